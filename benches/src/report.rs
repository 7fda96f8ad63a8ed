//! `bench-report`: turns the JSON records of a sweep into `REPORT.md`, its
//! tables, the targets verdict, and SVG charts.

use crate::measure::{Kind, Measurement, Mode};
use crate::svg::{Chart, PALETTE, Scale, Series, human};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// Reads JSON Lines files of [`Measurement`]s, in order.
pub fn load(paths: &[impl AsRef<Path>]) -> Result<Vec<Measurement>, String> {
    let mut out = Vec::new();
    for path in paths {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            out.push(
                serde_json::from_str(line)
                    .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?,
            );
        }
    }
    Ok(out)
}

/// The fabrics in report order, with their baselines.
pub const FABRICS: &[(&str, Kind, &str)] = &[
    ("mem", Kind::Channel, "crossbeam channel ping-pong"),
    ("tcp", Kind::Tonic, "tonic (gRPC) on loopback TCP"),
    (
        "tls",
        Kind::Plaintext,
        "rdma-rpc on tcp:// in the clear; ours: tcp:// over TLS",
    ),
    (
        "tcp-tokio",
        Kind::Tonic,
        "tonic (gRPC) on loopback TCP; ours: tcp://, calls from tasks on a multi-thread tokio runtime, as tonic's",
    ),
    (
        "grpc-face",
        Kind::Tonic,
        "tonic's own server; ours: our server's gRPC face (tonic's clients both)",
    ),
    (
        "rdma",
        Kind::Perftest,
        "perftest ib_write_lat / ib_write_bw",
    ),
];

/// A record's place in the sweep: kind, fabric, size, concurrency, connections.
type Key = (Kind, String, usize, usize, usize);

/// The record of each (kind, fabric, size, concurrency, connections) in
/// `mode`. A cell measured several times in a sweep (rdma:// runs each
/// unary cell more than once: the guest's figures swing from run to run)
/// is represented by its median run: the one whose calls/s is the median
/// of ours (the lower of the two middle ones for an even count), with
/// that same run's baseline record, which holds the ratios between the
/// two.
fn representative(records: &[Measurement], mode: Mode) -> BTreeMap<Key, &Measurement> {
    let mut runs: BTreeMap<Key, Vec<&Measurement>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.mode == mode) {
        let key = (
            r.kind,
            r.fabric.clone(),
            r.size,
            r.concurrency,
            r.connections,
        );
        runs.entry(key).or_default().push(r);
    }
    let median = |list: &[&Measurement]| {
        let mut order: Vec<usize> = (0..list.len()).collect();
        order.sort_by(|&a, &b| list[a].rps.total_cmp(&list[b].rps));
        order[(order.len() - 1) / 2]
    };
    runs.iter()
        .map(|(key, list)| {
            let ours_key = (Kind::Rpc, key.1.clone(), key.2, key.3, key.4);
            let pick = match runs.get(&ours_key) {
                // A baseline run pairs with ours of the same turn.
                Some(ours) if ours.len() == list.len() => median(ours),
                _ => median(list),
            };
            (key.clone(), list[pick])
        })
        .collect()
}

