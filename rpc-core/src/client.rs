//! The client side: [`Channel`] and [`UnaryCall`].

use crate::auth::Credential;
use crate::descriptor::MethodDescriptor;
use crate::dispatch::{Config, Conn, Endpoint, Frame, OutFrame, Role, least_loaded};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Fabric, FabricUrl, LocalSetup, Scheme};
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, CallTable, FrameKind};
use crate::slot::SlotPool;
use crate::streaming::{
    CallOwner, ClientStreamingCall, Link, Outbox, Pump, RequestPump, RequestSender, StreamCore,
    Streaming, send_control,
};
use crate::{Code, Metadata, Request, Response, Status};
use futures_core::Stream;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A connection to one server, shared by every clone.
///
/// ```no_run
/// # fn main() -> Result<(), rpc_core::Status> {
/// let channel = rpc_core::Channel::builder("tcp://127.0.0.1:7471")
///     .timeout(std::time::Duration::from_secs(1))
///     .connect()?;
/// # Ok(()) }
/// ```
///
/// A channel is one connection, not a thread: every channel of the process
/// is served by the dispatcher threads of one client runtime per fabric
/// (one per CPU), each owning a completion queue and its share of the
/// connections. Calls from any number of threads or tasks share the
/// connection; each is one frame in the server's receive ring and one back.
/// When the ring is full, calls queue (or fail with `ResourceExhausted` if
/// they ask to fail fast). When the connection fails, pending and later
/// calls fail with `Unavailable`; connect again to recover.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Handle>,
}

/// Dropping the last clone closes the connection.
struct Handle {
    client: ClientInner,
    url: String,
    default_timeout: Option<Duration>,
    /// How long a caller polls for its response before it sleeps, at least.
    spin: Duration,
}

enum ClientInner {
    Soft(Client<SoftFabric>),
    #[cfg(feature = "verbs")]
    Verbs(Client<crate::fabric::verbs::VerbsFabric>),
}

/// Runs `$body` with `$c` bound to the fabric-specific client.
macro_rules! with_client {
    ($inner:expr, $c:ident => $body:expr) => {
        match $inner {
            ClientInner::Soft($c) => $body,
            #[cfg(feature = "verbs")]
            ClientInner::Verbs($c) => $body,
        }
    };
}

/// One connection on one dispatcher of the client runtime.
struct Client<F: Fabric> {
    ep: Arc<Endpoint<F, ClientRole>>,
    conn: Arc<Conn<F>>,
}

impl<F: Fabric> Drop for Client<F> {
    fn drop(&mut self) {
        self.ep.close(&self.conn, "channel dropped");
    }
}

/// The dispatchers that serve every channel of the process on one fabric
/// context. They live as long as the process; idle, they block.
struct ClientRuntime<F: Fabric> {
    endpoints: Vec<Arc<Endpoint<F, ClientRole>>>,
}

impl<F: Fabric> ClientRuntime<F> {
    fn start(fabric: F, name: &str) -> Result<ClientRuntime<F>, Status> {
        let n = crate::dispatch::available_cores();
        let mut endpoints = Vec::with_capacity(n);
        for i in 0..n {
            let ep = Endpoint::new(
                fabric.clone(),
                Config::default(),
                ClientRole::default(),
                false,
            )?;
            let runner = ep.clone();
            std::thread::Builder::new()
                .name(format!("rpc-client-{name}-{i}"))
                .spawn(move || runner.run())
                .map_err(|e| Status::internal(format!("cannot spawn a client dispatcher: {e}")))?;
            endpoints.push(ep);
        }
        Ok(ClientRuntime { endpoints })
    }
}

/// The client runtime of the software fabric (mem:// and tcp://).
fn soft_runtime() -> Result<&'static ClientRuntime<SoftFabric>, Status> {
    static RT: OnceLock<ClientRuntime<SoftFabric>> = OnceLock::new();
    static START: Mutex<()> = Mutex::new(());
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let _one = START.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = ClientRuntime::start(SoftFabric::new(), "soft")?;
    Ok(RT.get_or_init(|| rt))
}

