//! Attacks on streaming, cancellation, deadlines and flow control: streams
//! stalled, dropped, cancelled and reopened; handlers that fail, panic or
//! never end; deadlines while backpressured; shutdown with streams in every
//! state; and the connection's send queue full while grants, cancels and
//! stream sends fall due (none may be lost, nor window leaked).

#[macro_use]
mod common;

use common::*;
use examples::routeguide::route_guide_client::RouteGuideClient;
use examples::routeguide::route_guide_server::{RouteGuide, RouteGuideServer};
use examples::routeguide::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use futures::StreamExt;
use rpc_core::{BoxStream, Channel, Code, Request, Response, Server, Status, Streaming};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Counters shared with the test.
#[derive(Default, Debug)]
pub struct Live {
    /// Response streams alive (created, not dropped).
    pub streams: AtomicUsize,
    /// Handler futures alive.
    pub handlers: AtomicUsize,
    /// Messages produced by response streams.
    pub produced: AtomicUsize,
    /// Messages read by handlers from request streams.
    pub consumed: AtomicUsize,
    /// Request-stream terminal statuses seen by handlers (code as usize).
    pub request_ends: std::sync::Mutex<Vec<String>>,
}

struct Guard(Arc<Live>, bool);
impl Guard {
    fn stream(live: &Arc<Live>) -> Guard {
        live.streams.fetch_add(1, Ordering::SeqCst);
        Guard(live.clone(), true)
    }
    fn handler(live: &Arc<Live>) -> Guard {
        live.handlers.fetch_add(1, Ordering::SeqCst);
        Guard(live.clone(), false)
    }
}
impl Drop for Guard {
    fn drop(&mut self) {
        if self.1 {
            self.0.streams.fetch_sub(1, Ordering::SeqCst);
        } else {
            self.0.handlers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A response stream steered by mode.
struct Evil {
    _g: Guard,
    live: Arc<Live>,
    n: usize,
    /// After this many, do `then`.
    after: usize,
    then: String,
    size: usize,
    incoming: Option<Streaming<RouteNote>>,
}

impl futures::Stream for Evil {
    type Item = Result<Feature, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(incoming) = &mut this.incoming {
            // echo mode: one reply per note read
            return match Pin::new(incoming).poll_next(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(s))) => {
                    this.live
                        .request_ends
                        .lock()
                        .unwrap()
                        .push(format!("{:?}", s.code()));
                    Poll::Ready(Some(Err(s)))
                }
                Poll::Ready(Some(Ok(note))) => {
                    this.live.consumed.fetch_add(1, Ordering::SeqCst);
                    this.live.produced.fetch_add(1, Ordering::SeqCst);
                    Poll::Ready(Some(Ok(Feature {
                        name: note.message,
                        location: note.location,
                    })))
                }
            };
        }
        if this.n >= this.after {
            match this.then.as_str() {
                "end" => return Poll::Ready(None),
                "error" => return Poll::Ready(Some(Err(Status::aborted("mid-stream error")))),
                "panic" => panic!("mid-stream panic"),
                "pending" => return Poll::Pending, // never wakes, ignores cancel
                _ => {}
            }
        }
        this.n += 1;
        this.live.produced.fetch_add(1, Ordering::SeqCst);
        if this.size == usize::MAX {
            return Poll::Ready(Some(Ok(Feature::default())));
        }
        Poll::Ready(Some(Ok(Feature {
            name: "x".repeat(this.size),
            location: Some(Point {
                latitude: this.n as i32,
                longitude: 0,
            }),
        })))
    }
}

#[derive(Clone, Default)]
struct Adversary {
    live: Arc<Live>,
}

fn md<'a, T>(r: &'a Request<T>, k: &str) -> Option<&'a str> {
    r.metadata().get(k)
}

impl RouteGuide for Adversary {
    async fn get_feature(&self, request: Request<Point>) -> Result<Response<Feature>, Status> {
        let _g = Guard::handler(&self.live);
        if let Some(ms) = md(&request, "sleep-ms") {
            tokio_free_sleep(Duration::from_millis(ms.parse().unwrap())).await;
        }
        Ok(Response::new(Feature {
            name: "unary".into(),
            location: Some(request.into_inner()),
        }))
    }

    type ListFeaturesStream = BoxStream<Feature>;

    async fn list_features(
        &self,
        request: Request<Rectangle>,
    ) -> Result<Response<BoxStream<Feature>>, Status> {
        let g = Guard::handler(&self.live);
        if md(&request, "handler-hang").is_some() {
            // Never completes, ignores cancellation.
            std::future::pending::<()>().await;
        }
        let after = md(&request, "after").map_or(usize::MAX, |v| v.parse().unwrap());
        let then = md(&request, "then").unwrap_or("").to_owned();
        let size = md(&request, "size").map_or(10, |v| {
            if v == "empty" {
                usize::MAX
            } else {
                v.parse().unwrap()
            }
        });
        drop(g);
        let mut metadata = rpc_core::Metadata::new();
        if let Some(session) = md(&request, "session") {
            metadata.insert("session", session).unwrap();
        }
        Ok(Response::from_parts(
            metadata,
            Box::pin(Evil {
                _g: Guard::stream(&self.live),
                live: self.live.clone(),
                n: 0,
                after,
                then,
                size,
                incoming: None,
            }),
        ))
    }

