//! The client side: [`Channel`] and [`UnaryCall`].

mod endpoints;
mod reconnect;
pub(crate) mod stream_limit;

pub use endpoints::{Dns, Resolver};
pub use reconnect::Backoff;

use crate::auth::Credential;
use crate::descriptor::MethodDescriptor;
use crate::descriptor::MethodKind;
use crate::dispatch::{Config, Conn, Endpoint, Frame, OutFrame, Role, least_loaded};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Fabric, FabricUrl, LocalSetup, Scheme};
use crate::interceptor::{Chain, Interceptor};
use crate::observe::{CallObs, TRACEPARENT};
use crate::protocol::header::Header;
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, CallTable, FrameKind};
use crate::slot::SlotPool;
use crate::streaming::{
    CallOwner, ClientStreamingCall, Link, Opening, Outbox, Pump, RequestPump, RequestSender,
    StreamCore, StreamParts, Streaming, send_control,
};
use crate::{Code, Metadata, Request, Response, Status};
use arc_swap::{ArcSwap, ArcSwapOption};
use futures_core::Stream;
use reconnect::Ready;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use stream_limit::{StreamLimit, StreamPermit, Waiting};

/// A client's way to one service: one connection, or one to each of
/// several endpoints, shared by every clone.
///
/// ```no_run
/// # fn main() -> Result<(), rpc_core::Status> {
/// let channel = rpc_core::Channel::builder("tcp://127.0.0.1:7471")
///     .timeout(std::time::Duration::from_secs(1))
///     .connect()?;
/// // Two servers, calls spread over them; a server that fails is left out
/// // until a reconnection to it succeeds.
/// let balanced = rpc_core::Channel::balance(["tcp://10.0.0.1:7471", "tcp://10.0.0.2:7471"])
///     .connect_lazy()?;
/// # Ok(()) }
/// ```
///
/// A channel's connection is not a thread: every channel of the process is
/// served by the dispatcher threads of one client runtime per fabric (one
/// per CPU), each owning a completion queue and its share of the
/// connections. Calls from any number of threads or tasks share the
/// connection; each is one frame in the server's receive ring and one back.
/// When the ring is full, calls queue (or fail with `ResourceExhausted` if
/// they ask to fail fast).
///
/// **When a connection fails**, its pending calls fail with `Unavailable`
/// and the channel reconnects by itself, with exponential backoff and
/// jitter ([`Backoff`]: from 50 ms up to 1 s between attempts by default),
/// on one process-wide thread that starts each attempt on a short-lived
/// thread of its own. Meanwhile new calls fail at once with `Unavailable`
/// (naming the last failure), or, when the call or channel asks for it
/// ([`Request::set_wait_for_ready`], [`ChannelBuilder::wait_for_ready`]: gRPC's
/// wait-for-ready), a call or stream waits for a connection until its
/// deadline. With several endpoints, calls go to those connected (round
/// robin, or to the one with the fewest calls outstanding, see
/// [`Balance`]) while the others reconnect.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Handle>,
}

/// What every clone of a channel shares.
struct Handle {
    /// One per endpoint: fixed, or replaced each time the resolver answers.
    targets: ArcSwap<Vec<Arc<Target>>>,
    /// The one endpoint of a channel of one fixed URL (the usual case),
    /// which calls reach without loading `targets`.
    single: Option<Arc<Target>>,
    settings: Arc<Settings>,
    /// The endpoints as given, comma-separated (or the resolver's name).
    url: String,
    /// Where the endpoints come from when they change.
    resolver: Option<endpoints::Resolving>,
    /// How endpoints are health-checked, if they are.
    health: Option<endpoints::HealthCheck>,
    default_timeout: Option<Duration>,
    wait_for_ready: bool,
    balance: Balance,
    interceptors: Chain,
    /// Round-robin position.
    next: AtomicUsize,
    /// Callers waiting for a connection.
    ready: Ready,
    /// Connections of endpoints the resolver dropped, kept until their
    /// calls finish (a blocked caller does not hold its connection).
    draining: Mutex<Vec<Arc<Connection>>>,
}

/// How connecting is done, for the first connection and every reconnection.
struct Settings {
    config: Config,
    credential: Option<Arc<dyn Credential>>,
    tls: Option<crate::fabric::ClientTls>,
    /// `None`: a failed connection stays failed.
    backoff: Option<Backoff>,
}

/// One endpoint of a channel.
struct Target {
    url: FabricUrl,
    /// Where to connect instead when `url` cannot be (see
    /// [`ChannelBuilder::fallback`]).
    fallback: Option<FabricUrl>,
    /// The live connection, if any: read without a lock by every call.
    current: ArcSwapOption<Connection>,
    state: Mutex<TargetState>,
    /// Whether the last health check found it serving (true until one
    /// says otherwise, and without health checks).
    serving: AtomicBool,
    /// The resolver no longer names it: it is not reconnected.
    removed: AtomicBool,
}

impl Target {
    fn new(url: FabricUrl, fallback: Option<FabricUrl>) -> Arc<Target> {
        Arc::new(Target {
            url,
            fallback,
            current: ArcSwapOption::empty(),
            state: Mutex::new(TargetState::default()),
            serving: AtomicBool::new(true),
            removed: AtomicBool::new(false),
        })
    }

    /// Its live connection, if it has one and it is serving.
    fn usable(&self) -> Option<Arc<Connection>> {
        self.current
            .load_full()
            .filter(|_| self.serving.load(Ordering::Relaxed))
    }
}

#[derive(Default)]
struct TargetState {
    /// Failed attempts in a row.
    failures: u32,
    /// An attempt is scheduled or under way.
    reconnecting: bool,
    /// Why the last connection or attempt failed.
    last_error: Option<Status>,
    /// What the last health check said.
    health: Option<String>,
}

/// How a channel over several endpoints picks one for each call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Balance {
    /// Each connected endpoint in turn (the default).
    #[default]
    RoundRobin,
    /// The connected endpoint with the fewest calls and streams
    /// outstanding on this channel (ties in turn).
    LeastOutstanding,
}

/// A stream started on a connection: its id, core, connection and
/// observation.
type StreamStarted = (CallId, Arc<StreamCore>, Arc<Connection>, CallObs);

/// Starts a stream once a connection is up (`Pending` meanwhile, its
/// waker registered).
type StreamOpener = Box<dyn FnMut(&mut Context<'_>) -> Poll<Result<StreamStarted, Status>> + Send>;

/// How a stream's start went: now (started or failed), or later, once a
/// connection is up (wait-for-ready), by polling the opener.
enum Opened {
    Now(Result<StreamStarted, Status>),
    Later(StreamOpener),
}

/// A stream that waits to start (see [`Channel::opener`]).
struct Deferred {
    method: &'static MethodDescriptor,
    metadata: Metadata,
    deadline: Option<Instant>,
    /// The request message of a server-streaming call, encoded.
    first: Option<Encoded>,
    final_message: bool,
    /// Whether it waits for a connection to come up, or fails
    /// `Unavailable` without one (it always waits for room on one).
    wait_for_ready: bool,
}

/// What one try to start a waiting stream came to.
enum Attempt {
    Done(Result<StreamStarted, Status>),
    /// No connection is up.
    NoConnection,
    /// The connection has as many streams as its server serves at once.
    Full,
}

/// An encoded message, sent as it is (the first request of a stream that
/// waited for a connection).
#[derive(Debug, Default, Clone, PartialEq)]
struct Encoded(Vec<u8>);

impl prost::Message for Encoded {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl prost::bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Never decoded: only sent.
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// The metadata key naming a `grpc://` call's server, for the gateway.
pub(crate) const GATEWAY_TARGET: &str = "rpc-gateway-target";
/// The metadata key naming a `grpc://` call's method path, for the gateway.
pub(crate) const GATEWAY_PATH: &str = "rpc-gateway-path";
/// The metadata key naming the TLS settings of a `grpc://` call's channel
/// (registered with the gateway), if it has any.
pub(crate) const GATEWAY_TLS: &str = "rpc-gateway-tls";

/// One connection of a channel, shared by the calls made on it.
struct Connection {
    /// Where it connected.
    url: FabricUrl,
    client: ClientInner,
    /// How long a caller polls for its response before it sleeps, at least.
    spin: Duration,
    /// Calls and streams of this channel outstanding on it.
    outstanding: AtomicUsize,
    /// How many streams it may have open at once, as its server said.
    streams: Arc<StreamLimit>,
    /// A `grpc://` connection's TLS settings, as the gateway knows them.
    gateway_tls: Option<String>,
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
        self.ep.role.unwatch(&self.conn);
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
    urls: Vec<String>,
    config: Config,
    timeout: Option<Duration>,
    credential: Option<Arc<dyn Credential>>,
    tls: Option<crate::fabric::ClientTls>,
    backoff: Option<Backoff>,
    wait_for_ready: bool,
    balance: Balance,
    fallback: Option<String>,
    interceptors: Chain,
    /// With `urls` empty: where the endpoints come from.
    resolver: Option<Arc<dyn Resolver>>,
    resolve_interval: Duration,
    /// The service to health-check endpoints for, if any.
    health: Option<String>,
    health_interval: Duration,
}

impl fmt::Debug for ChannelBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelBuilder")
            .field("urls", &self.urls)
            .field("config", &self.config)
            .field("timeout", &self.timeout)
            .field("credential", &self.credential.is_some())
            .field("tls", &self.tls.is_some())
            .field("backoff", &self.backoff)
            .field("wait_for_ready", &self.wait_for_ready)
            .field("balance", &self.balance)
            .field("fallback", &self.fallback)
            .field("interceptors", &self.interceptors)
            .field("resolver", &self.resolver.is_some())
            .field("resolve_interval", &self.resolve_interval)
            .field("health", &self.health)
            .field("health_interval", &self.health_interval)
            .finish()
    }
}