fn size_label(size: usize) -> String {
    if size >= 1 << 20 && size % (1 << 20) == 0 {
        format!("{} MiB", size >> 20)
    } else if size >= 1024 && size % 1024 == 0 {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// What a target judges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Figure {
    /// Our p50 / the baseline's.
    RatioP50,
    /// Our rps / the baseline's.
    RatioRps,
    /// Our CPU time per call / the baseline's.
    RatioCpu,
    /// Our calls per second.
    Rps,
    /// Our CPU time per call, µs.
    CpuPerCall,
    /// Our rps at this concurrency / our rps at the given one.
    RpsOver(usize),
}

/// A target of the issue, judged from the figures.
#[derive(Debug, Clone)]
pub struct Target {
    /// Unary calls or stream messages (the figures then count messages).
    pub mode: Mode,
    /// Fabric.
    pub fabric: &'static str,
    /// Payload size.
    pub size: usize,
    /// Concurrency the figure is taken at (one connection).
    pub concurrency: usize,
    /// What is judged.
    pub figure: Figure,
    /// `true`: at most `bound`; `false`: at least.
    pub at_most: bool,
    /// The bound.
    pub bound: f64,
}

const fn target(
    fabric: &'static str,
    size: usize,
    concurrency: usize,
    figure: Figure,
    at_most: bool,
    bound: f64,
) -> Target {
    Target {
        mode: Mode::Unary,
        fabric,
        size,
        concurrency,
        figure,
        at_most,
        bound,
    }
}

impl Target {
    /// The same target, judged on `--stream` records.
    const fn on_streams(self) -> Target {
        Target {
            mode: Mode::Stream,
            ..self
        }
    }
}

/// The targets, with default settings: tcp:// at 64 B and 1 KiB, at 1, 8
/// and 64 calls outstanding, p50 ≤ 0.5×, rps ≥ 2× and CPU per call ≤ 0.5×
/// tonic's; mem:// 64 B p50 ≤ 3× the channel ping-pong at concurrency 1,
/// and at 64 at least 1,000,000 calls/s at ≤ 1.5 µs of CPU per call;
/// rdma:// 64 B p50 ≤ 1.5× perftest's at concurrency 1, rps ≥ 0.6×
/// perftest's at 8, and rps at 8 ≥ 2× rps at 1; tcp:// server streaming of
/// 64 B messages at ≥ 3× tonic's messages per second. Bandwidth (one
/// server stream of large messages, by rendezvous): 1 MiB messages on
/// tcp:// at ≥ 1.5× tonic's MB/s; on rdma://, 1 MiB and larger at ≥ 0.8×
/// `ib_write_bw`'s at the same size.
pub const TARGETS: &[Target] = &[
    target("tcp", 64, 1, Figure::RatioP50, true, 0.5),
    target("tcp", 64, 1, Figure::RatioRps, false, 2.0),
    target("tcp", 64, 1, Figure::RatioCpu, true, 0.5),
    target("tcp", 64, 8, Figure::RatioP50, true, 0.5),
    target("tcp", 64, 8, Figure::RatioRps, false, 2.0),
    target("tcp", 64, 8, Figure::RatioCpu, true, 0.5),
    target("tcp", 64, 64, Figure::RatioP50, true, 0.5),
    target("tcp", 64, 64, Figure::RatioRps, false, 2.0),
    target("tcp", 64, 64, Figure::RatioCpu, true, 0.5),
    target("tcp", 1024, 1, Figure::RatioP50, true, 0.5),
    target("tcp", 1024, 1, Figure::RatioRps, false, 2.0),
    target("tcp", 1024, 1, Figure::RatioCpu, true, 0.5),
    target("tcp", 1024, 8, Figure::RatioP50, true, 0.5),
    target("tcp", 1024, 8, Figure::RatioRps, false, 2.0),
    target("tcp", 1024, 8, Figure::RatioCpu, true, 0.5),
    target("tcp", 1024, 64, Figure::RatioP50, true, 0.5),
    target("tcp", 1024, 64, Figure::RatioRps, false, 2.0),
    target("tcp", 1024, 64, Figure::RatioCpu, true, 0.5),
    target("mem", 64, 1, Figure::RatioP50, true, 3.0),
    target("mem", 64, 64, Figure::Rps, false, 1_000_000.0),
    target("mem", 64, 64, Figure::CpuPerCall, true, 1.5),
    target("rdma", 64, 1, Figure::RatioP50, true, 1.5),
    target("rdma", 64, 8, Figure::RatioRps, false, 0.6),
    target("rdma", 64, 8, Figure::RpsOver(1), false, 2.0),
    target("tcp", 64, 1, Figure::RatioRps, false, 3.0).on_streams(),
    target("tcp", 1 << 20, 1, Figure::RatioRps, false, 1.5).on_streams(),
    target("rdma", 1 << 20, 1, Figure::RatioRps, false, 0.8).on_streams(),
    target("rdma", 16 << 20, 1, Figure::RatioRps, false, 0.8).on_streams(),
    target("rdma", 256 << 20, 1, Figure::RatioRps, false, 0.8).on_streams(),
];

impl Target {
    /// The figure's name as the report shows it, against baseline `rn`.
    fn name(&self, rn: &str) -> String {
        if self.mode == Mode::Stream {
            return match self.figure {
                Figure::RatioP50 => format!("streams: ratio_gap_p50_vs_{rn}"),
                Figure::RatioRps => format!("streams: ratio_msgs_per_s_vs_{rn}"),
                Figure::RatioCpu => format!("streams: ratio_cpu_vs_{rn}"),
                Figure::Rps | Figure::RpsOver(_) => "streams: msgs_per_s".to_owned(),
                Figure::CpuPerCall => "streams: cpu_us_per_msg".to_owned(),
            };
        }
        match self.figure {
            Figure::RatioP50 => format!("ratio_p50_vs_{rn}"),
            Figure::RatioRps => format!("ratio_rps_vs_{rn}"),
            Figure::RatioCpu => format!("ratio_cpu_vs_{rn}"),
            Figure::Rps => "rps".to_owned(),
            Figure::CpuPerCall => "cpu_us_per_call".to_owned(),
            Figure::RpsOver(c) => format!("rps / rps at concurrency {c}"),
        }
    }

    /// The measured figure, and the errors of the runs it comes from.
    fn measure(&self, map: &BTreeMap<Key, &Measurement>, base: Kind) -> (Option<f64>, u64) {
        let at = |kind: Kind, c: usize| map.get(&(kind, self.fabric.to_owned(), self.size, c, 1));
        let ours = at(Kind::Rpc, self.concurrency);
        let theirs = at(base, self.concurrency);
        let errors = |r: Option<&&Measurement>| r.map_or(0, |r| r.errors);
        match self.figure {
            Figure::RatioP50 | Figure::RatioRps | Figure::RatioCpu => {
                let v = theirs.and_then(|b| match self.figure {
                    Figure::RatioP50 => b.ratio_p50,
                    Figure::RatioRps => b.ratio_rps,
                    _ => b.ratio_cpu,
                });
                (v, errors(ours) + errors(theirs))
            }
            Figure::Rps => (ours.map(|r| r.rps), errors(ours)),
            Figure::CpuPerCall => (ours.and_then(|r| r.cpu_us_per_call), errors(ours)),
            Figure::RpsOver(c) => {
                let low = at(Kind::Rpc, c);
                let v = ours
                    .zip(low)
                    .map(|(hi, lo)| hi.rps / lo.rps.max(f64::EPSILON));
                (v, errors(ours) + errors(low))
            }
        }
    }
}

/// Renders the report: the markdown, and the SVG files (name, content) it
/// links to under `svg_dir` (relative to the markdown file).
pub fn render(
    records: &[Measurement],
    preamble: &str,
    svg_dir: &str,
) -> (String, Vec<(String, String)>) {
    let map = representative(records, Mode::Unary);
    let streams = representative(records, Mode::Stream);
    let mut md = String::new();
    let mut svgs = Vec::new();
    md.push_str(preamble.trim_end());
    md.push_str("\n\n");

    md.push_str("## Targets\n\n");
    md.push_str("Judged from the figures below, as measured; ratios are ours / baseline.\n\n");
    md.push_str("| fabric | size | concurrency | figure | target | measured | verdict |\n|---|---|---|---|---|---|---|\n");
    for t in TARGETS {
        let Some(base) = FABRICS.iter().find(|f| f.0 == t.fabric).map(|f| f.1) else {
            continue;
        };
        let on = if t.mode == Mode::Stream {
            &streams
        } else {
            &map
        };
        let (value, errors) = t.measure(on, base);
        let op = if t.at_most { "≤" } else { "≥" };
        let verdict = match value.filter(|v| v.is_finite()) {
            Some(_) if errors > 0 => "not judged: calls failed",
            Some(v) if (t.at_most && v <= t.bound) || (!t.at_most && v >= t.bound) => "**met**",
            Some(_) => "**not met**",
            None => "no data",
        };
        let digits = if t.figure == Figure::Rps { 0 } else { 3 };
        let _ = writeln!(
            md,
            "| {}:// | {} | {} | {} | {op} {} | {} | {verdict} |",
            t.fabric,
            size_label(t.size),
            t.concurrency,
            t.name(base.ratio_name()),
            t.bound,
            fmt_opt(value, digits)
        );
    }
    let rdma_rps: Vec<String> = [1, 8, 64]
        .iter()
        .filter_map(|&c| {
            map.get(&(Kind::Perftest, "rdma".to_owned(), 64, c, 1))
                .and_then(|r| r.ratio_rps)
                .map(|v| format!("{v:.3} at concurrency {c}"))
        })
        .collect();
    if !rdma_rps.is_empty() {
        let _ = writeln!(
            md,
            "\nrdma:// 64 B `ratio_rps_vs_verbs` at every concurrency measured: {}.",
            rdma_rps.join(", ")
        );
    }
    md.push('\n');

    streams_section(&mut md, &streams);

    for &(fabric, base_kind, base_name) in FABRICS {
        let ours: Vec<&Measurement> = map
            .iter()
            .filter(|((k, f, _, _, _), _)| *k == Kind::Rpc && f == fabric)
            .map(|(_, r)| *r)
            .collect();
        if ours.is_empty() {
            let _ = writeln!(md, "## {fabric}://\n\nNo results.\n");
            continue;
        }
        let rn = base_kind.ratio_name();
        let _ = writeln!(md, "## {fabric}:// (baseline: {base_name})\n");
        let _ = writeln!(
            md,
            "| size | concurrency | connections | calls | errors (both) | p50 µs | p99 µs | p99.9 µs | rps | CPU µs/call | {rn} p50 µs | {rn} p99 µs | {rn} rps | {rn} CPU µs/call | ratio_p50_vs_{rn} | ratio_rps_vs_{rn} | ratio_cpu_vs_{rn} |"
        );
        md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in &ours {
            let b = map.get(&(
                base_kind,
                fabric.to_owned(),
                r.size,
                r.concurrency,
                r.connections,
            ));
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
                size_label(r.size),
                r.concurrency,
                r.connections,
                r.calls,
                r.errors + b.map_or(0, |b| b.errors),
                r.p50_us,
                r.p99_us,
                r.p999_us,
                r.rps,
                fmt_opt(r.cpu_us_per_call, 2),
                fmt_opt(b.map(|b| b.p50_us), 1),
                fmt_opt(b.map(|b| b.p99_us), 1),
                fmt_opt(b.map(|b| b.rps), 0),
                fmt_opt(b.and_then(|b| b.cpu_us_per_call), 2),
                fmt_opt(b.and_then(|b| b.ratio_p50), 3),
                fmt_opt(b.and_then(|b| b.ratio_rps), 3),
                fmt_opt(b.and_then(|b| b.ratio_cpu), 3),
            );
        }
        md.push('\n');
        if base_kind == Kind::Perftest {
            md.push_str(
                "`ib_write_lat` keeps one write outstanding whatever the concurrency, so \
                 above concurrency 1 the verbs p50 is still a single write's round trip, \
                 and `ratio_p50_vs_verbs` there includes the queueing of C calls on our \
                 side that the baseline does not have. `ib_write_bw` runs with C writes \
                 outstanding (`-t C`).\n\n",
            );
        }

        let sizes: Vec<usize> = {
            let mut s: Vec<usize> = ours.iter().map(|r| r.size).collect();
            s.dedup();
            s
        };
        let concurrencies: Vec<usize> = {
            // The charts show one connection; more are in the table.
            let mut c: Vec<usize> = ours
                .iter()
                .filter(|r| r.connections == 1)
                .map(|r| r.concurrency)
                .collect();
            c.sort_unstable();
            c.dedup();
            c
        };
        let cdf_c = concurrencies.first().copied().unwrap_or(1);

        // Latency CDF at the lowest concurrency: ours solid, baseline dashed.
        let mut series = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            for (kind, dashed, who) in [(Kind::Rpc, false, "rdma-rpc"), (base_kind, true, rn)] {
                if let Some(r) = map.get(&(kind, fabric.to_owned(), size, cdf_c, 1)) {
                    series.push(Series {
                        label: format!("{who} {}", size_label(size)),
                        color,
                        dashed,
                        points: r.cdf.iter().map(|&(q, us)| (q, us)).collect(),
                    });
                }
            }
        }
        let cdf = Chart {
            title: format!("{fabric}:// round-trip latency, concurrency {cdf_c}"),
            x_label: "percentile".into(),
            x: Scale::Nines { nines: 4.0 },
            x_unit: "",
            y_label: "latency (µs, log)".into(),
            y: Scale::log_covering(series.iter().flat_map(|s| s.points.iter().map(|p| p.1))),
            y_unit: "",
            series,
        };
        let cdf_name = format!("latency-{fabric}.svg");
        svgs.push((cdf_name.clone(), cdf.render()));

        // Throughput against concurrency.
        let mut series = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            for (kind, dashed, who) in [(Kind::Rpc, false, "rdma-rpc"), (base_kind, true, rn)] {
                let points: Vec<(f64, f64)> = concurrencies
                    .iter()
                    .filter_map(|&c| {
                        map.get(&(kind, fabric.to_owned(), size, c, 1))
                            .map(|r| (c as f64, r.rps))
                    })
                    .collect();
                if !points.is_empty() {
                    series.push(Series {
                        label: format!("{who} {}", size_label(size)),
                        color,
                        dashed,
                        points,
                    });
                }
            }
        }
        let rps = Chart {
            title: format!("{fabric}:// throughput"),
            x_label: "calls outstanding (log)".into(),
            x: Scale::log_covering(concurrencies.iter().map(|&c| c as f64)),
            x_unit: "",
            y_label: "calls per second (log)".into(),
            y: Scale::log_covering(series.iter().flat_map(|s| s.points.iter().map(|p| p.1))),
            y_unit: "",
            series,
        };
        let rps_name = format!("throughput-{fabric}.svg");
        svgs.push((rps_name.clone(), rps.render()));
        let _ = writeln!(
            md,
            "![{fabric}:// latency percentiles]({svg_dir}/{cdf_name})\n![{fabric}:// throughput]({svg_dir}/{rps_name})\n"
        );

        let extras: Vec<String> = map
            .iter()
            .filter(|((k, f, _, _, _), _)| *k == base_kind && f == fabric)
            .filter(|(_, r)| !r.extra.is_empty())
            .map(|(_, r)| {
                let figures: Vec<String> = r
                    .extra
                    .iter()
                    .map(|(k, v)| format!("{k}={}", human(*v)))
                    .collect();
                format!(
                    "- {} at concurrency {} over {} connection(s): {}",
                    size_label(r.size),
                    r.concurrency,
                    r.connections,
                    figures.join(" ")
                )
            })
            .collect();
        if !extras.is_empty() {
            let _ = writeln!(md, "{rn}'s own figures (one-way latencies, µs):\n");
            md.push_str(&extras.join("\n"));
            md.push_str("\n\n");
        }
    }
    (md, svgs)
}

