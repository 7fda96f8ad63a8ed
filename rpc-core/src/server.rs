//! The server side: [`Server`], [`Service`], [`ServerCall`] and [`ServerHandle`].

use crate::blocking::BlockingPool;
use crate::dispatch::encode_exact;
use crate::dispatch::{Config, Conn, Endpoint, Frame, OutFrame, Role, least_loaded};
use crate::executor::{self, Executor, panic_message};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Fabric, FabricUrl, Listener, LocalSetup, Scheme};
use crate::idmap::IdMap;
use crate::protocol::{CallId, FrameKind};
use crate::{Metadata, Request, Response, Status};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use crate::descriptor::{MethodDescriptor, ServiceDescriptor};

/// A service a [`Server`] can host. Generated `FooServer<T>` wrappers
/// implement it; it can be implemented by hand too.
pub trait Service: Send + Sync + 'static {
    /// The service's name and methods.
    fn descriptor(&self) -> &'static ServiceDescriptor;
    /// Handles one call to one of this service's methods. The call must be
    /// answered (through [`ServerCall::unary`] or [`ServerCall::unimplemented`]);
    /// a call dropped unanswered is answered `Internal`.
    fn call(&self, call: ServerCall);
}

/// Sends replies on a connection, whatever its fabric.
trait ReplySink: Send + Sync {
    fn send(&self, frame: &OutFrame<'_>, fill: &mut dyn FnMut(&mut [u8])) -> Result<(), Status>;
    fn peer(&self) -> &str;
    /// Takes back the buffer a request arrived in, once decoded.
    fn recycle(&self, buf: Vec<u8>);
}

impl<F: Fabric> ReplySink for Conn<F> {
    fn send(&self, frame: &OutFrame<'_>, fill: &mut dyn FnMut(&mut [u8])) -> Result<(), Status> {
        Conn::send(self, frame, false, fill).map_err(Status::from)
    }
    fn peer(&self) -> &str {
        &self.peer_addr
    }
    fn recycle(&self, buf: Vec<u8>) {
        Conn::recycle(self, buf)
    }
}

/// One incoming call, to be answered exactly once.
pub struct ServerCall {
    method_id: u32,
    call_id: CallId,
    metadata: Metadata,
    payload: Vec<u8>,
    deadline: Option<Instant>,
    sink: Option<Arc<dyn ReplySink>>,
    inflight: Arc<AtomicUsize>,
}

impl fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerCall")
            .field("method_id", &format_args!("{:#010x}", self.method_id))
            .field("call_id", &self.call_id.0)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

impl ServerCall {
    /// The method id the caller asked for.
    pub fn method_id(&self) -> u32 {
        self.method_id
    }

