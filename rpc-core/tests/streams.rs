//! Streams over mem:// and tcp://, through a hand-written service: every
//! kind of rpc, flow control, cancellation, deadlines and final statuses.

use futures::StreamExt;
use rpc_core::codegen::{
    MethodDescriptor, MethodKind, ServiceDescriptor, client_streaming, client_streaming_sender,
    method_id, server_streaming, streaming, streaming_sender, unary,
};
use rpc_core::{
    BoxStream, Channel, Code, Metadata, Request, Response, Server, ServerCall, ServerHandle,
    Service, Status, Trailers,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Clone, PartialEq, prost::Message)]
struct Item {
    #[prost(uint64, tag = "1")]
    seq: u64,
    #[prost(bytes = "vec", tag = "2")]
    data: Vec<u8>,
}

fn item(seq: u64) -> Item {
    Item { seq, data: vec![] }
}

/// How an `Encodings` call reports an encoding.
fn encoding_code(encoding: Option<rpc_core::Encoding>) -> u8 {
    encoding.map_or(0, |e| {
        1 + rpc_core::Encoding::ALL
            .iter()
            .position(|a| *a == e)
            .unwrap() as u8
    })
}

/// `len` bytes for message `seq`: a 251-byte run (prime, so that no run
/// lines up with a frame or chunk edge) of `i * 31 + seq` repeated, built
/// by copies (byte by byte, the tests' unoptimised build takes seconds per
/// MiB under the Soft-RoCE guest's emulated CPU).
fn numbered(len: usize, seq: u64) -> Vec<u8> {
    let run: Vec<u8> = (0..251u64).map(|i| (i * 31 + seq) as u8).collect();
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let take = run.len().min(len - out.len());
        out.extend_from_slice(&run[..take]);
    }
    out
}

macro_rules! method {
    ($name:literal, $kind:ident) => {
        MethodDescriptor {
            name: $name,
            path: concat!("/hand.Feed/", $name),
            id: method_id(concat!("/hand.Feed/", $name)),
            kind: MethodKind::$kind,
        }
    };
}

static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
    name: "hand.Feed",
    methods: &[
        method!("Count", ServerStreaming),
        method!("Endless", ServerStreaming),
        method!("Sum", ClientStreaming),
        method!("Echo", Streaming),
        method!("Ping", Unary),
        method!("WaitCancel", Unary),
        method!("Fail", ServerStreaming),
        method!("Budget", Unary),
        method!("Relay", Unary),
        method!("Encodings", ClientStreaming),
    ],
};
const COUNT: &MethodDescriptor = &DESCRIPTOR.methods[0];
const ENDLESS: &MethodDescriptor = &DESCRIPTOR.methods[1];
const SUM: &MethodDescriptor = &DESCRIPTOR.methods[2];
const ECHO: &MethodDescriptor = &DESCRIPTOR.methods[3];
const PING: &MethodDescriptor = &DESCRIPTOR.methods[4];
const WAIT_CANCEL: &MethodDescriptor = &DESCRIPTOR.methods[5];
const FAIL: &MethodDescriptor = &DESCRIPTOR.methods[6];
const BUDGET: &MethodDescriptor = &DESCRIPTOR.methods[7];
const RELAY: &MethodDescriptor = &DESCRIPTOR.methods[8];
const ENCODINGS: &MethodDescriptor = &DESCRIPTOR.methods[9];

/// What the handlers report to the tests.
#[derive(Default)]
struct Probe {
    /// Messages the endless stream produced.
    produced: AtomicU64,
    /// When the endless stream was dropped.
    stream_dropped: Mutex<Option<Instant>>,
    /// When a waiting unary handler heard of its cancellation.
    cancel_seen: Mutex<Option<Instant>>,
    /// A channel back to the server itself, for the relay.
    channel: OnceLock<Channel>,
}

#[derive(Clone)]
struct Feed(Arc<Probe>);

/// Records when the stream holding it is dropped.
struct DropGuard(Arc<Probe>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        *self.0.stream_dropped.lock().unwrap() = Some(Instant::now());
    }
}