/// The `--stream` records: one table, each run beside its baseline.
fn streams_section(md: &mut String, streams: &BTreeMap<Key, &Measurement>) {
    let ours: Vec<&Measurement> = streams
        .iter()
        .filter(|((k, _, _, _, _), _)| *k == Kind::Rpc)
        .map(|(_, r)| *r)
        .collect();
    if ours.is_empty() {
        return;
    }
    md.push_str(
        "## Server streams\n\n`rpc-bench --stream`: messages of echo `Stream` calls, each \
         checked; a gap is the time between two messages of a stream; CPU is the \
         process's (client and server) per message.\n\n",
    );
    md.push_str(
        "| fabric | size | streams | messages | errors (both) | gap p50 µs | gap p99 µs | msgs/s | MB/s | CPU µs/msg | baseline | baseline msgs/s | baseline CPU µs/msg | ratio msgs/s | ratio CPU |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n",
    );
    for &(fabric, base_kind, _) in FABRICS {
        for r in ours.iter().filter(|r| r.fabric == fabric) {
            let b = streams.get(&(
                base_kind,
                fabric.to_owned(),
                r.size,
                r.concurrency,
                r.connections,
            ));
            let _ = writeln!(
                md,
                "| {fabric}:// | {} | {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.1} | {} | {} | {} | {} | {} | {} |",
                size_label(r.size),
                r.concurrency,
                r.calls,
                r.errors + b.map_or(0, |b| b.errors),
                r.p50_us,
                r.p99_us,
                r.rps,
                r.rps * r.size as f64 / 1e6,
                fmt_opt(r.cpu_us_per_call, 3),
                b.map_or("–", |_| base_kind.ratio_name()),
                fmt_opt(b.map(|b| b.rps), 0),
                fmt_opt(b.and_then(|b| b.cpu_us_per_call), 3),
                fmt_opt(b.and_then(|b| b.ratio_rps), 3),
                fmt_opt(b.and_then(|b| b.ratio_cpu), 3),
            );
        }
    }
    md.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::{Params, Tally};
    use std::time::Duration;

    fn rec(kind: Kind, fabric: &str, size: usize, c: usize, us: u64) -> Measurement {
        let mut t = Tally::default();
        for _ in 0..100 {
            t.record(Duration::from_micros(us), Ok(()));
        }
        let p = Params {
            mode: Mode::Unary,
            stream_len: None,
            size,
            concurrency: c,
            connections: 1,
            calls: 100,
            warmup: 0,
        };
        Measurement::from_tally(
            kind,
            fabric,
            format!("{fabric}://x"),
            p,
            &t,
            0,
            Duration::from_millis(us / 10),
        )
    }

    #[test]
    fn renders_tables_targets_and_charts() {
        let ours = rec(Kind::Rpc, "mem", 64, 1, 10);
        let mut base = rec(Kind::Channel, "mem", 64, 1, 5);
        base.set_ratios(&ours);
        let (md, svgs) = render(&[ours, base], "# Report", "report");
        assert!(
            md.contains("| mem:// | 64 B | 1 | ratio_p50_vs_channel | ≤ 3 | 2.000 | **met** |"),
            "{md}"
        );
        assert!(
            md.contains("| tcp:// | 64 B | 8 | ratio_rps_vs_tonic | ≥ 2 | – | no data |"),
            "{md}"
        );
        // Absolute figures and scaling, judged from our own records.
        let mut fast = rec(Kind::Rpc, "mem", 64, 64, 10);
        fast.rps = 1_200_000.0;
        fast.cpu_us_per_call = Some(2.0);
        let one = rec(Kind::Rpc, "rdma", 64, 1, 100);
        let mut eight = rec(Kind::Rpc, "rdma", 64, 8, 100);
        eight.rps = one.rps * 1.5;
        let mut wide = rec(Kind::Rpc, "mem", 64, 64, 10);
        wide.connections = 16;
        let (md, _) = render(&[fast, one, eight, wide], "# Report", "report");
        for row in [
            "| mem:// | 64 B | 64 | rps | ≥ 1000000 | 1200000 | **met** |",
            "| mem:// | 64 B | 64 | cpu_us_per_call | ≤ 1.5 | 2.000 | **not met** |",
            "| rdma:// | 64 B | 8 | rps / rps at concurrency 1 | ≥ 2 | 1.500 | **not met** |",
            "| 64 B | 64 | 16 | 100 |",
        ] {
            assert!(md.contains(row), "{row} not in\n{md}");
        }
        assert!(md.contains("## mem:// (baseline"));
        assert!(md.contains("](report/latency-mem.svg)"));
        assert_eq!(svgs.len(), 2);
    }

    #[test]
    fn a_cell_run_several_times_shows_its_median_run() {
        let mut records = Vec::new();
        for (rps, base_rps) in [(30.0, 100.0), (10.0, 50.0), (20.0, 40.0)] {
            let mut ours = rec(Kind::Rpc, "rdma", 64, 8, 100);
            ours.rps = rps;
            let mut base = rec(Kind::Perftest, "rdma", 64, 8, 10);
            base.rps = base_rps;
            base.set_ratios(&ours);
            records.extend([ours, base]);
        }
        let map = representative(&records, Mode::Unary);
        let key = |kind| (kind, "rdma".to_owned(), 64, 8, 1);
        // The median of ours is the third run (20 calls/s): its own
        // baseline (40) comes with it, not the median baseline (50).
        assert_eq!(map[&key(Kind::Rpc)].rps, 20.0);
        assert_eq!(map[&key(Kind::Perftest)].rps, 40.0);
        assert_eq!(map[&key(Kind::Perftest)].ratio_rps, Some(0.5));
    }

    #[test]
    fn stream_records_get_their_table_and_target() {
        let stream = |kind| {
            let mut r = rec(kind, "tcp", 64, 1, 1);
            r.mode = Mode::Stream;
            r
        };
        let mut ours = stream(Kind::Rpc);
        ours.rps = 6_000_000.0;
        let mut tonic = stream(Kind::Tonic);
        tonic.rps = 5_000_000.0;
        tonic.set_ratios(&ours);
        let (md, _) = render(&[ours, tonic], "# Report", "report");
        for row in [
            "| tcp:// | 64 B | 1 | streams: ratio_msgs_per_s_vs_tonic | ≥ 3 | 1.200 | **not met** |",
            "## Server streams",
            "| tcp:// | 64 B | 1 | 100 | 0 |",
        ] {
            assert!(md.contains(row), "{row} not in\n{md}");
        }
        // Stream records are not unary calls: no unary table for them.
        assert!(md.contains("## tcp://\n\nNo results."), "{md}");
    }
}