    /// The caller's metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Checks the deadline and decodes the request as `Req`; answers the
    /// call itself (`DeadlineExceeded`, `InvalidArgument`) and returns
    /// `None` when the handler must not run.
    fn take_request<Req: prost::Message + Default>(&mut self) -> Option<Request<Req>> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.answer_err(&Status::deadline_exceeded(
                "deadline passed before the handler ran",
            ));
            return None;
        }
        let decoded = Req::decode(&self.payload[..]);
        if let Some(sink) = &self.sink {
            sink.recycle(std::mem::take(&mut self.payload));
        }
        match decoded {
            Ok(message) => Some(Request::from_wire(
                message,
                std::mem::take(&mut self.metadata),
                self.deadline,
            )),
            Err(e) => {
                let what = std::any::type_name::<Req>();
                self.answer_err(&Status::invalid_argument(format!(
                    "request is not a valid {what}: {e}"
                )));
                None
            }
        }
    }

    /// Sends a handler's result.
    fn reply<Resp: prost::Message>(self, result: Result<Response<Resp>, Status>) {
        match result {
            Ok(response) => self.reply_ok(response),
            Err(status) => self.reply_err(&status),
        }
    }

    /// Answers a handler that panicked with `Internal`.
    fn reply_panic(self, panic: &(dyn std::any::Any + Send)) {
        let what = panic_message(panic);
        tracing::error!(method_id = self.method_id, panic = %what, "handler panicked");
        self.reply_err(&Status::internal(format!("handler panicked: {what}")));
    }

    /// Decodes the request as `Req`, runs the synchronous `handler` on this
    /// thread, and sends its result. A payload that is not a valid `Req` is
    /// answered `InvalidArgument` without running the handler; a handler
    /// that panics is answered `Internal`; a call whose deadline passed is
    /// answered `DeadlineExceeded` without running the handler.
    pub fn unary<Req, Resp, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message,
        F: FnOnce(Request<Req>) -> Result<Response<Resp>, Status>,
    {
        let Some(request) = self.take_request::<Req>() else {
            return;
        };
        match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(result) => self.reply(result),
            Err(panic) => self.reply_panic(&*panic),
        }
    }

    /// Like [`ServerCall::unary`], for a handler that returns a future.
    ///
    /// On a dispatcher thread the future runs to completion there: it is
    /// polled at once, and if it has to wait (a timer, another call, I/O)
    /// it parks, the dispatcher goes on with other calls, and it resumes on
    /// the same dispatcher when woken; its reply is sent from there. Off a
    /// dispatcher (the blocking pool) the thread blocks on it. A future that
    /// panics is answered `Internal`.
    pub fn unary_async<Req, Resp, Fut, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message + 'static,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
    {
        let Some(request) = self.take_request::<Req>() else {
            return;
        };
        let future = match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(future) => future,
            Err(panic) => return self.reply_panic(&*panic),
        };
        let task = async move {
            // Panics are caught here, around the handler's future, so that
            // the call is still ours to answer with the panic's message.
            let mut future = std::pin::pin!(future);
            let result = std::future::poll_fn(|cx| {
                match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
                    Ok(poll) => poll.map(Ok),
                    Err(panic) => std::task::Poll::Ready(Err(panic)),
                }
            })
            .await;
            match result {
                Ok(result) => self.reply(result),
                Err(panic) => self.reply_panic(&*panic),
            }
        };
        match Executor::current() {
            Some(exec) => exec.spawn(task),
            None => executor::block_on(task),
        }
    }

    /// Answers `Unimplemented`.
    pub fn unimplemented(self) {
        let status = Status::unimplemented(format!(
            "method id {:#010x} is not implemented by this server",
            self.method_id
        ));
        self.reply_err(&status);
    }

    fn reply_ok<Resp: prost::Message>(mut self, response: Response<Resp>) {
        let Some(sink) = self.sink.take() else { return };
        let (metadata, message) = response.into_parts();
        let frame = OutFrame {
            kind: FrameKind::Response,
            call_id: self.call_id,
            method_id: self.method_id,
            status: 0,
            timeout_us: 0,
            metadata: Some(&metadata),
            payload_len: message.encoded_len(),
        };
        if let Err(status) = sink.send(&frame, &mut |buf| encode_exact(&message, buf)) {
            // Too large for the client, or the connection is gone: say so if we still can.
            tracing::debug!(peer = sink.peer(), %status, "could not send a response");
            self.sink = Some(sink);
            self.reply_err(&status);
        }
    }

    fn reply_err(mut self, status: &Status) {
        self.answer_err(status);
    }

    /// Answers with an error status, once.
    fn answer_err(&mut self, status: &Status) {
        if let Some(sink) = self.sink.take() {
            send_error(&*sink, self.call_id, self.method_id, status);
        }
    }
}

fn send_error(sink: &dyn ReplySink, call_id: CallId, method_id: u32, status: &Status) {
    let message = status.message().as_bytes();
    // Keep error messages within any client's limits.
    let message = &message[..message.len().min(4096)];
    let frame = OutFrame {
        kind: FrameKind::Error,
        call_id,
        method_id,
        status: status.code() as u16,
        timeout_us: 0,
        metadata: None,
        payload_len: message.len(),
    };
    if let Err(e) = sink.send(&frame, &mut |buf| buf.copy_from_slice(message)) {
        tracing::debug!(peer = sink.peer(), error = %e, "could not send an error response");
    }
}