impl Service for Feed {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &DESCRIPTOR
    }

    fn call(&self, call: ServerCall) {
        let probe = self.0.clone();
        match call.method_id() {
            id if id == COUNT.id => call.server_streaming(|r: Request<Item>| async move {
                let (n, size) = (r.get_ref().seq, r.get_ref().data.len());
                // Trailers the stream fills in as it goes: what it sent.
                let trailers = Trailers::new();
                trailers.insert("sent", "0").unwrap();
                let sent = trailers.clone();
                let s = futures::stream::iter(0..n).map(move |seq| {
                    sent.insert("sent", (seq + 1).to_string()).unwrap();
                    Ok(Item {
                        seq,
                        data: vec![seq as u8; size],
                    })
                });
                let mut resp = Response::new(s).with_trailers(trailers);
                resp.metadata_mut().insert("kind", "count").unwrap();
                Ok(resp)
            }),
            // Messages of as many bytes as the request's `seq` says.
            id if id == ENDLESS.id => call.server_streaming(move |r: Request<Item>| async move {
                let guard = DropGuard(probe.clone());
                let size = r.into_inner().seq as usize;
                let s = futures::stream::unfold((0u64, guard), move |(seq, guard)| async move {
                    guard.0.produced.fetch_add(1, Ordering::Relaxed);
                    let m = Item {
                        seq,
                        data: vec![seq as u8; size],
                    };
                    Some((Ok(m), (seq + 1, guard)))
                });
                Ok(Response::new(Box::pin(s) as BoxStream<Item>))
            }),
            id if id == SUM.id => {
                call.client_streaming(|r: Request<rpc_core::Streaming<Item>>| async move {
                    let mut stream = r.into_inner();
                    let (mut count, mut sum) = (0, 0);
                    while let Some(item) = stream.message().await? {
                        count += 1;
                        sum += item.seq;
                    }
                    Ok(Response::new(Item {
                        seq: sum,
                        data: vec![count as u8],
                    }))
                })
            }
            // How each message arrived: a byte each, 0 as it was, else
            // 1 + its encoding's place in `Encoding::ALL`.
            id if id == ENCODINGS.id => {
                call.client_streaming(|r: Request<rpc_core::Streaming<Item>>| async move {
                    let mut stream = r.into_inner();
                    let mut seen = Vec::new();
                    while let Some(item) = stream.message().await? {
                        assert_eq!(item.data, numbered(item.data.len(), item.seq));
                        seen.push(encoding_code(stream.message_encoding()));
                    }
                    Ok(Response::new(Item {
                        seq: seen.len() as u64,
                        data: seen,
                    }))
                })
            }
            id if id == ECHO.id => {
                call.streaming(|r: Request<rpc_core::Streaming<Item>>| async move {
                    let echoed = r.into_inner().map(|m| {
                        m.map(|i| Item {
                            seq: i.seq * 2,
                            ..i
                        })
                    });
                    Ok(Response::new(echoed))
                })
            }
            id if id == PING.id => call
                .unary_async(|r: Request<Item>| async move { Ok(Response::new(r.into_inner())) }),
            id if id == WAIT_CANCEL.id => call.unary_async(move |r: Request<Item>| async move {
                r.cancelled().await;
                *probe.cancel_seen.lock().unwrap() = Some(Instant::now());
                Err::<Response<Item>, _>(Status::cancelled("seen"))
            }),
            id if id == FAIL.id => call.server_streaming(|_: Request<Item>| async move {
                let mut why = Metadata::new();
                why.insert("why", "three is enough").unwrap();
                let trailers = Trailers::new();
                let sent = trailers.clone();
                let s = futures::stream::iter(0..4u64).map(move |seq| {
                    if seq < 3 {
                        sent.insert("sent", (seq + 1).to_string()).unwrap();
                        Ok(item(seq))
                    } else {
                        Err(Status::out_of_range("no more").with_metadata(why.clone()))
                    }
                });
                Ok(Response::new(s).with_trailers(trailers))
            }),
            id if id == BUDGET.id => call.unary_async(|r: Request<Item>| async move {
                let left = r.deadline().map_or(0, |d| {
                    d.saturating_duration_since(Instant::now()).as_micros()
                });
                Ok(Response::new(item(left as u64)))
            }),
            id if id == RELAY.id => call.unary_async(move |r: Request<Item>| async move {
                let channel = probe.channel.get().expect("set at start").clone();
                // The child call carries what remains of this call's budget.
                let child = r.child(item(0));
                unary::<_, Item>(&channel, BUDGET, child).await
            }),
            _ => call.unimplemented(),
        }
    }
}

