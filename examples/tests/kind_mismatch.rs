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
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        let client = EchoClient::new(channel.clone());
        // A call in flight on the same connection meanwhile.
        let mut slow = echo_request("slow", b"in flight".to_vec(), &[("sleep-ms", "300")]);
        slow.set_timeout(Duration::from_secs(10));
        let in_flight = client.echo(slow);
        // The server streams `Stream`; this client thinks it unary.
        let stream_as_unary = described("/echo.Echo/Stream", MethodKind::Unary);
        let mut request = Request::new(StreamRequest { count: 1000, size: 8 });
        request.set_timeout(Duration::from_secs(10));
        let status = codegen::unary::<_, EchoReply>(&channel, stream_as_unary, request)
            .wait()
            .unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Stream is a server-streaming method on this server, called as unary"
            ),
            "{status}"
        );
        // The call in flight and new ones on the same channel are served.
        let reply = in_flight.wait().unwrap();
        assert_eq!(reply.get_ref().payload, &b"in flight"[..]);
        for i in 0..20u32 {
            let payload = i.to_le_bytes().to_vec();
            let reply = client
                .echo(Request::new(EchoRequest { payload: payload.clone().into() }))
                .wait()
                .unwrap();
            assert_eq!(reply.get_ref().payload, payload);
        }
        server.shutdown();
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
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        // The server's unary `Echo`, thought server-streaming by this client.
        let unary_as_stream = described("/echo.Echo/Echo", MethodKind::ServerStreaming);
        let request = Request::new(EchoRequest { payload: b"one answer".to_vec().into() });
        let mut stream =
            codegen::server_streaming::<_, EchoReply>(&channel, unary_as_stream, request);
        let status = stream.blocking_message().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Echo is a unary method on this server, called as server-streaming"
            ),
            "{status}"
        );
        // The connection serves on.
        let reply = EchoClient::new(channel)
            .echo(Request::new(EchoRequest { payload: b"next".to_vec().into() }))
            .wait()
            .unwrap();
        assert_eq!(reply.get_ref().payload, &b"next"[..]);
        server.shutdown();
    }
}

/// The calls on `channel` after a refused one: a unary call that was in
/// flight meanwhile, then new ones, are all answered.
fn serves_on(client: &EchoClient, in_flight: rpc_core::client::UnaryCall<EchoReply>) {
    let reply = in_flight.wait().unwrap();
    assert_eq!(reply.get_ref().payload, &b"in flight"[..]);
    for i in 0..20u32 {
        let payload = i.to_le_bytes().to_vec();
        let reply = client
            .echo(Request::new(EchoRequest {
                payload: payload.clone().into(),
            }))
            .wait()
            .unwrap();
        assert_eq!(reply.get_ref().payload, payload);
    }
}

/// A unary call on `client` that the server answers after 300 ms.
fn slow_call(client: &EchoClient) -> rpc_core::client::UnaryCall<EchoReply> {
    let mut slow = echo_request("slow", b"in flight".to_vec(), &[("sleep-ms", "300")]);
    slow.set_timeout(Duration::from_secs(10));
    client.echo(slow)
}

on_every_fabric! {
    fn a_request_stream_to_a_method_that_takes_none_fails_that_call_only(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        let client = EchoClient::new(channel.clone());
        let in_flight = slow_call(&client);
        // The server streams `Stream`'s responses, from one request; this
        // client streams requests to it. Before the server said so by its
        // kind, the first request message closed the connection.
        let as_client_stream = described("/echo.Echo/Stream", MethodKind::ClientStreaming);
        let (mut tx, call) = codegen::client_streaming_sender::<StreamRequest, EchoReply>(
            &channel,
            as_client_stream,
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
        let status = call.wait().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Stream is a server-streaming method on this server, \
                 called as client-streaming"
            ),
            "{status}"
        );
        if let Some(sent) = refused {
            assert_eq!(sent.code(), Code::Internal, "{sent}");
        }
        serves_on(&client, in_flight);
        server.shutdown();
    }
}

on_every_fabric! {
    fn a_stream_to_a_unary_method_fails_without_an_answer(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        let client = EchoClient::new(channel.clone());
        let in_flight = slow_call(&client);
        // A client-streaming call to the unary `Echo`. Before the server
        // checked the kind, it ran `Echo` on an empty request and the
        // client took its echo for the answer.
        let as_client_stream = described("/echo.Echo/Echo", MethodKind::ClientStreaming);
        let (mut tx, call) = codegen::client_streaming_sender::<EchoRequest, EchoReply>(
            &channel,
            as_client_stream,
            Request::new(()),
        );
        let _ = tx.send(EchoRequest { payload: b"one".to_vec().into() });
        let _ = tx.close();
        let status = call.wait().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Echo is a unary method on this server, called as client-streaming"
            ),
            "{status}"
        );
        // A bidirectional one, read before anything is sent.
        let as_bidi = described("/echo.Echo/Echo", MethodKind::Streaming);
        let (_tx, mut responses) = codegen::streaming_sender::<EchoRequest, EchoReply>(
            &channel,
            as_bidi,
            Request::new(()),
        );
        let status = responses.blocking_message().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Echo is a unary method on this server, called as \
                 bidirectional-streaming"
            ),
            "{status}"
        );
        let entered = probe.seen().entered.clone();
        assert!(entered.iter().all(|t| t == "slow"), "a refused call ran: {entered:?}");
        serves_on(&client, in_flight);
        server.shutdown();
    }
}

on_every_fabric! {
    fn a_call_made_otherwise_than_its_descriptor_says_is_refused_by_how_it_is_made(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let channel = channel(server.local_url());
        let client = EchoClient::new(channel.clone());
        let in_flight = slow_call(&client);
        // A hand-built descriptor that says what the server serves, used
        // for a call of another kind: the request says how it is made.
        let descriptor = described("/echo.Echo/Stream", MethodKind::ServerStreaming);
        let (mut tx, call) = codegen::client_streaming_sender::<StreamRequest, EchoReply>(
            &channel,
            descriptor,
            Request::new(()),
        );
        let _ = tx.send(StreamRequest { count: 1, size: 8 });
        let _ = tx.close();
        let status = call.wait().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(
            status.message().starts_with(
                "/echo.Echo/Stream is a server-streaming method on this server, \
                 called as client-streaming"
            ),
            "{status}"
        );
        serves_on(&client, in_flight);
        server.shutdown();
    }
}