/// The client runtime of the RDMA device `url` selects (one per device,
/// port and GID choice).
#[cfg(feature = "verbs")]
fn verbs_runtime(
    url: &FabricUrl,
) -> Result<Arc<ClientRuntime<crate::fabric::verbs::VerbsFabric>>, Status> {
    use crate::fabric::verbs::DeviceSelection;
    type Runtimes = Mutex<
        Vec<(
            DeviceSelection,
            Arc<ClientRuntime<crate::fabric::verbs::VerbsFabric>>,
        )>,
    >;
    static RTS: OnceLock<Runtimes> = OnceLock::new();
    // URLs that select alike share a runtime, without opening the device
    // again.
    let key = DeviceSelection::of(url);
    let mut rts = RTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, rt)) = rts.iter().find(|(k, _)| *k == key) {
        return Ok(rt.clone());
    }
    let fabric = crate::fabric::open_verbs(url)?;
    let device = fabric.choice().device.clone();
    let rt = Arc::new(ClientRuntime::start(fabric, &device)?);
    rts.push((key, rt.clone()));
    Ok(rt)
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("url", &self.inner.url)
            .finish()
    }
}

/// Configures and opens a [`Channel`].
#[derive(Clone)]
pub struct ChannelBuilder {
    url: String,
    config: Config,
    timeout: Option<Duration>,
    credential: Option<Arc<dyn Credential>>,
    tls: Option<crate::fabric::ClientTls>,
}

impl fmt::Debug for ChannelBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelBuilder")
            .field("url", &self.url)
            .field("config", &self.config)
            .field("timeout", &self.timeout)
            .field("credential", &self.credential.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl ChannelBuilder {
    /// Default timeout of every call (none by default); [`Request::set_timeout`] overrides it.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// What to present to a server that requires a credential: a
    /// [`SharedSecret`](crate::SharedSecret) or any [`Credential`]. The
    /// server must prove that it knows it too, or connecting fails with
    /// `Unauthenticated`.
    pub fn credential(mut self, credential: impl Credential) -> Self {
        self.credential = Some(Arc::new(credential));
        self
    }

    /// Connects over TLS (`tcp://`: everything; `rdma://`: the handshake
    /// over TCP; `mem://` ignores it): the server's certificate must come
    /// from a CA in `config` and be valid for the URL's host (or
    /// [`ClientTlsConfig::domain_name`](crate::tls::ClientTlsConfig::domain_name)).
    /// Fails at once if `config` is not usable (no CA, a PEM without a
    /// certificate or key, a key that does not match its certificate).
    #[cfg(feature = "tls")]
    pub fn tls_config(mut self, config: crate::tls::ClientTlsConfig) -> Result<Self, Status> {
        self.tls = Some(config.build()?);
        Ok(self)
    }

    /// How long connecting may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// Size of the receive ring for responses, in bytes: a power of two
    /// (default 256 KiB on mem:// and tcp://, 128 KiB on rdma://, where it is
    /// registered memory). Small messages travel through it; payloads larger
    /// than the rendezvous threshold ([`ChannelBuilder::rendezvous_above`])
    /// or than half the ring are lent by the sender and read from its memory.
    pub fn ring_size(mut self, bytes: usize) -> Self {
        self.config.ring_size = Some(bytes);
        self
    }

    /// Largest response (metadata + payload) accepted, in bytes (default
    /// 64 MiB, at most 4 GiB less a byte). A larger response fails with
    /// `ResourceExhausted`, before anything is allocated here.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.config.max_message = bytes;
        self
    }

    /// Payloads larger than this many bytes (default 32 KiB) travel by
    /// rendezvous: the sender lends its encoded message to the connection,
    /// the receiver reads it straight into its own buffer. Smaller ones
    /// are copied through the ring.
    pub fn rendezvous_above(mut self, bytes: usize) -> Self {
        self.config.lend_above = bytes;
        self
    }

    /// How long a caller polls for its response before it sleeps, at least
    /// (default 50 µs; longer while recent responses came within 1 ms).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// How often an idle connection sends a heartbeat (default 1 s, at
    /// least 10 ms), or `None` for none. The server's transport must
    /// acknowledge each, so a server host that vanished (power, link) fails
    /// every pending call with `Unavailable` within 5 s with the default (about
    /// 2.5 s on rdma://; see [`heartbeat_bound`](crate::heartbeat_bound));
    /// without heartbeats, only TCP keepalive notices, after 20 s.
    pub fn heartbeat(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat = interval;
        self
    }

    /// Connects.
    pub fn connect(self) -> Result<Channel, Status> {
        self.config.validate()?;
        let url = FabricUrl::parse(&self.url)?;
        let client = match url.scheme {
            Scheme::Mem | Scheme::Tcp => ClientInner::Soft(Client::connect(
                soft_runtime()?,
                &url,
                &self.config,
                self.credential,
                self.tls,
            )?),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => ClientInner::Verbs(Client::connect(
                &*verbs_runtime(&url)?,
                &url,
                &self.config,
                self.credential,
                self.tls,
            )?),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(&url)? {},
        };
        Ok(Channel {
            inner: Arc::new(Handle {
                client,
                url: url.to_string(),
                default_timeout: self.timeout,
                spin: self.config.spin,
            }),
        })
    }
}

