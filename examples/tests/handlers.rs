//! The handler model: handlers run on the dispatcher that received their
//! call; an awaiting handler parks and lets the dispatcher serve others;
//! tokio timers, tasks and channels work in handlers of a server started in
//! (or given) a tokio runtime; blocking work goes to the blocking pool, by
//! service, by method or with `rpc_core::blocking`, and never holds up other
//! calls. Every server here has a single dispatcher, so "other calls were
//! served meanwhile" means that dispatcher was free.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::{Echo, EchoServer};
use examples::echo::{EchoReply, EchoRequest};
use examples::kv::kv_client::KvClient;
use examples::kv::kv_server::KvServer;
use examples::kv::{GetRequest, PutRequest};
use examples::services::KvStore;
use rpc_core::{Channel, Code, Request, Response, Server, ServerBuilder, Status, UnaryCall};
use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

/// Gates that handlers await (parking their task, not blocking a thread).
#[derive(Default)]
struct AsyncGates {
    state: Mutex<GateState>,
}

/// Open gates, and the tasks waiting at closed ones.
#[derive(Default)]
struct GateState {
    open: HashSet<String>,
    waiting: HashMap<String, Vec<Waker>>,
}

impl AsyncGates {
    fn open(&self, name: &str) {
        let mut st = self.state.lock().unwrap();
        st.open.insert(name.to_owned());
        for waker in st.waiting.remove(name).unwrap_or_default() {
            waker.wake();
        }
    }

    async fn wait(&self, name: &str) {
        poll_fn(|cx| {
            let mut st = self.state.lock().unwrap();
            if st.open.contains(name) {
                return Poll::Ready(());
            }
            st.waiting
                .entry(name.to_owned())
                .or_default()
                .push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// An `echo.Echo` steered by request metadata:
///
/// - `await`: awaits the async gate of that name;
/// - `tokio-sleep-ms`: sleeps that long on a tokio timer;
/// - `tokio-task`: awaits a tokio task's answer over a tokio oneshot channel;
/// - `block-thread`: blocks its thread at the (thread) gate of that name;
/// - `offload`: waits at that thread gate inside `rpc_core::blocking`.
///
/// Replies echo the payload, with metadata `entered` (the thread the handler
/// started on) and `ran` (where the work ran, for `offload` and `tokio-task`).
#[derive(Clone, Default)]
struct Steered {
    gates: Arc<AsyncGates>,
    thread_gates: Arc<Gates>,
    entered: Arc<Mutex<Vec<String>>>,
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("?").to_owned()
}

impl Echo for Steered {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let md = request.metadata().clone();
        let tag = md.get("tag").unwrap_or_default().to_owned();
        let entered = thread_name();
        self.entered.lock().unwrap().push(tag);
        let mut ran = entered.clone();
        if let Some(gate) = md.get("await") {
            self.gates.wait(gate).await;
        }
        if let Some(ms) = md.get("tokio-sleep-ms") {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        }
        if md.get("tokio-task").is_some() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let _ = tx.send(thread_name());
            });
            ran = rx
                .await
                .map_err(|_| Status::internal("the tokio task went away"))?;
        }
        if let Some(gate) = md.get("block-thread") {
            if !self.thread_gates.wait(gate) {
                return Err(Status::aborted("gate never opened"));
            }
        }
        if let Some(gate) = md.get("offload") {
            let (gates, gate) = (self.thread_gates.clone(), gate.to_owned());
            ran = rpc_core::blocking(move || {
                gates.wait(&gate);
                thread_name()
            })
            .await;
        }
        let mut reply = Response::new(EchoReply {
            payload: request.into_inner().payload,
        });
        reply
            .metadata_mut()
            .insert("entered", entered.as_str())
            .unwrap();
        reply.metadata_mut().insert("ran", ran.as_str()).unwrap();
        Ok(reply)
    }

    type StreamStream = examples::services::Replies;

    /// Streams like [`examples::services::EchoService`].
    async fn stream(
        &self,
        request: Request<examples::echo::StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        examples::services::EchoService.stream(request).await
    }
}

impl Steered {
    fn wait_entered(&self, tag: &str) {
        eventually(&format!("handler {tag:?} to start"), || {
            self.entered.lock().unwrap().iter().any(|t| t == tag)
        });
    }
}