impl Drop for ServerCall {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            // A handler's future dropped after it panicked (see the executor).
            let status = match executor::take_panic_message() {
                Some(what) => Status::internal(format!("handler panicked: {what}")),
                None => Status::internal("the handler did not answer the call"),
            };
            send_error(&*sink, self.call_id, self.method_id, &status);
        }
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Entry point: `Server::builder()`.
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder with default settings.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            services: Vec::new(),
            blocking_methods: Vec::new(),
            config: Config::default(),
            dispatchers: crate::dispatch::available_cores(),
            blocking_threads: crate::dispatch::available_cores().max(4),
            #[cfg(feature = "tokio")]
            tokio: None,
        }
    }
}

/// Configures services and limits, then serves.
pub struct ServerBuilder {
    /// Services, each with whether all its methods block.
    services: Vec<(Arc<dyn Service>, bool)>,
    /// Paths (`/package.Service/Method`) of methods that block.
    blocking_methods: Vec<String>,
    config: Config,
    dispatchers: usize,
    blocking_threads: usize,
    #[cfg(feature = "tokio")]
    tokio: Option<tokio::runtime::Handle>,
}

impl fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self
            .services
            .iter()
            .map(|(s, _)| s.descriptor().name)
            .collect();
        f.debug_struct("ServerBuilder")
            .field("services", &names)
            .field("dispatchers", &self.dispatchers)
            .field("blocking_threads", &self.blocking_threads)
            .finish()
    }
}

impl ServerBuilder {
    /// Adds a service (a generated `FooServer::new(impl)`, or any [`Service`]).
    ///
    /// Its handlers run to completion on the dispatcher thread that received
    /// the request: no hand-off to another thread, the reply leaves in the
    /// same batch of posts. An `async` handler that waits (a timer, a call
    /// to another service, tokio I/O) parks and lets the dispatcher go on.
    /// A handler must therefore not *block* the thread: blocking or
    /// CPU-heavy work goes to [`ServerBuilder::add_blocking_service`],
    /// [`ServerBuilder::blocking_method`] or [`crate::blocking`].
    pub fn add_service(mut self, service: impl Service) -> Self {
        self.services.push((Arc::new(service), false));
        self
    }

    /// Adds a service whose handlers may block or run long: they run on the
    /// server's bounded blocking pool ([`ServerBuilder::blocking_threads`]),
    /// so one of them never delays other calls or connections. Each call
    /// costs a hand-off to a pool thread and back.
    pub fn add_blocking_service(mut self, service: impl Service) -> Self {
        self.services.push((Arc::new(service), true));
        self
    }

    /// Runs one method (`/package.Service/Method`) on the blocking pool, as
    /// [`ServerBuilder::add_blocking_service`] does for whole services.
    /// [`ServerBuilder::serve`] fails if no added service has that method.
    pub fn blocking_method(mut self, path: &str) -> Self {
        self.blocking_methods.push(path.to_owned());
        self
    }

    /// Dispatcher threads (default: one per CPU). Each owns a completion
    /// queue and its share of the connections, and runs their handlers.
    pub fn dispatchers(mut self, n: usize) -> Self {
        self.dispatchers = n.max(1);
        self
    }

    /// Most threads of the blocking pool (default: the number of CPUs, at
    /// least 4). Threads start when first needed.
    pub fn blocking_threads(mut self, n: usize) -> Self {
        self.blocking_threads = n.max(1);
        self
    }

    /// Receive ring per connection in bytes, a power of two (default 2 MiB).
    /// Requests up to half of it, less a 32-byte header, fit.
    pub fn ring_size(mut self, bytes: usize) -> Self {
        self.config.ring_size = bytes;
        self.config.max_message = (bytes / 2).saturating_sub(crate::protocol::HEADER_LEN);
        self
    }

