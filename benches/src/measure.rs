//! What one run measured: the summary line `rpc-bench` prints, and the
//! record it appends to the JSON results.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Longest a single unary call may take before it counts as failed
/// (streams run without a deadline), in every system measured.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Quantiles of the latency distribution kept in every record, for CDF
/// plots: dense in the tail.
pub const CDF_QUANTILES: &[f64] = &[
    0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999,
    0.9995, 0.9999, 1.0,
];

/// A latency histogram in nanoseconds, 1 ns to 100 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// What a set of calls produced: latencies of the successful ones, and the
/// failures.
#[derive(Debug, Clone)]
pub struct Tally {
    /// Latencies of successful calls, nanoseconds.
    pub hist: Histogram<u64>,
    /// Calls that failed or whose echo was wrong.
    pub errors: u64,
    /// The first failure seen.
    pub first_error: Option<String>,
}

/// What a run measures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Unary echo calls: a call is a request and its echo.
    #[default]
    Unary,
    /// Server streams (echo's `Stream`): a "call" is one message of a
    /// stream, its latency the gap since the stream's previous message.
    Stream,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            hist: histogram(),
            errors: 0,
            first_error: None,
        }
    }
}

impl Tally {
    /// Records one call: its latency when it succeeded, else the failure
    /// (a failed call's latency is not recorded: a fast failure must not
    /// look like a fast call).
    pub fn record(&mut self, latency: Duration, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => {
                let ns = latency.as_nanos().clamp(1, u64::MAX as u128) as u64;
                self.hist.saturating_record(ns);
            }
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    /// Counts `n` failures at once (messages a stream never delivered),
    /// with `error` as the reason.
    pub fn record_failures(&mut self, n: u64, error: String) {
        if n > 0 {
            self.errors += n;
            self.first_error.get_or_insert(error);
        }
    }

    /// Adds `other` into this tally.
    pub fn merge(&mut self, other: Tally) {
        self.hist.add(&other.hist).expect("same histogram bounds");
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// A system under measurement, set up once and then asked for rounds of
/// calls: our server and client, or a baseline.
pub trait Bench {
    /// Runs `calls` calls numbered from `first`, the configured number
    /// outstanding; returns what they measured and their wall-clock time.
    fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration);
}

/// What a series of rounds added up to.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// The measured calls.
    pub tally: Tally,
    /// Errors of the warm-up calls.
    pub warmup_errors: u64,
    /// Wall-clock time of the measured rounds, summed.
    pub elapsed: Duration,
    /// CPU time of this process (user + system, all threads) during the
    /// measured rounds, summed.
    pub cpu: Duration,
}

/// CPU time this process has used so far, user + system, all its threads.
pub fn process_cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable `rusage`; getrusage only writes it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return Duration::ZERO;
    }
    // SAFETY: zero-initialised and, as getrusage succeeded, filled in.
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Runs a round of `bench`, adding what it measured to `totals`.
fn measured_round(bench: &mut dyn Bench, first: u64, calls: u64, totals: &mut Totals) {
    let cpu = process_cpu();
    let (tally, elapsed) = bench.round(first, calls);
    totals.cpu += process_cpu().saturating_sub(cpu);
    totals.tally.merge(tally);
    totals.elapsed += elapsed;
}

/// Rounds to split a run into when a baseline is interleaved with it: up to
/// 5, with at least 20 × `concurrency` calls each so that the ramp-up and
/// drain of a round (fewer than `concurrency` calls outstanding) stay a
/// small part of it.
pub fn rounds_for(params: &Params) -> u64 {
    (params.calls / (20 * params.concurrency.max(1) as u64)).clamp(1, 5)
}

/// Warms both systems up, then runs `rounds` rounds of the measured calls,
/// alternating between `ours` and `baseline` (and which goes first), so
/// that a change in the machine's load during the run (other processes on
/// a shared machine) weighs on both alike instead of on whichever ran
/// second. Calls are numbered alike on both sides. Each side's CPU time is
/// the process's, taken over its own rounds only.
pub fn interleave(
    ours: &mut dyn Bench,
    mut baseline: Option<&mut dyn Bench>,
    params: &Params,
    rounds: u64,
) -> (Totals, Totals) {
    let mut totals = (Totals::default(), Totals::default());
    totals.0.warmup_errors = ours.round(0, params.warmup).0.errors;
    if let Some(b) = baseline.as_deref_mut() {
        totals.1.warmup_errors = b.round(0, params.warmup).0.errors;
    }
    let rounds = rounds.clamp(1, params.calls.max(1));
    let mut first = params.warmup;
    for r in 0..rounds {
        let n = params.calls / rounds + u64::from(r < params.calls % rounds);
        match baseline.as_deref_mut() {
            None => measured_round(ours, first, n, &mut totals.0),
            Some(b) if r % 2 == 0 => {
                measured_round(ours, first, n, &mut totals.0);
                measured_round(b, first, n, &mut totals.1);
            }
            Some(b) => {
                measured_round(b, first, n, &mut totals.1);
                measured_round(ours, first, n, &mut totals.0);
            }
        }
        first += n;
    }
    totals
}

