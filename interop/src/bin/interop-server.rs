//! Serves `grpc.testing.TestService` (gRPC's interop test service) until
//! SIGINT or SIGTERM.
//!
//! ```text
//! interop-server --port 10000                    # standard gRPC (HTTP/2) on 0.0.0.0:10000
//! interop-server --listen tcp://0.0.0.0:7480 --listen mem://interop
//! interop-server --port 10000 --use_tls true     # TLS, with the test certificates
//! ```

use examples::cli::{block_termination_signals, fail, wait_for_termination};
use interop::certs::TestCerts;
use interop::pb::test_service_server::TestServiceServer;
use interop::server::TestServer;
use rpc_core::Server;

const USAGE: &str = "\
usage: interop-server [--port PORT] [--listen URL]... [--use_tls true|false]
  --port PORT    serve standard gRPC (HTTP/2) on 0.0.0.0:PORT, as gRPC's interop servers do
  --listen URL   serve on one of our fabrics too: tcp://host:port, rdma://host:port, mem://name
                 (repeatable)
  --use_tls      serve over TLS (the face, tcp://, and rdma://'s handshake) with the test
                 certificates, made on first use in $RPC_INTEROP_CERTS (default: the temporary
                 directory's rdma-rpc-interop-certs); clients trust its ca.pem
At least one of --port and --listen. Prints a `listening` line per address, then
serves until SIGINT or SIGTERM.";

fn main() {
    examples::init_logging("warn");
    let signals = block_termination_signals();
    let mut port = None;
    let mut urls = Vec::new();
    let mut tls = false;
    let flags =
        interop::flags(std::env::args().skip(1)).unwrap_or_else(|e| fail(&format!("{e}\n{USAGE}")));
    for (name, value) in flags {
        match name.as_str() {
            "--port" => port = Some(value),
            "--listen" => urls.push(value),
            "--use_tls" => tls = interop::truth(&name, &value).unwrap_or_else(|e| fail(&e)),
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
    let certs = tls.then(|| {
        let dir = TestCerts::default_dir();
        let certs = TestCerts::load_or_make(&dir).unwrap_or_else(|e| {
            fail(&format!(
                "interop-server: test certificates in {}: {e}",
                dir.display()
            ))
        });
        println!(
            "interop-server TLS with the test certificates: trust {}",
            certs.dir.join("ca.pem").display()
        );
        certs
    });
    let mut servers = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        // Every encoding is accepted by default: a client's compressed
        // requests arrive, and the service answers compressed when asked.
        let mut builder = Server::builder().add_service(TestServiceServer::new(TestServer));
        if let Some(certs) = &certs {
            builder = builder
                .tls_config(certs.server_config())
                .unwrap_or_else(|s| fail(&format!("interop-server: TLS: {}", s.message())));
        }
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