impl ChannelBuilder {
    /// Default timeout of every call (none by default); [`Request::set_timeout`] overrides it.
    ///
    /// It bounds streams too, from start to end: a stream meant to outlive
    /// it (a health `Watch`, a feed) sets its own, `Duration::MAX` for none.
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

    /// How long connecting may take (default 5 s): reaching the server and
    /// both handshakes (TLS, if used, and the exchange of endpoints), all
    /// within it, however slowly the server answers.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// How to space reconnection attempts after a connection fails
    /// (default: [`Backoff::default`], 50 ms growing to 1 s).
    pub fn reconnect_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// Whether the channel reconnects by itself after its connection fails
    /// (default `true`). With `false`, a failed connection stays failed and
    /// every later call fails with `Unavailable`: open a new channel.
    pub fn reconnect(mut self, reconnect: bool) -> Self {
        self.backoff = reconnect.then(|| self.backoff.unwrap_or_default());
        self
    }

    /// Whether calls and streams made while no connection is up wait for
    /// one, until their deadline (gRPC's wait-for-ready), instead of
    /// failing at once with `Unavailable` (default `false`; a call may
    /// choose with [`Request::set_wait_for_ready`]). A waiting stream
    /// starts on the first connection up: its `Streaming` and its request
    /// sender wait for it, whichever is used first.
    pub fn wait_for_ready(mut self, wait: bool) -> Self {
        self.wait_for_ready = wait;
        self
    }

    /// Where to connect when the channel's URL cannot be connected: for
    /// example `tcp://host:port` for an `rdma://` URL, for hosts without an
    /// RDMA device or servers without RDMA. Each connection attempt tries
    /// the URL first, then the fallback, logging a warning with why the URL
    /// failed; a reconnection tries the URL again, so a channel moves back
    /// to RDMA once it works. For a channel of one endpoint (connecting
    /// fails with `InvalidArgument` otherwise).
    pub fn fallback(mut self, url: &str) -> Self {
        self.fallback = Some(url.to_owned());
        self
    }

    /// Adds an interceptor: it sees every call (unary and streams) before
    /// it is sent, may change its metadata, and may fail it with a status
    /// (see [`crate::interceptor`]). Interceptors run in the order added.
    pub fn interceptor(mut self, interceptor: impl Interceptor) -> Self {
        self.interceptors.push(interceptor);
        self
    }

    /// How calls are spread over several endpoints (default round robin).
    pub fn balance(mut self, balance: Balance) -> Self {
        self.balance = balance;
        self
    }

    /// Health-checks every endpoint with the standard health service:
    /// `grpc.health.v1.Health/Check` for `service` (`package.Service`, or
    /// `""` for the server as a whole), as soon as it connects and then
    /// every [`ChannelBuilder::health_check_interval`]. An endpoint whose
    /// check says anything but `SERVING`, or does not answer within the
    /// interval, gets no calls until a check says `SERVING` again; a
    /// server without the health service (`Unimplemented`) is taken to
    /// serve. With every endpoint out, calls fail with `Unavailable` (or
    /// wait for one, with wait-for-ready). Off by default. Checks carry
    /// the channel's interceptors' metadata (a token, say).
    pub fn health_check(mut self, service: &str) -> Self {
        self.health = Some(service.to_owned());
        self
    }

