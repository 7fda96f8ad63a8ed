//! With TLS, handshakes still cost no thread and cannot keep real clients
//! out: peers that say nothing, and peers that stop in the middle of their
//! TLS handshake, sit in the gate until evicted or timed out. The whole
//! process's threads are counted, so this binary holds this one test.

#[macro_use]
mod common;

use common::certs::Ca;
use common::*;
use examples::echo::echo_client::EchoClient;
use rpc_core::Channel;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The first bytes of a TLS 1.2 ClientHello record: the gate starts a TLS
/// session for such a peer and waits for the rest.
const CLIENT_HELLO_START: &[u8] = &[0x16, 0x03, 0x01, 0x00, 0xf0, 0x01, 0x00, 0x00];

on_network_fabrics! {
    fn tls_idle_handshakes_hold_no_thread_and_keep_nobody_out(url: &str) {
        const IDLE: usize = 1000;
        allow_descriptors(8192);
        let ca = Ca::new("test CA");
        let probe = Probe::new();
        let server = serve(
            test_server(&probe).tls_config(ca.server_config(url)).unwrap(),
            url,
        );
        let u = server.local_url().to_owned();
        let addr = rpc_core::fabric::FabricUrl::parse(&u).unwrap().socket_addr();
        let tls_channel = || {
            Channel::builder(&u)
                .timeout(LIMIT)
                .tls_config(ca.client_config())
                .unwrap()
                .connect()
                .expect("a TLS connect")
        };
        // The client side's own threads start with its first channel.
        drop(tls_channel());
        let before = threads();
        // Half say nothing; half start a TLS handshake and stop.
        let idle: Vec<TcpStream> = (0..IDLE)
            .map(|i| {
                let mut s = TcpStream::connect(&addr)
                    .unwrap_or_else(|e| panic!("idle connect {i}: {e}"));
                if i % 2 == 1 {
                    s.write_all(CLIENT_HELLO_START).unwrap();
                }
                s
            })
            .collect();
        // Let the server take them all in.
        std::thread::sleep(Duration::from_millis(300));
        let during = threads();
        assert!(
            during <= before,
            "{IDLE} idle TLS handshakes took {} threads",
            during.saturating_sub(before)
        );
        // A real client still gets in at once, TLS handshake and all.
        let started = Instant::now();
        let real = tls_channel();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(300), "connecting took {took:?}");
        let reply = EchoClient::new(real)
            .echo(echo_request("real", vec![7; 100], &[]))
            .wait()
            .expect("a call past the idle peers");
        assert_eq!(reply.into_inner().payload, vec![7; 100]);
        drop(idle);
    }
}
