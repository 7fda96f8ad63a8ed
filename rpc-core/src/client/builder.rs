//! [`ChannelBuilder`]: a channel's settings, and opening it.

use super::connection::Settings;
use super::endpoints::{self, Resolver};
use super::reconnect::{Backoff, Ready};
use super::targets::{Balance, Target};
use super::{Channel, Handle};
use crate::Status;
use crate::auth::Credential;
use crate::dispatch::Config;
use crate::fabric::FabricUrl;
use crate::interceptor::{Chain, Interceptor};
use arc_swap::ArcSwap;
use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    compression: crate::CompressionConfig,
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
    /// A builder with default settings, for `urls`, or for the endpoints
    /// `resolver` names (see [`Channel::balance`], [`Channel::resolve`]).
    pub(super) fn new(urls: Vec<String>, resolver: Option<Arc<dyn Resolver>>) -> ChannelBuilder {
        ChannelBuilder {
            urls,
            config: Config::default(),
            timeout: None,
            credential: None,
            tls: None,
            backoff: Some(Backoff::default()),
            wait_for_ready: false,
            balance: Balance::default(),
            fallback: None,
            interceptors: Chain::default(),
            resolver,
            resolve_interval: endpoints::DEFAULT_RESOLVE_INTERVAL,
            health: None,
            health_interval: endpoints::DEFAULT_HEALTH_INTERVAL,
            compression: crate::CompressionConfig::default(),
        }
    }

    /// Every call of the channel sends its requests (and stream messages)
    /// compressed in `encoding` (default: as they are). A server that does
    /// not accept it answers `Unimplemented`.
    pub fn send_compressed(mut self, encoding: crate::Encoding) -> Self {
        self.compression = self.compression.send_compressed(encoding);
        self
    }

    /// Accepts responses compressed in `encoding`. Every encoding this
    /// build knows is accepted by default; once one is named here, only
    /// those named are, and servers send their other responses as they are.
    pub fn accept_compressed(mut self, encoding: crate::Encoding) -> Self {
        self.compression = self.compression.accept_compressed(encoding);
        self
    }

    /// Accepts responses compressed in exactly the encodings of `set`.
    pub fn accept_encodings(mut self, set: crate::EncodingSet) -> Self {
        self.compression = self.compression.accept_encodings(set);
        self
    }

    /// Default timeout of every call (none by default); [`Request::set_timeout`] overrides it.
    ///
    /// It bounds streams too, from start to end: a stream meant to outlive
    /// it (a health `Watch`, a feed) sets its own, `Duration::MAX` for none.
    ///
    /// [`Request::set_timeout`]: crate::Request::set_timeout
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
    ///
    /// [`Request::set_wait_for_ready`]: crate::Request::set_wait_for_ready
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
            compression: self.compression,
        })
    }
}
