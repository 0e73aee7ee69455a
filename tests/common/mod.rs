//! Test harness: a real counting backend, the real `idemgate` binary, and a raw HTTP/1.1 client.
#![allow(dead_code, unused_imports)]

pub mod backend;
pub mod client;
pub mod faultproxy;
pub mod proxy;
pub mod rawbackend;
pub mod redis;
pub mod soak_backend;
pub mod tcp;
pub mod tls;

pub use backend::Backend;
pub use client::{Request, Response};
pub use proxy::{Proxy, ProxyBuilder};

/// Runs a command (its input closed) and panics, with what it printed, unless it succeeds.
pub fn run_ok(cmd: &mut std::process::Command) {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {cmd:?} (is it installed?): {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of the sample `name` (no labels) in a Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// `idemgate_key_outcomes_total` of `route` for `outcome` in a `/metrics` text.
pub fn key_outcome(text: &str, route: &str, outcome: &str) -> Option<f64> {
    metric(
        text,
        &format!("idemgate_key_outcomes_total{{outcome=\"{outcome}\",route=\"{route}\"}}"),
    )
}

/// What a POST to `/orders` without a key gets: `INVALID` while the harness's `orders` route
/// requires a key, `BYPASS` once an edit made it optional.
pub async fn no_key_result(proxy: &Proxy) -> Option<String> {
    Request::post("/orders")
        .body("{}")
        .send(proxy.addr)
        .await
        .result()
        .map(str::to_string)
}