    async fn record_route(
        &self,
        request: Request<Streaming<Point>>,
    ) -> Result<Response<RouteSummary>, Status> {
        let _g = Guard::handler(&self.live);
        let mode = md(&request, "mode").unwrap_or("").to_owned();
        let mut points = request.into_inner();
        match mode.as_str() {
            "answer-now" => {
                return Ok(Response::new(RouteSummary {
                    point_count: -1,
                    ..Default::default()
                }));
            }
            "never-read" => {
                std::future::pending::<()>().await;
            }
            "sleep-then-read" => {
                tokio_free_sleep(Duration::from_millis(2000)).await;
            }
            _ => {}
        }
        let mut n = 0;
        loop {
            match points.message().await {
                Ok(Some(_)) => {
                    n += 1;
                    self.live.consumed.fetch_add(1, Ordering::SeqCst);
                }
                Ok(None) => {
                    self.live
                        .request_ends
                        .lock()
                        .unwrap()
                        .push(format!("ended after {n}"));
                    break;
                }
                Err(s) => {
                    self.live
                        .request_ends
                        .lock()
                        .unwrap()
                        .push(format!("{:?}", s.code()));
                    return Err(s);
                }
            }
        }
        Ok(Response::new(RouteSummary {
            point_count: n,
            ..Default::default()
        }))
    }

    type RouteChatStream = BoxStream<RouteNote>;

    async fn route_chat(
        &self,
        request: Request<Streaming<RouteNote>>,
    ) -> Result<Response<BoxStream<RouteNote>>, Status> {
        let mode = md(&request, "mode").unwrap_or("echo").to_owned();
        if mode == "await-forever" {
            let _g = Guard::handler(&self.live);
            std::future::pending::<()>().await;
        }
        let size = md(&request, "size").map_or(10, |v| v.parse().unwrap());
        let mut metadata = rpc_core::Metadata::new();
        if let Some(session) = md(&request, "session") {
            metadata.insert("session", session).unwrap();
        }
        let mut incoming = request.into_inner();
        if mode == "headers-first" {
            // A request stream has no initial metadata: none, at once.
            let headers = incoming.initial_metadata().await?;
            assert!(headers.is_empty(), "{headers:?}");
        }
        let silent = mode == "silent";
        let incoming = matches!(mode.as_str(), "echo" | "headers-first").then_some(incoming);
        Ok(Response::from_parts(
            metadata,
            Box::pin(
                (Evil {
                    _g: Guard::stream(&self.live),
                    live: self.live.clone(),
                    n: 0,
                    after: if silent { 0 } else { usize::MAX },
                    then: if silent {
                        "pending".into()
                    } else {
                        String::new()
                    },
                    size,
                    incoming,
                })
                .map(|r| {
                    r.map(|f| RouteNote {
                        location: f.location,
                        message: f.name,
                    })
                }),
            ),
        ))
    }
}

/// A sleep that needs no runtime: a thread wakes the task.
async fn tokio_free_sleep(d: Duration) {
    let until = Instant::now() + d;
    let mut spawned = false;
    std::future::poll_fn(move |cx| {
        if Instant::now() >= until {
            return Poll::Ready(());
        }
        if !spawned {
            spawned = true;
            let w = cx.waker().clone();
            std::thread::spawn(move || {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                w.wake();
            });
        }
        Poll::Pending
    })
    .await
}

fn start(url: &str) -> (rpc_core::ServerHandle, Arc<Live>, String) {
    let svc = Adversary::default();
    let live = svc.live.clone();
    let server = serve(
        Server::builder()
            .dispatchers(1)
            .add_service(RouteGuideServer::new(svc)),
        url,
    );
    let u = server.local_url().to_owned();
    (server, live, u)
}

/// A server of [`Adversary`] that serves one stream at a time per
/// connection.
fn one_stream_server(url: &str) -> rpc_core::ServerHandle {
    serve(
        Server::builder()
            .dispatchers(1)
            .max_concurrent_streams(1)
            .add_service(RouteGuideServer::new(Adversary::default())),
        url,
    )
}

/// A server that serves one stream at a time per connection, and a client.
fn start_with_one_stream(url: &str) -> (rpc_core::ServerHandle, RouteGuideClient) {
    let server = one_stream_server(url);
    let client = client_for(server.local_url(), Some(LIMIT));
    (server, client)
}

fn client_for(url: &str, timeout: Option<Duration>) -> RouteGuideClient {
    let mut b = Channel::builder(url);
    if let Some(t) = timeout {
        b = b.timeout(t);
    }
    RouteGuideClient::new(b.connect().unwrap())
}

/// A request of `message` with `meta` as its metadata.
fn with_meta<T>(message: T, meta: &[(&str, &str)]) -> Request<T> {
    let mut r = Request::new(message);
    for (k, v) in meta {
        r.metadata_mut().insert(k, *v).unwrap();
    }
    r
}

fn rect_req(meta: &[(&str, &str)]) -> Request<Rectangle> {
    let rect = Rectangle {
        lo: Some(Point::default()),
        hi: Some(Point::default()),
    };
    with_meta(rect, meta)
}

fn unary_ok(client: &RouteGuideClient) {
    let got = client
        .get_feature(Point {
            latitude: 7,
            longitude: 7,
        })
        .wait()
        .unwrap();
    assert_eq!(got.get_ref().name, "unary");
}

// ---------------------------------------------------------------------------

