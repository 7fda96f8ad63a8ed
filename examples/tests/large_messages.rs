//! Large messages travel by rendezvous: the sender lends its encoded
//! message to the connection and the receiver reads it straight into its
//! own buffer (an RDMA READ; emulated on mem:// and tcp://). Requests and
//! responses of any size up to the limit arrive intact, a message above
//! the limit fails at its sender with `ResourceExhausted`, and small calls
//! on the same connection go on meanwhile.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use rpc_core::Code;

/// How long the largest round trips may take.
const HUGE_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// The tests of this file one at a time: they count the process's
/// large-message buffers.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A server built by `server` that takes messages of `len` bytes (and
/// their metadata), and an echo client of the same limit whose calls time
/// out after `timeout`.
fn serve_large(
    server: rpc_core::ServerBuilder,
    url: &str,
    len: usize,
    timeout: std::time::Duration,
) -> (rpc_core::ServerHandle, EchoClient) {
    let server = serve(server.max_message_size(len + 64), url);
    let echo = EchoClient::new(
        rpc_core::Channel::builder(server.local_url())
            .max_message_size(len + 64)
            .timeout(timeout)
            .connect()
            .unwrap(),
    );
    (server, echo)
}

/// Sends `len` bytes and asks for `reply` bytes back, checking both.
fn round_trip(echo: &EchoClient, len: usize, seed: u64) {
    let payload = pattern(len, seed);
    let reply = echo
        .echo(echo_request("large", payload.clone(), &[]))
        .wait()
        .unwrap_or_else(|e| panic!("echo of {len} bytes: {e}"));
    let got = reply.into_inner().payload;
    assert_eq!(got.len(), len, "echoed length");
    assert!(got == payload, "echo of {len} bytes differs");
}

on_every_fabric! {
    fn messages_of_every_size_round_trip(url: &str) {
        let _serial = serial();
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let echo = EchoClient::new(channel(server.local_url()));
        // Around the rendezvous threshold and the ring's half, and well past.
        for (i, len) in [0, 1, 32 << 10, (32 << 10) + 1, 1 << 20, (1 << 20) + 7, 9 << 20]
            .into_iter()
            .enumerate()
        {
            round_trip(&echo, len, i as u64);
        }
    }
}

