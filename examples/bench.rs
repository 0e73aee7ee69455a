//! Load harness: idemgate against a direct backend and nginx, in one run, printing ratios.
//!
//! # Running it
//!
//! ```text
//! cargo build --release --bins --examples && target/release/examples/bench
//! target/release/examples/bench --duration 30s --connections 64 --redis
//! BENCH_DURATION=30s BENCH_CONNECTIONS=64 BENCH_REDIS=1 target/release/examples/bench
//! ```
//!
//! (With `CARGO_TARGET_DIR` set, the binaries live under that directory instead of `target/`.)
//! It needs `wrk`, `nginx` (Debian's `nginx-light` is enough) and, for `--redis`, `redis-server`
//! and `redis-cli` on the `PATH`, and the release `idemgate` binary next to the `examples/`
//! directory this program runs from. Everything listens on free loopback ports; every process it
//! starts is stopped and its temporary directory (configs, wrk scripts, logs) removed when it
//! ends, on error too. `--keep` keeps the directory for reading the logs.
//!
//! # What each row measures
//!
//! Every row is wrk (`-t1 -c32 -d10s --latency` by default, after a 2 s warm-up run that is not
//! reported) sending the same ~60-byte JSON `POST` to one fast backend: an nginx worker that
//! answers `201 {"id":"ord_1","status":"created"}` without doing any work.
//!
//! - **direct**: wrk → backend. The ceiling of this machine; no proxy hop.
//! - **nginx proxy**: wrk → nginx (`proxy_pass`, upstream keep-alive) → backend. The gateway a
//!   user would otherwise run: the baseline idemgate's forwarding is judged against.
//! - **idemgate pass-through**: `POST /plain`, a route without idempotency: idemgate is a plain
//!   reverse proxy here (routing, logging, metrics, no store).
//! - **keyed miss**: `POST /orders` with a new `Idempotency-Key` on every request: each one is
//!   fingerprinted, claimed in the memory store, forwarded, and its response stored.
//! - **keyed hit**: `POST /orders` with one fixed key, executed once just before the row (a new
//!   key for every row and round): every request is replayed from the store and never reaches
//!   the backend. A key per round keeps the Redis hit row measuring a hot retry answered from
//!   the local cache, what the row is for: with one key for the whole run, the miss rows'
//!   records churned the cache between rounds (~150k per round against a 64 MiB cache that,
//!   charged honestly, holds about 100k small records) and from round 2 on the row measured a
//!   key evicted from it, answered by Redis.
//! - **keyed miss (redis)** / **keyed hit (redis)** (only with `--redis`): the same against a
//!   second idemgate whose store is a `redis-server` started for the run. The Redis round trips
//!   per request are the Redis commands clients sent during the run (`INFO commandstats`, our own
//!   `INFO` excluded) divided by the requests idemgate counted. After the last round the report
//!   gives Redis's memory per record: `used_memory` over an empty server's, divided by `DBSIZE`
//!   (the keyed-miss rows' records, plus the hit keys). `--redis-arg NAME=VALUE` starts
//!   redis-server with `--NAME VALUE`, to compare settings such as `hash-max-listpack-value`.
//!
//! # Setup details
//!
//! - Both nginx instances run with their own config, pid, temp paths and error log in the
//!   temporary directory. The backend has `worker_processes 1`; the gateways under comparison
//!   have `--workers N` each (default 1): the nginx proxy `worker_processes N`, idemgate
//!   `threads: N`. One worker each compares their cost per core; two on this 2-core machine is
//!   what each runs out of the box (Debian's nginx has `worker_processes auto`, idemgate's
//!   `threads` defaults to 2). The nginx proxy writes an access log, one line per
//!   request (method, path, status, time) to `logs/` in the temporary directory, buffered
//!   (`buffer=64k flush=1s`) as idemgate's log writer batches: both gateways do the same
//!   logging work, as Debian's nginx (which logs every request by default) and idemgate (one
//!   line per request) do out of the box. Until 2026-11-30 the proxy ran with `access_log off`
//!   while idemgate logged: by hand (four alternating 6 s pairs), the buffered log cost nginx
//!   -0.2 to +1.05 µs per request (about 0.5 µs; 12.9-18.0 µs without). The backend runs
//!   `access_log off`: it is the fixture every row shares, not a gateway under comparison.
//!   `keepalive_requests` is raised from nginx's default of 1000 so no row pays for periodic
//!   reconnections that another row does not. The proxy uses an `upstream` block with
//!   `keepalive 64`, `proxy_http_version 1.1` and `proxy_set_header Connection ""`.
//! - idemgate runs from its release binary with a generated config: `threads: N`, route `plain`
//!   on `/plain` (no idempotency block), route `orders` on `/orders` (`methods: [POST]`,
//!   `key: required`, `ttl: 1h`, `scope_headers: []`), `store.backend: memory` with a 4 GiB
//!   capacity. The TTL outlasts the whole run: with 60 s, the records of one round expired
//!   while a later round was measured, and that work (idemgate's sweeper, and for the Redis
//!   rows redis-server's active expiry, both competing for the same two cores) landed on
//!   whichever row ran then — in one 3-round run the keyed-miss worker was 84% busy, against
//!   96% in a single-round run. It logs at `IDEMGATE_LOG=info`, one line per request, to a file
//!   in `logs/` in the temporary directory: logging is part of the real cost, so it stays on.
//!   The logs sit apart from the configs because idemgate watches its config's directory: a log
//!   written there wakes the watcher thread on every flush, which no deployment does.
//! - With `--redis`, the second idemgate's config is first put to `idemgate --config F --check`;
//!   if this build rejects `store.backend: redis`, the Redis rows are skipped with idemgate's
//!   message and everything else runs.
//! - No CPU pinning: wrk, the backend and the proxy float over the cores as a user's would.
//!
//! # Reading the numbers
//!
//! Absolute req/s on a small shared machine are noise; the ratios between rows of one run are
//! the result. `vs X` is this row's req/s divided by row X's. The three targets of the core issue
//! are printed under the table: pass-through / nginx ≥ 0.80 (idemgate forwards nearly as
//! cheaply as nginx), keyed miss / pass-through ≥ 0.80 (idempotency costs at most 20 % on
//! top of forwarding), keyed hit / nginx ≥ 1.00 (a replay, which skips the backend, is at
//! least as fast as nginx forwarding). With `--redis`, miss (redis) / pass-through ≥ 0.60 and
//! hit (redis) / nginx ≥ 1.00.
//!
//! wrk, the backend and the proxy share the machine's cores, so a proxy row has three busy
//! processes where the direct row has two. The second table therefore shows where the CPU went
//! during each measured run (from `/proc`; 100 % = one core): the proxy's CPU time per request
//! is the number least disturbed by that contention.
//!
//! `--rounds N` runs every row N times, interleaved (all rows, then all rows again...), and
//! reports each row's median round: a burst of load from another tenant of the machine then
//! spoils one round of every row instead of every round of one row. The `other` column of the
//! CPU table (busy time not charged to wrk, the backend or the proxy) shows such load; the
//! line under it names the rows where it was large.
//!
//! # Correctness checks (printed, never timed)
//!
//! A row is only worth its number if its answers were right: wrk must report no non-2xx/3xx
//! responses and no socket errors; for idemgate rows the `idemgate_requests_total` counters on
//! the admin `/metrics` endpoint, read before and after the run, must show only the expected
//! result (`FORWARD`, `MISS` or `HIT`); and one request sent before and one after each keyed run
//! must carry the expected `X-Idempotent-Result` header. After the rounds, the nginx proxy's
//! access log must hold a line for every request its rows measured. A failed check is printed
//! and makes the exit status 1, after the table.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// The small JSON order every row sends (~60 bytes).
const BODY: &str = r#"{"customer":"cus_4242","items":[{"sku":"sku_1","qty":2}]}"#;