    /// How often [`ChannelBuilder::health_check`] asks (default 1 s, at
    /// least 10 ms); also how long a check may take.
    pub fn health_check_interval(mut self, interval: Duration) -> Self {
        self.health_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How often a [`Channel::resolve`] channel asks its resolver again
    /// (default 30 s, at least 100 ms).
    pub fn resolve_interval(mut self, interval: Duration) -> Self {
        self.resolve_interval = interval.max(Duration::from_millis(100));
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
    /// (default 50 µs, from the call's start or the last responses it saw
    /// handled meanwhile; longer while recent responses came within 1 ms).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// How often an idle connection sends a heartbeat (default 1 s, at
    /// least 10 ms; what one is on each fabric: [`DEFAULT_HEARTBEAT`](crate::DEFAULT_HEARTBEAT)),
    /// or `None` for none. The server's transport must
    /// acknowledge each, so a server host that vanished (power, link) fails
    /// every pending call with `Unavailable` within 5 s with the default (about
    /// 2.5 s on rdma://; see [`heartbeat_bound`](crate::heartbeat_bound));
    /// without heartbeats, only TCP keepalive notices, after 20 s.
    pub fn heartbeat(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat = interval;
        self
    }

    /// Connects: to the endpoint, or to each of several, at once on this
    /// thread. Fails if no endpoint can be reached (with the first
    /// endpoint's error); endpoints that fail while others connect are
    /// retried in the background.
    pub fn connect(self) -> Result<Channel, Status> {
        let channel = self.build()?;
        if let Some(resolving) = &channel.inner.resolver {
            // The first answer, at once: connecting needs endpoints.
            channel.inner.resolve_now(false)?;
            Handle::schedule_resolve(&channel.inner, Instant::now() + resolving.interval());
        }
        let mut first_error = None;
        let mut any = false;
        for target in channel.inner.targets.load().iter() {
            match target.open(&channel.inner.settings) {
                Ok(conn) => {
                    channel.inner.install(target, conn);
                    any = true;
                }
                Err(status) => {
                    channel.inner.failed(target, status.clone());
                    first_error.get_or_insert(status);
                }
            }
        }
        match first_error {
            Some(status) if !any => Err(status),
            _ => Ok(channel),
        }
    }

    /// [`ChannelBuilder::connect`] for async code: connects on a thread of
    /// the process's blocking pool (see [`crate::blocking`]), so the task
    /// that awaits it holds up no executor thread however long the
    /// handshakes take (up to the connect timeout).
    pub fn connect_async(self) -> crate::Blocking<Result<Channel, Status>> {
        crate::blocking(move || self.connect())
    }

    /// A channel that connects in the background: it returns at once, and
    /// calls made before a connection is up fail with `Unavailable` or
    /// wait for it ([`ChannelBuilder::wait_for_ready`]). Fails only on a
    /// malformed URL or setting.
    pub fn connect_lazy(self) -> Result<Channel, Status> {
        let mut builder = self;
        if builder.backoff.is_none() {
            // A lazy channel that never retried would never connect at all.
            builder.backoff = Some(Backoff::default());
        }
        let channel = builder.build()?;
        if channel.inner.resolver.is_some() {
            Handle::schedule_resolve(&channel.inner, Instant::now());
        }
        for target in channel.inner.targets.load().iter() {
            channel.inner.schedule(target, Instant::now());
        }
        Ok(channel)
    }

    fn build(self) -> Result<Channel, Status> {
        self.config.validate()?;
        if self.urls.is_empty() && self.resolver.is_none() {
            return Err(Status::invalid_argument("a channel needs at least one URL"));
        }
        if self.fallback.is_some() && (self.urls.len() > 1 || self.resolver.is_some()) {
            return Err(Status::invalid_argument(
                "a fallback URL is for a channel of one endpoint",
            ));
        }
        let fallback = self.fallback.as_deref().map(FabricUrl::parse).transpose()?;
        let targets = self
            .urls
            .iter()
            .map(|u| Ok(Target::new(FabricUrl::parse(u)?, fallback.clone())))
            .collect::<Result<Vec<_>, Status>>()?;
        let (url, resolver, tls) = match self.resolver {
            None => {
                let urls: Vec<_> = targets.iter().map(|t| t.url.to_string()).collect();
                (urls.join(","), None, self.tls)
            }
            Some(resolver) => {
                // Certificates name the host, not the addresses it
                // resolves to.
                let tls = match (self.tls, resolver.server_name()) {
                    (Some(tls), Some(name)) => Some(tls.with_default_domain(name)?),
                    (tls, _) => tls,
                };
                let resolving = endpoints::Resolving::new(resolver, self.resolve_interval);
                (resolving.name(), Some(resolving), tls)
            }
        };
        let single = match (&resolver, targets.as_slice()) {
            (None, [only]) => Some(only.clone()),
            _ => None,
        };
        Ok(Channel {
            inner: Arc::new(Handle {
                single,
                targets: ArcSwap::from_pointee(targets),
                settings: Arc::new(Settings {
                    config: self.config,
                    credential: self.credential,
                    tls,
                    backoff: self.backoff,
                }),
                url,
                resolver,
                health: self.health.map(|service| endpoints::HealthCheck {
                    service,
                    interval: self.health_interval,
                }),
                default_timeout: self.timeout,
                wait_for_ready: self.wait_for_ready,
                balance: self.balance,
                interceptors: self.interceptors,
                next: AtomicUsize::new(0),
                ready: Ready::default(),
                draining: Mutex::default(),
            }),
        })
    }
}

impl Handle {
    /// A live connection for the next call, as [`Balance`] says; marks the
    /// dead ones it meets for reconnection.
    fn pick(self: &Arc<Self>) -> Result<Arc<Connection>, Status> {
        if let Some(target) = &self.single {
            return self.pick_from(target);
        }
        let targets = self.targets.load();
        let n = targets.len();
        if n == 1 {
            return self.pick_from(&targets[0]);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<Arc<Connection>> = None;
        for k in 0..n {
            let target = &targets[(start + k) % n];
            let Some(c) = target.usable() else {
                continue;
            };
            if !c.is_alive() {
                self.lost(target, &c);
                continue;
            }
            match self.balance {
                Balance::RoundRobin => return Ok(c),
                Balance::LeastOutstanding => {
                    let fewer = best.as_ref().is_none_or(|b| {
                        c.outstanding.load(Ordering::Relaxed)
                            < b.outstanding.load(Ordering::Relaxed)
                    });
                    if fewer {
                        best = Some(c);
                    }
                }
            }
        }
        best.ok_or_else(|| self.unavailable())
    }

    /// [`Handle::pick`] for a stream: a connection with room for one more
    /// under its server's stream limit, if any has; else any.
    fn pick_for_stream(self: &Arc<Self>) -> Result<Arc<Connection>, Status> {
        let picked = self.pick()?;
        if picked.streams.has_room() || self.single.is_some() {
            return Ok(picked);
        }
        let targets = self.targets.load();
        let n = targets.len();
        let start = self.next.load(Ordering::Relaxed);
        let roomy = (0..n)
            .filter_map(|k| targets[(start + k) % n].usable())
            .find(|c| c.is_alive() && c.streams.has_room());
        Ok(roomy.unwrap_or(picked))
    }

    /// For a stream that found `full` at its server's stream limit: a place
    /// on another of the channel's live connections, if one has room;
    /// otherwise `waker` is woken (through `waiting`) once a stream ends on
    /// any of them, not only on `full`.
    fn open_elsewhere(
        &self,
        full: &Arc<Connection>,
        waiting: &Arc<Waiting>,
        waker: &Waker,
    ) -> Option<(Arc<Connection>, StreamPermit)> {
        if self.single.is_some() {
            return None;
        }
        let targets = self.targets.load();
        targets
            .iter()
            .filter_map(|t| t.usable())
            .filter(|c| !Arc::ptr_eq(c, full) && c.is_alive())
            .find_map(|c| c.streams.open_or_wake(waiting, waker).map(|p| (c, p)))
    }

    /// Of the places `handed` to a waiting stream, one on `picked` or on
    /// another of the channel's live connections, with that connection;
    /// the others go on to the next streams waiting for them.
    fn handed_place(
        &self,
        picked: &Arc<Connection>,
        handed: Vec<StreamPermit>,
    ) -> Option<(Arc<Connection>, StreamPermit)> {
        if handed.is_empty() {
            return None;
        }
        let targets = self.targets.load();
        handed.into_iter().find_map(|permit| {
            let conn = if permit.is_on(&picked.streams) {
                Some(picked.clone())
            } else {
                targets
                    .iter()
                    .filter_map(|t| t.usable())
                    .find(|c| c.is_alive() && permit.is_on(&c.streams))
            };
            conn.map(|c| (c, permit))
        })
    }

    /// `target`'s live connection, if it serves; a dead one is taken out.
    fn pick_from(self: &Arc<Self>, target: &Arc<Target>) -> Result<Arc<Connection>, Status> {
        match target.usable() {
            Some(c) if c.is_alive() => Ok(c),
            dead => {
                if let Some(c) = dead {
                    self.lost(target, &c);
                }
                Err(self.unavailable())
            }
        }
    }

    /// The status of a call made with no connection up.
    fn unavailable(&self) -> Status {
        let targets = self.targets.load();
        let not_serving = targets
            .iter()
            .find(|t| t.current.load().is_some() && !t.serving.load(Ordering::Relaxed));
        let why = targets
            .iter()
            .find_map(|t| t.lock().last_error.as_ref().map(|s| s.message().to_owned()))
            .or_else(|| not_serving.map(|t| self.not_serving_reason(t)))
            .or_else(|| self.resolver.as_ref().and_then(|r| r.last_error()))
            .unwrap_or_else(|| "not connected yet".to_owned());
        let retry = if self.settings.backoff.is_some() {
            "; reconnecting"
        } else {
            "; reconnection is off: open a new channel"
        };
        Status::unavailable(format!("no connection to {}: {why}{retry}", self.url))
    }

    /// Whether callers may wait for a connection: one may come.
    fn may_reconnect(&self) -> bool {
        self.settings.backoff.is_some()
    }

    /// Connection `dead` of `target` failed: takes it out and schedules
    /// a reconnection (once).
    fn lost(self: &Arc<Self>, target: &Arc<Target>, dead: &Arc<Connection>) {
        let current = target.current.load();
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, dead)) {
            return; // already replaced
        }
        target.current.store(None);
        let why = dead.death();
        tracing::info!(url = %target.url, %why, "connection lost; reconnecting");
        self.failed(
            target,
            Status::unavailable(format!("connection lost: {why}")),
        );
    }

    /// `target` has no connection because of `status`: schedules the
    /// next attempt after the backoff.
    fn failed(self: &Arc<Self>, target: &Arc<Target>, status: Status) {
        let Some(backoff) = self.settings.backoff else {
            target.lock().last_error = Some(status);
            return;
        };
        if target.removed.load(Ordering::Relaxed) {
            return;
        }
        let delay = {
            let mut st = target.lock();
            st.last_error = Some(status);
            if st.reconnecting {
                return;
            }
            st.failures = st.failures.saturating_add(1);
            backoff.delay(st.failures)
        };
        self.schedule(target, Instant::now() + delay);
    }

    /// Attempts to connect `target` at `at`, unless an attempt is due.
    fn schedule(self: &Arc<Self>, target: &Arc<Target>, at: Instant) {
        {
            let mut st = target.lock();
            if st.reconnecting {
                return;
            }
            st.reconnecting = true;
        }
        let weak = Arc::downgrade(self);
        let weak_target = Arc::downgrade(target);
        reconnect::schedule(at, move || Handle::attempt(weak, weak_target));
    }

    /// One attempt to connect `target`, on a thread of its own. Neither
    /// the channel nor the target is kept alive meanwhile: if every handle
    /// to the channel goes away, or the resolver drops the target, the new
    /// connection is closed.
    fn attempt(weak: Weak<Handle>, weak_target: Weak<Target>) {
        let (Some(h), Some(target)) = (weak.upgrade(), weak_target.upgrade()) else {
            return;
        };
        let settings = h.settings.clone();
        drop(h);
        let outcome = Target::connect(&target.url, target.fallback.as_ref(), &settings);
        let Some(handle) = weak.upgrade() else {
            return;
        };
        target.lock().reconnecting = false;
        if target.removed.load(Ordering::Relaxed) {
            return;
        }
        let url = &target.url;
        if target.current.load().as_ref().is_some_and(|c| c.is_alive()) {
            // Connected meanwhile by another way (`connect`): keep that one,
            // whose calls are under way; this one closes unused.
            return;
        }
        match outcome {
            Ok(conn) => {
                tracing::info!(%url, "reconnected");
                crate::observe::reconnected();
                handle.install(&target, conn);
            }
            Err(status) => {
                tracing::debug!(%url, %status, "reconnection attempt failed");
                handle.failed(&target, status);
            }
        }
    }

    /// Makes `conn` `target`'s connection and wakes whoever waits.
    fn install(self: &Arc<Self>, target: &Arc<Target>, conn: Connection) {
        let conn = Arc::new(conn);
        {
            let mut st = target.lock();
            st.failures = 0;
            st.last_error = None;
        }
        target.serving.store(true, Ordering::Relaxed);
        // Learn of its failure as it happens, not only at the next call,
        // so that reconnection starts at once.
        let weak = Arc::downgrade(self);
        let weak_target = Arc::downgrade(target);
        let dead = Arc::downgrade(&conn);
        conn.watch(Box::new(move || {
            if let (Some(h), Some(t), Some(c)) =
                (weak.upgrade(), weak_target.upgrade(), dead.upgrade())
            {
                h.lost(&t, &c);
            }
        }));
        target.current.store(Some(conn.clone()));
        // After the store: a check finding another connection there ends.
        if self.health.is_some() {
            Handle::schedule_health_check(self, target, &conn, Instant::now());
        }
        self.ready.notify();
    }
}

impl Target {
    fn lock(&self) -> std::sync::MutexGuard<'_, TargetState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connects this endpoint (or its fallback).
    fn open(&self, settings: &Settings) -> Result<Connection, Status> {
        Target::connect(&self.url, self.fallback.as_ref(), settings)
    }

