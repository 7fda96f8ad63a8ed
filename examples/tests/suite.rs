//! End-to-end behaviour of the runtime through the example services, on every
//! fabric: correctness, concurrency, message size limits, flow control,
//! deadlines, shutdown, panics and clients that go away mid-call.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::echo::{EchoReply, EchoRequest, StreamRequest};
use examples::kv::kv_client::KvClient;
use examples::kv::kv_server::KvServer;
use examples::kv::{DeleteRequest, Entry, GetRequest, PutRequest, ScanRequest};
use examples::services::{EchoService, KvStore, MAX_STREAM_REPLY, StreamPayloads};
use rpc_core::testing::protocol::{ALIGN, HEADER_LEN};
use rpc_core::{Bytes, Channel, Code, Request, Response, Server, Status};
use std::time::{Duration, Instant};

fn put(kv: &KvClient, key: &str, value: &[u8]) -> bool {
    kv.put(PutRequest {
        key: key.into(),
        value: Bytes::copy_from_slice(value),
    })
    .wait()
    .unwrap_or_else(|e| panic!("put {key}: {e}"))
    .into_inner()
    .replaced
}

fn get(kv: &KvClient, key: &str) -> Option<Bytes> {
    kv.get(GetRequest { key: key.into() })
        .wait()
        .unwrap_or_else(|e| panic!("get {key}: {e}"))
        .into_inner()
        .value
}

fn delete(kv: &KvClient, key: &str) -> bool {
    kv.delete(DeleteRequest { key: key.into() })
        .wait()
        .unwrap_or_else(|e| panic!("delete {key}: {e}"))
        .into_inner()
        .existed
}

/// Keys and whether more matched.
fn scan(kv: &KvClient, prefix: &str, limit: u32) -> (Vec<(String, Bytes)>, bool) {
    let reply = kv
        .scan(ScanRequest {
            prefix: prefix.into(),
            limit,
        })
        .wait()
        .unwrap_or_else(|e| panic!("scan {prefix:?}: {e}"))
        .into_inner();
    let entries = reply
        .entries
        .into_iter()
        .map(|Entry { key, value }| (key, value))
        .collect();
    (entries, reply.truncated)
}

fn keys(entries: &[(String, Bytes)]) -> Vec<&str> {
    entries.iter().map(|(k, _)| k.as_str()).collect()
}

/// Echoes `payload` with `metadata` and checks that both come back unchanged.
fn check_echo(echo: &EchoClient, payload: Vec<u8>, metadata: &[(&str, &[u8])]) {
    let mut request = Request::new(EchoRequest {
        payload: payload.clone().into(),
    });
    for (k, v) in metadata {
        request.metadata_mut().insert_bin(k, v.to_vec()).unwrap();
    }
    let response = echo
        .echo(request)
        .wait()
        .unwrap_or_else(|e| panic!("echo of {} bytes: {e}", payload.len()));
    let got: Vec<(&str, &[u8])> = response.metadata().iter().collect();
    assert_eq!(got, metadata, "metadata came back changed");
    assert_eq!(response.into_inner().payload, payload);
}

/// A `Stream` call of `count` replies of `size` bytes, with `metadata`.
fn stream_request(count: u64, size: u32, metadata: &[(&str, &str)]) -> Request<StreamRequest> {
    let mut request = Request::new(StreamRequest { count, size });
    for (k, v) in metadata {
        request.metadata_mut().insert(k, *v).unwrap();
    }
    request
}

on_every_fabric! {
    /// A response stream's initial metadata arrives once its handler
    /// returned, before the first message if the stream has none ready
    /// (as gRPC sends headers); with it if it has; a call that fails first
    /// gives its status.
    fn initial_metadata_arrives_before_the_first_message(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let echo = EchoClient::new(channel(server.local_url()));

        let held = [("session", "s1"), ("hold", "held"), ("trailer", "t1")];
        let mut stream = echo.stream(stream_request(3, 8, &held));
        let headers = stream.blocking_initial_metadata().unwrap();
        assert_eq!(headers.get("session"), Some("s1"));
        assert_eq!(stream.metadata().unwrap().get("session"), Some("s1"));
        let again = futures::executor::block_on(stream.initial_metadata()).unwrap();
        assert_eq!(again.get("session"), Some("s1"));
        assert_eq!(stream.trailers(), None, "the stream runs on");
        probe.open_gate("held");
        let replies: Vec<Bytes> = (&mut stream).into_iter().map(|r| r.unwrap().payload).collect();
        assert_eq!(replies.len(), 3);
        for (i, p) in replies.iter().enumerate() {
            assert!(StreamPayloads::matches(p, 8, i as u64), "reply {i}");
        }
        assert_eq!(stream.trailers().unwrap().get("x-trailer"), Some("t1"));

        // A stream with messages ready at once: its metadata comes with
        // the first of them.
        let mut ready = echo.stream(stream_request(2, 8, &[("session", "s2")]));
        let headers = futures::executor::block_on(ready.initial_metadata()).unwrap();
        assert_eq!(headers.get("session"), Some("s2"));
        assert_eq!(ready.into_iter().map(Result::unwrap).count(), 2);

        // A stream that ends at once: its metadata and its trailers apart.
        let mut empty = echo.stream(stream_request(0, 8, &[("session", "s3"), ("trailer", "t3")]));
        let headers = empty.blocking_initial_metadata().unwrap();
        assert_eq!(headers.get("session"), Some("s3"));
        assert_eq!(headers.get("x-trailer"), None, "{headers:?}");
        assert!(empty.blocking_message().unwrap().is_none());
        let trailers = empty.trailers().unwrap();
        assert_eq!(trailers.get("x-trailer"), Some("t3"));
        assert_eq!(trailers.get("session"), None, "{trailers:?}");
        // So do empty metadata: the trailers are not taken for them.
        let mut bare = echo.stream(stream_request(0, 8, &[("trailer", "t4")]));
        let headers = bare.blocking_initial_metadata().unwrap();
        assert!(headers.is_empty(), "{headers:?}");
        assert!(bare.blocking_message().unwrap().is_none());
        assert_eq!(bare.trailers().unwrap().get("x-trailer"), Some("t4"));

        // A call that fails before any frame: its status, then the stream's.
        let mut refused = echo.stream(stream_request(1, MAX_STREAM_REPLY + 1, &[]));
        let status = refused.blocking_initial_metadata().unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        // Asked again once the refusal is in (its metadata with it).
        eventually("the refusal arrived", || refused.metadata().is_some());
        let status = refused.blocking_initial_metadata().unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let status = refused.into_iter().next().unwrap().unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

        // A held stream dropped after its metadata: the connection goes on.
        let mut dropped = echo.stream(stream_request(1, 8, &[("hold", "never")]));
        assert!(dropped.blocking_initial_metadata().unwrap().is_empty());
        drop(dropped);
        check_echo(&echo, b"after".to_vec(), &[]);
        probe.open_gate("never");
        bounded("shutdown", move || server.shutdown());
    }
}

