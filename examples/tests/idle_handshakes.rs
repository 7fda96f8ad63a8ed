//! Handshakes cost no thread and cannot keep real clients out. The whole
//! process's threads are counted, so this binary holds this one test.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Whether the server reports no identity for the caller (none required).
fn anonymous(channel: rpc_core::Channel) -> bool {
    let reply = EchoClient::new(channel)
        .echo(echo_request("who", Vec::new(), &[("who", "1")]))
        .wait()
        .expect("a call on an admitted connection");
    reply.metadata().get("peer-identity").is_none()
}

on_network_fabrics! {
    fn idle_handshakes_hold_no_thread_and_keep_nobody_out(url: &str) {
        const IDLE: usize = 2000;
        allow_descriptors(8192);
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let u = server.local_url().to_owned();
        let addr = rpc_core::fabric::FabricUrl::parse(&u).unwrap().socket_addr();
        // The client side's own threads start with its first channel.
        drop(channel(&u));
        let before = threads();
        // Peers that connect and never say a word, in a burst. With a short
        // listen backlog some of them would wait for a SYN retransmit (1 s).
        let mut slowest = Duration::ZERO;
        let idle: Vec<TcpStream> = (0..IDLE)
            .map(|i| {
                let t = Instant::now();
                let s = TcpStream::connect(&addr).unwrap_or_else(|e| panic!("idle connect {i}: {e}"));
                slowest = slowest.max(t.elapsed());
                s
            })
            .collect();
        assert!(
            slowest < Duration::from_millis(900),
            "a connect in the burst took {slowest:?}"
        );
        // Let the server take them all in.
        std::thread::sleep(Duration::from_millis(300));
        let during = threads();
        assert!(
            during <= before,
            "{IDLE} idle handshakes took {} threads",
            during.saturating_sub(before)
        );
        // A real client still gets in at once.
        let started = Instant::now();
        let real = channel(&u);
        let took = started.elapsed();
        assert!(took < Duration::from_millis(100), "connecting took {took:?}");
        assert!(anonymous(real));
        drop(idle);
    }
}