impl Channel {
    /// Connects to `url` with default settings: `mem://name`, `tcp://host:port` or `rdma://host:port`.
    pub fn connect(url: &str) -> Result<Channel, Status> {
        Channel::builder(url).connect()
    }

    /// A builder for a channel to `url`.
    pub fn builder(url: &str) -> ChannelBuilder {
        ChannelBuilder {
            url: url.to_owned(),
            config: Config::default(),
            timeout: None,
            credential: None,
            tls: None,
        }
    }

    /// The URL this channel connected to.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Whether the connection is still up.
    pub fn is_connected(&self) -> bool {
        with_client!(&self.inner.client, c => c.conn.is_alive())
    }

    /// The completion queue and queue pair number under this channel, if
    /// it is `rdma://` (tests inject device events through them).
    #[cfg(all(test, feature = "verbs"))]
    pub(crate) fn verbs_queue(&self) -> Option<(&crate::fabric::verbs::VerbsCq, u32)> {
        match &self.inner.client {
            ClientInner::Verbs(c) => Some((&c.ep.cq, c.conn.qp_num)),
            ClientInner::Soft(_) => None,
        }
    }

    /// Responses dropped because they arrived after their call ended (timed
    /// out or cancelled), or named no call of this channel.
    pub fn stale_responses(&self) -> u64 {
        with_client!(&self.inner.client, c => c.conn.stale_responses())
    }