    /// Connects to `url`, or if that fails, to `fallback`; the error is
    /// `url`'s when both fail.
    fn connect(
        url: &FabricUrl,
        fallback: Option<&FabricUrl>,
        settings: &Settings,
    ) -> Result<Connection, Status> {
        let status = match Connection::open(url, settings) {
            Ok(conn) => return Ok(conn),
            Err(status) => status,
        };
        let Some(fallback) = fallback else {
            return Err(status);
        };
        match Connection::open(fallback, settings) {
            Ok(conn) => {
                tracing::warn!(%url, %fallback, %status, "cannot connect; using the fallback");
                Ok(conn)
            }
            Err(second) => Err(Status::new(
                status.code(),
                format!(
                    "{}; fallback {fallback}: {}",
                    status.message(),
                    second.message()
                ),
            )),
        }
    }
}

impl Channel {
    /// Connects to `url` with default settings: `mem://name`, `tcp://host:port`
    /// or `rdma://host:port`, or `grpc://host:port` for a standard gRPC
    /// server (HTTP/2 without TLS, through tonic; feature `grpc`).
    pub fn connect(url: &str) -> Result<Channel, Status> {
        Channel::builder(url).connect()
    }

    /// [`Channel::connect`] for async code (see
    /// [`ChannelBuilder::connect_async`]).
    pub fn connect_async(url: &str) -> crate::Blocking<Result<Channel, Status>> {
        Channel::builder(url).connect_async()
    }

    /// A builder for a channel to `url`.
    pub fn builder(url: &str) -> ChannelBuilder {
        Channel::balance([url])
    }

    /// A builder for a channel over several endpoints (all serving the same
    /// services): each call goes to one that is connected, as
    /// [`ChannelBuilder::balance`] says; one that fails is left out while it
    /// reconnects.
    pub fn balance<I, S>(urls: I) -> ChannelBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        ChannelBuilder {
            urls: urls.into_iter().map(|u| u.as_ref().to_owned()).collect(),
            config: Config::default(),
            timeout: None,
            credential: None,
            tls: None,
            backoff: Some(Backoff::default()),
            wait_for_ready: false,
            balance: Balance::default(),
            fallback: None,
            interceptors: Chain::default(),
            resolver: None,
            resolve_interval: endpoints::DEFAULT_RESOLVE_INTERVAL,
            health: None,
            health_interval: endpoints::DEFAULT_HEALTH_INTERVAL,
        }
    }

    /// A builder for a channel whose endpoints come from `resolver` (such
    /// as [`Dns`]), asked again every [`ChannelBuilder::resolve_interval`]:
    /// endpoints it adds are connected, endpoints it no longer names are
    /// closed (calls in flight on them finish), and calls are spread over
    /// the connected ones as [`ChannelBuilder::balance`] says. When the
    /// resolver fails, the channel keeps the endpoints it has.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), rpc_core::Status> {
    /// use rpc_core::{Channel, client::Dns};
    /// // Every address of kv.internal, looked up again every 30 s.
    /// let channel = Channel::resolve(Dns::new("tcp://kv.internal:7471")?)
    ///     .health_check("kv.Kv")
    ///     .connect()?;
    /// # Ok(()) }
    /// ```
    pub fn resolve(resolver: impl Resolver) -> ChannelBuilder {
        ChannelBuilder {
            resolver: Some(Arc::new(resolver)),
            ..Channel::balance(std::iter::empty::<&str>())
        }
    }

    /// The URL this channel connects to (several, comma-separated).
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Whether a connection is up (to at least one endpoint).
    pub fn is_connected(&self) -> bool {
        self.inner
            .targets
            .load()
            .iter()
            .any(|t| t.current.load().as_ref().is_some_and(|c| c.is_alive()))
    }

    /// The URLs of the connections up now (the fallback's, if the channel
    /// fell back to it).
    pub fn connected_urls(&self) -> Vec<String> {
        self.inner
            .targets
            .load()
            .iter()
            .filter_map(|t| t.current.load_full())
            .filter(|c| c.is_alive())
            .map(|c| c.url.to_string())
            .collect()
    }

    /// Waits until a connection is up, or `timeout` passes; true if one is.
    pub fn wait_connected(&self, timeout: Duration) -> bool {
        let deadline = crate::deadline_after(timeout);
        loop {
            let generation = self.inner.ready.generation();
            if self.is_connected() {
                return true;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) || !self.inner.may_reconnect() {
                return false;
            }
            self.inner.ready.wait(generation, deadline);
        }
    }

    /// The completion queue and queue pair number under this channel, if
    /// it is `rdma://` (tests inject device events through them).
    #[cfg(all(test, feature = "verbs"))]
    pub(crate) fn verbs_queue(&self) -> Option<(crate::fabric::verbs::VerbsCq, u32)> {
        let conn = self.inner.targets.load().first()?.current.load_full()?;
        match &conn.client {
            ClientInner::Verbs(c) => Some((c.ep.cq.clone(), c.conn.qp_num)),
            ClientInner::Soft(_) => None,
        }
    }

    /// Responses dropped because they arrived after their call ended (timed
    /// out or cancelled), or named no call of this channel: on the
    /// connections up now.
    pub fn stale_responses(&self) -> u64 {
        self.inner
            .targets
            .load()
            .iter()
            .filter_map(|t| t.current.load_full())
            .map(|c| with_client!(&c.client, x => x.conn.stale_responses()))
            .sum()
    }

    /// Runs the channel's interceptors on a call's metadata.
    fn intercept(&self, method: &MethodDescriptor, metadata: &mut Metadata) -> Result<(), Status> {
        if self.inner.interceptors.is_empty() {
            return Ok(());
        }
        self.inner.interceptors.run(method.path, metadata, None)
    }

