//! Shared pieces of the integration suites: which fabrics a test runs on, a
//! test-only echo service whose handlers can sleep, block, panic or answer
//! with a chosen size, and bounded waits so that no test can hang.

#![allow(dead_code, unused_macros)]

pub mod certs;
pub mod procs;

use examples::echo::echo_server::{Echo, EchoServer};
use examples::echo::{EchoReply, EchoRequest};
use examples::kv::kv_server::KvServer;
use examples::services::KvStore;
use rpc_core::codegen::{ServiceDescriptor, prost::Message};
use rpc_core::{
    Channel, Code, Request, Response, Server, ServerBuilder, ServerCall, ServerHandle, Service,
    Status,
};
use std::collections::HashSet;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The bound on any single wait in a test: long enough never to fire on a
/// slow machine, short enough that a hang fails the test instead of the run.
pub const LIMIT: Duration = Duration::from_secs(20);

/// Where a `tcp://` server listens: loopback, a port the OS picks.
pub const TCP_ANY: &str = "tcp://127.0.0.1:0";

/// Name of the variable that sets the URL `rdma` tests serve on, e.g.
/// `rdma://10.0.0.1:0`; by default `rdma://$RXE_IP:0` (the Soft-RoCE guest's
/// address), else `rdma://127.0.0.1:0`. The `rdma` tests are ignored by a
/// plain `cargo test`; `scripts/test` runs them (`--include-ignored rdma`)
/// inside the Soft-RoCE guest, where they must pass.
pub const RDMA_URL_VAR: &str = "RPC_TEST_RDMA_URL";

/// The `rdma://` URL test servers listen on.
pub fn rdma_url() -> String {
    std::env::var(RDMA_URL_VAR).unwrap_or_else(|_| {
        let host = std::env::var("RXE_IP").unwrap_or_else(|_| "127.0.0.1".into());
        format!("rdma://{host}:0")
    })
}

/// Whether `call` has completed, polling it once without waiting.
pub fn is_done<T: Message + Default>(call: &mut rpc_core::UnaryCall<T>) -> bool {
    futures::FutureExt::now_or_never(call).is_some()
}

/// A `mem://` URL unique to the test at `path` (a module path).
pub fn mem_url(path: &str) -> String {
    format!("mem://{}", path.replace("::", "."))
}