/// A call of `echo` with `payload` and metadata `md`.
fn call(client: &EchoClient, payload: &[u8], md: &[(&str, &str)]) -> UnaryCall<EchoReply> {
    let mut request = Request::new(EchoRequest {
        payload: payload.to_vec().into(),
    });
    for (k, v) in md {
        request.metadata_mut().insert(k, *v).unwrap();
    }
    client.echo(request)
}

/// A server with one dispatcher; `build` adds services.
fn one_dispatcher(
    url: &str,
    build: impl FnOnce(ServerBuilder) -> ServerBuilder,
) -> rpc_core::ServerHandle {
    serve(build(Server::builder().dispatchers(1)), url)
}

/// `n` plain echo calls, all answered with their own payload.
fn others_are_served(client: &EchoClient, n: u32) {
    for i in 0..n {
        let payload = i.to_le_bytes();
        let reply = call(client, &payload, &[]).wait().unwrap();
        assert_eq!(reply.get_ref().payload, payload[..]);
    }
}

on_every_fabric! {
    fn an_awaiting_handler_parks_and_the_dispatcher_serves_others(url: &str) {
        let service = Steered::default();
        let server = one_dispatcher(url, |b| b.add_service(EchoServer::new(service.clone())));
        let client = EchoClient::new(channel(server.local_url()));
        let mut parked: Vec<Option<UnaryCall<EchoReply>>> = (0..3)
            .map(|i| {
                let (tag, gate) = (format!("p{i}"), format!("g{i}"));
                Some(call(&client, tag.as_bytes(), &[("tag", &tag), ("await", &gate)]))
            })
            .collect();
        for i in 0..3 {
            service.wait_entered(&format!("p{i}"));
        }
        // Three handlers parked on one dispatcher: it still serves others.
        others_are_served(&client, 50);
        assert!(
            !parked.iter_mut().flatten().any(is_done),
            "no gate was opened yet"
        );
        // Woken out of order, each resumes on its dispatcher and answers
        // its own call; the others stay parked.
        for i in [2, 0, 1] {
            service.gates.open(&format!("g{i}"));
            let reply = parked[i].take().unwrap().wait().unwrap();
            assert_eq!(reply.get_ref().payload, format!("p{i}").as_bytes());
            assert_eq!(reply.metadata().get("entered"), Some("rpc-dispatch-0"));
            for rest in parked.iter_mut().flatten() {
                assert!(!is_done(rest), "a call whose gate is closed finished");
            }
        }
        server.shutdown();
    }
}

on_every_fabric! {
    fn handlers_use_tokio_timers_tasks_and_channels(url: &str) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Started inside the runtime: its dispatchers enter it.
        let service = Steered::default();
        let url = url.to_owned();
        let server = rt.block_on(async {
            Server::builder()
                .dispatchers(1)
                .add_service(EchoServer::new(service.clone()))
                .serve(&url)
                .unwrap()
        });
        let client = EchoClient::new(channel(server.local_url()));
        // A handler asleep on a tokio timer holds up nobody.
        let mut asleep = call(&client, b"asleep", &[("tag", "sleep"), ("tokio-sleep-ms", "3000")]);
        service.wait_entered("sleep");
        others_are_served(&client, 20);
        // A tokio task answers a handler over a tokio channel.
        let reply = call(&client, b"task", &[("tokio-task", "")]).wait().unwrap();
        assert_eq!(reply.get_ref().payload, &b"task"[..]);
        assert_ne!(reply.metadata().get("ran"), reply.metadata().get("entered"));
        assert!(!is_done(&mut asleep), "the 3 s sleep ended early");
        let reply = asleep.wait().unwrap();
        assert_eq!(reply.get_ref().payload, &b"asleep"[..]);
        server.shutdown();

        // Given a handle instead, from outside the runtime.
        let server = Server::builder()
            .dispatchers(1)
            .tokio_handle(rt.handle().clone())
            .add_service(EchoServer::new(Steered::default()))
            .serve(&url)
            .unwrap();
        let client = EchoClient::new(channel(server.local_url()));
        let reply = call(&client, b"t", &[("tokio-sleep-ms", "20"), ("tokio-task", "")])
            .wait()
            .unwrap();
        assert_eq!(reply.get_ref().payload, &b"t"[..]);
        server.shutdown();

        // Blocking handlers, on the pool's threads, are in the runtime too,
        // whichever way the server was given it.
        for given in [false, true] {
            let build = || {
                Server::builder()
                    .dispatchers(1)
                    .add_service(EchoServer::new(Steered::default()))
                    .blocking_method("/echo.Echo/Echo")
            };
            let server = if given {
                build().tokio_handle(rt.handle().clone()).serve(&url).unwrap()
            } else {
                rt.block_on(async { build().serve(&url).unwrap() })
            };
            let client = EchoClient::new(channel(server.local_url()));
            let reply = call(&client, b"b", &[("tokio-sleep-ms", "5"), ("tokio-task", "")])
                .wait()
                .unwrap();
            assert_eq!(reply.get_ref().payload, &b"b"[..]);
            let entered = reply.metadata().get("entered").unwrap_or_default();
            assert!(entered.starts_with("rpc-blocking"), "ran on {entered}");
            server.shutdown();
        }
    }
}

