//! Quick start: a demo order service on 127.0.0.1:8080 and idemgate on 127.0.0.1:6180 in front
//! of it, in one command: `cargo run --release --example demo`.
//!
//! The order service prints every order it really creates, so a replayed retry is visible as
//! the absence of a line. `POST /orders/slow` takes two seconds (to see a 409), and
//! `POST /orders/fail` answers 503 (to see a released key executed again).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

const BACKEND: &str = "127.0.0.1:8080";

async fn order_service(orders: Arc<AtomicU64>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let exec_id = req
        .headers()
        .get("x-idempotency-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if method != hyper::Method::POST {
        return json(
            200,
            format!("{{\"orders_created\":{}}}", orders.load(Ordering::SeqCst)),
        );
    }
    if path.ends_with("/slow") {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    if path.ends_with("/fail") {
        println!("order-service: failing {path} (execution {exec_id}) with 503");
        return json(503, "{\"error\":\"temporarily unavailable\"}".into());
    }
    let n = orders.fetch_add(1, Ordering::SeqCst) + 1;
    println!(
        "order-service: created order ord_{n} (execution {exec_id}, {} body bytes)",
        body.len()
    );
    json(
        201,
        format!("{{\"id\":\"ord_{n}\",\"status\":\"created\"}}"),
    )
}

fn json(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn start_order_service() {
    let orders = Arc::new(AtomicU64::new(0));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let Ok(rt) = rt else {
            eprintln!("demo: cannot start the order service runtime");
            std::process::exit(1);
        };
        rt.block_on(async move {
            let listener = match tokio::net::TcpListener::bind(BACKEND).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("demo: cannot listen on {BACKEND}: {e}");
                    std::process::exit(1);
                }
            };
            println!("order-service: listening on http://{BACKEND}");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let orders = orders.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let orders = orders.clone();
                        async move { Ok::<_, Infallible>(order_service(orders, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    });
}

fn main() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.yaml");
    let config = match idemgate::config::Config::load(std::path::Path::new(path)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(64);
        }
    };
    start_order_service();
    // Colour codes only at a terminal, as the idemgate binary does.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    println!("idemgate: proxying http://127.0.0.1:6180 -> http://{BACKEND} (admin http://127.0.0.1:6181)");
    if let Err(e) = idemgate::server::run(path.into(), config, || {}) {
        eprintln!("demo: {e}");
        std::process::exit(64);
    }
}
