//! The access log: one line per request, written straight into the batching log writer.
//!
//! Formatting this line through `tracing`'s fmt layer (field visitors, `core::fmt`, a timestamp
//! formatted from scratch, styling even with colours off) cost about a tenth of a forwarded
//! request. The line is still governed by `IDEMGATE_LOG` like every other (`target
//! idemgate::access`, level INFO) and has the same shape: the fmt layer's text format, or a flat
//! JSON object under `IDEMGATE_LOG_FORMAT=json`. When no writer was installed (the library used
//! on its own), the line goes through `tracing` as before.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::logwriter::BatchWriter;

/// The log target of access lines.
pub const TARGET: &str = "idemgate::access";

struct Sink {
    writer: BatchWriter,
    json: bool,
}

static SINK: OnceLock<Sink> = OnceLock::new();

/// A line written straight to stderr (past the log writer), as its lines are: see
/// [`notice_line`], at level ERROR, JSON under JSON logging.
pub fn stderr_line(target: &str, message: &str, extra: &[(&str, &str)], plain: &str) -> String {
    let json = SINK.get().is_some_and(|s| s.json);
    notice_line(json, "ERROR", target, message, extra, plain)
}

/// One whole line (newline included) of idemgate's own, outside the tracing pipeline: with
/// `json` an object like the log's (`timestamp`, `level`, `target`, `message`, then `extra`'s
/// members: names, and values already in JSON), else `idemgate: <message>` followed by the
/// `plain` text.
pub(crate) fn notice_line(
    json: bool,
    level: &str,
    target: &str,
    message: &str,
    extra: &[(&str, &str)],
    plain: &str,
) -> String {
    if !json {
        return format!("idemgate: {message}{plain}\n");
    }
    let mut buf = b"{\"timestamp\":\"".to_vec();
    write_timestamp(&mut buf, SystemTime::now());
    buf.extend_from_slice(b"\",\"level\":");
    json_str(&mut buf, level);
    buf.extend_from_slice(b",\"target\":");
    json_str(&mut buf, target);
    buf.extend_from_slice(b",\"message\":");
    json_str(&mut buf, message);
    for (name, value) in extra {
        buf.push(b',');
        json_str(&mut buf, name);
        buf.push(b':');
        buf.extend_from_slice(value.as_bytes());
    }
    buf.extend_from_slice(b"}\n");
    String::from_utf8_lossy(&buf).into_owned()
}

/// Sends access lines to `writer` from now on, as JSON when `json`.
pub fn install(writer: BatchWriter, json: bool) {
    let _ = SINK.set(Sink { writer, json });
}

/// Log lines dropped since start by the installed writer (0 without one).
pub fn dropped_lines() -> u64 {
    SINK.get().map_or(0, |sink| sink.writer.dropped_total())
}

/// One request, as logged.
pub struct AccessLine<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub route: &'a str,
    pub result: &'a str,
    pub status: u16,
    pub duration: Duration,
    /// Short label of the record hash (never the key).
    pub record: Option<crate::key::HashLabel>,
    /// The record's execution id (`X-Idempotency-Id`), once the request claimed or read it.
    pub execution_id: Option<u64>,
    pub error: Option<&'a dyn std::fmt::Display>,
}

thread_local! {
    static LINE: RefCell<(Vec<u8>, Stamp)> = RefCell::new((Vec::with_capacity(256), Stamp::default()));
}

/// Logs `line` if `idemgate::access` is enabled at INFO.
pub fn log(line: &AccessLine<'_>) {
    if !tracing::enabled!(target: "idemgate::access", tracing::Level::INFO) {
        return;
    }
    let Some(sink) = SINK.get() else {
        tracing::info!(
            target: "idemgate::access",
            method = line.method,
            path = line.path,
            route = line.route,
            result = line.result,
            status = line.status,
            duration_ms = %Millis(line.duration),
            record = line.record.map(tracing::field::display),
            execution_id = line.execution_id,
            error = line.error.map(tracing::field::display),
        );
        return;
    };
    // `try_with`: a line written from a request's drop while the thread is being torn down
    // is left out rather than panicking there.
    let _ = LINE.try_with(|cell| {
        let mut cell = cell.borrow_mut();
        let (buf, stamp) = &mut *cell;
        buf.clear();
        format(buf, stamp, line, sink.json);
        let mut writer = sink.writer.clone();
        let _ = writer.write_all(buf);
    });
}

