//! The config loader: YAML text -> file structs -> validated `Config`.
//!
//! Any text must give `Ok` or `Err`, never a panic (the live reloader feeds it whatever an
//! operator saves). A config that validates must then be usable: route matching answers for any
//! request with indices that exist, a route's own prefix reaches that route or an earlier one,
//! and every status code has an answer. Upstream addresses are checked by shape only (no DNS).
#![no_main]

use http::Method;
use idemgate::config::RouteMatch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Config::load reads the file as UTF-8, so nothing else reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = idemgate::fuzzing::config_from_yaml(text) else {
        return;
    };

    let methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
    ];
    let check = |method: &Method, path: &str| -> Option<usize> {
        match config.match_route(method, path) {
            RouteMatch::Idempotent(i) => {
                assert!(config.routes[i].idempotency.is_some());
                Some(i)
            }
            RouteMatch::Forward { route, upstream } => {
                assert!(upstream < config.upstreams.len());
                if let Some(i) = route {
                    assert!(i < config.routes.len());
                }
                route
            }
            RouteMatch::NoRoute => {
                assert!(config.default_upstream.is_none());
                None
            }
        }
    };
    for method in &methods {
        for path in ["/", "", "/x", "//", "/orders/1"] {
            check(method, path);
        }
    }
    for (i, route) in config.routes.iter().enumerate() {
        assert!(route.upstream < config.upstreams.len());
        let method = route.methods.first().cloned().unwrap_or(Method::POST);
        let hit = check(&method, &route.path_prefix);
        assert!(
            hit.is_some_and(|j| j <= i),
            "route {i} unreachable by its own prefix"
        );
        let below = format!("{}/x", route.path_prefix.trim_end_matches('/'));
        check(&method, &below);
        if let Some(idem) = &route.idempotency {
            assert!(idem.lock_ttl <= idem.ttl);
            for status in 0..=1000u16 {
                let stored = idem.cache_statuses.contains(status);
                if stored {
                    assert!((200..=599).contains(&status), "{status} stored");
                }
            }
        }
    }
    if let Some(d) = config.default_upstream {
        assert!(d < config.upstreams.len());
    }
    let _ = format!("{config:?}");
});
