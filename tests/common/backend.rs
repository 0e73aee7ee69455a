//! A real HTTP/1.1 backend on port 0 that records every execution and answers by path.
//!
//! Paths (after any prefix): `/binary`, `/chunked`, `/empty`, `/status/NNN`, `/flaky/N` (first N
//! executions per `X-Idempotency-Id` answer 503), `/slow/MS`, `/gate/NAME` (answers once the
//! test calls [`Backend::open`] with `NAME`), `/large/BYTES`, `/echo`; anything else answers 201
//! JSON with the execution number.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// One execution as the backend saw it.
#[derive(Clone, Debug)]
pub struct Execution {
    pub method: String,
    pub path: String,
    pub execution_id: Option<String>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

#[derive(Default)]
struct State {
    executions: Vec<Execution>,
    gates: std::collections::HashMap<String, Arc<Gate>>,
}

/// What requests to `/gate/NAME` wait on.
#[derive(Default)]
struct Gate {
    open: std::sync::atomic::AtomicBool,
    opened: tokio::sync::Notify,
}

/// The running backend.
#[derive(Clone)]
pub struct Backend {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

impl Backend {
    /// Starts the backend on a free loopback port, in the background.
    pub async fn start() -> Backend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("backend addr");
        let backend = Backend {
            addr,
            state: Arc::default(),
        };
        let b = backend.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let b = b.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let b = b.clone();
                        async move { Ok::<_, Infallible>(b.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        backend
    }

    /// Every execution so far.
    pub fn executions(&self) -> Vec<Execution> {
        self.state.lock().unwrap().executions.clone()
    }

    /// Lets the requests to `/gate/NAME` answer, those waiting and those to come: a test holds
    /// an execution at the backend for as long as it needs (to break the store under it), on a
    /// machine of any speed.
    #[allow(dead_code)]
    pub fn open(&self, name: &str) {
        let gate = self.gate(name);
        gate.open.store(true, std::sync::atomic::Ordering::SeqCst);
        gate.opened.notify_waiters();
    }

    fn gate(&self, name: &str) -> Arc<Gate> {
        let mut st = self.state.lock().unwrap();
        st.gates.entry(name.to_owned()).or_default().clone()
    }

    /// Panics unless every execution id ran once (no key twice, no id under two keys), naming
    /// the `Idempotency-Key`s under an id that ran more; returns how many ids ran.
    pub fn assert_each_id_ran_once(&self) -> usize {
        let mut keys_of_id: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for e in self.executions() {
            let key = e
                .headers
                .iter()
                .find(|(name, _)| name == "idempotency-key")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
            keys_of_id
                .entry(e.execution_id.expect("every execution carries its id"))
                .or_default()
                .push(key.unwrap_or_default());
        }
        let twice: Vec<_> = keys_of_id
            .iter()
            .filter(|(_, keys)| keys.len() > 1)
            .collect();
        assert!(
            twice.is_empty(),
            "ids that ran more than once (keys): {twice:?}"
        );
        keys_of_id.len()
    }

    /// How many requests reached the backend.
    pub fn count(&self) -> usize {
        self.state.lock().unwrap().executions.len()
    }

    /// Waits until `n` requests have reached the backend (10 s at most): a request sent in the
    /// background has been claimed and forwarded, on a machine of any speed.
    pub async fn until_count(&self, n: usize) {
        let started = std::time::Instant::now();
        while self.count() < n {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the backend saw {} requests, not {n}",
                self.count()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().to_string();
        let path = req.uri().path().to_string();
        let headers: Vec<(String, Vec<u8>)> = req
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect();
        let execution_id = req
            .headers()
            .get("x-idempotency-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes().to_vec())
            .unwrap_or_default();
        let (n, same_id) = {
            let mut st = self.state.lock().unwrap();
            let same_id = st
                .executions
                .iter()
                .filter(|e| execution_id.is_some() && e.execution_id == execution_id)
                .count();
            st.executions.push(Execution {
                method,
                path: path.clone(),
                execution_id,
                headers,
                body: body.clone(),
            });
            (st.executions.len(), same_id)
        };
        let seg: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let find = |name: &str| {
            seg.iter()
                .position(|s| *s == name)
                .and_then(|i| seg.get(i + 1))
                .copied()
        };
        if let Some(ms) = find("slow").and_then(|v| v.parse::<u64>().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if let Some(name) = find("gate") {
            let gate = self.gate(name);
            loop {
                // Made before the look, so an `open` in between is not missed.
                let opened = gate.opened.notified();
                if gate.open.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                opened.await;
            }
        }
        let mut resp = Response::builder();
        if seg.contains(&"binary") {
            let body: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
            return resp
                .status(200)
                .header("content-type", "application/octet-stream")
                .body(full(body))
                .unwrap();
        }
        if seg.contains(&"chunked") {
            let frames =
                (0..5).map(|i| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("part-{i};")))));
            let body = BodyExt::boxed(chunk_frames(frames.collect()));
            return resp
                .status(200)
                .header("content-type", "text/plain")
                .body(body)
                .unwrap();
        }
        if seg.contains(&"empty") {
            return resp
                .status(200)
                .header("x-empty", "yes")
                .body(full(Bytes::new()))
                .unwrap();
        }
        if let Some(code) = find("status").and_then(|v| v.parse::<u16>().ok()) {
            return resp
                .status(code)
                .header("content-type", "application/json")
                .body(full(format!("{{\"status\":{code},\"n\":{n}}}")))
                .unwrap();
        }
        if let Some(times) = find("flaky").and_then(|v| v.parse::<usize>().ok()) {
            if same_id < times {
                return resp.status(503).body(full("try again")).unwrap();
            }
        }
        if let Some(len) = find("large").and_then(|v| v.parse::<usize>().ok()) {
            let body: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            return resp
                .status(200)
                .header("content-type", "text/plain")
                .body(full(body))
                .unwrap();
        }
        if seg.contains(&"echo") {
            return resp
                .status(200)
                .header("content-type", "application/octet-stream")
                .body(full(body))
                .unwrap();
        }
        resp = resp
            .status(201)
            .header("content-type", "application/json")
            .header("x-backend", "orders")
            .header("set-cookie", "session=abc")
            .header("x-multi", "one")
            .header("x-multi", "two");
        resp.body(full(format!("{{\"order\":{n},\"bytes\":{}}}", body.len())))
            .unwrap()
    }
}

/// A body of several data frames with no declared length, so it goes out chunked.
fn chunk_frames(
    frames: Vec<Result<Frame<Bytes>, Infallible>>,
) -> impl hyper::body::Body<Data = Bytes, Error = Infallible> + Send + Sync + 'static {
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    struct Frames(VecDeque<Result<Frame<Bytes>, Infallible>>);
    impl hyper::body::Body for Frames {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front())
        }
    }
    Frames(frames.into())
}