/// Writes `line` as the fmt layer's text line, or as a flat JSON object when `json`.
fn format(buf: &mut Vec<u8>, stamp: &mut Stamp, line: &AccessLine<'_>, json: bool) {
    let f = Fields { json };
    if json {
        buf.extend_from_slice(b"{\"timestamp\":\"");
        stamp.write(buf, SystemTime::now());
        buf.extend_from_slice(b"\",\"level\":\"INFO\"");
    } else {
        stamp.write(buf, SystemTime::now());
        buf.extend_from_slice(b"  INFO idemgate::access:");
    }
    f.key(buf, "method");
    f.symbol(buf, line.method.as_bytes());
    for (key, value) in [
        ("path", line.path),
        ("route", line.route),
        ("result", line.result),
    ] {
        f.key(buf, key);
        f.quoted(buf, value);
    }
    f.key(buf, "status");
    buf.extend_from_slice(crate::upstream::itoa(line.status.into(), &mut [0; 20]));
    f.key(buf, "duration_ms");
    millis(buf, line.duration);
    if let Some(record) = line.record {
        f.key(buf, "record");
        f.symbol(buf, &record.hex());
    }
    // A string in JSON too: a Snowflake id is above the integers a JSON number keeps exactly
    // in many readers (2^53).
    if let Some(id) = line.execution_id {
        f.key(buf, "execution_id");
        f.symbol(buf, crate::upstream::itoa(id, &mut [0; 20]));
    }
    if let Some(error) = line.error {
        f.key(buf, "error");
        f.symbol(buf, error.to_string().as_bytes());
    }
    buf.extend_from_slice(if json {
        &b",\"target\":\"idemgate::access\"}\n"[..]
    } else {
        &b"\n"[..]
    });
}

/// How one field is written in either format.
struct Fields {
    json: bool,
}

impl Fields {
    /// ` key=` or `,"key":`.
    fn key(&self, buf: &mut Vec<u8>, key: &str) {
        if self.json {
            buf.extend_from_slice(b",\"");
            buf.extend_from_slice(key.as_bytes());
            buf.extend_from_slice(b"\":");
        } else {
            buf.push(b' ');
            buf.extend_from_slice(key.as_bytes());
            buf.push(b'=');
        }
    }

    /// A string the fmt layer prints as `Debug` (quoted).
    fn quoted(&self, buf: &mut Vec<u8>, value: &str) {
        if self.json {
            json_str(buf, value);
        } else {
            debug_str(buf, value);
        }
    }

    /// A value the fmt layer prints as `Display` (bare): a JSON string all the same.
    fn symbol(&self, buf: &mut Vec<u8>, value: &[u8]) {
        if self.json {
            json_str(buf, &String::from_utf8_lossy(value));
        } else {
            buf.extend_from_slice(value);
        }
    }
}

/// Milliseconds with microsecond precision: `1.336`.
/// A duration as milliseconds to the microsecond (`1336.492`), for the fmt layer's line when
/// no sink is installed (an embedding, such as the demo): an `f64` there printed float noise
/// (`0.25139500000000004`).
struct Millis(Duration);

impl std::fmt::Display for Millis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut buf = Vec::with_capacity(24);
        millis(&mut buf, self.0);
        f.write_str(std::str::from_utf8(&buf).map_err(|_| std::fmt::Error)?)
    }
}

fn millis(buf: &mut Vec<u8>, d: Duration) {
    let micros = d.as_micros().min(u64::MAX as u128) as u64;
    buf.extend_from_slice(crate::upstream::itoa(micros / 1000, &mut [0; 20]));
    let frac = micros % 1000;
    buf.extend_from_slice(&[
        b'.',
        b'0' + (frac / 100) as u8,
        b'0' + (frac / 10 % 10) as u8,
        b'0' + (frac % 10) as u8,
    ]);
}

/// A string as Rust's `Debug` writes it (what the fmt layer prints for string fields).
fn debug_str(buf: &mut Vec<u8>, s: &str) {
    if s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        let _ = write!(buf, "{s:?}");
    }
}

/// A JSON string literal.
fn json_str(buf: &mut Vec<u8>, s: &str) {
    // Writing a `str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *buf, s);
}

