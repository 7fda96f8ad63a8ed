//! How a server is configured and started: [`Server::builder`], the
//! [`ServerBuilder`]'s settings, the method table it builds from its
//! services, and `serve`, which starts the listener, the dispatchers and
//! the acceptor and hands back a [`ServerHandle`]; with a gRPC face, also
//! the face, which that handle stops first.

use super::Service;
use super::accept::accept_loop;
use super::registry::Registry;
use super::role::ServerRole;
use super::route::Route;
#[cfg(feature = "grpc")]
use super::shutdown::Stop;
use super::shutdown::{ServerHandle, ServerStopper};
use super::start::ServerShared;
use crate::Status;
use crate::auth::Authenticator;
use crate::blocking::BlockingPool;
use crate::dispatch::{Config, Endpoint};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Admission, Fabric, FabricUrl, Listener, Scheme};
use crate::idmap::IdMap;
use crate::interceptor::{Chain, Interceptor};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

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
            admission: Admission::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            interceptors: Chain::default(),
            reflection: false,
            #[cfg(feature = "grpc")]
            grpc: None,
            fallback: None,
            compression: crate::CompressionConfig::default(),
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
    pub(super) config: Config,
    dispatchers: usize,
    pub(super) blocking_threads: usize,
    /// How handshakes are admitted; their timeout is `config.connect_timeout`.
    admission: Admission,
    max_connections: usize,
    pub(super) max_streams: u32,
    pub(super) interceptors: Chain,
    /// Whether `serve` adds the reflection service.
    reflection: bool,
    /// Where to serve standard gRPC too.
    #[cfg(feature = "grpc")]
    grpc: Option<String>,
    /// Takes the calls of methods no service has, whose kind the caller
    /// names in metadata (the gRPC gateway of `grpc://` clients).
    fallback: Option<Arc<dyn Service>>,
    /// What calls send compressed and accept, but for services with their
    /// own settings.
    pub(super) compression: crate::CompressionConfig,
    #[cfg(feature = "tokio")]
    tokio: Option<tokio::runtime::Handle>,
}

/// Streams a server serves at once on one connection, by default: as
/// HTTP/2 servers commonly allow (RFC 9113 asks for at least 100). Each
/// stream may hold a window (256 KiB) of its client's messages unread, so a
/// connection's streams hold at most 25 MiB, within the 64 MiB a connection
/// may queue to send: no stream's send within its window meets a full queue
/// unless unary traffic fills it too.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 100;

