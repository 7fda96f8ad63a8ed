//! `rpc-bench`: unary echo calls (or, with `--stream`, the messages of
//! server streams) against an embedded server, against a baseline measured
//! in the same invocation. See `rpc-bench --help`, and
//! the `benches` crate docs for how each side is driven.

use benches::channel_baseline::ChannelBench;
use benches::measure::{Bench, Kind, Measurement, Mode, Params, interleave, rounds_for};
use benches::rpc::{RpcBench, RpcRun};
use benches::tonic_baseline::TonicBench;
use benches::{Baseline, Options, cli, perftest};
use std::io::Write;

fn main() {
    let options = match Options::parse(std::env::args().skip(1)) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{}", cli::USAGE);
            return;
        }
        Err(e) => {
            eprintln!("rpc-bench: {e}\n\n{}", cli::USAGE);
            std::process::exit(2);
        }
    };
    std::process::exit(run(&options));
}

/// Runs everything asked for, prints the lines, writes the JSON; returns
/// the exit code.
fn run(o: &Options) -> i32 {
    let params = Params {
        mode: if o.stream { Mode::Stream } else { Mode::Unary },
        stream_len: o.stream_len,
        size: o.size,
        concurrency: o.concurrency,
        connections: o.connections,
        calls: o.calls,
        warmup: o.warmup,
    };
    if o.baseline == Some(Baseline::Perftest) {
        if let Err(e) = perftest::tools() {
            eprintln!("rpc-bench: {e}");
            return 1;
        }
    }
    let tls = if o.tls {
        let host = rpc_core::fabric::FabricUrl::parse(&o.url)
            .map(|u| u.host)
            .unwrap_or_default();
        match benches::tls::TestPki::new(&host) {
            Ok(pki) => Some(pki),
            Err(e) => {
                eprintln!("rpc-bench: {e}");
                return 1;
            }
        }
    } else {
        None
    };
    let run = RpcRun {
        url: o.url.clone(),
        params,
        tuning: o.tuning,
        tls,
        tokio: o.tokio,
    };
    // `grpc-face://`: tonic's clients against our server's gRPC face.
    let started: Result<(Box<dyn Bench>, String, String), String> =
        if o.url.starts_with("grpc-face://") {
            TonicBench::start_face(&params).map(|b| {
                let url = b.url();
                (Box::new(b) as Box<dyn Bench>, "grpc-face".to_owned(), url)
            })
        } else {
            RpcBench::start(&run).map(|b| {
                let (fabric, url) = (b.fabric(), b.url().to_owned());
                (Box::new(b) as Box<dyn Bench>, fabric, url)
            })
        };
    let (mut ours_bench, fabric, ours_url) = match started {
        Ok(b) => b,
        Err(e) => {
            eprintln!("rpc-bench: {e}");
            return 1;
        }
    };
    // tonic and the channel run in this process too: set up now and
    // interleaved round by round with ours. perftest runs afterwards, on
    // its own, once our server is gone.
    let mut baseline: Option<(Box<dyn Bench>, Kind, String)> = match o.baseline {
        Some(Baseline::Tonic) => match TonicBench::start(&params) {
            Ok(b) => {
                let url = b.url();
                Some((Box::new(b), Kind::Tonic, url))
            }
            Err(e) => {
                eprintln!("rpc-bench: {e}");
                return 1;
            }
        },
        Some(Baseline::Channel) => {
            let b = ChannelBench::new(&params);
            let url = b.url();
            Some((Box::new(b), Kind::Channel, url))
        }
        Some(Baseline::Plaintext) => {
            let plain = RpcRun {
                tls: None,
                ..run.clone()
            };
            match RpcBench::start(&plain) {
                Ok(b) => {
                    let url = b.url().to_owned();
                    Some((Box::new(b), Kind::Plaintext, url))
                }
                Err(e) => {
                    eprintln!("rpc-bench: {e}");
                    return 1;
                }
            }
        }
        Some(Baseline::Perftest) | None => None,
    };
    let rounds = if baseline.is_some() {
        rounds_for(&params)
    } else {
        1
    };
    let (ours_totals, base_totals) = interleave(
        &mut *ours_bench,
        baseline
            .as_mut()
            .map(|(b, _, _)| &mut **b as &mut dyn Bench),
        &params,
        rounds,
    );
    let ours = Measurement::from_totals(Kind::Rpc, &fabric, ours_url, params, &ours_totals);
    drop(ours_bench);
    say(&ours);
    // Built with the `stages` feature: where a lone call's time went.
    if let Some(r) = rpc_core::stages::report() {
        let mut line = format!("stages: calls={} total_us={:.2}", r.calls, r.total_us);
        for (name, us) in rpc_core::stages::NAMES.iter().zip(r.stage_us).skip(1) {
            line.push_str(&format!(" {name}={us:.2}"));
        }
        say(&line);
    }
    if let Some(e) = &ours.first_error {
        eprintln!("rpc-bench: first error: {e}");
    }
    let mut records = vec![ours.clone()];
    let mut code = i32::from(ours.errors > 0);

    let measured = match (o.baseline, baseline) {
        (_, Some((bench, kind, url))) => {
            drop(bench);
            Some(Ok(Measurement::from_totals(
                kind,
                &fabric,
                url,
                params,
                &base_totals,
            )))
        }
        (Some(Baseline::Perftest), None) => Some(perftest::run(&ours.url, params)),
        _ => None,
    };
    match measured {
        Some(Ok(mut base)) => {
            base.fabric = fabric;
            base.set_ratios(&ours);
            say(&base);
            say(&base.ratio_line());
            if let Some(e) = &base.first_error {
                eprintln!("rpc-bench: first baseline error: {e}");
            }
            if base.errors > 0 {
                code = 1;
            }
            records.push(base);
        }
        Some(Err(e)) => {
            eprintln!("rpc-bench: {e}");
            code = 1;
        }
        None => {}
    }

    if let Some(path) = &o.json {
        if let Err(e) = append_json(path, &records) {
            eprintln!("rpc-bench: cannot write {}: {e}", path.display());
            code = 1;
        }
    }
    code
}

/// Appends one JSON object per line.
fn append_json(path: &std::path::Path, records: &[Measurement]) -> std::io::Result<()> {
    let mut text = String::new();
    for r in records {
        text += &serde_json::to_string(r).map_err(std::io::Error::other)?;
        text.push('\n');
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(text.as_bytes())
}

/// Prints a result line; exits quietly if stdout is gone (a closed pipe).
fn say(line: &dyn std::fmt::Display) {
    use std::io::Write;
    if writeln!(std::io::stdout(), "{line}").is_err() {
        std::process::exit(1);
    }
}