    /// Largest request (metadata + payload) accepted, in bytes; at most what the ring holds.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.config.max_message = bytes;
        self
    }

    /// How long a dispatcher spins on an idle queue before it blocks, at
    /// least (default 50 µs; it spins longer while requests keep coming
    /// within a millisecond of each other).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// The tokio runtime whose timers, sockets and channels handlers may
    /// use: the dispatchers enter it. By default, the runtime `serve` is
    /// called from, if any.
    #[cfg(feature = "tokio")]
    pub fn tokio_handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.tokio = Some(handle);
        self
    }

    /// Starts serving on `url` in background threads and returns at once.
    /// `tcp://host:0` picks a free port: see [`ServerHandle::local_url`].
    pub fn serve(self, url: &str) -> Result<ServerHandle, Status> {
        self.config.validate()?;
        let routes = self.routes()?;
        let url = FabricUrl::parse(url)?;
        match url.scheme {
            Scheme::Mem | Scheme::Tcp => self.serve_on(SoftFabric::new(), &url, routes),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => self.serve_on(crate::fabric::open_verbs(&url)?, &url, routes),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(&url)? {},
        }
    }

    fn routes(&self) -> Result<IdMap<Route>, Status> {
        if self.services.is_empty() {
            return Err(Status::invalid_argument(
                "a server needs at least one service",
            ));
        }
        let mut routes: HashMap<u32, (&'static str, Route)> = HashMap::new();
        for (svc, blocking) in &self.services {
            for m in svc.descriptor().methods {
                let expected = crate::descriptor::method_id(m.path);
                if m.id != expected {
                    return Err(Status::invalid_argument(format!(
                        "{} claims id {:#010x} but its id is {expected:#010x}: regenerate the code",
                        m.path, m.id
                    )));
                }
                let route = Route {
                    service: svc.clone(),
                    blocking: *blocking || self.blocking_methods.iter().any(|p| p == m.path),
                };
                if let Some((other, _)) = routes.insert(m.id, (m.path, route)) {
                    return Err(Status::invalid_argument(format!(
                        "method id collision: {other} and {} both hash to {:#010x}; rename one",
                        m.path, m.id
                    )));
                }
            }
        }
        for path in &self.blocking_methods {
            if !routes.values().any(|(p, _)| p == path) {
                return Err(Status::invalid_argument(format!(
                    "blocking_method({path:?}): no added service has that method"
                )));
            }
        }
        Ok(routes.into_iter().map(|(id, (_, r))| (id, r)).collect())
    }

    fn serve_on<F: Fabric>(
        self,
        fabric: F,
        url: &FabricUrl,
        routes: IdMap<Route>,
    ) -> Result<ServerHandle, Status> {
        let listener = Arc::new(fabric.listen(url)?);
        let local_url = listener.local_url();
        let shared = Arc::new(ServerShared {
            routes,
            pool: BlockingPool::new("rpc-blocking", self.blocking_threads),
            draining: AtomicBool::new(false),
            inflight: Arc::new(AtomicUsize::new(0)),
        });
        let mut endpoints = Vec::with_capacity(self.dispatchers);
        for _ in 0..self.dispatchers {
            let role = ServerRole {
                shared: shared.clone(),
            };
            endpoints.push(Endpoint::new(
                fabric.clone(),
                self.config.clone(),
                role,
                true,
            )?);
        }
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Status::internal(format!("cannot spawn a thread: {e}")))
        };
        #[cfg(feature = "tokio")]
        let tokio = self
            .tokio
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        let mut dispatchers = Vec::with_capacity(endpoints.len());
        for (i, ep) in endpoints.iter().enumerate() {
            let ep = ep.clone();
            #[cfg(feature = "tokio")]
            let tokio = tokio.clone();
            dispatchers.push(spawn(
                format!("rpc-dispatch-{i}"),
                Box::new(move || {
                    #[cfg(feature = "tokio")]
                    let _entered = tokio.as_ref().map(|h| h.enter());
                    ep.run()
                }),
            )?);
        }
        let endpoints = Arc::new(endpoints);
        let acceptor = {
            let endpoints = endpoints.clone();
            let listener = listener.clone();
            let shared = shared.clone();
            spawn(
                "rpc-acceptor".into(),
                Box::new(move || accept_loop(&endpoints, &shared, listener)),
            )?
        };
        tracing::info!(url = %local_url, dispatchers = endpoints.len(), "serving");
        Ok(ServerHandle {
            local_url,
            stopper: Some(Box::new(ServerStopper {
                endpoints,
                shared,
                listener,
                acceptor: Some(acceptor),
                dispatchers,
            })),
        })
    }
}