fn start(url: &str) -> (ServerHandle, Channel, Arc<Probe>) {
    let probe = Arc::new(Probe::default());
    let server = Server::builder()
        .add_service(Feed(probe.clone()))
        .serve(url)
        .unwrap();
    let channel = Channel::connect(server.local_url()).unwrap();
    let _ = probe
        .channel
        .set(Channel::connect(server.local_url()).unwrap());
    (server, channel, probe)
}

/// Runs the test `$name(url)` on mem:// and tcp://, and on rdma:// where
/// there is a device (`scripts/test` runs those in the Soft-RoCE guest,
/// with `RPC_TEST_RDMA_URL` set).
macro_rules! on_every_fabric {
    ($name:ident) => {
        mod $name {
            #[test]
            fn mem() {
                super::$name(concat!("mem://streams-", stringify!($name)));
            }
            #[test]
            fn tcp() {
                super::$name("tcp://127.0.0.1:0");
            }
            #[test]
            #[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
            fn rdma() {
                let url = std::env::var("RPC_TEST_RDMA_URL").expect("RPC_TEST_RDMA_URL");
                super::$name(&url);
            }
        }
    };
}

fn count(ch: &Channel, n: u64, size: usize) -> rpc_core::Streaming<Item> {
    server_streaming::<_, Item>(
        ch,
        COUNT,
        Request::new(Item {
            seq: n,
            data: vec![0; size],
        }),
    )
}

on_every_fabric!(server_streams_arrive_complete_and_in_order);
fn server_streams_arrive_complete_and_in_order(url: &str) {
    let (_server, ch, _) = start(url);
    // Blocking iterator.
    let mut stream = count(&ch, 20_000, 100);
    let mut next = 0;
    for m in &mut stream {
        let m = m.unwrap();
        assert_eq!(m.seq, next, "{url}");
        assert_eq!(m.data, vec![next as u8; 100]);
        next += 1;
    }
    assert_eq!(next, 20_000, "{url}");
    assert_eq!(stream.metadata().unwrap().get("kind"), Some("count"));
    // The trailers the handler set while its stream ran, with the end.
    let trailers = stream.trailers().expect("trailers at the end");
    assert_eq!(trailers.get("sent"), Some("20000"), "{url}");
    assert_eq!(
        trailers.get("kind"),
        None,
        "initial metadata are not trailers"
    );
    // Async, with messages larger than half the window.
    let stream = count(&ch, 20, 200_000);
    let got: Vec<_> =
        futures::executor::block_on(stream.map(|m| m.unwrap().seq).collect::<Vec<_>>());
    assert_eq!(got, (0..20).collect::<Vec<_>>(), "{url}");
    // An empty stream still carries the initial metadata, before its end.
    let mut stream = count(&ch, 0, 0);
    assert!(stream.blocking_message().unwrap().is_none());
    assert_eq!(stream.metadata().unwrap().get("kind"), Some("count"));
    assert_eq!(stream.trailers().unwrap().get("sent"), Some("0"));
}

#[test]
fn a_million_messages_arrive_in_order() {
    let (_server, ch, _) = start("mem://streams-million");
    let mut expected = 0u64;
    for m in count(&ch, 1_000_000, 8) {
        let m = m.unwrap();
        assert_eq!(m.seq, expected);
        expected += 1;
    }
    assert_eq!(expected, 1_000_000);
}

