//! The gateway of `grpc://` URLs: an in-process server, one per process,
//! whose fallback passes every call of our clients on to the gRPC server
//! its metadata names, over one tonic channel per server and TLS settings.

use super::codec::{RawCodec, from_grpc, metadata_from_grpc, metadata_to_grpc};
use super::relay::{HoldEnd, UntilFailed};
use super::runtime;
use crate::descriptor::ServiceDescriptor;
use crate::{RawMessage, Request, Response, Status, Streaming};
use futures_core::Stream;
use prost::bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

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

static FORWARD: ServiceDescriptor = ServiceDescriptor {
    name: "rpc.GrpcGateway",
    methods: &[],
};

/// The TLS settings of `grpc://` channels, numbered: a call names its
/// channel's by number ([`crate::conventions::GATEWAY_TLS`]). Equal settings
/// share a number, so the list grows only with distinct settings.
#[cfg(feature = "tls")]
static GATEWAY_TLS: std::sync::Mutex<Vec<crate::tls::ClientTlsConfig>> =
    std::sync::Mutex::new(Vec::new());

/// The number of `config` among the gateway's TLS settings.
#[cfg(feature = "tls")]
pub(crate) fn gateway_tls(config: &crate::tls::ClientTlsConfig) -> String {
    let mut known = GATEWAY_TLS.lock().unwrap_or_else(|e| e.into_inner());
    let n = match known.iter().position(|c| c.same_as(config)) {
        Some(n) => n,
        None => {
            known.push(config.clone());
            known.len() - 1
        }
    };
    n.to_string()
}

/// tonic's TLS settings numbered `n`.
#[cfg(feature = "tls")]
fn gateway_tls_config(n: &str) -> Option<tonic::transport::ClientTlsConfig> {
    let known = GATEWAY_TLS.lock().unwrap_or_else(|e| e.into_inner());
    Some(known.get(n.parse::<usize>().ok()?)?.to_tonic())
}

/// Passes calls on to gRPC servers: the gateway's fallback.
struct Forward {
    /// One tonic channel (HTTP/2 connection, reconnecting) per server and
    /// TLS settings.
    channels: std::sync::Mutex<HashMap<(String, Option<String>), tonic::transport::Channel>>,
}

impl Forward {
    /// The channel to `target`, over TLS with the settings numbered `tls`.
    fn channel(
        &self,
        target: &str,
        tls: Option<&str>,
    ) -> Result<tonic::transport::Channel, Status> {
        let key = (target.to_owned(), tls.map(str::to_owned));
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = channels.get(&key) {
            return Ok(c.clone());
        }
        let bad =
            |e: &dyn std::fmt::Display| Status::invalid_argument(format!("grpc://{target}: {e}"));
        let scheme = if tls.is_some() { "https" } else { "http" };
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{target}"))
            .map_err(|e| bad(&e))?
            .tcp_nodelay(true);
        if let Some(n) = tls {
            #[cfg(feature = "tls")]
            {
                let config = gateway_tls_config(n).ok_or_else(|| {
                    Status::internal(format!("gRPC gateway: no TLS settings {n}"))
                })?;
                endpoint = endpoint.tls_config(config).map_err(|e| bad(&e))?;
            }
            #[cfg(not(feature = "tls"))]
            return Err(bad(&format!("TLS settings {n}, and no TLS in this build")));
        }
        let channel = endpoint.connect_lazy();
        channels.insert(key, channel.clone());
        Ok(channel)
    }
}

