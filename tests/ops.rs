//! Operations under outside trouble: a config edit refused for something outside the file goes
//! live once that is fixed, and `/readyz` answers a probe in time while Redis hangs when the
//! outage policy lets requests through.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Edit;
use common::{metric, no_key_result, Backend, ProxyBuilder, Request};

#[tokio::test]
async fn an_edit_refused_for_a_missing_script_version_goes_live_once_the_version_appears() {
    let backend = Backend::start().await;
    // The memory store still checks a store.redis block: its script versions must exist.
    let scripts = tempfile::tempdir().expect("scripts dir");
    let mut proxy = ProxyBuilder::new(&backend)
        .store("redis:")
        .scripts(scripts.path(), "v1")
        .start()
        .await;
    assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));

    // A visible change, and a script version that is not there yet (a ConfigMap published
    // before the volume holding the scripts, say).
    proxy.edit_config(Edit::Rename, |y| {
        y.replacen("      key: required\n", "      key: optional\n", 1)
            .replace("version: v1", "version: v9")
    });
    proxy
        .metrics_containing("idemgate_config_last_reload_successful 0")
        .await;
    proxy.log_containing("store.redis.scripts.version").await;
    // Long enough for the poll to have tried the same bytes again at least once.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));

    // The version appears, whole at once; the config file is not touched again.
    let staging = scripts.path().join(".v9.tmp");
    std::fs::create_dir(&staging).expect("staging dir");
    for name in ["claim", "complete", "release", "get"] {
        std::fs::write(staging.join(format!("{name}.lua")), "return nil\n").expect("script");
    }
    std::fs::rename(&staging, scripts.path().join("v9")).expect("publish v9");
    let started = Instant::now();
    while no_key_result(&proxy).await.as_deref() != Some("BYPASS") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the refused edit never went live once its scripts were there; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "idemgate_config_last_reload_successful"),
        Some(1.0)
    );
    assert_eq!(metric(&m, "idemgate_config_reloads_total"), Some(1.0));
    // The poll's retries of the same bytes failing the same way were neither counted...
    assert_eq!(
        metric(&m, "idemgate_config_reload_failures_total"),
        Some(1.0),
        "{m}"
    );
    // ...nor logged.
    let log = proxy.log();
    assert_eq!(log.matches("config reload refused").count(), 1, "{log}");
}

/// A TCP server that accepts connections and never answers: a blackholed Redis.
async fn silent_server() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_answers_in_time_while_redis_hangs_under_a_permissive_policy() {
    let backend = Backend::start().await;
    let redis = silent_server().await;
    // Default timeouts: a ping takes connect_timeout + 2 × response_timeout (1.4 s) to fail.
    let mut proxy = ProxyBuilder::new(&backend)
        .redis(&[format!("redis://{redis}")])
        .store("on_unavailable: pass")
        .start()
        .await;
    // Probes that come while a ping is still out start no ping of their own.
    let probes: Vec<_> = (0..5)
        .map(|_| {
            let admin = proxy.admin;
            tokio::spawn(async move { Request::get("/readyz").send(admin).await })
        })
        .collect();
    let mut waiting = 0;
    for probe in probes {
        let r = probe.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        waiting += usize::from(r.text().contains("an earlier ping has not answered"));
    }
    assert!(waiting >= 1, "every probe started its own ping");
    // Over a few seconds, so a probe meets the circuit closed, open and half-open.
    for probe in 0..10 {
        let started = Instant::now();
        let r = Request::get("/readyz").send(proxy.admin).await;
        let took = started.elapsed();
        assert_eq!(r.status, 200, "probe {probe}: {}", r.text());
        // A probe waits for a ping 200 ms at most; one that waited for the whole ping would
        // take 1.4 s.
        assert!(
            took < Duration::from_millis(1000),
            "probe {probe} took {took:?}, past a Kubernetes probe's 1 s timeout: {}",
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The policy applies live, without the restart warning; under reject the ping decides.
    proxy.edit_config(Edit::Rename, |y| {
        y.replace("on_unavailable: pass", "on_unavailable: reject")
    });
    proxy.log_containing("config reloaded").await;
    let started = Instant::now();
    loop {
        let r = Request::get("/readyz").send(proxy.admin).await;
        if r.status == 503 {
            assert!(r.text().contains("store unavailable"), "{}", r.text());
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "/readyz stayed {} under reject: {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = proxy.log();
    assert!(!log.contains("after a restart"), "{log}");
}

/// A proxy that writes its dead letters to `path`.
fn dead_letters_to(backend: &Backend, path: &std::path::Path) -> ProxyBuilder {
    ProxyBuilder::new(backend).store(&format!(
        "completion_retry: {{ dead_letter_path: \"{}\" }}",
        path.display()
    ))
}

/// The dead-letter file holds whole responses: created for this user only, and one others can
/// read is reported at start.
#[tokio::test]
async fn a_dead_letter_file_is_private_and_an_exposed_one_is_reported_at_start() {
    use std::os::unix::fs::PermissionsExt;
    // The usual umask, which alone would create the file readable by all: the proxies started
    // here inherit it. (A stricter one would make the check below pass whatever the code does.)
    // SAFETY: umask only sets the process's file creation mask.
    unsafe { libc::umask(0o022) };
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let fresh = dir.path().join("fresh.jsonl");
    let proxy = dead_letters_to(&backend, &fresh).start().await;
    assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));
    let mode = std::fs::metadata(&fresh)
        .expect("created at start")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    proxy.log_written().await;
    assert!(!proxy.log().contains("can be read by other users"));

    let exposed = dir.path().join("exposed.jsonl");
    std::fs::write(&exposed, "").expect("file");
    std::fs::set_permissions(&exposed, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let proxy = dead_letters_to(&backend, &exposed).start().await;
    let line = proxy.log_containing("can be read by other users").await;
    assert!(line.contains("644"), "{line}");
}

/// Dead letters a run before this one wrote still show once the process has restarted (its
/// counters start at 0 again), until the file is renamed aside to be reconciled.
#[tokio::test]
async fn the_dead_letter_file_size_is_a_gauge_that_outlives_a_restart() {
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("dead.jsonl");
    let earlier = "{\"reason\":\"written by the run before\"}\n";
    std::fs::write(&path, earlier).expect("file");
    let proxy = dead_letters_to(&backend, &path).start().await;
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_dead_letters_total"), Some(0.0));
    assert_eq!(
        metric(&m, "idemgate_dead_letter_file_bytes"),
        Some(earlier.len() as f64)
    );
    std::fs::rename(&path, dir.path().join("dead.jsonl.rotated")).expect("rotate");
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "idemgate_dead_letter_file_bytes"), Some(0.0));
}

#[tokio::test]
async fn a_dead_letter_file_that_cannot_be_opened_is_reported_at_start() {
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("no-such-dir").join("dead.jsonl");
    let proxy = dead_letters_to(&backend, &path).start().await;
    let line = proxy
        .log_containing("the dead-letter file cannot be opened")
        .await;
    assert!(line.contains("no-such-dir"), "{line}");
    // It still serves: the file is a last resort, not a dependency.
    assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "idemgate_dead_letter_write_failures_total"),
        Some(0.0)
    );
}
