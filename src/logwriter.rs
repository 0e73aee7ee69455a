//! A batching log writer: request threads append lines to a shared buffer, and one thread writes
//! the buffer out every 50 ms (or sooner when it grows past 64 KiB).
//!
//! A writer thread woken per line (a channel send and a futex wake per request) cost more than
//! formatting the line; batching makes logging a few `write(2)`s a second. Lines are delayed by
//! at most one interval, and [`BatchWriter::flush_now`] empties the buffer on exit. If the
//! buffer reaches its hard cap because the sink is stuck, new lines are dropped and counted, so
//! a blocked stderr never stalls requests; nor does it stall exit, which waits for the last
//! flush only [`EXIT_FLUSH_WAIT`].

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const FLUSH_EVERY: Duration = Duration::from_millis(50);
const SOON: usize = 64 * 1024;
const HARD_CAP: usize = 16 * 1024 * 1024;
/// Longest [`BatchWriter::flush_now`] waits for the sink. On exit after a SIGTERM drain, a
/// stderr nobody reads must not keep the process alive: what is not written by then is lost.
pub const EXIT_FLUSH_WAIT: Duration = Duration::from_millis(500);

struct Shared {
    buf: Mutex<Vec<u8>>,
    wake: Condvar,
    /// Lines dropped since start, never reset (`idemgate_log_lines_dropped_total`).
    dropped: AtomicU64,
    /// Of those, the ones a notice has told; written only under the sink's lock.
    told: AtomicU64,
    /// Flushes asked for by [`BatchWriter::flush_now`]; changed only under `buf`'s lock, so the
    /// writer thread knows which asks the buffer it takes covers.
    asked: AtomicU64,
    /// The last ask the writer thread has written out; `written` is signalled when it moves.
    done: Mutex<u64>,
    written: Condvar,
    /// No writer thread could be started: every line goes to the sink as it is written.
    inline: AtomicBool,
    /// The sink failed partway through a line: the next write starts with a newline.
    torn: AtomicBool,
    /// Lines are JSON objects (`IDEMGATE_LOG_FORMAT=json`): the writer's own notices are too.
    json: AtomicBool,
}