/// Connections a server keeps at most, by default. An idle connection
/// costs little (see the README's "Limits and memory"); the process's
/// descriptor limit (`ulimit -n`) usually binds first on tcp://.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

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
            .field("admission", &self.admission)
            .field("max_connections", &self.max_connections)
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

    /// Adds the reflection service, `grpc.reflection.v1.ServerReflection`
    /// ([`crate::reflection`]), which tells clients such as the `rpc`
    /// command line tool what this server serves: every service added,
    /// before or after this call, and the `.proto` files generated services
    /// carry. Off by default, as in gRPC: it shows the whole API to anyone
    /// who may connect.
    pub fn add_reflection(mut self) -> Self {
        self.reflection = true;
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

    /// Receive ring per connection in bytes, a power of two (default 256 KiB
    /// on mem:// and tcp://, 128 KiB on rdma://, where it is registered
    /// memory).
    /// Small messages travel through it; payloads larger than the
    /// rendezvous threshold ([`ServerBuilder::rendezvous_above`]) or than
    /// half the ring are lent by the sender and read from its memory.
    pub fn ring_size(mut self, bytes: usize) -> Self {
        self.config.ring_size = Some(bytes);
        self
    }

    /// Largest request (metadata + payload) accepted, in bytes (default
    /// 64 MiB, at most 4 GiB less a byte). A larger request fails at its
    /// sender with `ResourceExhausted`, before anything is allocated here.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.config.max_message = bytes;
        self
    }

    /// Sends responses compressed in `encoding` (default: as they are), to
    /// callers that accept it (others get them as they are). Services may
    /// have settings of their own (the generated servers' `send_compressed`),
    /// and a handler may choose per response
    /// ([`Response::send_compressed`](crate::Response::send_compressed)) or
    /// per message of a stream ([`crate::CompressionSwitch`]).
    pub fn send_compressed(mut self, encoding: crate::Encoding) -> Self {
        self.compression = self.compression.send_compressed(encoding);
        self
    }

    /// Accepts requests compressed in `encoding`. Every encoding this build
    /// knows is accepted by default; once one is named here, only those
    /// named are, and a request in another fails `Unimplemented`.
    pub fn accept_compressed(mut self, encoding: crate::Encoding) -> Self {
        self.compression = self.compression.accept_compressed(encoding);
        self
    }

    /// Accepts requests compressed in exactly the encodings of `set`
    /// ([`crate::EncodingSet::none`]: only uncompressed ones).
    pub fn accept_encodings(mut self, set: crate::EncodingSet) -> Self {
        self.compression = self.compression.accept_encodings(set);
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

    /// How long a dispatcher spins on an idle queue before it blocks, at
    /// least (default 50 µs; it spins longer while requests keep coming
    /// within a millisecond of each other).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// How often an idle connection sends a heartbeat (default 1 s, at
    /// least 10 ms; what one is on each fabric: [`DEFAULT_HEARTBEAT`](crate::DEFAULT_HEARTBEAT)),
    /// or `None` for none. The client's transport must
    /// acknowledge each, so the connection of a client host that vanished
    /// is dropped, and its memory returned, within 5 s with the default (about
    /// 2.5 s on rdma://; see [`heartbeat_bound`](crate::heartbeat_bound));
    /// without heartbeats, only TCP keepalive notices, after 20 s.
    pub fn heartbeat(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat = interval;
        self
    }

    /// Requires every client to authenticate before any memory is set
    /// aside for it: with [`SharedSecret`](crate::SharedSecret) (or
    /// [`SharedSecrets`](crate::SharedSecrets)), HMAC challenge-response,
    /// mutual; or any [`Authenticator`]. A client without the credential
    /// fails to connect with `Unauthenticated`. Handlers see who the client
    /// is in [`Request::peer`](crate::Request::peer).
    pub fn authenticator(mut self, authenticator: impl Authenticator) -> Self {
        self.admission.authenticator = Some(Arc::new(authenticator));
        self
    }

    /// Serves over TLS (`tcp://`: everything; `rdma://`: the handshake over
    /// TCP; `mem://` ignores it): clients must connect with
    /// [`ChannelBuilder::tls_config`](crate::ChannelBuilder::tls_config),
    /// and a plaintext one is told so. With
    /// [`ServerTlsConfig::client_ca_root`](crate::tls::ServerTlsConfig::client_ca_root)
    /// clients need a certificate from that CA, and handlers see the name
    /// in it in [`Request::peer`](crate::Request::peer) (unless an
    /// [`authenticator`](ServerBuilder::authenticator) names the client).
    /// Fails at once if `config` is not usable (no identity, a PEM without
    /// a certificate or key, a key that does not match its certificate).
    #[cfg(feature = "tls")]
    pub fn tls_config(mut self, config: crate::tls::ServerTlsConfig) -> Result<Self, Status> {
        self.admission.tls = Some(config.build()?);
        Ok(self)
    }

    /// Connections kept at most (default 16,384); a client beyond it fails
    /// to connect with `ResourceExhausted`, naming the limit.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Streams served at once on one connection (default
    /// [`DEFAULT_MAX_CONCURRENT_STREAMS`], 100), like HTTP/2's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`; at least 1. Unary calls do not
    /// count. The server tells each client the limit when it connects
    /// (up to 65,535; a larger limit is told as 65,535), and the client's
    /// stream beyond it waits for one of that connection's streams to end
    /// (within its deadline) before it is sent. A stream that arrives
    /// beyond the limit anyway (a client that ignores it) fails at once
    /// with `ResourceExhausted`, naming the limit. The same limit applies
    /// to each HTTP/2 connection of the gRPC face, where (as in HTTP/2)
    /// unary calls count too.
    ///
    /// Each stream may hold a window (256 KiB) of its client's messages
    /// that the handler has not read yet, so the limit bounds that memory
    /// per connection; with more than 256 streams a connection's sends
    /// within their windows can together exceed what it may queue (64 MiB)
    /// and fail `ResourceExhausted`.
    pub fn max_concurrent_streams(mut self, n: u32) -> Self {
        self.max_streams = n.max(1);
        self
    }

    /// Handshakes in progress at most (default 1,024, fewer if the process
    /// may open few descriptors). They need no thread: one thread admits
    /// them all. Beyond the limit the oldest is dropped, so peers that
    /// connect and say nothing cannot keep real clients out.
    pub fn max_pending_handshakes(mut self, n: usize) -> Self {
        self.admission.max_pending = n.max(1);
        self
    }

    /// How long a client's connection set-up may take (default 5 s).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
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

    /// Adds an interceptor: it sees every call (unary and streams) before
    /// its handler runs, with the caller's [`Peer`](crate::auth::Peer), may
    /// change the metadata the handler sees, and may answer the call with
    /// a status instead (see [`crate::interceptor`]). Interceptors run in
    /// the order added, on the dispatcher: they must not block.
    pub fn interceptor(mut self, interceptor: impl Interceptor) -> Self {
        self.interceptors.push(interceptor);
        self
    }

    /// Starts serving on `url` in background threads and returns at once.
    /// `tcp://host:0` picks a free port: see [`ServerHandle::local_url`].
    pub fn serve(mut self, url: &str) -> Result<ServerHandle, Status> {
        self.config.validate()?;
        if std::mem::take(&mut self.reflection) && !self.services.is_empty() {
            let services: Vec<&dyn Service> = self.services.iter().map(|(s, _)| &**s).collect();
            let reflection = crate::reflection::server::ReflectionServer::new(&services);
            self.services.push((Arc::new(reflection), false));
        }
        #[cfg(feature = "grpc")]
        if let Some(addr) = self.grpc.take() {
            return self.serve_with_grpc(url, &addr);
        }
        self.serve_plain(url)
    }

    /// Serves standard gRPC (HTTP/2) on `addr` too (`host:port`; port 0
    /// picks a free one, see [`ServerHandle::grpc_addr`]): the same
    /// services, interceptors, deadlines, cancellation, metadata, status
    /// codes and streams, for callers that speak gRPC (other languages,
    /// grpcurl, load balancers, Kubernetes probes; add the health service
    /// for those). Served by tonic, on the tokio runtime given to
    /// [`ServerBuilder::tokio_handle`] or on one of its own (two threads,
    /// `rpc-grpc`): a gRPC call's handler runs on the tokio worker that
    /// read it (a blocking service or method on the blocking pool), and
    /// the handler sees the caller as a [`Peer`](crate::Peer) of fabric
    /// `"grpc"`. The `rdma://` and `tcp://` paths are not touched.
    ///
    /// With [`ServerBuilder::tls_config`] the face serves TLS too, with
    /// the same certificate and, for mutual TLS, the same client CA (the
    /// name in a client's certificate is then the peer's identity). The
    /// server's [`authenticator`](ServerBuilder::authenticator) is a
    /// handshake of our fabrics that gRPC does not have: it does not guard
    /// the face. Guard it with mutual TLS or an
    /// [`interceptor`](ServerBuilder::interceptor).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), rpc_core::Status> {
    /// # struct Kv; impl rpc_core::Service for Kv { fn descriptor(&self) -> &'static rpc_core::server::ServiceDescriptor { unimplemented!() } fn call(&self, _: rpc_core::ServerCall) {} }
    /// let server = rpc_core::Server::builder()
    ///     .add_service(Kv)
    ///     .grpc("0.0.0.0:50051")
    ///     .serve("rdma://0.0.0.0:7471")?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "grpc")]
    pub fn grpc(mut self, addr: &str) -> Self {
        self.grpc = Some(addr.to_owned());
        self
    }

    /// A service for the calls of methods no added service has, whose
    /// kind the caller names in metadata
    /// ([`FALLBACK_KIND`](crate::conventions::FALLBACK_KIND)): the gateway of `grpc://`
    /// clients passes any method on.
    #[cfg(feature = "grpc")]
    pub(crate) fn fallback(mut self, service: Arc<dyn Service>) -> Self {
        self.fallback = Some(service);
        self
    }

    /// Serves on `url`, and gRPC on `addr` with the same services: the
    /// face starts each call as a dispatcher would, on tokio's workers.
    #[cfg(feature = "grpc")]
    fn serve_with_grpc(self, url: &str, addr: &str) -> Result<ServerHandle, Status> {
        let runtime = self.tokio.clone();
        #[cfg(feature = "tls")]
        let tls = self.admission.tls.as_ref().map(|t| t.source.to_tonic());
        #[cfg(not(feature = "tls"))]
        let tls = None;
        let mut main = self.serve_plain(url)?;
        let shared = main
            .shared
            .clone()
            .ok_or_else(|| Status::internal("gRPC face: the server has no calls to share"))?;
        let face = crate::grpc::face::GrpcFace::start(addr, shared.clone(), runtime, tls)?;
        main.grpc_addr = Some(face.local_addr());
        let stopper = main.stopper.take();
        main.stopper = Some(Box::new(WithFace {
            face,
            shared,
            main: stopper,
        }));
        Ok(main)
    }

    fn serve_plain(self, url: &str) -> Result<ServerHandle, Status> {
        let routes = self.routes()?;
        let url = FabricUrl::parse(url)?;
        match url.scheme {
            Scheme::Mem | Scheme::Tcp => self.serve_on(SoftFabric::new(), &url, routes),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => self.serve_on(crate::fabric::open_verbs(&url)?, &url, routes),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(&url)? {},
            Scheme::Grpc => Err(Status::invalid_argument(
                "a server does not listen on grpc://: serve gRPC beside its URL with \
                 ServerBuilder::grpc",
            )),
        }
    }

    /// Serves on `url` until `signal` completes, then shuts down as
    /// [`ServerHandle::shutdown`] does (without blocking the executor),
    /// for async applications, as tonic's `serve_with_shutdown`:
    ///
    /// ```no_run
    /// # async fn f(
    /// #     builder: rpc_core::ServerBuilder,
    /// #     ctrl_c: impl std::future::Future<Output = ()>,
    /// # ) -> Result<(), rpc_core::Status> {
    /// // `ctrl_c`: any future, e.g. `async { tokio::signal::ctrl_c().await.ok(); }`
    /// builder.serve_with_shutdown("tcp://0.0.0.0:7471", ctrl_c).await?;
    /// # Ok(()) }
    /// ```
    pub async fn serve_with_shutdown(
        self,
        url: &str,
        signal: impl Future<Output = ()>,
    ) -> Result<(), Status> {
        let server = self.serve(url)?;
        signal.await;
        server.shutdown_async().await;
        Ok(())
    }

    pub(super) fn routes(&self) -> Result<IdMap<Route>, Status> {
        if self.services.is_empty() && self.fallback.is_none() {
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
                    path: m.path,
                    service: svc.clone(),
                    blocking: *blocking || self.blocking_methods.iter().any(|p| p == m.path),
                    kind: m.kind,
                    compression: svc.compression().unwrap_or(self.compression),
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
        let admission = Admission {
            timeout: self.config.connect_timeout,
            ..self.admission.clone()
        };
        let listener = Arc::new(fabric.listen(url, admission)?);
        let local_url = listener.local_url();
        let shared = Arc::new(ServerShared {
            routes,
            fallback: self.fallback.clone(),
            interceptors: self.interceptors.clone(),
            pool: BlockingPool::new("rpc-blocking", self.blocking_threads),
            draining: AtomicBool::new(false),
            inflight: Arc::new(AtomicUsize::new(0)),
            max_message: self.config.max_message,
            max_streams: self.max_streams,
            compression: self.compression,
        });
        let mut endpoints = Vec::with_capacity(self.dispatchers);
        for _ in 0..self.dispatchers {
            let role = ServerRole {
                shared: shared.clone(),
                registry: Arc::new(Registry::with_stream_limit(self.max_streams)),
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
                    crate::dispatch::mark_server_dispatcher();
                    ep.run()
                }),
            )?);
        }
        let endpoints = Arc::new(endpoints);
        let acceptor = {
            let endpoints = endpoints.clone();
            let listener = listener.clone();
            let shared = shared.clone();
            let max_connections = self.max_connections;
            spawn(
                "rpc-acceptor".into(),
                Box::new(move || accept_loop(&endpoints, &shared, listener, max_connections)),
            )?
        };
        tracing::info!(url = %local_url, dispatchers = endpoints.len(), "serving");
        Ok(ServerHandle {
            local_url,
            grpc_addr: None,
            #[cfg(feature = "grpc")]
            shared: Some(shared.clone()),
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

/// A server with a gRPC face: the face stops accepting first (its calls
/// under way end within the grace period), then the server itself.
#[cfg(feature = "grpc")]
struct WithFace {
    face: crate::grpc::face::GrpcFace,
    shared: Arc<ServerShared>,
    main: Option<Box<dyn Stop>>,
}

#[cfg(feature = "grpc")]
impl Stop for WithFace {
    fn stop(&mut self, grace: Duration) {
        // Calls on the face end as they would on the server.
        self.shared.begin_shutdown();
        self.face.stop(grace);
        if let Some(mut main) = self.main.take() {
            main.stop(grace);
        }
    }
}
