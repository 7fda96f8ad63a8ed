//! A closed-loop client workload against the kv service, shared by
//! `kv-client bench` and `demo`: each worker thread issues blocking calls
//! back to back, half puts and half gets, and checks every get. A lost
//! connection (`Unavailable`) stops the run: every later call would fail
//! the same way.

use crate::kv::{GetRequest, PutRequest, kv_client::KvClient};
use hdrhistogram::Histogram;
use rpc_core::{Bytes, Code, Status};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Keys the workload cycles through.
const KEYS: u64 = 1024;

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Calls made (fewer than asked if the run stopped early).
    pub calls: u64,
    /// Calls that failed or returned a wrong value.
    pub errors: u64,
    /// Median latency of the successful calls, microseconds (None if none
    /// succeeded).
    pub p50_us: Option<f64>,
    /// 99th-percentile latency of the successful calls, microseconds.
    pub p99_us: Option<f64>,
    /// Successful calls per second over the whole run.
    pub rps: f64,
    /// The first error seen, if any, with its status code.
    pub first_error: Option<Status>,
    /// The run stopped early: the connection was lost.
    pub stopped: bool,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        write!(
            f,
            "calls={} errors={} p50_us={} p99_us={} rps={:.0}",
            self.calls,
            self.errors,
            us(self.p50_us),
            us(self.p99_us),
            self.rps
        )?;
        if self.stopped {
            write!(f, " stopped=connection-lost")?;
        }
        Ok(())
    }
}

/// What one worker measured.
struct Worker {
    /// Latencies of successful calls, ns.
    hist: Histogram<u64>,
    made: u64,
    errors: u64,
    first_error: Option<(Instant, Status)>,
}

/// The value the workload stores under `key`: derived from it, so any get
/// can be checked without shared state.
pub fn value_for(key: &str) -> Bytes {
    let mut v = format!("value-of-{key}-").into_bytes();
    v.resize(64, b'.');
    v.into()
}

/// Runs `calls` calls over `concurrency` threads sharing `client`'s
/// connection, until done or the connection is lost.
pub fn run(client: &KvClient, calls: u64, concurrency: usize) -> Summary {
    let concurrency = concurrency.max(1) as u64;
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<Worker> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..concurrency)
            .map(|w| {
                let client = client.clone();
                let n = calls / concurrency + u64::from(w < calls % concurrency);
                let stop = &stop;
                s.spawn(move || worker(&client, w, n, stop))
            })
            .collect();
        workers
            .into_iter()
            .map(|h| h.join().expect("workload thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut hist = new_histogram();
    let (mut made, mut errors) = (0, 0);
    let mut first_error: Option<(Instant, Status)> = None;
    for r in results {
        hist.add(&r.hist).expect("same bounds");
        made += r.made;
        errors += r.errors;
        if let Some((at, status)) = r.first_error {
            if first_error.as_ref().is_none_or(|(first, _)| at < *first) {
                first_error = Some((at, status));
            }
        }
    }
    let quantile = |q| (!hist.is_empty()).then(|| hist.value_at_quantile(q) as f64 / 1000.0);
    Summary {
        calls: made,
        errors,
        p50_us: quantile(0.50),
        p99_us: quantile(0.99),
        rps: hist.len() as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
        first_error: first_error.map(|(_, s)| s),
        stopped: stop.load(Ordering::Relaxed),
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

fn worker(client: &KvClient, w: u64, n: u64, stop: &AtomicBool) -> Worker {
    let mut out = Worker {
        hist: new_histogram(),
        made: 0,
        errors: 0,
        first_error: None,
    };
    for i in 0..n {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let key = format!("key-{}", (w * 7919 + i) % KEYS);
        let t = Instant::now();
        let outcome = if i % 2 == 0 {
            client
                .put(PutRequest {
                    key: key.clone(),
                    value: value_for(&key),
                })
                .wait()
                .map(|_| ())
        } else {
            client
                .get(GetRequest { key: key.clone() })
                .wait()
                .and_then(|r| match r.into_inner().value {
                    Some(v) if v != value_for(&key) => Err(rpc_core::Status::data_loss(format!(
                        "wrong value for {key}"
                    ))),
                    _ => Ok(()),
                })
        };
        out.made += 1;
        match outcome {
            Ok(()) => {
                let ns = t.elapsed().max(Duration::from_nanos(1)).as_nanos() as u64;
                out.hist.saturating_record(ns);
            }
            Err(status) => {
                out.errors += 1;
                if status.code() == Code::Unavailable {
                    stop.store(true, Ordering::Relaxed);
                }
                out.first_error.get_or_insert((Instant::now(), status));
            }
        }
    }
    out
}
