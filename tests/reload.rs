//! Live config: file edits of every kind, invalid edits, SIGHUP, the admin endpoint, and
//! reloads under load.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Edit;
use common::{no_key_result, Backend, Proxy, ProxyBuilder, Request};

/// A config edit.
type Rewrite = fn(&str) -> String;

const TOKEN: &str = "test-admin-token-0123456789";

/// Waits up to `limit` for requests without a key to get `want`; returns how long it took.
async fn wait_for_result(proxy: &Proxy, want: &str, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if no_key_result(proxy).await.as_deref() == Some(want) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "config edit not applied within {limit:?}; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn optional(yaml: &str) -> String {
    yaml.replacen("      key: required\n", "      key: optional\n", 1)
}

fn required(yaml: &str) -> String {
    yaml.replacen("      key: optional\n", "      key: required\n", 1)
}

#[tokio::test]
async fn in_place_rename_and_configmap_edits_take_effect_within_two_seconds() {
    let backend = Backend::start().await;
    for (how, configmap) in [
        (Edit::InPlace, false),
        (Edit::Rename, false),
        (Edit::ConfigMap, true),
    ] {
        let mut builder = ProxyBuilder::new(&backend);
        if configmap {
            builder = builder.configmap();
        }
        let mut proxy = builder.start().await;
        assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));
        proxy.edit_config(how, optional);
        wait_for_result(&proxy, "BYPASS", Duration::from_secs(2)).await;
        // And back: the watcher keeps working after the first event (re-armed).
        proxy.edit_config(how, required);
        wait_for_result(&proxy, "INVALID", Duration::from_secs(2)).await;
        let m = proxy.metrics().await;
        assert!(
            m.contains("idemgate_config_last_reload_successful 1"),
            "{how:?}\n{m}"
        );
        assert!(
            m.contains("idemgate_config_reloads_total 2"),
            "{how:?}\n{m}"
        );
    }
}

