//! The client side: [`Channel`] and [`UnaryCall`].

mod builder; // ChannelBuilder: a channel's settings, connecting it
mod connection; // one connection, and the calls started on it
mod endpoints; // resolvers and health checks
mod reconnect; // backoff, the reconnecting thread, waiting for a connection
mod role; // each dispatcher's side of the protocol: frames to calls
mod runtime; // the dispatchers every channel shares
pub(crate) mod stream_limit; // how many streams a connection may have open
mod streams; // opening streams
mod targets; // a channel's endpoints: picking one for a call, reconnecting
mod unary; // UnaryCall: starting a unary call, and how its caller waits

pub use builder::ChannelBuilder;
pub use endpoints::{Dns, Resolver};
pub use reconnect::Backoff;
pub use targets::Balance;
pub use unary::UnaryCall;

use crate::compression::{CompressionConfig, Encoding, EncodingSet};
use crate::descriptor::MethodDescriptor;
use crate::interceptor::Chain;
use crate::streaming::{ClientStreamingCall, RequestSender, Streaming};
use crate::{Metadata, Request, Status};
use arc_swap::ArcSwap;
use connection::{Connection, Settings};
use futures_core::Stream;
use reconnect::Ready;
use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use targets::Target;

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
    /// What this handle's calls send compressed and accept (clones made
    /// by [`Channel::send_compressed`] and the like differ).
    compression: CompressionConfig,
}

/// What every clone of a channel shares. How it picks a connection for a
/// call and reconnects its endpoints is in `targets`; how it resolves them
/// and checks their health, in `endpoints`.
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

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("url", &self.inner.url)
            .finish()
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

    /// This channel, its calls sending their requests (and stream
    /// messages) compressed in `encoding`. A server that does not accept
    /// it answers `Unimplemented`. Clones share the connections, not this
    /// setting; [`ChannelBuilder::send_compressed`] sets it for every
    /// handle of a new channel.
    pub fn send_compressed(mut self, encoding: Encoding) -> Channel {
        self.compression = self.compression.send_compressed(encoding);
        self
    }

    /// This channel, its calls accepting responses compressed in
    /// `encoding`: every encoding is accepted by default; once one is
    /// named, only those named are, and the server sends the others' as
    /// they are.
    pub fn accept_compressed(mut self, encoding: Encoding) -> Channel {
        self.compression = self.compression.accept_compressed(encoding);
        self
    }

    /// This channel, its calls accepting responses compressed in exactly
    /// the encodings of `set`.
    pub fn accept_encodings(mut self, set: EncodingSet) -> Channel {
        self.compression = self.compression.accept_encodings(set);
        self
    }

    /// What this handle's calls send compressed and accept.
    pub fn compression(&self) -> CompressionConfig {
        self.compression
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
        ChannelBuilder::new(
            urls.into_iter().map(|u| u.as_ref().to_owned()).collect(),
            None,
        )
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
        ChannelBuilder::new(Vec::new(), Some(Arc::new(resolver)))
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
        conn.verbs_queue()
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
            .map(|c| c.stale_responses())
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
        UnaryCall::start(self, method, request)
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
        Self::incoming(opened, self.outbox_compression(), |_| None)
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
}
