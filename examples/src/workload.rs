//! A closed-loop client workload against the kv service, shared by
//! `kv-client bench` and `demo`: each worker thread issues blocking calls
//! back to back, half puts and half gets, and checks every get.

use crate::kv::{GetRequest, PutRequest, kv_client::KvClient};
use hdrhistogram::Histogram;
use std::time::{Duration, Instant};

/// Keys the workload cycles through.
const KEYS: u64 = 1024;

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Calls issued.
    pub calls: u64,
    /// Calls that failed or returned a wrong value.
    pub errors: u64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th-percentile latency, microseconds.
    pub p99_us: f64,
    /// Calls per second over the whole run.
    pub rps: f64,
    /// The first error seen, if any.
    pub first_error: Option<String>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "calls={} errors={} p50_us={:.1} p99_us={:.1} rps={:.0}",
            self.calls, self.errors, self.p50_us, self.p99_us, self.rps
        )
    }
}

/// The value the workload stores under `key`: derived from it, so any get
/// can be checked without shared state.
pub fn value_for(key: &str) -> Vec<u8> {
    let mut v = format!("value-of-{key}-").into_bytes();
    v.resize(64, b'.');
    v
}

/// Runs `calls` calls over `concurrency` threads sharing `client`'s connection.
pub fn run(client: &KvClient, calls: u64, concurrency: usize) -> Summary {
    let concurrency = concurrency.max(1) as u64;
    let start = Instant::now();
    let results: Vec<(Histogram<u64>, u64, Option<String>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..concurrency)
            .map(|w| {
                let client = client.clone();
                let n = calls / concurrency + u64::from(w < calls % concurrency);
                s.spawn(move || worker(&client, w, n))
            })
            .collect();
        workers
            .into_iter()
            .map(|h| h.join().expect("workload thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
    let mut errors = 0;
    let mut first_error = None;
    for (h, e, first) in results {
        hist.add(&h).expect("same bounds");
        errors += e;
        first_error = first_error.or(first);
    }
    Summary {
        calls,
        errors,
        p50_us: hist.value_at_quantile(0.50) as f64 / 1000.0,
        p99_us: hist.value_at_quantile(0.99) as f64 / 1000.0,
        rps: calls as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
        first_error,
    }
}

fn worker(client: &KvClient, w: u64, n: u64) -> (Histogram<u64>, u64, Option<String>) {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
    let mut errors = 0;
    let mut first_error = None;
    for i in 0..n {
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
        let ns = t.elapsed().max(Duration::from_nanos(1)).as_nanos() as u64;
        hist.saturating_record(ns);
        if let Err(status) = outcome {
            errors += 1;
            first_error.get_or_insert_with(|| status.to_string());
        }
    }
    (hist, errors, first_error)
}