on_every_fabric!(empty_messages_give_their_window_back);
/// A default message encodes to no bytes, yet its frame costs window: it
/// must be granted back like any other, or a stream of them stalls once
/// they have used up the window (4,096 of them in 256 KiB).
fn empty_messages_give_their_window_back(url: &str) {
    let (_server, ch, _) = start(url);
    let (mut tx, call) = client_streaming_sender::<Item, Item>(&ch, SUM, Request::new(()));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..10_000 {
            tx.send(Item::default()).unwrap();
        }
        tx.close().unwrap();
        done_tx.send(futures::executor::block_on(call)).unwrap();
    });
    let reply = done_rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{url}: a stream of empty messages stalled"))
        .unwrap()
        .into_inner();
    assert_eq!(
        (reply.seq, reply.data),
        (0, vec![(10_000 % 256) as u8]),
        "{url}"
    );
}

on_every_fabric!(client_streams_and_bidi_streams_both_ways);
fn client_streams_and_bidi_streams_both_ways(url: &str) {
    let (_server, ch, _) = start(url);
    // From a stream.
    let requests = futures::stream::iter((1..=1000).map(item));
    let reply = client_streaming::<_, Item>(&ch, SUM, Request::new(requests))
        .wait()
        .unwrap()
        .into_inner();
    assert_eq!(reply.seq, 500_500, "{url}");
    assert_eq!(reply.data, vec![(1000 % 256) as u8]);
    // Through a sender, awaited.
    let (mut tx, call) = client_streaming_sender::<Item, Item>(&ch, SUM, Request::new(()));
    for seq in 0..10_000 {
        tx.send(item(seq)).unwrap();
    }
    tx.close().unwrap();
    let reply = futures::executor::block_on(call).unwrap().into_inner();
    assert_eq!(reply.seq, (0..10_000).sum::<u64>(), "{url}");

    // Bidi from a stream, many windows' worth.
    let requests = futures::stream::iter((0..50_000).map(item));
    let echoed: Vec<u64> = streaming::<_, Item>(&ch, ECHO, Request::new(requests))
        .map(|m| m.unwrap().seq)
        .collect::<Vec<_>>()
        .wait_blocking();
    assert_eq!(
        echoed,
        (0..50_000).map(|s| s * 2).collect::<Vec<_>>(),
        "{url}"
    );
    // Bidi through a sender, one message at a time, in lockstep.
    let (mut tx, mut rx) = streaming_sender::<Item, Item>(&ch, ECHO, Request::new(()));
    for seq in 0..1000 {
        tx.send(item(seq)).unwrap();
        assert_eq!(rx.blocking_message().unwrap().unwrap().seq, seq * 2);
    }
    drop(tx); // half-closes
    assert!(rx.blocking_message().unwrap().is_none(), "{url}");
}

on_every_fabric!(a_request_stream_switches_compression_message_by_message);
/// A sender switches compression between messages, small ones batched in
/// the ring and large ones lent: the server sees each as it was sent, and
/// the channel's setting holds until the sender changes it.
fn a_request_stream_switches_compression_message_by_message(url: &str) {
    use rpc_core::Encoding;
    let (_server, ch, _) = start(url);
    let ch = ch.send_compressed(Encoding::Zstd);
    let (mut tx, call) = client_streaming_sender::<Item, Item>(&ch, ENCODINGS, Request::new(()));
    let plan = [
        (None, 100),
        (Some(Encoding::Zstd), 100),
        (Some(Encoding::Gzip), 100),
        (Some(Encoding::Gzip), 100),
        (None, 300_000),
        (Some(Encoding::Deflate), 300_000),
        (Some(Encoding::Zstd), 10),
    ];
    let mut want = Vec::new();
    for (seq, (encoding, len)) in plan.into_iter().enumerate() {
        // The first goes with the channel's setting.
        let sent = if seq == 0 {
            Some(Encoding::Zstd)
        } else {
            encoding
        };
        if seq > 0 {
            tx.set_compression(encoding);
        }
        tx.send(Item {
            seq: seq as u64,
            data: numbered(len, seq as u64),
        })
        .unwrap();
        want.push(encoding_code(sent));
    }
    tx.close().unwrap();
    let reply = futures::executor::block_on(call).unwrap().into_inner();
    assert_eq!(reply.data, want, "{url}");
}

