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
    /// The system the ratio is taken against where it is not the fabric's
    /// baseline: a peer run beside rdma:// in the same guest boot
    /// ([`Kind::Erpc`]), judged from the medians of [`peer_cells`].
    pub against: Option<Kind>,
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
        against: None,
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

    /// The same target, a ratio against `peer` instead of the baseline.
    const fn against(self, peer: Kind) -> Target {
        Target {
            against: Some(peer),
            ..self
        }
    }
}

/// The targets, with default settings: tcp:// at 64 B and 1 KiB, at 1, 8
/// and 64 calls outstanding, p50 ≤ 0.5×, rps ≥ 2× and CPU per call ≤ 0.5×
/// tonic's; mem:// 64 B p50 ≤ 2× the channel ping-pong's at concurrency
/// 1, and at 64 CPU per call ≤ 1.5× and rps ≥ 0.6× the channel's;
/// rdma:// 64 B p50 ≤ 1.5× perftest's at concurrency 1, rps ≥ 0.6×
/// perftest's at 8, and rps at 8 ≥ 2× rps at 1; against eRPC in the same
/// guest boot, rdma:// 64 B p50 ≤ 1× and rps ≥ 1× eRPC's at concurrency 1,
/// and rps ≥ 1.2× eRPC's at 8; tcp:// server streaming of 64 B messages
/// at ≥ 3× tonic's messages per second. Bandwidth (one server stream of
/// large messages, by rendezvous): 1 MiB messages on tcp:// at ≥ 1.5×
/// tonic's MB/s; on rdma://, 1 MiB and larger at ≥ 0.8× `ib_write_bw`'s
/// at the same size.
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
    target("mem", 64, 1, Figure::RatioP50, true, 2.0),
    target("mem", 64, 64, Figure::RatioCpu, true, 1.5),
    target("mem", 64, 64, Figure::RatioRps, false, 0.6),
    target("rdma", 64, 1, Figure::RatioP50, true, 1.5),
    target("rdma", 64, 8, Figure::RatioRps, false, 0.6),
    target("rdma", 64, 8, Figure::RpsOver(1), false, 2.0),
    target("rdma", 64, 1, Figure::RatioP50, true, 1.0).against(Kind::Erpc),
    target("rdma", 64, 1, Figure::RatioRps, false, 1.0).against(Kind::Erpc),
    target("rdma", 64, 8, Figure::RatioRps, false, 1.2).against(Kind::Erpc),
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

    /// The measured figure, and the errors of the runs it comes from:
    /// from `map` against the baseline `base`, or from `peers` for a
    /// target against a peer.
    fn measure(
        &self,
        map: &BTreeMap<Key, &Measurement>,
        base: Kind,
        peers: &[PeerCell],
    ) -> (Option<f64>, u64) {
        if let Some(peer) = self.against {
            let cell = peers.iter().find(|c| {
                c.peer == peer && c.size == self.size && c.concurrency == self.concurrency
            });
            let v = cell.and_then(|c| match self.figure {
                Figure::RatioP50 => c.ratio_p50,
                Figure::RatioRps => c.ratio_rps,
                _ => None,
            });
            return (v, cell.map_or(0, |c| c.errors));
        }
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

    /// The verdict on `value`, measured in runs with `errors` errors.
    fn verdict(&self, value: Option<f64>, errors: u64) -> &'static str {
        match value.filter(|v| v.is_finite()) {
            Some(_) if errors > 0 => "not judged: calls failed",
            Some(v) if (self.at_most && v <= self.bound) || (!self.at_most && v >= self.bound) => {
                "**met**"
            }
            Some(_) => "**not met**",
            None => "no data",
        }
    }
}

/// One rdma:// unary cell (one connection) measured both by us and by a
/// peer RPC system in the same guest boot, the two alternating in rounds.
/// Figures are medians over the paired rounds (the mean of the two middle
/// ones for an even count); `None` where no round paired.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerCell {
    /// The peer.
    pub peer: Kind,
    /// Payload size, bytes.
    pub size: usize,
    /// Calls outstanding.
    pub concurrency: usize,
    /// Rounds in which a run of ours and one of the peer's paired.
    pub rounds: usize,
    /// The peer's runs in this cell, paired or not.
    pub peer_runs: usize,
    /// Median of our p50s, µs.
    pub ours_p50_us: Option<f64>,
    /// Median of our calls per second.
    pub ours_rps: Option<f64>,
    /// Median of the peer's p50s, µs.
    pub peer_p50_us: Option<f64>,
    /// Median of the peer's calls per second.
    pub peer_rps: Option<f64>,
    /// Median over the rounds of our p50 / the peer's.
    pub ratio_p50: Option<f64>,
    /// Median over the rounds of our calls/s / the peer's.
    pub ratio_rps: Option<f64>,
    /// Failed calls and wrong echoes in the paired runs, both sides.
    pub errors: u64,
    /// The peer's paired runs that a busy host disturbed: retransmissions
    /// (`retx` among its figures) over 1 % of its calls, or p99 over 5 ms.
    pub unsteady: usize,
}

