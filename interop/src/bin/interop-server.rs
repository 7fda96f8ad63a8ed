//! Serves `grpc.testing.TestService` (gRPC's interop test service) until
//! SIGINT or SIGTERM.
//!
//! ```text
//! interop-server --port 10000                    # standard gRPC (HTTP/2) on 0.0.0.0:10000
//! interop-server --listen tcp://0.0.0.0:7480 --listen mem://interop
//! ```

use examples::cli::{block_termination_signals, fail, wait_for_termination};
use interop::pb::test_service_server::TestServiceServer;
use interop::server::TestServer;
use rpc_core::Server;

const USAGE: &str = "\
usage: interop-server [--port PORT] [--listen URL]...
  --port PORT    serve standard gRPC (HTTP/2) on 0.0.0.0:PORT, as gRPC's interop servers do
  --listen URL   serve on one of our fabrics too: tcp://host:port, rdma://host:port, mem://name
                 (repeatable)
At least one of them. Prints a `listening` line per address, then serves until
SIGINT or SIGTERM.";

fn main() {
    examples::init_logging("warn");
    let signals = block_termination_signals();
    let mut port = None;
    let mut urls = Vec::new();
    let flags =
        interop::flags(std::env::args().skip(1)).unwrap_or_else(|e| fail(&format!("{e}\n{USAGE}")));
    for (name, value) in flags {
        match name.as_str() {
            "--port" => port = Some(value),
            "--listen" => urls.push(value),
            "--use_tls" => {
                if value != "false" {
                    fail("interop-server: --use_tls is not supported yet");
                }
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => fail(&format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    if port.is_none() && urls.is_empty() {
        fail(USAGE);
    }
    // The face needs a fabric to serve on too: an in-process one of its own
    // when no --listen URL is given.
    if urls.is_empty() {
        urls.push(format!("mem://interop-{}", std::process::id()));
    }
    let mut servers = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        // Every encoding is accepted by default: a client's compressed
        // requests arrive, and the service answers compressed when asked.
        let mut builder = Server::builder().add_service(TestServiceServer::new(TestServer));
        if let (0, Some(port)) = (i, &port) {
            builder = builder.grpc(&format!("0.0.0.0:{port}"));
        }
        let server = builder.serve(url).unwrap_or_else(|s| {
            fail(&format!(
                "interop-server: cannot serve on {url}: {}",
                s.message()
            ))
        });
        println!("interop-server listening on {}", server.local_url());
        if let Some(addr) = server.grpc_addr() {
            println!("interop-server listening on grpc://{addr}");
        }
        servers.push(server);
    }
    let signal = wait_for_termination(&signals);
    eprintln!("interop-server: signal {signal}: shutting down");
    for server in servers {
        server.shutdown();
    }
    std::process::exit(0);
}
