//! Smoke tests of `rpc-bench`: each fabric and baseline with a few hundred
//! calls, the binary's output, JSON and exit codes. Figures are only
//! checked for sanity, never for speed.

use benches::measure::{Kind, Measurement, Params};
use benches::rpc::RpcRun;
use benches::{channel_baseline, tonic_baseline};
use std::process::Command;

fn params(calls: u64, concurrency: usize, connections: usize) -> Params {
    Params {
        size: 100,
        concurrency,
        connections,
        calls,
        warmup: 20,
    }
}

fn assert_sane(m: &Measurement, calls: u64) {
    assert_eq!(m.errors, 0, "{m} (first error: {:?})", m.first_error);
    assert_eq!(m.calls, calls);
    assert!(
        m.p50_us > 0.0 && m.p50_us <= m.p99_us && m.p99_us <= m.p999_us,
        "{m}"
    );
    assert!(m.rps > 0.0 && m.rps.is_finite(), "{m}");
    assert!(
        m.cdf
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
        "{m:?}"
    );
}

fn ours(url: &str, p: Params) -> Measurement {
    benches::rpc::run(&RpcRun {
        url: url.into(),
        params: p,
        spin: None,
    })
    .expect("server and connections come up")
}

#[test]
fn mem_and_channel_baseline() {
    let p = params(300, 4, 2);
    let m = ours("mem://rpc-bench-smoke", p);
    assert_sane(&m, 300);
    assert_eq!(m.kind, Kind::Rpc);
    assert_eq!(m.fabric, "mem");
    let c = channel_baseline::run(p);
    assert_sane(&c, 300);
}

#[test]
fn tcp_and_tonic_baseline() {
    let p = params(300, 8, 1);
    let m = ours("tcp://127.0.0.1:0", p);
    assert_sane(&m, 300);
    assert!(
        m.url.starts_with("tcp://127.0.0.1:") && !m.url.ends_with(":0"),
        "{}",
        m.url
    );
    let t = tonic_baseline::run(p).expect("tonic comes up");
    assert_sane(&t, 300);
    assert!(t.url.starts_with("tonic://127.0.0.1:"), "{}", t.url);
}

#[test]
fn large_payloads() {
    let mut p = params(50, 3, 1);
    p.size = 64 * 1024;
    let m = benches::rpc::run(&RpcRun {
        url: "mem://rpc-bench-large".into(),
        params: p,
        spin: None,
    })
    .unwrap();
    assert_sane(&m, 50);
}

#[test]
fn binary_prints_lines_writes_json_and_exits_2_on_bad_args() {
    let bin = env!("CARGO_BIN_EXE_rpc-bench");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.jsonl");
    let out = Command::new(bin)
        .args([
            "--url",
            "mem://rpc-bench-bin",
            "--size",
            "64",
            "--calls",
            "200",
        ])
        .args(["--concurrency", "2", "--baseline", "channel", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(
        lines[0].starts_with(
            "url=mem://rpc-bench-bin size=64 concurrency=2 calls=200 errors=0 p50_us="
        )
    );
    for key in ["p99_us=", "p999_us=", "rps=", "cpu_us_per_call="] {
        assert!(lines[0].contains(key) && lines[1].contains(key), "{stdout}");
    }
    assert!(lines[1].starts_with("url=channel://"), "{stdout}");
    assert!(
        lines[2].starts_with("ratio_p50_vs_channel=")
            && lines[2].contains(" ratio_rps_vs_channel=")
            && lines[2].contains(" ratio_cpu_vs_channel=")
    );
    let records = benches::report::load(&[&json]).unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(
        (records[0].kind, records[1].kind),
        (Kind::Rpc, Kind::Channel)
    );
    assert!(records[1].ratio_p50.is_some());

    for bad in [
        &["--url", "mem://x", "--size", "64", "--calls", "10"][..],
        &[
            "--url",
            "mem://x",
            "--size",
            "64",
            "--calls",
            "10",
            "--concurrency",
            "1",
            "--baseline",
            "nope",
        ],
        &[
            "--url",
            "tcp://127.0.0.1:0",
            "--size",
            "64",
            "--calls",
            "10",
            "--concurrency",
            "1",
            "--baseline",
            "perftest",
        ],
    ] {
        let out = Command::new(bin).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("usage: rpc-bench"));
    }
}

/// The perftest baseline on a real device: ignored by a plain `cargo test`;
/// `scripts/test` runs it in the Soft-RoCE guest (`--include-ignored rdma`),
/// with `RPC_TEST_RDMA_URL` naming the device's address.
#[test]
#[ignore = "needs an RDMA device and perftest: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_perftest_baseline() {
    let url = std::env::var("RPC_TEST_RDMA_URL").unwrap_or_else(|_| "rdma://127.0.0.1:0".into());
    let p = Params {
        size: 64,
        concurrency: 1,
        connections: 1,
        calls: 200,
        warmup: 20,
    };
    let m = ours(&url, p);
    assert_sane(&m, 200);
    let mut b = benches::perftest::run(&m.url, p).expect("perftest runs");
    b.set_ratios(&m);
    assert!(b.p50_us > 0.0 && b.rps > 0.0, "{b}");
    assert!(b.ratio_line().starts_with("ratio_p50_vs_verbs="));
}
