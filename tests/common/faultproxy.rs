//! A TCP fault proxy for tests: listens on a free loopback port and relays every connection to a
//! target (e.g. Redis), applying the fault in force, switchable at run time:
//!
//! - [`Fault::Pass`]: bytes flow untouched.
//! - [`Fault::Delay`]: every chunk is delivered that long after it was read, in both directions
//!   (a pipe with latency: chunks keep their order and do not queue behind each other's delay).
//! - [`Fault::Hold`]: a partition. Nothing is delivered and new connections are accepted but not
//!   relayed; bytes are kept, not dropped, and flow again when the fault ends, as TCP
//!   retransmission would deliver them. (Dropping bytes on a live connection would desync any
//!   pipelined protocol in a way no real network does.)
//! - [`Fault::Reset`]: every relayed connection is aborted with RST (`SO_LINGER` 0) on both
//!   sides, and new connections are reset as soon as they are accepted.
//!
//! Apart from the fault, [`FaultProxy::strand`] silences the connections open at that moment
//! for good (a NAT or load balancer that dropped their flows: no FIN, no RST, nothing
//! delivered either way), while new connections are relayed as usual.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The fault applied to relayed traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    Hold,
    Reset,
}

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct FaultStats {
    pub accepted: AtomicU64,
    pub reset: AtomicU64,
}

/// A running fault proxy; stops accepting when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    /// Where new connections are relayed to ([`FaultProxy::retarget`]).
    target: watch::Sender<SocketAddr>,
    mode: watch::Sender<Fault>,
    /// Bumped by [`FaultProxy::strand`]; a relay accepted under an older value is silent.
    strands: watch::Sender<u64>,
    pub stats: Arc<FaultStats>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts relaying a free loopback port to `target`, passing traffic untouched.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fault proxy");
        let addr = listener.local_addr().expect("fault proxy addr");
        let (mode, rx) = watch::channel(Fault::Pass);
        let (strands, stranded) = watch::channel(0u64);
        let (targets, target_now) = watch::channel(target);
        let stats = Arc::new(FaultStats::default());
        let accept = tokio::spawn({
            let stats = stats.clone();
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    stats.accepted.fetch_add(1, Ordering::Relaxed);
                    let born = Strand {
                        at: *stranded.borrow(),
                        now: stranded.clone(),
                    };
                    let target = *target_now.borrow();
                    tokio::spawn(relay(client, target, rx.clone(), born, stats.clone()));
                }
            }
        });
        FaultProxy {
            addr,
            target: targets,
            mode,
            strands,
            stats,
            accept,
        }
    }

    /// Silences every connection open now, for good: nothing more is delivered on them either
    /// way and they stay open. Connections made afterwards are relayed as usual.
    pub fn strand(&self) {
        self.strands.send_modify(|n| *n += 1);
    }

    /// Relays connections made from now on to `to`, as a DNS name or a virtual IP moved to
    /// another server does; connections open now stay with the server they reach.
    pub fn retarget(&self, to: SocketAddr) {
        self.target.send_replace(to);
    }

    /// `redis://<addr>`: the proxy's address as a Redis URL.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Switches the fault for live and new connections.
    pub fn set(&self, fault: Fault) {
        self.mode.send_replace(fault);
    }

    /// The fault in force.
    pub fn fault(&self) -> Fault {
        *self.mode.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Live relays end too: a reset is the one fault every relay obeys at once.
        self.mode.send_replace(Fault::Reset);
    }
}

/// The strand count a relay was accepted under, and the proxy's current one.
#[derive(Clone)]
struct Strand {
    at: u64,
    now: watch::Receiver<u64>,
}

impl Strand {
    fn stranded(&self) -> bool {
        *self.now.borrow() > self.at
    }
}

/// How one direction of a relay ended.
enum End {
    Closed,
    Reset,
}

async fn relay(
    mut client: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<Fault>,
    strand: Strand,
    stats: Arc<FaultStats>,
) {
    // A new connection during a partition hangs (connected, nothing relayed) until it heals.
    loop {
        let fault = *mode.borrow_and_update();
        match fault {
            Fault::Reset => return abort(&client, None, &stats),
            Fault::Hold => {
                if mode.changed().await.is_err() {
                    return;
                }
            }
            Fault::Pass | Fault::Delay(_) => break,
        }
    }
    let Ok(mut upstream) = TcpStream::connect(target).await else {
        // The target is down: the client sees its connection refused, as it would directly.
        return abort(&client, None, &stats);
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let end = {
        let (cr, cw) = client.split();
        let (ur, uw) = upstream.split();
        tokio::select! {
            end = pipe(cr, uw, mode.clone(), strand.clone()) => end,
            end = pipe(ur, cw, mode.clone(), strand.clone()) => end,
        }
    };
    match end {
        End::Reset => abort(&client, Some(&upstream), &stats),
        // One side closed: close the other (dropping both sends FIN).
        End::Closed => {}
    }
}

fn abort(client: &TcpStream, upstream: Option<&TcpStream>, stats: &FaultStats) {
    stats.reset.fetch_add(1, Ordering::Relaxed);
    let _ = client.set_zero_linger();
    if let Some(up) = upstream {
        let _ = up.set_zero_linger();
    }
    // The caller drops the streams right after: with linger 0 that close is an RST.
}

/// Relays one direction: a reader stamps chunks as they arrive, a writer delivers each one when
/// the fault in force allows.
async fn pipe(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    mode: watch::Receiver<Fault>,
    strand: Strand,
) -> End {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let mut read_mode = mode.clone();
    // Both halves own what they use: when the reader ends, its sender is dropped and the writer
    // delivers what is queued, then ends.
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                read = from.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return End::Closed,
                    Ok(n) => {
                        if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                            return End::Closed;
                        }
                    }
                },
                _ = until_reset(&mut read_mode) => return End::Reset,
            }
        }
    };
    let mut write_mode = mode;
    let writer = async move {
        while let Some((read_at, chunk)) = rx.recv().await {
            if strand.stranded() {
                // Silent until the proxy goes (its drop resets every relay).
                until_reset(&mut write_mode).await;
                return End::Reset;
            }
            loop {
                let fault = *write_mode.borrow_and_update();
                match fault {
                    Fault::Pass => break,
                    Fault::Delay(d) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(read_at + d) => break,
                            _ = until_reset(&mut write_mode) => return End::Reset,
                        }
                    }
                    Fault::Hold => {
                        if write_mode.changed().await.is_err() {
                            return End::Closed;
                        }
                    }
                    Fault::Reset => return End::Reset,
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return End::Closed;
            }
        }
        End::Closed
    };
    // The reader ending with Closed must still let queued chunks out (a reply followed by FIN);
    // a reset ends both at once.
    tokio::pin!(reader, writer);
    tokio::select! {
        end = &mut writer => end,
        end = &mut reader => match end {
            End::Reset => End::Reset,
            End::Closed => writer.await,
        },
    }
}

/// Resolves once the fault is `Reset` (never, if the proxy is gone without one).
async fn until_reset(mode: &mut watch::Receiver<Fault>) {
    loop {
        if *mode.borrow_and_update() == Fault::Reset {
            return;
        }
        if mode.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}
