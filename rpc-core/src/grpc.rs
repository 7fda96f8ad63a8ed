//! The gRPC face of a server ([`ServerBuilder::grpc`](crate::ServerBuilder::grpc)):
//! standard gRPC over HTTP/2 on a TCP address, beside the server's own
//! URL, served by tonic, for callers that speak gRPC (other languages,
//! grpcurl, load balancers, Kubernetes probes).
//!
//! It also holds the gateway of `grpc://` URLs: our clients calling a
//! standard gRPC server (see [`gateway`]).
//!
//! Every gRPC call goes on to the same services through an in-process
//! `mem://` endpoint of the server: the same handlers, interceptors,
//! deadlines (`grpc-timeout`), cancellation (a reset HTTP/2 stream
//! cancels the call), metadata, status codes and streams of all four
//! kinds. Messages pass as their encoded bytes ([`RawMessage`]): nothing is
//! decoded twice. The rdma:// and tcp:// paths do not change.

use crate::codegen::{MethodDescriptor, MethodKind};
use crate::{Channel, Metadata, RawMessage, Request, Response, Status, Streaming};
use futures_core::Stream;
use prost::bytes::{Buf, BufMut, Bytes};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The gRPC face of a running server: its listener's task, stopped with
/// the server.
pub(crate) struct GrpcFace {
    local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::sync::mpsc::Receiver<()>>,
    /// The runtime made for the face when the server was given none.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for GrpcFace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcFace")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl GrpcFace {
    /// Listens on `addr` (`host:port`; port 0 picks one) and serves gRPC,
    /// passing each call to `channel` (the server's in-process endpoint),
    /// whose services' methods are `methods`.
    pub(crate) fn start(
        addr: &str,
        channel: Channel,
        methods: Vec<&'static MethodDescriptor>,
        max_message_size: usize,
        handle: Option<tokio::runtime::Handle>,
    ) -> Result<GrpcFace, Status> {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| Status::unavailable(format!("gRPC face: cannot listen on {addr}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Status::internal(format!("gRPC face: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Status::internal(format!("gRPC face: {e}")))?;
        let (runtime, handle) = match handle {
            Some(h) => (None, h),
            None => {
                let rt = runtime("gRPC face")?;
                let h = rt.handle().clone();
                (Some(rt), h)
            }
        };
        let proxy = Proxy {
            inner: Arc::new(ProxyInner {
                channel,
                methods: methods.into_iter().map(|m| (m.path, m)).collect(),
                max_message_size,
            }),
        };
        let mut routes = tonic::service::Routes::default();
        let router = std::mem::take(routes.axum_router_mut()).fallback_service(proxy);
        let routes = tonic::service::Routes::from(router);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let listener = {
            let _in = handle.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|e| Status::internal(format!("gRPC face: {e}")))?
        };
        handle.spawn(async move {
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            let served = tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "gRPC face stopped");
            }
            let _ = done_tx.send(());
        });
        tracing::info!(%local_addr, "serving gRPC");
        Ok(GrpcFace {
            local_addr,
            stop: Some(stop),
            done: Some(done),
            runtime,
        })
    }

    /// Where it listens.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets the calls under way end (up to `grace`), and
    /// stops.
    pub(crate) fn stop(&mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = done.recv_timeout(grace);
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for GrpcFace {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

/// A runtime of its own for `what`: two `rpc-grpc` threads.
fn runtime(what: &str) -> Result<tokio::runtime::Runtime, Status> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rpc-grpc")
        .enable_all()
        .build()
        .map_err(|e| Status::internal(format!("{what}: no runtime: {e}")))
}

/// The bytes of a gRPC message, passed on as they are.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Every gRPC path, routed to the server's methods.
#[derive(Clone)]
struct Proxy {
    inner: Arc<ProxyInner>,
}

struct ProxyInner {
    channel: Channel,
    methods: HashMap<&'static str, &'static MethodDescriptor>,
    max_message_size: usize,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tonic::codegen::Service<http::Request<axum::body::Body>> for Proxy {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            let path = request.uri().path();
            let Some(&method) = inner.methods.get(path) else {
                let status = tonic::Status::unimplemented(format!("no method {path}"));
                return Ok(status.into_http());
            };
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(inner.max_message_size)
                .max_encoding_message_size(inner.max_message_size);
            let call = Call { inner, method };
            Ok(match method.kind {
                MethodKind::Unary => grpc.unary(call, request).await,
                MethodKind::ServerStreaming => {
                    grpc.server_streaming(ServerStream(call), request).await
                }
                MethodKind::ClientStreaming => {
                    grpc.client_streaming(ClientStream(call), request).await
                }
                MethodKind::Streaming => grpc.streaming(Bidi(call), request).await,
            })
        })
    }
}