on_every_fabric! {
    fn echo_and_kv_are_correct(url: &str) {
        let server = serve(
            Server::builder()
                .add_service(EchoServer::new(EchoService))
                .add_service(KvServer::new(KvStore::new())),
            url,
        );
        let ch = channel(server.local_url());

        // Echo: payloads and metadata (text and binary) come back unchanged.
        let echo = EchoClient::new(ch.clone());
        check_echo(&echo, Vec::new(), &[]);
        check_echo(&echo, b"hello".to_vec(), &[("tenant", b"blue")]);
        check_echo(&echo, pattern(3000, 1), &[("a", b""), ("trace-bin", &[0, 255, 1, 254])]);
        check_echo(&echo, vec![0; 100_000], &[("x", &[7; 1000])]);

        // Stream: `count` replies of `size` bytes, each its index, then zeros.
        for (count, size) in [(0, 10), (5, 0), (3, 3), (100, 1000)] {
            let replies: Vec<Bytes> = echo
                .stream(StreamRequest { count, size })
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("stream of {count}: {e}")).payload)
                .collect();
            assert_eq!(replies.len(), count as usize);
            for (i, p) in replies.iter().enumerate() {
                assert!(StreamPayloads::matches(p, size as usize, i as u64), "reply {i}");
                assert!(p.iter().skip(8).all(|&b| b == 0), "reply {i}");
            }
        }
        let too_large = StreamRequest { count: 1, size: MAX_STREAM_REPLY + 1 };
        let refused = echo.stream(too_large).into_iter().next();
        assert_eq!(
            refused.map(|r| r.map(drop).unwrap_err().code()),
            Some(Code::InvalidArgument)
        );

        let kv = KvClient::new(ch);
        // Put and get; replacing reports it; absent keys read as None.
        assert!(!put(&kv, "alpha", b"1"));
        assert_eq!(get(&kv, "alpha").as_deref(), Some(&b"1"[..]));
        assert!(put(&kv, "alpha", b"one"));
        assert_eq!(get(&kv, "alpha").as_deref(), Some(&b"one"[..]));
        assert_eq!(get(&kv, "missing"), None);
        // An empty value is a value, not an absence.
        assert!(!put(&kv, "empty", b""));
        assert_eq!(get(&kv, "empty"), Some(Bytes::new()));
        // Binary values survive.
        let blob = pattern(5000, 2);
        put(&kv, "blob", &blob);
        assert_eq!(get(&kv, "blob"), Some(Bytes::from(blob)));
        // Delete reports whether the key existed.
        assert!(delete(&kv, "alpha"));
        assert!(!delete(&kv, "alpha"));
        assert_eq!(get(&kv, "alpha"), None);
        assert!(delete(&kv, "empty"));
        assert!(delete(&kv, "blob"));
        // Invalid keys are the caller's error.
        let e = expect_code(kv.get(GetRequest { key: String::new() }).wait(), Code::InvalidArgument);
        assert!(e.message().contains("empty"), "{e}");
        expect_code(
            kv.put(PutRequest { key: "k".repeat(4097), value: Bytes::new() }).wait(),
            Code::InvalidArgument,
        );

        // Scan: key order whatever the insertion order, prefix filtering
        // (a key equal to the prefix matches; neighbours do not), truncation.
        for key in ["b/3", "a", "b/1", "c/1", "b", "b/2", "ba", "b/10", "c"] {
            put(&kv, key, format!("v-{key}").as_bytes());
        }
        let (all, truncated) = scan(&kv, "", 0);
        assert_eq!(keys(&all), ["a", "b", "b/1", "b/10", "b/2", "b/3", "ba", "c", "c/1"]);
        assert!(!truncated);
        for (k, v) in &all {
            assert_eq!(v, format!("v-{k}").as_bytes());
        }
        let (b, truncated) = scan(&kv, "b/", 0);
        assert_eq!(keys(&b), ["b/1", "b/10", "b/2", "b/3"]);
        assert!(!truncated);
        let (b, truncated) = scan(&kv, "b", 0);
        assert_eq!(keys(&b), ["b", "b/1", "b/10", "b/2", "b/3", "ba"]);
        assert!(!truncated);
        let (b, truncated) = scan(&kv, "b/", 2);
        assert_eq!(keys(&b), ["b/1", "b/10"]);
        assert!(truncated, "2 of 4 matches is truncated");
        let (b, truncated) = scan(&kv, "b/", 4);
        assert_eq!(keys(&b), ["b/1", "b/10", "b/2", "b/3"]);
        assert!(!truncated, "exactly the limit is not truncated");
        let (b, truncated) = scan(&kv, "b/", 5);
        assert_eq!(b.len(), 4);
        assert!(!truncated);
        let (none, truncated) = scan(&kv, "zzz", 0);
        assert!(none.is_empty() && !truncated);
        let (none, truncated) = scan(&kv, "b/4", 0);
        assert!(none.is_empty() && !truncated);
        // The default limit is 1000 entries.
        for i in 0..1001 {
            put(&kv, &format!("many/{i:04}"), b"");
        }
        let (many, truncated) = scan(&kv, "many/", 0);
        assert_eq!(many.len(), examples::services::DEFAULT_SCAN_LIMIT);
        assert_eq!(many[999].0, "many/0999");
        assert!(truncated);
        // Deleted keys leave scans.
        assert!(delete(&kv, "b/10"));
        let (b, _) = scan(&kv, "b/", 0);
        assert_eq!(keys(&b), ["b/1", "b/2", "b/3"]);
        server.shutdown();
    }
}