/// What the backend answers to every request.
const BACKEND_REPLY: &str = r#"{"id":"ord_1","status":"created"}"#;

/// How long a started server gets to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a stopped process gets between SIGTERM and SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

const HELP: &str = "\
bench: idemgate load harness (see the top of examples/bench.rs)

usage: bench [--duration 10s] [--connections 32] [--warmup 2s] [--rounds 1] [--workers 1]
             [--redis] [--redis-arg NAME=VALUE]... [--keep]

  -d, --duration D     measured wrk run per row (env BENCH_DURATION), e.g. 10s, 1m
  -c, --connections N  wrk connections (env BENCH_CONNECTIONS)
  -r, --rounds N       run every row N times, interleaved; report each row's median round
                       (env BENCH_ROUNDS)
      --warmup D       unreported wrk run before each row (env BENCH_WARMUP)
  -w, --workers N      workers of each gateway under comparison: the nginx proxy's
                       worker_processes and idemgate's threads (env BENCH_WORKERS); the
                       backend keeps one worker
      --redis          add keyed miss/hit rows on a Redis store (env BENCH_REDIS=1)
      --redis-arg N=V  start redis-server with `--N V` (repeatable), e.g.
                       hash-max-listpack-value=1024
      --keep           keep the temporary directory with configs and logs (env BENCH_KEEP=1)
";

fn main() -> ExitCode {
    let opts = match Options::parse() {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench: {e}\n\n{HELP}");
            return ExitCode::from(64);
        }
    };
    match run(&opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench: some correctness checks failed (see above)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::from(1)
        }
    }
}

// === Options ===

/// Command-line and environment settings.
struct Options {
    duration: Duration,
    warmup: Duration,
    connections: u32,
    rounds: u32,
    /// The nginx proxy's `worker_processes` and idemgate's `threads`.
    workers: u32,
    redis: bool,
    /// Extra `redis-server` settings, `(name, value)`.
    redis_args: Vec<(String, String)>,
    keep: bool,
}

impl Options {
    /// `Ok(None)` means `--help` was asked for.
    fn parse() -> BoxResult<Option<Options>> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let truthy = |v: Option<String>| v.is_some_and(|v| v != "0" && v != "false");
        let mut opts = Options {
            duration: parse_duration(&env("BENCH_DURATION").unwrap_or_else(|| "10s".into()))?,
            warmup: parse_duration(&env("BENCH_WARMUP").unwrap_or_else(|| "2s".into()))?,
            connections: parse_count(&env("BENCH_CONNECTIONS").unwrap_or_else(|| "32".into()))?,
            rounds: parse_count(&env("BENCH_ROUNDS").unwrap_or_else(|| "1".into()))?,
            workers: parse_count(&env("BENCH_WORKERS").unwrap_or_else(|| "1".into()))?,
            redis: truthy(env("BENCH_REDIS")),
            redis_args: Vec::new(),
            keep: truthy(env("BENCH_KEEP")),
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) => (n.to_owned(), Some(v.to_owned())),
                None => (arg.clone(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match name.as_str() {
                "-d" | "--duration" => opts.duration = parse_duration(&value()?)?,
                "--warmup" => opts.warmup = parse_duration(&value()?)?,
                "-c" | "--connections" => opts.connections = parse_count(&value()?)?,
                "-r" | "--rounds" => opts.rounds = parse_count(&value()?)?,
                "-w" | "--workers" => opts.workers = parse_count(&value()?)?,
                "--redis" => opts.redis = true,
                "--redis-arg" => {
                    let arg = value()?;
                    let (n, v) = arg
                        .split_once('=')
                        .filter(|(n, _)| !n.is_empty() && !n.starts_with('-'))
                        .ok_or_else(|| format!("--redis-arg wants NAME=VALUE, got {arg:?}"))?;
                    opts.redis_args.push((n.to_owned(), v.to_owned()));
                }
                "--keep" => opts.keep = true,
                "-h" | "--help" => return Ok(None),
                _ => return Err(format!("unknown argument {arg:?}").into()),
            }
        }
        if opts.duration.as_secs() == 0 {
            return Err("the duration must be at least 1s".into());
        }
        Ok(Some(opts))
    }
}

/// wrk takes whole seconds; accept `10`, `10s` and `2m`.
fn parse_duration(s: &str) -> BoxResult<Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix('m') {
        (n, 60)
    } else {
        (s.strip_suffix('s').unwrap_or(s), 1)
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (use e.g. 10s or 1m)"))?;
    Ok(Duration::from_secs(n * mult))
}

fn parse_count(s: &str) -> BoxResult<u32> {
    match s.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("bad count {s:?} (a whole number >= 1)").into()),
    }
}

// === The run ===

/// Where a row sends its requests and what its answers must look like.
struct Scenario {
    name: &'static str,
    addr: SocketAddr,
    path: &'static str,
    script: PathBuf,
    expect: Expect,
    /// `redis-cli` port whose command counts are read around the run.
    redis_port: Option<u16>,
}

/// What a row's idemgate answers must be; checked on the admin metrics and with probes.
#[derive(Clone)]
enum Expect {
    /// Not behind idemgate: only wrk's own error counts are checked.
    Nothing,
    /// idemgate forwarding on `route`.
    Forward {
        admin: SocketAddr,
        route: &'static str,
    },
    /// Every request a first execution: `MISS`.
    Miss {
        admin: SocketAddr,
        route: &'static str,
    },
    /// Every request a replay of `key`: `HIT`.
    Hit {
        admin: SocketAddr,
        route: &'static str,
        key: String,
    },
}

/// One measured row.
struct RowResult {
    name: &'static str,
    wrk: WrkStats,
    cpu: CpuUse,
    redis_per_request: Option<f64>,
}

