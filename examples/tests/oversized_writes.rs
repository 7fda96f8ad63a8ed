//! A stranger cannot make a tcp:// server allocate with a length field: a
//! write's length is checked against the ring it targets before anything
//! is set aside, and payload lands in the ring itself. The whole process is
//! measured (one test per binary).

#[macro_use]
mod common;

use common::*;
use rpc_core::fabric::PeerRing;
use rpc_core::testing::bootstrap::{HELLO_LEN, Hello, HelloFabric};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Handshakes by hand: a valid 64-byte hello for a 64 KiB ring; returns the
/// server's ring.
fn handshake(stream: &mut TcpStream) -> PeerRing {
    stream
        .write_all(&tcp_hello(64 << 10, 1024).encode())
        .unwrap();
    let mut reply = [0; HELLO_LEN];
    stream.read_exact(&mut reply).expect("the server's hello");
    Hello::decode(&reply, HelloFabric::Tcp)
        .expect("a valid hello")
        .ring
}

/// The 29 bytes of a WRITE's head: tag, wr_id, remote address, rkey,
/// immediate, length; no payload follows.
fn write_head(ring: &PeerRing, len: u32) -> Vec<u8> {
    let mut w = vec![1u8];
    w.extend_from_slice(&7u64.to_le_bytes());
    w.extend_from_slice(&ring.addr.to_le_bytes());
    w.extend_from_slice(&ring.rkey.to_le_bytes());
    w.extend_from_slice(&0u32.to_le_bytes());
    w.extend_from_slice(&len.to_le_bytes());
    w
}

/// Whether the server closed the connection (after what it sent).
fn closed(stream: &mut TcpStream) -> bool {
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    }
}

#[test]
fn ninety_three_bytes_cannot_make_the_server_allocate() {
    const PEERS: usize = 100;
    const SLACK: u64 = 16 << 20;
    watchdog(|| {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let url = server.local_url().to_owned();
        let addr = rpc_core::fabric::FabricUrl::parse(&url)
            .unwrap()
            .socket_addr();
        let good = channel(&url);
        drop(good);
        std::thread::sleep(Duration::from_millis(200));
        let baseline = rss();

        // 64-byte hello + 29-byte write head claiming 2 GiB: refused and
        // closed (with a logged reason) before anything is allocated.
        let mut liars: Vec<TcpStream> = (0..PEERS)
            .map(|_| {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(LIMIT)).unwrap();
                let ring = handshake(&mut s);
                s.write_all(&write_head(&ring, 1 << 31)).unwrap();
                s
            })
            .collect();
        let grown = rss().saturating_sub(baseline);
        assert!(
            grown < SLACK,
            "{PEERS} lying peers grew the server by {} MiB",
            grown >> 20
        );
        for (i, s) in liars.iter_mut().enumerate() {
            assert!(closed(s), "peer {i} was not closed");
        }

        // A length that fits the ring, and a payload that never comes: the
        // connection waits, holding only its ring (untouched pages).
        let waiting: Vec<TcpStream> = (0..PEERS)
            .map(|_| {
                let mut s = TcpStream::connect(&addr).unwrap();
                let ring = handshake(&mut s);
                s.write_all(&write_head(&ring, (ring.len / 2) as u32))
                    .unwrap();
                s
            })
            .collect();
        let settle = Instant::now() + Duration::from_millis(300);
        while Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(50));
        }
        let grown = rss().saturating_sub(baseline);
        assert!(
            grown < SLACK,
            "{PEERS} peers holding half-sent writes grew the server by {} MiB",
            grown >> 20
        );
        // The server still serves.
        let reply = examples::echo::echo_client::EchoClient::new(channel(&url))
            .echo(echo_request("after", vec![1, 2, 3], &[]))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, vec![1, 2, 3]);
        drop(waiting);
    });
}