on_soft_fabrics! {
    /// Many streams on one connection: some never read, some dropped mid-stream.
    /// Unary calls keep flowing; all released after.
    fn many_streams_some_stalled(url: &str) {
        let (server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let mut stalled = Vec::new();
        for _ in 0..32 {
            let s = client.list_features(rect_req(&[("size", "1000")]));
            stalled.push(s);
        }
        // Read one message from each to make sure they started.
        for s in &mut stalled {
            let m = s.blocking_message().unwrap().unwrap();
            assert_eq!(m.name.len(), 1000);
        }
        for _ in 0..100 {
            unary_ok(&client);
        }
        // A fresh stream reads to a bound.
        let mut s = client.list_features(rect_req(&[("after", "5000"), ("then", "end")]));
        let mut n = 0;
        while let Some(_m) = s.blocking_message().unwrap() {
            n += 1;
        }
        assert_eq!(n, 5000);
        eventually("streams live 32", || live.streams.load(Ordering::SeqCst) == 32);
        // Drop half, from another thread.
        let second = stalled.split_off(16);
        std::thread::spawn(move || drop(second)).join().unwrap();
        eventually("streams live 16", || live.streams.load(Ordering::SeqCst) == 16);
        drop(stalled);
        eventually("streams live 0", || live.streams.load(Ordering::SeqCst) == 0);
        for _ in 0..10 {
            unary_ok(&client);
        }
        server.shutdown_timeout(Duration::from_secs(2));
    }
}

/// Reads `s` to its end: the messages read, and the error it ended with.
fn read_to_end<T: prost::Message + Default>(mut s: Streaming<T>) -> (usize, Option<Status>) {
    let mut n = 0;
    loop {
        match s.blocking_message() {
            Ok(Some(_)) => n += 1,
            Ok(None) => return (n, None),
            Err(e) => return (n, Some(e)),
        }
    }
}

on_soft_fabrics! {
    /// A response stream that yields an error mid-way: the client reads the
    /// messages before, then the error.
    fn midstream_error(url: &str) {
        let (_server, _live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let s = client.list_features(rect_req(&[("after", "1000"), ("then", "error")]));
        let (n, end) = read_to_end(s);
        assert_eq!(n, 1000);
        assert_eq!(end.unwrap().code(), Code::Aborted);
        unary_ok(&client);
    }
}

on_soft_fabrics! {
    /// A response stream that panics mid-way: the client reads the messages
    /// it yielded before, then `Internal`.
    fn midstream_panic(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let s = client.list_features(rect_req(&[("after", "300"), ("then", "panic")]));
        let (n, end) = read_to_end(s);
        assert_eq!(n, 300);
        assert_eq!(end.unwrap().code(), Code::Internal);
        unary_ok(&client);
        eventually("stream dropped", || live.streams.load(Ordering::SeqCst) == 0);
    }
}

on_soft_fabrics! {
    /// A response stream that goes Pending forever and never wakes: the
    /// client's deadline ends it; the server drops the stream after cancel.
    fn pending_forever_deadline(url: &str) {
        let (server, live, u) = start(url);
        let client = client_for(&u, Some(Duration::from_millis(500)));
        let mut s = client.list_features(rect_req(&[("after", "3"), ("then", "pending")]));
        let mut n = 0;
        let t = Instant::now();
        let end = loop {
            match s.blocking_message() {
                Ok(Some(_)) => n += 1,
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        assert_eq!(n, 3);
        assert_eq!(end.unwrap().code(), Code::DeadlineExceeded);
        assert!(t.elapsed() < Duration::from_secs(5));
        drop(s);
        eventually("stream dropped after cancel", || live.streams.load(Ordering::SeqCst) == 0);
        unary_ok(&client);
        let t = Instant::now();
        server.shutdown_timeout(Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(3), "shutdown waited {:?}", t.elapsed());
    }
}

on_soft_fabrics! {
    /// Deadline expires while the stream is backpressured (client not reading).
    fn deadline_while_backpressured(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(Duration::from_millis(400)));
        let mut s = client.list_features(rect_req(&[("size", "4000")]));
        std::thread::sleep(Duration::from_millis(800));
        // Cancelled/out of time: drops what it received; status at once.
        let t = Instant::now();
        let r = s.blocking_message();
        assert!(t.elapsed() < Duration::from_millis(200));
        assert_eq!(r.unwrap_err().code(), Code::DeadlineExceeded);
        eventually("server stream dropped", || live.streams.load(Ordering::SeqCst) == 0);
        let produced = live.produced.load(Ordering::SeqCst);
        assert!(produced < 200, "produced {produced} of 4 KB beyond the 256 KiB window");
    }
}

on_soft_fabrics! {
    /// Cancel (drop) and immediately open a new stream, repeatedly.
    fn cancel_and_reopen(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        for i in 0..300 {
            let mut s = client.list_features(rect_req(&[("size", "100")]));
            let _ = s.blocking_message().unwrap().unwrap();
            if i % 2 == 0 {
                drop(s);
            } else {
                std::thread::spawn(move || drop(s));
            }
        }
        let mut s = client.list_features(rect_req(&[("after", "10"), ("then", "end")]));
        let mut n = 0;
        while s.blocking_message().unwrap().is_some() {
            n += 1;
        }
        assert_eq!(n, 10);
        eventually("all dropped", || live.streams.load(Ordering::SeqCst) == 0);
    }
}

on_soft_fabrics! {
    /// Client streaming, deadline before half-close with a server that never reads.
    fn client_stream_deadline_before_halfclose(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(Duration::from_millis(500)));
        let (mut tx, call) = client.record_route_sender(with_meta((), &[("mode", "never-read")]));
        let t = Instant::now();
        let mut sent = 0;
        let err = loop {
            match tx.send(Point { latitude: 1, longitude: 2 }) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            if t.elapsed() > Duration::from_secs(10) { panic!("send never failed"); }
        };
        eprintln!("sent {sent} before {err}");
        assert!(t.elapsed() < Duration::from_secs(3), "send blocked {:?}", t.elapsed());
        let r = call.wait();
        assert_eq!(r.unwrap_err().code(), Code::DeadlineExceeded);
        // The handler, awaiting something else than its stream, is dropped.
        eventually("handler dropped", || live.handlers.load(Ordering::SeqCst) == 0);
    }
}

on_soft_fabrics! {
    /// A bidi handler that awaits something else before it answers with a
    /// stream: dropping the call drops the handler's future.
    fn a_cancel_drops_a_stream_handler_that_has_not_answered(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let (tx, rx) = client.route_chat_sender(with_meta((), &[("mode", "await-forever")]));
        eventually("handler running", || live.handlers.load(Ordering::SeqCst) == 1);
        drop((tx, rx));
        eventually("handler dropped", || live.handlers.load(Ordering::SeqCst) == 0);
        unary_ok(&client);
    }
}

on_soft_fabrics! {
    /// Server answers a client stream early without reading: the sender's
    /// next sends fail and the call has the answer.
    fn client_stream_server_answers_early(url: &str) {
        let (_server, _live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let (mut tx, call) = client.record_route_sender(with_meta((), &[("mode", "answer-now")]));
        let t = Instant::now();
        let mut err = None;
        for _ in 0..100_000 {
            if let Err(e) = tx.send(Point { latitude: 1, longitude: 2 }) {
                err = Some(e);
                break;
            }
        }
        eprintln!("send ended with {err:?} after {:?}", t.elapsed());
        assert!(err.is_some(), "sends never failed");
        let got = call.wait().unwrap();
        assert_eq!(got.get_ref().point_count, -1);
    }
}

on_soft_fabrics! {
    /// Server shutdown with streams in every state: every caller errs, no hang.
    fn shutdown_with_streams_everywhere(url: &str) {
        let (server, _live, u) = start(url);
        let client = client_for(&u, None);
        // open, blocked on credits (not reading)
        let mut blocked = client.list_features(rect_req(&[("size", "4000")]));
        let _ = blocked.blocking_message().unwrap();
        // open, idle (pending forever server side)
        let mut idle = client.list_features(rect_req(&[("after", "1"), ("then", "pending")]));
        let _ = idle.blocking_message().unwrap();
        // bidi, half-closed by client
        let (tx, mut bidi_hc) = client.route_chat_sender(());
        drop(tx);
        // bidi open
        let (mut tx2, mut bidi) = client.route_chat_sender(());
        tx2.send(RouteNote { location: Some(Point::default()), message: "a".into() }).unwrap();
        let _ = bidi.blocking_message().unwrap();
        // client stream whose server never reads, sender blocked
        let (mut tx3, cs) = client.record_route_sender(with_meta((), &[("mode", "never-read")]));
        let sender = std::thread::spawn(move || {
            loop {
                if let Err(e) = tx3.send(Point { latitude: 1, longitude: 1 }) {
                    return e;
                }
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let stopper = std::thread::spawn(move || server.shutdown_timeout(Duration::from_secs(1)));
        let e1 = bounded("blocked", move || loop {
            match blocked.blocking_message() { Ok(Some(_)) => continue, Ok(None) => break None, Err(e) => break Some(e) }
        });
        let e2 = bounded("idle", move || idle.blocking_message());
        let e3 = bounded("bidi_hc", move || bidi_hc.blocking_message());
        let e4 = bounded("bidi", move || bidi.blocking_message());
        let e5 = bounded("cs", move || cs.wait());
        let e6 = bounded("sender", move || sender.join().unwrap());
        stopper.join().unwrap();
        eprintln!("blocked={e1:?}\nidle={e2:?}\nbidi_hc={e3:?}\nbidi={e4:?}\ncs={e5:?}\nsender={e6:?}\nafter {:?}", t.elapsed());
        assert!(matches!(e1, Some(ref e) if e.code() == Code::Unavailable), "{e1:?}");
        assert_eq!(e2.unwrap_err().code(), Code::Unavailable);
        assert_eq!(e4.unwrap_err().code(), Code::Unavailable);
        assert_eq!(e5.unwrap_err().code(), Code::Unavailable);
        let _ = e3;
        let _ = e6;
    }
}

use examples::echo::echo_client::EchoClient;

/// A server with one dispatcher, which a test blocks with the echo
/// service's `sleep-ms`, serving the attacks' route guide too; and a
/// channel to it with a timeout of `timeout_s` seconds.
struct Blockable {
    probe: Arc<Probe>,
    svc: Adversary,
    server: rpc_core::ServerHandle,
    client: RouteGuideClient,
    echo: EchoClient,
}

fn blockable(url: &str, timeout_s: u64) -> Blockable {
    let probe = Probe::new();
    let svc = Adversary::default();
    let server = serve(
        test_server_with(&probe, true)
            .dispatchers(1)
            .add_service(RouteGuideServer::new(svc.clone())),
        url,
    );
    let ch = Channel::builder(server.local_url())
        .timeout(Duration::from_secs(timeout_s))
        .connect()
        .unwrap();
    Blockable {
        probe,
        svc,
        server,
        client: RouteGuideClient::new(ch.clone()),
        echo: EchoClient::new(ch),
    }
}

on_soft_fabrics! {
    /// A window grant that falls due while the connection's send queue is
    /// full is queued, not dropped: the stream goes on once it drains.
    fn a_grant_survives_a_full_send_queue(url: &str) {
        let Blockable { probe, svc, server: _server, client, echo } = blockable(url, 30);
        let mut s = client.list_features(rect_req(&[("size", "4000")]));
        let _ = s.blocking_message().unwrap().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let before = svc.live.produced.load(Ordering::SeqCst);
        eprintln!("server produced {before} (window-bound)");
        // Block the server's only dispatcher.
        let blocker = echo.echo(echo_request("blocker", vec![1], &[("sleep-ms", "3000")]));
        probe.wait_entered("blocker");
        // Fill the backlog toward the server (64 MiB).
        let mut calls = Vec::new();
        let mut failed = None;
        for i in 0..2400 {
            let mut c = echo.echo(echo_request(&format!("f{i}"), vec![0; 30_000], &[]));
            if is_done(&mut c) {
                failed = Some(i);
                eprintln!("call {i} failed at once");
                break;
            }
            calls.push(c);
        }
        eprintln!("queued {} calls; first immediate failure at {failed:?}", calls.len());
        // Top it up to the byte: smaller and smaller requests.
        let mut size = 16_384usize;
        let mut j = 0;
        loop {
            let mut c = echo.echo(echo_request(&format!("g{j}"), vec![0; size], &[]));
            j += 1;
            if is_done(&mut c) {
                if size == 0 { break; }
                size /= 2;
                continue;
            }
            calls.push(c);
        }
        eprintln!("backlog topped up: {} calls", calls.len());
        // Read what is in the inbox: the grants due now meet the full queue.
        for _ in 0..63 {
            let _ = s.blocking_message().unwrap().unwrap();
        }
        let mut probe_call = echo.echo(echo_request("probe", vec![], &[]));
        eprintln!("backlog still full after the reads: {}", is_done(&mut probe_call));
        let _ = blocker.wait();
        let mut ok = 0;
        for c in calls {
            if c.wait().is_ok() { ok += 1; }
        }
        eprintln!("{ok} queued calls answered");
        // The stream should go on (it is infinite).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..500 {
                let m = s.blocking_message();
                let _ = tx.send((i, m.map(|m| m.is_some())));
            }
        });
        let mut got = 0;
        loop {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((i, r)) => { got = i + 1; r.unwrap(); if got == 500 { break; } }
                Err(_) => panic!("stream stalled after {got} more messages; server produced {}", svc.live.produced.load(Ordering::SeqCst)),
            }
        }
    }
}

on_soft_fabrics! {
    /// Large (rendezvous) stream messages, cancelled mid-stream over and over:
    /// nothing leaks, and large streams still flow after.
    fn large_messages_cancelled_repeatedly(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let base = rss();
        for i in 0..150 {
            let mut s = client.list_features(rect_req(&[("size", "1000000")]));
            let m = s.blocking_message().unwrap().unwrap();
            assert_eq!(m.name.len(), 1_000_000);
            if i % 3 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            drop(s);
            if i % 50 == 0 { eprintln!("{i}: rss +{} MB", (rss() as i64 - base as i64) / 1_000_000); }
        }
        eventually("all dropped", || live.streams.load(Ordering::SeqCst) == 0);
        let mut s = client.list_features(rect_req(&[("size", "5000000"), ("after", "40"), ("then", "end")]));
        let mut n = 0;
        while let Some(m) = s.blocking_message().unwrap() { assert_eq!(m.name.len(), 5_000_000); n += 1; }
        assert_eq!(n, 40);
        unary_ok(&client);
        eprintln!("end: rss +{} MB", (rss() as i64 - base as i64) / 1_000_000);
    }
}

/// Queues requests toward a server whose only dispatcher is blocked until
/// the connection's 64 MiB backlog is full to the last few bytes.
fn fill_backlog(echo: &EchoClient) -> Vec<rpc_core::UnaryCall<examples::echo::EchoReply>> {
    let mut calls = Vec::new();
    let mut size = 30_000usize;
    let mut j = 0;
    loop {
        let mut c = echo.echo(echo_request(&format!("g{j}"), vec![0; size], &[]));
        j += 1;
        if is_done(&mut c) {
            if size == 0 {
                break;
            }
            size /= 2;
            continue;
        }
        calls.push(c);
    }
    calls
}

on_soft_fabrics! {
    /// A cancel sent while the send queue is full is queued, not dropped:
    /// the server's stream and handler task end once it drains.
    fn a_cancel_survives_a_full_send_queue(url: &str) {
        let Blockable { probe, svc, server: _server, client, echo } = blockable(url, 30);
        let mut s = client.list_features(rect_req(&[("size", "4000")]));
        let _ = s.blocking_message().unwrap().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let blocker = echo.echo(echo_request("blocker", vec![1], &[("sleep-ms", "2000")]));
        probe.wait_entered("blocker");
        let calls = fill_backlog(&echo);
        drop(s); // its cancel meets the full queue
        let _ = blocker.wait();
        for c in calls { let _ = c.wait(); }
        unary_ok(&client);
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(svc.live.streams.load(Ordering::SeqCst), 0, "the server's stream outlived the client's cancel");
    }
}

on_soft_fabrics! {
    /// A few streams whose server handler never reads: other calls on the
    /// connection must keep flowing.
    fn unread_request_streams_stall_connection(url: &str) {
        let (_server, _live, u) = start(url);
        let client = client_for(&u, Some(Duration::from_secs(5)));
        let n = 8;
        let mut held = Vec::new();
        for i in 0..n {
            let (mut tx, rx) = client.route_chat_sender(with_meta((), &[("mode", "silent")]));
            for j in 0..60 {
                if let Err(e) = tx.send(RouteNote { location: None, message: "m".repeat(4000) }) {
                    panic!("stream {i} message {j}: {e}");
                }
            }
            held.push((tx, rx));
            let t = Instant::now();
            let r = client.get_feature(Point { latitude: 1, longitude: 1 }).wait();
            eprintln!("after {} silent streams: unary {:?} in {:?}", i + 1, r.as_ref().map(|_| ()), t.elapsed());
            r.unwrap();
        }
    }
}

on_soft_fabrics! {
    /// Stream sends that fail for a full send queue give back the window
    /// they took: later sends go through once it drains.
    fn failed_sends_give_back_their_window(url: &str) {
        let Blockable { probe, svc: _, server: _server, client, echo } = blockable(url, 120);
        let (mut tx, mut rx) = client.route_chat_sender(());
        tx.send(RouteNote { location: None, message: "hello".into() }).unwrap();
        assert_eq!(rx.blocking_message().unwrap().unwrap().message, "hello");
        let blocker = echo.echo(echo_request("blocker", vec![1], &[("sleep-ms", "2000")]));
        probe.wait_entered("blocker");
        let calls = fill_backlog(&echo);
        let failures = 60;
        for _ in 0..failures {
            let e = tx.send(RouteNote { location: None, message: "m".repeat(4000) }).unwrap_err();
            assert_eq!(e.code(), Code::ResourceExhausted);
        }
        eprintln!("{failures} sends failed with ResourceExhausted (nothing sent)");
        let _ = blocker.wait();
        for c in calls { let _ = c.wait(); }
        unary_ok(&client);
        // The stream is not over, and its server echoes what it reads.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..20 {
                let r = tx.send(RouteNote { location: None, message: format!("{i:04}").repeat(1000) });
                let _ = done_tx.send((i, r));
            }
            drop(tx);
        });
        let reader = std::thread::spawn(move || {
            let mut n = 0;
            while let Ok(Some(_)) = rx.blocking_message() { n += 1; }
            n
        });
        let mut sent = 0;
        while let Ok((i, r)) = done_rx.recv_timeout(Duration::from_secs(5)) {
            r.unwrap();
            sent = i + 1;
        }
        assert_eq!(sent, 20, "the stream's sends block for good after {sent}: its window was taken by the failed sends");
        let _ = reader;
    }
}

