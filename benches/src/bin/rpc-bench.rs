//! `rpc-bench`: unary echo calls against an embedded server, against a
//! baseline measured in the same invocation. See `rpc-bench --help`, and
//! the `benches` crate docs for how each side is driven.

use benches::measure::{Measurement, Params};
use benches::rpc::RpcRun;
use benches::{Baseline, Options, channel_baseline, cli, perftest, tonic_baseline};
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
        size: o.size,
        concurrency: o.concurrency,
        connections: o.connections,
        calls: o.calls,
        warmup: o.warmup,
    };
    let ours = match benches::rpc::run(&RpcRun {
        url: o.url.clone(),
        params,
        inline_handlers: o.inline_handlers,
    }) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("rpc-bench: {e}");
            return 1;
        }
    };
    println!("{ours}");
    if let Some(e) = &ours.first_error {
        eprintln!("rpc-bench: first error: {e}");
    }
    let mut records = vec![ours.clone()];
    let mut code = i32::from(ours.errors > 0);

    if let Some(baseline) = o.baseline {
        let measured = match baseline {
            Baseline::Tonic => tonic_baseline::run(params),
            Baseline::Channel => Ok(channel_baseline::run(params)),
            Baseline::Perftest => perftest::run(&ours.url, params),
        };
        match measured {
            Ok(mut base) => {
                base.fabric = ours.fabric.clone();
                base.set_ratios(&ours);
                println!("{base}");
                println!("{}", base.ratio_line());
                if let Some(e) = &base.first_error {
                    eprintln!("rpc-bench: first baseline error: {e}");
                }
                if base.errors > 0 {
                    code = 1;
                }
                records.push(base);
            }
            Err(e) => {
                eprintln!("rpc-bench: {e}");
                code = 1;
            }
        }
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