on_soft_fabrics! {
    fn tokio_in_a_handler_without_a_runtime_fails_that_call_only(url: &str) {
        // Not started in a runtime and given none: tokio's timer has no
        // reactor and panics; the call fails with Internal, the server lives.
        let server = one_dispatcher(url, |b| b.add_service(EchoServer::new(Steered::default())));
        let client = EchoClient::new(channel(server.local_url()));
        let status = call(&client, b"x", &[("tokio-sleep-ms", "1")]).wait().unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        others_are_served(&client, 5);
        server.shutdown();
    }
}

/// A blocked handler (`block-thread`) of the echo service runs on the
/// blocking pool: the server's one dispatcher serves kv calls meanwhile.
fn blocked_handler_holds_up_nobody(url: &str, server: &rpc_core::ServerHandle, service: &Steered) {
    let channel: Channel = channel(server.local_url());
    let client = EchoClient::new(channel.clone());
    let kv = KvClient::new(channel);
    let mut blocked: Vec<_> = (0..2)
        .map(|i| {
            call(
                &client,
                b"blocked",
                &[("tag", &format!("b{i}")), ("block-thread", "open")],
            )
        })
        .collect();
    service.wait_entered("b0");
    service.wait_entered("b1");
    for i in 0..20 {
        let key = format!("k{i}");
        kv.put(Request::new(PutRequest {
            key: key.clone(),
            value: vec![i as u8].into(),
        }))
        .wait()
        .unwrap();
        let got = kv.get(Request::new(GetRequest { key })).wait().unwrap();
        assert_eq!(
            got.get_ref().value,
            Some(rpc_core::Bytes::from(vec![i as u8])),
            "{url}"
        );
    }
    assert!(!blocked.iter_mut().any(is_done));
    service.thread_gates.open("open");
    for c in blocked {
        let reply = c.wait().unwrap();
        assert_eq!(reply.get_ref().payload, &b"blocked"[..]);
        let entered = reply.metadata().get("entered").unwrap_or_default();
        assert!(
            entered.starts_with("rpc-blocking"),
            "{url}: ran on {entered}"
        );
    }
}

on_every_fabric! {
    fn blocking_services_and_methods_run_on_the_pool(url: &str) {
        // A whole service.
        let service = Steered::default();
        let server = one_dispatcher(url, |b| {
            b.blocking_threads(2)
                .add_blocking_service(EchoServer::new(service.clone()))
                .add_service(KvServer::new(KvStore::new()))
        });
        blocked_handler_holds_up_nobody(url, &server, &service);
        server.shutdown();

        // One method.
        let service = Steered::default();
        let server = one_dispatcher(url, |b| {
            b.blocking_threads(2)
                .add_service(EchoServer::new(service.clone()))
                .add_service(KvServer::new(KvStore::new()))
                .blocking_method("/echo.Echo/Echo")
        });
        blocked_handler_holds_up_nobody(url, &server, &service);
        server.shutdown();

        // A method no service has is a configuration error, said at once.
        let err = Server::builder()
            .add_service(EchoServer::new(Steered::default()))
            .blocking_method("/echo.Echo/Ech")
            .serve(url)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        assert!(err.message().contains("/echo.Echo/Ech"), "{err}");
    }
}