/// The tag and payload of call `i` of worker `w`: unique, of varying length.
fn call_input(w: u64, i: u64) -> (String, Vec<u8>) {
    let tag = format!("w{w}-c{i}");
    let len = ((w * 7919 + i * 131) % 3000) as usize;
    (tag, pattern(len, w << 32 | i))
}

/// Checks that `response` answers the call `tag` with `payload`.
#[track_caller]
fn check_reply(tag: &str, payload: &[u8], response: Result<Response<EchoReply>, Status>) {
    let response = response.unwrap_or_else(|e| panic!("call {tag}: {e}"));
    assert_eq!(
        response.metadata().get("tag"),
        Some(tag),
        "reply to the wrong call"
    );
    assert!(
        response.get_ref().payload == payload,
        "call {tag}: wrong payload"
    );
}

on_every_fabric! {
    fn concurrent_calls_each_get_their_own_reply(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(3), url);
        let ch = channel(server.local_url());

        // Blocking calls from several threads sharing one channel, with a few
        // calls each kept in flight at once.
        std::thread::scope(|s| {
            for w in 0..4u64 {
                let echo = EchoClient::new(ch.clone());
                s.spawn(move || {
                    for batch in 0..50u64 {
                        let calls: Vec<_> = (0..4)
                            .map(|j| {
                                let (tag, payload) = call_input(w, batch * 4 + j);
                                let call = echo.echo(echo_request(&tag, payload.clone(), &[]));
                                (tag, payload, call)
                            })
                            .collect();
                        for (tag, payload, call) in calls.into_iter().rev() {
                            check_reply(&tag, &payload, call.wait());
                        }
                    }
                });
            }
        });

        // Async calls from tasks of a multi-threaded tokio runtime.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let tasks: Vec<_> = (0..32u64)
                .map(|t| {
                    let echo = EchoClient::new(ch.clone());
                    tokio::spawn(async move {
                        for i in 0..10 {
                            let (tag, payload) = call_input(100 + t, i);
                            let reply = echo.echo(echo_request(&tag, payload.clone(), &[])).await;
                            check_reply(&tag, &payload, reply);
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("task panicked");
            }
            // Many futures of one task, polled together.
            let echo = EchoClient::new(ch.clone());
            let inputs: Vec<_> = (0..100).map(|i| call_input(200, i)).collect();
            let replies = futures::future::join_all(
                inputs.iter().map(|(tag, payload)| echo.echo(echo_request(tag, payload.clone(), &[]))),
            )
            .await;
            for ((tag, payload), reply) in inputs.iter().zip(replies) {
                check_reply(tag, payload, reply);
            }
        });
        drop(rt);

        // Async calls under an executor that is not tokio.
        let echo = EchoClient::new(ch.clone());
        let inputs: Vec<_> = (0..100).map(|i| call_input(300, i)).collect();
        let replies = futures::executor::block_on(futures::future::join_all(
            inputs.iter().map(|(tag, payload)| echo.echo(echo_request(tag, payload.clone(), &[]))),
        ));
        for ((tag, payload), reply) in inputs.iter().zip(replies) {
            check_reply(tag, payload, reply);
        }
        server.shutdown();
    }
}

/// Ring size of the size-limit test: requests and responses up to half of
/// it, less a header, fit.
const RING: usize = 65536;
const MAX_BODY: usize = RING / 2 - 32;

/// The largest echo payload whose message, with `metadata_len` bytes of
/// metadata, is at most `max_body` bytes.
fn largest_payload(max_body: usize, metadata_len: usize) -> usize {
    let mut len = max_body - metadata_len;
    while echo_encoded_len(len) + metadata_len > max_body {
        len -= 1;
    }
    len
}

on_every_fabric! {
    fn message_sizes_up_to_the_limit(url: &str) {
        assert_eq!(MAX_BODY, RING / 2 - HEADER_LEN);
        let server = serve(
            Server::builder()
                .add_service(EchoServer::new(EchoService))
                .ring_size(RING)
                .max_message_size(MAX_BODY),
            url,
        );
        let ch = Channel::builder(server.local_url())
            .ring_size(RING)
            .max_message_size(MAX_BODY)
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let echo = EchoClient::new(ch.clone());
        let payload = |len: usize| pattern(len, len as u64);

        // Every size class, from nothing up to the largest that fits.
        let largest = largest_payload(MAX_BODY, 0);
        assert_eq!(echo_encoded_len(largest), MAX_BODY, "the limit is reachable exactly");
        for len in [0, 1, 2, 31, 32, 63, 64, 65, 127, 128, 1000, 4096, 16383, 16384, 32000, largest] {
            check_echo(&echo, payload(len), &[]);
        }
        // One byte more is refused before it is sent.
        let e = expect_code(
            echo.echo(EchoRequest { payload: payload(largest + 1).into() }).wait(),
            Code::ResourceExhausted,
        );
        assert!(e.message().contains(&MAX_BODY.to_string()), "{e}");
        // Metadata counts against the same limit.
        let md: &[(&str, &[u8])] = &[("key", b"value"), ("bin", &[0; 100])];
        let md_len = metadata_len(&[("key", "value"), ("bin", &"x".repeat(100))]);
        let largest = largest_payload(MAX_BODY, md_len);
        check_echo(&echo, payload(largest), md);
        let mut request = Request::new(EchoRequest { payload: payload(largest + 1).into() });
        for (k, v) in md {
            request.metadata_mut().insert_bin(k, v.to_vec()).unwrap();
        }
        expect_code(echo.echo(request).wait(), Code::ResourceExhausted);
        // Metadata has a limit of its own, whatever the ring.
        let mut request = Request::new(EchoRequest::default());
        request.metadata_mut().insert_bin("big", vec![0; 70_000]).unwrap();
        expect_code(echo.echo(request).wait(), Code::InvalidArgument);
        // The channel is unharmed.
        check_echo(&echo, payload(10), &[]);
        drop(echo);
        drop(ch);
        server.shutdown();

        // A handler's error status whose trailing metadata is over that
        // limit still reaches its caller: its code and message, saying why
        // the metadata was left out.
        let server = serve(test_server(&Probe::new()), url);
        let echo = EchoClient::new(channel(server.local_url()));
        for len in [100, 70_000] {
            let request = echo_request("big status", Vec::new(), &[("fail-with-len", &len.to_string())]);
            let status = expect_code(echo.echo(request).wait(), Code::FailedPrecondition);
            let detail = status.metadata().and_then(|md| md.get("detail"));
            if len == 100 {
                assert_eq!(detail.map(str::len), Some(100), "{status}");
                // The binary details arrive beside it, not in the metadata.
                assert_eq!(status.details(), format!("details: {}", "d".repeat(100)).as_bytes());
                assert_eq!(status.metadata().unwrap().len(), 1, "{status:?}");
            } else {
                assert_eq!(detail, None);
                assert!(status.details().is_empty());
                assert!(status.message().starts_with("as asked"), "{status}");
                assert!(status.message().contains("trailing metadata"), "{status}");
            }
        }
        check_echo(&echo, payload(10), &[]);
        server.shutdown();

        // The server advertises a lower limit set with max_message_size.
        let server = serve(
            Server::builder()
                .add_service(EchoServer::new(EchoService))
                .ring_size(RING)
                .max_message_size(1000),
            url,
        );
        let echo = EchoClient::new(channel(server.local_url()));
        let largest = largest_payload(1000, 0);
        check_echo(&echo, payload(largest), &[]);
        expect_code(
            echo.echo(EchoRequest { payload: payload(largest + 1).into() }).wait(),
            Code::ResourceExhausted,
        );
        server.shutdown();
    }
}

on_every_fabric! {
    fn response_too_large_for_the_client(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).ring_size(RING), url);
        let client_ring = 8192;
        let ch = Channel::builder(server.local_url())
            .ring_size(client_ring)
            .max_message_size(client_ring / 2 - HEADER_LEN)
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let echo = EchoClient::new(ch);
        // Replies of `reply-len` carry no metadata.
        let largest = largest_payload(client_ring / 2 - HEADER_LEN, 0);
        let reply = echo
            .echo(echo_request("fits", Vec::new(), &[("reply-len", &largest.to_string())]))
            .wait()
            .unwrap();
        assert_eq!(reply.into_inner().payload, pattern(largest, 7));
        // One byte more cannot reach the client: the server says so instead.
        let e = expect_code(
            echo.echo(echo_request("big", Vec::new(), &[("reply-len", &(largest + 1).to_string())]))
                .wait(),
            Code::ResourceExhausted,
        );
        assert!(e.message().contains("exceeds"), "{e}");
        // Far larger too, and the connection survives it.
        expect_code(
            echo.echo(echo_request("huge", Vec::new(), &[("reply-len", "20000")])).wait(),
            Code::ResourceExhausted,
        );
        let reply = echo.echo(echo_request("after", b"ok".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"ok"[..]);
        server.shutdown();
    }
}