    /// Starts a unary call; generated clients call this.
    #[doc(hidden)]
    pub fn unary<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<Req>,
    ) -> UnaryCall<Resp>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let timeout = request.budget(self.inner.default_timeout);
        let span = tracing::trace_span!("call", method = method.path);
        let _guard = span.enter();
        let started = with_client!(&self.inner.client, c => c.start(method.id, &request, timeout));
        match started {
            Ok((id, slot)) => UnaryCall {
                slot: Some(slot),
                id,
                canceller: Some(self.clone()),
                started: None,
                misses: 0,
                corked: true,
                _t: PhantomData,
            },
            Err(status) => UnaryCall::failed(status),
        }
    }

    /// Starts a server-streaming call; generated clients call this.
    #[doc(hidden)]
    pub fn server_streaming<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<Req>,
    ) -> Streaming<Resp>
    where
        Req: prost::Message,
    {
        let timeout = request.budget(self.inner.default_timeout);
        let opened = self.open_stream(
            method,
            request.metadata(),
            timeout,
            Some(request.get_ref()),
            false,
        );
        self.incoming(opened, |_| None)
    }

    /// Starts a bidirectional call whose requests come from a stream;
    /// generated clients call this.
    #[doc(hidden)]
    pub fn streaming<S, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<S>,
    ) -> Streaming<Resp>
    where
        S: Stream + Send + 'static,
        S::Item: prost::Message + Send,
    {
        self.pumped(method, request, false)
    }

    /// Starts a client-streaming call whose requests come from a stream;
    /// generated clients call this.
    #[doc(hidden)]
    pub fn client_streaming<S, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<S>,
    ) -> ClientStreamingCall<Resp>
    where
        S: Stream + Send + 'static,
        S::Item: prost::Message + Send,
    {
        ClientStreamingCall::new(self.pumped(method, request, true))
    }

    /// Starts a bidirectional call whose requests are sent through the
    /// returned sender; generated clients call this.
    #[doc(hidden)]
    pub fn streaming_sender<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<()>,
    ) -> (RequestSender<Req>, Streaming<Resp>)
    where
        Req: prost::Message,
    {
        self.with_sender(method, request, false)
    }

    /// Starts a client-streaming call whose requests are sent through the
    /// returned sender; generated clients call this.
    #[doc(hidden)]
    pub fn client_streaming_sender<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<()>,
    ) -> (RequestSender<Req>, ClientStreamingCall<Resp>)
    where
        Req: prost::Message,
    {
        let (sender, stream) = self.with_sender(method, request, true);
        (sender, ClientStreamingCall::new(stream))
    }

    /// Opens a stream whose requests come from `request`'s stream, sent as
    /// the returned `Streaming` is polled.
    fn pumped<S, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<S>,
        final_message: bool,
    ) -> Streaming<Resp>
    where
        S: Stream + Send + 'static,
        S::Item: prost::Message + Send,
    {
        let timeout = request.budget(self.inner.default_timeout);
        let metadata = request.metadata().clone();
        let stream = request.into_inner();
        let opened = self.open_stream::<()>(method, &metadata, timeout, None, final_message);
        self.incoming(opened, move |outbox| {
            Some(Box::new(RequestPump::new(stream, outbox)) as Box<dyn Pump>)
        })
    }

    /// Opens a stream whose requests go through a [`RequestSender`].
    fn with_sender<Req: prost::Message, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<()>,
        final_message: bool,
    ) -> (RequestSender<Req>, Streaming<Resp>) {
        let timeout = request.budget(self.inner.default_timeout);
        let opened =
            self.open_stream::<()>(method, request.metadata(), timeout, None, final_message);
        let mut sender = None;
        let stream = self.incoming(opened, |outbox| {
            sender = Some(RequestSender::new(outbox));
            None
        });
        let sender = sender.unwrap_or_else(|| RequestSender::new(Outbox::closed()));
        (sender, stream)
    }

    fn open_stream<Req: prost::Message>(
        &self,
        method: &'static MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
    ) -> Result<(CallId, Arc<StreamCore>), Status> {
        let span = tracing::trace_span!("stream", method = method.path);
        let _guard = span.enter();
        with_client!(&self.inner.client, c => c.start_stream(method, metadata, timeout, first, final_message))
    }

    /// The consumer's end of an opened stream; `pump` makes the request
    /// side from the stream's outbox.
    fn incoming<Resp>(
        &self,
        opened: Result<(CallId, Arc<StreamCore>), Status>,
        pump: impl FnOnce(Outbox) -> Option<Box<dyn Pump>>,
    ) -> Streaming<Resp> {
        let (id, core) = match opened {
            Ok(opened) => opened,
            Err(status) => return Streaming::failed(status),
        };
        let link: Arc<dyn Link> = with_client!(&self.inner.client, c => c.conn.clone());
        let outbox = Outbox::new(core.clone(), link.clone(), id, 0, None);
        let pump = pump(outbox);
        let owner: Arc<dyn CallOwner> = Arc::new(self.clone());
        Streaming::new(core, link, id, Some(owner), pump)
    }

    fn cancel(&self, id: CallId) {
        with_client!(&self.inner.client, c => c.cancel(id))
    }

    /// Sends the requests staged on this channel's connection.
    fn uncork(&self) {
        with_client!(&self.inner.client, c => c.conn.uncork())
    }

    /// Whether requests are staged on this channel's connection.
    fn is_corked(&self) -> bool {
        with_client!(&self.inner.client, c => c.conn.is_corked())
    }

    /// Decodes a finished call's outcome and takes back what the call used:
    /// its slot and the buffer its response arrived in.
    fn finish_call<T: prost::Message + Default>(
        &self,
        slot: Arc<CallSlot>,
        outcome: Result<RawReply, Status>,
    ) -> Result<Response<T>, Status> {
        let mut buf = Default::default();
        let reply = decode_reply(outcome, |b| buf = b);
        with_client!(&self.inner.client, c => {
            c.conn.recycle(buf);
            c.ep.role.release_slot(slot);
        });
        reply
    }

    /// Handles completions on this thread while `slot` waits, for a while.
    fn poll_for(&self, slot: &CallSlot) {
        let spin = self.inner.spin;
        with_client!(&self.inner.client, c => {
            c.ep.poll_until(spin, || slot.is_done(), || !c.ep.role.calls().is_empty());
        })
    }

    /// Turns the queue once on this thread if nobody else is; true if it did.
    fn try_progress(&self) -> bool {
        with_client!(&self.inner.client, c => c.ep.try_progress())
    }

    /// How long a caller keeps polling for a response before it sleeps.
    fn spin_budget(&self) -> Duration {
        let spin = self.inner.spin;
        with_client!(&self.inner.client, c => c.ep.call_waits.budget(spin))
    }

    /// Notes how long a call waited for its response.
    fn note_wait(&self, wait: Duration) {
        with_client!(&self.inner.client, c => c.ep.call_waits.record(wait))
    }

    /// Makes sure someone handles completions while a call waits.
    fn ensure_polled(&self) {
        with_client!(&self.inner.client, c => c.ep.ensure_polled())
    }
}