on_every_fabric! {
    fn rpc_core_blocking_moves_work_off_the_dispatcher(url: &str) {
        let service = Steered::default();
        let server = one_dispatcher(url, |b| b.add_service(EchoServer::new(service.clone())));
        let client = EchoClient::new(channel(server.local_url()));
        let mut offloaded: Vec<_> = (0..3)
            .map(|i| call(&client, b"offloaded", &[("tag", &format!("o{i}")), ("offload", "go")]))
            .collect();
        for i in 0..3 {
            service.wait_entered(&format!("o{i}"));
        }
        others_are_served(&client, 20);
        assert!(!offloaded.iter_mut().any(is_done));
        service.thread_gates.open("go");
        for c in offloaded {
            let reply = c.wait().unwrap();
            assert_eq!(reply.get_ref().payload, &b"offloaded"[..]);
            // Started on the dispatcher, the blocking part ran on the pool.
            assert_eq!(reply.metadata().get("entered"), Some("rpc-dispatch-0"));
            let ran = reply.metadata().get("ran").unwrap_or_default();
            assert!(ran.starts_with("rpc-blocking"), "ran on {ran}");
        }
        server.shutdown();
    }
}

on_every_fabric! {
    fn slow_calls_of_one_connection_do_not_starve_another(url: &str) {
        // Two pool threads and 40 calls of a 200 ms blocking handler from
        // one connection: queued first come, first served, a call from
        // another connection would wait 4 s. The pool takes connections in
        // turn, so it waits for one running call at most.
        let probe = Probe::new();
        let server = serve(test_server(&probe).blocking_threads(2), url);
        let u = server.local_url();
        let slow = EchoClient::new(channel(u));
        let slow_calls: Vec<_> = (0..40)
            .map(|i| slow.echo(echo_request(&format!("slow-{i}"), vec![], &[("sleep-ms", "200")])))
            .collect();
        probe.wait_entered("slow-0");
        probe.wait_entered("slow-1");
        let other = channel(u);
        let started = std::time::Instant::now();
        let reply = EchoClient::new(other.clone())
            .echo(echo_request("fast", vec![7], &[]))
            .wait()
            .unwrap();
        let took = started.elapsed();
        assert_eq!(reply.into_inner().payload, vec![7]);
        assert!(took < Duration::from_secs(1), "a fast call waited {took:?} behind another connection's slow ones");
        // A method that runs on the dispatcher is not held up at all.
        let started = std::time::Instant::now();
        KvClient::new(other).get(GetRequest { key: "k".into() }).wait().unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(500), "a dispatcher call waited {took:?}");
        for call in slow_calls {
            call.wait().unwrap();
        }
    }
}

/// An `echo.Echo` whose replies' payloads, when dropped (as the server
/// tears the call down after sending its answer), wait up to 2 s for the
/// client to say it has the answer, and note whether it did.
#[derive(Clone, Default)]
struct Teardown {
    answered: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<bool>>>,
}

/// A reply payload that reports its drop to [`Teardown`].
struct Watched {
    bytes: Vec<u8>,
    answered: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl AsRef<[u8]> for Watched {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let until = std::time::Instant::now() + Duration::from_secs(2);
        let answered = loop {
            if self.answered.load(Ordering::Acquire) {
                break true;
            }
            if std::time::Instant::now() >= until {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.seen.lock().unwrap().push(answered);
    }
}

impl Echo for Teardown {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let watched = Watched {
            bytes: request.into_inner().payload.to_vec(),
            answered: self.answered.clone(),
            seen: self.seen.clone(),
        };
        Ok(Response::new(EchoReply {
            payload: prost::bytes::Bytes::from_owner(watched),
        }))
    }

    type StreamStream = examples::services::Replies;

    async fn stream(
        &self,
        request: Request<examples::echo::StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        examples::services::EchoService.stream(request).await
    }
}

on_every_fabric! {
    fn an_inline_handlers_answer_leaves_before_its_call_is_torn_down(url: &str) {
        // One call at a time: its request is the last frame of the
        // dispatcher's turn, so nothing can join the answer's write, and
        // the answer is posted as soon as it is staged, before the call's
        // state is dropped (and the rest of the turn runs). The reply's
        // payload is dropped in that teardown; it waits for the client.
        let service = Teardown::default();
        let server = one_dispatcher(url, |b| b.add_service(EchoServer::new(service.clone())));
        let client = EchoClient::new(channel(server.local_url()));
        for i in 0..3u8 {
            service.answered.store(false, Ordering::Release);
            let reply = call(&client, &[i; 16], &[]).wait().unwrap();
            assert_eq!(reply.get_ref().payload, [i; 16][..]);
            service.answered.store(true, Ordering::Release);
            eventually("the reply's payload to be dropped", || {
                service.seen.lock().unwrap().len() == usize::from(i) + 1
            });
        }
        assert_eq!(
            *service.seen.lock().unwrap(),
            [true; 3],
            "the client had each answer before the server dropped the call"
        );
    }
}