/// A call as tonic sends it: our metadata (the gateway's keys left out),
/// and what is left of our deadline.
fn to_tonic<T, U>(request: Request<T>, f: impl FnOnce(T) -> U) -> tonic::Request<U> {
    let deadline = request.deadline();
    let mut metadata = request.metadata().clone();
    for key in [
        crate::conventions::GATEWAY_TARGET,
        crate::conventions::GATEWAY_PATH,
        crate::conventions::GATEWAY_TLS,
        crate::conventions::FALLBACK_KIND,
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

/// Our client's request stream, as the gateway sends it to a gRPC server.
fn to_server(
    stream: Streaming<RawMessage>,
) -> UntilFailed<Streaming<RawMessage>, fn(RawMessage) -> Bytes> {
    UntilFailed::new(stream, |m| Bytes::from(m.0), HoldEnd::No)
}

/// tonic's response as ours.
fn from_tonic<T, U>(response: tonic::Response<T>, f: impl FnOnce(T) -> U) -> Response<U> {
    let metadata = metadata_from_grpc(response.metadata());
    Response::from_parts(metadata, f(response.into_inner()))
}

/// A gRPC server's response stream, as our handler returns it; at its
/// clean end, the server's trailing metadata goes into `trailers`.
struct FromServer {
    stream: tonic::Streaming<Bytes>,
    trailers: crate::Trailers,
}

impl FromServer {
    /// The handler's response for `stream`.
    fn response(reply: tonic::Response<tonic::Streaming<Bytes>>) -> Response<FromServer> {
        let trailers = crate::Trailers::new();
        from_tonic(reply, |stream| FromServer {
            stream,
            trailers: trailers.clone(),
        })
        .with_trailers(trailers)
    }
}

impl Stream for FromServer {
    type Item = Result<RawMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = Pin::new(&mut self.stream).poll_next(cx);
        if let Poll::Ready(None) = next {
            // Read with the end of the body: ready at once.
            let this = &mut *self;
            let mut trailers = std::pin::pin!(this.stream.trailers());
            if let Poll::Ready(Ok(Some(map))) = trailers.as_mut().poll(cx) {
                this.trailers.insert_all(&metadata_from_grpc(&map));
            }
        }
        next.map(|m| m.map(|m| m.map(|b| RawMessage(b.to_vec())).map_err(from_grpc)))
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
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &FORWARD
    }

    fn call(&self, call: crate::ServerCall) {
        let md = call.metadata();
        let target = md
            .get(crate::conventions::GATEWAY_TARGET)
            .map(str::to_owned);
        let path = md
            .get(crate::conventions::GATEWAY_PATH)
            .and_then(|p| http::uri::PathAndQuery::try_from(p).ok());
        let kind = md.get(crate::conventions::FALLBACK_KIND).map(str::to_owned);
        let tls = md.get(crate::conventions::GATEWAY_TLS).map(str::to_owned);
        let (Some(target), Some(path), Some(kind)) = (target, path, kind) else {
            return call.unimplemented();
        };
        let channel = self.channel(&target, tls.as_deref());
        match kind.as_str() {
            // A cancel by our caller drops the handler, and with it tonic's
            // call, which resets its HTTP/2 stream.
            "unary" => call.unary_async(move |r: Request<RawMessage>| async move {
                let mut grpc = ready(channel).await?;
                let request = to_tonic(r, |m| Bytes::from(m.0));
                let reply = grpc
                    .unary(request, path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(from_tonic(reply, |b| RawMessage(b.to_vec())))
            }),
            "server" => call.server_streaming(move |r: Request<RawMessage>| async move {
                let mut grpc = ready(channel).await?;
                let request = to_tonic(r, |m| Bytes::from(m.0));
                let reply = grpc
                    .server_streaming(request, path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(FromServer::response(reply))
            }),
            "client" => {
                call.client_streaming(move |r: Request<Streaming<RawMessage>>| async move {
                    let mut grpc = ready(channel).await?;
                    let request = to_tonic(r, to_server);
                    let reply = grpc
                        .client_streaming(request, path, RawCodec)
                        .await
                        .map_err(from_grpc)?;
                    Ok(from_tonic(reply, |b| RawMessage(b.to_vec())))
                })
            }
            _ => call.streaming(move |r: Request<Streaming<RawMessage>>| async move {
                let mut grpc = ready(channel).await?;
                let request = to_tonic(r, to_server);
                let reply = grpc
                    .streaming(request, path, RawCodec)
                    .await
                    .map_err(from_grpc)?;
                Ok(FromServer::response(reply))
            }),
        }
    }
}
