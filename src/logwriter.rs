//! A batching log writer: request threads append lines to a shared buffer, and one thread writes
//! the buffer out every 50 ms (or sooner when it grows past 64 KiB).
//!
//! A writer thread woken per line (a channel send and a futex wake per request) cost more than
//! formatting the line; batching makes logging a few `write(2)`s a second. Lines are delayed by
//! at most one interval, and [`BatchWriter::flush_now`] empties the buffer on exit. If the
//! buffer reaches its hard cap because the sink is stuck, new lines are dropped and counted, so
//! a blocked stderr never stalls requests.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const FLUSH_EVERY: Duration = Duration::from_millis(50);
const SOON: usize = 64 * 1024;
const HARD_CAP: usize = 16 * 1024 * 1024;

struct Shared {
    buf: Mutex<Vec<u8>>,
    wake: Condvar,
    dropped: AtomicU64,
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
        let shared = Arc::new(Shared {
            buf: Mutex::new(Vec::with_capacity(SOON)),
            wake: Condvar::new(),
            dropped: AtomicU64::new(0),
        });
        let writer = BatchWriter {
            shared,
            sink: Arc::new(Mutex::new(sink)),
        };
        let w = writer.clone();
        let spawned = std::thread::Builder::new()
            .name("log writer".into())
            .spawn(move || loop {
                let full = {
                    let guard = w.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
                    let (guard, _) = w
                        .shared
                        .wake
                        .wait_timeout(guard, FLUSH_EVERY)
                        .unwrap_or_else(|e| e.into_inner());
                    !guard.is_empty()
                };
                if full {
                    w.flush_now();
                }
            });
        if spawned.is_err() {
            eprintln!("idemgate: cannot start the log writer thread; logs are written inline");
        }
        writer
    }

    /// Writes out everything buffered so far.
    pub fn flush_now(&self) {
        let pending = {
            let mut guard = self.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *guard, Vec::with_capacity(SOON))
        };
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let dropped = self.shared.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let _ = writeln!(
                sink,
                "idemgate: {dropped} log lines dropped (log sink too slow)"
            );
        }
        let _ = sink.write_all(&pending);
        let _ = sink.flush();
    }
}

impl Write for BatchWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
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
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (entered, entered_rx) = std::sync::mpsc::sync_channel(1);
        let sink = StuckSink {
            out: out.clone(),
            gate: gate.clone(),
            entered,
        };
        let mut w = BatchWriter::new(Box::new(sink));
        writeln!(w, "first").unwrap();
        // The background flush now hangs in the sink, holding "first".
        entered_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the writer thread reached the sink");

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
            ["idemgate: 500 log lines dropped (log sink too slow)"]
        );
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
        writeln!(w, "later").unwrap();
        std::thread::sleep(FLUSH_EVERY * 4);
        assert!(String::from_utf8(sink.0.lock().unwrap().clone())
            .unwrap()
            .ends_with("later\n"));
    }
}