impl<F: Fabric> Client<F> {
    fn connect(
        rt: &ClientRuntime<F>,
        url: &FabricUrl,
        config: &Config,
        credential: Option<Arc<dyn Credential>>,
        tls: Option<crate::fabric::ClientTls>,
    ) -> Result<Client<F>, Status> {
        let ep = least_loaded(&rt.endpoints).clone();
        let ring = ep.fabric.register(config.ring_size::<F>(), true)?;
        let local = LocalSetup {
            ring: &ring,
            max_message: config.max_message as u32,
            timeout: config.connect_timeout,
            credential,
            tls,
        };
        let connected = ep.fabric.connect(url, local, &ep.cq)?;
        let conn = ep.add(connected, ring, config.max_message)?;
        // The client writes first: an empty credit doorbell tells the server
        // that our ring takes its writes (on rdma://, that our memory window
        // is bound), so that it may send of its own accord (heartbeats).
        if conn.post_fence().is_none() {
            let why = conn.death().unwrap_or_else(|| "send queue full".into());
            ep.close(&conn, &why);
            return Err(Status::unavailable(format!(
                "connection failed at once: {why}"
            )));
        }
        if let Some(every) = config.heartbeat {
            ep.start_heartbeat(&conn, every, false);
        }
        tracing::debug!(%url, qp_num = conn.qp_num, "connected");
        Ok(Client { ep, conn })
    }

    /// `Unavailable` once the connection has failed.
    fn ensure_alive(&self) -> Result<(), Status> {
        if self.conn.is_alive() {
            return Ok(());
        }
        Err(Status::unavailable(format!(
            "connection closed: {}",
            self.conn.death().unwrap_or_default()
        )))
    }

    /// Enters a call into the dispatcher's table, with its deadline if it
    /// has a timeout (and makes the dispatcher wake for it).
    fn register(&self, waiter: Waiter, timeout: Option<Duration>) -> CallId {
        let deadline = timeout.map(|t| Instant::now() + t);
        let call = Call {
            waiter,
            qp_num: self.conn.qp_num,
        };
        let id = self.ep.role.calls().insert(call, deadline);
        if let Some(at) = deadline {
            self.ep.wake_by(at);
        }
        id
    }

    fn start<Req: prost::Message>(
        &self,
        method_id: u32,
        request: &Request<Req>,
        timeout: Option<Duration>,
    ) -> Result<(CallId, Arc<CallSlot>), Status> {
        self.ensure_alive()?;
        let slot = self.ep.role.take_slot();
        let id = self.register(Waiter::Unary(slot.clone()), timeout);
        let message = request.get_ref();
        let frame = OutFrame {
            kind: FrameKind::Request,
            call_id: id,
            method_id,
            status: 0,
            timeout_us: timeout_us(timeout),
            metadata: Some(request.metadata()),
            payload_len: message.encoded_len(),
        };
        let sent = self
            .conn
            .send_corked(&frame, request.fail_fast(), &mut |buf| {
                crate::dispatch::encode_exact(message, buf)
            });
        match sent {
            Ok(true) => self.ep.corked(&self.conn),
            Ok(false) => {}
            Err(e) => {
                self.ep.role.calls().remove(id);
                return Err(e.into());
            }
        }
        Ok((id, slot))
    }

    /// Opens a stream: registers the call and sends its `Request` frame,
    /// with `first` as the request message of a server-streaming call.
    fn start_stream<Req: prost::Message>(
        &self,
        method: &MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
    ) -> Result<(CallId, Arc<StreamCore>), Status> {
        self.ensure_alive()?;
        // Only a client-streaming call's responses are not a stream.
        let core = StreamCore::new(DEFAULT_WINDOW, !final_message);
        let waiter = Waiter::Stream {
            core: core.clone(),
            final_message,
        };
        let id = self.register(waiter, timeout);
        let frame = OutFrame {
            kind: FrameKind::Request,
            call_id: id,
            method_id: method.id,
            status: 0,
            timeout_us: timeout_us(timeout),
            metadata: Some(metadata),
            payload_len: first.map_or(0, |m| m.encoded_len()),
        };
        let sent = self.conn.send(&frame, false, &mut |buf| {
            if let Some(m) = first {
                crate::dispatch::encode_exact(m, buf)
            }
        });
        if let Err(e) = sent {
            self.ep.role.calls().remove(id);
            return Err(e.into());
        }
        Ok((id, core))
    }