/// Generates a module named after the test with `fn run(url)` and one
/// `#[test]` per listed fabric, each running `run` under a watchdog. The
/// `rdma` test is ignored unless asked for (see [`RDMA_URL_VAR`]). Adding a
/// fabric is one arm of `fabric_test!`.
macro_rules! fabric_tests {
    ([$($fabric:ident),*] $(#[$meta:meta])* fn $name:ident($url:ident: &str) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn run($url: &str) $body

            fabric_test!(@each [$($fabric)*] [$(#[$meta])*]);
        }
    };
}

/// One fabric's `#[test]` inside a [`fabric_tests!`] module.
macro_rules! fabric_test {
    (@each [] $attrs:tt) => {};
    (@each [$first:ident $($rest:ident)*] $attrs:tt) => {
        fabric_test!($first $attrs);
        fabric_test!(@each [$($rest)*] $attrs);
    };
    (mem [$(#[$meta:meta])*]) => {
        $(#[$meta])*
        #[test]
        fn mem() {
            let url = $crate::common::mem_url(module_path!());
            $crate::common::watchdog(move || run(&url));
        }
    };
    (tcp [$(#[$meta:meta])*]) => {
        $(#[$meta])*
        #[test]
        fn tcp() {
            $crate::common::watchdog(|| run($crate::common::TCP_ANY));
        }
    };
    (face [$(#[$meta:meta])*]) => {
        $(#[$meta])*
        #[test]
        fn face() {
            let url = format!("face+{}-face", $crate::common::mem_url(module_path!()));
            $crate::common::watchdog(move || run(&url));
        }
    };
    (rdma [$(#[$meta:meta])*]) => {
        $(#[$meta])*
        #[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
        #[test]
        fn rdma() {
            let url = $crate::common::rdma_url();
            $crate::common::watchdog(move || run(&url));
        }
    };
}

/// Runs the test body once per fabric: `mem`, `tcp` and `rdma`.
macro_rules! on_every_fabric {
    ($($t:tt)*) => { fabric_tests!([mem, tcp, rdma] $($t)*); };
}

/// Like [`on_every_fabric`], and once more through a server's gRPC face
/// (`face`: our client calls it by `grpc://`, see [`serve_for_clients`]).
#[allow(unused_macros)]
macro_rules! on_every_fabric_and_face {
    ($($t:tt)*) => { fabric_tests!([mem, tcp, rdma, face] $($t)*); };
}

/// Like [`on_every_fabric`], for fabrics that reach other processes (no `mem`).
macro_rules! on_network_fabrics {
    ($($t:tt)*) => { fabric_tests!([tcp, rdma] $($t)*); };
}

/// Like [`on_every_fabric`], for tests that drive the software fabric's
/// public API directly (`mem` and `tcp` only).
macro_rules! on_soft_fabrics {
    ($($t:tt)*) => { fabric_tests!([mem, tcp] $($t)*); };
}

/// How long a whole test may take.
pub const TEST_LIMIT: Duration = Duration::from_secs(60);

/// Runs a test body on its own thread and fails if it takes longer than
/// [`TEST_LIMIT`]; a panic in the body fails the test as usual.
pub fn watchdog(body: impl FnOnce() + Send + 'static) {
    within(TEST_LIMIT, "the test", body)
}

/// Runs `f` on a new thread and returns its result, or fails the test if it
/// has not finished within `limit`.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(what.to_owned())
        .spawn(move || {
            let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
        })
        .expect("spawn a thread");
    match rx.recv_timeout(limit) {
        Ok(Ok(value)) => {
            let _ = thread.join();
            value
        }
        Ok(Err(panic)) => resume_unwind(panic),
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Waits for a call (or anything) with the [`LIMIT`] bound.
pub fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    within(LIMIT, what, f)
}

/// A channel whose calls time out after [`LIMIT`] unless they say otherwise,
/// so a lost response fails the test instead of hanging it.
pub fn channel(url: &str) -> Channel {
    Channel::builder(url)
        .timeout(LIMIT)
        .connect()
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// `path` described as an rpc of `kind`: a method of the client's own
/// `.proto`, whatever the server serves.
#[allow(dead_code)]
pub fn described(
    path: &'static str,
    kind: rpc_core::codegen::MethodKind,
) -> &'static rpc_core::codegen::MethodDescriptor {
    Box::leak(Box::new(rpc_core::codegen::MethodDescriptor {
        name: "Described",
        path,
        id: rpc_core::codegen::method_id(path),
        kind,
    }))
}

/// A channel to a server at its connection limit, once it has room:
/// retries while connecting fails with `ResourceExhausted`, up to [`LIMIT`].
pub fn connect_when_there_is_room(url: &str) -> Channel {
    let deadline = Instant::now() + LIMIT;
    loop {
        match Channel::builder(url).timeout(LIMIT).connect() {
            Ok(c) => return c,
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("no room on {url}: {e}"),
        }
    }
}

/// Asserts that `result` failed with `code`, and returns the status.
#[track_caller]
pub fn expect_code<T: std::fmt::Debug>(result: Result<T, Status>, code: Code) -> Status {
    match result {
        Ok(v) => panic!("expected {code:?}, got a success: {v:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "unexpected status: {status}");
            status
        }
    }
}

/// Doors, by name, that handlers wait at until the test opens them. Waits
/// are bounded by [`LIMIT`]; a handler that times out answers `Aborted`,
/// which fails whatever test expected it to be released.
#[derive(Debug, Default)]
pub struct Gates {
    open: Mutex<HashSet<String>>,
    cond: Condvar,
}

impl Gates {
    /// Opens gate `name` for every waiter, now and later.
    pub fn open(&self, name: &str) {
        self.open.lock().unwrap().insert(name.to_owned());
        self.cond.notify_all();
    }

    /// Waits until gate `name` opens; false if [`LIMIT`] passed first.
    pub fn wait(&self, name: &str) -> bool {
        let open = self.open.lock().unwrap();
        let (open, _) = self
            .cond
            .wait_timeout_while(open, LIMIT, |open| !open.contains(name))
            .unwrap();
        open.contains(name)
    }
}

/// What the test service saw, shared with the test.
#[derive(Debug, Default)]
pub struct Seen {
    /// `tag` metadata of calls whose handler started, in order.
    pub entered: Vec<String>,
    /// `tag` metadata of calls fully done (handler ran and the reply was
    /// sent or failed), in order.
    pub finished: Vec<String>,
    /// `tag` metadata of calls whose handler's future was dropped before
    /// it finished (`await-forever`), in order.
    pub dropped: Vec<String>,
}

/// The test's view into the test service: a gate for blocking handlers and
/// a record of what ran, with bounded waits on it.
#[derive(Debug, Default)]
pub struct Probe {
    gates: Gates,
    seen: Mutex<Seen>,
    changed: Condvar,
}

impl Probe {
    /// A new probe, shared.
    pub fn new() -> Arc<Probe> {
        Arc::new(Probe::default())
    }

    fn update(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.seen.lock().unwrap());
        self.changed.notify_all();
    }

    /// Releases the handlers waiting at gate `name` (see [`TestEcho`]).
    pub fn open_gate(&self, name: &str) {
        self.gates.open(name);
    }

    /// Whether gate `name` opened within [`LIMIT`], awaited without
    /// blocking the task's thread (a thread waits for it).
    pub async fn gate_opened(self: Arc<Probe>, name: String) -> bool {
        let (tx, rx) = futures::channel::oneshot::channel();
        std::thread::spawn(move || {
            let _ = tx.send(self.gates.wait(&name));
        });
        rx.await.unwrap_or(false)
    }

    /// A snapshot of what was seen so far.
    pub fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }

    /// Waits until `done` holds, failing the test after [`LIMIT`].
    #[track_caller]
    pub fn wait_for(&self, what: &str, done: impl Fn(&Seen) -> bool) {
        let seen = self.seen.lock().unwrap();
        let (seen, timeout) = self
            .changed
            .wait_timeout_while(seen, LIMIT, |s| !done(s))
            .unwrap();
        let snapshot = format!("{:?}", *seen);
        // Fail without holding the lock: the handlers still need it.
        drop(seen);
        assert!(
            !timeout.timed_out(),
            "timed out waiting for {what}; seen {snapshot}"
        );
    }

    /// Waits until the handler of the call tagged `tag` has started.
    #[track_caller]
    pub fn wait_entered(&self, tag: &str) {
        self.wait_for(&format!("handler {tag:?} to start"), |s| {
            s.entered.iter().any(|t| t == tag)
        });
    }

    /// Waits until the call tagged `tag` is done, reply included.
    #[track_caller]
    pub fn wait_finished(&self, tag: &str) {
        self.wait_for(&format!("call {tag:?} to finish"), |s| {
            s.finished.iter().any(|t| t == tag)
        });
    }
}

/// An `echo.Echo` implementation for fault tests, steered by request
/// metadata:
///
/// - `tag`: recorded in [`Seen`] (and echoed like all metadata);
/// - `block`: wait until the test opens the gate named by the value;
/// - `sleep-ms`: sleep that long before answering;
/// - `panic`: panic with the value as message;
/// - `yield-log`: park once (the handler resumes when woken), then log an
///   event with the value as message;
/// - `reply-len`: answer a payload of that many bytes and no metadata,
///   instead of the echo;
/// - `report-deadline`: add `deadline-left-ms` to the echoed metadata,
///   what is left of the call's deadline (-1: none);
/// - `fail-with`: fail `FailedPrecondition`, the value as the status's
///   `detail` metadata (gRPC's trailers) and, after `details: `, as its
///   binary details;
/// - `fail-with-len`: the same, with a `detail` of that many bytes;
/// - `who`: answer the caller's fabric and address as the server saw them
///   (`peer-fabric`, `peer-addr`);
/// - `await-forever`: wait for ever, recording the tag in
///   [`Seen::dropped`] if the handler's future is dropped; with `check`,
///   asks `request.is_cancelled()` first, with `race`, makes (and drops)
///   a `request.cancelled()` future first, as a handler whose work won a
///   `select!` against it does;
///
/// `Stream` calls with `trailer` send its value as the trailing metadata
/// `x-trailer` at the stream's end, with `session` its value as the
/// initial metadata `session`, and with `hold` send no message until the
/// gate it names opens.
/// Without any of these it echoes payload and metadata, like
/// [`examples::services::EchoService`].
#[derive(Debug, Clone)]
pub struct TestEcho {
    probe: Arc<Probe>,
}

impl Echo for TestEcho {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let md = request.metadata();
        let tag = md.get("tag").unwrap_or_default().to_owned();
        // Asked before the handler is seen to start: a test that cancels
        // the call once it has cannot cancel it before this.
        let cancelled_at_start = md.get("await-forever") == Some("check") && request.is_cancelled();
        self.probe.update(|s| s.entered.push(tag.clone()));
        if let Some(gate) = md.get("block") {
            if !self.probe.gates.wait(gate) {
                return Err(Status::aborted(format!(
                    "{tag}: gate {gate:?} never opened"
                )));
            }
        }
        if let Some(ms) = md.get("sleep-ms") {
            std::thread::sleep(Duration::from_millis(ms.parse().expect("sleep-ms")));
        }
        let detail = match md.get("fail-with-len") {
            Some(len) => Some("d".repeat(len.parse().expect("fail-with-len"))),
            None => md.get("fail-with").map(str::to_owned),
        };
        if let Some(detail) = detail {
            let mut metadata = rpc_core::Metadata::new();
            metadata.insert("detail", &detail).unwrap();
            let details = format!("details: {detail}").into_bytes();
            return Err(Status::with_details(
                rpc_core::Code::FailedPrecondition,
                "as asked",
                details,
            )
            .with_metadata(metadata));
        }
        if let Some(message) = md.get("panic") {
            panic!("{message}");
        }
        if let Some(first) = md.get("await-forever") {
            match first {
                "check" => assert!(!cancelled_at_start),
                "race" => drop(request.cancelled()),
                _ => {}
            }
            struct Dropped(Arc<Probe>, String);
            impl Drop for Dropped {
                fn drop(&mut self) {
                    let tag = std::mem::take(&mut self.1);
                    self.0.update(|s| s.dropped.push(tag));
                }
            }
            let _dropped = Dropped(self.probe.clone(), tag.clone());
            std::future::pending::<()>().await;
        }
        if let Some(message) = md.get("yield-log") {
            let message = message.to_owned();
            yield_once().await;
            tracing::info!("{message}");
        }
        if md.get("who").is_some() {
            // Who called, as the server saw it.
            let peer = request
                .peer()
                .expect("a server-side request knows its peer");
            let mut reply = rpc_core::Metadata::new();
            reply.insert("peer-fabric", peer.fabric).unwrap();
            reply.insert("peer-addr", &peer.addr).unwrap();
            if let Some(identity) = &peer.identity {
                reply.insert("peer-identity", identity).unwrap();
            }
            return Ok(Response::from_parts(
                reply,
                EchoReply {
                    payload: Vec::new().into(),
                },
            ));
        }
        if let Some(len) = md.get("reply-len") {
            let len: usize = len.parse().expect("reply-len");
            return Ok(Response::new(EchoReply {
                payload: pattern(len, 7).into(),
            }));
        }
        let mut metadata = md.clone();
        if md.get("report-deadline").is_some() {
            // What is left of the call's deadline, as the handler sees it.
            let left = request.deadline().map_or(-1, |d| {
                d.saturating_duration_since(Instant::now()).as_millis() as i64
            });
            metadata
                .insert("deadline-left-ms", left.to_string())
                .unwrap();
        }
        let payload = request.into_inner().payload;
        Ok(Response::from_parts(metadata, EchoReply { payload }))
    }

    type StreamStream = rpc_core::BoxStream<EchoReply>;

    /// Streams like [`examples::services::EchoService`].
    async fn stream(
        &self,
        request: Request<examples::echo::StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        use futures::StreamExt;
        let md = request.metadata();
        let trailer = md.get("trailer").map(str::to_owned);
        let session = md.get("session").map(str::to_owned);
        let hold = md.get("hold").map(str::to_owned);
        let mut response = examples::services::EchoService.stream(request).await?;
        if let Some(value) = session {
            response.metadata_mut().insert("session", value).unwrap();
        }
        if let Some(value) = trailer {
            let trailers = rpc_core::Trailers::new();
            trailers.insert("x-trailer", value).unwrap();
            response = response.with_trailers(trailers);
        }
        let probe = self.probe.clone();
        Ok(response.map(|replies| match hold {
            None => replies.boxed(),
            Some(gate) => futures::stream::once(probe.gate_opened(gate.clone()))
                .flat_map(move |open| match open {
                    true => replies.clone().left_stream(),
                    false => futures::stream::iter([Err(Status::aborted(format!(
                        "gate {gate:?} never opened"
                    )))])
                    .right_stream(),
                })
                .boxed(),
        }))
    }
}

/// Wraps a service to record, in the probe, each call once it is fully
/// handled (the reply sent or its failure handled).
struct Tracked<S> {
    inner: S,
    probe: Arc<Probe>,
}

impl<S: Service> Service for Tracked<S> {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        self.inner.descriptor()
    }

    fn call(&self, call: ServerCall) {
        let tag = call.metadata().get("tag").unwrap_or_default().to_owned();
        self.inner.call(call);
        self.probe.update(|s| s.finished.push(tag));
    }
}

/// A server builder hosting [`TestEcho`] (tracked by `probe`) and a fresh
/// [`KvStore`], ready for more settings.
pub fn test_server(probe: &Arc<Probe>) -> ServerBuilder {
    test_server_with(probe, false)
}

/// [`test_server`], with the test service's handlers on the dispatchers
/// (`inline`: a handler that blocks then holds up its dispatcher, as a
/// misbehaving handler would) or on the blocking pool.
pub fn test_server_with(probe: &Arc<Probe>, inline: bool) -> ServerBuilder {
    let echo = Tracked {
        inner: EchoServer::new(TestEcho {
            probe: probe.clone(),
        }),
        probe: probe.clone(),
    };
    let builder = Server::builder();
    let builder = if inline {
        builder.add_service(echo)
    } else {
        builder.add_blocking_service(echo)
    };
    builder.add_service(KvServer::new(KvStore::new()))
}

/// Sends the library's warnings and errors to the test's captured output,
/// shown when a test fails (`RUST_LOG` overrides the level).
pub fn capture_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "rpc_core=warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Serves `builder` on `url`, failing the test if it cannot.
pub fn serve(builder: ServerBuilder, url: &str) -> ServerHandle {
    capture_logs();
    builder
        .serve(url)
        .unwrap_or_else(|e| panic!("serve on {url}: {e}"))
}

/// A server of `builder` on `url`, and the URL its clients call: its own;
/// or for a `face+` URL (the `face` of [`on_every_fabric_and_face`]), its
/// gRPC face's, by `grpc://`, the server itself on the rest of the URL.
#[allow(dead_code)]
pub fn serve_for_clients(builder: ServerBuilder, url: &str) -> (ServerHandle, String) {
    match url.strip_prefix("face+") {
        Some(own) => {
            let server = serve(builder.grpc("127.0.0.1:0"), own);
            let face = server.grpc_addr().expect("the gRPC face is up");
            (server, format!("grpc://{face}"))
        }
        None => {
            let server = serve(builder, url);
            let at = server.local_url().to_owned();
            (server, at)
        }
    }
}

/// A request to echo `payload`, tagged `tag`, with more metadata.
pub fn echo_request(
    tag: &str,
    payload: Vec<u8>,
    metadata: &[(&str, &str)],
) -> Request<EchoRequest> {
    let mut request = Request::new(EchoRequest {
        payload: payload.into(),
    });
    request.metadata_mut().insert("tag", tag).unwrap();
    for (k, v) in metadata {
        request.metadata_mut().insert(k, *v).unwrap();
    }
    request
}

/// Deterministic bytes of length `len`, different for each `seed`.
///
/// A block of 4,093 xorshift bytes (a prime length, so that no block edge
/// falls on a frame's, a ring's or a chunk's power-of-two boundary)
/// repeated, each copy stamped with its index: a byte changed, lost,
/// doubled or moved anywhere shows. Built by copies rather than byte by
/// byte, as the tests' unoptimised build would make hundreds of MiB of
/// payload take minutes under the Soft-RoCE guest's emulated CPU.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    const BLOCK: usize = 4093;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut block = [0u8; BLOCK];
    for b in block.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut out = Vec::with_capacity(len);
    let mut index = 0u64;
    while out.len() < len {
        let start = out.len();
        let take = BLOCK.min(len - start);
        out.extend_from_slice(&block[..take]);
        let stamp = (index ^ seed.rotate_left(32)).to_le_bytes();
        let n = stamp.len().min(take);
        out[start..start + n].copy_from_slice(&stamp[..n]);
        index += 1;
    }
    out
}

/// Bytes an [`EchoRequest`] or [`EchoReply`] with a payload of `len` bytes
/// takes in protobuf: the field tag and length prefix, then the bytes.
pub fn echo_encoded_len(len: usize) -> usize {
    EchoRequest {
        payload: vec![0; len].into(),
    }
    .encoded_len()
}

/// Bytes metadata entries take on the wire: per entry a key length byte,
/// the key, a 4-byte value length and the value.
pub fn metadata_len(entries: &[(&str, &str)]) -> usize {
    entries.iter().map(|(k, v)| 1 + k.len() + 4 + v.len()).sum()
}

/// Polls `check` until it holds or [`LIMIT`] passes (for state that has no
/// notification to wait on, such as a counter in the library).
#[track_caller]
pub fn eventually(what: &str, check: impl Fn() -> bool) {
    eventually_within(LIMIT, what, check)
}

/// [`eventually`] with its own time limit, for waits that can take longer
/// (a transfer of hundreds of megabytes in the emulated guest).
#[track_caller]
pub fn eventually_within(limit: Duration, what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Resident set size of this process, bytes.
pub fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

/// A hand-written tcp:// server on a free port of 127.0.0.1: its URL, and
/// the thread that accepts one client, reads its hello, answers with
/// [`tcp_hello`]`(ring_len, max_message)`, then runs `then` on the socket.
#[allow(dead_code)]
pub fn fake_tcp_server(
    ring_len: u64,
    max_message: u32,
    then: impl FnOnce(std::net::TcpStream) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0; rpc_core::testing::bootstrap::HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&tcp_hello(ring_len, max_message).encode())
            .unwrap();
        then(s);
    });
    (url, server)
}

/// A valid tcp:// hello for a hand-written peer with a ring of `ring_len`
/// bytes, accepting messages up to `max_message`.
pub fn tcp_hello(ring_len: u64, max_message: u32) -> rpc_core::testing::bootstrap::Hello {
    use rpc_core::testing::bootstrap::{Hello, HelloFabric};
    Hello {
        fabric: HelloFabric::Tcp,
        qp_num: 1,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 0,
        ring: rpc_core::fabric::PeerRing {
            addr: 0x1000,
            len: ring_len,
            rkey: 1,
            max_message,
            max_streams: 0,
        },
    }
}

/// Lets this process open `n` descriptors, if its hard limit allows.
pub fn allow_descriptors(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < n {
            lim.rlim_cur = n.min(lim.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// A future that is pending once (waking its task at once), then ready:
/// a handler that awaits it parks and resumes.
pub async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}