    /// Whether `request` waits for a connection when none is up.
    fn waits_for_ready<T>(&self, request: &Request<T>) -> bool {
        request
            .wait_for_ready()
            .unwrap_or(self.inner.wait_for_ready)
            && self.inner.may_reconnect()
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
        crate::stages::mark(crate::stages::Stage::CallStart);
        let mut request = request;
        if let Err(status) = self.intercept(method, request.metadata_mut()) {
            return UnaryCall::failed(status);
        }
        let (obs, trace) = CallObs::client(method.path, &self.inner.url, request.metadata());
        if let Some(trace) = trace {
            let _ = request.metadata_mut().insert(TRACEPARENT, trace);
        }
        let _in = obs.span().clone().entered();
        let timeout = request.budget(self.inner.default_timeout);
        let conn = match self.inner.pick() {
            Ok(conn) => conn,
            Err(status) => {
                if !self.waits_for_ready(&request) {
                    return UnaryCall::failed(status).observed_by(obs);
                }
                return UnaryCall::waiting(Pending {
                    handle: self.inner.clone(),
                    method,
                    metadata: request.metadata().clone(),
                    payload: request.get_ref().encode_to_vec(),
                    fail_fast: request.fail_fast(),
                    deadline: timeout.and_then(crate::deadline_after),
                })
                .observed_by(obs);
            }
        };
        let message = request.get_ref();
        let metadata = conn.gateway_metadata(method, request.metadata());
        let started = conn.start(
            method.id,
            &metadata,
            request.fail_fast(),
            timeout,
            message.encoded_len(),
            &mut |buf| crate::dispatch::encode_exact(message, buf),
        );
        match started {
            Ok(sent) => UnaryCall::started(conn, sent),
            Err(status) => UnaryCall::failed(status),
        }
        .observed_by(obs)
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
        let wait = self.waits_for_ready(&request);
        let opened = self.open_stream(
            method,
            request.metadata(),
            timeout,
            Some(request.get_ref()),
            false,
            wait,
        );
        Self::incoming(opened, |_| None)
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
        let wait = self.waits_for_ready(&request);
        let metadata = request.metadata().clone();
        let stream = request.into_inner();
        let opened = self.open_stream::<()>(method, &metadata, timeout, None, final_message, wait);
        Self::incoming(opened, move |outbox| {
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
        let wait = self.waits_for_ready(&request);
        let opened = self.open_stream::<()>(
            method,
            request.metadata(),
            timeout,
            None,
            final_message,
            wait,
        );
        let mut opener = match opened {
            Opened::Now(Ok(started)) => {
                let (parts, outbox) = Self::parts(started);
                let stream =
                    Streaming::new(parts.core, parts.link, parts.call_id, parts.owner, None);
                return (RequestSender::new(outbox), stream);
            }
            Opened::Now(Err(status)) => {
                return (
                    RequestSender::new(Outbox::closed()),
                    Streaming::failed(status),
                );
            }
            Opened::Later(opener) => opener,
        };
        let opening = Opening::new(Box::new(move |cx| {
            opener(cx).map(|started| {
                let (mut parts, outbox) = Self::parts(started?);
                parts.outbox = Some(outbox);
                Ok(parts)
            })
        }));
        (
            RequestSender::waiting(opening.clone()),
            Streaming::waiting(opening),
        )
    }

    /// Starts a stream on a connection now, or, for a call that waits for
    /// ready when none is up, later (see [`Opened::Later`]).
    fn open_stream<Req: prost::Message>(
        &self,
        method: &'static MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
        wait: bool,
    ) -> Opened {
        // Copied only if something adds to it (or the stream waits).
        let mut metadata = std::borrow::Cow::Borrowed(metadata);
        if !self.inner.interceptors.is_empty() {
            if let Err(status) = self.intercept(method, metadata.to_mut()) {
                return Opened::Now(Err(status));
            }
        }
        let (mut obs, trace) = CallObs::client(method.path, &self.inner.url, &metadata);
        if let Some(trace) = trace {
            let _ = metadata.to_mut().insert(TRACEPARENT, trace);
        }
        let _in = obs.span().clone().entered();
        let picked = self.inner.pick_for_stream();
        // A connection at its server's stream limit makes the stream wait,
        // as does no connection for a call that waits for ready.
        let later = |metadata: std::borrow::Cow<'_, Metadata>, obs| {
            let deferred = Deferred {
                method,
                metadata: metadata.into_owned(),
                deadline: timeout.and_then(crate::deadline_after),
                first: first.map(|m| Encoded(m.encode_to_vec())),
                final_message,
                wait_for_ready: wait,
            };
            Opened::Later(Self::opener(self.inner.clone(), deferred, obs))
        };
        let (conn, permit) = match picked {
            Ok(conn) => match conn.streams.try_open() {
                Some(permit) => (conn, permit),
                None => return later(metadata, obs),
            },
            Err(_) if wait => return later(metadata, obs),
            Err(status) => {
                obs.finish(status.code());
                return Opened::Now(Err(status));
            }
        };
        let metadata = conn.gateway_metadata(method, &metadata);
        let started = with_client!(&conn.client, c => c.start_stream(method, &metadata, timeout, first, final_message, permit));
        Opened::Now(match started {
            Ok((id, core)) => Ok((id, core, conn, obs)),
            Err(status) => {
                obs.finish(status.code());
                Err(status)
            }
        })
    }

    /// Starts a stream once a connection is up (if it waits for ready)
    /// and has room for it under its server's stream limit, or fails it
    /// with `DeadlineExceeded` at its deadline.
    fn opener(handle: Arc<Handle>, deferred: Deferred, obs: CallObs) -> StreamOpener {
        let Deferred {
            method,
            metadata,
            deadline,
            first,
            final_message,
            wait_for_ready,
        } = deferred;
        let mut obs = Some(obs);
        let ready = handle.clone();
        // Woken through it when a full connection's stream ends, or when a
        // connection comes up.
        let waiting = Arc::new(Waiting::default());
        let on_ready = waiting.clone();
        let mut listed_on_ready = false;
        // The stream limit of the connection it last found full.
        let mut full = None;
        let mut try_start = move |waker: &Waker| -> Attempt {
            let timeout = match deadline {
                Some(at) => match at.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => {
                        let status = Status::deadline_exceeded(match full {
                            Some(limit) => format!(
                                "deadline exceeded waiting for one of the {limit} streams its \
                                 server serves at once on a connection to end \
                                 (ServerBuilder::max_concurrent_streams)"
                            ),
                            None => format!(
                                "deadline exceeded waiting for a connection ({})",
                                handle.unavailable().message()
                            ),
                        });
                        if let Some(mut obs) = obs.take() {
                            obs.finish(status.code());
                        }
                        return Attempt::Done(Err(status));
                    }
                },
                None => None,
            };
            let conn = match handle.pick_for_stream() {
                Ok(conn) => conn,
                Err(_) if wait_for_ready => {
                    full = None;
                    return Attempt::NoConnection;
                }
                // It waited for room, and the connection went.
                Err(status) => {
                    if let Some(mut obs) = obs.take() {
                        obs.finish(status.code());
                    }
                    return Attempt::Done(Err(status));
                }
            };
            // A place a stream's end handed over, or one free now.
            let opened = match handle.handed_place(&conn, waiting.take_handed()) {
                Some(handed) => Some(handed),
                None => match conn.streams.open_or_wake(&waiting, waker) {
                    Some(permit) => Some((conn.clone(), permit)),
                    None => handle.open_elsewhere(&conn, &waiting, waker),
                },
            };
            let Some((conn, permit)) = opened else {
                full = Some(conn.streams.max());
                return Attempt::Full;
            };
            let Some(mut obs) = obs.take() else {
                return Attempt::Done(Err(Status::internal("the stream was started twice")));
            };
            let started = {
                let _in = obs.span().clone().entered();
                let metadata = conn.gateway_metadata(method, &metadata);
                with_client!(&conn.client, c => c.start_stream(method, &metadata, timeout, first.as_ref(), final_message, permit))
            };
            Attempt::Done(match started {
                Ok((id, core)) => Ok((id, core, conn, obs)),
                Err(status) => {
                    obs.finish(status.code());
                    Err(status)
                }
            })
        };
        // Once it started or gave up, the places handed to it go on.
        let finishing = on_ready.clone();
        let mut try_start = move |waker: &Waker| {
            let attempt = try_start(waker);
            if matches!(attempt, Attempt::Done(_)) {
                finishing.finish();
            }
            attempt
        };
        // The waker the deadline wakes while the stream waits for room.
        let mut timer: Option<Waker> = None;
        Box::new(move |cx| match try_start(cx.waker()) {
            Attempt::Done(started) => Poll::Ready(started),
            // Woken when a stream ends on one of the full connections (their
            // limits took the waker), or at the deadline.
            Attempt::Full => {
                if let Some(at) = deadline {
                    if !timer.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        timer = Some(cx.waker().clone());
                        reconnect::wake_at(at, cx.waker().clone());
                    }
                }
                if listed_on_ready {
                    return Poll::Pending;
                }
                // A connection that comes up (another endpoint, a
                // reconnect) may have room: woken then too, once listed;
                // and one that came up before that is looked at now.
                ready.ready.register_stream(&on_ready);
                listed_on_ready = true;
                match try_start(cx.waker()) {
                    Attempt::Done(started) => Poll::Ready(started),
                    Attempt::Full | Attempt::NoConnection => Poll::Pending,
                }
            }
            Attempt::NoConnection => {
                ready.ready.register(cx.waker(), deadline);
                // A connection that came up before the waker was in place.
                match try_start(cx.waker()) {
                    Attempt::Done(started) => Poll::Ready(started),
                    Attempt::Full | Attempt::NoConnection => Poll::Pending,
                }
            }
        })
    }

    /// The consumer's end of an opened stream; `pump` makes the request
    /// side from the stream's outbox.
    fn incoming<Resp>(
        opened: Opened,
        pump: impl FnOnce(Outbox) -> Option<Box<dyn Pump>> + Send + 'static,
    ) -> Streaming<Resp> {
        let started = match opened {
            Opened::Now(Ok(started)) => started,
            Opened::Now(Err(status)) => return Streaming::failed(status),
            Opened::Later(mut opener) => {
                let mut pump = Some(pump);
                return Streaming::waiting(Opening::new(Box::new(move |cx| {
                    opener(cx).map(|started| {
                        let (mut parts, outbox) = Self::parts(started?);
                        parts.pump = pump.take().and_then(|p| p(outbox));
                        Ok(parts)
                    })
                })));
            }
        };
        let (parts, outbox) = Self::parts(started);
        let pump = pump(outbox);
        Streaming::new(parts.core, parts.link, parts.call_id, parts.owner, pump)
    }

    /// What a started stream's handles hold, and its request outbox.
    fn parts(started: StreamStarted) -> (StreamParts, Outbox) {
        let (id, core, conn, obs) = started;
        let link: Arc<dyn Link> = with_client!(&conn.client, c => c.conn.clone());
        let outbox = Outbox::new(core.clone(), link.clone(), id, 0, None);
        conn.outstanding.fetch_add(1, Ordering::Relaxed);
        let owner: Arc<dyn CallOwner> = Arc::new(StreamOwner {
            conn,
            core: core.clone(),
            obs,
            turns_seen: AtomicU64::new(0),
        });
        let parts = StreamParts {
            core,
            link,
            call_id: id,
            owner: Some(owner),
            pump: None,
            outbox: None,
        };
        (parts, outbox)
    }
}

