//! The measured run: unary echo calls, or the messages of echo's server
//! streams, against an rdma-rpc server embedded in this process.
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
//! With `--tokio` the lanes are tasks spawned on a multi-thread tokio
//! runtime instead (a worker per core), as the tonic baseline's are and as
//! an async service would make its calls: what the runtime does when the
//! callers' threads are the executor's, not one driver.
//!
//! The clock runs from just before the call is issued (encoding included)
//! to its decoded reply; building the request payload and checking the
//! echo happen outside it, but inside the wall-clock time that `rps` is
//! computed from, as they are for every baseline.
//!
//! # Streams
//!
//! In stream mode ([`drive_streams`]) the lanes are the same, each reading
//! echo `Stream` calls to the end instead of making unary calls (see
//! [`crate::stream`] for how messages are split into streams and checked);
//! at concurrency 1 the stream is read with its blocking iterator, as a
//! synchronous caller does.

use crate::measure::{Bench, Kind, Measurement, Mode, Params, Tally, interleave};
use crate::payload;
use crate::stream::{Chunks, Consumer};
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::echo::{EchoRequest, StreamRequest};
use examples::services::EchoService;
use rpc_core::{Channel, Server, ServerHandle};
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

pub use crate::measure::CALL_TIMEOUT;

/// What to run (see [`crate::Options`], of which this is the part the
/// measured run needs).
#[derive(Debug, Clone)]
pub struct RpcRun {
    /// Where the server listens (port 0 allowed).
    pub url: String,
    /// Calls, payload and concurrency.
    pub params: Params,
    /// Experiment knobs (all `None`: the defaults a user gets).
    pub tuning: Tuning,
    /// TLS for server and clients (None: plaintext).
    pub tls: Option<crate::tls::TestPki>,
    /// Unary calls are made from tasks on a multi-thread tokio runtime
    /// (`--tokio`) instead of lanes joined on one thread.
    pub tokio: bool,
}

/// Settings a run may change for an experiment (`--spin-us`,
/// `--ring-size`, `--rendezvous-above`); each `None` leaves the default a
/// user gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tuning {
    /// How long server and clients spin before they sleep.
    pub spin: Option<Duration>,
    /// Receive ring per connection, each side (bytes, a power of two).
    pub ring_size: Option<usize>,
    /// Largest message, each side (set by [`Tuning::fitting`]).
    pub max_message: Option<usize>,
    /// Payloads above this many bytes travel by rendezvous, each side.
    pub rendezvous_above: Option<usize>,
    /// Both sides send their messages compressed in this encoding.
    pub compression: Option<rpc_core::Encoding>,
    /// Random (incompressible) payloads instead of a repeated byte.
    pub random_payload: bool,
}

/// The largest message both sides accept by default.
const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

impl Tuning {
    /// These settings, with both sides' message limit raised to fit
    /// payloads of `size` bytes if the default (64 MiB) does not, as the
    /// tonic baseline's limits are raised: a run at such sizes measures
    /// them instead of failing.
    pub fn fitting(mut self, size: usize) -> Tuning {
        let needed = size.saturating_add(1 << 20);
        if needed > DEFAULT_MAX_MESSAGE {
            self.max_message = Some(needed.min(u32::MAX as usize));
        }
        self
    }

    fn server(&self, mut builder: rpc_core::ServerBuilder) -> rpc_core::ServerBuilder {
        if let Some(spin) = self.spin {
            builder = builder.spin(spin);
        }
        if let Some(bytes) = self.ring_size {
            builder = builder.ring_size(bytes);
        }
        if let Some(bytes) = self.max_message {
            builder = builder.max_message_size(bytes);
        }
        if let Some(bytes) = self.rendezvous_above {
            builder = builder.rendezvous_above(bytes);
        }
        if let Some(encoding) = self.compression {
            builder = builder.send_compressed(encoding);
        }
        builder
    }