on_every_fabric! {
    fn small_rings_wrap_under_concurrent_load(url: &str) {
        // Both rings at the minimum: frames of every size up to the largest
        // wrap around constantly, in both directions, with several calls in
        // flight per thread.
        let ring = 4096;
        let probe = Probe::new();
        let server = serve(test_server(&probe).ring_size(ring).blocking_threads(2), url);
        let ch = Channel::builder(server.local_url())
            .ring_size(ring)
            .timeout(LIMIT)
            .connect()
            .unwrap();
        std::thread::scope(|s| {
            for w in 0..3u64 {
                let echo = EchoClient::new(ch.clone());
                s.spawn(move || {
                    for batch in 0..40u64 {
                        let calls: Vec<_> = (0..3)
                            .map(|j| {
                                let i = batch * 3 + j;
                                let tag = format!("w{w}-c{i:03}");
                                let md_len = metadata_len(&[("tag", &tag)]);
                                let largest = largest_payload(ring / 2 - HEADER_LEN, md_len);
                                // Mostly random sizes, often the largest.
                                let len = match pattern(1, w << 32 | i)[0] % 4 {
                                    0 => largest,
                                    _ => pattern(2, i << 8 | w)
                                        .iter()
                                        .fold(0usize, |a, &b| a << 8 | b as usize)
                                        % (largest + 1),
                                };
                                let payload = pattern(len, i);
                                let call = echo.echo(echo_request(&tag, payload.clone(), &[]));
                                (tag, payload, call)
                            })
                            .collect();
                        for (tag, payload, call) in calls {
                            check_reply(&tag, &payload, call.wait());
                        }
                    }
                });
            }
        });
        server.shutdown();
    }
}