impl Connection {
    /// Connects to `url` as `settings` say, on the fabric its scheme names.
    fn open(url: &FabricUrl, settings: &Settings) -> Result<Connection, Status> {
        let (config, credential, tls) = (
            &settings.config,
            settings.credential.clone(),
            settings.tls.clone(),
        );
        let client = match url.scheme {
            Scheme::Mem | Scheme::Tcp => ClientInner::Soft(Client::connect(
                soft_runtime()?,
                url,
                config,
                credential,
                tls,
            )?),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => ClientInner::Verbs(Client::connect(
                &*verbs_runtime(url)?,
                url,
                config,
                credential,
                tls,
            )?),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(url)? {},
            // Through the process's gRPC gateway, an in-process server
            // that passes each call on with tonic (see `gateway_metadata`).
            #[cfg(feature = "grpc")]
            Scheme::Grpc => ClientInner::Soft(Client::connect(
                soft_runtime()?,
                &FabricUrl::parse(crate::grpc::gateway()?)?,
                config,
                None,
                None,
            )?),
            #[cfg(not(feature = "grpc"))]
            Scheme::Grpc => {
                return Err(Status::invalid_argument(
                    "grpc:// needs rpc-core's `grpc` feature",
                ));
            }
        };
        #[cfg(all(feature = "grpc", feature = "tls"))]
        let gateway_tls = match (url.scheme, &settings.tls) {
            (Scheme::Grpc, Some(tls)) => Some(crate::grpc::gateway_tls(&tls.source)),
            _ => None,
        };
        #[cfg(not(all(feature = "grpc", feature = "tls")))]
        let gateway_tls = None;
        let streams = StreamLimit::new(with_client!(&client, c => c.conn.peer_max_streams()));
        Ok(Connection {
            url: url.clone(),
            client,
            spin: config.spin,
            outstanding: AtomicUsize::new(0),
            streams,
            gateway_tls,
        })
    }

    /// For a `grpc://` connection (to the process's gRPC gateway),
    /// `metadata` with what the gateway needs to pass the call on: the
    /// server, and the method's path and kind; other connections' as is.
    fn gateway_metadata<'a>(
        &self,
        method: &MethodDescriptor,
        metadata: &'a Metadata,
    ) -> std::borrow::Cow<'a, Metadata> {
        if self.url.scheme != Scheme::Grpc {
            return std::borrow::Cow::Borrowed(metadata);
        }
        let mut with = metadata.clone();
        let _ = with.insert(GATEWAY_TARGET, self.url.socket_addr());
        let _ = with.insert(GATEWAY_PATH, method.path);
        if let Some(tls) = &self.gateway_tls {
            let _ = with.insert(GATEWAY_TLS, tls.as_str());
        }
        let _ = with.insert(
            crate::server::FALLBACK_KIND,
            crate::server::fallback_kind_name(method.kind),
        );
        std::borrow::Cow::Owned(with)
    }

    fn is_alive(&self) -> bool {
        with_client!(&self.client, c => c.conn.is_alive())
    }

    /// Why the connection failed.
    fn death(&self) -> String {
        with_client!(&self.client, c => c.conn.death()).unwrap_or_else(|| "closed".to_owned())
    }

    /// Calls `on_lost` once the connection fails (on a dispatcher thread:
    /// it must not block), or at once if it has failed already.
    fn watch(&self, on_lost: Box<dyn FnOnce() + Send>) {
        with_client!(&self.client, c => c.ep.role.watch(&c.conn, on_lost));
    }

    /// Sends a unary request of `payload_len` bytes that `fill` encodes.
    fn start(
        self: &Arc<Self>,
        method_id: u32,
        metadata: &Metadata,
        fail_fast: bool,
        timeout: Option<Duration>,
        payload_len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<Sent, Status> {
        // Requests issued back to back leave together, in writes of up to
        // half the calls in flight: fewer, larger writes (a syscall each on
        // tcp://, a doorbell and packets on rdma://), while two batches in
        // flight keep both ends working at once. A lone call leaves at once.
        let batch = self.outstanding.load(Ordering::Relaxed).div_ceil(2);
        let started = with_client!(&self.client, c => c.start(method_id, metadata, fail_fast, timeout, batch, payload_len, fill))?;
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Ok(started)
    }

    /// A call on this connection ended (see `outstanding`).
    fn ended(&self) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    fn cancel(&self, id: CallId) {
        with_client!(&self.client, c => c.cancel(id))
    }

    /// Sends the requests staged on this connection.
    fn uncork(&self) {
        with_client!(&self.client, c => c.conn.uncork())
    }

    /// Whether requests are staged on this connection.
    fn is_corked(&self) -> bool {
        with_client!(&self.client, c => c.conn.is_corked())
    }

    /// Decodes a finished call's outcome and takes back what the call used:
    /// its slot and the buffer its response arrived in.
    fn finish_call<T: prost::Message + Default>(
        &self,
        slot: Arc<CallSlot>,
        outcome: Result<RawReply, Status>,
    ) -> Result<Response<T>, Status> {
        self.ended();
        let mut buf = Default::default();
        let reply = decode_reply(outcome, |b| buf = b);
        with_client!(&self.client, c => {
            c.conn.recycle(buf);
            c.ep.role.release_slot(slot);
        });
        reply
    }

    /// Handles completions on this thread while `slot` waits, for a while.
    /// Polls for `slot`'s outcome on this thread for up to the spin
    /// budget, counted from `since` (when the request was sent, if the
    /// clock was read then) or from the first poll that finds nothing.
    fn poll_for(&self, slot: &CallSlot, since: Option<Instant>) {
        let spin = self.spin;
        with_client!(&self.client, c => {
            c.ep.poll_until(spin, since, || slot.is_done(), || !c.ep.role.calls().is_empty());
        })
    }

    /// Turns the queue once on this thread if nobody else is; true if it did.
    fn try_progress(&self, seen: &mut u64) -> bool {
        with_client!(&self.client, c => c.ep.try_progress(seen))
    }

    /// How long a caller keeps polling for a response before it sleeps.
    fn spin_budget(&self) -> Duration {
        let spin = self.spin;
        with_client!(&self.client, c => c.ep.call_waits.budget(spin))
    }

    /// Notes how long a call waited for its response.
    fn note_wait(&self, wait: Duration) {
        with_client!(&self.client, c => c.ep.call_waits.record(wait))
    }

    /// Makes sure someone handles completions while a call waits.
    fn ensure_polled(&self) {
        with_client!(&self.client, c => c.ep.ensure_polled())
    }
}

/// A client stream's hold on its connection, and its span and metrics.
struct StreamOwner {
    conn: Arc<Connection>,
    core: Arc<StreamCore>,
    obs: CallObs,
    /// Callers' turns of the queue as of this stream's last look (see
    /// `PollHandoff::try_turn`).
    turns_seen: AtomicU64,
}

impl Drop for StreamOwner {
    fn drop(&mut self) {
        self.conn.ended();
        self.obs
            .finish(self.core.end_code().unwrap_or(Code::Cancelled));
    }
}

impl CallOwner for StreamOwner {
    fn release(&self, call_id: CallId) {
        self.conn.cancel(call_id);
    }

    fn progress(&self) -> bool {
        let mut seen = self.turns_seen.load(Ordering::Relaxed);
        let turned = self.conn.try_progress(&mut seen);
        self.turns_seen.store(seen, Ordering::Relaxed);
        turned
    }