on_every_fabric!(messages_lent_and_in_the_ring_keep_their_order);
/// Stream messages large enough to be lent (encoded ahead into the buffer
/// the peer reads) and small ones gathered into the ring, interleaved both
/// ways: each arrives whole, in its place, and a lent first message still
/// carries the stream's initial metadata.
fn messages_lent_and_in_the_ring_keep_their_order(url: &str) {
    let (_server, ch, _) = start(url);
    const SIZES: [usize; 8] = [0, 100, 20_000, 40_000, 8, 300_000, 1 << 20, 33_000];
    let sent = |seq: u64| Item {
        seq,
        data: numbered(SIZES[seq as usize % SIZES.len()], seq),
    };
    let requests = futures::stream::iter((0..200).map(sent));
    let mut echoed = streaming::<_, Item>(&ch, ECHO, Request::new(requests));
    let mut next = 0u64;
    while let Some(m) = echoed.blocking_message().unwrap() {
        let want = sent(next);
        assert_eq!(m.seq, next * 2, "{url}: message {next} out of order");
        assert!(m.data == want.data, "{url}: message {next} arrived damaged");
        next += 1;
    }
    assert_eq!(next, 200, "{url}");
    // A server stream whose every message is lent, the first one with the
    // initial metadata.
    let mut stream = count(&ch, 5, 1 << 20);
    for seq in 0..5u64 {
        let m = stream.blocking_message().unwrap().expect("five messages");
        assert_eq!((m.seq, m.data.len()), (seq, 1 << 20), "{url}");
        assert!(m.data == vec![seq as u8; 1 << 20], "{url}");
    }
    assert!(stream.blocking_message().unwrap().is_none(), "{url}");
    assert_eq!(
        stream.metadata().unwrap().get("kind"),
        Some("count"),
        "{url}"
    );
    assert_eq!(stream.trailers().unwrap().get("sent"), Some("5"), "{url}");
}

/// Runs a future to completion on this thread.
trait WaitBlocking: std::future::Future + Sized {
    fn wait_blocking(self) -> Self::Output {
        futures::executor::block_on(self)
    }
}
impl<F: std::future::Future> WaitBlocking for F {}

on_every_fabric!(a_stream_ends_with_its_error_status_and_trailers);
fn a_stream_ends_with_its_error_status_and_trailers(url: &str) {
    let (_server, ch, _) = start(url);
    let mut stream = server_streaming::<_, Item>(&ch, FAIL, Request::new(item(0)));
    for seq in 0..3 {
        assert_eq!(stream.blocking_message().unwrap().unwrap().seq, seq);
    }
    let e = stream.blocking_message().unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{url}: {e}");
    assert_eq!(
        e.metadata().and_then(|m| m.get("why")),
        Some("three is enough")
    );
    // The handler's trailers join the error's own metadata.
    assert_eq!(e.metadata().and_then(|m| m.get("sent")), Some("3"));
    assert!(stream.blocking_message().unwrap().is_none());
    // An unknown streaming method fails the stream, not the channel.
    static NOPE: MethodDescriptor = MethodDescriptor {
        name: "Nope",
        path: "/hand.Feed/Nope",
        id: 0xdead_beef,
        kind: MethodKind::ServerStreaming,
    };
    let e = server_streaming::<_, Item>(&ch, &NOPE, Request::new(item(0)))
        .blocking_message()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let ping = unary::<_, Item>(&ch, PING, Request::new(item(7))).wait();
    assert_eq!(ping.unwrap().into_inner().seq, 7);
}

/// Waits up to `limit` for `f` to return `Some`.
fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