/// Which system a record measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// rdma-rpc itself.
    Rpc,
    /// gRPC over tonic on loopback TCP.
    Tonic,
    /// perftest's `ib_write_lat` / `ib_write_bw` on the same device.
    Perftest,
    /// A crossbeam-channel ping-pong between two threads.
    Channel,
    /// rdma-rpc on tcp:// without TLS: the baseline of its runs over TLS.
    Plaintext,
    /// eRPC's echo benchmark (`erpc_bench`), a peer RPC system run beside
    /// rdma:// in the same guest boot: its records are written by
    /// `scripts/bench`, not by `rpc-bench`.
    Erpc,
}

impl Kind {
    /// The name used in ratio keys (`ratio_p50_vs_<name>`).
    pub fn ratio_name(self) -> &'static str {
        match self {
            Kind::Rpc => "rpc",
            Kind::Tonic => "tonic",
            Kind::Perftest => "verbs",
            Kind::Channel => "channel",
            Kind::Plaintext => "plaintext",
            Kind::Erpc => "erpc",
        }
    }
}

/// One line of `rpc-bench` output and one JSON record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// What was measured.
    pub kind: Kind,
    /// Unary calls or stream messages (`calls`, `rps`, the latencies and
    /// `cpu_us_per_call` then count messages).
    #[serde(default)]
    pub mode: Mode,
    /// Stream mode: messages per stream (None: each round's messages split
    /// evenly over `concurrency` streams).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_len: Option<u64>,
    /// The fabric of the rdma-rpc run this belongs to: `mem`, `tcp` or `rdma`.
    pub fabric: String,
    /// Where: the server's bound URL for rdma-rpc, a descriptive URL
    /// (`tonic://…`, `channel://…`, `perftest://…`) for baselines.
    pub url: String,
    /// Request (and reply) payload, bytes.
    pub size: usize,
    /// Calls kept outstanding.
    pub concurrency: usize,
    /// Connections the calls were spread over.
    pub connections: usize,
    /// Calls measured (warm-up excluded).
    pub calls: u64,
    /// Warm-up calls run before, not measured.
    pub warmup: u64,
    /// Failed calls or wrong echoes, warm-up included.
    pub errors: u64,
    /// Median round-trip latency, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Measured calls per second of wall-clock time.
    pub rps: f64,
    /// Wall-clock time of the measured calls, seconds.
    pub elapsed_s: f64,
    /// CPU time per measured call, µs: the process's user + system time
    /// (client and server, every thread) over the measured calls, divided
    /// by their number. None where it was not measured (perftest, older
    /// records).
    #[serde(default)]
    pub cpu_us_per_call: Option<f64>,
    /// `(quantile, µs)` points of the latency distribution.
    pub cdf: Vec<(f64, f64)>,
    /// Figures of a baseline beyond the common ones (perftest's own), by name.
    #[serde(default)]
    pub extra: BTreeMap<String, f64>,
    /// On a baseline record: our p50 divided by this one's.
    #[serde(default)]
    pub ratio_p50: Option<f64>,
    /// On a baseline record: our rps divided by this one's.
    #[serde(default)]
    pub ratio_rps: Option<f64>,
    /// On a baseline record: our CPU time per call divided by this one's.
    #[serde(default)]
    pub ratio_cpu: Option<f64>,
    /// The first error, if any.
    #[serde(default)]
    pub first_error: Option<String>,
    /// Seconds since the Unix epoch when the record was written.
    #[serde(default)]
    pub unix_time: u64,
}