fn run(opts: &Options) -> BoxResult<bool> {
    let idemgate_bin = idemgate_binary()?;
    for tool in ["wrk", "nginx"] {
        require_tool(tool)?;
    }
    let mut lab = Lab::new(opts.keep)?;
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);

    // Ports are reserved together so no two servers are handed the same one.
    let ports = free_ports(4)?;
    let [backend_port, nginx_port, idem_port, idem_admin] = ports[..] else {
        return Err("could not reserve ports".into());
    };
    let backend = loopback(backend_port);
    let nginx_proxy = loopback(nginx_port);
    let idem = loopback(idem_port);
    let idem_admin = loopback(idem_admin);

    lab.start_nginx("backend", &backend_nginx_conf(lab.dir(), backend_port))?;
    wait_for_http(&mut lab, backend, "/")?;
    lab.start_nginx(
        "nginx-proxy",
        &proxy_nginx_conf(lab.dir(), nginx_port, backend_port, opts.workers),
    )?;
    wait_for_http(&mut lab, nginx_proxy, "/")?;
    let memory_cfg = lab.write(
        "idemgate-memory.yaml",
        &idemgate_yaml(
            idem,
            idem_admin,
            backend,
            opts.workers,
            "memory: { capacity: 4GiB }",
        ),
    )?;
    check_config(&idemgate_bin, &memory_cfg).map_err(|e| format!("idemgate --check: {e}"))?;
    lab.start_idemgate("idemgate", &idemgate_bin, &memory_cfg)?;
    wait_for_http(&mut lab, idem_admin, "/readyz")?;

    let plain_lua = lab.write("plain.lua", &plain_lua())?;
    let hit_key = format!("bench-hit-{nonce}");
    let hit_lua = lab.write("hit.lua", &hit_lua())?;
    let miss_lua = lab.write("miss.lua", &miss_lua(&format!("bench-miss-{nonce}")))?;

    let mut scenarios = vec![
        Scenario {
            name: "direct",
            addr: backend,
            path: "/orders",
            script: plain_lua.clone(),
            expect: Expect::Nothing,
            redis_port: None,
        },
        Scenario {
            name: "nginx proxy",
            addr: nginx_proxy,
            path: "/orders",
            script: plain_lua.clone(),
            expect: Expect::Nothing,
            redis_port: None,
        },
        Scenario {
            name: "idemgate pass-through",
            addr: idem,
            path: "/plain",
            script: plain_lua,
            expect: Expect::Forward {
                admin: idem_admin,
                route: "plain",
            },
            redis_port: None,
        },
        Scenario {
            name: "keyed miss",
            addr: idem,
            path: "/orders",
            script: miss_lua.clone(),
            expect: Expect::Miss {
                admin: idem_admin,
                route: "orders",
            },
            redis_port: None,
        },
        Scenario {
            name: "keyed hit",
            addr: idem,
            path: "/orders",
            script: hit_lua.clone(),
            expect: Expect::Hit {
                admin: idem_admin,
                route: "orders",
                key: hit_key.clone(),
            },
            redis_port: None,
        },
    ];

    let mut notes = Vec::new();
    // The Redis server and its memory before any record, for the memory per record.
    let mut redis_empty: Option<(u16, u64)> = None;
    if opts.redis {
        match start_redis_instance(
            &mut lab,
            &idemgate_bin,
            backend,
            opts.workers,
            &opts.redis_args,
        )? {
            RedisSetup::Ready {
                proxy,
                admin,
                redis_port,
            } => {
                redis_empty = Some((redis_port, redis_used_memory(redis_port)?.0));
                scenarios.push(Scenario {
                    name: "keyed miss (redis)",
                    addr: proxy,
                    path: "/orders",
                    script: miss_lua,
                    expect: Expect::Miss {
                        admin,
                        route: "orders",
                    },
                    redis_port: Some(redis_port),
                });
                scenarios.push(Scenario {
                    name: "keyed hit (redis)",
                    addr: proxy,
                    path: "/orders",
                    script: hit_lua,
                    expect: Expect::Hit {
                        admin,
                        route: "orders",
                        key: hit_key,
                    },
                    redis_port: Some(redis_port),
                });
            }
            RedisSetup::Skipped(why) => {
                println!("bench: skipping the Redis rows: {why}");
                notes.push(format!("Redis rows skipped: {why}"));
            }
        }
    }

    let machine = Machine::describe();
    println!("bench: {machine}");
    println!(
        "bench: wrk -t1 -c{} -d{}s --latency per row, after an unreported {}s warm-up; body {} bytes",
        opts.connections,
        opts.duration.as_secs(),
        opts.warmup.as_secs(),
        BODY.len()
    );
    println!(
        "bench: pids: backend nginx {:?}, nginx proxy {:?}, idemgate {:?}; temp dir {}",
        lab.pids("backend"),
        lab.pids("nginx-proxy"),
        lab.pids("idemgate"),
        lab.dir().display()
    );

    let background = background_load();
    println!(
        "bench: machine {:.0}% busy (100% = one core) in the second before the first row",
        background * 100.0
    );

    // Rounds run every row in turn, so a burst of load from another tenant of the machine
    // lands on one round of every row rather than on all rounds of one row.
    let mut rounds: Vec<Vec<RowResult>> = scenarios.iter().map(|_| Vec::new()).collect();
    let mut failures = Vec::new();
    for round in 0..opts.rounds {
        for (i, sc) in scenarios.iter().enumerate() {
            println!(
                "bench: round {}/{}: {} ...",
                round + 1,
                opts.rounds,
                sc.name
            );
            let row = run_scenario(&mut lab, opts, &format!("{round}r{i}"), sc, &mut failures)?;
            println!(
                "bench:   {:.0} req/s, p50 {}, p99 {}",
                row.wrk.rps,
                fmt_latency(row.wrk.p50_us),
                fmt_latency(row.wrk.p99_us)
            );
            rounds[i].push(row);
        }
    }
    // The baseline's log is part of what it was measured doing: every request it answered in a
    // measured run must be in it (warm-ups add more). Its buffer is flushed within a second,
    // and later rows ran for longer than that.
    let nginx_log = logs_dir(lab.dir()).join("nginx-proxy-access.log");
    let logged = fs::read(&nginx_log).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count());
    let answered: u64 = scenarios
        .iter()
        .zip(&rounds)
        .filter(|(sc, _)| sc.name == "nginx proxy")
        .flat_map(|(_, rows)| rows.iter().map(|r| r.wrk.requests))
        .sum();
    if (logged as u64) < answered {
        failures.push(format!(
            "nginx proxy: its access log has {logged} lines for {answered} measured requests"
        ));
    }
    let per_round = (0..opts.rounds as usize)
        .map(|round| {
            rounds
                .iter()
                .filter_map(|row| row.get(round))
                .map(|r| (r.name, r.wrk.rps))
                .collect()
        })
        .collect();
    let redis_memory = match redis_empty {
        Some((port, empty)) => redis_memory_line(port, empty, &opts.redis_args)?,
        None => None,
    };
    let outcome = Outcome {
        rows: rounds.into_iter().filter_map(median_round).collect(),
        per_round,
        failures,
        notes,
        redis_memory,
    };

    println!();
    print!("{}", report(&machine, background, opts, &outcome, &lab));
    Ok(outcome.failures.is_empty())
}

/// Everything measured and checked, for the report.
struct Outcome {
    /// Each row's median round.
    rows: Vec<RowResult>,
    /// req/s of every row, round by round.
    per_round: Vec<BTreeMap<&'static str, f64>>,
    failures: Vec<String>,
    notes: Vec<String>,
    /// Memory the Redis rows' records take in redis-server, when they ran.
    redis_memory: Option<String>,
}

/// The round with the median req/s (the lower middle one for an even count).
fn median_round(mut rounds: Vec<RowResult>) -> Option<RowResult> {
    rounds.sort_by(|a, b| a.wrk.rps.total_cmp(&b.wrk.rps));
    let mid = rounds.len().saturating_sub(1) / 2;
    (mid < rounds.len()).then(|| rounds.swap_remove(mid))
}

/// Machine busy fraction (1.0 = one core) over one second.
fn background_load() -> f64 {
    let before = machine_busy_secs();
    let started = Instant::now();
    sleep(Duration::from_secs(1));
    (machine_busy_secs() - before) / started.elapsed().as_secs_f64()
}

/// Warms up, measures, and checks one row (`id` makes its generated keys unique).
fn run_scenario(
    lab: &mut Lab,
    opts: &Options,
    id: &str,
    sc: &Scenario,
    failures: &mut Vec<String>,
) -> BoxResult<RowResult> {
    let url = format!("http://{}{}", sc.addr, sc.path);
    // A hit row replays a key executed just before it, one per row and round: the row measures
    // a hot retry of a key this replica completed, not whether an earlier round's key survived
    // the churn the miss rows put through the local cache in between. The probe doubles as the
    // check that it was stored.
    let row_key = match &sc.expect {
        Expect::Hit { key, .. } => Some(format!("{key}-{id}")),
        _ => None,
    };
    if let Some(key) = &row_key {
        let first = post(sc.addr, sc.path, Some(key))?;
        if !first.status_ok() {
            failures.push(format!(
                "{}: warming request answered {} {}",
                sc.name,
                first.status,
                first.idem_result()
            ));
        }
    }
    // wrk's script argument: the hit row's key, or a tag that keeps each run's miss keys apart.
    let tag = |phase: &str| row_key.clone().unwrap_or_else(|| format!("{id}{phase}"));
    run_wrk(&url, &sc.script, &tag("w"), opts.connections, opts.warmup)?;
    lab.check_alive()?;

    probe(sc, &tag("b"), "before", failures)?;
    let metrics_before = read_metrics(&sc.expect)?;
    let redis_before = sc.redis_port.map(redis_calls).transpose()?;
    let cpu = CpuSampler::new(lab, sc);
    let wrk = run_wrk(&url, &sc.script, &tag("m"), opts.connections, opts.duration)?;
    let cpu = cpu.finish();
    // A server that died during the run explains every error that would follow.
    lab.check_alive()?;
    // Lets idemgate finish counting the last responses wrk saw before its metrics are read.
    sleep(Duration::from_millis(100));
    let redis_after = sc.redis_port.map(redis_calls).transpose()?;
    let metrics_after = read_metrics(&sc.expect)?;
    probe(sc, &tag("a"), "after", failures)?;

    if wrk.non_2xx > 0 {
        failures.push(format!(
            "{}: wrk saw {} non-2xx/3xx responses",
            sc.name, wrk.non_2xx
        ));
    }
    if let Some(errors) = &wrk.socket_errors {
        failures.push(format!("{}: wrk socket errors: {errors}", sc.name));
    }
    let counted = check_metrics(sc, &wrk, &metrics_before, &metrics_after, failures);
    let redis_per_request = match (redis_before, redis_after) {
        (Some(b), Some(a)) if counted > 0 => Some(a.saturating_sub(b) as f64 / counted as f64),
        _ => None,
    };
    Ok(RowResult {
        name: sc.name,
        wrk,
        cpu,
        redis_per_request,
    })
}

