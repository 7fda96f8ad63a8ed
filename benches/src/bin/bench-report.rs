//! `bench-report`: renders `benches/REPORT.md` and its SVG charts from the
//! JSON records `rpc-bench --json` wrote.
//!
//! `bench-report --out REPORT.md --svg-dir DIR [--preamble FILE]
//! [--epilogue FILE] RESULTS.jsonl...`: the preamble goes first, then the
//! targets, one section per fabric with its table and charts, rdma://
//! against eRPC (the records `scripts/bench` writes for it), then the
//! epilogue. DIR is where the SVG files go; the markdown links to them
//! relative to its own directory.

use std::path::{Path, PathBuf};

const USAGE: &str = "usage: bench-report --out REPORT.md --svg-dir DIR [--preamble FILE] [--epilogue FILE] RESULTS.jsonl...";

fn main() {
    let mut out = None;
    let mut svg_dir = None;
    let mut preamble = None;
    let mut epilogue = None;
    let mut inputs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--out" => out = Some(PathBuf::from(value())),
            "--svg-dir" => svg_dir = Some(PathBuf::from(value())),
            "--preamble" => preamble = Some(PathBuf::from(value())),
            "--epilogue" => epilogue = Some(PathBuf::from(value())),
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            a if a.starts_with("--") => usage(&format!("unexpected argument {a:?}")),
            a => inputs.push(PathBuf::from(a)),
        }
    }
    let (Some(out), Some(svg_dir)) = (out, svg_dir) else {
        usage("--out and --svg-dir are required")
    };
    if inputs.is_empty() {
        usage("no result files given");
    }
    if let Err(e) = run(&out, &svg_dir, [preamble, epilogue], &inputs) {
        eprintln!("bench-report: {e}");
        std::process::exit(1);
    }
}

fn run(
    out: &Path,
    svg_dir: &Path,
    [preamble, epilogue]: [Option<PathBuf>; 2],
    inputs: &[PathBuf],
) -> Result<(), String> {
    let records = benches::report::load(inputs)?;
    let read = |p: Option<PathBuf>, default: &str| match p {
        Some(p) => {
            std::fs::read_to_string(&p).map_err(|e| format!("cannot read {}: {e}", p.display()))
        }
        None => Ok(default.to_owned()),
    };
    let preamble = read(preamble, "# Benchmark report\n")?;
    let epilogue = read(epilogue, "")?;
    let base = out.parent().unwrap_or(Path::new("."));
    let rel = svg_dir.strip_prefix(base).unwrap_or(svg_dir);
    let (md, svgs) = benches::report::render(&records, &preamble, &rel.to_string_lossy());
    std::fs::create_dir_all(svg_dir)
        .map_err(|e| format!("cannot create {}: {e}", svg_dir.display()))?;
    for (name, svg) in svgs {
        let path = svg_dir.join(name);
        std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    let md = format!("{}\n\n{}", md.trim_end(), epilogue);
    std::fs::write(out, md.trim_end().to_owned() + "\n")
        .map_err(|e| format!("cannot write {}: {e}", out.display()))
}

fn usage(msg: &str) -> ! {
    eprintln!("bench-report: {msg}\n{USAGE}");
    std::process::exit(2)
}