/// The run's parameters, shared by our run and its baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Unary calls or stream messages.
    pub mode: Mode,
    /// Stream mode: messages per stream (None: each round's messages split
    /// evenly over the `concurrency` streams, one each).
    pub stream_len: Option<u64>,
    /// Payload bytes.
    pub size: usize,
    /// Outstanding calls.
    pub concurrency: usize,
    /// Connections.
    pub connections: usize,
    /// Measured calls.
    pub calls: u64,
    /// Warm-up calls.
    pub warmup: u64,
}

impl Measurement {
    /// Builds a record from the [`Totals`] of a series of rounds.
    pub fn from_totals(kind: Kind, fabric: &str, url: String, params: Params, t: &Totals) -> Self {
        let mut m = Self::from_tally(
            kind,
            fabric,
            url,
            params,
            &t.tally,
            t.warmup_errors,
            t.elapsed,
        );
        m.cpu_us_per_call = Some(t.cpu.as_secs_f64() * 1e6 / params.calls.max(1) as f64);
        m
    }

    /// Builds a record from a tally of the measured calls (`warmup_errors`
    /// from the warm-up ones) that took `elapsed`.
    pub fn from_tally(
        kind: Kind,
        fabric: &str,
        url: String,
        params: Params,
        tally: &Tally,
        warmup_errors: u64,
        elapsed: Duration,
    ) -> Measurement {
        let us = |q: f64| {
            if tally.hist.is_empty() {
                0.0
            } else {
                tally.hist.value_at_quantile(q) as f64 / 1000.0
            }
        };
        let cdf = if tally.hist.is_empty() {
            Vec::new()
        } else {
            CDF_QUANTILES.iter().map(|&q| (q, us(q))).collect()
        };
        Measurement {
            kind,
            mode: params.mode,
            stream_len: params.stream_len.filter(|_| params.mode == Mode::Stream),
            fabric: fabric.to_owned(),
            url,
            size: params.size,
            concurrency: params.concurrency,
            connections: params.connections,
            calls: params.calls,
            warmup: params.warmup,
            errors: tally.errors + warmup_errors,
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            rps: params.calls as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
            elapsed_s: elapsed.as_secs_f64(),
            cpu_us_per_call: None,
            cdf,
            extra: BTreeMap::new(),
            ratio_p50: None,
            ratio_rps: None,
            ratio_cpu: None,
            first_error: tally.first_error.clone(),
            unix_time: now_unix(),
        }
    }

    /// Sets this baseline record's ratios against our run `ours`.
    /// A stream baseline without gaps (perftest) gets no gap ratio.
    pub fn set_ratios(&mut self, ours: &Measurement) {
        self.ratio_p50 = (self.mode == Mode::Unary || !self.cdf.is_empty())
            .then(|| ratio(ours.p50_us, self.p50_us));
        self.ratio_rps = Some(ratio(ours.rps, self.rps));
        self.ratio_cpu = match (ours.cpu_us_per_call, self.cpu_us_per_call) {
            (Some(a), Some(b)) => Some(ratio(a, b)),
            _ => None,
        };
    }