/// One gRPC call, passed on to `method`.
#[derive(Clone)]
struct Call {
    inner: Arc<ProxyInner>,
    method: &'static MethodDescriptor,
}

impl Call {
    /// Our request for `request`: its metadata (gRPC's own headers left
    /// out) and its deadline (`grpc-timeout`).
    fn request<T, U>(request: tonic::Request<T>, f: impl FnOnce(T) -> U) -> Request<U> {
        let (metadata, _, message) = request.into_parts();
        let timeout = metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_timeout);
        let mut ours = Request::new(f(message));
        *ours.metadata_mut() = metadata_from_grpc(&metadata);
        if let Some(timeout) = timeout {
            ours.set_timeout(timeout);
        }
        ours
    }
}

impl tonic::codegen::Service<tonic::Request<Bytes>> for Call {
    type Response = tonic::Response<Bytes>;
    type Error = tonic::Status;
    type Future = BoxFuture<Result<Self::Response, tonic::Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), tonic::Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let request = Call::request(request, |b| RawMessage(b.to_vec()));
            match this.method.kind {
                MethodKind::Unary => {
                    let reply: Response<RawMessage> = this
                        .inner
                        .channel
                        .unary(this.method, request)
                        .await
                        .map_err(to_grpc)?;
                    Ok(response_to_grpc(reply, |m| Bytes::from(m.0)))
                }
                _ => Err(tonic::Status::internal("a unary service for a stream")),
            }
        })
    }
}

/// A response stream as tonic sends it: the message already read to learn
/// the initial metadata, then the rest.
struct Outgoing {
    first: Option<Bytes>,
    rest: Streaming<RawMessage>,
}

impl Stream for Outgoing {
    type Item = Result<Bytes, tonic::Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        Pin::new(&mut self.rest)
            .poll_next(cx)
            .map(|m| m.map(|m| m.map(|m| Bytes::from(m.0)).map_err(to_grpc)))
    }
}

/// A client's request stream, as our call sends it: it ends at the
/// client's half-close, or at an error (the call is then cancelled when
/// its HTTP/2 stream goes).
struct Incoming(tonic::Streaming<Bytes>);

impl Stream for Incoming {
    type Item = RawMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<RawMessage>> {
        Pin::new(&mut self.0).poll_next(cx).map(|m| match m {
            Some(Ok(b)) => Some(RawMessage(b.to_vec())),
            Some(Err(status)) => {
                tracing::debug!(%status, "gRPC request stream failed");
                None
            }
            None => None,
        })
    }
}

/// A server-streaming call (tonic's service traits, one type per kind).
struct ServerStream(Call);

/// A client-streaming call.
struct ClientStream(Call);

/// A bidirectional call.
struct Bidi(Call);

impl tonic::server::ServerStreamingService<Bytes> for ServerStream {
    type Response = Bytes;
    type ResponseStream = Outgoing;
    type Future = BoxFuture<Result<tonic::Response<Outgoing>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let this = self.0.clone();
        Box::pin(async move {
            let request = Call::request(request, |b| RawMessage(b.to_vec()));
            let stream = this.inner.channel.server_streaming(this.method, request);
            started(stream).await
        })
    }
}

impl tonic::server::ClientStreamingService<Bytes> for ClientStream {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Bytes>>) -> Self::Future {
        let this = self.0.clone();
        Box::pin(async move {
            let request = Call::request(request, Incoming);
            let reply: Response<RawMessage> = this
                .inner
                .channel
                .client_streaming(this.method, request)
                .await
                .map_err(to_grpc)?;
            Ok(response_to_grpc(reply, |m| Bytes::from(m.0)))
        })
    }
}

impl tonic::server::StreamingService<Bytes> for Bidi {
    type Response = Bytes;
    type ResponseStream = Outgoing;
    type Future = BoxFuture<Result<tonic::Response<Outgoing>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Bytes>>) -> Self::Future {
        let this = self.0.clone();
        Box::pin(async move {
            let request = Call::request(request, Incoming);
            let stream = this.inner.channel.streaming(this.method, request);
            started(stream).await
        })
    }
}

/// A response stream, once its start is known: gRPC sends the initial
/// metadata before the first message, so this waits for that message (or
/// the end) to learn it; a stream that fails before any message is a
/// status.
async fn started(
    mut stream: Streaming<RawMessage>,
) -> Result<tonic::Response<Outgoing>, tonic::Status> {
    let first = stream.message().await.map_err(to_grpc)?;
    let metadata = stream.metadata().unwrap_or_default();
    let mut response = tonic::Response::new(Outgoing {
        first: first.map(|m| Bytes::from(m.0)),
        rest: stream,
    });
    *response.metadata_mut() = metadata_to_grpc(&metadata);
    Ok(response)
}

