//! The `idemgate` binary: parse the CLI, load the config, run, exit.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use idemgate::config::Config;
use idemgate::logwriter::BatchWriter;

// glibc malloc showed up at ~7% of a proxy worker's samples; mimalloc's thread-local free lists
// suit the many short-lived per-request allocations better.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit status for a config that cannot be run (EX_USAGE), as sidecar supervisors expect.
const EXIT_BAD_CONFIG: u8 = 64;
/// Exit status for a listen address that cannot be bound (EX_UNAVAILABLE).
const EXIT_CANNOT_LISTEN: u8 = 69;
/// Exit status for a stop with dead letters the dead-letter file never took (EX_IOERR).
const EXIT_DEAD_LETTERS_LOST: u8 = idemgate::server::EXIT_DEAD_LETTERS_LOST as u8;

/// A reverse proxy that makes non-idempotent HTTP APIs safe to retry.
#[derive(Parser, Debug)]
#[command(name = "idemgate", version, about)]
struct Cli {
    /// Path to the YAML config file.
    #[arg(long, short = 'c', value_name = "FILE")]
    config: PathBuf,

    /// Validate the config and exit: 0 when valid, 1 with a message naming the field otherwise.
    #[arg(long)]
    check: bool,

    /// Reconcile a dead-letter file against the config's Redis store: say what became of each
    /// line (stored, another outcome, executing, missing, expired) and exit 0 when nothing needs
    /// more, 1 when something does.
    #[arg(long, value_name = "DEAD_LETTERS", conflicts_with = "check")]
    reconcile: Option<PathBuf>,

    /// With --reconcile: write the missing responses back, so retries replay them instead of
    /// executing again.
    #[arg(long, requires = "reconcile")]
    apply: bool,
}

/// The log writer, flushed on exit.
static LOG_WRITER: std::sync::OnceLock<BatchWriter> = std::sync::OnceLock::new();

fn flush_logs() {
    if let Some(w) = LOG_WRITER.get() {
        w.flush_now();
    }
}

/// Crates whose debug and trace output carries raw request headers or store commands
/// (pingora-proxy logs every header it sends upstream at debug).
const SECRET_DUMPING_TARGETS: [&str; 4] =
    ["pingora_core", "pingora_proxy", "pingora_http", "redis"];

/// pingora's server loop for plain HTTP apps: the admin listener's.
const ADMIN_SERVER_LOOP: &str = "pingora_core::apps::http_app";

/// The log settings from the environment: `IDEMGATE_LOG` (a tracing filter; unset or empty:
/// `info`) and `IDEMGATE_LOG_FORMAT` (`json` or `text`; unset or empty: text). A filter that
/// does not parse, or another format, is an error naming the variable: taken silently for
/// `info`, a typo would hide the debug output asked for, and an empty filter once turned off
/// every line, errors and the access log included.
fn log_settings() -> Result<(tracing_subscriber::EnvFilter, bool), String> {
    let var = |name: &str| match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name}: not UTF-8")),
    };
    let filter = match var("IDEMGATE_LOG")? {
        None => tracing_subscriber::EnvFilter::new("info"),
        Some(v) => tracing_subscriber::EnvFilter::try_new(&v)
            .map_err(|e| format!("IDEMGATE_LOG: {v:?} is not a log filter: {e}"))?,
    };
    let json = match var("IDEMGATE_LOG_FORMAT")? {
        None => false,
        Some(v) if v.eq_ignore_ascii_case("json") => true,
        Some(v) if v.eq_ignore_ascii_case("text") => false,
        Some(v) => {
            return Err(format!(
                "IDEMGATE_LOG_FORMAT: {v:?} is neither json nor text"
            ))
        }
    };
    Ok((filter, json))
}

fn init_logging(filter: tracing_subscriber::EnvFilter, json: bool) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::fmt;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // At debug and trace these crates dump raw requests and commands (keys, `Authorization`,
    // bodies): whatever level is asked for, they stop at info. A second filter, so it only ever
    // lowers what `IDEMGATE_LOG` enables (a directive in the EnvFilter would also raise it).
    // Its default is the most verbose level the filter can enable (not TRACE): the subscriber's
    // level hint then stays that of `IDEMGATE_LOG`, and the `log` crate's max level with it, so
    // pingora's per-request `debug!` calls stop at a static check instead of reaching the bridge.
    let most = filter.max_level_hint().unwrap_or(LevelFilter::TRACE);
    // The admin listener's server loop (pingora's `http_app`, which nothing else here uses)
    // logs at error a request it cannot parse with its first 2 KiB of raw bytes (a bearer
    // token, a raw key in the path, a principal's credentials), and the raw path of one whose
    // answer it could not write: off entirely. The admin app answers what it can parse itself.
    let cap = Targets::new()
        .with_default(most)
        .with_targets(SECRET_DUMPING_TARGETS.map(|t| (t, LevelFilter::INFO.min(most))))
        .with_target(ADMIN_SERVER_LOOP, LevelFilter::OFF);
    let writer = LOG_WRITER
        .get_or_init(|| BatchWriter::new(Box::new(std::io::stderr())))
        .clone();
    // Colour codes only for a person at a terminal, never into files or log collectors.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    idemgate::accesslog::install(writer.clone(), json);
    writer.set_json(json);
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    if json {
        builder.json().flatten_event(true).finish().with(cap).init();
    } else {
        builder.finish().with(cap).init();
    }
}