/// Compares the idemgate result counters of the run with what the row expects; returns how many
/// requests idemgate counted for the route (0 when not behind idemgate).
fn check_metrics(
    sc: &Scenario,
    wrk: &WrkStats,
    before: &Counters,
    after: &Counters,
    failures: &mut Vec<String>,
) -> u64 {
    let (route, want) = match &sc.expect {
        Expect::Nothing => return 0,
        Expect::Forward { route, .. } => (*route, "FORWARD"),
        Expect::Miss { route, .. } => (*route, "MISS"),
        Expect::Hit { route, .. } => (*route, "HIT"),
    };
    let mut seen = 0;
    for (key, value) in after {
        let delta = value.saturating_sub(before.get(key).copied().unwrap_or(0));
        if delta == 0 {
            continue;
        }
        if key.0 == route && key.1 == want {
            seen = delta;
        } else {
            failures.push(format!(
                "{}: idemgate counted {delta} requests as route={} result={} during the run",
                sc.name, key.0, key.1
            ));
        }
    }
    // wrk does not count the responses still in flight when it stops, so idemgate may have
    // counted up to one per connection more.
    if seen < wrk.requests {
        failures.push(format!(
            "{}: wrk completed {} requests but idemgate counted only {seen} as {want}",
            sc.name, wrk.requests
        ));
    }
    seen
}

/// One request with the std library, showing the `X-Idempotent-Result` a client would see.
fn probe(sc: &Scenario, tag: &str, when: &str, failures: &mut Vec<String>) -> BoxResult<()> {
    let (key, want) = match &sc.expect {
        Expect::Nothing | Expect::Forward { .. } => return Ok(()),
        Expect::Miss { .. } => (format!("bench-probe-{}-{tag}", std::process::id()), "MISS"),
        // A hit row's tag is its key.
        Expect::Hit { .. } => (tag.to_string(), "HIT"),
    };
    let reply = post(sc.addr, sc.path, Some(&key))?;
    let got = reply.idem_result();
    println!(
        "bench:   probe {when}: {} X-Idempotent-Result: {got}",
        reply.status
    );
    if !reply.status_ok() || got != want {
        failures.push(format!(
            "{}: probe {when} answered {} with X-Idempotent-Result {got:?}, expected 2xx {want}",
            sc.name, reply.status
        ));
    }
    Ok(())
}

// === Redis ===

enum RedisSetup {
    Ready {
        proxy: SocketAddr,
        admin: SocketAddr,
        redis_port: u16,
    },
    Skipped(String),
}

/// Starts `redis-server` and a second idemgate on it, unless this idemgate build rejects the
/// Redis backend (it is built in parallel) or Redis is not installed.
fn start_redis_instance(
    lab: &mut Lab,
    idemgate_bin: &Path,
    backend: SocketAddr,
    workers: u32,
    extra: &[(String, String)],
) -> BoxResult<RedisSetup> {
    let ports = free_ports(3)?;
    let [redis_port, proxy_port, admin_port] = ports[..] else {
        return Err("could not reserve ports".into());
    };
    let (proxy, admin) = (loopback(proxy_port), loopback(admin_port));
    let store = format!("redis: {{ url: \"redis://127.0.0.1:{redis_port}\" }}");
    let cfg = lab.write(
        "idemgate-redis.yaml",
        &idemgate_yaml_with_backend(proxy, admin, backend, workers, "redis", &store),
    )?;
    if let Err(e) = check_config(idemgate_bin, &cfg) {
        return Ok(RedisSetup::Skipped(format!(
            "this idemgate rejects the redis store config ({e})"
        )));
    }
    for tool in ["redis-server", "redis-cli"] {
        if require_tool(tool).is_err() {
            return Ok(RedisSetup::Skipped(format!("{tool} is not installed")));
        }
    }
    let dir = lab.dir().to_path_buf();
    let log = dir.join("redis.log");
    let port = redis_port.to_string();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "no", "--daemonize", "no"])
        .arg("--dir")
        .arg(&dir)
        .arg("--logfile")
        .arg(&log);
    for (name, value) in extra {
        cmd.arg(format!("--{name}")).arg(value);
    }
    lab.spawn("redis", cmd, &dir.join("redis.out"))?;
    wait_for_tcp(lab, loopback(redis_port))?;
    lab.start_idemgate("idemgate-redis", idemgate_bin, &cfg)?;
    wait_for_http(lab, admin, "/readyz")?;
    Ok(RedisSetup::Ready {
        proxy,
        admin,
        redis_port,
    })
}

/// The report's line on Redis's memory per record: `used_memory` over `empty` (an empty
/// server's) divided by the keys, under the `settings` redis-server was started with. None
/// when Redis holds no record.
fn redis_memory_line(
    port: u16,
    empty: u64,
    settings: &[(String, String)],
) -> BoxResult<Option<String>> {
    let (used, records) = redis_used_memory(port)?;
    if records == 0 {
        return Ok(None);
    }
    let settings = if settings.is_empty() {
        "redis-server defaults".to_owned()
    } else {
        let set: Vec<String> = settings.iter().map(|(n, v)| format!("{n} {v}")).collect();
        set.join(", ")
    };
    let grown = used.saturating_sub(empty) as f64;
    Ok(Some(format!(
        "Redis memory per record: {:.0} bytes ({records} records, used_memory {:.1} MiB over an \
         empty server's; {settings})",
        grown / records as f64,
        grown / (1 << 20) as f64,
    )))
}

/// Redis's `used_memory` and its number of keys.
fn redis_used_memory(port: u16) -> BoxResult<(u64, u64)> {
    let used = redis_cli(port, &["INFO", "memory"])?
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or("no used_memory in INFO memory")?;
    let keys = redis_cli(port, &["DBSIZE"])?
        .trim()
        .parse()
        .map_err(|_| "DBSIZE is not a number")?;
    Ok((used, keys))
}

/// Commands Redis has executed so far, excluding the `INFO` calls this harness makes.
fn redis_calls(port: u16) -> BoxResult<u64> {
    Ok(sum_commandstats(&redis_cli(
        port,
        &["INFO", "commandstats"],
    )?))
}

/// What `redis-cli -p port args...` prints.
fn redis_cli(port: u16, args: &[&str]) -> BoxResult<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "redis-cli {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Commands a client sends itself. `INFO commandstats` also counts the commands a Lua script
/// runs inside Redis (HMGET, HSET, TIME...), which are not round trips.
const CLIENT_COMMANDS: &[&str] = &[
    "evalsha:",
    "eval:",
    "evalsha_ro:",
    "eval_ro:",
    "script|load:",
    "ping:",
    "publish:",
];