#[tokio::test]
async fn invalid_edits_keep_the_running_config_and_say_why() {
    let backend = Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend).start().await;
    let cases: [(&str, Rewrite); 3] = [
        // Not YAML at all: an unterminated quoted scalar.
        ("at line", |y| {
            y.replacen("listen: \"", "listen: \"\n  - [", 1) + "\"oops"
        }),
        ("routes[0].upstream", |y| {
            y.replacen("upstream: orders", "upstream: nowhere", 1)
        }),
        ("routes[0].idempotency.ttl", |y| {
            optional(y).replacen("key: optional", "key: optional\n      ttl: 3 parsecs", 1)
        }),
    ];
    for (i, (why, edit)) in cases.into_iter().enumerate() {
        let before = proxy.yaml.clone();
        proxy.edit_config(Edit::Rename, edit);
        let m = proxy
            .metrics_containing("idemgate_config_last_reload_successful 0")
            .await;
        assert!(m.contains("idemgate_config_reload_failures_total"));
        // One clear error per bad edit, not one per poll.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let deadline = Instant::now() + Duration::from_secs(3);
        while !proxy.log().contains(why) {
            assert!(
                Instant::now() < deadline,
                "log does not say {why:?}:\n{}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        // The running config stays: no key is still refused, keyed requests still work.
        assert_eq!(no_key_result(&proxy).await.as_deref(), Some("INVALID"));
        let r = Request::post("/orders")
            .key(&format!("k{i}"))
            .body("{}")
            .send(proxy.addr)
            .await;
        assert_eq!(r.status, 201);
        proxy.edit_config(Edit::Rename, |_| before.clone());
        proxy
            .metrics_containing("idemgate_config_last_reload_successful 1")
            .await;
    }
    let errors = proxy.log().matches("config reload refused").count();
    assert_eq!(errors, 3, "one error per invalid edit:\n{}", proxy.log());
}

#[tokio::test]
async fn sighup_and_the_admin_endpoint_force_a_reload() {
    let backend = Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    // Mutations need the token.
    let refused = Request::post("/admin/reload").send(proxy.admin).await;
    assert_eq!(refused.status, 401);
    let wrong = Request::post("/admin/reload")
        .header("Authorization", "Bearer nope")
        .send(proxy.admin)
        .await;
    assert_eq!(wrong.status, 401);
    let ok = Request::post("/admin/reload")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert!(ok.text().contains("unchanged"));

    // An invalid file: the admin endpoint answers 422 naming the field, SIGHUP logs it.
    proxy.edit_config(Edit::InPlace, |y| {
        y.replacen("upstream: orders", "upstream: nowhere", 1)
    });
    let bad = Request::post("/admin/reload")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    assert_eq!(bad.status, 422);
    assert!(bad.text().contains("routes[0].upstream"), "{}", bad.text());
    proxy.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(3);
    while !proxy.log().contains("trigger=\"SIGHUP\"") && !proxy.log().contains("trigger=SIGHUP") {
        assert!(
            Instant::now() < deadline,
            "SIGHUP not handled:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // The admin config view shows the running (old) config, secrets redacted.
    let view = Request::get("/admin/config").send(proxy.admin).await;
    assert_eq!(view.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&view.body).unwrap();
    assert_eq!(v["routes"][0]["upstream"], "orders");
    assert_eq!(v["admin"]["token"], "<redacted>");
    assert!(!view.text().contains(TOKEN));
    // The file's hash (secrets included: guesses could be tested against it) only with the
    // token.
    assert!(v.get("hash").is_none(), "{v}");
    let trusted = Request::get("/admin/config")
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send(proxy.admin)
        .await;
    let v: serde_json::Value = serde_json::from_slice(&trusted.body).unwrap();
    assert_eq!(v["hash"].as_str().map(str::len), Some(64));
}

#[tokio::test]
async fn a_hundred_reloads_under_load_fail_no_request() {
    let backend = Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend)
        .idem("ttl: 1h")
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let addr = proxy.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            let mut n = 0u32;
            while (n < 300 || !stop.load(std::sync::atomic::Ordering::Relaxed)) && n < 20_000 {
                let key = format!("load-{}", n / 2);
                let r = Request::post("/orders")
                    .key(&key)
                    .body("{}")
                    .send(addr)
                    .await;
                statuses.push((r.status, r.result().map(str::to_string)));
                n += 1;
            }
            statuses
        })
    };
    for i in 0..100 {
        let ttl = if i % 2 == 0 { "ttl: 2h" } else { "ttl: 1h" };
        proxy.edit_config(Edit::Rename, |y| {
            y.replace("ttl: 1h", ttl).replace("ttl: 2h", ttl)
        });
        let r = Request::post("/admin/reload")
            .header("Authorization", format!("Bearer {TOKEN}"))
            .send(proxy.admin)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = load.await.unwrap();
    assert!(
        statuses.len() >= 100,
        "the load ran: {} requests",
        statuses.len()
    );
    for (status, result) in &statuses {
        assert_eq!(*status, 201, "{result:?}");
        assert!(matches!(result.as_deref(), Some("MISS") | Some("HIT")));
    }
    let m = proxy.metrics().await;
    let reloads: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_config_reloads_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(reloads >= 100.0, "{reloads} reloads");
}

