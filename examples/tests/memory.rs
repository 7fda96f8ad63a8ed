//! Closing connections gives their memory back: rings and staging areas
//! are mappings of their own, unmapped when a connection goes, so a
//! server that saw many connections does not stay large (with the default
//! allocator, whose heap would otherwise keep them). The whole process is
//! measured (client and server here), one test per binary run at a time.

#[macro_use]
mod common;

use common::{allow_descriptors, rss};
use examples::echo::EchoRequest;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::services::EchoService;
use rpc_core::{Channel, Request, Server};
use std::time::{Duration, Instant};

/// Opens `n` channels to `url` with default settings, makes one call on
/// each (so its rings are touched), and closes them all.
fn round(url: &str, n: usize) {
    let clients: Vec<EchoClient> = (0..n)
        .map(|i| {
            let channel = Channel::connect(url).unwrap_or_else(|s| panic!("channel {i}: {s}"));
            EchoClient::new(channel)
        })
        .collect();
    for (i, c) in clients.iter().enumerate() {
        let payload = rpc_core::Bytes::from(vec![i as u8; 4096]);
        let reply = c
            .echo(Request::new(EchoRequest {
                payload: payload.clone(),
            }))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, payload);
    }
}

/// Waits up to `limit` for RSS to fall to `most`; returns the last reading.
fn settle(most: u64, limit: Duration) -> u64 {
    let until = Instant::now() + limit;
    loop {
        let now = rss();
        if now <= most || Instant::now() > until {
            return now;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn closed_connections_give_their_memory_back() {
    const ROUNDS: usize = 10;
    const CONNECTIONS: usize = 1000;
    const SLACK: u64 = 64 << 20;
    // Both ends of every connection are in this process.
    allow_descriptors(8192);
    let server = Server::builder()
        .add_service(EchoServer::new(EchoService))
        .serve("tcp://127.0.0.1:0")
        .unwrap();
    let url = server.local_url().to_owned();
    // A first small round sets up what stays (dispatchers, pools).
    round(&url, 10);
    let baseline = settle(0, Duration::from_millis(500));
    let mut peak = 0;
    for r in 0..ROUNDS {
        round(&url, CONNECTIONS);
        peak = peak.max(rss());
        let after = settle(baseline + SLACK, Duration::from_secs(10));
        assert!(
            after <= baseline + SLACK,
            "round {r}: {} MiB resident after closing {CONNECTIONS} connections, \
             baseline {} MiB (peak {} MiB)",
            after >> 20,
            baseline >> 20,
            peak >> 20
        );
    }
    eprintln!(
        "baseline {} MiB, peak {} MiB, after {ROUNDS} rounds {} MiB",
        baseline >> 20,
        peak >> 20,
        rss() >> 20
    );
}