    /// The ratio line printed after a baseline's line:
    /// `ratio_p50_vs_tonic=X ratio_rps_vs_tonic=Y`, then
    /// ` ratio_cpu_vs_tonic=Z` where both sides' CPU time was measured.
    /// In stream mode: `ratio_gap_p50_vs_tonic=X ratio_msgs_per_s_vs_tonic=Y`
    /// and the CPU ratio likewise.
    pub fn ratio_line(&self) -> String {
        let name = self.kind.ratio_name();
        let show = |r: Option<f64>| r.map_or_else(|| "nan".to_owned(), |r| format!("{r:.3}"));
        let (p50, rps) = match self.mode {
            Mode::Unary => ("p50", "rps"),
            Mode::Stream => ("gap_p50", "msgs_per_s"),
        };
        let mut line = String::new();
        if self.mode == Mode::Unary || self.ratio_p50.is_some() {
            line += &format!("ratio_{p50}_vs_{name}={} ", show(self.ratio_p50));
        }
        line += &format!("ratio_{rps}_vs_{name}={}", show(self.ratio_rps));
        if self.ratio_cpu.is_some() {
            line += &format!(" ratio_cpu_vs_{name}={}", show(self.ratio_cpu));
        }
        line
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The summary line: `url=… size=… concurrency=… calls=… errors=… p50_us=…
/// p99_us=… p999_us=… rps=… cpu_us_per_call=…`, then a baseline's own
/// figures (`extra`). In stream mode: `url=… mode=stream size=…
/// concurrency=… stream_len=… messages=… errors=… gap_p50_us=… gap_p99_us=…
/// gap_p999_us=… msgs_per_s=… mb_per_s=… cpu_us_per_msg=…` (`stream_len`
/// only when set, gaps only when measured; MB are 10^6 bytes of payload).
impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.mode == Mode::Stream {
            write!(
                f,
                "url={} mode=stream size={} concurrency={}",
                self.url, self.size, self.concurrency
            )?;
            if let Some(len) = self.stream_len {
                write!(f, " stream_len={len}")?;
            }
            write!(f, " messages={} errors={}", self.calls, self.errors)?;
            // No gaps where none were measured (perftest, or nothing arrived).
            if !self.cdf.is_empty() {
                write!(
                    f,
                    " gap_p50_us={:.2} gap_p99_us={:.2} gap_p999_us={:.2}",
                    self.p50_us, self.p99_us, self.p999_us
                )?;
            }
            write!(
                f,
                " msgs_per_s={:.0} mb_per_s={:.1}",
                self.rps,
                self.rps * self.size as f64 / 1e6
            )?;
            if let Some(cpu) = self.cpu_us_per_call {
                write!(f, " cpu_us_per_msg={cpu:.3}")?;
            }
            for (k, v) in &self.extra {
                write!(f, " {k}={v}")?;
            }
            return Ok(());
        }
        write!(
            f,
            "url={} size={} concurrency={} calls={} errors={} p50_us={:.2} p99_us={:.2} p999_us={:.2} rps={:.0}",
            self.url,
            self.size,
            self.concurrency,
            self.calls,
            self.errors,
            self.p50_us,
            self.p99_us,
            self.p999_us,
            self.rps
        )?;
        if let Some(cpu) = self.cpu_us_per_call {
            write!(f, " cpu_us_per_call={cpu:.2}")?;
        }
        for (k, v) in &self.extra {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

impl Tally {
    /// Adds up the tallies of client tasks spawned on a tokio runtime (a
    /// task that failed counts as one failed call).
    pub(crate) async fn join(tasks: Vec<tokio::task::JoinHandle<Tally>>) -> Tally {
        let mut total = Tally::default();
        for task in tasks {
            match task.await {
                Ok(t) => total.merge(t),
                Err(e) => total.record_failures(1, format!("client task failed: {e}")),
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which calls it was asked for, each taking 1 µs.
    struct Fake(Vec<(u64, u64)>);

    impl Bench for Fake {
        fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration) {
            self.0.push((first, calls));
            let mut t = Tally::default();
            for _ in 0..calls {
                t.record(Duration::from_micros(1), Ok(()));
            }
            (t, Duration::from_micros(calls))
        }
    }

    #[test]
    fn interleaves_rounds() {
        let p = Params {
            mode: Mode::Unary,
            stream_len: None,
            size: 64,
            concurrency: 2,
            connections: 1,
            calls: 1003,
            warmup: 10,
        };
        assert_eq!(rounds_for(&p), 5);
        assert_eq!(rounds_for(&Params { calls: 100, ..p }), 2);
        assert_eq!(rounds_for(&Params { calls: 10, ..p }), 1);
        let (mut a, mut b) = (Fake(Vec::new()), Fake(Vec::new()));
        let (ta, tb) = interleave(&mut a, Some(&mut b), &p, 5);
        let want = vec![
            (0, 10),
            (10, 201),
            (211, 201),
            (412, 201),
            (613, 200),
            (813, 200),
        ];
        assert_eq!(a.0, want);
        assert_eq!(b.0, want);
        assert_eq!(ta.tally.hist.len(), 1003);
        assert_eq!(tb.elapsed, Duration::from_micros(1003));
        let p_totals = Measurement::from_totals(Kind::Rpc, "mem", "mem://x".into(), p, &ta);
        assert!(p_totals.cpu_us_per_call.is_some_and(|c| c >= 0.0));
        let mut alone = Fake(Vec::new());
        let (t, none) = interleave(&mut alone, None, &p, 1);
        assert_eq!(alone.0, vec![(0, 10), (10, 1003)]);
        assert_eq!((t.tally.hist.len(), none.tally.hist.len()), (1003, 0));
    }

    #[test]
    fn process_cpu_counts_work_on_any_thread() {
        let before = process_cpu();
        let spin = |d: Duration| {
            let start = std::time::Instant::now();
            let mut x = 0u64;
            while start.elapsed() < d {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        };
        std::thread::spawn(move || spin(Duration::from_millis(30)))
            .join()
            .unwrap();
        spin(Duration::from_millis(30));
        let used = process_cpu() - before;
        assert!(used >= Duration::from_millis(40), "{used:?}");
    }

    #[test]
    fn line_and_ratios() {
        let mut t = Tally::default();
        for us in 1..=1000u64 {
            t.record(Duration::from_micros(us), Ok(()));
        }
        t.record(Duration::from_nanos(1), Err("boom".into()));
        let p = Params {
            mode: Mode::Unary,
            stream_len: None,
            size: 64,
            concurrency: 1,
            connections: 1,
            calls: 1001,
            warmup: 0,
        };
        let ours = Measurement::from_tally(
            Kind::Rpc,
            "mem",
            "mem://x".into(),
            p,
            &t,
            0,
            Duration::from_secs(1),
        );
        assert_eq!(ours.errors, 1);
        assert_eq!(ours.first_error.as_deref(), Some("boom"));
        assert!((ours.p50_us - 500.0).abs() < 1.0, "{}", ours.p50_us);
        assert!((ours.p99_us - 990.0).abs() < 1.5, "{}", ours.p99_us);
        assert_eq!(ours.cdf.len(), CDF_QUANTILES.len());
        let line = ours.to_string();
        assert!(
            line.starts_with("url=mem://x size=64 concurrency=1 calls=1001 errors=1 p50_us=500."),
            "{line}"
        );
        assert!(line.ends_with(" rps=1001"), "{line}");

        let mut base = ours.clone();
        base.kind = Kind::Channel;
        base.p50_us = ours.p50_us / 2.0;
        base.rps = ours.rps * 4.0;
        base.set_ratios(&ours);
        assert_eq!(
            base.ratio_line(),
            "ratio_p50_vs_channel=2.000 ratio_rps_vs_channel=0.250"
        );
        // CPU time per call, where both sides measured it.
        let mut ours = ours;
        ours.cpu_us_per_call = Some(3.0);
        base.cpu_us_per_call = Some(12.0);
        base.set_ratios(&ours);
        assert!(ours.to_string().ends_with(" rps=1001 cpu_us_per_call=3.00"));
        assert_eq!(
            base.ratio_line(),
            "ratio_p50_vs_channel=2.000 ratio_rps_vs_channel=0.250 ratio_cpu_vs_channel=0.250"
        );
        let json = serde_json::to_string(&base).unwrap();
        let back: Measurement = serde_json::from_str(&json).unwrap();
        assert_eq!(back, base);
    }
    #[test]
    fn stream_line_and_ratios() {
        let mut t = Tally::default();
        for _ in 0..100 {
            t.record(Duration::from_micros(2), Ok(()));
        }
        let p = Params {
            mode: Mode::Stream,
            stream_len: Some(10),
            size: 1000,
            concurrency: 2,
            connections: 1,
            calls: 100,
            warmup: 0,
        };
        let mut ours = Measurement::from_tally(
            Kind::Rpc,
            "tcp",
            "tcp://x".into(),
            p,
            &t,
            0,
            Duration::from_millis(1),
        );
        ours.cpu_us_per_call = Some(1.5);
        assert_eq!(
            ours.to_string(),
            "url=tcp://x mode=stream size=1000 concurrency=2 stream_len=10 messages=100 errors=0 \
             gap_p50_us=2.00 gap_p99_us=2.00 gap_p999_us=2.00 msgs_per_s=100000 mb_per_s=100.0 \
             cpu_us_per_msg=1.500"
        );
        let mut tonic = ours.clone();
        tonic.kind = Kind::Tonic;
        tonic.rps = 50_000.0;
        tonic.cpu_us_per_call = Some(3.0);
        tonic.set_ratios(&ours);
        assert_eq!(
            tonic.ratio_line(),
            "ratio_gap_p50_vs_tonic=1.000 ratio_msgs_per_s_vs_tonic=2.000 ratio_cpu_vs_tonic=0.500"
        );
        // perftest measures no gaps: none shown, no gap ratio.
        let mut bw = Measurement::from_tally(
            Kind::Perftest,
            "rdma",
            "perftest://x".into(),
            p,
            &Tally::default(),
            0,
            Duration::from_millis(2),
        );
        bw.set_ratios(&ours);
        assert!(!bw.to_string().contains("gap_"), "{bw}");
        assert_eq!(bw.ratio_line(), "ratio_msgs_per_s_vs_verbs=2.000");
    }
}