on_soft_fabrics! {
    /// Empty messages: every one arrives, and the window still bounds them.
    fn empty_messages(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let mut s = client.list_features(rect_req(&[("size", "empty"), ("after", "100000"), ("then", "end")]));
        let mut n = 0;
        while let Some(m) = s.blocking_message().unwrap() { assert_eq!(m, Feature::default()); n += 1; }
        assert_eq!(n, 100000);
        let mut s = client.list_features(rect_req(&[("size", "empty")]));
        let _ = s.blocking_message().unwrap().unwrap();
        let p0 = live.produced.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
        let p1 = live.produced.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
        let p2 = live.produced.load(Ordering::SeqCst);
        eprintln!("unread empty stream produced {} then {} more", p1 - p0, p2 - p1);
        assert_eq!(p1, p2, "an unread stream of empty messages is not bounded by the window");
    }
}

on_soft_fabrics! {
    /// Bidi with a pumped, infinite request stream; the client half-closes
    /// nothing, reads a few echoes, then drops the call: the server's
    /// stream and handler go away, and the pump stops.
    fn pumped_bidi_cancelled(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        for round in 0..20 {
            let notes = futures::stream::iter((0..).map(|i: u64| RouteNote { location: None, message: format!("{i}") }));
            let mut s = client.route_chat(notes);
            for i in 0..50 {
                let m = s.blocking_message().unwrap().unwrap();
                assert_eq!(m.message, format!("{i}"), "round {round}");
            }
            drop(s);
        }
        eventually("server streams gone", || live.streams.load(Ordering::SeqCst) == 0);
        unary_ok(&client);
    }
}