on_every_fabric!(a_consumer_that_stops_reading_stalls_only_its_own_producer);
fn a_consumer_that_stops_reading_stalls_only_its_own_producer(url: &str) {
    let (_server, ch, probe) = start(url);
    let mut stalled = server_streaming::<_, Item>(&ch, ENDLESS, Request::new(item(0)));
    assert_eq!(stalled.blocking_message().unwrap().unwrap().seq, 0);
    // The producer runs until the window is full, then stops.
    let produced = produced_when_stalled(&probe, url);
    // One window (256 KiB of messages, each at least its 4-byte length
    // and a 2-byte item in a batch), one batch (16 KiB) waiting for window,
    // and what one poll of the producer takes from its stream.
    let most = (256 << 10) / 6 + (16 << 10) / 6 + 256;
    assert!(
        produced <= most,
        "{url}: {produced} produced, at most {most}"
    );
    // Meanwhile the connection serves everyone else.
    for seq in 0..200 {
        let r = unary::<_, Item>(&ch, PING, Request::new(item(seq))).wait();
        assert_eq!(r.unwrap().into_inner().seq, seq, "{url}");
    }
    let other = count(&ch, 50_000, 16).into_iter().count();
    assert_eq!(other, 50_000, "{url}");
    // Reading again resumes the stalled stream where it stopped.
    for seq in 1..10_000 {
        assert_eq!(stalled.blocking_message().unwrap().unwrap().seq, seq);
    }
}

/// How many messages the endless stream produced, once the count holds
/// still (an emulated guest takes a while to get there).
fn produced_when_stalled(probe: &Probe, url: &str) -> u64 {
    let mut produced = probe.produced.load(Ordering::Relaxed);
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = probe.produced.load(Ordering::Relaxed);
        if now == produced {
            return produced;
        }
        assert!(
            Instant::now() < give_up,
            "{url}: the producer kept going ({now} produced)"
        );
        produced = now;
    }
}

on_every_fabric!(a_stalled_stream_of_large_messages_holds_few);
/// Messages above `PIPELINED_MAX` (64 MiB), which travel one at a time,
/// are produced no further ahead than the one encoded into its buffer
/// while the one before is read: a stalled consumer of such messages does
/// not make its producer hold one more for nothing. A client that then
/// drops the stream and its channel at once, while a message is being
/// read, ends the handler's stream: by its cancel, or by the connection's
/// end if the cancel does not make it.
fn a_stalled_stream_of_large_messages_holds_few(url: &str) {
    let (server, _, probe) = start(url);
    let size = (64 << 20) + 1;
    let ch = Channel::builder(server.local_url())
        .max_message_size(2 * size as usize)
        .connect()
        .unwrap();
    let mut stalled = server_streaming::<_, Item>(&ch, ENDLESS, Request::new(item(size)));
    let first = stalled.blocking_message().unwrap().unwrap();
    assert_eq!((first.seq, first.data.len()), (0, size as usize), "{url}");
    // The one read, the next in flight, one encoded ahead.
    let produced = produced_when_stalled(&probe, url);
    assert!(produced <= 3, "{url}: {produced} produced, at most 3");
    for seq in 1..3 {
        let m = stalled.blocking_message().unwrap().unwrap();
        assert_eq!((m.seq, m.data.len()), (seq, size as usize), "{url}");
        // Compared a page at a time: quick in a debug build, even emulated.
        let page = [seq as u8; 4096];
        let whole = m.data.chunks(page.len()).all(|c| c == &page[..c.len()]);
        assert!(whole, "{url}: message {seq} arrived damaged");
    }
    drop(stalled);
    drop(ch);
    let gone = wait_for(Duration::from_secs(5), || {
        *probe.stream_dropped.lock().unwrap()
    });
    assert!(
        gone.is_some(),
        "{url}: the handler's stream outlived its client"
    );
}

