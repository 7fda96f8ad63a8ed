//! A `Channel` is a connection, not a thread: a thousand of them in one
//! process share the client's dispatchers, and a server's connections share
//! its own. One test per binary run at a time (threads are counted for the
//! whole process): the soft fabrics in one test, rdma:// in another that
//! runs alone in the Soft-RoCE guest.

#[macro_use]
mod common;

use common::threads;
use examples::echo::EchoRequest;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::services::EchoService;
use rpc_core::{Channel, Request, Server};
use std::collections::BTreeMap;

/// Dispatcher threads the server gets (set explicitly).
const SERVER_DISPATCHERS: usize = 2;
/// Threads allowed beyond the dispatchers of client and server: the
/// acceptor, the handshake gate, the rdma:// liveness watchers.
const SLACK: usize = 8;
/// Small rings: this test is about threads, not memory.
const RING: usize = 64 << 10;

/// Threads whose name starts with `prefix`, and their names.
fn named(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .filter(|c| c.starts_with(prefix))
        .collect()
}

/// A thread's kind: its name up to the second dash (`rpc-dispatch-3` is a
/// `rpc-dispatch`; the kernel keeps 15 bytes of a name).
fn kind(name: &str) -> String {
    name.splitn(3, '-').take(2).collect::<Vec<_>>().join("-")
}

/// The threads ARCHITECTURE.md's table says a server with
/// [`SERVER_DISPATCHERS`] and its clients run on `url`'s fabric, by kind
/// (the blocking pool starts on demand: the echo service never needs it).
fn table(url: &str, client_dispatchers: usize) -> BTreeMap<String, usize> {
    let mut t = BTreeMap::from([
        ("rpc-dispatch".to_owned(), SERVER_DISPATCHERS),
        ("rpc-acceptor".to_owned(), 1),
        ("rpc-client".to_owned(), client_dispatchers),
    ]);
    if !url.starts_with("mem://") {
        t.insert("rpc-gate".to_owned(), 1);
    }
    if url.starts_with("rdma://") {
        // One liveness watcher per device context: the server's and the
        // client runtime's.
        t.insert("rpc-rdma".to_owned(), 2);
    }
    t
}

fn many_channels(url: &str, channels: usize) {
    let client_dispatchers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let before = threads();
    let server = Server::builder()
        .dispatchers(SERVER_DISPATCHERS)
        .ring_size(RING)
        .add_service(EchoServer::new(EchoService))
        .serve(url)
        .unwrap();
    let clients: Vec<EchoClient> = (0..channels)
        .map(|i| {
            let channel = Channel::builder(server.local_url())
                .ring_size(RING)
                .connect()
                .unwrap_or_else(|s| panic!("{url}: channel {i}: {s}"));
            EchoClient::new(channel)
        })
        .collect();
    // One call outstanding on every channel at once, each answered with its
    // own payload.
    let calls: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let payload = (i as u32).to_le_bytes().to_vec();
            (
                payload.clone(),
                c.echo(Request::new(EchoRequest {
                    payload: payload.into(),
                })),
            )
        })
        .collect();
    for (i, (payload, call)) in calls.into_iter().enumerate() {
        let reply = call
            .wait()
            .unwrap_or_else(|s| panic!("{url}: call on channel {i}: {s}"));
        assert_eq!(reply.get_ref().payload, payload, "{url}: channel {i}");
    }
    let bound = SERVER_DISPATCHERS + client_dispatchers + SLACK;
    let added = threads().saturating_sub(before);
    assert!(
        added <= bound,
        "{url}: {channels} channels run {added} threads, more than the {} dispatchers + {SLACK}: {:?}",
        SERVER_DISPATCHERS + client_dispatchers,
        named("")
    );
    eprintln!(
        "{url}: {channels} channels, {added} threads: {:?}",
        named("rpc-")
    );
    // Exactly the threads ARCHITECTURE.md's table lists, by kind.
    let mut running = BTreeMap::new();
    for name in named("rpc-") {
        *running.entry(kind(&name)).or_insert(0) += 1;
    }
    assert_eq!(
        running,
        table(url, client_dispatchers),
        "{url}: {:?}",
        named("rpc-")
    );
    drop(clients);
    server.shutdown();
}

#[test]
fn a_thousand_channels_share_the_dispatchers() {
    many_channels(&common::mem_url(module_path!()), 1000);
    many_channels("tcp://127.0.0.1:0", 1000);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_channels_share_the_dispatchers() {
    // Fewer in the emulated guest (each connection there takes tens of
    // milliseconds to set up), still far more than the thread bound.
    many_channels(&common::rdma_url(), 200);
}