fn accept_loop<F: Fabric>(
    endpoints: &Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    shared: &ServerShared,
    listener: Arc<F::Listener>,
) {
    loop {
        let incoming = match listener.next() {
            Ok(Some(i)) => i,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "listener failed; no longer accepting");
                return;
            }
        };
        if shared.draining.load(Ordering::Acquire) {
            continue; // dropping it refuses the connection
        }
        let ep = least_loaded(endpoints).clone();
        // Handshakes run on their own thread so a slow peer cannot stall others.
        let spawned = std::thread::Builder::new()
            .name("rpc-handshake".into())
            .spawn(move || {
                if let Err(status) = establish(&ep, incoming) {
                    tracing::warn!(%status, "connection attempt failed");
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn a handshake thread");
        }
    }
}

fn establish<F: Fabric>(ep: &Endpoint<F, ServerRole>, incoming: F::Incoming) -> Result<(), Status> {
    let ring = ep.register_ring()?;
    let local = LocalSetup {
        ring: &ring,
        max_message: ep.config.max_message as u32,
        timeout: ep.config.connect_timeout,
    };
    let connected = ep.fabric.accept(incoming, local, &ep.cq)?;
    let conn = ep.add(connected, ring, ep.config.max_message)?;
    if let Err(status) = conn.established() {
        ep.close(&conn, "handshake failed");
        return Err(status);
    }
    tracing::info!(peer = %conn.peer_addr, qp_num = conn.qp_num, "client connected");
    Ok(())
}

/// Where a method's calls go.
struct Route {
    service: Arc<dyn Service>,
    /// On the blocking pool, not the dispatcher.
    blocking: bool,
}

/// Calls a service, answering a call the service dropped after a panic.
fn call_service(service: &dyn Service, call: ServerCall) {
    let method_id = call.method_id;
    // A hand-written Service may panic outside ServerCall::unary; the call's
    // drop then answers it.
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| service.call(call))) {
        tracing::error!(method_id, panic = %panic_message(&*panic), "service panicked");
    }
}

/// What a server's dispatchers share: routes and shutdown state.
struct ServerShared {
    routes: IdMap<Route>,
    pool: BlockingPool,
    draining: AtomicBool,
    inflight: Arc<AtomicUsize>,
}

/// The server's side of one dispatcher: routes requests to handlers.
struct ServerRole {
    shared: Arc<ServerShared>,
}

impl<F: Fabric> Role<F> for ServerRole {
    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        let h = frame.header;
        match h.kind {
            FrameKind::Request => {}
            // Handlers are not interruptible; a cancelled call's late reply is
            // dropped by the client.
            FrameKind::Cancel | FrameKind::Credit => return,
            kind => {
                tracing::warn!(
                    qp_num = conn.qp_num,
                    ?kind,
                    "closing connection: client sent a server-bound frame kind"
                );
                ep.close(conn, "client sent an unexpected frame kind");
                return;
            }
        }
        let shared = &self.shared;
        shared.inflight.fetch_add(1, Ordering::AcqRel);
        let deadline =
            (h.timeout_us > 0).then(|| Instant::now() + Duration::from_micros(h.timeout_us as u64));
        let sink: Arc<dyn ReplySink> = conn.clone();
        let call = ServerCall {
            method_id: h.method_id,
            call_id: h.call_id,
            metadata: Metadata::new(),
            payload: frame.payload,
            deadline,
            sink: Some(sink),
            inflight: shared.inflight.clone(),
        };
        let Some(metadata) = frame.metadata else {
            return call.reply_err(&Status::invalid_argument("request metadata is malformed"));
        };
        let mut call = call;
        call.metadata = metadata;
        if shared.draining.load(Ordering::Acquire) {
            return call.reply_err(&Status::unavailable("server is shutting down"));
        }
        let Some(route) = shared.routes.get(&h.method_id) else {
            return call.unimplemented();
        };
        if route.blocking {
            let service = route.service.clone();
            shared
                .pool
                .execute(Box::new(move || call_service(&*service, call)));
        } else {
            call_service(&*route.service, call);
        }
    }

    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::info!(peer = %conn.peer_addr, qp_num = conn.qp_num, %why, "client disconnected");
    }

    fn on_tick(&self, _ep: &Endpoint<F, Self>, _now: Instant) -> Option<Instant> {
        None
    }
}

/// Checks `done` every millisecond until it holds (true) or `deadline`
/// passes (false).
fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

