//! Smoke tests of `rpc-bench`: each fabric and baseline with a few hundred
//! calls (or stream messages), the binary's output, JSON and exit codes.
//! Figures are only checked for sanity, never for speed.

use benches::measure::{Bench, Kind, Measurement, Mode, Params};
use benches::rpc::{RpcBench, RpcRun};
use benches::tonic_baseline::TonicBench;
use benches::{channel_baseline, tonic_baseline};
use std::process::Command;

fn params(calls: u64, concurrency: usize, connections: usize) -> Params {
    Params {
        mode: Mode::Unary,
        stream_len: None,
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
    ours_from(url, p, false)
}

/// Our run, its calls made from tokio tasks with `tokio`.
fn ours_from(url: &str, p: Params, tokio: bool) -> Measurement {
    benches::rpc::run(&RpcRun {
        url: url.into(),
        params: p,
        tuning: Default::default(),
        tls: None,
        tokio,
    })
    .expect("server and connections come up")
}

/// `--tokio`: every call made from the runtime's tasks succeeds, and the
/// records say how they were made.
#[test]
fn calls_from_tokio_tasks() {
    for (url, fabric) in [
        ("mem://rpc-bench-tokio", "mem-tokio"),
        ("tcp://127.0.0.1:0", "tcp-tokio"),
    ] {
        let m = ours_from(url, params(500, 8, 2), true);
        assert_sane(&m, 500);
        assert_eq!(m.fabric, fabric);
    }
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
        tuning: Default::default(),
        tls: None,
        tokio: false,
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
        &[
            "--stream", "--url", "mem://x", "--size", "64", "--calls", "10", "--tokio",
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
        mode: Mode::Unary,
        stream_len: None,
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

/// Stream mode, through the library: every message asked for arrives and
/// passes its check, on mem:// and tcp:// and on tonic, with one stream or
/// several at a time, streams of the default or a set length, and payloads
/// from empty to 64 KiB.
#[test]
fn streams_deliver_every_message() {
    let shapes = [
        (0, 1, 1, None),
        (64, 1, 1, Some(7)),
        (1000, 3, 2, None),
        (64 * 1024, 2, 1, Some(5)),
    ];
    for (size, concurrency, connections, stream_len) in shapes {
        let p = Params {
            mode: Mode::Stream,
            stream_len,
            size,
            concurrency,
            connections,
            calls: 40,
            warmup: 0,
        };
        let mut benches: Vec<(String, Box<dyn Bench>)> = Vec::new();
        for url in ["mem://rpc-bench-streams", "tcp://127.0.0.1:0"] {
            let run = RpcRun {
                url: url.into(),
                params: p,
                tuning: Default::default(),
                tls: None,
                tokio: false,
            };
            benches.push((url.into(), Box::new(RpcBench::start(&run).unwrap())));
        }
        benches.push(("tonic".into(), Box::new(TonicBench::start(&p).unwrap())));
        for (name, bench) in &mut benches {
            for (first, n) in [(0, 40), (40, 1), (41, 23)] {
                let (tally, elapsed) = bench.round(first, n);
                let what = format!("{name} {p:?} round of {n}");
                assert_eq!(tally.errors, 0, "{what}: {:?}", tally.first_error);
                assert_eq!(tally.hist.len(), n, "{what}");
                assert!(elapsed > std::time::Duration::ZERO, "{what}");
            }
        }
    }
}

/// `rpc-bench --stream` on mem:// alone and on tcp:// against tonic: its
/// lines, ratios and JSON records.
#[test]
fn binary_streams_on_mem_and_tcp() {
    let bin = env!("CARGO_BIN_EXE_rpc-bench");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.jsonl");
    let run = |args: &[&str]| {
        let out = Command::new(bin)
            .arg("--stream")
            .args(args)
            .arg("--json")
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let keys = [
        "gap_p50_us=",
        "gap_p99_us=",
        "gap_p999_us=",
        "msgs_per_s=",
        "mb_per_s=",
        "cpu_us_per_msg=",
    ];

    let mem = run(&[
        "--url",
        "mem://rpc-bench-stream-bin",
        "--size",
        "64",
        "--calls",
        "3000",
    ]);
    let lines: Vec<&str> = mem.lines().collect();
    assert_eq!(lines.len(), 1, "{mem}");
    assert!(
        lines[0].starts_with(
            "url=mem://rpc-bench-stream-bin mode=stream size=64 concurrency=1 messages=3000 errors=0 "
        ),
        "{mem}"
    );
    assert!(keys.iter().all(|k| lines[0].contains(k)), "{mem}");

    let tcp = run(&[
        "--url",
        "tcp://127.0.0.1:0",
        "--size",
        "1024",
        "--calls",
        "2000",
        "--concurrency",
        "2",
        "--stream-len",
        "300",
        "--baseline",
        "tonic",
    ]);
    let lines: Vec<&str> = tcp.lines().collect();
    assert_eq!(lines.len(), 3, "{tcp}");
    for (line, url) in lines[..2]
        .iter()
        .zip(["url=tcp://127.0.0.1:", "url=tonic://"])
    {
        assert!(line.starts_with(url), "{tcp}");
        assert!(
            line.contains(
                " mode=stream size=1024 concurrency=2 stream_len=300 messages=2000 errors=0 "
            ),
            "{tcp}"
        );
        assert!(keys.iter().all(|k| line.contains(k)), "{tcp}");
    }
    assert!(
        lines[2].starts_with("ratio_gap_p50_vs_tonic=")
            && lines[2].contains(" ratio_msgs_per_s_vs_tonic=")
            && lines[2].contains(" ratio_cpu_vs_tonic="),
        "{tcp}"
    );

    let records = benches::report::load(&[&json]).unwrap();
    assert_eq!(records.len(), 3);
    assert!(
        records
            .iter()
            .all(|r| r.mode == Mode::Stream && r.errors == 0)
    );
    assert_eq!(
        records.iter().map(|r| r.kind).collect::<Vec<_>>(),
        [Kind::Rpc, Kind::Rpc, Kind::Tonic]
    );
    assert_eq!(records[2].stream_len, Some(300));
    assert!(records[2].ratio_rps.is_some_and(|r| r > 0.0));
}

/// Stream mode on a real device, against `ib_write_bw`: ignored by a plain
/// `cargo test`; `scripts/test` runs it in the Soft-RoCE guest.
#[test]
#[ignore = "needs an RDMA device and perftest: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_streams_and_ib_write_bw() {
    let url = std::env::var("RPC_TEST_RDMA_URL").unwrap_or_else(|_| "rdma://127.0.0.1:0".into());
    let p = Params {
        mode: Mode::Stream,
        stream_len: None,
        size: 1024,
        concurrency: 2,
        connections: 1,
        calls: 2000,
        warmup: 100,
    };
    let m = ours(&url, p);
    assert_eq!(m.errors, 0, "{m} (first error: {:?})", m.first_error);
    assert!(
        m.rps > 0.0 && m.to_string().contains(" mode=stream "),
        "{m}"
    );
    let mut b = benches::perftest::run(&m.url, p).expect("perftest runs");
    b.set_ratios(&m);
    assert!(b.rps > 0.0 && b.extra.contains_key("bw_avg_MBps"), "{b}");
    assert!(
        b.ratio_line().starts_with("ratio_msgs_per_s_vs_verbs="),
        "{}",
        b.ratio_line()
    );
}