/// The median of the finite values, `None` if there are none.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// The rdma:// unary cells in which `peer` ran, each of its runs paired
/// with the run of ours next to it in `records` (the sweep alternates the
/// two in each cell, which one goes first changing from round to round,
/// and writes the records in the order they ran). A run left without a
/// neighbour of the other side, as when one failed, is not counted.
pub fn peer_cells(records: &[Measurement], peer: Kind) -> Vec<PeerCell> {
    let mut cells: BTreeMap<(usize, usize), Vec<&Measurement>> = BTreeMap::new();
    for r in records.iter().filter(|r| {
        r.fabric == "rdma"
            && r.mode == Mode::Unary
            && r.connections == 1
            && (r.kind == Kind::Rpc || r.kind == peer)
    }) {
        cells.entry((r.size, r.concurrency)).or_default().push(r);
    }
    cells
        .into_iter()
        .filter(|(_, runs)| runs.iter().any(|r| r.kind == peer))
        .map(|((size, concurrency), runs)| {
            let mut pairs: Vec<(&Measurement, &Measurement)> = Vec::new();
            let mut i = 0;
            while i + 1 < runs.len() {
                let (a, b) = (runs[i], runs[i + 1]);
                if a.kind == b.kind {
                    i += 1;
                    continue;
                }
                pairs.push(if a.kind == Kind::Rpc { (a, b) } else { (b, a) });
                i += 2;
            }
            let of = |f: &dyn Fn(&(&Measurement, &Measurement)) -> f64| {
                median(pairs.iter().map(f).collect())
            };
            PeerCell {
                peer,
                size,
                concurrency,
                rounds: pairs.len(),
                peer_runs: runs.iter().filter(|r| r.kind == peer).count(),
                ours_p50_us: of(&|(o, _)| o.p50_us),
                ours_rps: of(&|(o, _)| o.rps),
                peer_p50_us: of(&|(_, p)| p.p50_us),
                peer_rps: of(&|(_, p)| p.rps),
                ratio_p50: of(&|(o, p)| o.p50_us / p.p50_us),
                ratio_rps: of(&|(o, p)| o.rps / p.rps),
                errors: pairs.iter().map(|(o, p)| o.errors + p.errors).sum(),
                unsteady: pairs
                    .iter()
                    .filter(|(_, p)| {
                        p.p99_us > 5000.0
                            || p.extra
                                .get("retx")
                                .is_some_and(|&retx| retx * 100.0 > p.calls as f64)
                    })
                    .count(),
            }
        })
        .collect()
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
    let peers = peer_cells(records, Kind::Erpc);
    let mut md = String::new();
    let mut svgs = Vec::new();
    md.push_str(preamble.trim_end());
    md.push_str("\n\n");

    md.push_str("## Targets\n\n");
    md.push_str(
        "Judged from the figures below, as measured; ratios are ours / baseline \
         (against eRPC: medians over the rounds of one guest boot, see below).\n\n",
    );
    md.push_str("| fabric | size | concurrency | figure | target | measured | verdict |\n|---|---|---|---|---|---|---|\n");
    for t in TARGETS {
        let Some(base) = t
            .against
            .or_else(|| FABRICS.iter().find(|f| f.0 == t.fabric).map(|f| f.1))
        else {
            continue;
        };
        let on = if t.mode == Mode::Stream {
            &streams
        } else {
            &map
        };
        let (value, errors) = t.measure(on, base, &peers);
        let op = if t.at_most { "≤" } else { "≥" };
        let verdict = t.verdict(value, errors);
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
    // After the rdma:// section, the last of the fabrics.
    erpc_section(&mut md, &peers);
    (md, svgs)
}

/// rdma:// against eRPC: a row per cell, with the targets against it.
fn erpc_section(md: &mut String, cells: &[PeerCell]) {
    md.push_str("## rdma:// against eRPC (same guest boot)\n\n");
    if cells.is_empty() {
        md.push_str(
            "eRPC was not run in the last sweep: the rdma:// results hold no eRPC \
             records. `scripts/bench` runs it beside the 64 B cells at 1 and 8 in \
             flight when its `erpc_bench` binary is there (`$ERPC_BENCH`, default \
             `/var/tmp/erpc/bin/erpc_bench`).\n\n",
        );
        return;
    }
    md.push_str(
        "[eRPC](https://github.com/erpc-io/eRPC) (NSDI'19; its `infiniband` \
         transport in RoCE mode: UD queue pairs, with its own reliability and \
         congestion control) echoing the same payloads over the same `rxe0`, in \
         the same guest boot as the rdma:// rows above: `erpc_bench`, one server \
         process pinned to vCPU 0 for the cells and one client per run pinned \
         to vCPU 1, one session \
         with C requests outstanding, timed from `enqueue_request()` to the \
         continuation over a fixed time after a warm-up. Ours: the rdma:// runs \
         of those cells, default settings. The sweep alternates the two in \
         rounds, which one goes first changing from round to round; the eRPC \
         server, which polls even when idle, is stopped (SIGSTOP) while ours \
         run. Each figure is the median over the \
         rounds of that boot; each ratio (ours / eRPC) is the median of the \
         rounds' ratios, our run of a round against the eRPC run beside it. \
         Every eRPC run is in `results/log-rdma.txt` (`erpc c=` lines).\n\n",
    );
    md.push_str(
        "| size | in flight | rounds | errors (both) | ours p50 µs | ours calls/s | eRPC p50 µs | eRPC calls/s | p50 ours/eRPC | target | verdict | calls/s ours/eRPC | target | verdict |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|\n",
    );
    for c in cells {
        let judged = |figure: Figure, value: Option<f64>| {
            TARGETS
                .iter()
                .find(|t| {
                    t.against == Some(c.peer)
                        && t.mode == Mode::Unary
                        && t.size == c.size
                        && t.concurrency == c.concurrency
                        && t.figure == figure
                })
                .map_or_else(
                    || "– | –".to_owned(),
                    |t| {
                        let op = if t.at_most { "≤" } else { "≥" };
                        format!("{op} {} | {}", t.bound, t.verdict(value, c.errors))
                    },
                )
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_label(c.size),
            c.concurrency,
            c.rounds,
            c.errors,
            fmt_opt(c.ours_p50_us, 1),
            fmt_opt(c.ours_rps, 0),
            fmt_opt(c.peer_p50_us, 1),
            fmt_opt(c.peer_rps, 0),
            fmt_opt(c.ratio_p50, 3),
            judged(Figure::RatioP50, c.ratio_p50),
            fmt_opt(c.ratio_rps, 3),
            judged(Figure::RatioRps, c.ratio_rps),
        );
    }
    md.push('\n');
    let unpaired: Vec<String> = cells
        .iter()
        .filter(|c| c.rounds < c.peer_runs)
        .map(|c| {
            format!(
                "{} at {} in flight: {} of {} eRPC runs without a run of ours beside them",
                size_label(c.size),
                c.concurrency,
                c.peer_runs - c.rounds,
                c.peer_runs
            )
        })
        .collect();
    if !unpaired.is_empty() {
        let _ = writeln!(md, "Not counted: {}.\n", unpaired.join("; "));
    }
    let unsteady: usize = cells.iter().map(|c| c.unsteady).sum();
    if unsteady > 0 {
        let rounds: usize = cells.iter().map(|c| c.rounds).sum();
        let _ = writeln!(
            md,
            "**{unsteady} of the {rounds} eRPC runs saw millisecond stalls** \
             (retransmissions over 1 % of calls, or p99 over 5 ms: the host \
             descheduled the guest's vCPUs, and eRPC's retransmissions snowball \
             then); their figures are unreliable.\n"
        );
    }
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
        let ours = rec(Kind::Rpc, "mem", 64, 1, 9);
        let mut base = rec(Kind::Channel, "mem", 64, 1, 5);
        base.set_ratios(&ours);
        let (md, svgs) = render(&[ours, base], "# Report", "report");
        assert!(
            md.contains("| mem:// | 64 B | 1 | ratio_p50_vs_channel | ≤ 2 | 1.800 | **met** |"),
            "{md}"
        );
        assert!(
            md.contains("| tcp:// | 64 B | 8 | ratio_rps_vs_tonic | ≥ 2 | – | no data |"),
            "{md}"
        );
        // CPU and throughput against the channel's, and scaling, judged
        // from our own records.
        let mut fast = rec(Kind::Rpc, "mem", 64, 64, 10);
        fast.rps = 700_000.0;
        fast.cpu_us_per_call = Some(2.0);
        let mut channel = rec(Kind::Channel, "mem", 64, 64, 1);
        channel.rps = 1_000_000.0;
        channel.cpu_us_per_call = Some(1.0);
        channel.set_ratios(&fast);
        let one = rec(Kind::Rpc, "rdma", 64, 1, 100);
        let mut eight = rec(Kind::Rpc, "rdma", 64, 8, 100);
        eight.rps = one.rps * 1.5;
        let mut wide = rec(Kind::Rpc, "mem", 64, 64, 10);
        wide.connections = 16;
        let (md, _) = render(&[fast, channel, one, eight, wide], "# Report", "report");
        for row in [
            "| mem:// | 64 B | 64 | ratio_cpu_vs_channel | ≤ 1.5 | 2.000 | **not met** |",
            "| mem:// | 64 B | 64 | ratio_rps_vs_channel | ≥ 0.6 | 0.700 | **met** |",
            "| rdma:// | 64 B | 8 | rps / rps at concurrency 1 | ≥ 2 | 1.500 | **not met** |",
            "| 64 B | 64 | 16 | 100 |",
        ] {
            assert!(md.contains(row), "{row} not in\n{md}");
        }
        assert!(md.contains("## mem:// (baseline"));
        assert!(md.contains("](report/latency-mem.svg)"));
        assert_eq!(svgs.len(), 2);
    }

    /// A run of ours on rdma:// with the given p50 and calls/s.
    fn ours_rdma(c: usize, p50_us: f64, rps: f64) -> Measurement {
        let mut r = rec(Kind::Rpc, "rdma", 64, c, 100);
        r.p50_us = p50_us;
        r.rps = rps;
        r
    }

    /// An eRPC record as `scripts/bench` writes it.
    fn erpc(c: usize, p50_us: f64, rps: f64, retx: f64) -> Measurement {
        let mut r = rec(Kind::Erpc, "rdma", 64, c, 100);
        r.url = "erpc://192.0.2.1:31850".into();
        r.p50_us = p50_us;
        r.rps = rps;
        r.extra.insert("retx".into(), retx);
        r
    }

    /// Our run with the perftest record `rpc-bench` writes after it.
    fn ours_and_perftest(c: usize, p50_us: f64, rps: f64) -> [Measurement; 2] {
        let ours = ours_rdma(c, p50_us, rps);
        let mut verbs = rec(Kind::Perftest, "rdma", 64, c, 20);
        verbs.set_ratios(&ours);
        [ours, verbs]
    }

    #[test]
    fn erpc_rounds_pair_into_medians_and_verdicts() {
        // Three rounds per cell, which side goes first alternating, as the
        // sweep runs them: (p50 µs, calls/s) of ours, then of eRPC.
        let rounds = [
            (
                1,
                [
                    (60.0, 10_000.0, 100.0, 5_000.0),
                    (70.0, 9_000.0, 50.0, 12_000.0),
                    (80.0, 8_000.0, 90.0, 7_000.0),
                ],
            ),
            (
                8,
                [
                    (200.0, 30_000.0, 300.0, 25_000.0),
                    (210.0, 28_000.0, 280.0, 26_000.0),
                    (190.0, 33_000.0, 250.0, 30_000.0),
                ],
            ),
        ];
        let mut records = Vec::new();
        for (c, runs) in rounds {
            for (round, (p50, rps, e_p50, e_rps)) in runs.into_iter().enumerate() {
                let peer = erpc(c, e_p50, e_rps, 0.0);
                if round % 2 == 0 {
                    records.extend(ours_and_perftest(c, p50, rps));
                    records.push(peer);
                } else {
                    records.push(peer);
                    records.extend(ours_and_perftest(c, p50, rps));
                }
            }
        }
        let cells = peer_cells(&records, Kind::Erpc);
        assert_eq!(cells.len(), 2);
        let one = &cells[0];
        assert_eq!(
            (one.size, one.concurrency, one.rounds, one.peer_runs),
            (64, 1, 3, 3)
        );
        assert_eq!(one.ours_p50_us, Some(70.0));
        assert_eq!(one.ours_rps, Some(9_000.0));
        assert_eq!(one.peer_p50_us, Some(90.0));
        assert_eq!(one.peer_rps, Some(7_000.0));
        // The median of the rounds' ratios (0.6, 1.4, 0.889 and 2.0, 0.75,
        // 1.143), not the ratio of the medians (0.778 and 1.286).
        assert_eq!(one.ratio_p50, Some(80.0 / 90.0));
        assert_eq!(one.ratio_rps, Some(8_000.0 / 7_000.0));
        assert_eq!(cells[1].ratio_rps, Some(33_000.0 / 30_000.0));
        assert_eq!(cells[1].unsteady, 0);

        let (md, _) = render(&records, "# Report", "report");
        for row in [
            "## rdma:// against eRPC (same guest boot)",
            "| 64 B | 1 | 3 | 0 | 70.0 | 9000 | 90.0 | 7000 | 0.889 | ≤ 1 | **met** | 1.143 | ≥ 1 | **met** |",
            "| 64 B | 8 | 3 | 0 | 200.0 | 30000 | 280.0 | 26000 | 0.750 | – | – | 1.100 | ≥ 1.2 | **not met** |",
            "| rdma:// | 64 B | 1 | ratio_p50_vs_erpc | ≤ 1 | 0.889 | **met** |",
            "| rdma:// | 64 B | 1 | ratio_rps_vs_erpc | ≥ 1 | 1.143 | **met** |",
            "| rdma:// | 64 B | 8 | ratio_rps_vs_erpc | ≥ 1.2 | 1.100 | **not met** |",
        ] {
            assert!(md.contains(row), "{row} not in\n{md}");
        }
        assert!(!md.contains("not run in the last sweep"), "{md}");
        assert!(!md.contains("Not counted"), "{md}");
        assert!(!md.contains("millisecond stalls"), "{md}");
        // The eRPC records do not change the perftest table's pick.
        assert!(md.contains("| 64 B | 1 | 1 | 100 | 0 | 70.0 |"), "{md}");
    }

    #[test]
    fn erpc_runs_without_a_neighbour_are_left_out() {
        // Round 2's eRPC run failed (no record); round 3's retransmitted
        // much; an eRPC run at the end has no run of ours beside it.
        let records = vec![
            ours_rdma(1, 60.0, 10_000.0),
            erpc(1, 100.0, 5_000.0, 0.0),
            ours_rdma(1, 70.0, 9_000.0),
            ours_rdma(1, 80.0, 8_000.0),
            erpc(1, 40.0, 16_000.0, 500.0),
            erpc(1, 10.0, 1.0, 0.0),
            rec(Kind::Erpc, "mem", 64, 1, 1),
        ];
        let cells = peer_cells(&records, Kind::Erpc);
        assert_eq!(cells.len(), 1);
        let c = &cells[0];
        assert_eq!((c.rounds, c.peer_runs, c.unsteady), (2, 3, 1));
        // Two rounds: the mean of the two.
        assert_eq!(c.ours_p50_us, Some(70.0));
        assert_eq!(c.peer_rps, Some(10_500.0));
        assert_eq!(c.ratio_p50, Some((0.6 + 2.0) / 2.0));
        assert_eq!(c.ratio_rps, Some((2.0 + 0.5) / 2.0));
        let (md, _) = render(&records, "# Report", "report");
        for text in [
            "| 64 B | 1 | 2 | 0 | 70.0 | 9000 |",
            "Not counted: 64 B at 1 in flight: 1 of 3 eRPC runs without a run of ours beside them.",
            "**1 of the 2 eRPC runs saw millisecond stalls**",
            "| rdma:// | 64 B | 1 | ratio_p50_vs_erpc | ≤ 1 | 1.300 | **not met** |",
        ] {
            assert!(md.contains(text), "{text} not in\n{md}");
        }

        // Failed calls in a paired run: no verdict.
        let mut failed = records.clone();
        failed[1].errors = 3;
        let (md, _) = render(&failed, "# Report", "report");
        assert!(
            md.contains("| rdma:// | 64 B | 1 | ratio_rps_vs_erpc | ≥ 1 | 1.250 | not judged: calls failed |"),
            "{md}"
        );
    }

    #[test]
    fn without_erpc_records_the_section_says_it_did_not_run() {
        let records = [
            ours_and_perftest(1, 60.0, 10_000.0),
            ours_and_perftest(8, 200.0, 30_000.0),
        ]
        .concat();
        assert!(peer_cells(&records, Kind::Erpc).is_empty());
        let (md, _) = render(&records, "# Report", "report");
        for text in [
            "## rdma:// against eRPC (same guest boot)\n\neRPC was not run in the last sweep",
            "| rdma:// | 64 B | 1 | ratio_p50_vs_erpc | ≤ 1 | – | no data |",
            "| rdma:// | 64 B | 8 | ratio_rps_vs_erpc | ≥ 1.2 | – | no data |",
        ] {
            assert!(md.contains(text), "{text} not in\n{md}");
        }
        // And with no results at all.
        let (md, _) = render(&[], "# Report", "report");
        assert!(md.contains("eRPC was not run in the last sweep"), "{md}");
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