/// A file written in place by a slow writer (a shell redirect over a slow link, an editor that
/// writes in place) is valid YAML halfway through: cut before the orders route's idempotency
/// block, it says that route forwards untouched. That half must never go live.
#[tokio::test]
async fn a_file_written_in_place_goes_live_only_once_its_writer_closes_it() {
    use std::io::Write;
    let backend = Backend::start().await;
    let proxy = ProxyBuilder::new(&backend).start().await;
    let no_key = || Request::post("/orders").body("{}");
    assert_eq!(no_key().send(proxy.addr).await.result(), Some("INVALID"));
    let before = reloads(&proxy).await;

    let whole = proxy.yaml.replacen(
        "      key: required\n",
        "      key: required\n      ttl: 2h\n",
        1,
    );
    let cut = whole
        .find("    idempotency:\n      key: required")
        .expect("orders block");
    let (head, tail) = whole.split_at(cut);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&proxy.config_path)
        .expect("open config");
    file.write_all(head.as_bytes()).expect("first half");
    file.flush().expect("flush");
    // The writer stalls well past the watcher's debounce, writes a little, stalls again: in
    // all longer than the watcher waits after one write, each stall shorter. It keeps its own
    // time on a thread of its own, whatever the requests that keep coming meanwhile take.
    let pieces = ["    # (written in pieces)\n".to_owned(), tail.to_owned()];
    let writer = std::thread::spawn(move || {
        for piece in pieces {
            std::thread::sleep(Duration::from_millis(1300));
            file.write_all(piece.as_bytes()).expect("next piece");
            file.flush().expect("flush");
        }
    });
    while !writer.is_finished() {
        let r = no_key().send(proxy.addr).await;
        assert_eq!(
            r.result(),
            Some("INVALID"),
            "the half-written file went live ({} {}); log:\n{}",
            r.status,
            r.text(),
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    writer.join().expect("writer");

    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(&proxy).await < before + 1.0 {
        assert!(
            Instant::now() < deadline,
            "never reloaded:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        reloads(&proxy).await,
        before + 1.0,
        "one reload, of the whole file"
    );
    assert_eq!(no_key().send(proxy.addr).await.result(), Some("INVALID"));
}

async fn reloads(proxy: &common::Proxy) -> f64 {
    common::metric(&proxy.metrics().await, "idemgate_config_reloads_total").unwrap_or(0.0)
}

/// An edit of settings read only at start-up says so: the admin reload answers
/// `restart_required` naming them, nothing counts as reloaded, and an edit that also changes
/// something live is `applied` with the same list.
#[tokio::test]
async fn an_edit_of_restart_only_settings_is_reported_as_needing_a_restart() {
    let backend = Backend::start().await;
    let mut proxy = ProxyBuilder::new(&backend)
        .threads(1)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let reload = |proxy: &Proxy| {
        let admin = proxy.admin;
        async move {
            Request::post("/admin/reload")
                .header("Authorization", format!("Bearer {TOKEN}"))
                .send(admin)
                .await
        }
    };
    // An edit of a comment alone changes no setting: not a restart-only edit.
    proxy.edit_config(Edit::Rename, |y| format!("# a comment\n{y}"));
    let v: serde_json::Value = serde_json::from_slice(&reload(&proxy).await.body).unwrap();
    assert_ne!(v["result"], "restart_required", "{v}");
    let before = reloads(&proxy).await;
    proxy.edit_config(Edit::Rename, |y| y.replacen("threads: 1", "threads: 3", 1));
    let r = reload(&proxy).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    // The file watcher waits 150 ms after an edit; on a stalled machine it may find the edit
    // first, and then the admin endpoint finds the file already taken as read (the watcher's
    // warning then names its trigger; the log is written in batches, so it is waited for).
    if v["result"] == "unchanged" {
        let log = proxy
            .log_containing("only take effect after a restart")
            .await;
        assert!(
            log.lines().any(
                |l| l.contains("only take effect after a restart") && l.contains("file change")
            ),
            "{v}\n{log}"
        );
    } else {
        assert_eq!(v["result"], "restart_required", "{v}");
        assert_eq!(v["restart_required"], serde_json::json!(["threads"]), "{v}");
    }
    proxy.log_containing("settings=[\"threads\"]").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(reloads(&proxy).await, before, "nothing was reloaded");
    assert_eq!(restart_pending(&proxy).await, 1.0);
    // Taken as read: asked again, the same file is unchanged.
    let again: serde_json::Value = serde_json::from_slice(&reload(&proxy).await.body).unwrap();
    assert_eq!(again["result"], "unchanged", "{again}");

    // A live change with it: applied, and the restart-only part still named.
    proxy.edit_config(Edit::Rename, |y| {
        y.replacen("threads: 3", "threads: 4", 1)
            .replacen("key: required", "key: optional", 1)
    });
    let v: serde_json::Value = serde_json::from_slice(&reload(&proxy).await.body).unwrap();
    if v["result"] == "unchanged" {
        // The watcher took it first: its reload named the setting (a second warning).
        let deadline = Instant::now() + Duration::from_secs(5);
        while proxy
            .log()
            .lines()
            .filter(|l| l.contains("only take effect after a restart") && l.contains("threads"))
            .count()
            < 2
        {
            assert!(Instant::now() < deadline, "{v}\n{}", proxy.log());
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    } else {
        assert_eq!(v["result"], "applied", "{v}");
        assert_eq!(v["restart_required"], serde_json::json!(["threads"]), "{v}");
    }
    wait_for_result(&proxy, "BYPASS", Duration::from_secs(5)).await;
    assert_eq!(reloads(&proxy).await, before + 1.0);
    assert_eq!(restart_pending(&proxy).await, 1.0, "still pending");

    // The file edited back to what runs: nothing is pending any more.
    proxy.edit_config(Edit::Rename, |y| y.replacen("threads: 4", "threads: 1", 1));
    let deadline = Instant::now() + Duration::from_secs(5);
    while restart_pending(&proxy).await != 0.0 {
        let _ = reload(&proxy).await;
        assert!(Instant::now() < deadline, "still pending");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn restart_pending(proxy: &common::Proxy) -> f64 {
    common::metric(&proxy.metrics().await, "idemgate_config_restart_pending")
        .expect("idemgate_config_restart_pending is exported")
}
