//! What the example binaries share: argument helpers, exiting with a
//! message, and serving until killed.

use rpc_core::health::{self, ServingStatus};
use rpc_core::{Server, Service};

/// Prints `msg` and exits with status 2 (bad usage, or cannot start).
pub fn fail(msg: &str) -> ! {
    eprintln!("{msg}");
    std::process::exit(2)
}

/// Removes `name VALUE` from `args` and returns the value, if present.
pub fn take_opt(args: &mut Vec<String>, name: &str) -> Option<String> {
    let i = args.iter().position(|a| a == name)?;
    if i + 1 >= args.len() {
        fail(&format!("{name} needs a value"));
    }
    args.remove(i);
    Some(args.remove(i))
}

/// Parses the value of option `name` as a number, or fails.
pub fn parse(v: &str, name: &str) -> u64 {
    v.parse()
        .unwrap_or_else(|_| fail(&format!("{name}: {v:?} is not a number")))
}

/// The main of a server binary `name`: takes `--listen URL`, serves
/// `service` and the standard health service (reporting the service as
/// serving) on it, and serves until killed.
pub fn serve_until_killed(name: &str, service: impl Service) -> ! {
    let usage = format!(
        "usage: {name} --listen URL   (URL: tcp://host:port, rdma://host:port or mem://name)"
    );
    let mut args = std::env::args().skip(1);
    let mut listen = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" | "-l" => listen = args.next(),
            "--help" | "-h" => {
                println!("{usage}");
                std::process::exit(0);
            }
            other => fail(&format!("unexpected argument {other:?}\n{usage}")),
        }
    }
    let Some(listen) = listen else { fail(&usage) };
    let service_name = service.descriptor().name;
    let (health, health_service) = health::service();
    let server = match Server::builder()
        .add_service(service)
        .add_service(health_service)
        .serve(&listen)
    {
        Ok(s) => s,
        Err(status) => fail(&format!(
            "{name}: cannot serve on {listen}: {}",
            status.message()
        )),
    };
    health.set_status(service_name, ServingStatus::Serving);
    println!("{name} listening on {}", server.local_url());
    loop {
        std::thread::park();
    }
}