on_every_fabric! {
    fn requests_cross_a_small_ring_while_no_reply_flows(url: &str) {
        // Every handler blocks, so nothing flows back to carry credits: the
        // server must return them on its own, also when the next frame has
        // to wrap around the ring. Frame sizes (header included) on a 4 KiB
        // ring: after 1984 + 128 bytes, a 2048-byte frame must skip the last
        // 1984 bytes, which needs the 128 back too, though they are far less
        // than the quarter of the ring that prompts a credit otherwise.
        let ring = 4096;
        let frames = [1984, 128, 2048, 100, 2000, 1000, 640, 2048, 64, 1990, 2048, 300];
        let probe = Probe::new();
        let server = serve(test_server(&probe).ring_size(ring).blocking_threads(frames.len()), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let calls: Vec<_> = frames
            .iter()
            .enumerate()
            .map(|(i, &frame)| {
                let tag = format!("c{i:02}");
                let md_len = metadata_len(&[("tag", &tag), ("block", "")]);
                let len = largest_payload(frame - HEADER_LEN, md_len);
                assert!(HEADER_LEN + md_len + echo_encoded_len(len) > frame - ALIGN);
                let payload = pattern(len, i as u64);
                let call = echo.echo(echo_request(&tag, payload.clone(), &[("block", "")]));
                // One frame per server batch: each is consumed (and any
                // credit decided) before the next is sent.
                probe.wait_entered(&tag);
                (tag, payload, call)
            })
            .collect();
        probe.open_gate("");
        for (tag, payload, call) in calls {
            check_reply(&tag, &payload, call.wait());
        }
        server.shutdown();
    }
}

on_every_fabric! {
    fn many_clients_share_one_server(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(2), url);
        let local = server.local_url().to_owned();
        std::thread::scope(|s| {
            for c in 0..12u64 {
                let local = local.clone();
                s.spawn(move || {
                    let echo = EchoClient::new(channel(&local));
                    for i in 0..30 {
                        let (tag, payload) = call_input(c, i);
                        check_reply(&tag, &payload, echo.echo(echo_request(&tag, payload.clone(), &[])).wait());
                    }
                });
            }
        });
        server.shutdown();
    }
}

#[test]
fn connection_failures_are_reported() {
    watchdog(|| {
        // Nobody serves this name or port.
        let e = Channel::connect("mem://suite.nobody-here").unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = Channel::builder(&format!("tcp://127.0.0.1:{port}"))
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        // Not a URL, or not a valid ring.
        for url in [
            "nonsense",
            "ftp://x:1",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:99999",
            "mem://",
        ] {
            let e = Channel::connect(url).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{url}: {e}");
        }
        for size in [1000, 5000, 2048] {
            let e = Channel::builder("mem://suite.anything")
                .ring_size(size)
                .connect()
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "ring of {size}: {e}");
        }
        let e = Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve("mem://")
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        // One mem:// name, one server.
        let server = serve(
            Server::builder().add_service(EchoServer::new(EchoService)),
            "mem://suite.taken",
        );
        let e = Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve("mem://suite.taken")
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        server.shutdown();
    });
}

on_every_fabric! {
    fn full_ring_queues_calls_then_drains_in_order(url: &str) {
        // Handlers run on the poller, so a blocked handler stops the server
        // from consuming its ring: later requests fill it, then queue.
        let probe = Probe::new();
        let server = serve(test_server_with(&probe, true).ring_size(4096), url);
        let ch = channel(server.local_url());
        let echo = EchoClient::new(ch.clone());

        let first = echo.echo(echo_request("blocker", b"first".to_vec(), &[("block", "")]));
        probe.wait_entered("blocker");
        // About 20 of these fit a 4 KiB ring: issue many more.
        let n = 100u64;
        let mut calls: Vec<_> = (0..n)
            .map(|i| {
                let tag = format!("queued-{i}");
                let payload = pattern(100, i);
                let call = echo.echo(echo_request(&tag, payload.clone(), &[]));
                (tag, payload, call)
            })
            .collect();
        // The ring is full: a fail-fast call is refused at once...
        let mut request = echo_request("impatient", Vec::new(), &[]);
        request.set_fail_fast(true);
        let e = expect_code(echo.echo(request).wait(), Code::ResourceExhausted);
        assert!(e.message().contains("full"), "{e}");
        // A deadline still applies to a call that could not be sent yet.
        let mut request = echo_request("expiring", Vec::new(), &[]);
        request.set_timeout(Duration::from_millis(100));
        expect_code(echo.echo(request).wait(), Code::DeadlineExceeded);
        // ...while the queued calls neither failed nor completed.
        for (tag, _, call) in &mut calls {
            assert!(!is_done(call), "{tag} completed while the server was blocked");
        }
        assert_eq!(probe.seen().entered, ["blocker"]);

        probe.open_gate("");
        assert_eq!(first.wait().unwrap().into_inner().payload, &b"first"[..]);
        for (tag, payload, call) in calls {
            check_reply(&tag, &payload, call.wait());
        }
        // The server saw every call once, in the order they were issued
        // (the expired one may or may not have been sent after them).
        let expected: Vec<String> = std::iter::once("blocker".to_owned())
            .chain((0..n).map(|i| format!("queued-{i}")))
            .collect();
        let mut entered = probe.seen().entered.clone();
        if entered.last().is_some_and(|t| t == "expiring") {
            entered.pop();
        }
        assert_eq!(entered, expected);
        // With room again, fail-fast calls go through.
        let mut request = echo_request("fast", b"x".to_vec(), &[]);
        request.set_fail_fast(true);
        assert_eq!(echo.echo(request).wait().unwrap().into_inner().payload, &b"x"[..]);
        server.shutdown();
    }
}