    fn ensure_polled(&self) {
        self.conn.ensure_polled();
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
            max_streams: 0,
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
        crate::observe::connection(crate::observe::Side::Client, 1.0);
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
    /// has a timeout (and makes the dispatcher wake for it). Returns its id
    /// and, if the clock was read for the deadline, when that was.
    fn register(&self, waiter: Waiter, timeout: Option<Duration>) -> (CallId, Option<Instant>) {
        let now = timeout.map(|_| Instant::now());
        // A timeout too long for the clock is no deadline at all.
        let deadline = now.zip(timeout).and_then(|(now, t)| now.checked_add(t));
        let call = Call {
            waiter,
            qp_num: self.conn.qp_num,
        };
        let id = self.ep.role.calls().insert(call, deadline);
        if let Some(at) = deadline {
            self.ep.wake_by(at);
        }
        (id, now)
    }

    /// Sends a unary request of `payload_len` bytes that `fill` encodes;
    /// its write may wait for requests that follow until it carries `batch`
    /// of them (see `Conn::send_corked`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        method_id: u32,
        metadata: &Metadata,
        fail_fast: bool,
        timeout: Option<Duration>,
        batch: usize,
        payload_len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<Sent, Status> {
        self.ensure_alive()?;
        let slot = self.ep.role.take_slot();
        let (id, at) = self.register(Waiter::Unary(slot.clone()), timeout);
        let frame = OutFrame {
            kind: FrameKind::Request,
            flags: 0,
            call_id: id,
            method_id,
            status: 0,
            timeout_us: crate::protocol::timeout_field(timeout),
            metadata: Some(metadata),
            payload_len,
        };
        let sent = self.conn.send_corked(&frame, fail_fast, batch, fill);
        match sent {
            Ok(true) => self.ep.corked(&self.conn),
            Ok(false) => {}
            Err(e) => {
                self.ep.role.calls().remove(id);
                return Err(e.into());
            }
        }
        Ok(Sent { id, slot, at })
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
        permit: StreamPermit,
    ) -> Result<(CallId, Arc<StreamCore>), Status> {
        self.ensure_alive()?;
        // Only a client-streaming call's responses are not a stream.
        let core = StreamCore::new(DEFAULT_WINDOW, !final_message);
        let waiter = Waiter::Stream {
            core: core.clone(),
            final_message,
            _permit: permit,
        };
        let (id, _) = self.register(waiter, timeout);
        let frame = OutFrame {
            kind: FrameKind::Request,
            // The call's kind as this call is made (its descriptor could
            // say otherwise, if hand-built): requests streamed unless the
            // one request comes now, responses unless one answer ends it.
            flags: Header::kind_flags(MethodKind::of(first.is_none(), !final_message)),
            call_id: id,
            method_id: method.id,
            status: 0,
            timeout_us: crate::protocol::timeout_field(timeout),
            metadata: Some(metadata),
            payload_len: first.map_or(0, |m| m.encoded_len()),
        };
        let sent = self.conn.send(&frame, false, &mut |buf| {
            if let Some(m) = first {
                crate::dispatch::encode_exact(m, buf)
            }
        });
        if let Err(e) = sent {
            // Its place on the connection goes outside the table's lock.
            let call = self.ep.role.calls().remove(id);
            drop(call);
            return Err(e.into());
        }
        Ok((id, core))
    }

    fn cancel(&self, id: CallId) {
        let call = self.ep.role.calls().remove(id);
        if let Some(call) = call {
            if let Waiter::Stream { core, .. } = &call.waiter {
                core.fail(Status::cancelled("the call was cancelled"));
            }
            send_cancel(&self.conn, id);
            // Only now may another stream take its place: the server
            // counts this one until the cancel arrives.
            drop(call);
        }
    }
}

/// Tells the server the call `id` is cancelled; what it lent for the call
/// and this side has not started to read is not read.
fn send_cancel<F: Fabric>(conn: &Conn<F>, id: CallId) {
    conn.cancel_reads(id);
    let _ = send_control(conn, FrameKind::Cancel, id, 0);
}

/// Who waits for a call's frames.
enum Waiter {
    /// A unary call's caller.
    Unary(Arc<CallSlot>),
    /// A stream's consumer; with `final_message`, the final `Response`
    /// carries a message (client-streaming calls). The stream holds its
    /// place on the connection while it is in the table.
    Stream {
        core: Arc<StreamCore>,
        final_message: bool,
        _permit: StreamPermit,
    },
}

/// A call in flight on a dispatcher: who waits, and on which connection.
struct Call {
    waiter: Waiter,
    qp_num: u32,
}

/// The client's side of one dispatcher: completes the calls of every
/// channel on it.
struct ClientRole {
    calls: Mutex<CallTable<Call>>,
    /// Slots of finished calls, for reuse.
    slots: SlotPool<Outcome>,
    /// What to do when a connection fails, by its address (see
    /// [`ClientRole::watch`]).
    watchers: Mutex<HashMap<usize, Box<dyn FnOnce() + Send>>>,
}

impl Default for ClientRole {
    fn default() -> Self {
        ClientRole {
            calls: Mutex::new(CallTable::new()),
            slots: SlotPool::new(),
            watchers: Mutex::new(HashMap::new()),
        }
    }
}

/// A connection's key among the watchers.
fn conn_key<F: Fabric>(conn: &Arc<Conn<F>>) -> usize {
    Arc::as_ptr(conn) as usize
}

impl ClientRole {
    /// Calls `on_lost` when `conn` fails (from the dispatcher, after its
    /// calls failed), or now if it has already.
    fn watch<F: Fabric>(&self, conn: &Arc<Conn<F>>, on_lost: Box<dyn FnOnce() + Send>) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if conn.is_alive() {
            watchers.insert(conn_key(conn), on_lost);
            return;
        }
        drop(watchers);
        on_lost();
    }

    /// Forgets `conn`'s watcher (it is being closed on purpose).
    fn unwatch<F: Fabric>(&self, conn: &Arc<Conn<F>>) {
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn_key(conn));
    }

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
    const SIDE: crate::observe::Side = crate::observe::Side::Client;

    /// An answer or a stream message is read only for a call of this
    /// connection still in the table: one cancelled or past its deadline
    /// would be dropped once read.
    fn wants_lent(&self, conn: &Arc<Conn<F>>, header: &Header) -> bool {
        self.calls()
            .get_mut(header.call_id)
            .is_some_and(|c| c.qp_num == conn.qp_num)
    }

    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        crate::stages::mark_once(crate::stages::Stage::ClientFrame);
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
                    ..
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
            // A unary call: completed by a response or an error. A stream
            // frame means the server serves the method as a stream (a
            // client built from another version of the .proto): that call
            // fails, and its stream is cancelled; the connection and its
            // other calls are not at fault.
            let mismatch = !matches!(h.kind, FrameKind::Response | FrameKind::Error);
            let call = calls.complete(id);
            drop(calls);
            let outcome = if mismatch {
                send_cancel(conn, id);
                Err(Status::internal(
                    "the server answered this unary call with a stream: the method streams \
                     on the server (is the client's .proto the server's?)",
                ))
            } else {
                unary_outcome(frame)
            };
            if let Some(Call {
                waiter: Waiter::Unary(slot),
                ..
            }) = call
            {
                self.finish(slot, outcome);
            }
            return;
        };
        // The stream's place on the connection is given back (below,
        // outside the lock): the server counted it until it sent this.
        let _ended =
            matches!(h.kind, FrameKind::Response | FrameKind::Error).then(|| calls.complete(id));
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
            // A stream's end carries no message (but a client stream's
            // answer): a message there is a single answer to a method the
            // server serves as unary or client-streaming. The call fails,
            // as a unary call answered with a stream does.
            FrameKind::Response if !final_message && !frame.payload.is_empty() => core.on_end(
                Err(Status::internal(
                    "the server answered this streaming call with a single response: the \
                     method is unary or client-streaming in the server's .proto; build this \
                     client from the same .proto as the server",
                )),
                None,
                None,
                true,
            ),
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
        crate::observe::connection(crate::observe::Side::Client, -1.0);
        let calls = self.calls().remove_where(|c| c.qp_num == conn.qp_num);
        for (_, call) in calls {
            let status = Status::unavailable(format!("connection lost: {why}"));
            match call.waiter {
                Waiter::Unary(slot) => self.finish(slot, Err(status)),
                Waiter::Stream { core, .. } => core.fail(status),
            }
        }
        let watcher = self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn_key(conn));
        if let Some(on_lost) = watcher {
            on_lost();
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
            // A stream's place on the connection (in its waiter) goes only
            // after the cancel.
            let permit = match call.waiter {
                Waiter::Unary(slot) => {
                    self.finish(slot, Err(status));
                    None
                }
                Waiter::Stream {
                    core,
                    _permit: permit,
                    ..
                } => {
                    core.fail(status);
                    Some(permit)
                }
            };
            if let Some(conn) = ep.conn(call.qp_num) {
                send_cancel(&conn, id);
            }
            drop(permit);
        }
        next
    }
}

impl ClientRole {
    /// Ends a stream the server broke: its consumer sees `why`, the server a cancel.
    fn fail_stream<F: Fabric>(&self, conn: &Conn<F>, id: CallId, core: &StreamCore, why: &str) {
        let call = self.calls().remove(id);
        core.fail(Status::internal(why));
        send_cancel(conn, id);
        // Its place on the connection goes only after the cancel.
        drop(call);
    }
}

/// The status an `Error` frame carries.
pub(crate) fn error_status(frame: &Frame) -> Status {
    let message = String::from_utf8_lossy(&frame.payload).into_owned();
    Status::from_wire(
        Code::from_u16(frame.header.status),
        message,
        frame.metadata.as_ref(),
    )
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
    canceller: Option<Arc<Connection>>,
    /// A call waiting for a connection (wait-for-ready), not started yet.
    pending: Option<Box<Pending>>,
    /// Its span and metrics.
    obs: Option<CallObs>,
    /// When the request was sent, or else when an `.await` first found the
    /// response missing: where its spin budget starts.
    started: Option<Instant>,
    /// Polls that found the response missing (the clock is read on every
    /// eighth only).
    misses: u32,
    /// The request may still be staged (see `Conn::send_corked`).
    corked: bool,
    /// Callers' turns of the queue as of this call's last look (see
    /// `PollHandoff::try_turn`).
    turns_seen: u64,
    /// `dispatch::calls_finished_here` as of this call's last look at its
    /// spin budget.
    finished_seen: u64,
    /// When that look last saw it grow: the budget runs from then.
    spin_from: Option<Instant>,
    /// The first poll let other tasks stage their requests (see `poll`).
    yielded: bool,
    /// The waker the slot holds, from the last poll that registered one.
    parked: Option<Waker>,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for UnaryCall<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnaryCall").field("id", &self.id.0).finish()
    }
}

/// A unary request sent: the call's id and slot, and when it was sent if
/// the clock was read for its deadline.
struct Sent {
    id: CallId,
    slot: Arc<CallSlot>,
    at: Option<Instant>,
}

/// A unary call sent on a connection.
type Started = Result<(Arc<Connection>, Sent), Status>;

/// A unary call waiting for its channel to connect: its request, encoded.
struct Pending {
    handle: Arc<Handle>,
    method: &'static MethodDescriptor,
    metadata: Metadata,
    payload: Vec<u8>,
    fail_fast: bool,
    deadline: Option<Instant>,
}