trait Stop: Send {
    fn stop(&mut self, grace: Duration);
}

struct ServerStopper<F: Fabric> {
    endpoints: Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    shared: Arc<ServerShared>,
    listener: Arc<F::Listener>,
    acceptor: Option<JoinHandle<()>>,
    dispatchers: Vec<JoinHandle<()>>,
}

/// A connection and the dispatcher that serves it.
type ServerConn<F> = (Arc<Endpoint<F, ServerRole>>, Arc<Conn<F>>);

impl<F: Fabric> ServerStopper<F> {
    fn connections(&self) -> Vec<ServerConn<F>> {
        self.endpoints
            .iter()
            .flat_map(|ep| ep.connections().into_iter().map(move |c| (ep.clone(), c)))
            .collect()
    }
}

impl<F: Fabric> Stop for ServerStopper<F> {
    fn stop(&mut self, grace: Duration) {
        // 1. Stop accepting.
        self.listener.close();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        // 2. Refuse new calls, let in-flight ones finish and their replies drain.
        self.shared.draining.store(true, Ordering::Release);
        let deadline = Instant::now() + grace;
        let drained = wait_until(deadline, || {
            self.shared.inflight.load(Ordering::Acquire) == 0
                && !self
                    .connections()
                    .iter()
                    .any(|(_, c)| c.is_alive() && c.has_unsent())
        });
        if !drained {
            tracing::warn!(
                inflight = self.shared.inflight.load(Ordering::Acquire),
                "shutdown grace period over; closing with calls in flight"
            );
        }
        // 3. Wait until the device has executed what was posted: destroying
        // a queue pair discards writes still queued on it, the last replies
        // among them. A signaled write completes after every write before it.
        let mut fences: Vec<_> = self
            .connections()
            .into_iter()
            .filter(|(_, c)| c.is_alive())
            .map(|(_, c)| (c, None))
            .collect();
        let confirmed = wait_until(deadline, || {
            for (conn, fence) in fences.iter_mut() {
                if fence.is_none() {
                    *fence = conn.post_fence();
                }
            }
            // Done: confirmed, or the connection died (nothing left to wait for).
            fences.retain(|(conn, fence)| {
                conn.is_alive() && !fence.is_some_and(|f| conn.completed_through(f))
            });
            fences.is_empty()
        });
        if !confirmed {
            tracing::warn!(
                connections = fences.len(),
                "shutdown grace period over; closing with writes unconfirmed"
            );
        }
        // 4. Close every connection (peers see it), then stop the threads.
        for (ep, conn) in self.connections() {
            ep.close(&conn, "server shut down");
        }
        for ep in self.endpoints.iter() {
            ep.stop();
        }
        for t in self.dispatchers.drain(..) {
            let _ = t.join();
        }
        // Blocking-pool threads exit once their queue closes, with the last
        // reference to the server's shared state; don't wait on them.
        tracing::info!("server stopped");
    }
}

/// A running server. [`ServerHandle::shutdown`] stops it gracefully; dropping
/// the handle does the same.
pub struct ServerHandle {
    local_url: String,
    stopper: Option<Box<dyn Stop>>,
}

impl fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerHandle")
            .field("local_url", &self.local_url)
            .finish()
    }
}

/// How long [`ServerHandle::shutdown`] lets in-flight calls finish.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

impl ServerHandle {
    /// Where clients connect (with the real port when 0 was asked).
    pub fn local_url(&self) -> &str {
        &self.local_url
    }

    /// Stops accepting connections, answers new calls `Unavailable`, waits for
    /// in-flight calls to finish and their responses to be sent (up to
    /// [`DEFAULT_SHUTDOWN_GRACE`]), closes every connection, and returns.
    pub fn shutdown(mut self) {
        self.stop(DEFAULT_SHUTDOWN_GRACE);
    }

    /// [`ServerHandle::shutdown`] with a chosen grace period.
    pub fn shutdown_timeout(mut self, grace: Duration) {
        self.stop(grace);
    }

    fn stop(&mut self, grace: Duration) {
        if let Some(mut s) = self.stopper.take() {
            s.stop(grace);
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop(DEFAULT_SHUTDOWN_GRACE);
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Mutex<ServerCall>>();
}
