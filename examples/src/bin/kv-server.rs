//! Serves the example key-value store, and the standard health service
//! (`grpc.health.v1.Health`) reporting it.
//!
//! ```text
//! kv-server --listen tcp://0.0.0.0:7471
//! ```

use examples::kv::kv_server::{self, KvServer};
use examples::services::KvStore;
use rpc_core::Server;
use rpc_core::health::{self, ServingStatus};

const USAGE: &str =
    "usage: kv-server --listen URL   (URL: tcp://host:port, rdma://host:port or mem://name)";

fn main() {
    examples::init_logging("info");
    let mut args = std::env::args().skip(1);
    let mut listen = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" | "-l" => listen = args.next(),
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            other => fail(&format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let Some(listen) = listen else { fail(USAGE) };
    let (health, health_service) = health::service();
    let server = match Server::builder()
        .add_service(KvServer::new(KvStore::new()))
        .add_service(health_service)
        .serve(&listen)
    {
        Ok(s) => s,
        Err(status) => fail(&format!(
            "kv-server: cannot serve on {listen}: {}",
            status.message()
        )),
    };
    health.set_status(kv_server::DESCRIPTOR.name, ServingStatus::Serving);
    println!("kv-server listening on {}", server.local_url());
    // Serve until killed.
    loop {
        std::thread::park();
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("{msg}");
    std::process::exit(2)
}