on_soft_fabrics! {
    /// Pumped client stream whose request stream stays pending past the
    /// deadline: DeadlineExceeded, and the server drops the handler.
    fn pumped_client_stream_pending_past_deadline(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(Duration::from_millis(300)));
        let points = futures::stream::iter(vec![Point::default(); 3]).chain(futures::stream::pending());
        let t = Instant::now();
        let r = client.record_route(points).wait();
        assert_eq!(r.unwrap_err().code(), Code::DeadlineExceeded);
        assert!(t.elapsed() < Duration::from_secs(2));
        eventually("handler gone", || live.handlers.load(Ordering::SeqCst) == 0);
        let ends = live.request_ends.lock().unwrap().clone();
        assert!(!ends.iter().any(|e| e.starts_with("ended")), "{ends:?}");
    }
}

on_soft_fabrics! {
    /// Bidi half-closed at once by the client while the server keeps
    /// producing: the client reads on; then drops; server stream goes.
    fn half_close_early_server_keeps_producing(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let (tx, mut rx) = client.route_chat_sender(with_meta((), &[("mode", "produce"), ("size", "3000")]));
        tx.close().unwrap();
        for _ in 0..2000 {
            rx.blocking_message().unwrap().unwrap();
        }
        drop(rx);
        eventually("server stream gone", || live.streams.load(Ordering::SeqCst) == 0);
    }
}