    fn cancel(&self, id: CallId) {
        let call = self.ep.role.calls().remove(id);
        if let Some(call) = call {
            if let Waiter::Stream { core, .. } = call.waiter {
                core.fail(Status::cancelled("the call was cancelled"));
            }
            send_cancel(&self.conn, id);
        }
    }
}

/// A timeout as the header's microseconds (0 = none; at least 1 otherwise).
fn timeout_us(timeout: Option<Duration>) -> u32 {
    timeout.map_or(0, |t| t.as_micros().clamp(1, u32::MAX as u128) as u32)
}

fn send_cancel<F: Fabric>(conn: &Conn<F>, id: CallId) {
    let _ = send_control(conn, FrameKind::Cancel, id, 0);
}

/// Who waits for a call's frames.
enum Waiter {
    /// A unary call's caller.
    Unary(Arc<CallSlot>),
    /// A stream's consumer; with `final_message`, the final `Response`
    /// carries a message (client-streaming calls).
    Stream {
        core: Arc<StreamCore>,
        final_message: bool,
    },
}

/// A call in flight on a dispatcher: who waits, and on which connection.
struct Call {
    waiter: Waiter,
    qp_num: u32,
}

impl CallOwner for Channel {
    fn release(&self, call_id: CallId) {
        self.cancel(call_id);
    }

    fn progress(&self) -> bool {
        self.try_progress()
    }

    fn ensure_polled(&self) {
        Channel::ensure_polled(self);
    }
}

/// The client's side of one dispatcher: completes the calls of every
/// channel on it.
struct ClientRole {
    calls: Mutex<CallTable<Call>>,
    /// Slots of finished calls, for reuse.
    slots: SlotPool<Outcome>,
}

impl Default for ClientRole {
    fn default() -> Self {
        ClientRole {
            calls: Mutex::new(CallTable::new()),
            slots: SlotPool::new(),
        }
    }
}

impl ClientRole {
    fn calls(&self) -> std::sync::MutexGuard<'_, CallTable<Call>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take_slot(&self) -> Arc<CallSlot> {
        self.slots.take()
    }

    /// Completes the call of `slot` and lets go of it.
    fn finish(&self, slot: Arc<CallSlot>, result: Outcome) {
        self.slots.finish(slot, result);
    }

    /// Lets go of a finished call's slot (see [`SlotPool::release`]).
    fn release_slot(&self, slot: Arc<CallSlot>) {
        self.slots.release(slot);
    }
}

impl<F: Fabric> Role<F> for ClientRole {
    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        let h = frame.header;
        match h.kind {
            FrameKind::Response | FrameKind::Error | FrameKind::Message | FrameKind::Window => {}
            FrameKind::Credit => return,
            kind => {
                ep.close_for_violation(conn, &format!("server sent a {kind:?} frame"));
                return;
            }
        }
        let id = h.call_id;
        let mut calls = self.calls();
        // Only a call of this connection: another channel's server cannot
        // complete it.
        let stream = match calls.get_mut(id) {
            Some(c) if c.qp_num == conn.qp_num => match &c.waiter {
                Waiter::Unary(_) => None,
                Waiter::Stream {
                    core,
                    final_message,
                } => Some((core.clone(), *final_message)),
            },
            _ => {
                drop(calls);
                conn.note_stale();
                tracing::debug!(
                    call_id = id.0,
                    kind = ?h.kind,
                    "dropped a frame of a call that already ended"
                );
                return;
            }
        };
        let Some((core, final_message)) = stream else {
            // A unary call: completed by a response or an error only.
            if !matches!(h.kind, FrameKind::Response | FrameKind::Error) {
                drop(calls);
                ep.close_for_violation(conn, "server sent a stream frame for a unary call");
                return;
            }
            let call = calls.complete(id);
            drop(calls);
            if let Some(Call {
                waiter: Waiter::Unary(slot),
                ..
            }) = call
            {
                self.finish(slot, unary_outcome(frame));
            }
            return;
        };
        if matches!(h.kind, FrameKind::Response | FrameKind::Error) {
            calls.complete(id);
        }
        drop(calls);
        let applied = match h.kind {
            FrameKind::Message => match frame.metadata {
                Some(md) => core.on_message(&h, frame.payload, md),
                None => {
                    self.fail_stream(conn, id, &core, "server sent malformed stream metadata");
                    return;
                }
            },
            FrameKind::Window => core.on_grant(h.timeout_us),
            FrameKind::Response => {
                let last = final_message.then_some(frame.payload);
                core.on_end(Ok(()), last, frame.metadata, true)
            }
            _ => {
                let status = error_status(&frame);
                core.on_end(Err(status), None, frame.metadata, true)
            }
        };
        if let Err(e) = applied {
            ep.close_for_violation(conn, &format!("stream protocol violation: {e}"));
        }
    }

    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::info!(%why, "connection lost");
        let calls = self.calls().remove_where(|c| c.qp_num == conn.qp_num);
        for (_, call) in calls {
            let status = Status::unavailable(format!("connection lost: {why}"));
            match call.waiter {
                Waiter::Unary(slot) => self.finish(slot, Err(status)),
                Waiter::Stream { core, .. } => core.fail(status),
            }
        }
    }

    fn on_tick(&self, ep: &Endpoint<F, Self>, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let next = {
            let mut calls = self.calls();
            while let Some(e) = calls.pop_expired(now) {
                expired.push(e);
            }
            calls.next_deadline()
        };
        for (id, call) in expired {
            let status = Status::deadline_exceeded("deadline exceeded before the call finished");
            match call.waiter {
                Waiter::Unary(slot) => self.finish(slot, Err(status)),
                Waiter::Stream { core, .. } => core.fail(status),
            }
            if let Some(conn) = ep.conn(call.qp_num) {
                send_cancel(&conn, id);
            }
        }
        next
    }
}