/// gRPC's own headers: not metadata of the call.
const RESERVED: [&str; 9] = [
    "te",
    "content-type",
    "user-agent",
    "grpc-timeout",
    "grpc-encoding",
    "grpc-accept-encoding",
    "grpc-message-type",
    "host",
    "accept-encoding",
];

/// A gRPC request's metadata as ours; keys ours refuses are left out.
fn metadata_from_grpc(map: &tonic::metadata::MetadataMap) -> Metadata {
    use tonic::metadata::KeyAndValueRef;
    let mut ours = Metadata::new();
    for entry in map.iter() {
        let _ = match entry {
            KeyAndValueRef::Ascii(key, value) => {
                if RESERVED.contains(&key.as_str()) {
                    continue;
                }
                match value.to_str() {
                    Ok(v) => ours.insert(key.as_str(), v),
                    Err(_) => continue,
                }
            }
            KeyAndValueRef::Binary(key, value) => match value.to_bytes() {
                Ok(v) => ours.insert_bin(key.as_str(), v.to_vec()),
                Err(_) => continue,
            },
        };
    }
    ours
}

/// Our metadata as gRPC's: `-bin` keys binary, the rest text; values
/// HTTP/2 cannot carry are left out.
fn metadata_to_grpc(metadata: &Metadata) -> tonic::metadata::MetadataMap {
    use tonic::metadata::{BinaryMetadataKey, MetadataKey, MetadataValue};
    let mut map = tonic::metadata::MetadataMap::new();
    for (key, value) in metadata.iter() {
        if key.ends_with("-bin") {
            if let Ok(k) = BinaryMetadataKey::from_bytes(key.as_bytes()) {
                map.insert_bin(k, MetadataValue::from_bytes(value));
            }
        } else if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            std::str::from_utf8(value)
                .ok()
                .and_then(|v| MetadataValue::try_from(v).ok())
                .ok_or(()),
        ) {
            map.insert(k, v);
        }
    }
    map
}

/// Our response as tonic's, its message mapped by `f`.
fn response_to_grpc<T, U>(response: Response<T>, f: impl FnOnce(T) -> U) -> tonic::Response<U> {
    let (metadata, message) = response.into_parts();
    let mut out = tonic::Response::new(f(message));
    *out.metadata_mut() = metadata_to_grpc(&metadata);
    out
}

/// Our status as gRPC's (same codes).
fn to_grpc(status: Status) -> tonic::Status {
    tonic::Status::new(
        tonic::Code::from_i32(status.code() as i32),
        status.message().to_owned(),
    )
}

/// A `grpc-timeout` value: up to 8 digits and a unit (`H`, `M`, `S`, `m`,
/// `u`, `n`).
fn parse_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The process's gRPC gateway for `grpc://` clients: an in-process server
/// whose fallback service passes every call on to the gRPC server its
/// metadata names, with tonic, on a runtime of its own. Started on first
/// use; it lives as long as the process.
struct Gateway {
    url: String,
    /// In a mutex only to be `Sync`, as a static must.
    _server: std::sync::Mutex<crate::ServerHandle>,
    _runtime: tokio::runtime::Runtime,
}

/// The `mem://` URL of the process's gRPC gateway, started on first use.
pub(crate) fn gateway() -> Result<&'static str, Status> {
    static GATEWAY: std::sync::OnceLock<Result<Gateway, Status>> = std::sync::OnceLock::new();
    match GATEWAY.get_or_init(Gateway::start) {
        Ok(g) => Ok(&g.url),
        Err(status) => Err(status.clone()),
    }
}

impl Gateway {
    fn start() -> Result<Gateway, Status> {
        let runtime = runtime("gRPC gateway")?;
        let url = format!("mem://rpc-grpc-gateway-{}", std::process::id());
        // No methods of its own: every call goes to the fallback.
        let server = crate::Server::builder()
            .fallback(Arc::new(Forward {
                channels: Default::default(),
            }))
            .tokio_handle(runtime.handle().clone())
            .serve(&url)?;
        Ok(Gateway {
            url,
            _server: std::sync::Mutex::new(server),
            _runtime: runtime,
        })
    }
}

static FORWARD: crate::codegen::ServiceDescriptor = crate::codegen::ServiceDescriptor {
    name: "rpc.GrpcGateway",
    methods: &[],
};

/// Passes calls on to gRPC servers: the gateway's fallback.
struct Forward {
    /// One tonic channel (HTTP/2 connection, reconnecting) per server.
    channels: std::sync::Mutex<HashMap<String, tonic::transport::Channel>>,
}