on_soft_fabrics! {
    /// A client stream our client drops half-way: the handler is dropped, and
    /// its request stream never ends as if the messages so far were the
    /// whole stream.
    /// (Through a gRPC face, `grpc://`, the gateway resets the HTTP/2 stream
    /// rather than end it, but hyper, serving the face, reports a reset with
    /// `CANCEL` as the body's end: not checked here.)
    fn a_dropped_client_stream_is_never_taken_as_complete(url: &str) {
        let (_server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let (mut tx, call) = client.record_route_sender(Request::new(()));
        for i in 0..3 {
            tx.send(Point { latitude: i, longitude: i }).unwrap();
        }
        eventually("the handler read them", || live.consumed.load(Ordering::SeqCst) >= 3);
        drop(call);
        drop(tx);
        eventually("the handler dropped", || live.handlers.load(Ordering::SeqCst) == 0);
        let ends = live.request_ends.lock().unwrap().clone();
        assert!(
            !ends.iter().any(|e| e.starts_with("ended")),
            "a dropped client stream was taken as complete: {ends:?}"
        );
    }
}

on_soft_fabrics! {
    /// A stream cancelled while its large message is still being read (by
    /// rendezvous): the cancel does not wait behind the read, so a stream
    /// opened in its place under the server's limit is not refused.
    fn a_cancel_behind_a_large_message_frees_its_place_at_once(url: &str) {
        let (_server, client) = start_with_one_stream(url);
        for round in 0..10 {
            let (mut tx, rx) = client.route_chat_sender(Request::new(()));
            tx.send(RouteNote { location: None, message: "x".repeat(8 << 20) }).unwrap();
            drop((tx, rx));
            let (mut tx, mut rx) = client.route_chat_sender(Request::new(()));
            tx.send(RouteNote { location: None, message: format!("{round}") }).unwrap();
            let echoed = rx
                .blocking_message()
                .unwrap_or_else(|e| panic!("round {round}: {e}"))
                .expect("an echo");
            assert_eq!(echoed.message, format!("{round}"));
        }
        unary_ok(&client);
    }
}

on_soft_fabrics! {
    /// A stream waiting for room under the server's limit, on a call that
    /// does not wait for ready: when the connection goes, it fails
    /// `Unavailable` at once rather than wait for another connection.
    fn a_stream_waiting_for_room_fails_when_its_connection_goes(url: &str) {
        let (server, client) = start_with_one_stream(url);
        let (_tx, mut held) = client.route_chat_sender(with_meta((), &[("mode", "silent")]));
        let waiting = client.clone();
        let second = std::thread::spawn(move || {
            let (_tx, mut rx) = waiting.route_chat_sender(Request::new(()));
            let started = Instant::now();
            (rx.blocking_message(), started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!second.is_finished(), "the second stream did not wait");
        server.shutdown_timeout(Duration::ZERO);
        let (second, waited) = second.join().unwrap();
        assert_eq!(second.unwrap_err().code(), Code::Unavailable);
        assert!(waited < LIMIT / 2, "waited {waited:?}");
        assert_eq!(held.blocking_message().unwrap_err().code(), Code::Unavailable);
    }
}

on_soft_fabrics! {
    /// A bidi stream waiting for room, its sender and its reader blocked
    /// on two threads: when a place frees, both go on.
    fn both_ends_of_a_stream_waiting_for_room_go_on(url: &str) {
        let (_server, client) = start_with_one_stream(url);
        let held = client.route_chat_sender(with_meta((), &[("mode", "silent")]));
        let (mut tx, mut rx) = client.route_chat_sender(Request::new(()));
        let sender = std::thread::spawn(move || {
            tx.send(RouteNote { location: None, message: "after".into() })
                .map(|()| tx)
        });
        let reader = std::thread::spawn(move || rx.blocking_message());
        std::thread::sleep(Duration::from_millis(100));
        assert!(!sender.is_finished() && !reader.is_finished(), "they did not wait");
        drop(held);
        let echoed = bounded("the reader", move || reader.join().unwrap());
        assert_eq!(echoed.unwrap().expect("an echo").message, "after");
        let tx = bounded("the sender", move || sender.join().unwrap());
        drop(tx.unwrap());
    }
}

on_soft_fabrics! {
    /// A bidirectional stream's initial metadata arrives as soon as its
    /// handler returned, before either side sent a message; a frame of
    /// metadata only is no message, so the stream then goes on as usual.
    fn a_bidi_streams_metadata_arrives_before_any_message(url: &str) {
        let (server, live, u) = start(url);
        let client = client_for(&u, Some(LIMIT));
        let (mut tx, mut rx) = client.route_chat_sender(with_meta((), &[("session", "chat-1")]));
        let headers = rx.blocking_initial_metadata().unwrap();
        assert_eq!(headers.get("session"), Some("chat-1"));
        assert_eq!(live.produced.load(Ordering::SeqCst), 0, "no message yet");
        for i in 0..3 {
            tx.send(RouteNote { location: None, message: format!("note {i}") }).unwrap();
            assert_eq!(rx.blocking_message().unwrap().unwrap().message, format!("note {i}"));
        }
        tx.close().unwrap();
        assert!(rx.blocking_message().unwrap().is_none());
        assert_eq!(rx.metadata().unwrap().get("session"), Some("chat-1"));

        // A handler that asks for its request stream's metadata first is
        // told at once that there is none: it answers before the client
        // sends anything.
        let (mut tx, mut rx) = client.route_chat_sender(with_meta((), &[("mode", "headers-first"), ("session", "chat-2")]));
        assert_eq!(rx.blocking_initial_metadata().unwrap().get("session"), Some("chat-2"));
        tx.send(RouteNote { location: None, message: "after".into() }).unwrap();
        assert_eq!(rx.blocking_message().unwrap().unwrap().message, "after");
        drop((tx, rx));

        // A response stream that fails at once: its metadata still comes
        // first, then its error.
        let mut failing = client.list_features(rect_req(&[
            ("session", "doomed"),
            ("after", "0"),
            ("then", "error"),
        ]));
        let headers = failing.blocking_initial_metadata().unwrap();
        assert_eq!(headers.get("session"), Some("doomed"));
        let status = failing.blocking_message().unwrap_err();
        assert_eq!(status.code(), Code::Aborted, "{status:?}");

        // A silent stream dropped after its metadata: cancelled, its
        // response stream dropped on the server.
        let (_tx, mut rx) = client.route_chat_sender(with_meta((), &[("mode", "silent")]));
        assert!(rx.blocking_initial_metadata().unwrap().is_empty());
        drop(rx);
        eventually("the silent stream dropped", || live.streams.load(Ordering::SeqCst) == 0);
        bounded("shutdown", move || server.shutdown());
    }
}

/// A silent bidi stream on `client`, once it started (its metadata came).
fn silent_stream(
    client: &RouteGuideClient,
) -> (rpc_core::RequestSender<RouteNote>, Streaming<RouteNote>) {
    let (tx, mut rx) = client.route_chat_sender(with_meta((), &[("mode", "silent")]));
    rx.blocking_initial_metadata().unwrap();
    (tx, rx)
}

on_soft_fabrics! {
    /// A stream waiting for room on a channel's only live endpoint goes as
    /// soon as another endpoint comes up, which has room.
    fn a_stream_waiting_for_room_takes_it_on_an_endpoint_that_comes_up(url: &str) {
        let later = if url.starts_with("tcp://") {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("tcp://{}", free.local_addr().unwrap())
        } else {
            format!("{url}.later")
        };
        let first = if url.starts_with("mem://") { format!("{url}.first") } else { url.to_owned() };
        let a = one_stream_server(&first);
        let channel = Channel::balance([a.local_url(), later.as_str()])
            .timeout(Duration::from_secs(20))
            .connect_lazy()
            .unwrap();
        let client = RouteGuideClient::new(channel.clone());
        eventually("the first endpoint connected", || channel.is_connected());
        let held = silent_stream(&client);
        let waiting = client.clone();
        let third = std::thread::spawn(move || silent_stream(&waiting));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!third.is_finished(), "the second stream did not wait");
        let b = one_stream_server(&later);
        let up = Instant::now();
        let second = third.join().unwrap();
        assert!(
            up.elapsed() < Duration::from_secs(10),
            "the second stream took {:?} to find the new endpoint",
            up.elapsed()
        );
        drop((held, second));
        for server in [a, b] {
            bounded("shutdown", move || server.shutdown());
        }
    }
}

on_soft_fabrics! {
    /// On a channel of several endpoints, each at its server's stream
    /// limit, a stream waiting for room goes as soon as a stream ends on
    /// any of them, whichever it found full first.
    fn a_stream_waiting_for_room_takes_it_on_any_endpoint(url: &str) {
        let servers: Vec<_> = ["a", "b"]
            .iter()
            .map(|name| {
                let url = if url.starts_with("mem://") { format!("{url}.{name}") } else { url.to_owned() };
                one_stream_server(&url)
            })
            .collect();
        let channel = Channel::balance([servers[0].local_url(), servers[1].local_url()])
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let client = RouteGuideClient::new(channel);
        // Both connections full, then each in turn frees its place.
        let mut held = vec![silent_stream(&client), silent_stream(&client)];
        for round in 0..4 {
            let waiting = client.clone();
            let third = std::thread::spawn(move || silent_stream(&waiting));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!third.is_finished(), "round {round}: the third stream did not wait");
            let freed = Instant::now();
            drop(held.remove(round % 2));
            let third = third.join().unwrap_or_else(|_| panic!("round {round}: no room found"));
            assert!(
                freed.elapsed() < Duration::from_secs(5),
                "round {round}: the third stream took {:?} to find the freed place",
                freed.elapsed()
            );
            held.insert(round % 2, third);
        }
        drop(held);
        for server in servers {
            bounded("shutdown", move || server.shutdown());
        }
    }
}