impl Pending {
    /// Starts the call on a connection if one is up: `None` while there is
    /// none and the deadline has not passed.
    fn try_start(&self) -> Option<Started> {
        let timeout = match self.deadline {
            Some(at) => match at.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => {
                    return Some(Err(Status::deadline_exceeded(format!(
                        "deadline exceeded waiting for a connection ({})",
                        self.handle.unavailable().message()
                    ))));
                }
            },
            None => None,
        };
        let conn = self.handle.pick().ok()?;
        let metadata = conn.gateway_metadata(self.method, &self.metadata);
        let started = conn.start(
            self.method.id,
            &metadata,
            self.fail_fast,
            timeout,
            self.payload.len(),
            &mut |buf| buf.copy_from_slice(&self.payload),
        );
        Some(started.map(|sent| (conn, sent)))
    }
}

impl<T> UnaryCall<T> {
    fn failed(status: Status) -> UnaryCall<T> {
        let slot = CallSlot::new();
        let _ = slot.complete(Err(status));
        UnaryCall::new(Some(Arc::new(slot)), CallId(0), None, None, None, false)
    }

    fn started(conn: Arc<Connection>, sent: Sent) -> UnaryCall<T> {
        UnaryCall::new(Some(sent.slot), sent.id, Some(conn), None, sent.at, true)
    }

    fn waiting(pending: Pending) -> UnaryCall<T> {
        UnaryCall::new(None, CallId(0), None, Some(Box::new(pending)), None, true)
    }

    /// A call in the given state, not yet polled.
    fn new(
        slot: Option<Arc<CallSlot>>,
        id: CallId,
        canceller: Option<Arc<Connection>>,
        pending: Option<Box<Pending>>,
        started: Option<Instant>,
        corked: bool,
    ) -> UnaryCall<T> {
        UnaryCall {
            slot,
            id,
            canceller,
            pending,
            obs: None,
            started,
            misses: 0,
            corked,
            turns_seen: 0,
            finished_seen: 0,
            spin_from: None,
            yielded: false,
            parked: None,
            _t: PhantomData,
        }
    }

    /// Moves a waiting call on to `started` (or to its failure).
    fn begin(&mut self, started: Started) {
        self.pending = None;
        let obs = self.obs.take();
        *self = match started {
            Ok((conn, sent)) => UnaryCall::started(conn, sent),
            Err(status) => UnaryCall::failed(status),
        };
        self.obs = obs;
    }

    /// Records the call's end in `obs` (its span and metrics).
    fn observed_by(mut self, obs: CallObs) -> UnaryCall<T> {
        self.obs = Some(obs);
        self
    }

    /// The call ended with `result`: its span and metrics say so.
    fn note_end<R>(&mut self, result: &mut Result<R, Status>) {
        if let Some(obs) = &mut self.obs {
            obs.finish(result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok));
            // The server knows a method by its id only: name it here.
            if let Err(status) = result {
                if status.code() == Code::Unimplemented
                    && status.message().starts_with(crate::server::UNKNOWN_METHOD)
                {
                    status.add_context(obs.method());
                }
            }
        }
    }

    /// Waits on this thread for a waiting call's connection.
    fn block_until_started(&mut self) {
        while let Some(p) = &self.pending {
            let generation = p.handle.ready.generation();
            if let Some(started) = p.try_start() {
                self.begin(started);
                return;
            }
            p.handle.ready.wait(generation, p.deadline);
        }
    }

    /// Polls a waiting call's connection: ready once started (or failed).
    fn poll_started(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(p) = &self.pending else {
            return Poll::Ready(());
        };
        if let Some(started) = p.try_start() {
            self.begin(started);
            return Poll::Ready(());
        }
        p.handle.ready.register(cx.waker(), p.deadline);
        // A connection that came up before the waker was in place.
        if let Some(started) = p.try_start() {
            self.begin(started);
            return Poll::Ready(());
        }
        Poll::Pending
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
    ///
    /// Not for async handlers, which run on the server's dispatcher
    /// threads: `.await` the call there (a warning is logged otherwise).
    pub fn wait(mut self) -> Result<Response<T>, Status> {
        crate::dispatch::warn_if_on_a_dispatcher("UnaryCall::wait");
        let mut result = self.wait_inner();
        crate::stages::finish();
        self.note_end(&mut result);
        result
    }

    fn wait_inner(&mut self) -> Result<Response<T>, Status> {
        self.block_until_started();
        let slot = self.slot.take().expect("slot present until completion");
        let Some(conn) = self.canceller.take() else {
            return decode_reply(wait_slot(&slot), drop);
        };
        conn.uncork();
        // One wait in four is timed, for the average that sets the spin
        // budget: from the clock read for the deadline at send time, or
        // from now if there was none.
        let sampled = self.id.generation() % 4 == 0;
        let started = self.started.take().or_else(|| sampled.then(Instant::now));
        conn.poll_for(&slot, started);
        // Sleep without holding the connection: if the last handle to it
        // goes away meanwhile, the call fails `Unavailable` instead of
        // waiting forever.
        let weak = Arc::downgrade(&conn);
        drop(conn);
        let outcome = wait_slot(&slot);
        crate::stages::mark(crate::stages::Stage::ClientTaken);
        match weak.upgrade() {
            Some(conn) => {
                if let Some(t) = started.filter(|_| sampled) {
                    conn.note_wait(t.elapsed());
                }
                conn.finish_call(slot, outcome)
            }
            None => decode_reply(outcome, drop),
        }
    }
}

impl<T: prost::Message + Default> Future for UnaryCall<T> {
    type Output = Result<Response<T>, Status>;

    /// Checks for the response. While it is missing, the task turns the
    /// completion queue itself, as a blocking [`UnaryCall::wait`] does
    /// (unless another waiting call turned it since this one last looked:
    /// many calls polled in a row turn it once per round), and asks to be
    /// polled again soon, for up to the channel's spin time from its start
    /// or from the last turn on this thread that found responses: a quick
    /// response then completes on the task's own thread with no hand-off.
    /// After that the channel's dispatcher takes over and wakes the task.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.pending.is_some() && self.poll_started(cx).is_pending() {
            return Poll::Pending;
        }
        if self.slot.is_none() {
            return Poll::Ready(Err(Status::internal("call polled after completion")));
        }
        if self.corked {
            if let Some(channel) = &self.canceller {
                if !self.yielded && channel.is_corked() {
                    // First poll: let the tasks that run next issue their
                    // requests too; they all leave in one post at the next
                    // poll of any of them.
                    self.yielded = true;
                    self.started.get_or_insert_with(Instant::now);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                channel.uncork();
            }
            self.corked = false;
        }
        let this = &mut *self;
        let slot = this.slot.as_ref().expect("checked above");
        // The slot holds a waker of this task from an earlier poll, and the
        // outcome is not in: no need to lock the slot to look.
        let parked = !slot.is_done()
            && this
                .parked
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()));
        let mut outcome = if parked {
            Poll::Pending
        } else {
            poll_slot(slot, cx)
        };
        if outcome.is_pending() {
            if let Some(channel) = &this.canceller {
                if channel.try_progress(&mut this.turns_seen) && slot.is_done() {
                    outcome = poll_slot(slot, cx);
                }
            }
        }
        if outcome.is_pending() && !parked {
            this.parked = Some(cx.waker().clone());
        }
        match outcome {
            Poll::Ready(r) => {
                crate::dispatch::note_call_finished_here();
                self.parked = None;
                let slot = self.slot.take().expect("checked above");
                let started = self.started.take();
                let mut result = match self.canceller.take() {
                    Some(channel) => {
                        // One call in four is enough for the average wait
                        // (the clock costs as much as a tenth of a call).
                        if let Some(t) = started.filter(|_| self.id.generation() % 4 == 0) {
                            channel.note_wait(t.elapsed());
                        }
                        channel.finish_call(slot, r)
                    }
                    None => decode_reply(r, drop),
                };
                self.note_end(&mut result);
                Poll::Ready(result)
            }
            Poll::Pending => {
                let this = &mut *self;
                this.misses = this.misses.wrapping_add(1);
                let within_budget = match this.started {
                    None => {
                        this.started = Some(Instant::now());
                        true
                    }
                    // Polls come a few hundred nanoseconds apart: reading
                    // the clock on every one of them costs more than
                    // overshooting the budget by seven.
                    Some(_) if this.misses % 8 != 0 => true,
                    // The budget runs from the last time a call awaited on
                    // this thread finished, not from the call's start:
                    // with many calls in flight each waits long, but the
                    // queue delivers often, and spinning on it pays.
                    Some(started) => match &this.canceller {
                        Some(c) => {
                            let now = Instant::now();
                            let finished = crate::dispatch::calls_finished_here();
                            if finished != this.finished_seen {
                                this.finished_seen = finished;
                                this.spin_from = Some(now);
                            }
                            let from = this.spin_from.unwrap_or(started);
                            crate::dispatch::future_spin_yield(now);
                            now.duration_since(from) < c.spin_budget()
                        }
                        None => false,
                    },
                };
                if let Some(channel) = &this.canceller {
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
        if let (Some(_), Some(conn)) = (self.slot.take(), self.canceller.take()) {
            conn.cancel(self.id);
            conn.ended();
        }
    }
}
