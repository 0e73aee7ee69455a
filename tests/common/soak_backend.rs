//! The chaos soak's backend: a raw HTTP/1.1 server (keep-alive, `Content-Length` bodies) that
//! records every execution — key, `X-Idempotency-Id`, the soak's request id, arrival time, and
//! how the backend chose to end it — and fails on purpose at rates set at run time:
//!
//! - **error**: answers 500, 503 or 429 (statuses idemgate releases), after up to 300 ms;
//! - **late**: answers 201 only after `late_by`, past the proxy's upstream read timeout;
//! - **reset**: aborts the connection with RST, either before any byte of the answer or after
//!   the header and part of the body.
//!
//! Otherwise it answers 201 after up to 400 ms, with a JSON body naming the key and the
//! execution, so a replay can be traced back to the execution it replays.
//!
//! The backend decides the faults itself (rather than a fault proxy in front of it) so the
//! record says exactly which executions' answers were cut off or late.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the backend ended one execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// The whole answer was written at once.
    Answered(u16),
    /// The answer was written only after `late_by` (the proxy had given up reading).
    Late(u16),
    /// The connection was reset; `after_head`: after the header and part of the body.
    Reset { after_head: bool },
}

/// One execution: a request that reached the backend whole.
#[derive(Clone, Debug)]
pub struct Execution {
    /// Execution number, from 1, in arrival order.
    pub seq: u64,
    /// The `Idempotency-Key` header as received.
    pub key: String,
    /// The `X-Idempotency-Id` header, if any.
    pub execution_id: Option<String>,
    /// The soak's request id (`X-Soak-Req`), if any.
    pub request: Option<u64>,
    /// When the request was read whole, since the backend's epoch.
    pub arrived: Duration,
    /// When the answer started being written (late answers: after the delay); `None` for a
    /// reset before any byte.
    pub answered: Option<Duration>,
    pub fate: Fate,
}

/// Probabilities (0.0..=1.0) of each fault per execution.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    pub error: f64,
    pub late: f64,
    pub reset: f64,
}

struct State {
    executions: Vec<Execution>,
    faults: Faults,
    rng: StdRng,
}

/// The running backend.
#[derive(Clone)]
pub struct SoakBackend {
    pub addr: SocketAddr,
    /// Time zero of every recorded instant.
    pub epoch: Instant,
    /// How long a late answer waits.
    pub late_by: Duration,
    state: Arc<Mutex<State>>,
}

/// A parsed request.
struct Incoming {
    headers: Vec<(String, String)>,
}

impl Incoming {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl SoakBackend {
    /// Starts on a free loopback port with no faults; `seed` drives the fault choices.
    pub async fn start(epoch: Instant, late_by: Duration, seed: u64) -> SoakBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind soak backend");
        let backend = SoakBackend {
            addr: listener.local_addr().expect("soak backend addr"),
            epoch,
            late_by,
            state: Arc::new(Mutex::new(State {
                executions: Vec::new(),
                faults: Faults::default(),
                rng: StdRng::seed_from_u64(seed),
            })),
        };
        let b = backend.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(b.clone().serve(stream));
            }
        });
        backend
    }

    /// Sets the fault rates for executions from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.state.lock().unwrap().faults = faults;
    }

    /// Every execution so far, in arrival order.
    pub fn executions(&self) -> Vec<Execution> {
        self.state.lock().unwrap().executions.clone()
    }

    /// Records an execution and decides its fate and how long to take.
    fn admit(&self, req: &Incoming) -> (u64, Fate, Duration) {
        let arrived = self.epoch.elapsed();
        let mut st = self.state.lock().unwrap();
        let faults = st.faults;
        let roll: f64 = st.rng.gen();
        let (fate, pause) = if roll < faults.reset {
            let after_head = st.rng.gen_bool(0.5);
            (Fate::Reset { after_head }, Duration::ZERO)
        } else if roll < faults.reset + faults.late {
            (Fate::Late(201), self.late_by)
        } else if roll < faults.reset + faults.late + faults.error {
            let status = [500, 503, 429][st.rng.gen_range(0..3)];
            let pause = Duration::from_millis(st.rng.gen_range(0..=300));
            (Fate::Answered(status), pause)
        } else {
            (
                Fate::Answered(201),
                Duration::from_millis(st.rng.gen_range(0..=400)),
            )
        };
        let seq = st.executions.len() as u64 + 1;
        st.executions.push(Execution {
            seq,
            key: req
                .header("idempotency-key")
                .unwrap_or_default()
                .to_string(),
            execution_id: req.header("x-idempotency-id").map(str::to_string),
            request: req.header("x-soak-req").and_then(|v| v.parse().ok()),
            arrived,
            answered: None,
            fate,
        });
        (seq, fate, pause)
    }

    fn mark_answered(&self, seq: u64) {
        let at = self.epoch.elapsed();
        let mut st = self.state.lock().unwrap();
        if let Some(e) = st.executions.get_mut(seq as usize - 1) {
            e.answered = Some(at);
        }
    }

    async fn serve(self, mut stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let mut buf = Vec::new();
        while let Some(req) = read_request(&mut stream, &mut buf).await {
            let (seq, fate, pause) = self.admit(&req);
            let key = req
                .header("idempotency-key")
                .unwrap_or_default()
                .to_string();
            tokio::time::sleep(pause).await;
            match fate {
                Fate::Answered(status) | Fate::Late(status) => {
                    self.mark_answered(seq);
                    let body = format!("{{\"key\":\"{key}\",\"exec\":{seq},\"status\":{status}}}");
                    let head = format!(
                        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nx-exec: {seq}\r\n\r\n",
                        reason(status),
                        body.len()
                    );
                    let mut out = head.into_bytes();
                    out.extend_from_slice(body.as_bytes());
                    if stream.write_all(&out).await.is_err() {
                        return;
                    }
                }
                Fate::Reset { after_head } => {
                    if after_head {
                        self.mark_answered(seq);
                        let partial = "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\
                                       content-length: 64\r\n\r\n{\"key\":";
                        let _ = stream.write_all(partial.as_bytes()).await;
                        // Let the partial answer reach the proxy before the reset discards it.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let _ = stream.set_zero_linger();
                    return;
                }
            }
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        201 => "Created",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Reads one request (head and `Content-Length` body); `None` at end of stream or on garbage.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Incoming> {
    let headers = super::rawbackend::read_request(stream, buf).await?;
    Some(Incoming { headers })
}