/// Writes `now` as an RFC 3339 UTC timestamp with microseconds, as the log lines carry it.
pub(crate) fn write_timestamp(buf: &mut Vec<u8>, now: SystemTime) {
    Stamp::default().write(buf, now);
}

/// RFC 3339 UTC timestamps with microseconds; the date and time are formatted once a second.
#[derive(Default)]
struct Stamp {
    second: u64,
    /// `2026-11-29T18:26:39.`
    prefix: String,
}

impl Stamp {
    fn write(&mut self, buf: &mut Vec<u8>, now: SystemTime) {
        let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs();
        if secs != self.second || self.prefix.is_empty() {
            self.second = secs;
            self.prefix.clear();
            let (y, mo, d) = civil_from_days((secs / 86_400) as i64);
            let rem = secs % 86_400;
            let _ = write!(
                self.prefix,
                "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.",
                rem / 3600,
                rem / 60 % 60,
                rem % 60
            );
        }
        buf.extend_from_slice(self.prefix.as_bytes());
        let micros = since.subsec_micros();
        let mut digits = [b'0'; 6];
        let mut n = micros;
        for d in digits.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        buf.extend_from_slice(&digits);
        buf.push(b'Z');
    }
}

/// Year, month, day of a day count since 1970-01-01 (proleptic Gregorian calendar).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(path: &str, record: Option<crate::key::HashLabel>) -> AccessLine<'_> {
        AccessLine {
            method: "POST",
            path,
            route: "orders",
            result: "MISS",
            status: 201,
            duration: Duration::from_micros(1_336_492),
            record,
            execution_id: record.map(|_| 386_369_419_159_617_536),
            error: None,
        }
    }

    #[test]
    fn durations_are_milliseconds_to_the_microsecond() {
        for (micros, want) in [
            (251_395u64, "251.395"),
            (251, "0.251"),
            (1_336_492, "1336.492"),
            (0, "0.000"),
        ] {
            assert_eq!(Millis(Duration::from_micros(micros)).to_string(), want);
        }
        // Nanoseconds below a microsecond are dropped, not printed as float noise.
        assert_eq!(
            Millis(Duration::from_nanos(251_395_123)).to_string(),
            "251.395"
        );
    }

    #[test]
    fn timestamps_match_rfc3339_for_known_instants() {
        let mut stamp = Stamp::default();
        for (secs, micros, want) in [
            (0u64, 0u32, "1970-01-01T00:00:00.000000Z"),
            (951_782_400, 5, "2000-02-29T00:00:00.000005Z"),
            (1_796_000_000, 123_456, "2026-11-30T00:53:20.123456Z"),
            (4_102_444_799, 999_999, "2099-12-31T23:59:59.999999Z"),
        ] {
            let mut buf = Vec::new();
            let t = UNIX_EPOCH + Duration::new(secs, micros * 1000);
            stamp.write(&mut buf, t);
            assert_eq!(String::from_utf8(buf).unwrap(), want);
        }
    }

    #[test]
    fn text_lines_have_the_fmt_layer_shape() {
        let mut buf = Vec::new();
        let record = crate::key::hash_label(&[0x41; 32]);
        format(
            &mut buf,
            &mut Stamp::default(),
            &line("/orders", Some(record)),
            false,
        );
        let text = String::from_utf8(buf).unwrap();
        let (_, rest) = text.split_once("Z  ").unwrap();
        assert_eq!(
            rest,
            "INFO idemgate::access: method=POST path=\"/orders\" route=\"orders\" result=\"MISS\" status=201 duration_ms=1336.492 record=4141414141414141 execution_id=386369419159617536\n"
        );
    }

    #[test]
    fn json_lines_parse_and_escape_what_needs_it() {
        let mut buf = Vec::new();
        let path = "/a\"b\\c\u{1}é";
        format(&mut buf, &mut Stamp::default(), &line(path, None), true);
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["path"], path);
        assert_eq!(v["status"], 201);
        assert_eq!(v["duration_ms"].as_f64(), Some(1336.492));
        assert_eq!(v["target"], TARGET);
        assert!(v.get("record").is_none());
    }

    #[test]
    fn text_paths_with_quotes_are_escaped_like_debug() {
        let mut buf = Vec::new();
        debug_str(&mut buf, "/a\"b");
        assert_eq!(buf, br#""/a\"b""#);
    }
}
