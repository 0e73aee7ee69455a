//! Routes see a request path the way backends resolve it: another spelling of an idempotent
//! route's path (`//orders`, `/x/../orders`, `/%6Frders`, `/orders;v=1`, `/orders%2F1`,
//! `/orders.json`, in origin-form or absolute-form) cannot skip the key check and run the
//! handler unprotected, and the request still reaches the backend exactly as the client sent
//! it.

mod common;

use common::proxy::Edit;
use common::{Backend, Proxy, ProxyBuilder, Request};

/// Spellings of `/orders` that backends resolve to it: dot-segments (Kestrel, Tomcat), merged
/// slashes and escaped unreserved characters (nginx, Go), path parameters (Tomcat, Jetty),
/// escaped slashes decoded into separators (WSGI servers, nginx's `$uri`), format suffixes
/// (Rails, Django REST framework, with a trailing slash too), a target that starts with two
/// slashes read as a network-path reference (Node's `new URL(req.url, base)`, Python's
/// `urlsplit`: `//x/orders` is host `x`, path `/orders`).
const BYPASSES: [&str; 25] = [
    "//x\\orders",
    "/\\x\\orders",
    "/orders.json/",
    "/orders.json%2F",
    "//x/orders",
    "//127.0.0.1:8080/orders",
    "/\\x/orders",
    "/orders%2F1",
    "/%2Forders",
    "/orders%5c1",
    "/orders.json",
    "/orders.",
    "/x/../orders",
    "/x\\..\\orders",
    "//orders",
    "/%6Frders",
    "/%6frders",
    "/orders;v=1",
    "/./orders",
    "/x/%2E%2E/orders",
    "/x/..;/orders",
    "//orders//1",
    "/orders/1/../2",
    "http://localhost/x/../orders",
    "http://localhost//orders;v=1",
];

/// The harness's routes (`/orders` idempotent with a required key) plus a forwarding `/` route
/// to the same upstream, so a path that misses `/orders` is forwarded rather than refused.
async fn setup() -> (Backend, Proxy) {
    let backend = Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend).start().await;
    proxy.edit_config(Edit::Rename, |yaml| {
        format!("{yaml}  - name: rest\n    path_prefix: /\n    upstream: orders\n")
    });
    proxy
        .metrics_containing("idemgate_config_reloads_total 1")
        .await;
    (backend, proxy)
}

#[tokio::test]
async fn other_spellings_of_an_idempotent_path_need_a_key() {
    let (backend, proxy) = setup().await;
    for path in BYPASSES {
        let response = Request::post(path).json("{}").send(proxy.addr).await;
        assert_eq!(response.status, 400, "{path}: {}", response.text());
        assert_eq!(response.problem_type(), "idempotency-key-missing", "{path}");
        assert_eq!(response.result(), Some("INVALID"), "{path}");
    }
    assert_eq!(backend.count(), 0, "no spelling reached the backend");
}

#[tokio::test]
async fn other_spellings_with_a_key_are_the_idempotent_route_and_forwarded_as_sent() {
    let (backend, proxy) = setup().await;
    for (n, path) in BYPASSES.iter().enumerate() {
        let request = Request::post(path).key(&format!("spelling-{n}")).json("{}");
        let first = request.send(proxy.addr).await;
        assert_eq!(first.status, 201, "{path}: {}", first.text());
        assert_eq!(first.result(), Some("MISS"), "{path}");
        let execution = backend.executions().pop().expect("executed");
        assert!(execution.execution_id.is_some(), "{path}: claimed");
        // The backend gets the target untouched: routing only looked at a normalised copy.
        let sent = path.strip_prefix("http://localhost").unwrap_or(path);
        assert_eq!(execution.path, sent, "{path}");
        // A retry is replayed, not executed again.
        let retry = request.send(proxy.addr).await;
        assert_eq!(retry.result(), Some("HIT"), "{path}");
        assert_eq!(retry.body, first.body, "{path}");
        assert_eq!(backend.count(), n + 1, "{path}");
    }
    // The same key under another spelling is another request (the fingerprint holds the path
    // as sent): refused, never executed a second time.
    let mismatch = Request::post("/orders")
        .key("spelling-0")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(mismatch.status, 422, "{}", mismatch.text());
    assert_eq!(mismatch.result(), Some("MISMATCH"));
    assert_eq!(backend.count(), BYPASSES.len());
}

#[tokio::test]
async fn ordinary_paths_route_as_before() {
    let (backend, proxy) = setup().await;
    let keyless = Request::post("/orders/1").json("{}").send(proxy.addr).await;
    assert_eq!(keyless.status, 400);
    assert_eq!(keyless.problem_type(), "idempotency-key-missing");
    let keyed = Request::post("/orders/1")
        .key("plain-1")
        .json("{}")
        .send(proxy.addr)
        .await;
    assert_eq!(keyed.result(), Some("MISS"));
    // Paths outside /orders, in any spelling, go to the `/` route untouched: no key needed, no
    // idempotency header. Case is not folded; a suffix is only a format on the last segment.
    for path in [
        "/elsewhere",
        "/ordersx",
        "/orders/../elsewhere",
        "/%6Frdersx",
        "/Orders",
        "/orders.json/x",
    ] {
        let response = Request::post(path).json("{}").send(proxy.addr).await;
        assert_eq!(response.status, 201, "{path}: {}", response.text());
        assert_eq!(response.result(), None, "{path}");
        assert_eq!(
            backend.executions().pop().expect("forwarded").path,
            path,
            "{path}: forwarded as sent"
        );
    }
    assert_eq!(backend.count(), 7);
}

#[tokio::test]
async fn a_target_that_is_no_path_is_refused_not_routed_as_the_root() {
    let (backend, proxy) = setup().await;
    // pingora reads each of these as the path `/` and would forward it as sent.
    for target in [
        "orders",
        "orders/1",
        "x/../orders",
        "%2Forders",
        "?x=1",
        "\\orders",
    ] {
        let response = Request::post(target).json("{}").send(proxy.addr).await;
        assert_eq!(response.status, 400, "{target}: {}", response.text());
        assert_eq!(response.problem_type(), "request-malformed", "{target}");
        assert_eq!(response.result(), None, "no route, no idempotency header");
        assert_eq!(response.header("connection"), Some("close"), "{target}");
    }
    assert_eq!(backend.count(), 0);
    // `OPTIONS *` is a target of its own and still forwarded (by the `/` route).
    let star = Request::new("OPTIONS", "*").send(proxy.addr).await;
    assert_ne!(star.status, 400, "{}", star.text());
}
