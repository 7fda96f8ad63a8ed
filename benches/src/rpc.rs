//! The measured run: unary echo calls against an rdma-rpc server embedded in
//! this process.
//!
//! # How concurrency is generated
//!
//! One driver thread keeps `concurrency` calls outstanding as that many
//! async lanes (`futures::executor::block_on` over `join_all`), each lane
//! issuing its next call as soon as its previous one completes (a closed
//! loop), the lanes spread round-robin over the connections. The
//! alternative, one OS thread per outstanding call blocking in
//! `UnaryCall::wait`, would at concurrency 64 on a 2-core machine mostly
//! measure the kernel scheduler juggling 64 runnable threads against the
//! client and server pollers and the server's workers; with one driver, the
//! threads that run are the framework's own (pollers, workers) plus one
//! caller, at any concurrency, and what grows with concurrency is what the
//! framework must handle: calls in flight on its rings. At concurrency 1 the
//! call blocks in `UnaryCall::wait`, as a synchronous caller's does: the
//! waiting thread polls for its own response.
//!
//! The clock runs from just before the call is issued (encoding included)
//! to its decoded reply; building the request payload and checking the
//! echo happen outside it, but inside the wall-clock time that `rps` is
//! computed from, as they are for every baseline.

use crate::measure::{Bench, Kind, Measurement, Params, Tally, interleave};
use crate::payload;
use examples::echo::EchoRequest;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::services::EchoService;
use rpc_core::{Channel, Server, ServerHandle};
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

/// Longest a single call may take before it counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What to run (see [`crate::Options`], of which this is the part the
/// measured run needs).
#[derive(Debug, Clone)]
pub struct RpcRun {
    /// Where the server listens (port 0 allowed).
    pub url: String,
    /// Calls, payload and concurrency.
    pub params: Params,
    /// How long server and clients spin before they sleep (None: default).
    pub spin: Option<Duration>,
}

/// Serves the echo service on `url`, with the defaults a user gets (and
/// `spin`, if set).
pub fn serve(url: &str, spin: Option<Duration>) -> Result<ServerHandle, String> {
    let mut builder = Server::builder().add_service(EchoServer::new(EchoService));
    if let Some(spin) = spin {
        builder = builder.spin(spin);
    }
    builder
        .serve(url)
        .map_err(|s| format!("cannot serve on {url}: {}", s.message()))
}

/// Our side, set up: the embedded server and its connected clients. The
/// server shuts down when this is dropped.
pub struct RpcBench {
    clients: Vec<EchoClient>,
    server: Option<ServerHandle>,
    url: String,
    size: usize,
    concurrency: usize,
}

impl RpcBench {
    /// Starts the server and opens the connections. `Err` when either
    /// cannot be set up.
    pub fn start(run: &RpcRun) -> Result<RpcBench, String> {
        let server = serve(&run.url, run.spin)?;
        let url = server.local_url().to_owned();
        let mut clients = Vec::with_capacity(run.params.connections);
        for _ in 0..run.params.connections.max(1) {
            let mut builder = Channel::builder(&url).timeout(CALL_TIMEOUT);
            if let Some(spin) = run.spin {
                builder = builder.spin(spin);
            }
            let channel = builder
                .connect()
                .map_err(|s| format!("cannot connect to {url}: {}", s.message()))?;
            clients.push(EchoClient::new(channel));
        }
        Ok(RpcBench {
            clients,
            server: Some(server),
            url,
            size: run.params.size,
            concurrency: run.params.concurrency,
        })
    }

    /// The server's bound URL (port 0 resolved).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL's fabric: `mem`, `tcp` or `rdma`.
    pub fn fabric(&self) -> &str {
        self.url.split("://").next().unwrap_or("")
    }
}

impl Bench for RpcBench {
    fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration) {
        drive(&self.clients, self.size, first, calls, self.concurrency)
    }
}

impl Drop for RpcBench {
    fn drop(&mut self) {
        self.clients.clear();
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
    }
}

/// Runs our side alone: starts, warms up, measures in one round, shuts
/// down. `Err` when the server or a connection cannot be set up; failed
/// calls are counted in the result instead.
pub fn run(run: &RpcRun) -> Result<Measurement, String> {
    let mut bench = RpcBench::start(run)?;
    let (totals, _) = interleave(&mut bench, None, &run.params, 1);
    let url = bench.url().to_owned();
    let fabric = bench.fabric().to_owned();
    drop(bench);
    Ok(Measurement::from_totals(
        Kind::Rpc,
        &fabric,
        url,
        run.params,
        &totals,
    ))
}

/// Runs `calls` calls numbered from `first`, `concurrency` outstanding, on
/// this thread; returns what they measured and the wall-clock time.
pub fn drive(
    clients: &[EchoClient],
    size: usize,
    first: u64,
    calls: u64,
    concurrency: usize,
) -> (Tally, Duration) {
    let next = Cell::new(first);
    let end = first + calls;
    let tally = RefCell::new(Tally::default());
    if concurrency <= 1 {
        // One call at a time: block in `wait`, as a synchronous caller does.
        let start = Instant::now();
        for seq in first..end {
            let request = EchoRequest {
                payload: payload::make(size, seq),
            };
            let client = &clients[(seq as usize) % clients.len()];
            let t = Instant::now();
            let reply = client.echo(request).wait();
            let latency = t.elapsed();
            let outcome = payload::outcome(reply.map(|r| r.into_inner().payload), size, seq);
            tally.borrow_mut().record(latency, outcome);
        }
        return (tally.into_inner(), start.elapsed());
    }
    let lanes = (0..concurrency.max(1)).map(|lane| {
        let client = &clients[lane % clients.len()];
        let (next, tally) = (&next, &tally);
        async move {
            loop {
                let seq = next.get();
                if seq >= end {
                    break;
                }
                next.set(seq + 1);
                let request = EchoRequest {
                    payload: payload::make(size, seq),
                };
                let start = Instant::now();
                let reply = client.echo(request).await;
                let latency = start.elapsed();
                let outcome = payload::outcome(reply.map(|r| r.into_inner().payload), size, seq);
                tally.borrow_mut().record(latency, outcome);
            }
        }
    });
    let start = Instant::now();
    futures::executor::block_on(futures::future::join_all(lanes));
    (tally.into_inner(), start.elapsed())
}
