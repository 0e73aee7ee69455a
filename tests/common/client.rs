//! A raw HTTP/1.1 client over real sockets, so tests control every byte they send.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A request under construction.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Send the body chunked (no Content-Length), in pieces of this size.
    pub chunked: Option<usize>,
}

impl Request {
    pub fn new(method: &str, path: &str) -> Self {
        Request {
            method: method.into(),
            path: path.into(),
            headers: vec![],
            body: vec![],
            chunked: None,
        }
    }
    pub fn post(path: &str) -> Self {
        Self::new("POST", path)
    }
    pub fn get(path: &str) -> Self {
        Self::new("GET", path)
    }
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.into(), value.as_ref().to_vec()));
        self
    }
    pub fn key(self, key: &str) -> Self {
        self.header("Idempotency-Key", key)
    }
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }
    pub fn json(self, body: &str) -> Self {
        self.header("Content-Type", "application/json")
            .body(body.as_bytes().to_vec())
    }
    pub fn chunked(mut self, piece: usize) -> Self {
        self.chunked = Some(piece);
        self
    }

    /// The request's bytes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nHost: localhost\r\n",
            self.method, self.path
        )
        .into_bytes();
        for (n, v) in &self.headers {
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        match self.chunked {
            Some(piece) => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for c in self.body.chunks(piece.max(1)) {
                    out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                    out.extend_from_slice(c);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\n\r\n");
            }
            None => {
                let has_len = self
                    .headers
                    .iter()
                    .any(|(n, _)| n.eq_ignore_ascii_case("content-length"));
                if !has_len && (!self.body.is_empty() || self.method == "POST") {
                    out.extend_from_slice(
                        format!("Content-Length: {}\r\n", self.body.len()).as_bytes(),
                    );
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&self.body);
            }
        }
        out
    }

    /// [`Request::send`] in the background: the answer is the task's result.
    #[allow(dead_code)]
    pub fn spawn_send(&self, addr: SocketAddr) -> tokio::task::JoinHandle<Response> {
        let req = self.clone();
        tokio::spawn(async move { req.send(addr).await })
    }

    /// Sends on a fresh connection and reads the whole response.
    pub async fn send(&self, addr: SocketAddr) -> Response {
        let mut stream = TcpStream::connect(addr).await.expect("connect to proxy");
        stream
            .write_all(&self.to_bytes())
            .await
            .expect("write request");
        read_response(&mut stream, self.method == "HEAD")
            .await
            .expect("read response")
    }
}

/// A parsed response.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// Lower-cased names, raw values, in wire order.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Whether the body came chunked.
    pub chunked: bool,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
    pub fn headers_named(&self, name: &str) -> Vec<&[u8]> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }
    pub fn result(&self) -> Option<&str> {
        self.header("x-idempotent-result")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem json");
        v["type"]
            .as_str()
            .unwrap_or_default()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string()
    }
    /// Headers minus the ones a replay legitimately changes.
    pub fn end_to_end_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(n, _)| {
                !matches!(
                    n.as_str(),
                    "date"
                        | "content-length"
                        | "transfer-encoding"
                        | "connection"
                        | "keep-alive"
                        | "x-idempotent-result"
                        | "idempotent-replayed"
                )
            })
            .cloned()
            .collect()
    }
}

