//! A client built from another version of a `.proto` than its server's: an
//! rpc of another kind, or one the server lacks, fails that call with a
//! status that says so, and the connection and its other calls go on.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::{EchoReply, EchoRequest, StreamRequest};
use rpc_core::codegen::{self, MethodKind};
use rpc_core::{Code, Request};
use std::time::Duration;

on_every_fabric! {
    fn a_streaming_method_called_as_unary_fails_that_call_only(url: &str) {
        let f = fixture(url);
        // The server streams `Stream`; this client thinks it unary.
        let stream_as_unary = described("/echo.Echo/Stream", MethodKind::Unary);
        let mut request = Request::new(StreamRequest { count: 1000, size: 8 });
        request.set_timeout(Duration::from_secs(10));
        let status = codegen::unary::<_, EchoReply>(&f.channel, stream_as_unary, request)
            .wait()
            .unwrap_err();
        assert_refused(
            &status,
            "/echo.Echo/Stream is a server-streaming method on this server, called as unary",
        );
        f.serves_on();
    }
}

on_every_fabric! {
    fn an_rpc_the_server_lacks_is_named_in_its_status(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        let missing = described("/echo.Echo/Missing", MethodKind::Unary);
        let request = Request::new(EchoRequest { payload: b"x".to_vec().into() });
        let status = codegen::unary::<_, EchoReply>(&channel, missing, request)
            .wait()
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{status}");
        assert!(status.message().starts_with("/echo.Echo/Missing: method id"), "{status}");
        // Awaited, the same.
        let request = Request::new(EchoRequest { payload: b"x".to_vec().into() });
        let call = codegen::unary::<_, EchoReply>(&channel, missing, request);
        let status = futures::executor::block_on(call).unwrap_err();
        assert!(status.message().starts_with("/echo.Echo/Missing: "), "{status}");
        server.shutdown();
    }
}

on_every_fabric! {
    fn a_unary_method_called_as_a_stream_fails_that_call_only(url: &str) {
        let f = fixture(url);
        // The server's unary `Echo`, thought server-streaming by this client.
        let unary_as_stream = described("/echo.Echo/Echo", MethodKind::ServerStreaming);
        let request = Request::new(EchoRequest { payload: b"one answer".to_vec().into() });
        let mut stream =
            codegen::server_streaming::<_, EchoReply>(&f.channel, unary_as_stream, request);
        assert_refused(
            &stream.blocking_message().unwrap_err(),
            "/echo.Echo/Echo is a unary method on this server, called as server-streaming",
        );
        f.serves_on();
    }
}

/// A server, a channel to it, and a unary call in flight on it (answered
/// after 300 ms) while a test makes calls the server refuses.
struct Fixture {
    probe: std::sync::Arc<Probe>,
    server: rpc_core::ServerHandle,
    channel: rpc_core::Channel,
    client: EchoClient,
    in_flight: rpc_core::client::UnaryCall<EchoReply>,
}

fn fixture(url: &str) -> Fixture {
    let probe = Probe::new();
    let server = serve(test_server(&probe), url);
    let channel = channel(server.local_url());
    let client = EchoClient::new(channel.clone());
    let mut slow = echo_request("slow", b"in flight".to_vec(), &[("sleep-ms", "300")]);
    slow.set_timeout(Duration::from_secs(10));
    let in_flight = client.echo(slow);
    Fixture {
        probe,
        server,
        channel,
        client,
        in_flight,
    }
}

impl Fixture {
    /// The refused calls ran no handler; the call in flight and new ones
    /// on the same channel are all answered.
    fn serves_on(self) {
        let entered = self.probe.seen().entered.clone();
        assert!(
            entered.iter().all(|t| t == "slow"),
            "a refused call ran: {entered:?}"
        );
        let reply = self.in_flight.wait().unwrap();
        assert_eq!(reply.get_ref().payload, &b"in flight"[..]);
        for i in 0..20u32 {
            let payload = i.to_le_bytes().to_vec();
            let reply = self
                .client
                .echo(Request::new(EchoRequest {
                    payload: payload.clone().into(),
                }))
                .wait()
                .unwrap();
            assert_eq!(reply.get_ref().payload, payload);
        }
        self.server.shutdown();
    }
}

/// `status` is the server's refusal of a call of another kind than its
/// method's, and starts with `says`.
fn assert_refused(status: &rpc_core::Status, says: &str) {
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(status.message().starts_with(says), "{status}");
    assert!(
        status
            .message()
            .ends_with("build the client from the server's .proto"),
        "{status}"
    );
}

on_every_fabric! {
    fn a_request_stream_to_a_method_that_takes_none_fails_that_call_only(url: &str) {
        let f = fixture(url);
        // The server streams `Stream`'s responses, from one request; this
        // client streams requests to it. Before the server said so by its
        // kind, the first request message closed the connection. The same
        // with a hand-built descriptor that says what the server serves,
        // used for a client-streaming call: the request says how the call
        // is made, not what its descriptor says.
        for kind in [MethodKind::ClientStreaming, MethodKind::ServerStreaming] {
            let descriptor = described("/echo.Echo/Stream", kind);
            let (mut tx, call) = codegen::client_streaming_sender::<StreamRequest, EchoReply>(
                &f.channel,
                descriptor,
                Request::new(()),
            );
            // Sends succeed until the refusal arrives, then fail with it.
            let mut refused = None;
            for count in 0..64 {
                if let Err(status) = tx.send(StreamRequest { count, size: 8 }) {
                    refused = Some(status);
                    break;
                }
            }
            if refused.is_none() {
                let _ = tx.close();
            }
            let says = "/echo.Echo/Stream is a server-streaming method on this server, \
                        called as client-streaming";
            assert_refused(&call.wait().unwrap_err(), says);
            if let Some(sent) = refused {
                assert_refused(&sent, says);
            }
        }
        f.serves_on();
    }
}

on_every_fabric! {
    fn a_stream_to_a_unary_method_fails_without_an_answer(url: &str) {
        let f = fixture(url);
        // A client-streaming call to the unary `Echo`. Before the server
        // checked the kind, it ran `Echo` on an empty request and the
        // client took its echo for the answer.
        let as_client_stream = described("/echo.Echo/Echo", MethodKind::ClientStreaming);
        let (mut tx, call) = codegen::client_streaming_sender::<EchoRequest, EchoReply>(
            &f.channel,
            as_client_stream,
            Request::new(()),
        );
        let _ = tx.send(EchoRequest { payload: b"one".to_vec().into() });
        let _ = tx.close();
        assert_refused(
            &call.wait().unwrap_err(),
            "/echo.Echo/Echo is a unary method on this server, called as client-streaming",
        );
        // A bidirectional one, read before anything is sent.
        let as_bidi = described("/echo.Echo/Echo", MethodKind::Streaming);
        let (_tx, mut responses) = codegen::streaming_sender::<EchoRequest, EchoReply>(
            &f.channel,
            as_bidi,
            Request::new(()),
        );
        assert_refused(
            &responses.blocking_message().unwrap_err(),
            "/echo.Echo/Echo is a unary method on this server, called as bidirectional-streaming",
        );
        f.serves_on();
    }
}