    fn channel(&self, mut builder: rpc_core::ChannelBuilder) -> rpc_core::ChannelBuilder {
        if let Some(spin) = self.spin {
            builder = builder.spin(spin);
        }
        if let Some(bytes) = self.ring_size {
            builder = builder.ring_size(bytes);
        }
        if let Some(bytes) = self.max_message {
            builder = builder.max_message_size(bytes);
        }
        if let Some(bytes) = self.rendezvous_above {
            builder = builder.rendezvous_above(bytes);
        }
        if let Some(encoding) = self.compression {
            builder = builder.send_compressed(encoding);
        }
        builder
    }
}

/// Serves the echo service on `url`, with the defaults a user gets (but
/// for what `tuning` sets; over TLS with `tls`).
pub fn serve(
    url: &str,
    tuning: &Tuning,
    tls: Option<&crate::tls::TestPki>,
) -> Result<ServerHandle, String> {
    let mut builder = tuning.server(Server::builder().add_service(EchoServer::new(EchoService)));
    if let Some(pki) = tls {
        builder = builder
            .tls_config(pki.server())
            .map_err(|s| format!("TLS: {}", s.message()))?;
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
    params: Params,
    tls: bool,
    /// What the fabric's label adds: `-gzip`, `-random` and the like.
    label: String,
    /// The runtime `--tokio` makes the calls from.
    tokio: Option<tokio::runtime::Runtime>,
}

impl RpcBench {
    /// Starts the server and opens the connections. `Err` when either
    /// cannot be set up.
    pub fn start(run: &RpcRun) -> Result<RpcBench, String> {
        let tuning = run.tuning.fitting(run.params.size);
        crate::payload::set_random(tuning.random_payload);
        let server = serve(&run.url, &tuning, run.tls.as_ref())?;
        let url = server.local_url().to_owned();
        let mut clients = Vec::with_capacity(run.params.connections);
        for _ in 0..run.params.connections.max(1) {
            let mut builder = Channel::builder(&url);
            // A unary call that hangs fails after CALL_TIMEOUT. A stream gets
            // the default, no deadline: it lasts a whole round, which may
            // take longer than any fixed limit (64 KiB messages in an
            // emulated guest).
            if run.params.mode == Mode::Unary {
                builder = builder.timeout(CALL_TIMEOUT);
            }
            builder = tuning.channel(builder);
            if let Some(pki) = &run.tls {
                builder = builder
                    .tls_config(pki.client())
                    .map_err(|s| format!("TLS: {}", s.message()))?;
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
            params: run.params,
            tls: run.tls.is_some(),
            label: [
                tuning.compression.map(|e| format!("-{e}")),
                tuning.random_payload.then(|| "-random".to_owned()),
            ]
            .into_iter()
            .flatten()
            .collect(),
            tokio: match run.tokio {
                true => Some(
                    tokio::runtime::Builder::new_multi_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| format!("cannot start a tokio runtime: {e}"))?,
                ),
                false => None,
            },
        })
    }

    /// The server's bound URL (port 0 resolved).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL's fabric: `mem`, `tcp` or `rdma`; `tls` for tcp:// over TLS;
    /// with `-tokio` added when the calls come from tokio tasks.
    pub fn fabric(&self) -> String {
        let fabric = match self.url.split("://").next().unwrap_or("") {
            "tcp" if self.tls => "tls",
            other => other,
        };
        let label = &self.label;
        match self.tokio {
            Some(_) => format!("{fabric}{label}-tokio"),
            None => format!("{fabric}{label}"),
        }
    }
}

impl Bench for RpcBench {
    fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration) {
        let p = &self.params;
        match p.mode {
            Mode::Unary => match &self.tokio {
                Some(rt) => drive_tokio(rt, &self.clients, p.size, first, calls, p.concurrency),
                None => drive(&self.clients, p.size, first, calls, p.concurrency),
            },
            Mode::Stream => {
                drive_streams(&self.clients, p.size, calls, p.concurrency, p.stream_len)
            }
        }
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
    let fabric = bench.fabric();
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
                payload: payload::make(size, seq).into(),
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
                let (latency, outcome) = timed_echo(client, size, seq).await;
                tally.borrow_mut().record(latency, outcome);
            }
        }
    });
    let start = Instant::now();
    futures::executor::block_on(futures::future::join_all(lanes));
    (tally.into_inner(), start.elapsed())
}