impl Forward {
    fn channel(&self, target: &str) -> Result<tonic::transport::Channel, Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = channels.get(target) {
            return Ok(c.clone());
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{target}"))
            .map_err(|e| Status::invalid_argument(format!("grpc://{target}: {e}")))?
            .tcp_nodelay(true)
            .connect_lazy();
        channels.insert(target.to_owned(), channel.clone());
        Ok(channel)
    }
}

/// A call as tonic sends it: our metadata (the gateway's keys left out),
/// and what is left of our deadline.
fn to_tonic<T, U>(request: Request<T>, f: impl FnOnce(T) -> U) -> tonic::Request<U> {
    let deadline = request.deadline();
    let mut metadata = request.metadata().clone();
    for key in [
        crate::client::GATEWAY_TARGET,
        crate::client::GATEWAY_PATH,
        crate::server::FALLBACK_KIND,
    ] {
        metadata.remove(key);
    }
    let mut out = tonic::Request::new(f(request.into_inner()));
    *out.metadata_mut() = metadata_to_grpc(&metadata);
    if let Some(at) = deadline {
        out.set_timeout(at.saturating_duration_since(std::time::Instant::now()));
    }
    out
}

/// tonic's status as ours (same codes).
fn from_grpc(status: tonic::Status) -> Status {
    Status::new(
        crate::Code::from_u16(status.code() as u16),
        status.message().to_owned(),
    )
}

/// tonic's response as ours.
fn from_tonic<T, U>(response: tonic::Response<T>, f: impl FnOnce(T) -> U) -> Response<U> {
    let metadata = metadata_from_grpc(response.metadata());
    Response::from_parts(metadata, f(response.into_inner()))
}

/// A gRPC server's response stream, as our handler returns it.
struct FromServer(tonic::Streaming<Bytes>);

impl Stream for FromServer {
    type Item = Result<RawMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|m| m.map(|m| m.map(|b| RawMessage(b.to_vec())).map_err(from_grpc)))
    }
}

/// Our client's request stream, as tonic sends it: it ends where ours
/// ends or fails (a failed one cancels the call when its handler goes).
struct ToServer(Streaming<RawMessage>);

impl Stream for ToServer {
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|m| m.and_then(|m| m.ok()).map(|m| Bytes::from(m.0)))
    }
}

/// A tonic client of `channel`, once it can send (connected); a channel
/// that could not be made fails the call with its status, whatever its
/// kind.
async fn ready(
    channel: Result<tonic::transport::Channel, Status>,
) -> Result<tonic::client::Grpc<tonic::transport::Channel>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel?)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("gRPC server: {e}")))?;
    Ok(grpc)
}

impl crate::Service for Forward {
    fn descriptor(&self) -> &'static crate::codegen::ServiceDescriptor {
        &FORWARD
    }

    fn call(&self, call: crate::ServerCall) {
        let md = call.metadata();
        let target = md.get(crate::client::GATEWAY_TARGET).map(str::to_owned);
        let path = md
            .get(crate::client::GATEWAY_PATH)
            .and_then(|p| http::uri::PathAndQuery::try_from(p).ok());
        let kind = md.get(crate::server::FALLBACK_KIND).map(str::to_owned);
        let (Some(target), Some(path), Some(kind)) = (target, path, kind) else {
            return call.unimplemented();
        };
        let channel = self.channel(&target);
        match kind.as_str() {
            "unary" => call.unary_async(move |r: Request<RawMessage>| async move {
                let mut grpc = ready(channel).await?;
                let reply = grpc
                    .unary(to_tonic(r, |m| Bytes::from(m.0)), path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(from_tonic(reply, |b| RawMessage(b.to_vec())))
            }),
            "server" => call.server_streaming(move |r: Request<RawMessage>| async move {
                let mut grpc = ready(channel).await?;
                let reply = grpc
                    .server_streaming(to_tonic(r, |m| Bytes::from(m.0)), path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(from_tonic(reply, FromServer))
            }),
            "client" => {
                call.client_streaming(move |r: Request<Streaming<RawMessage>>| async move {
                    let mut grpc = ready(channel).await?;
                    let reply = grpc
                        .client_streaming(to_tonic(r, ToServer), path, RawCodec)
                        .await
                        .map_err(from_grpc)?;
                    Ok(from_tonic(reply, |b| RawMessage(b.to_vec())))
                })
            }
            _ => call.streaming(move |r: Request<Streaming<RawMessage>>| async move {
                let mut grpc = ready(channel).await?;
                let reply = grpc
                    .streaming(to_tonic(r, ToServer), path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(from_tonic(reply, FromServer))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_timeout;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        assert_eq!(parse_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "5", "S", "123456789S", "5s", "-5S", "5X"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
    }
}