/// Writes `data` to `sink` until done or an error (retrying on `Interrupted`, and a few times
/// on `WouldBlock`: a non-blocking stderr that is momentarily full); returns how many bytes
/// went.
fn write_all_counted(sink: &mut dyn Write, data: &[u8]) -> usize {
    let mut sent = 0;
    let mut waits = 0;
    while sent < data.len() {
        match sink.write(&data[sent..]) {
            Ok(0) => break,
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && waits < 20 => {
                waits += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => break,
        }
    }
    sent
}

/// The handle given to the tracing subscriber; cheap to clone.
#[derive(Clone)]
pub struct BatchWriter {
    shared: Arc<Shared>,
    sink: Arc<Mutex<Box<dyn Write + Send>>>,
}

impl BatchWriter {
    /// Starts the flushing thread over `sink`.
    pub fn new(sink: Box<dyn Write + Send>) -> Self {
        let writer = Self::unstarted(sink);
        let w = writer.clone();
        let spawned = std::thread::Builder::new()
            .name("log writer".into())
            .spawn(move || w.run());
        if let Err(e) = spawned {
            // Buffered lines would otherwise wait for exit, or be dropped at the cap, unseen.
            writer.shared.inline.store(true, Ordering::Release);
            eprintln!(
                "idemgate: cannot start the log writer thread ({e}); logs are written inline, \
                 unbatched (a stalled stderr now stalls the requests that log)"
            );
        }
        writer
    }

    /// Writes the writer's own notices (lines dropped) as JSON objects, like the lines it
    /// carries under `IDEMGATE_LOG_FORMAT=json`, so a collector parsing every line as JSON
    /// never meets a plain one.
    pub fn set_json(&self, json: bool) {
        self.shared.json.store(json, Ordering::Relaxed);
    }

    /// The writer over `sink` with no thread behind it yet.
    fn unstarted(sink: Box<dyn Write + Send>) -> Self {
        BatchWriter {
            shared: Arc::new(Shared {
                buf: Mutex::new(Vec::with_capacity(SOON)),
                wake: Condvar::new(),
                dropped: AtomicU64::new(0),
                told: AtomicU64::new(0),
                asked: AtomicU64::new(0),
                done: Mutex::new(0),
                written: Condvar::new(),
                inline: AtomicBool::new(false),
                torn: AtomicBool::new(false),
                json: AtomicBool::new(false),
            }),
            sink: Arc::new(Mutex::new(sink)),
        }
    }

    /// The writer thread: writes the buffer out every interval, when it grows past [`SOON`],
    /// and when a flush is asked for.
    fn run(&self) {
        let mut covered = 0;
        loop {
            let (pending, asked) = {
                let mut guard = self.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
                // An ask made while the last batch was being written has already notified.
                if self.shared.asked.load(Ordering::Relaxed) == covered {
                    guard = self
                        .shared
                        .wake
                        .wait_timeout(guard, FLUSH_EVERY)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                let asked = self.shared.asked.load(Ordering::Relaxed);
                let pending = if guard.is_empty() {
                    Vec::new()
                } else {
                    std::mem::replace(&mut *guard, Vec::with_capacity(SOON))
                };
                (pending, asked)
            };
            if !pending.is_empty() {
                let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
                self.write_out(&mut **sink, &pending);
            }
            if asked != covered {
                covered = asked;
                *self.shared.done.lock().unwrap_or_else(|e| e.into_inner()) = asked;
                self.shared.written.notify_all();
            }
        }
    }

    /// Writes the count of dropped lines, if any, then `pending`, to the locked sink. What the
    /// sink refuses (a full disk, an I/O error) is counted as dropped, reported with the next
    /// batch that gets through, and a line it cut short is ended before the next one starts,
    /// so no two lines run together.
    fn write_out(&self, sink: &mut dyn Write, pending: &[u8]) {
        let torn = self.shared.torn.swap(false, Ordering::Relaxed);
        let dropped = self.untold();
        let mut notice = Vec::new();
        if torn {
            notice.push(b'\n');
        }
        if dropped > 0 {
            let message = format!("{dropped} log lines dropped (log sink too slow or failing)");
            let line = crate::accesslog::notice_line(
                self.shared.json.load(Ordering::Relaxed),
                "WARN",
                "idemgate::logwriter",
                &message,
                &[("dropped", &dropped.to_string())],
                "",
            );
            notice.extend_from_slice(line.as_bytes());
        }
        let sent = write_all_counted(sink, &notice);
        if sent < notice.len() {
            // Nothing of it may stand half written: the next try starts a fresh line.
            self.shared.torn.store(sent > 0 || torn, Ordering::Relaxed);
        } else if dropped > 0 {
            // Only once told: lines dropped meanwhile are told next time.
            self.shared.told.fetch_add(dropped, Ordering::Relaxed);
        }
        let sent = if sent < notice.len() {
            0
        } else {
            write_all_counted(sink, pending)
        };
        if sent < pending.len() {
            let rest = &pending[sent..];
            let lost = rest.iter().filter(|&&b| b == b'\n').count() as u64;
            self.shared
                .dropped
                .fetch_add(lost.max(1), Ordering::Relaxed);
            if sent > 0 && pending[sent - 1] != b'\n' {
                self.shared.torn.store(true, Ordering::Relaxed);
            }
        }
        let _ = sink.flush();
    }

    /// Lines dropped since start: over the hard cap behind a stalled sink, or refused by a
    /// failing one (`idemgate_log_lines_dropped_total`).
    pub fn dropped_total(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Dropped lines no notice has told yet.
    fn untold(&self) -> u64 {
        let told = self.shared.told.load(Ordering::Relaxed);
        self.shared
            .dropped
            .load(Ordering::Relaxed)
            .saturating_sub(told)
    }

    /// Writes out everything buffered so far, waiting at most [`EXIT_FLUSH_WAIT`]. The writing
    /// is the writer thread's, so a sink that blocks holds that thread, never the caller: past
    /// the wait, what is still buffered is given up (it is lost if the process then exits).
    pub fn flush_now(&self) {
        if self.shared.inline.load(Ordering::Acquire) {
            // Every line was written and flushed as it came.
            return;
        }
        let deadline = Instant::now() + EXIT_FLUSH_WAIT;
        let ticket = {
            let _guard = self.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
            let ticket = self.shared.asked.fetch_add(1, Ordering::Relaxed) + 1;
            self.shared.wake.notify_one();
            ticket
        };
        let mut done = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
        while *done < ticket {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            done = self
                .shared
                .written
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Write for BatchWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.shared.inline.load(Ordering::Relaxed) {
            let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
            self.write_out(&mut **sink, data);
            return Ok(data.len());
        }
        let mut guard = self.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
        if guard.len() + data.len() > HARD_CAP {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(data.len());
        }
        guard.extend_from_slice(data);
        if guard.len() >= SOON {
            self.shared.wake.notify_one();
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BatchWriter {
    type Writer = BatchWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A sink that blocks every write until `open` is called, like a stderr nobody reads.
    #[derive(Clone)]
    struct StuckSink {
        out: Sink,
        gate: Arc<(Mutex<bool>, Condvar)>,
        entered: std::sync::mpsc::SyncSender<()>,
    }

    impl StuckSink {
        fn open(gate: &(Mutex<bool>, Condvar)) {
            *gate.0.lock().unwrap() = true;
            gate.1.notify_all();
        }
    }

    /// A writer on a [`StuckSink`] writing into `out`, with its gate, once "first" has been
    /// written and the writer thread hangs in the sink holding it.
    fn stuck_writer(out: Sink) -> (BatchWriter, Arc<(Mutex<bool>, Condvar)>) {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (entered, entered_rx) = std::sync::mpsc::sync_channel(1);
        let sink = StuckSink {
            out,
            gate: gate.clone(),
            entered,
        };
        let mut w = BatchWriter::new(Box::new(sink));
        writeln!(w, "first").unwrap();
        entered_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the writer thread reached the sink");
        (w, gate)
    }

    impl Write for StuckSink {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            let _ = self.entered.try_send(());
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            self.out.write(data)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stuck_sink_never_blocks_writers_and_drops_are_reported() {
        let out = Sink::default();
        // The background flush now hangs in the sink, holding "first".
        let (mut w, gate) = stuck_writer(out.clone());

        // One write per line, as the tracing formatter does; the cap holds a whole number.
        let mut line = vec![b'x'; 1023];
        line.push(b'\n');
        let fit = HARD_CAP / line.len();
        let started = std::time::Instant::now();
        for _ in 0..fit + 500 {
            w.write_all(&line).unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "writers waited for the sink"
        );

        StuckSink::open(&gate);
        w.flush_now();
        // The writer thread may hold the last batch a moment longer than this flush.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let text = loop {
            let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
            if text.lines().filter(|l| l.starts_with('x')).count() == fit
                || std::time::Instant::now() > deadline
            {
                break text;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(text.starts_with("first\n"), "{:?}", &text[..40]);
        assert_eq!(text.lines().filter(|l| l.starts_with('x')).count(), fit);
        let notices: Vec<&str> = text.lines().filter(|l| l.contains("dropped")).collect();
        assert_eq!(
            notices,
            ["idemgate: 500 log lines dropped (log sink too slow or failing)"]
        );
        assert_eq!(w.dropped_total(), 500, "idemgate_log_lines_dropped_total");
    }

    /// A sink that takes `room` more bytes, then fails every write (a full disk).
    #[derive(Clone)]
    struct FullSink {
        out: Sink,
        room: Arc<Mutex<usize>>,
    }

    impl Write for FullSink {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            let mut room = self.room.lock().unwrap();
            if *room == 0 {
                return Err(std::io::Error::other("no space left on device"));
            }
            let n = data.len().min(*room);
            *room -= n;
            self.out.write(&data[..n])
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What a failing sink refuses is counted and told once it takes lines again, and a line
    /// it cut short is ended before the next: no two lines run together (a JSON log line glued
    /// to half of another parses as neither), and nothing vanishes uncounted.
    #[test]
    fn a_failing_sink_loses_no_line_uncounted_and_tears_none_into_another() {
        let out = Sink::default();
        let room = Arc::new(Mutex::new(10));
        let w = BatchWriter::unstarted(Box::new(FullSink {
            out: out.clone(),
            room: room.clone(),
        }));
        let write = |text: &str| {
            let mut sink = w.sink.lock().unwrap();
            w.write_out(&mut **sink, text.as_bytes());
        };
        // 10 bytes go: "{\"n\":1}\n{\"" — the second line is cut, the third refused.
        write("{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n");
        assert_eq!(w.untold(), 2);
        // Still full: the next batch is refused whole and counted.
        write("{\"n\":4}\n");
        assert_eq!(w.untold(), 3);
        *room.lock().unwrap() = 1 << 20;
        write("{\"n\":5}\n");
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "{\"n\":1}");
        assert_eq!(lines[1], "{\"", "the torn line, ended on its own");
        assert!(lines[2].contains("3 log lines dropped"), "{text}");
        assert_eq!(lines[3], "{\"n\":5}");
        assert_eq!(w.untold(), 0, "told once");
        assert_eq!(w.dropped_total(), 3, "counted for good");
    }

    /// Under JSON logging the notice is a JSON object like every other line.
    #[test]
    fn the_dropped_lines_notice_is_json_under_json_logging() {
        let out = Sink::default();
        let room = Arc::new(Mutex::new(0));
        let w = BatchWriter::unstarted(Box::new(FullSink {
            out: out.clone(),
            room: room.clone(),
        }));
        w.set_json(true);
        let write = |text: &str| {
            let mut sink = w.sink.lock().unwrap();
            w.write_out(&mut **sink, text.as_bytes());
        };
        write("{\"n\":1}\n{\"n\":2}\n");
        *room.lock().unwrap() = 1 << 20;
        write("{\"n\":3}\n");
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let notice: serde_json::Value = serde_json::from_str(lines[0]).expect("a JSON line");
        assert_eq!(notice["level"], "WARN");
        assert_eq!(notice["dropped"], 2);
        assert_eq!(
            notice["message"],
            "2 log lines dropped (log sink too slow or failing)"
        );
        let stamp = notice["timestamp"].as_str().expect("a timestamp");
        assert!(stamp.ends_with('Z') && stamp.len() == 27, "{stamp}");
        assert_eq!(lines[1], "{\"n\":3}");
    }

    #[test]
    fn an_exit_flush_gives_up_on_a_stuck_sink() {
        // The writer thread now hangs in the sink, holding it, as on a stderr nobody reads.
        let (mut w, gate) = stuck_writer(Sink::default());
        writeln!(w, "last words").unwrap();

        let (took_tx, took_rx) = std::sync::mpsc::channel();
        let exiting = w.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            exiting.flush_now();
            let _ = took_tx.send(started.elapsed());
        });
        let took = took_rx.recv_timeout(Duration::from_secs(5));
        // Unstick the sink whatever happened, so no thread is left hanging.
        StuckSink::open(&gate);
        let took = took.expect("flush_now waited on the stuck sink");
        assert!(took < Duration::from_secs(1), "flush_now took {took:?}");
    }

    #[test]
    fn without_a_writer_thread_lines_are_written_inline() {
        let sink = Sink::default();
        let mut w = BatchWriter::unstarted(Box::new(sink.clone()));
        w.shared.inline.store(true, Ordering::Release);
        writeln!(w, "at once").unwrap();
        assert_eq!(sink.0.lock().unwrap().as_slice(), b"at once\n");
        w.flush_now();
        assert_eq!(sink.0.lock().unwrap().as_slice(), b"at once\n");
    }

    #[test]
    fn lines_arrive_in_order_after_an_interval_or_a_flush() {
        let sink = Sink::default();
        let mut w = BatchWriter::new(Box::new(sink.clone()));
        for i in 0..100 {
            writeln!(w, "line {i}").unwrap();
        }
        w.flush_now();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let expected: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, expected);
        // Unflushed, it is written by the writer thread's next interval (polled: a loaded
        // machine may run that thread late).
        writeln!(w, "later").unwrap();
        let started = std::time::Instant::now();
        while !sink.0.lock().unwrap().ends_with(b"later\n") {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "never written without a flush"
            );
            std::thread::sleep(FLUSH_EVERY / 5);
        }
    }
}
