//! Runs gRPC's interop test cases against a server of
//! `grpc.testing.TestService`: one of ours over any fabric (`--url`), or
//! any gRPC server over standard gRPC (`--server_host`, `--server_port`).
//!
//! ```text
//! interop-client --server_host localhost --server_port 10000 --test_case all
//! interop-client --url tcp://127.0.0.1:7480 --test_case large_unary
//! ```
//!
//! Prints `PASS name` or `FAIL name: why` per case and `N passed, M
//! failed`; exits 1 if any failed, 2 on bad arguments.

use examples::cli::fail;
use interop::cases;
use rpc_core::Channel;
use std::time::Duration;

const USAGE: &str = "\
usage: interop-client [--server_host HOST] [--server_port PORT] [--url URL]
                      [--test_case NAME[,NAME...]|all] [--use_tls false]
                      [--use_test_ca false] [--server_host_override HOST]
  --server_host, --server_port   a gRPC server (HTTP/2), as gRPC's interop clients take it
  --url URL                      instead, one of ours: tcp://, rdma://, mem:// or grpc://
  --test_case                    the cases to run (default all)";

/// How long any one call may take: a case that hangs fails.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    examples::init_logging("warn");
    let (mut host, mut port, mut url) = (None, None, None);
    let mut test_case = "all".to_owned();
    let flags =
        interop::flags(std::env::args().skip(1)).unwrap_or_else(|e| fail(&format!("{e}\n{USAGE}")));
    for (name, value) in flags {
        match name.as_str() {
            "--server_host" => host = Some(value),
            "--server_port" => port = Some(value),
            "--url" => url = Some(value),
            "--test_case" => test_case = value,
            "--use_tls" | "--use_test_ca" => {
                if value != "false" {
                    fail(&format!("interop-client: {name} is not supported yet"));
                }
            }
            // The name TLS would check: nothing to override without TLS.
            "--server_host_override" => {}
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => fail(&format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let url = match (url, host, port) {
        (Some(url), None, None) => url,
        (None, host, Some(port)) => {
            format!("grpc://{}:{port}", host.as_deref().unwrap_or("localhost"))
        }
        _ => fail(&format!(
            "give --url, or --server_port (and --server_host)\n{USAGE}"
        )),
    };
    let selected: Vec<&cases::Case> = if test_case == "all" {
        cases::ALL.iter().collect()
    } else {
        test_case
            .split(',')
            .map(|name| {
                cases::find(name).unwrap_or_else(|| fail(&format!("unknown test case {name:?}")))
            })
            .collect()
    };
    let channel = Channel::builder(&url)
        .timeout(CALL_TIMEOUT)
        .connect()
        .unwrap_or_else(|s| {
            fail(&format!(
                "interop-client: cannot connect to {url}: {}",
                s.message()
            ))
        });
    let failed = cases::run(&channel, &selected);
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