on_every_fabric! {
    fn deadlines_expire_and_late_replies_are_dropped(url: &str) {
        // One worker: calls are handled, and answered, one after the other.
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(1), url);
        let ch = channel(server.local_url());
        let echo = EchoClient::new(ch.clone());

        let timeout = Duration::from_millis(200);
        let mut request = echo_request("slow", b"late".to_vec(), &[("block", "")]);
        request.set_timeout(timeout);
        let started = Instant::now();
        let e = expect_code(echo.echo(request).wait(), Code::DeadlineExceeded);
        let elapsed = started.elapsed();
        assert!(elapsed >= timeout, "gave up after {elapsed:?}, before {timeout:?}: {e}");
        assert!(elapsed < timeout + Duration::from_secs(5), "gave up only after {elapsed:?}");
        probe.wait_entered("slow");
        assert_eq!(ch.stale_responses(), 0);

        // A call queued behind the blocked worker expires on both sides: the
        // server drops it without running the handler once its own deadline
        // (counted from arrival) has passed too.
        let mut request = echo_request("doomed", Vec::new(), &[]);
        request.set_timeout(Duration::from_millis(100));
        let sent = Instant::now();
        expect_code(echo.echo(request).wait(), Code::DeadlineExceeded);
        // The request reached the server within a few ms of being sent; give
        // its server-side deadline ample time to pass as well.
        std::thread::sleep((sent + Duration::from_millis(400)).saturating_duration_since(Instant::now()));

        // The handler finishes late; the channel keeps working. The client
        // cancelled both expired calls, so the server sends no late reply
        // for them (the next reply would come after one, and a late reply
        // would be counted as stale and dropped).
        probe.open_gate("");
        let reply = echo.echo(echo_request("next", b"on time".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.metadata().get("tag"), Some("next"));
        assert_eq!(reply.into_inner().payload, &b"on time"[..]);
        assert_eq!(ch.stale_responses(), 0, "a cancelled call was answered");
        assert_eq!(probe.seen().entered, ["slow", "next"], "an expired call was run");

        // A channel's default timeout applies to every call...
        let short = EchoClient::new(
            Channel::builder(server.local_url())
                .timeout(Duration::from_millis(150))
                .connect()
                .unwrap(),
        );
        expect_code(
            short.echo(echo_request("sleepy", Vec::new(), &[("sleep-ms", "1000")])).wait(),
            Code::DeadlineExceeded,
        );
        // ...unless the request sets its own. This one waits behind the
        // sleeping call on the single worker, far longer than 150 ms.
        let mut request = echo_request("patient", b"p".to_vec(), &[("sleep-ms", "10")]);
        request.set_timeout(LIMIT);
        let started = Instant::now();
        let reply = short.echo(request).wait().unwrap();
        assert!(started.elapsed() > Duration::from_millis(150));
        assert_eq!(reply.into_inner().payload, &b"p"[..]);
        assert_eq!(short.channel().stale_responses(), 0);
        server.shutdown();
    }
}