async fn read_until_headers(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(pos + 4);
        }
        let mut chunk = vec![0u8; 8192];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "eof before headers",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, want: usize) -> std::io::Result<()> {
    while buf.len() < want {
        let mut chunk = vec![0u8; 65536];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "eof in body",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// Everything the proxy sends on `s` until it closes the connection, which it must within 5 s.
pub async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("the proxy closed the connection");
    got
}

/// Sends `request`, bytes as they are, on a new connection to `addr` and reads one response.
pub async fn send_raw(addr: SocketAddr, request: &[u8]) -> Response {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("send");
    read_response(&mut stream, false).await.expect("response")
}

/// Reads one response (skipping 1xx) from `stream`.
pub async fn read_response(stream: &mut TcpStream, head: bool) -> std::io::Result<Response> {
    let fut = async {
        let mut buf = Vec::new();
        loop {
            let end = read_until_headers(stream, &mut buf).await?;
            let head_text = String::from_utf8_lossy(&buf[..end]).into_owned();
            let mut lines = head_text.split("\r\n");
            let status_line = lines.next().unwrap_or_default();
            let status: u16 = status_line
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let mut headers = Vec::new();
            for line in lines.filter(|l| !l.is_empty()) {
                if let Some((n, v)) = line.split_once(':') {
                    headers.push((n.trim().to_ascii_lowercase(), v.trim().as_bytes().to_vec()));
                }
            }
            buf.drain(..end);
            if (100..200).contains(&status) {
                continue;
            }
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            };
            // Chunked when it is the last coding listed (`gzip, chunked` too).
            let chunked = get("transfer-encoding").is_some_and(|v| {
                v.rsplit(',')
                    .map(str::trim)
                    .find(|c| !c.is_empty())
                    .is_some_and(|c| c.eq_ignore_ascii_case("chunked"))
            });
            let mut body = Vec::new();
            if head || status == 204 || status == 304 {
            } else if chunked {
                loop {
                    let line_end = loop {
                        if let Some(p) = buf.windows(2).position(|w| w == b"\r\n") {
                            break p;
                        }
                        let want = buf.len() + 1;
                        fill(stream, &mut buf, want).await?;
                    };
                    let size_text = String::from_utf8_lossy(&buf[..line_end]).into_owned();
                    let size =
                        usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                            .map_err(|_| {
                                std::io::Error::new(std::io::ErrorKind::InvalidData, "chunk size")
                            })?;
                    buf.drain(..line_end + 2);
                    if size == 0 {
                        // Trailers (if any) end with an empty line.
                        loop {
                            let p = loop {
                                if let Some(p) = buf.windows(2).position(|w| w == b"\r\n") {
                                    break p;
                                }
                                let want = buf.len() + 1;
                                fill(stream, &mut buf, want).await?;
                            };
                            buf.drain(..p + 2);
                            if p == 0 {
                                break;
                            }
                        }
                        break;
                    }
                    fill(stream, &mut buf, size + 2).await?;
                    body.extend_from_slice(&buf[..size]);
                    buf.drain(..size + 2);
                }
            } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
                fill(stream, &mut buf, len).await?;
                body = buf[..len].to_vec();
            } else {
                // Close-delimited.
                let mut rest = Vec::new();
                stream.read_to_end(&mut rest).await?;
                buf.extend_from_slice(&rest);
                body = std::mem::take(&mut buf);
            }
            return Ok(Response {
                status,
                headers,
                body,
                chunked,
            });
        }
    };
    tokio::time::timeout(Duration::from_secs(30), Box::pin(fut))
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "response timeout",
            ))
        })
}

/// Reads what the listener at `addr` sends while the request header is trickled a byte every
/// 100 ms (40 at most), until it closes. Returns the bytes, how long after the first header byte the
/// connection closed, and how many trickled bytes went out.
pub async fn trickle_header(addr: SocketAddr, start: &[u8]) -> (Vec<u8>, Duration, usize) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    // Before the write: the listener's clock starts once it reads the first byte, never
    // before this.
    let started = std::time::Instant::now();
    s.write_all(start).await.unwrap();
    let (mut got, mut buf, mut sent) = (Vec::new(), [0u8; 4096], 0);
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still open after 10 s and {sent} trickled bytes"
        );
        tokio::select! {
            n = s.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            },
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                if sent < 40 && s.write_all(b"a").await.is_ok() {
                    sent += 1;
                }
            }
        }
    }
    (got, started.elapsed(), sent)
}

/// Whether `addr` refuses a new connection before `task` ends, trying every 20 ms for 10 s at
/// most: a listener closed while a request it took still runs (a drain).
pub async fn refused_while<T>(addr: SocketAddr, task: &tokio::task::JoinHandle<T>) -> bool {
    let started = std::time::Instant::now();
    while !task.is_finished() && started.elapsed() < Duration::from_secs(10) {
        if TcpStream::connect(addr).await.is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
