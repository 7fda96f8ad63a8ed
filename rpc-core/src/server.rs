//! The server side: [`Server`], [`Service`], [`ServerCall`] and [`ServerHandle`].

use crate::client::encode_exact;
use crate::dispatch::{Config, Conn, Endpoint, Frame, OutFrame, Role};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Fabric, FabricUrl, Listener, LocalSetup, Scheme};
use crate::idmap::IdMap;
use crate::protocol::{CallId, FrameKind};
use crate::{Metadata, Request, Response, Status};
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Describes one rpc of a service.
#[derive(Debug)]
pub struct MethodDescriptor {
    /// The rpc's name as written in the .proto file (`Get`).
    pub name: &'static str,
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// Stable id: [`crate::codegen::method_id`] of `path`.
    pub id: u32,
}

/// Describes a service: its full name and its rpcs.
#[derive(Debug)]
pub struct ServiceDescriptor {
    /// `package.Service`.
    pub name: &'static str,
    /// The rpcs.
    pub methods: &'static [MethodDescriptor],
}

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

    /// Decodes the request as `Req`, runs `handler`, and sends its result.
    /// A payload that is not a valid `Req` is answered `InvalidArgument`
    /// without running the handler; a handler that panics is answered
    /// `Internal`; a call whose deadline passed is answered
    /// `DeadlineExceeded` without running the handler.
    pub fn unary<Req, Resp, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message,
        F: FnOnce(Request<Req>) -> Result<Response<Resp>, Status>,
    {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return self.reply_err(&Status::deadline_exceeded(
                "deadline passed before the handler ran",
            ));
        }
        let decoded = Req::decode(&self.payload[..]);
        if let Some(sink) = &self.sink {
            sink.recycle(std::mem::take(&mut self.payload));
        }
        let message = match decoded {
            Ok(m) => m,
            Err(e) => {
                let what = std::any::type_name::<Req>();
                return self.reply_err(&Status::invalid_argument(format!(
                    "request is not a valid {what}: {e}"
                )));
            }
        };
        let request =
            Request::from_wire(message, std::mem::take(&mut self.metadata), self.deadline);
        match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(Ok(response)) => self.reply_ok(response),
            Ok(Err(status)) => self.reply_err(&status),
            Err(panic) => {
                let what = panic_message(&*panic);
                tracing::error!(method_id = self.method_id, panic = %what, "handler panicked");
                self.reply_err(&Status::internal(format!("handler panicked: {what}")));
            }
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
            let status = Status::internal("the handler did not answer the call");
            send_error(&*sink, self.call_id, self.method_id, &status);
        }
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
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
            config: Config::default(),
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            inline: false,
        }
    }
}

/// Configures services and limits, then serves.
pub struct ServerBuilder {
    services: Vec<Arc<dyn Service>>,
    config: Config,
    workers: usize,
    inline: bool,
}

impl fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self.services.iter().map(|s| s.descriptor().name).collect();
        f.debug_struct("ServerBuilder")
            .field("services", &names)
            .field("workers", &self.workers)
            .finish()
    }
}

impl ServerBuilder {
    /// Adds a service (a generated `FooServer::new(impl)`, or any [`Service`]).
    pub fn add_service(mut self, service: impl Service) -> Self {
        self.services.push(Arc::new(service));
        self
    }

    /// Worker threads running handlers (default: one per CPU).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Runs handlers on the poller thread itself, skipping the hand-off to a
    /// worker: fastest for short, non-blocking handlers; a slow handler then
    /// delays every connection of this server.
    pub fn inline_handlers(mut self, inline: bool) -> Self {
        self.inline = inline;
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

    /// How long the poller spins before it blocks when idle (default 50 µs).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
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

    fn routes(&self) -> Result<IdMap<Arc<dyn Service>>, Status> {
        if self.services.is_empty() {
            return Err(Status::invalid_argument(
                "a server needs at least one service",
            ));
        }
        let mut routes: HashMap<u32, (&'static str, Arc<dyn Service>)> = HashMap::new();
        for svc in &self.services {
            for m in svc.descriptor().methods {
                let expected = crate::codegen::method_id(m.path);
                if m.id != expected {
                    return Err(Status::invalid_argument(format!(
                        "{} claims id {:#010x} but its id is {expected:#010x}: regenerate the code",
                        m.path, m.id
                    )));
                }
                if let Some((other, _)) = routes.insert(m.id, (m.path, svc.clone())) {
                    return Err(Status::invalid_argument(format!(
                        "method id collision: {other} and {} both hash to {:#010x}; rename one",
                        m.path, m.id
                    )));
                }
            }
        }
        Ok(routes.into_iter().map(|(id, (_, s))| (id, s)).collect())
    }

    fn serve_on<F: Fabric>(
        self,
        fabric: F,
        url: &FabricUrl,
        routes: IdMap<Arc<dyn Service>>,
    ) -> Result<ServerHandle, Status> {
        let listener = Arc::new(fabric.listen(url)?);
        let local_url = listener.local_url();
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let role = ServerRole {
            routes,
            jobs: if self.inline { None } else { Some(jobs_tx) },
            draining: AtomicBool::new(false),
            inflight: Arc::new(AtomicUsize::new(0)),
        };
        let ep = Endpoint::new(fabric, self.config, role)?;
        let mut threads = Vec::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Status::internal(format!("cannot spawn a thread: {e}")))
        };
        let poller = {
            let ep = ep.clone();
            spawn("rpc-server-poller".into(), Box::new(move || ep.run()))?
        };
        if !self.inline {
            for i in 0..self.workers {
                let rx = jobs_rx.clone();
                threads.push(spawn(
                    format!("rpc-worker-{i}"),
                    Box::new(move || worker(rx)),
                )?);
            }
        }
        drop(jobs_rx);
        let acceptor = {
            let ep = ep.clone();
            let listener = listener.clone();
            spawn(
                "rpc-acceptor".into(),
                Box::new(move || accept_loop(ep, listener)),
            )?
        };
        tracing::info!(url = %local_url, "serving");
        let ep2 = ep.clone();
        Ok(ServerHandle {
            local_url,
            stopper: Some(Box::new(ServerStopper {
                ep: ep2,
                listener,
                acceptor: Some(acceptor),
                poller: Some(poller),
                workers: threads,
            })),
        })
    }
}