impl ClientRole {
    /// Ends a stream the server broke: its consumer sees `why`, the server a cancel.
    fn fail_stream<F: Fabric>(&self, conn: &Conn<F>, id: CallId, core: &StreamCore, why: &str) {
        self.calls().remove(id);
        core.fail(Status::internal(why));
        send_cancel(conn, id);
    }
}

/// The status an `Error` frame carries.
fn error_status(frame: &Frame) -> Status {
    let message = String::from_utf8_lossy(&frame.payload).into_owned();
    let status = Status::new(Code::from_u16(frame.header.status), message);
    match &frame.metadata {
        Some(md) if !md.is_empty() => status.with_metadata(md.clone()),
        _ => status,
    }
}

/// What a unary call's `Response` or `Error` frame tells its caller.
fn unary_outcome(frame: Frame) -> Result<RawReply, Status> {
    match frame.header.kind {
        FrameKind::Response => match frame.metadata {
            Some(metadata) => Ok(RawReply {
                metadata,
                payload: frame.payload,
            }),
            None => Err(Status::internal("server sent malformed response metadata")),
        },
        _ => Err(error_status(&frame)),
    }
}

/// A response as received, before decoding.
#[derive(Debug)]
struct RawReply {
    metadata: Metadata,
    payload: crate::payload::Payload,
}

/// What a unary call ends with, left in its slot.
type Outcome = Result<RawReply, Status>;
/// Where a unary call's outcome is left for its caller.
type CallSlot = crate::slot::CallSlot<Outcome>;

/// A call in flight: `.await` it from any executor, or block on it with
/// [`UnaryCall::wait`]. Dropping it unfinished cancels the call.
///
/// The request is encoded into the connection's send ring when the call is
/// made, and leaves when the call is first waited on or awaited, together
/// with the requests other callers made meanwhile (one post, one vectored
/// write on tcp://), as a tonic call leaves when first polled.
#[must_use = "a call does nothing useful unless awaited or waited on"]
pub struct UnaryCall<T> {
    slot: Option<Arc<CallSlot>>,
    id: CallId,
    canceller: Option<Channel>,
    /// When an `.await` first found the response missing.
    started: Option<Instant>,
    /// Polls that found the response missing (the clock is read on every
    /// fourth only).
    misses: u32,
    /// The request may still be staged (see `Conn::send_corked`).
    corked: bool,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for UnaryCall<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnaryCall").field("id", &self.id.0).finish()
    }
}

impl<T> UnaryCall<T> {
    fn failed(status: Status) -> UnaryCall<T> {
        let slot = CallSlot::new();
        let _ = slot.complete(Err(status));
        UnaryCall {
            slot: Some(Arc::new(slot)),
            id: CallId(0),
            canceller: None,
            started: None,
            misses: 0,
            corked: false,
            _t: PhantomData,
        }
    }
}

/// Blocks until the outcome of `slot` is in and takes it.
fn wait_slot(slot: &CallSlot) -> Outcome {
    slot.wait()
        .unwrap_or_else(|| Err(Status::internal("call result already taken")))
}

