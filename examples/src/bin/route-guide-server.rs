//! Serves gRPC's route guide over the example feature database, and the
//! standard health service (`grpc.health.v1.Health`) reporting it.
//!
//! ```text
//! route-guide-server --listen tcp://0.0.0.0:10000
//! ```

use examples::route_guide::RouteGuideService;
use examples::routeguide::route_guide_server::{self, RouteGuideServer};
use rpc_core::Server;
use rpc_core::health::{self, ServingStatus};

const USAGE: &str = "usage: route-guide-server --listen URL
  (URL: tcp://host:port, rdma://host:port or mem://name)";

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
        .add_service(RouteGuideServer::new(RouteGuideService::new()))
        .add_service(health_service)
        .serve(&listen)
    {
        Ok(s) => s,
        Err(status) => fail(&format!(
            "route-guide-server: cannot serve on {listen}: {}",
            status.message()
        )),
    };
    health.set_status(route_guide_server::DESCRIPTOR.name, ServingStatus::Serving);
    println!("route-guide-server listening on {}", server.local_url());
    // Serve until killed.
    loop {
        std::thread::park();
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("{msg}");
    std::process::exit(2)
}