/// Sums `calls=` over the `cmdstat_*` lines of commands clients send (one round trip each).
fn sum_commandstats(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("cmdstat_"))
        .filter(|l| CLIENT_COMMANDS.iter().any(|c| l.starts_with(c)))
        .filter_map(|l| {
            let calls = l.split_once("calls=")?.1;
            calls.split(',').next()?.parse::<u64>().ok()
        })
        .sum()
}

// === Configs and scripts ===

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Lines every nginx instance shares: its own temp paths, no system paths, and the given
/// `access_log` directive. `keepalive_requests` is raised from its default of 1000 so no row
/// pays for reconnections that another does not.
fn nginx_common(dir: &Path, name: &str, workers: u32, access_log: &str) -> String {
    let d = dir.display();
    format!(
        "worker_processes {workers};\n\
         daemon off;\n\
         pid {d}/{name}.pid;\n\
         error_log {d}/{name}-error.log warn;\n\
         events {{ worker_connections 4096; }}\n"
    ) + &format!(
        "http {{\n\
         \x20 {access_log}\n\
         \x20 keepalive_requests 1000000;\n\
         \x20 keepalive_timeout 75s;\n\
         \x20 client_body_buffer_size 64k;\n\
         \x20 client_body_temp_path {d}/{name}-body;\n\
         \x20 proxy_temp_path {d}/{name}-proxy;\n\
         \x20 fastcgi_temp_path {d}/{name}-fastcgi;\n\
         \x20 uwsgi_temp_path {d}/{name}-uwsgi;\n\
         \x20 scgi_temp_path {d}/{name}-scgi;\n"
    )
}

fn backend_nginx_conf(dir: &Path, port: u16) -> String {
    // The backend is the fixture every row shares, not a gateway under comparison: no log.
    nginx_common(dir, "backend", 1, "access_log off;")
        + &format!(
            "  server {{\n\
             \x20   listen 127.0.0.1:{port};\n\
             \x20   location / {{\n\
             \x20     default_type application/json;\n\
             \x20     return 201 '{BACKEND_REPLY}';\n\
             \x20   }}\n\
             \x20 }}\n\
             }}\n"
        )
}

/// The baseline gateway logs every request, as idemgate does (and as Debian's nginx does by
/// default): one line per request to a file, buffered like idemgate's own batching writer.
fn proxy_nginx_conf(dir: &Path, port: u16, backend_port: u16, workers: u32) -> String {
    let logs = logs_dir(dir);
    let logs = logs.display();
    let access_log = format!(
        "log_format access '$request_method $uri $status $request_time'; \
         access_log {logs}/nginx-proxy-access.log access buffer=64k flush=1s;"
    );
    nginx_common(dir, "nginx-proxy", workers, &access_log)
        + &format!(
            "  upstream backend {{\n\
             \x20   server 127.0.0.1:{backend_port};\n\
             \x20   keepalive 64;\n\
             \x20   keepalive_requests 1000000;\n\
             \x20 }}\n\
             \x20 server {{\n\
             \x20   listen 127.0.0.1:{port};\n\
             \x20   location / {{\n\
             \x20     proxy_pass http://backend;\n\
             \x20     proxy_http_version 1.1;\n\
             \x20     proxy_set_header Connection \"\";\n\
             \x20   }}\n\
             \x20 }}\n\
             }}\n"
        )
}

fn idemgate_yaml(
    listen: SocketAddr,
    admin: SocketAddr,
    backend: SocketAddr,
    threads: u32,
    memory: &str,
) -> String {
    idemgate_yaml_with_backend(listen, admin, backend, threads, "memory", memory)
}

/// The idemgate config of a row: `threads` workers, a pass-through route and a keyed route.
fn idemgate_yaml_with_backend(
    listen: SocketAddr,
    admin: SocketAddr,
    backend: SocketAddr,
    threads: u32,
    store_backend: &str,
    store_block: &str,
) -> String {
    // BENCH_WORK_STEALING=true|false overrides idemgate's scheduler choice, to compare both.
    let stealing = std::env::var("BENCH_WORK_STEALING")
        .map(|v| format!("work_stealing: {v}\n"))
        .unwrap_or_default();
    format!(
        "# Generated by examples/bench.rs.\n\
         listen: \"{listen}\"\n\
         threads: {threads}\n\
         {stealing}\
         admin:\n  listen: \"{admin}\"\n\
         upstreams:\n  backend:\n    addrs: [\"{backend}\"]\n\
         store:\n  backend: {store_backend}\n  {store_block}\n\
         routes:\n\
         \x20 - name: plain\n\
         \x20   path_prefix: /plain\n\
         \x20   upstream: backend\n\
         \x20 - name: orders\n\
         \x20   methods: [POST]\n\
         \x20   path_prefix: /orders\n\
         \x20   upstream: backend\n\
         \x20   idempotency:\n\
         \x20     key: required\n\
         \x20     ttl: 1h\n\
         \x20     scope_headers: []\n"
    )
}

fn lua_string(s: &str) -> String {
    format!("{s:?}")
}

/// Rows without a key: a fixed request, so wrk builds it once.
fn plain_lua() -> String {
    format!(
        "-- POST the bench body; a static request, built once by wrk.\n\
         wrk.method = \"POST\"\n\
         wrk.body = {body}\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n",
        body = lua_string(BODY)
    )
}

/// The hit row: a fixed request carrying one key (wrk's script argument), executed once before
/// the run.
fn hit_lua() -> String {
    plain_lua()
        + "-- Every request carries the same, already executed key: each one is a replay.\n\
           function init(args)\n\
           \x20 wrk.headers[\"Idempotency-Key\"] = args[1]\n\
           end\n"
}

/// The miss rows: a new key per request, `<prefix>-<tag>-<thread>-<counter>`. The prefix holds
/// a per-run nonce; the tag (wrk's script argument) differs between the warm-up and measured runs
/// of every row, which are separate wrk processes that both count from 1.
fn miss_lua(prefix: &str) -> String {
    format!(
        "-- A new Idempotency-Key on every request: each one is a first execution.\n\
         local threads = 0\n\
         function setup(thread)\n\
         \x20 threads = threads + 1\n\
         \x20 thread:set(\"tid\", threads)\n\
         end\n\
         local key_prefix\n\
         local counter = 0\n\
         local headers = {{}}\n\
         function init(args)\n\
         \x20 key_prefix = {prefix} .. \"-\" .. (args[1] or \"x\") .. \"-\" .. tid .. \"-\"\n\
         \x20 headers[\"Content-Type\"] = \"application/json\"\n\
         end\n\
         function request()\n\
         \x20 counter = counter + 1\n\
         \x20 headers[\"Idempotency-Key\"] = key_prefix .. counter\n\
         \x20 return wrk.format(\"POST\", nil, headers, {body})\n\
         end\n",
        prefix = lua_string(prefix),
        body = lua_string(BODY)
    )
}

// === wrk ===

/// What one wrk run reported.
#[derive(Debug, Default, Clone)]
struct WrkStats {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    requests: u64,
    non_2xx: u64,
    socket_errors: Option<String>,
}

/// Runs wrk once; `tag` is passed to the script's `init(args)`.
fn run_wrk(
    url: &str,
    script: &Path,
    tag: &str,
    connections: u32,
    duration: Duration,
) -> BoxResult<WrkStats> {
    let out = Command::new("wrk")
        .args(["-t1", &format!("-c{connections}")])
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(url)
        .args(["--", tag])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run wrk: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "wrk failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    parse_wrk(&text).ok_or_else(|| format!("cannot read wrk's output:\n{text}").into())
}