/// Takes the outcome of `slot` if it is in.
fn poll_slot(slot: &CallSlot, cx: &mut Context<'_>) -> Poll<Outcome> {
    slot.poll(cx)
        .map(|r| r.unwrap_or_else(|| Err(Status::internal("call polled after completion"))))
}

/// Decodes a response; hands the buffer it arrived in to `recycle`.
fn decode_reply<T: prost::Message + Default>(
    r: Result<RawReply, Status>,
    recycle: impl FnOnce(crate::payload::Payload),
) -> Result<Response<T>, Status> {
    let RawReply { metadata, payload } = r?;
    let message = payload.decode::<T>(recycle).map_err(|e| {
        Status::internal(format!(
            "response is not a valid {}: {e}",
            std::any::type_name::<T>()
        ))
    })?;
    Ok(Response::from_parts(metadata, message))
}

impl<T: prost::Message + Default> UnaryCall<T> {
    /// Blocks the current thread until the response arrives.
    ///
    /// While it waits, the thread first handles completions itself for a
    /// short while (the channel's spin time), so a quick response reaches it
    /// without a hand-off from the dispatcher thread; then it sleeps.
    pub fn wait(mut self) -> Result<Response<T>, Status> {
        let slot = self.slot.take().expect("slot present until completion");
        let Some(channel) = self.canceller.take() else {
            return decode_reply(wait_slot(&slot), drop);
        };
        channel.uncork();
        let started = Instant::now();
        channel.poll_for(&slot);
        // Sleep without holding the channel: if its last handle goes away
        // meanwhile, the call fails `Unavailable` instead of waiting forever.
        let weak = Arc::downgrade(&channel.inner);
        drop(channel);
        let outcome = wait_slot(&slot);
        match weak.upgrade() {
            Some(inner) => {
                let channel = Channel { inner };
                channel.note_wait(started.elapsed());
                channel.finish_call(slot, outcome)
            }
            None => decode_reply(outcome, drop),
        }
    }
}

impl<T: prost::Message + Default> Future for UnaryCall<T> {
    type Output = Result<Response<T>, Status>;

    /// Checks for the response. While it is missing, the task turns the
    /// completion queue itself, as a blocking [`UnaryCall::wait`] does, and
    /// asks to be polled again soon, for up to the channel's spin time: a
    /// quick response then completes on the task's own thread with no
    /// hand-off. After that the channel's dispatcher takes over and wakes
    /// the task.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(slot) = self.slot.clone() else {
            return Poll::Ready(Err(Status::internal("call polled after completion")));
        };
        if self.corked {
            if let Some(channel) = &self.canceller {
                if self.started.is_none() && channel.is_corked() {
                    // First poll: let the tasks that run next issue their
                    // requests too; they all leave in one post at the next
                    // poll of any of them.
                    self.started = Some(Instant::now());
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                channel.uncork();
            }
            self.corked = false;
        }
        let mut outcome = poll_slot(&slot, cx);
        if outcome.is_pending() {
            if let Some(channel) = &self.canceller {
                if channel.try_progress() && slot.is_done() {
                    outcome = poll_slot(&slot, cx);
                }
            }
        }
        match outcome {
            Poll::Ready(r) => {
                let slot = self.slot.take().expect("checked above");
                let started = self.started.take();
                Poll::Ready(match self.canceller.take() {
                    Some(channel) => {
                        if let Some(t) = started {
                            channel.note_wait(t.elapsed());
                        }
                        channel.finish_call(slot, r)
                    }
                    None => decode_reply(r, drop),
                })
            }
            Poll::Pending => {
                self.misses = self.misses.wrapping_add(1);
                let within_budget = match self.started {
                    None => {
                        self.started = Some(Instant::now());
                        true
                    }
                    // Polls come a few hundred nanoseconds apart: reading
                    // the clock on every one of them costs more than
                    // overshooting the budget by three.
                    Some(_) if self.misses % 4 != 0 => true,
                    Some(started) => self
                        .canceller
                        .as_ref()
                        .is_some_and(|c| started.elapsed() < c.spin_budget()),
                };
                if let Some(channel) = &self.canceller {
                    if within_budget {
                        cx.waker().wake_by_ref();
                    } else {
                        channel.ensure_polled();
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl<T> Drop for UnaryCall<T> {
    fn drop(&mut self) {
        if let (Some(_), Some(channel)) = (self.slot.take(), self.canceller.take()) {
            channel.cancel(self.id);
        }
    }
}
