//! Ring sizes are a per-direction agreement: each side chooses the ring it
//! receives into, and a side stages what it sends for the peer's ring, up
//! to 64 MiB of it (or its own ring size, if larger). A server with a
//! large ring must still serve clients with default settings, and a message
//! larger than its receiver accepts must fail with a status naming both the
//! message and the limit, leaving the connection usable.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use rpc_core::{Channel, Code};

/// A client's message limit in these tests: below half its 2 MiB ring, as
/// on a fabric without rendezvous.
const DEFAULT_CLIENT_LIMIT: usize = (1 << 20) - 32;
/// A server's message limit in these tests.
const SERVER_LIMIT: usize = 512 << 10;

/// A small echo round trip on `echo` works.
fn echoes(echo: &EchoClient, tag: &str) {
    let reply = echo
        .echo(echo_request(tag, tag.as_bytes().to_vec(), &[]))
        .wait()
        .unwrap_or_else(|e| panic!("call {tag}: {e}"));
    assert_eq!(reply.into_inner().payload, tag.as_bytes());
}

on_every_fabric! {
    fn a_large_ring_server_serves_default_clients(url: &str) {
        let probe = Probe::new();
        let server = serve(
            test_server(&probe).ring_size(256 << 20).max_message_size(16 << 20),
            url,
        );
        let echo = EchoClient::new(
            Channel::builder(server.local_url())
                .max_message_size(DEFAULT_CLIENT_LIMIT)
                .connect()
                .unwrap(),
        );
        echoes(&echo, "small");

        // Requests far larger than the client's own limit go through: the
        // server's ring for this client is 64 MiB, the most it stages.
        let big = pattern(8 << 20, 1);
        let reply = echo
            .echo(echo_request("big", big.clone(), &[("reply-len", "16")]))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, pattern(16, 7));

        // A response larger than the client accepts fails, naming both.
        let len = (4 << 20).to_string();
        let err = echo
            .echo(echo_request("too-big", Vec::new(), &[("reply-len", &len)]))
            .wait()
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        let message = err.message();
        assert!(
            message.contains(&DEFAULT_CLIENT_LIMIT.to_string()),
            "names the client's limit: {message}"
        );
        assert!(message.contains("response"), "says what was too large: {message}");
        assert!(
            message.contains("max_message_size"),
            "says how to raise the limit: {message}"
        );
        // The server's own limit.
        let server_limit = (16 << 20).to_string();
        assert!(message.contains(&server_limit), "names the server's limit: {message}");

        // The connection is still good, and a client with a larger ring
        // gets the same response.
        echoes(&echo, "after");
        let roomy = EchoClient::new(
            Channel::builder(server.local_url())
                .ring_size(16 << 20)
                .connect()
                .unwrap(),
        );
        let reply = roomy
            .echo(echo_request("roomy", Vec::new(), &[("reply-len", &len)]))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, pattern(4 << 20, 7));
        bounded("shutdown", move || server.shutdown());
    }
}

on_every_fabric! {
    fn a_client_with_a_large_ring_uses_a_default_server(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).max_message_size(SERVER_LIMIT), url);
        let echo = EchoClient::new(
            Channel::builder(server.local_url())
                .ring_size(128 << 20)
                .connect()
                .unwrap(),
        );
        let len = (8 << 20).to_string();
        let reply = echo
            .echo(echo_request("large-reply", Vec::new(), &[("reply-len", &len)]))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, pattern(8 << 20, 7));
        // A request larger than the server accepts fails before it is sent.
        let err = echo
            .echo(echo_request("too-big", pattern(2 << 20, 2), &[]))
            .wait()
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        assert!(err.message().contains(&SERVER_LIMIT.to_string()), "{err}");
        bounded("shutdown", move || server.shutdown());
    }
}

on_soft_fabrics! {
    fn writes_larger_than_the_socket_buffer_arrive_whole(url: &str) {
        // On tcp:// a write of several MiB leaves in parts as the socket
        // takes them; the part not taken at once must be queued from where
        // the socket stopped (it once lost what followed, and the call hung).
        let probe = Probe::new();
        let server = serve(test_server(&probe).ring_size(64 << 20), url);
        let echo = EchoClient::new(channel(server.local_url()));
        for mib in [1usize, 2, 4, 8, 16] {
            let reply = echo
                .echo(echo_request("big", pattern(mib << 20, mib as u64), &[("reply-len", "16")]))
                .wait()
                .unwrap_or_else(|e| panic!("{mib} MiB: {e}"));
            assert_eq!(reply.into_inner().payload, pattern(16, 7));
        }
        bounded("shutdown", move || server.shutdown());
    }
}
