//! Interceptors on both sides: a server that rejects calls without a token,
//! a client that adds it, metadata a client interceptor adds reaching the
//! handler, and the same for streams.

#[macro_use]
mod common;

use common::*;
use examples::echo::StreamRequest;
use examples::echo::echo_client::EchoClient;
use futures::StreamExt;
use rpc_core::interceptor::CallInfo;
use rpc_core::{Channel, Code, Request, Status};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const TOKEN: &str = "Bearer 7c1d";

/// Rejects calls without the token; tags the rest with the method and the
/// peer's fabric, for the handler to see.
fn require_token(call: &mut CallInfo<'_>) -> Result<(), Status> {
    if call.metadata().get("authorization") != Some(TOKEN) {
        return Err(Status::unauthenticated(format!(
            "{}: no valid token",
            call.method()
        )));
    }
    let fabric = call.peer().expect("a server knows its peer").fabric;
    let method = call.method();
    call.metadata_mut()
        .insert("seen-by", "server-interceptor")?;
    call.metadata_mut().insert("seen-method", method)?;
    call.metadata_mut().insert("seen-fabric", fabric)?;
    Ok(())
}

fn add_token(call: &mut CallInfo<'_>) -> Result<(), Status> {
    assert!(call.peer().is_none(), "a client has no peer to show");
    call.metadata_mut().insert("authorization", TOKEN)?;
    call.metadata_mut().insert("tenant", "blue")?;
    Ok(())
}

fn stream_of(echo: &EchoClient, count: u64) -> Result<Vec<rpc_core::Bytes>, Status> {
    let mut stream = echo.stream(StreamRequest { count, size: 8 });
    futures::executor::block_on(async {
        let mut got = Vec::new();
        while let Some(m) = stream.next().await {
            got.push(m?.payload);
        }
        Ok(got)
    })
}

on_every_fabric! {
    fn a_server_interceptor_rejects_calls_without_a_token(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).interceptor(require_token), url);

        // No token: rejected before the handler, unary and stream alike.
        let bare = EchoClient::new(channel(server.local_url()));
        let e = expect_code(
            bare.echo(echo_request("bare", vec![1], &[])).wait(),
            Code::Unauthenticated,
        );
        assert!(e.message().contains("/echo.Echo/Echo"), "{e}");
        expect_code(stream_of(&bare, 3), Code::Unauthenticated);
        assert!(probe.seen().entered.is_empty(), "no handler ran");

        // A client interceptor adds the token: the handler runs and sees
        // what both interceptors added (the echo service returns it).
        let with_token = EchoClient::new(
            Channel::builder(server.local_url())
                .timeout(LIMIT)
                .interceptor(add_token)
                .connect()
                .unwrap(),
        );
        let reply = with_token
            .echo(echo_request("ok", vec![2], &[]))
            .wait()
            .unwrap();
        let md = reply.metadata();
        assert_eq!(md.get("tenant"), Some("blue"));
        assert_eq!(md.get("seen-by"), Some("server-interceptor"));
        assert_eq!(md.get("seen-method"), Some("/echo.Echo/Echo"));
        let fabric = url.split("://").next().unwrap();
        assert_eq!(md.get("seen-fabric"), Some(fabric));
        assert_eq!(reply.into_inner().payload, vec![2]);
        assert_eq!(stream_of(&with_token, 3).unwrap().len(), 3);
        assert_eq!(probe.seen().entered, vec!["ok".to_owned()]);
    }
}

#[test]
fn client_interceptors_run_in_order_and_may_reject_before_sending() {
    watchdog(|| {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let echo = EchoClient::new(
            Channel::builder(server.local_url())
                .timeout(LIMIT)
                .interceptor(move |call: &mut CallInfo<'_>| {
                    counted.fetch_add(1, Ordering::Relaxed);
                    call.metadata_mut().insert("step", "1")?;
                    Ok(())
                })
                .interceptor(|call: &mut CallInfo<'_>| {
                    // Sees the first one's work.
                    assert_eq!(call.metadata().get("step"), Some("1"));
                    if call.metadata().get("tag") == Some("forbidden") {
                        return Err(Status::permission_denied("not this one"));
                    }
                    call.metadata_mut().insert("step", "2")?;
                    Ok(())
                })
                .connect()
                .unwrap(),
        );
        let reply = echo.echo(echo_request("fine", vec![], &[])).wait().unwrap();
        assert_eq!(reply.metadata().get("step"), Some("2"));
        expect_code(
            echo.echo(echo_request("forbidden", vec![], &[])).wait(),
            Code::PermissionDenied,
        );
        // Rejected on the client: the server never saw it.
        assert_eq!(probe.seen().entered, vec!["fine".to_owned()]);
        // Awaited calls and streams pass through them too.
        let mut request = Request::new(examples::echo::EchoRequest {
            payload: vec![5].into(),
        });
        request.metadata_mut().insert("tag", "async").unwrap();
        let reply = futures::executor::block_on(echo.echo(request)).unwrap();
        assert_eq!(reply.metadata().get("step"), Some("2"));
        assert_eq!(stream_of(&echo, 2).unwrap().len(), 2);
        assert_eq!(calls.load(Ordering::Relaxed), 4);
    });
}