fn accept_loop<F: Fabric>(ep: Arc<Endpoint<F, ServerRole>>, listener: Arc<F::Listener>) {
    loop {
        let incoming = match listener.next() {
            Ok(Some(i)) => i,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "listener failed; no longer accepting");
                return;
            }
        };
        if ep.role.draining.load(Ordering::Acquire) {
            continue; // dropping it refuses the connection
        }
        let ep = ep.clone();
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
    let connected = ep.fabric.accept(incoming, local)?;
    let conn = ep.add(connected, ring)?;
    if let Err(status) = conn.established() {
        ep.close(&conn, "handshake failed");
        return Err(status);
    }
    tracing::info!(peer = %conn.peer_addr, qp_num = conn.qp_num, "client connected");
    Ok(())
}

struct Job {
    service: Arc<dyn Service>,
    call: ServerCall,
}

fn run_job(job: Job) {
    let Job { service, call } = job;
    let method_id = call.method_id;
    // A hand-written Service may panic outside ServerCall::unary; the call's
    // drop then answers it.
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| service.call(call))) {
        tracing::error!(method_id, panic = %panic_message(&*panic), "service panicked");
    }
}

fn worker(jobs: Receiver<Job>) {
    for job in jobs.iter() {
        run_job(job);
    }
}

/// The server's side of the dispatcher: routes requests to handlers.
struct ServerRole {
    routes: IdMap<Arc<dyn Service>>,
    jobs: Option<Sender<Job>>,
    draining: AtomicBool,
    inflight: Arc<AtomicUsize>,
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
        self.inflight.fetch_add(1, Ordering::AcqRel);
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
            inflight: self.inflight.clone(),
        };
        let Some(metadata) = frame.metadata else {
            return call.reply_err(&Status::invalid_argument("request metadata is malformed"));
        };
        let mut call = call;
        call.metadata = metadata;
        if self.draining.load(Ordering::Acquire) {
            return call.reply_err(&Status::unavailable("server is shutting down"));
        }
        let Some(service) = self.routes.get(&h.method_id) else {
            return call.unimplemented();
        };
        let job = Job {
            service: service.clone(),
            call,
        };
        match &self.jobs {
            Some(tx) => {
                if let Err(e) = tx.send(job) {
                    e.into_inner()
                        .call
                        .reply_err(&Status::unavailable("server is shutting down"));
                }
            }
            None => run_job(job),
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
    ep: Arc<Endpoint<F, ServerRole>>,
    listener: Arc<F::Listener>,
    acceptor: Option<JoinHandle<()>>,
    poller: Option<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl<F: Fabric> Stop for ServerStopper<F> {
    fn stop(&mut self, grace: Duration) {
        // 1. Stop accepting.
        self.listener.close();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        // 2. Refuse new calls, let in-flight ones finish and their replies drain.
        self.ep.role.draining.store(true, Ordering::Release);
        let deadline = Instant::now() + grace;
        let drained = wait_until(deadline, || {
            self.ep.role.inflight.load(Ordering::Acquire) == 0
                && !self
                    .ep
                    .connections()
                    .iter()
                    .any(|c| c.is_alive() && c.has_unsent())
        });
        if !drained {
            tracing::warn!(
                inflight = self.ep.role.inflight.load(Ordering::Acquire),
                "shutdown grace period over; closing with calls in flight"
            );
        }
        // 3. Wait until the device has executed what was posted: destroying
        // a queue pair discards writes still queued on it, the last replies
        // among them. A signaled write completes after every write before it.
        let mut fences: Vec<_> = self
            .ep
            .connections()
            .into_iter()
            .filter(|c| c.is_alive())
            .map(|c| (c, None))
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
        for conn in self.ep.connections() {
            self.ep.close(&conn, "server shut down");
        }
        self.ep.stop();
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
        // Workers exit when the job channel closes (the role owns the sender,
        // which goes with the last endpoint reference); don't wait on them
        // beyond the grace period.
        self.workers.clear();
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