fn parse_wrk(text: &str) -> Option<WrkStats> {
    let mut stats = WrkStats::default();
    let (mut rps, mut p50, mut p99) = (None, None, None);
    for line in text.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("Requests/sec:") => rps = words.next().and_then(|v| v.parse().ok()),
            Some("50%") => p50 = words.next().and_then(parse_wrk_time),
            Some("99%") => p99 = words.next().and_then(parse_wrk_time),
            Some("Non-2xx") => {
                stats.non_2xx = line.rsplit(' ').next()?.parse().ok()?;
            }
            Some("Socket") => {
                // "Socket errors: connect 0, read 0, write 0, timeout 0": printed only when some
                // count is non-zero.
                stats.socket_errors = line.split_once(": ").map(|(_, r)| r.to_owned());
            }
            Some(n) if line.contains(" requests in ") => stats.requests = n.parse().ok()?,
            _ => {}
        }
    }
    stats.rps = rps?;
    stats.p50_us = p50?;
    stats.p99_us = p99?;
    Some(stats)
}

/// wrk prints times as `812.00us`, `1.23ms`, `2.00s` or `1.00m`.
fn parse_wrk_time(s: &str) -> Option<f64> {
    let split = s.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().ok()?;
    let factor = match unit {
        "us" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" => 60e6,
        "h" => 3600e6,
        _ => return None,
    };
    Some(num * factor)
}

fn fmt_latency(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

// === A tiny HTTP/1.1 client ===

/// A response read with the std library (`Connection: close`).
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn status_ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn idem_result(&self) -> &str {
        self.header("x-idempotent-result").unwrap_or("(none)")
    }
}

fn post(addr: SocketAddr, path: &str, key: Option<&str>) -> BoxResult<Reply> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        BODY.len()
    );
    if let Some(key) = key {
        let _ = write!(head, "Idempotency-Key: {key}\r\n");
    }
    http_exchange(addr, &(head + "\r\n" + BODY))
}

fn get(addr: SocketAddr, path: &str) -> BoxResult<Reply> {
    http_exchange(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    )
}

fn http_exchange(addr: SocketAddr, request: &str) -> BoxResult<Reply> {
    let line = request.lines().next().unwrap_or_default();
    let exchange = || -> std::io::Result<Vec<u8>> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        Ok(raw)
    };
    let raw = exchange().map_err(|e| format!("{line} to {addr}: {e}"))?;
    parse_reply(&raw).ok_or_else(|| format!("{line} to {addr}: malformed HTTP response").into())
}

fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers.iter().any(|(n, v)| {
        n.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Some(Reply {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).ok()?;
        let size_text = size_text.split(';').next()?.trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

// === idemgate metrics ===

/// `idemgate_requests_total` by (route, result).
type Counters = BTreeMap<(String, String), u64>;

fn read_metrics(expect: &Expect) -> BoxResult<Counters> {
    let admin = match expect {
        Expect::Nothing => return Ok(Counters::new()),
        Expect::Forward { admin, .. } | Expect::Miss { admin, .. } | Expect::Hit { admin, .. } => {
            *admin
        }
    };
    let reply = get(admin, "/metrics")?;
    if !reply.status_ok() {
        return Err(format!("GET /metrics on {admin} answered {}", reply.status).into());
    }
    Ok(parse_request_counters(&String::from_utf8_lossy(
        &reply.body,
    )))
}

fn parse_request_counters(text: &str) -> Counters {
    let mut out = Counters::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("idemgate_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == name).then(|| v.trim().trim_matches('"').to_owned())
            })
        };
        if let (Some(route), Some(result), Ok(v)) =
            (label("route"), label("result"), value.trim().parse::<f64>())
        {
            out.insert((route, result), v as u64);
        }
    }
    out
}

// === CPU accounting ===

/// CPU time used during a measured run (in seconds of one core).
#[derive(Debug, Default, Clone)]
struct CpuUse {
    wall: f64,
    machine_busy: f64,
    backend: f64,
    proxy: Option<f64>,
    wrk: f64,
    /// The idemgate process's threads by name (workers, log writer, admin...), busiest first.
    idemgate_threads: Vec<(String, f64)>,
}

/// Samples `/proc` before a run so [`CpuSampler::finish`] can take the difference.
struct CpuSampler {
    started: Instant,
    machine: f64,
    backend_pids: Vec<u32>,
    proxy_pids: Vec<u32>,
    backend: f64,
    proxy: f64,
    children: f64,
    idemgate_pid: Option<u32>,
    threads: BTreeMap<String, f64>,
}

impl CpuSampler {
    fn new(lab: &Lab, sc: &Scenario) -> Self {
        let backend_pids = lab.pids("backend");
        let proxy_pids = match sc.name {
            "direct" => Vec::new(),
            "nginx proxy" => lab.pids("nginx-proxy"),
            _ if sc.redis_port.is_some() => {
                let mut p = lab.pids("idemgate-redis");
                p.extend(lab.pids("redis"));
                p
            }
            _ => lab.pids("idemgate"),
        };
        let idemgate_pid = match sc.expect {
            Expect::Nothing => None,
            _ => proxy_pids.first().copied(),
        };
        CpuSampler {
            threads: idemgate_pid.map(thread_cpu_secs).unwrap_or_default(),
            idemgate_pid,
            started: Instant::now(),
            machine: machine_busy_secs(),
            backend: pids_cpu_secs(&backend_pids),
            proxy: pids_cpu_secs(&proxy_pids),
            backend_pids,
            proxy_pids,
            children: children_cpu_secs(),
        }
    }

    fn finish(self) -> CpuUse {
        CpuUse {
            wall: self.started.elapsed().as_secs_f64(),
            machine_busy: machine_busy_secs() - self.machine,
            backend: pids_cpu_secs(&self.backend_pids) - self.backend,
            proxy: (!self.proxy_pids.is_empty())
                .then(|| pids_cpu_secs(&self.proxy_pids) - self.proxy),
            // wrk is the only child reaped during the run, so this is its CPU time.
            wrk: children_cpu_secs() - self.children,
            idemgate_threads: self.idemgate_pid.map_or_else(Vec::new, |pid| {
                let mut diff: Vec<(String, f64)> = thread_cpu_secs(pid)
                    .into_iter()
                    .map(|(name, after)| {
                        let before = self.threads.get(&name).copied().unwrap_or(0.0);
                        (name, after - before)
                    })
                    .filter(|(_, secs)| *secs > 0.0)
                    .collect();
                diff.sort_by(|a, b| b.1.total_cmp(&a.1));
                diff
            }),
        }
    }
}

/// Name and utime + stime (in ticks) from a `/proc/.../stat` file.
fn read_stat(path: &str) -> Option<(String, u64)> {
    let stat = fs::read_to_string(path).ok()?;
    let (head, after) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_owned();
    // Fields after the parenthesised name; utime and stime are fields 14 and 15 of the file.
    let f: Vec<&str> = after.split_whitespace().collect();
    Some((
        name,
        f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?,
    ))
}

/// CPU seconds of a process's threads, summed by thread name.
fn thread_cpu_secs(pid: u32) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.filter_map(Result::ok) {
        let path = format!("{}/stat", task.path().display());
        if let Some((name, ticks)) = read_stat(&path) {
            *out.entry(name).or_insert(0.0) += ticks as f64 / clock_ticks();
        }
    }
    out
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime of the processes, in seconds.
fn pids_cpu_secs(pids: &[u32]) -> f64 {
    let ticks: u64 = pids
        .iter()
        .filter_map(|pid| read_stat(&format!("/proc/{pid}/stat")))
        .map(|(_, ticks)| ticks)
        .sum();
    ticks as f64 / clock_ticks()
}