/// Turns transparent huge pages off for this process. mimalloc asks for them on its arenas, and
/// under the kernel's default `defrag` setting (`madvise`) the first touch of such memory may
/// compact memory synchronously: a growing embedded store stalled the worker for milliseconds
/// (keyed-miss p99 6.4–7.0 ms with them, 2.0–3.0 ms without, at the same throughput and CPU per
/// request). A kernel without the call (before 3.15) keeps them; nothing else changes.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and reads or writes no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// `--reconcile`: runs [`idemgate::reconcile`] against the config's Redis store, printing a
/// line per dead letter and a summary.
fn reconcile(config: &Config, dead_letters: &std::path::Path, apply: bool) -> ExitCode {
    let mut lines = match idemgate::reconcile::open_dead_letters(dead_letters) {
        Ok(lines) => lines,
        Err(e) => {
            eprintln!("idemgate: cannot read {}: {e}", dead_letters.display());
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let settings = match (config.store.backend, &config.store.redis) {
        (idemgate::config::StoreBackend::Redis, Some(settings)) => settings,
        _ => {
            eprintln!(
                "idemgate: --reconcile needs store.backend: redis (the embedded store lived in \
                 the process that wrote the dead letters)"
            );
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let store: std::sync::Arc<dyn idemgate::store::RecordStore> =
        match idemgate::store::RedisStore::new(settings) {
            Ok(store) => std::sync::Arc::new(store),
            Err(e) => {
                eprintln!("idemgate: store.redis: {e}");
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idemgate: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout().lock();
    match runtime.block_on(idemgate::reconcile::reconcile(
        &store,
        &settings.key_prefix,
        &mut lines,
        apply,
        &mut out,
    )) {
        Ok(tally) if tally.needs_action() => ExitCode::FAILURE,
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: writing the report: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ignores SIGHUP until the config watcher listens for it (it then triggers a reload). Its
/// default action is to terminate: a config-reloader sidecar that signals while the process is
/// still starting would stop it. One that arrives meanwhile is lost, which costs nothing: the
/// watcher compares the file with what was loaded when it starts.
fn ignore_sighup_until_watched() {
    // SAFETY: sets the disposition of one signal to SIG_IGN; no handler of ours runs.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
}

fn main() -> ExitCode {
    ignore_sighup_until_watched();
    idemgate::server::catch_stop_signals_while_starting();
    no_transparent_huge_pages();
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "idemgate: invalid config {}: {e}",
                idemgate::server::describe(&cli.config).display()
            );
            return ExitCode::from(if cli.check { 1 } else { EXIT_BAD_CONFIG });
        }
    };
    if cli.check {
        // Checked as a run would: a worker id from the environment that is no id is refused.
        if let Err(e) = idemgate::server::worker_id_from_env() {
            eprintln!("idemgate: {e}");
            return ExitCode::from(1);
        }
        if let Err(e) = log_settings() {
            eprintln!("idemgate: {e}");
            return ExitCode::from(1);
        }
        for warning in config.warnings() {
            eprintln!("idemgate: warning: {warning}");
        }
        println!("idemgate: config {} is valid", cli.config.display());
        return ExitCode::SUCCESS;
    }
    if let Some(dead_letters) = &cli.reconcile {
        // A reconcile stops on a stop signal as any command does (its report says how far it
        // got); one that came while it started ends it at once.
        idemgate::server::default_stop_signals();
        if let Some(signal) = idemgate::server::stop_signal_while_starting() {
            return ExitCode::from(128 + signal as u8);
        }
        return reconcile(&config, dead_letters, cli.apply);
    }
    match log_settings() {
        Ok((filter, json)) => init_logging(filter, json),
        Err(e) => {
            eprintln!("idemgate: {e}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    }
    match idemgate::server::run(cli.config.clone(), config, flush_logs) {
        Ok(()) => ExitCode::SUCCESS,
        // Said on stderr already; the status tells a supervisor.
        Err(idemgate::server::StartError::DeadLettersLost { .. }) => {
            ExitCode::from(EXIT_DEAD_LETTERS_LOST)
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            flush_logs();
            eprintln!("idemgate: {e}");
            ExitCode::from(match e {
                idemgate::server::StartError::Listen { .. } => EXIT_CANNOT_LISTEN,
                idemgate::server::StartError::Config(_) => EXIT_BAD_CONFIG,
                idemgate::server::StartError::DeadLettersLost { .. } => EXIT_DEAD_LETTERS_LOST,
            })
        }
    }
}
