//! Runs gRPC's interop test cases against a server of
//! `grpc.testing.TestService`: one of ours over any fabric (`--url`), or
//! any gRPC server over standard gRPC (`--server_host`, `--server_port`).
//!
//! ```text
//! interop-client --server_host localhost --server_port 10000 --test_case all
//! interop-client --url tcp://127.0.0.1:7480 --test_case large_unary
//! interop-client --server_port 10000 --use_tls true --use_test_ca true \
//!     --server_host_override foo.test.google.fr
//! ```
//!
//! Prints `PASS name` or `FAIL name: why` per case and `N passed, M
//! failed`; exits 1 if any failed, 2 on bad arguments.

use examples::cli::fail;
use interop::cases;
use interop::certs::TestCerts;
use rpc_core::Channel;
use std::time::Duration;

const USAGE: &str = "\
usage: interop-client [--server_host HOST] [--server_port PORT] [--url URL]
                      [--test_case NAME[,NAME...]|all] [--use_tls true|false]
                      [--use_test_ca true|false] [--server_host_override HOST]
  --server_host, --server_port   a gRPC server (HTTP/2), as gRPC's interop clients take it
  --url URL                      instead, one of ours: tcp://, rdma://, mem:// or grpc://
  --test_case                    the cases to run (default all)
  --use_tls                      over TLS (standard gRPC, tcp://, rdma://'s handshake)
  --use_test_ca                  trust the test CA (interop-server's; $RPC_INTEROP_CERTS,
                                 default the temporary directory's rdma-rpc-interop-certs)
  --server_host_override         the name the server's certificate is checked for
                                 (default: the server's host)";

/// How long any one call may take: a case that hangs fails.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    examples::init_logging("warn");
    let (mut host, mut port, mut url) = (None, None, None);
    let mut test_case = "all".to_owned();
    let (mut tls, mut test_ca, mut host_override) = (false, false, None);
    let flags =
        interop::flags(std::env::args().skip(1)).unwrap_or_else(|e| fail(&format!("{e}\n{USAGE}")));
    for (name, value) in flags {
        match name.as_str() {
            "--server_host" => host = Some(value),
            "--server_port" => port = Some(value),
            "--url" => url = Some(value),
            "--test_case" => test_case = value,
            "--use_tls" => tls = interop::truth(&name, &value).unwrap_or_else(|e| fail(&e)),
            "--use_test_ca" => test_ca = interop::truth(&name, &value).unwrap_or_else(|e| fail(&e)),
            "--server_host_override" => host_override = Some(value),
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
    let mut builder = Channel::builder(&url).timeout(CALL_TIMEOUT);
    if tls {
        if !test_ca {
            // No built-in roots: a client names the CA it trusts.
            fail("interop-client: --use_tls needs --use_test_ca true (no system roots are loaded)");
        }
        let dir = TestCerts::default_dir();
        let certs = TestCerts::load(&dir).unwrap_or_else(|e| {
            fail(&format!(
                "interop-client: the test CA ({e}): start interop-server with --use_tls first"
            ))
        });
        let host = host_override.unwrap_or_else(|| host_of(&url));
        builder = builder
            .tls_config(certs.client_config(&host))
            .unwrap_or_else(|s| fail(&format!("interop-client: TLS: {}", s.message())));
    }
    let channel = builder.connect().unwrap_or_else(|s| {
        fail(&format!(
            "interop-client: cannot connect to {url}: {}",
            s.message()
        ))
    });
    let failed = cases::run(&channel, &selected);
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// The host of `url` (`scheme://host:port`), brackets of an IPv6 address
/// removed.
fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = match rest.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => rest,
    };
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned()
}