/// Busy time of all cores (everything but idle and iowait), in seconds.
fn machine_busy_secs() -> f64 {
    let Ok(stat) = fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    total.saturating_sub(idle) as f64 / clock_ticks()
}

/// CPU time of this process's reaped children, in seconds.
fn children_cpu_secs() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we pass and nothing else.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) != 0 {
            return 0.0;
        }
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Children of `pid` (nginx's workers), from `/proc`.
fn child_pids(pid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                })
                == Some(pid)
        })
        .collect()
}

// === The machine ===

struct Machine {
    nproc: usize,
    cpu_model: String,
    kernel: String,
}

impl Machine {
    fn describe() -> Self {
        let cpu_model = fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            kernel,
        }
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "machine: nproc = {}, {}, Linux {}",
            self.nproc, self.cpu_model, self.kernel
        )
    }
}

// === The report ===

fn report(
    machine: &Machine,
    background: f64,
    opts: &Options,
    outcome: &Outcome,
    lab: &Lab,
) -> String {
    let rows = &outcome.rows;
    let rps = |name: &str| rows.iter().find(|r| r.name == name).map(|r| r.wrk.rps);
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    let (direct, nginx, plain) = (
        rps("direct"),
        rps("nginx proxy"),
        rps("idemgate pass-through"),
    );

    let mut out = String::new();
    let _ = writeln!(out, "{machine}");
    let _ = writeln!(
        out,
        "wrk: -t1 -c{} -d{}s --latency per row (after an unreported {}s warm-up), POST of {} JSON bytes; \
         backend nginx {} (worker_processes 1), nginx proxy worker_processes {} with a buffered access log, idemgate threads: {} logging at info",
        opts.connections,
        opts.duration.as_secs(),
        opts.warmup.as_secs(),
        BODY.len(),
        lab.nginx_version,
        opts.workers,
        opts.workers
    );
    if opts.rounds > 1 {
        let _ = writeln!(
            out,
            "rounds: {} (rows interleaved; each row shows its median round by req/s)",
            opts.rounds
        );
    }
    let _ = writeln!(
        out,
        "machine load before the run: {:.0}% of one core",
        background * 100.0
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| scenario | req/s | p50 | p99 | vs direct | vs nginx proxy | vs idemgate pass-through |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {} | {} | {} | {} | {} |",
            r.name,
            r.wrk.rps,
            fmt_latency(r.wrk.p50_us),
            fmt_latency(r.wrk.p99_us),
            ratio(Some(r.wrk.rps), direct),
            ratio(Some(r.wrk.rps), nginx),
            ratio(Some(r.wrk.rps), plain),
        );
    }
    let _ = writeln!(out);

    // Targets as (label, numerator row, denominator row, minimum ratio).
    let targets = [
        (
            "pass-through / nginx",
            "idemgate pass-through",
            "nginx proxy",
            0.80,
        ),
        (
            "keyed miss / pass-through",
            "keyed miss",
            "idemgate pass-through",
            0.80,
        ),
        ("keyed hit / nginx", "keyed hit", "nginx proxy", 1.00),
        (
            "keyed miss (redis) / pass-through",
            "keyed miss (redis)",
            "idemgate pass-through",
            0.60,
        ),
        (
            "keyed hit (redis) / nginx",
            "keyed hit (redis)",
            "nginx proxy",
            1.00,
        ),
    ];
    for (label, num, den, min) in targets {
        let (Some(a), Some(b)) = (rps(num), rps(den)) else {
            continue;
        };
        let x = if b > 0.0 { a / b } else { 0.0 };
        let verdict = if x >= min { "met" } else { "NOT met" };
        let _ = write!(out, "{label} = {x:.2} (target >= {min:.2}): {verdict}");
        if outcome.per_round.len() > 1 {
            // The same ratio within each round, whose rows ran minutes apart at most.
            let each: Vec<String> = outcome
                .per_round
                .iter()
                .map(|round| ratio(round.get(num).copied(), round.get(den).copied()))
                .collect();
            let _ = write!(out, " [per round: {}]", each.join(", "));
        }
        let _ = writeln!(out);
    }
    for r in rows {
        if let Some(rt) = r.redis_per_request {
            let _ = writeln!(out, "{}: {rt:.2} Redis round trips per request", r.name);
        }
    }
    if let Some(m) = &outcome.redis_memory {
        let _ = writeln!(out, "{m}");
    }
    for n in &outcome.notes {
        let _ = writeln!(out, "note: {n}");
    }

    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "CPU during each measured run (100% = one core; {} cores):",
        machine.nproc
    );
    let _ = writeln!(
        out,
        "| scenario | machine busy | wrk | backend | proxy | other | proxy CPU per request |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let pct = |secs: f64| format!("{:.0}%", 100.0 * secs / r.cpu.wall.max(1e-9));
        let requests = r.wrk.requests.max(1) as f64;
        let (proxy, per_req) = match r.cpu.proxy {
            Some(p) => (pct(p), format!("{:.1} µs", p * 1e6 / requests)),
            None => ("-".into(), "-".into()),
        };
        let other =
            r.cpu.machine_busy - r.cpu.wrk - r.cpu.backend - r.cpu.proxy.unwrap_or_default();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.name,
            pct(r.cpu.machine_busy),
            pct(r.cpu.wrk),
            pct(r.cpu.backend),
            proxy,
            pct(other.max(0.0)),
            per_req
        );
    }
    let _ = writeln!(
        out,
        "(other = busy time not charged to these processes: other tenants of the machine, \
         interrupts and softirq work the kernel accounts to no process{})",
        if rows.iter().any(|r| r.name.contains("(redis)")) {
            "; for the Redis rows, proxy = idemgate + redis-server"
        } else {
            ""
        }
    );
    let noisy: Vec<&str> = rows
        .iter()
        .filter(|r| {
            let other =
                r.cpu.machine_busy - r.cpu.wrk - r.cpu.backend - r.cpu.proxy.unwrap_or_default();
            other / r.cpu.wall.max(1e-9) > 0.25
        })
        .map(|r| r.name)
        .collect();
    if !noisy.is_empty() {
        let _ = writeln!(
            out,
            "warning: more than 25% of a core went elsewhere during: {} (a busy machine: \
             compare ratios of quiet rows{})",
            noisy.join(", "),
            if opts.rounds > 1 {
                ", and the per-round ratios"
            } else {
                ", or rerun with --rounds 3"
            }
        );
    }
    for r in rows.iter().filter(|r| !r.cpu.idemgate_threads.is_empty()) {
        let threads: Vec<String> = r
            .cpu
            .idemgate_threads
            .iter()
            .map(|(name, secs)| format!("{name} {:.0}%", 100.0 * secs / r.cpu.wall.max(1e-9)))
            .collect();
        let _ = writeln!(out, "idemgate threads, {}: {}", r.name, threads.join(", "));
    }

    let _ = writeln!(out);
    if outcome.failures.is_empty() {
        let _ = writeln!(
            out,
            "checks: all passed (no non-2xx, no socket errors, idemgate counted only the expected result per row, probes saw MISS/HIT, the nginx proxy logged every request)"
        );
    } else {
        let _ = writeln!(out, "checks FAILED:");
        for f in &outcome.failures {
            let _ = writeln!(out, "  - {f}");
        }
    }
    out
}

// === The lab: temp dir and child processes ===

/// A child process stopped (SIGTERM, then SIGKILL) when dropped.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        stop(&mut self.child);
    }
}