/// [`drive`]'s calls from `concurrency` tasks spawned on `rt` (each
/// making calls one after another until `calls` were made), as the tonic
/// baseline drives its own.
pub fn drive_tokio(
    rt: &tokio::runtime::Runtime,
    clients: &[EchoClient],
    size: usize,
    first: u64,
    calls: u64,
    concurrency: usize,
) -> (Tally, Duration) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(first));
    let end = first + calls;
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency.max(1))
        .map(|lane| {
            let client = clients[lane % clients.len()].clone();
            let next = next.clone();
            rt.spawn(async move {
                let mut tally = Tally::default();
                loop {
                    let seq = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seq >= end {
                        break;
                    }
                    let (latency, outcome) = timed_echo(&client, size, seq).await;
                    tally.record(latency, outcome);
                }
                tally
            })
        })
        .collect();
    (rt.block_on(Tally::join(tasks)), start.elapsed())
}

/// One echo call of a `size`-byte payload numbered `seq`: its latency, from
/// just before it is issued to its reply, and whether the echo is right.
async fn timed_echo(client: &EchoClient, size: usize, seq: u64) -> (Duration, Result<(), String>) {
    let request = EchoRequest {
        payload: payload::make(size, seq).into(),
    };
    let start = Instant::now();
    let reply = client.echo(request).await;
    let latency = start.elapsed();
    let outcome = payload::outcome(reply.map(|r| r.into_inner().payload), size, seq);
    (latency, outcome)
}

/// Reads `messages` messages of `size` bytes from echo `Stream` calls,
/// `concurrency` streams at a time (`stream_len` messages each, see
/// [`Chunks`]), on this thread; returns what they measured and the
/// wall-clock time.
pub fn drive_streams(
    clients: &[EchoClient],
    size: usize,
    messages: u64,
    concurrency: usize,
    stream_len: Option<u64>,
) -> (Tally, Duration) {
    let chunks = Chunks::new(messages, concurrency, stream_len);
    let request = |count| StreamRequest {
        count,
        size: size as u32,
    };
    let mut tally = Tally::default();
    if concurrency <= 1 {
        // One stream at a time, read with the blocking iterator.
        let start = Instant::now();
        let mut streams = 0;
        while let Some(count) = chunks.take() {
            let client = &clients[streams % clients.len()];
            streams += 1;
            let mut consumer = Consumer::start(&mut tally, size, count);
            let mut outcome = Ok(());
            for reply in client.stream(request(count)) {
                match reply {
                    Ok(reply) => consumer.message(&reply.payload),
                    Err(status) => {
                        outcome = Err(status.to_string());
                        break;
                    }
                }
            }
            consumer.end(outcome);
        }
        return (tally, start.elapsed());
    }
    let lanes = (0..concurrency).map(|lane| {
        let client = &clients[lane % clients.len()];
        let chunks = &chunks;
        async move {
            let mut tally = Tally::default();
            while let Some(count) = chunks.take() {
                let mut consumer = Consumer::start(&mut tally, size, count);
                let mut stream = client.stream(request(count));
                let outcome = loop {
                    match stream.message().await {
                        Ok(Some(reply)) => consumer.message(&reply.payload),
                        Ok(None) => break Ok(()),
                        Err(status) => break Err(status.to_string()),
                    }
                };
                consumer.end(outcome);
            }
            tally
        }
    });
    let start = Instant::now();
    let tallies = futures::executor::block_on(futures::future::join_all(lanes));
    let elapsed = start.elapsed();
    for t in tallies {
        tally.merge(t);
    }
    (tally, elapsed)
}
