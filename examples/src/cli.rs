//! What the example binaries share: argument helpers, exiting with a
//! message, and serving until killed.

use rpc_core::health::{self, ServingStatus};
use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use rpc_core::{ChannelBuilder, Server, Service};

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

/// What the client binaries say about their TLS options.
pub const CLIENT_TLS_USAGE: &str = "TLS (tcp://, and the rdma:// handshake):
  --tls-ca FILE                 trust servers whose certificate this CA (PEM) issued
  --tls-domain NAME             the name the server's certificate must carry (default: the URL's host)
  --tls-cert FILE --tls-key FILE  this client's certificate and key (PEM), for mutual TLS";

/// Removes the client's TLS options from `args` (see [`CLIENT_TLS_USAGE`])
/// and applies them to `builder`; fails with a message naming a bad file.
pub fn client_tls(args: &mut Vec<String>, builder: ChannelBuilder) -> ChannelBuilder {
    let ca = take_opt(args, "--tls-ca");
    let domain = take_opt(args, "--tls-domain");
    let identity = identity(take_opt(args, "--tls-cert"), take_opt(args, "--tls-key"));
    let Some(ca) = ca else {
        if domain.is_some() || identity.is_some() {
            fail("--tls-domain, --tls-cert and --tls-key need --tls-ca");
        }
        return builder;
    };
    let ca = Certificate::from_pem_file(&ca).unwrap_or_else(|e| fail(e.message()));
    let mut config = ClientTlsConfig::new().ca_certificate(ca);
    if let Some(domain) = domain {
        config = config.domain_name(domain);
    }
    if let Some(identity) = identity {
        config = config.identity(identity);
    }
    builder
        .tls_config(config)
        .unwrap_or_else(|e| fail(e.message()))
}

/// The identity in a certificate and a key file, given both or neither.
fn identity(cert: Option<String>, key: Option<String>) -> Option<Identity> {
    match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => {
            Some(Identity::from_pem_files(cert, key).unwrap_or_else(|e| fail(e.message())))
        }
        _ => fail("--tls-cert and --tls-key go together"),
    }
}

/// The main of a server binary `name`: takes `--listen URL` (and TLS
/// options, and `--grpc HOST:PORT` for a gRPC face), serves `service` and the standard health service (reporting
/// the service as serving) and the reflection service (so that `rpc list`
/// and `rpc call` work against it) on it, until SIGINT or SIGTERM: then it reports
/// the service as not serving, stops accepting, lets calls in flight
/// finish (up to the default grace period) and exits 0.
pub fn serve_until_killed(name: &str, service: impl Service) -> ! {
    // Before any thread starts, so that every thread inherits the mask and
    // only `wait_for_termination` receives them.
    let signals = block_termination_signals();
    let usage = format!(
        "usage: {name} --listen URL [--grpc HOST:PORT] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
  URL: tcp://host:port, rdma://host:port or mem://name
  --grpc HOST:PORT                serve standard gRPC (HTTP/2) there too, for gRPC clients and probes
  --tls-cert FILE --tls-key FILE  serve over TLS with this certificate chain and key (PEM)
  --tls-client-ca FILE            and require client certificates from this CA (mutual TLS)"
    );
    let mut args = std::env::args().skip(1);
    let mut listen = None;
    let mut grpc = None;
    let (mut cert, mut key, mut client_ca) = (None, None, None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" | "-l" => listen = args.next(),
            "--grpc" => grpc = args.next(),
            "--tls-cert" => cert = args.next(),
            "--tls-key" => key = args.next(),
            "--tls-client-ca" => client_ca = args.next(),
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
    let mut builder = Server::builder();
    match identity(cert, key) {
        Some(identity) => {
            let mut config = ServerTlsConfig::new().identity(identity);
            if let Some(ca) = client_ca {
                let ca = Certificate::from_pem_file(&ca).unwrap_or_else(|e| fail(e.message()));
                config = config.client_ca_root(ca);
            }
            builder = builder
                .tls_config(config)
                .unwrap_or_else(|e| fail(&format!("{name}: {}", e.message())));
        }
        None if client_ca.is_some() => fail("--tls-client-ca needs --tls-cert and --tls-key"),
        None => {}
    }
    builder = builder
        .add_service(service)
        .add_service(health_service)
        .add_reflection();
    if let Some(addr) = &grpc {
        builder = builder.grpc(addr);
    }
    let server = match builder.serve(&listen) {
        Ok(s) => s,
        Err(status) => fail(&format!(
            "{name}: cannot serve on {listen}: {}",
            status.message()
        )),
    };
    health.set_status(service_name, ServingStatus::Serving);
    println!("{name} listening on {}", server.local_url());
    if let Some(addr) = server.grpc_addr() {
        println!("{name} serving gRPC on {addr}");
    }
    let signal = wait_for_termination(&signals);
    eprintln!("{name}: signal {signal}: shutting down");
    // Sets every health status to NOT_SERVING and ends the watches.
    server.shutdown();
    eprintln!("{name}: stopped");
    std::process::exit(0);
}

/// Blocks SIGINT and SIGTERM on this thread (and the threads it starts
/// after), and returns the set to wait for them with.
pub fn block_termination_signals() -> libc::sigset_t {
    // SAFETY: `set` is a plain sigset_t initialised by `sigemptyset` before
    // use; `pthread_sigmask` only reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits for one of the signals of `set` (blocked beforehand) and returns it.
pub fn wait_for_termination(set: &libc::sigset_t) -> i32 {
    loop {
        let mut signal = 0;
        // SAFETY: `set` is a valid, initialised signal set and `signal` a
        // valid place for the result.
        let rc = unsafe { libc::sigwait(set, &mut signal) };
        if rc == 0 {
            return signal;
        }
    }
}