fn stop(child: &mut Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill only sends a signal to our own child, which has not been reaped yet (so the
        // pid cannot have been reused).
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Owns the temporary directory and every process started in it. Fields drop in order: the
/// processes are stopped before their directory is removed.
struct Lab {
    procs: Vec<Proc>,
    dir: TempDir,
    nginx_version: String,
}

impl Lab {
    fn new(keep: bool) -> BoxResult<Self> {
        let nginx_version = Command::new("nginx")
            .arg("-v")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_owned())
            .and_then(|s| s.rsplit('/').next().map(str::to_owned))
            .unwrap_or_else(|| "?".into());
        Ok(Lab {
            procs: Vec::new(),
            dir: TempDir::new(keep)?,
            nginx_version,
        })
    }

    fn dir(&self) -> &Path {
        &self.dir.path
    }

    fn write(&self, name: &str, contents: &str) -> BoxResult<PathBuf> {
        let path = self.dir().join(name);
        fs::write(&path, contents)?;
        Ok(path)
    }

    fn spawn(&mut self, name: &str, mut cmd: Command, log: &Path) -> BoxResult<()> {
        let out = fs::File::create(log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        self.procs.push(Proc {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        });
        Ok(())
    }

    fn start_nginx(&mut self, name: &str, conf: &str) -> BoxResult<()> {
        let conf_path = self.write(&format!("{name}.conf"), conf)?;
        let dir = self.dir().to_path_buf();
        let mut cmd = Command::new("nginx");
        cmd.arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf_path)
            // Also the log for messages before the config is read; keeps nginx off system paths.
            .arg("-e")
            .arg(dir.join(format!("{name}-error.log")));
        self.spawn(name, cmd, &dir.join(format!("{name}.out")))
    }

    fn start_idemgate(&mut self, name: &str, bin: &Path, config: &Path) -> BoxResult<()> {
        let dir = self.dir().to_path_buf();
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(config)
            .env("IDEMGATE_LOG", "info")
            .env_remove("IDEMGATE_LOG_FORMAT")
            // pingora's pid file and upgrade socket go to the temp dir.
            .env("TMPDIR", &dir);
        self.spawn(name, cmd, &logs_dir(&dir).join(format!("{name}.log")))
    }

    /// The pids of a started process and of its children (nginx's workers).
    fn pids(&self, name: &str) -> Vec<u32> {
        self.procs
            .iter()
            .filter(|p| p.name == name)
            .flat_map(|p| {
                let pid = p.child.id();
                std::iter::once(pid).chain(child_pids(pid))
            })
            .collect()
    }

    /// Fails when a started process has exited, showing the end of its log.
    fn check_alive(&mut self) -> BoxResult<()> {
        for p in &mut self.procs {
            if let Ok(Some(status)) = p.child.try_wait() {
                return Err(format!(
                    "{} exited ({status}); end of {} (--keep keeps it):\n{}",
                    p.name,
                    p.log.display(),
                    tail(&p.log)
                )
                .into());
            }
        }
        Ok(())
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Where the access logs go: a directory of their own, not the one holding idemgate's config.
/// idemgate watches its config's directory, so a log written next to the config would wake
/// its watcher thread (and the kernel's inotify) on every flush: work no deployment does, where
/// logs go to stdout and the config sits in its own mount.
fn logs_dir(dir: &Path) -> PathBuf {
    dir.join("logs")
}

/// The temporary directory, removed on drop unless `--keep` was given.
struct TempDir {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
}

impl TempDir {
    fn new(keep: bool) -> BoxResult<Self> {
        let dir = tempfile::Builder::new()
            .prefix("idemgate-bench-")
            .tempdir()?;
        let path = dir.path().to_path_buf();
        fs::create_dir(logs_dir(&path))?;
        let dir = if keep {
            let _ = dir.keep();
            None
        } else {
            Some(dir)
        };
        Ok(TempDir { dir, path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        match self.dir.take() {
            Some(dir) => {
                let _ = dir.close();
            }
            None => eprintln!("bench: kept {}", self.path.display()),
        }
    }
}

// === Helpers ===

/// `target/release/idemgate`, next to the `examples/` directory this program runs from.
fn idemgate_binary() -> BoxResult<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("idemgate"))
        .ok_or("cannot locate the target directory from this executable's path")?;
    if !bin.is_file() {
        return Err(format!(
            "{} is missing: build it first with `cargo build --release --bins --examples`",
            bin.display()
        )
        .into());
    }
    Ok(bin)
}

fn require_tool(tool: &str) -> BoxResult<()> {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    if found {
        Ok(())
    } else {
        Err(
            format!("`{tool}` is not on the PATH (apt-get install wrk nginx-light redis-server)")
                .into(),
        )
    }
}

/// `idemgate --config F --check`; the error is idemgate's own message.
fn check_config(bin: &Path, config: &Path) -> Result<(), String> {
    let out = Command::new(bin)
        .arg("--config")
        .arg(config)
        .arg("--check")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        Err(if msg.is_empty() {
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        } else {
            msg
        })
    }
}

/// Reserves `n` distinct free loopback ports. They are released before the servers bind them;
/// the window is small and nothing else on this machine is expected to race for them.
fn free_ports(n: usize) -> BoxResult<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

fn wait_for_tcp(lab: &mut Lab, addr: SocketAddr) -> BoxResult<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        lab.check_alive()?;
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("nothing listens on {addr} after {START_TIMEOUT:?}").into());
        }
        sleep(Duration::from_millis(50));
    }
}

/// Waits until `GET path` on `addr` answers at all (any status means the server is up), then
/// until it answers 2xx, which is what `/readyz` promises.
fn wait_for_http(lab: &mut Lab, addr: SocketAddr, path: &str) -> BoxResult<()> {
    wait_for_tcp(lab, addr)?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        lab.check_alive()?;
        match get(addr, path) {
            Ok(r) if r.status_ok() => return Ok(()),
            Ok(r) if Instant::now() > deadline => {
                return Err(format!("GET http://{addr}{path} answers {}", r.status).into())
            }
            Err(e) if Instant::now() > deadline => {
                return Err(format!("GET http://{addr}{path}: {e}").into())
            }
            _ => sleep(Duration::from_millis(50)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk_output() {
        let text = "Running 10s test @ http://127.0.0.1:1/orders
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   612.00us  100.00us   5.00ms   90.00%
    Req/Sec    50.00k     1.00k   52.00k    70.00%
  Latency Distribution
     50%  598.00us
     75%  650.00us
     90%  700.00us
     99%    1.20ms
  500000 requests in 10.00s, 80.00MB read
  Socket errors: connect 0, read 2, write 0, timeout 0
  Non-2xx or 3xx responses: 3
Requests/sec:  49999.50
Transfer/sec:      8.00MB
";
        let s = parse_wrk(text).unwrap();
        assert_eq!(s.rps, 49999.5);
        assert_eq!(s.p50_us, 598.0);
        assert_eq!(s.p99_us, 1200.0);
        assert_eq!(s.requests, 500_000);
        assert_eq!(s.non_2xx, 3);
        assert_eq!(
            s.socket_errors.as_deref(),
            Some("connect 0, read 2, write 0, timeout 0")
        );
    }

    #[test]
    fn sums_commandstats_without_info() {
        let text = "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=5,usec_per_call=0.5,rejected_calls=0,failed_calls=0\r\ncmdstat_info:calls=4,usec=1\r\ncmdstat_ping:calls=2,usec=1\r\ncmdstat_hset:calls=9,usec=1\r\n";
        assert_eq!(sum_commandstats(text), 12);
    }

    #[test]
    fn parses_request_counters() {
        let text = "# TYPE idemgate_requests_total counter\n\
                    idemgate_requests_total{result=\"MISS\",route=\"orders\"} 42\n\
                    idemgate_requests_total{result=\"FORWARD\",route=\"plain\"} 7\n";
        let c = parse_request_counters(text);
        assert_eq!(c[&("orders".to_owned(), "MISS".to_owned())], 42);
        assert_eq!(c[&("plain".to_owned(), "FORWARD".to_owned())], 7);
    }

    #[test]
    fn dechunks() {
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
    }
}
