//! A backend that answers every request with scripted raw bytes, for upstream answers a
//! well-behaved HTTP library would never send: no length, both `Content-Length` and chunked,
//! 1xx before the final answer, trailers, a close in the middle of the body.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One step of the scripted answer.
#[derive(Clone, Debug)]
pub enum Step {
    /// Write these bytes.
    Send(Vec<u8>),
    /// Wait before the next step.
    Pause(Duration),
    /// Close the connection (after the steps so far); later steps are ignored.
    Close,
    /// Reset the connection (`SO_LINGER` 0, then close: the peer reads a reset, not an end).
    Reset,
}

/// The running backend. Every complete request it reads counts as one execution.
#[derive(Clone)]
pub struct RawBackend {
    pub addr: SocketAddr,
    executions: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    /// Connections the other side ended (or broke) while this one waited for a request.
    ended: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<String>>>,
    /// When each request was read, in order.
    read_at: Arc<Mutex<Vec<std::time::Instant>>>,
}

impl RawBackend {
    /// Starts on a free loopback port; each request on a connection gets `script`. Without a
    /// `Close` step the connection is kept for the next request.
    pub async fn start(script: Vec<Step>) -> RawBackend {
        RawBackend::start_sequence(vec![script]).await
    }

    /// Like [`RawBackend::start`], with the n-th request on each connection answered by
    /// `scripts[n]` (the last script for every request after).
    pub async fn start_sequence(scripts: Vec<Vec<Step>>) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        RawBackend::serve_on(listener, scripts, false)
    }

    /// A backend that reads only the head of the one request on each connection, never its
    /// body, answers with `script`, then drops the connection (with the body unread, its kernel
    /// resets it). Its receive buffer is small, so a large body cannot hide in it: the request
    /// goes out whole only if the backend reads it.
    pub async fn start_head_only(script: Vec<Step>) -> RawBackend {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("receive buffer");
        socket
            .bind("127.0.0.1:0".parse().expect("addr"))
            .expect("bind");
        RawBackend::serve_on(socket.listen(16).expect("listen"), vec![script], true)
    }

    fn serve_on(listener: TcpListener, scripts: Vec<Vec<Step>>, head_only: bool) -> RawBackend {
        let addr = listener.local_addr().expect("addr");
        let backend = RawBackend {
            addr,
            executions: Arc::new(AtomicUsize::new(0)),
            connections: Arc::new(AtomicUsize::new(0)),
            ended: Arc::new(AtomicUsize::new(0)),
            heads: Arc::new(Mutex::new(Vec::new())),
            read_at: Arc::new(Mutex::new(Vec::new())),
        };
        let b = backend.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                // Each scripted write goes out as written (a head sent a byte at a time is one).
                let _ = stream.set_nodelay(true);
                b.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, scripts.clone(), b.clone(), head_only));
            }
        });
        backend
    }

    /// Requests read so far.
    pub fn count(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    /// When the first request was read (its script starts then), once one was.
    #[allow(dead_code)]
    pub fn first_read_at(&self) -> Option<std::time::Instant> {
        self.read_at.lock().expect("read_at").first().copied()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Connections the proxy closed while they waited for its next request.
    #[allow(dead_code)]
    pub fn ended(&self) -> usize {
        self.ended.load(Ordering::SeqCst)
    }

    /// The raw heads (request line and headers) of the requests read so far.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().expect("heads").clone()
    }
}

async fn serve(
    mut stream: TcpStream,
    scripts: Vec<Vec<Step>>,
    backend: RawBackend,
    head_only: bool,
) {
    let mut buf = Vec::new();
    for n in 0.. {
        let head = if head_only {
            if n > 0 {
                return;
            }
            read_head(&mut stream, &mut buf).await.map(|(head, _)| head)
        } else {
            read_raw_request(&mut stream, &mut buf)
                .await
                .map(|(head, _)| head)
        };
        let Some(head) = head else {
            backend.ended.fetch_add(1, Ordering::SeqCst);
            return;
        };
        backend.heads.lock().expect("heads").push(head);
        backend
            .read_at
            .lock()
            .expect("read_at")
            .push(std::time::Instant::now());
        backend.executions.fetch_add(1, Ordering::SeqCst);
        let script = &scripts[n.min(scripts.len() - 1)];
        for step in script {
            match step {
                Step::Send(bytes) => {
                    if stream.write_all(bytes).await.is_err() {
                        return;
                    }
                }
                Step::Pause(d) => tokio::time::sleep(*d).await,
                Step::Close => {
                    let _ = stream.shutdown().await;
                    return;
                }
                Step::Reset => {
                    let _ = stream.set_zero_linger();
                    return;
                }
            }
        }
    }
}

/// Reads one request with a `Content-Length` body (idemgate always sends one upstream) from
/// `stream`, keeping bytes of the next request in `buf`. Returns its headers, lower-case names
/// and trimmed values; `None` at EOF, on a read error or a head over 64 KiB.
pub async fn read_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Option<Vec<(String, String)>> {
    read_raw_request(stream, buf)
        .await
        .map(|(_, headers)| headers)
}

/// [`read_request`], also returning the raw head as received.
pub async fn read_raw_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, Vec<(String, String)>)> {
    let (head, head_end) = read_head(stream, buf).await?;
    let headers: Vec<(String, String)> = head
        .split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        read_more(stream, buf).await?;
    }
    buf.drain(..head_end + length);
    Some((head, headers))
}

/// Reads until `buf` holds a whole request head; returns it and where it ends in `buf`.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, usize)> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 64 * 1024 {
            return None;
        }
        read_more(stream, buf).await?;
    };
    Some((
        String::from_utf8_lossy(&buf[..head_end]).into_owned(),
        head_end,
    ))
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}