on_every_fabric!(cancelling_a_stream_ends_the_handlers_stream_within_10ms);
fn cancelling_a_stream_ends_the_handlers_stream_within_10ms(url: &str) {
    let (_server, ch, probe) = start(url);
    // The best of three: a busy machine may deschedule any one run.
    let mut best = Duration::MAX;
    for _ in 0..3 {
        *probe.stream_dropped.lock().unwrap() = None;
        let mut stream = server_streaming::<_, Item>(&ch, ENDLESS, Request::new(item(0)));
        for _ in 0..100 {
            stream.blocking_message().unwrap().unwrap();
        }
        let cancelled = Instant::now();
        drop(stream);
        let dropped = wait_for(Duration::from_secs(5), || {
            *probe.stream_dropped.lock().unwrap()
        })
        .unwrap_or_else(|| panic!("{url}: the handler's stream was never dropped"));
        best = best.min(dropped.saturating_duration_since(cancelled));
    }
    // The Soft-RoCE guest emulates its CPU: there, only an upper bound.
    let limit = if url.starts_with("rdma") { 200 } else { 10 };
    assert!(best <= Duration::from_millis(limit), "{url}: {best:?}");
}

on_every_fabric!(unary_handlers_see_their_cancellation);
fn unary_handlers_see_their_cancellation(url: &str) {
    let (_server, ch, probe) = start(url);
    let mut req = Request::new(item(0));
    req.set_timeout(Duration::from_millis(50));
    let e = unary::<_, Item>(&ch, WAIT_CANCEL, req).wait().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{url}");
    let seen = wait_for(Duration::from_secs(5), || {
        *probe.cancel_seen.lock().unwrap()
    });
    assert!(seen.is_some(), "{url}: the handler never heard");
    // A dropped call is a cancel too.
    *probe.cancel_seen.lock().unwrap() = None;
    let call = unary::<_, Item>(&ch, WAIT_CANCEL, Request::new(item(0)));
    let call = futures::FutureExt::boxed(call);
    let mut call = call;
    // Poll it once so that its request leaves, then drop it.
    let waker = futures::task::noop_waker();
    let _ = call
        .as_mut()
        .poll(&mut std::task::Context::from_waker(&waker));
    std::thread::sleep(Duration::from_millis(20));
    drop(call);
    let seen = wait_for(Duration::from_secs(5), || {
        *probe.cancel_seen.lock().unwrap()
    });
    assert!(seen.is_some(), "{url}: a dropped call was not cancelled");
}

on_every_fabric!(a_child_call_inherits_the_remaining_deadline);
fn a_child_call_inherits_the_remaining_deadline(url: &str) {
    let (_server, ch, _) = start(url);
    let mut req = Request::new(item(0));
    req.set_timeout(Duration::from_millis(800));

    let left = unary::<_, Item>(&ch, RELAY, req)
        .wait()
        .unwrap()
        .into_inner()
        .seq;
    assert!(left > 0 && left <= 800_000, "{url}: {left} µs left");
    // Without a deadline, the child has none.
    let left = unary::<_, Item>(&ch, RELAY, Request::new(item(0)))
        .wait()
        .unwrap()
        .into_inner()
        .seq;
    assert_eq!(left, 0, "{url}");
    // A deadline set directly counts down the same way.
    let mut req = Request::new(item(0));
    req.set_deadline(Instant::now() + Duration::from_millis(300));
    let left = unary::<_, Item>(&ch, BUDGET, req)
        .wait()
        .unwrap()
        .into_inner()
        .seq;
    assert!(left > 0 && left <= 300_000, "{url}: {left} µs left");
}

on_every_fabric!(a_stream_deadline_fails_it_and_cancels_the_handler);
fn a_stream_deadline_fails_it_and_cancels_the_handler(url: &str) {
    let (_server, ch, probe) = start(url);
    let mut req = Request::new(item(0));
    req.set_timeout(Duration::from_millis(100));
    let mut stream = server_streaming::<_, Item>(&ch, ENDLESS, req);
    let mut n = 0;
    let e = loop {
        match stream.blocking_message() {
            Ok(Some(_)) => n += 1,
            Ok(None) => panic!("{url}: an endless stream ended"),
            Err(e) => break e,
        }
        // Read slowly, so the deadline comes first.
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(e.code(), Code::DeadlineExceeded, "{url} after {n}");
    let dropped = wait_for(Duration::from_secs(5), || {
        *probe.stream_dropped.lock().unwrap()
    });
    assert!(
        dropped.is_some(),
        "{url}: the handler's stream outlived the deadline"
    );
}
