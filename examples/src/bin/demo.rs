//! Starts an embedded kv server in this process, drives a client workload
//! against it, and prints one summary line:
//!
//! ```text
//! calls=20000 errors=0 p50_us=… p99_us=… rps=…
//! ```
//!
//! `demo --url URL --calls N --concurrency C`; the URL picks the fabric
//! (default `mem://demo`; `tcp://127.0.0.1:0` and `rdma://…` work too).

use examples::kv::kv_client::KvClient;
use examples::kv::kv_server::KvServer;
use examples::services::KvStore;
use examples::workload;
use rpc_core::{Channel, Server};
use std::time::Duration;

const USAGE: &str = "usage: demo [--url URL] [--calls N] [--concurrency C]";

fn main() {
    examples::init_logging("warn");
    let mut url = "mem://demo".to_owned();
    let mut calls: u64 = 20_000;
    let mut concurrency: usize = 4;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| fail(&format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--url" => url = value(),
            "--calls" => {
                calls = value()
                    .parse()
                    .unwrap_or_else(|_| fail("--calls needs a number"))
            }
            "--concurrency" => {
                concurrency = value()
                    .parse()
                    .unwrap_or_else(|_| fail("--concurrency needs a number"))
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            other => fail(&format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let server = Server::builder()
        .add_service(KvServer::new(KvStore::new()))
        .serve(&url)
        .unwrap_or_else(|s| fail(&format!("demo: cannot serve on {url}: {}", s.message())));
    let channel = Channel::builder(server.local_url())
        .timeout(Duration::from_secs(10))
        .connect()
        .unwrap_or_else(|s| {
            fail(&format!(
                "demo: cannot connect to {}: {}",
                server.local_url(),
                s.message()
            ))
        });
    let summary = workload::run(&KvClient::new(channel), calls, concurrency);
    println!("{summary}");
    if let Some(e) = &summary.first_error {
        eprintln!("first error: {e}");
    }
    server.shutdown();
    if summary.errors > 0 {
        std::process::exit(1);
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("{msg}");
    std::process::exit(2)
}