on_every_fabric! {
    fn shutdown_finishes_running_calls_and_refuses_new_ones(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(4), url);
        let ch = channel(server.local_url());
        let echo = EchoClient::new(ch.clone());
        let running: Vec<_> = (0..3)
            .map(|i| {
                let tag = format!("running-{i}");
                let call = echo.echo(echo_request(&tag, pattern(50, i), &[("block", "")]));
                probe.wait_entered(&tag);
                (tag, pattern(50, i), call)
            })
            .collect();

        let local_url = server.local_url().to_owned();
        let shutdown = std::thread::spawn(move || server.shutdown());
        // Once the server drains, new calls are refused. Probe until then:
        // calls that raced ahead of the shutdown are still answered.
        let mut probes = 0;
        let deadline = Instant::now() + LIMIT;
        let refused = loop {
            probes += 1;
            assert!(Instant::now() < deadline, "calls still accepted during shutdown");
            match echo.echo(echo_request(&format!("probe-{probes}"), Vec::new(), &[])).wait() {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(refused.code(), Code::Unavailable, "{refused}");
        expect_code(
            echo.echo(echo_request("after", Vec::new(), &[])).wait(),
            Code::Unavailable,
        );
        assert!(!shutdown.is_finished(), "shutdown returned with calls running");

        // The running calls complete normally, then shutdown returns.
        probe.open_gate("");
        for (tag, payload, call) in running {
            check_reply(&tag, &payload, call.wait());
        }
        bounded("shutdown", move || shutdown.join().expect("shutdown panicked"));
        // The connection is closed now.
        expect_code(
            echo.echo(echo_request("closed", Vec::new(), &[])).wait(),
            Code::Unavailable,
        );
        eventually("the channel to notice", || !ch.is_connected());
        // New connections are refused.
        let e = Channel::builder(&local_url)
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .expect_err("connected to a server that shut down");
        assert_eq!(e.code(), Code::Unavailable, "{e}");
    }
}

on_every_fabric! {
    fn shutdown_grace_period_is_bounded(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(2), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let stuck = echo.echo(echo_request("stuck", Vec::new(), &[("block", "")]));
        probe.wait_entered("stuck");
        let started = Instant::now();
        bounded("shutdown", move || server.shutdown_timeout(Duration::from_millis(300)));
        assert!(started.elapsed() >= Duration::from_millis(300));
        // The call still running when the grace period ended is cut off.
        expect_code(stuck.wait(), Code::Unavailable);
        probe.open_gate("");
    }
}

on_every_fabric! {
    fn panicking_handler_is_internal_and_server_keeps_serving(url: &str) {
        for inline in [false, true] {
            let probe = Probe::new();
            let server = serve(test_server_with(&probe, inline), url);
            let echo = EchoClient::new(channel(server.local_url()));
            for i in 0..3 {
                let e = expect_code(
                    echo.echo(echo_request("boom", Vec::new(), &[("panic", "kaboom")])).wait(),
                    Code::Internal,
                );
                assert!(e.message().contains("kaboom"), "{e}");
                let payload = pattern(10, i);
                let reply = echo.echo(echo_request("fine", payload.clone(), &[])).wait().unwrap();
                assert_eq!(reply.into_inner().payload, payload);
            }
            // Other clients are served too.
            let other = EchoClient::new(channel(server.local_url()));
            let reply = other.echo(echo_request("other", b"o".to_vec(), &[])).wait().unwrap();
            assert_eq!(reply.into_inner().payload, &b"o"[..]);
            server.shutdown();
        }
    }
}

on_every_fabric! {
    /// Timeouts past what the clock or the wire can say: `Duration::MAX`
    /// means no deadline (no panic), and one over the header's 71.6
    /// minutes reaches the server as no deadline, not cut short.
    fn huge_timeouts_mean_no_deadline(url: &str) {
        let server = serve(test_server(&Probe::new()), url);
        let left_ms = |channel: &Channel, timeout: Option<Duration>| {
            let mut request = echo_request("deadline", b"d".to_vec(), &[("report-deadline", "1")]);
            if let Some(t) = timeout {
                request.set_timeout(t);
            }
            let reply = EchoClient::new(channel.clone()).echo(request).wait().unwrap();
            reply.metadata().get("deadline-left-ms").unwrap().parse::<i64>().unwrap()
        };
        let plain = channel(server.local_url());
        assert_eq!(left_ms(&plain, Some(Duration::MAX)), -1);
        assert_eq!(left_ms(&plain, Some(Duration::from_secs(2 * 3600))), -1);
        let hour = left_ms(&plain, Some(Duration::from_secs(3600)));
        assert!((3_590_000..=3_600_000).contains(&hour), "{hour} ms left of an hour");
        // As a channel's default, for connecting and for streams too.
        let forever = Channel::builder(server.local_url())
            .timeout(Duration::MAX)
            .connect_timeout(Duration::MAX)
            .connect()
            .unwrap();
        assert_eq!(left_ms(&forever, None), -1);
        let stream = EchoClient::new(forever.clone()).stream(StreamRequest { count: 3, size: 8 });
        assert_eq!(stream.into_iter().map(Result::unwrap).count(), 3);
        assert!(forever.wait_connected(Duration::MAX));
        server.shutdown();
    }
}

on_every_fabric! {
    /// A bug of ours that panics while a dispatcher handles a frame closes
    /// that frame's connection, and only it: the thread lives on and serves
    /// the other connections it polls.
    fn a_dispatcher_panic_closes_only_its_connection(url: &str) {
        let path = format!("/fault.{}/Panic", &url[..url.find(':').unwrap()]);
        let faulty = described(path.leak(), rpc_core::codegen::MethodKind::Unary);
        rpc_core::testing::faults::panic_on_method(faulty.id);
        let probe = Probe::new();
        // One dispatcher: the faulty connection and the others share it.
        let server = serve(test_server(&probe).dispatchers(1), url);
        let bystander = EchoClient::new(channel(server.local_url()));
        let mut slow = echo_request("across", b"in flight".to_vec(), &[("sleep-ms", "200")]);
        slow.set_timeout(LIMIT);
        let in_flight = bystander.echo(slow);

        let victim = Channel::builder(server.local_url())
            .timeout(LIMIT)
            .reconnect(false)
            .connect()
            .unwrap();
        let request = Request::new(EchoRequest { payload: b"x".to_vec().into() });
        let status = rpc_core::codegen::unary::<_, EchoReply>(&victim, faulty, request)
            .wait()
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status}");
        // The connection is closed for good: its next call fails too.
        let again = EchoClient::new(victim).echo(echo_request("after", Vec::new(), &[])).wait();
        expect_code(again, Code::Unavailable);

        // The call in flight on the same dispatcher, and new ones, are served.
        assert_eq!(in_flight.wait().unwrap().into_inner().payload, &b"in flight"[..]);
        let reply = bystander.echo(echo_request("next", b"n".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"n"[..]);
        let newcomer = EchoClient::new(channel(server.local_url()));
        let reply = newcomer.echo(echo_request("new", b"w".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"w"[..]);
        server.shutdown();
    }
}

on_every_fabric! {
    fn client_gone_mid_call_leaves_the_server_serving(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(2), url);
        let other = EchoClient::new(channel(server.local_url()));

        let leaving = channel(server.local_url());
        let call = EchoClient::new(leaving.clone())
            .echo(echo_request("orphan", pattern(1000, 1), &[("block", "")]));
        probe.wait_entered("orphan");
        // The client goes away with its call running.
        drop(call);
        drop(leaving);
        // Others are served meanwhile...
        let reply = other.echo(echo_request("during", b"d".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"d"[..]);
        // ...and after the handler answers into the closed connection.
        probe.open_gate("");
        probe.wait_finished("orphan");
        let reply = other.echo(echo_request("after", b"a".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"a"[..]);
        let newcomer = EchoClient::new(channel(server.local_url()));
        let reply = newcomer.echo(echo_request("new", b"n".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"n"[..]);

        // A thread still waiting on a call when the last handle of its
        // channel goes away gets Unavailable rather than waiting forever.
        let leaving = EchoClient::new(channel(server.local_url()));
        let call = leaving.echo(echo_request("abandoned", Vec::new(), &[("block", "abandoned")]));
        let waiter = std::thread::spawn(move || call.wait());
        probe.wait_entered("abandoned");
        drop(leaving);
        let result = bounded("the abandoned call", move || waiter.join().unwrap());
        expect_code(result, Code::Unavailable);
        probe.open_gate("abandoned");
        probe.wait_finished("abandoned");
        let reply = other.echo(echo_request("last", b"l".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"l"[..]);
        bounded("shutdown", move || server.shutdown());
    }
}

on_every_fabric! {
    fn slow_inline_handler_delays_but_does_not_drop_a_deep_pipeline(url: &str) {
        // A 2 MiB ring has room for far more small requests than a fabric
        // context keeps receives posted by default (4096), and every
        // incoming write consumes one. While the only poller is stuck in a
        // handler, nobody replenishes them: a sender that finds none waits
        // up to the RNR timeout, then the connection fails. Receives must be
        // provisioned for everything the ring admits, so that the stuck
        // poller only delays the pipeline, however long it is stuck.
        let probe = Probe::new();
        let server = serve(test_server_with(&probe, true).ring_size(2 << 20), url);
        let echo = EchoClient::new(channel(server.local_url()));
        let first = echo.echo(echo_request("blocker", Vec::new(), &[("block", "")]));
        probe.wait_entered("blocker");
        let calls = bounded("issuing the pipeline", move || {
            let calls: Vec<_> = (0..6000u64)
                .map(|i| {
                    let tag = format!("p{i}");
                    let call = echo.echo(echo_request(&tag, Vec::new(), &[]));
                    (tag, call)
                })
                .collect();
            (echo, calls)
        });
        // The handler stays stuck past the point where senders give up.
        std::thread::sleep(rpc_core::fabric::soft::DEFAULT_RNR_TIMEOUT + Duration::from_secs(1));
        probe.open_gate("");
        first.wait().unwrap();
        for (tag, call) in calls.1 {
            check_reply(&tag, &[], call.wait());
        }
        let expected: Vec<String> = std::iter::once("blocker".to_owned())
            .chain((0..6000).map(|i| format!("p{i}")))
            .collect();
        assert!(probe.seen().entered == expected, "calls lost, repeated or reordered");
        server.shutdown();
    }
}

on_every_fabric! {
    /// A server serves a bounded number of streams at once per connection:
    /// a client's stream beyond the limit waits until one of the
    /// connection's streams ends (or fails at its deadline, saying why),
    /// and unary calls do not count.
    fn a_stream_beyond_the_servers_limit_waits_for_one_to_end(url: &str) {
        use rpc_core::health::{HealthCheckRequest, HealthClient, ServingStatus};
        let probe = Probe::new();
        let (_reporter, health) = rpc_core::health::service();
        let server = serve(
            test_server(&probe).max_concurrent_streams(2).add_service(health),
            url,
        );
        let ch = channel(server.local_url());
        let health = HealthClient::new(ch.clone());
        let echo = EchoClient::new(ch);
        let serving = |w: &mut rpc_core::Streaming<rpc_core::health::HealthCheckResponse>| {
            let status = w.blocking_message().unwrap().expect("a first status");
            assert_eq!(status.status, ServingStatus::Serving as i32);
        };
        let mut first = health.watch("");
        let mut second = health.watch("");
        serving(&mut first);
        serving(&mut second);
        // Unary calls go on beside the two streams.
        let reply = echo.echo(echo_request("beside", b"ok".to_vec(), &[])).wait().unwrap();
        assert_eq!(reply.into_inner().payload, &b"ok"[..]);
        // A third with a deadline fails at it, naming the limit.
        let mut request = Request::new(HealthCheckRequest::default());
        request.set_timeout(Duration::from_millis(200));
        let started = Instant::now();
        let e = expect_code(
            health.watch_request(request).blocking_message(),
            Code::DeadlineExceeded,
        );
        assert!(started.elapsed() >= Duration::from_millis(150), "{e}");
        assert!(e.message().contains("max_concurrent_streams"), "{e}");
        // A third without one waits, on another thread, until the first ends.
        let waiting = health.clone();
        let third = std::thread::spawn(move || {
            let mut third = waiting.watch("");
            let status = third.blocking_message();
            (status, third)
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!third.is_finished(), "the third stream did not wait");
        drop(first);
        let (status, third) = third.join().unwrap();
        let status = status.unwrap().expect("a first status");
        assert_eq!(status.status, ServingStatus::Serving as i32);
        // A stream that ends on its own frees its place too.
        drop(second);
        let mut fourth = health.watch("");
        serving(&mut fourth);
        drop((third, fourth));
        bounded("shutdown", move || server.shutdown());
    }
}

on_every_fabric! {
    /// Streams waiting for room on a full connection open one per stream
    /// that ends, in the order they asked: each end wakes only the stream
    /// it hands its place to, so a long queue costs each waiter a few
    /// polls, not one per stream ahead of it.
    fn streams_waiting_for_room_open_in_turn_each_woken_once(url: &str) {
        use futures::StreamExt;
        use rpc_core::health::HealthClient;
        const WAITING: usize = 64;
        let probe = Probe::new();
        let (_reporter, health) = rpc_core::health::service();
        let server = serve(
            test_server(&probe).max_concurrent_streams(1).add_service(health),
            url,
        );
        let health = HealthClient::new(channel(server.local_url()));
        let mut held = health.watch("");
        held.blocking_message().unwrap().expect("a first status");
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let waiters = {
            let (health, queued) = (health.clone(), queued.clone());
            std::thread::spawn(move || {
                let order = std::cell::RefCell::new(Vec::new());
                let streams = (0..WAITING).map(|i| {
                    let (health, order, queued) = (&health, &order, &queued);
                    async move {
                        let mut stream = health.watch("");
                        let mut polls = 0;
                        let first = futures::future::poll_fn(|cx| {
                            polls += 1;
                            if polls == 1 {
                                queued.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            stream.poll_next_unpin(cx)
                        })
                        .await;
                        first.expect("a status").expect("not an error");
                        order.borrow_mut().push(i);
                        // Its end hands the place to the next.
                        drop(stream);
                        polls
                    }
                });
                let polls = futures::executor::block_on(futures::future::join_all(streams));
                (order.into_inner(), polls)
            })
        };
        let all_queued = queued.clone();
        bounded("the streams queue", move || {
            while all_queued.load(std::sync::atomic::Ordering::SeqCst) < WAITING {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        drop(held);
        let (order, polls) = waiters.join().unwrap();
        assert_eq!(order, (0..WAITING).collect::<Vec<_>>(), "in the order they asked");
        let most = polls.iter().max().copied().unwrap_or(0);
        assert!(most <= 6, "a waiting stream was polled {most} times: {polls:?}");
        bounded("shutdown", move || server.shutdown());
    }
}

on_every_fabric! {
    /// A cancelled call's handler future is dropped, as tonic drops it:
    /// whether the client drops the call or its deadline passes, and
    /// whether the handler runs on a dispatcher or on the blocking pool.
    fn a_cancelled_handlers_future_is_dropped(url: &str) {
        for inline in [true, false] {
            let probe = Probe::new();
            let server = serve(test_server_with(&probe, inline), url);
            let echo = EchoClient::new(channel(server.local_url()));
            let dropped = |tag: &str| {
                probe.wait_for(&format!("{tag:?}'s handler dropped"), |s| {
                    s.dropped.iter().any(|t| t == tag)
                })
            };
            // Asking about cancellation before waiting makes no difference.
            for first in ["1", "check", "race"] {
                let forever = |tag: &str| echo_request(tag, Vec::new(), &[("await-forever", first)]);
                let tag = format!("dropped-{first}");
                let call = echo.echo(forever(&tag));
                probe.wait_entered(&tag);
                drop(call);
                dropped(&tag);
                let tag = format!("deadline-{first}");
                let mut request = forever(&tag);
                request.set_timeout(Duration::from_millis(200));
                expect_code(echo.echo(request).wait(), Code::DeadlineExceeded);
                dropped(&tag);
            }
            // Nothing was answered for them, and the server goes on.
            let reply = echo.echo(echo_request("after", b"ok".to_vec(), &[])).wait().unwrap();
            assert_eq!(reply.into_inner().payload, &b"ok"[..], "inline: {inline}");
            bounded("shutdown", move || server.shutdown());
        }
    }
}