on_every_fabric! {
    fn a_message_above_the_limit_fails_at_its_sender(url: &str) {
        let _serial = serial();
        let probe = Probe::new();
        let server = serve(test_server(&probe).max_message_size(4 << 20), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let err = echo
            .echo(echo_request("too-big", vec![0; 5 << 20], &[]))
            .wait()
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        assert!(err.message().contains(&(4 << 20).to_string()), "names the limit: {err}");
        // The connection is fine.
        round_trip(&echo, 3 << 20, 1);
    }
}

on_every_fabric! {
    fn small_calls_pass_while_large_ones_are_read(url: &str) {
        let _serial = serial();
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let big = std::thread::spawn({
            let echo = echo.clone();
            move || {
                for i in 0..4 {
                    round_trip(&echo, 16 << 20, i);
                }
            }
        });
        for i in 0..200u64 {
            round_trip(&echo, 100, i);
        }
        big.join().unwrap();
    }
}

on_every_fabric! {
    fn many_large_messages_at_once_all_arrive_intact(url: &str) {
        // 9 × 8 MiB each way: more than a connection reads at once (64 MiB),
        // so some wait for others' reads to finish, in order.
        let _serial = serial();
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let calls: Vec<_> = (0..9u64)
            .map(|i| {
                let echo = echo.clone();
                std::thread::spawn(move || round_trip(&echo, 8 << 20, i))
            })
            .collect();
        for c in calls {
            c.join().unwrap();
        }
        eventually_within(HUGE_LIMIT, "every buffer back", || {
            rpc_core::fabric::buffer_bytes().0 == 0
        });
    }
}

on_every_fabric! {
    /// Calls cancelled while their lent requests wait behind another's read
    /// (a connection reads 64 MiB at once): those requests are never read,
    /// their buffers go back to the client at once, and the one read under
    /// way completes and is dropped.
    fn a_cancelled_calls_lent_payloads_waiting_to_be_read_are_not_read(url: &str) {
        let posted = cancel_waiting_lent_requests(url, 40 << 20, 6);
        assert_eq!(posted, 1, "cancelled requests read (of 6), the first under way");
    }
}

fabric_tests! {
    [rdma]
    /// As above, with more lent requests than a verbs queue pair reads at
    /// once (16), all of which fit the 64 MiB a connection reads at once:
    /// the reads beyond those 16 wait in the dispatcher, where the cancels
    /// take them back, not in the queue pair, where they would be read.
    fn cancelled_lent_requests_beyond_the_queue_pairs_reads_are_not_read(url: &str) {
        // All 30 requests and their cancels are doorbells in the server's
        // completion queue before the first read can complete (a 2 MiB
        // read takes tens of milliseconds in the guest), and a verbs
        // dispatcher takes receive completions before send ones in a turn.
        let posted = cancel_waiting_lent_requests(url, 2 << 20, 30);
        assert_eq!(posted, 16, "cancelled requests read (of 30), 16 under way");
    }
}

/// Sends `calls` requests of `len` bytes (lent) and cancels each at once,
/// while the server's one dispatcher is held in a handler; then lets it go.
/// Checks that the client's lent buffers all come back, that no cancelled
/// call ran and that the connection goes on; returns how many of the
/// requests' reads the server posted.
fn cancel_waiting_lent_requests(url: &str, len: usize, calls: u64) -> u64 {
    let _serial = serial();
    let probe = Probe::new();
    let (_server, echo) = serve_large(
        test_server_with(&probe, true).dispatchers(1),
        url,
        len,
        LIMIT,
    );
    // The server's one dispatcher is held in a handler while the large
    // requests and their cancels queue up behind it.
    let blocker = echo.echo(echo_request("blocker", vec![1], &[("block", "go")]));
    probe.wait_entered("blocker");
    let before = rpc_core::testing::reads_posted();
    let payload = pattern(len, 9);
    for i in 0..calls {
        drop(echo.echo(echo_request(&format!("big-{i}"), payload.clone(), &[])));
    }
    drop(payload);
    probe.open_gate("go");
    blocker.wait().unwrap();
    eventually("the client's lent requests come back", || {
        rpc_core::fabric::buffer_bytes().0 == 0
    });
    let posted = rpc_core::testing::reads_posted() - before;
    assert!(
        probe.seen().entered.iter().all(|t| t == "blocker"),
        "a cancelled call ran"
    );
    // The connection reads large messages on.
    round_trip(&echo, 2 << 20, 1);
    posted
}

/// A request and a response of `len` bytes each, every byte checked (the
/// echo answers with what it received); then no buffer stays in use.
fn huge_round_trip(url: &str, len: usize) {
    let probe = Probe::new();
    let (server, echo) = serve_large(test_server(&probe), url, len, HUGE_LIMIT);
    let started = std::time::Instant::now();
    let payload = pattern(len, 3);
    let reply = echo
        .echo(echo_request("gib", payload.clone(), &[]))
        .wait()
        .unwrap_or_else(|e| panic!("echo of {len} bytes: {e}"));
    let got = reply.into_inner().payload;
    assert_eq!(got.len(), len);
    assert!(got == payload, "the echo of {len} bytes differs");
    eprintln!("{len} bytes each way in {:?}", started.elapsed());
    drop(got);
    eventually("buffers in use return once the call is done", || {
        rpc_core::fabric::buffer_bytes().0 == 0
    });
    // Each side may keep its last large buffer (more than `len` bytes) for
    // reuse, but not for long: unused for 2 s, it is freed, even with no
    // connection left to tick for (the client runtime outlives this
    // channel). What stays kept is of the size classes, 256 MiB at most
    // per side.
    drop(echo);
    drop(server);
    eventually("large buffers kept for reuse are freed once unused", || {
        rpc_core::fabric::buffer_bytes().1 <= 2 * (256 << 20)
    });
}

on_soft_fabrics! {
    /// A 1 GiB request and a 1 GiB response.
    fn a_gibibyte_each_way_round_trips_intact(url: &str) {
        let _serial = serial();
        huge_round_trip(url, 1 << 30);
    }
}

/// 256 MiB each way on rdma:// (the Soft-RoCE guest has less memory,
/// and emulates the NIC slowly: a longer time limit than other tests').
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn a_256_mib_message_each_way_round_trips_intact_on_rdma() {
    let url = common::rdma_url();
    within(HUGE_LIMIT, "the 256 MiB round trip", move || {
        let _serial = serial();
        huge_round_trip(&url, 256 << 20);
    });
}

/// A server that goes away while it reads a request of `len` bytes: the
/// call fails `Unavailable`, and both sides' buffers are returned.
fn lost_mid_transfer(url: &str, len: usize, limit: std::time::Duration) {
    let probe = Probe::new();
    let (server, echo) = serve_large(test_server(&probe), url, len, limit);
    let call =
        std::thread::spawn(move || echo.echo(echo_request("cut", pattern(len, 5), &[])).wait());
    // Both sides hold a buffer: the client's lent request, the server's
    // destination.
    eventually_within(limit, "the transfer starts", || {
        rpc_core::fabric::buffer_bytes().0 >= 2 * len
    });
    drop(server);
    let err = call.join().unwrap().expect_err("the server went away");
    assert_eq!(err.code(), rpc_core::Code::Unavailable, "{err}");
    eventually_within(limit, "no buffer is left in use", || {
        rpc_core::fabric::buffer_bytes().0 == 0
    });
}

on_soft_fabrics! {
    fn a_peer_lost_mid_transfer_leaves_no_buffers(url: &str) {
        let _serial = serial();
        lost_mid_transfer(url, 256 << 20, LIMIT);
    }
}

/// On rdma:// the lent buffer is registered memory behind a memory
/// window, and the destination too: both are returned.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn a_peer_lost_mid_transfer_leaves_no_buffers_on_rdma() {
    let url = common::rdma_url();
    within(HUGE_LIMIT, "the lost transfer", move || {
        let _serial = serial();
        lost_mid_transfer(&url, 64 << 20, HUGE_LIMIT);
    });
}
