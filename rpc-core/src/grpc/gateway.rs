//! The gateway of `grpc://` URLs: an in-process server, one per process,
//! whose fallback passes every call of our clients on to the gRPC server
//! its metadata names, over one tonic channel (HTTP/2 connection) per
//! server and TLS settings. The gRPC framing is ours (`framing`), so that
//! each message keeps its compressed flag both ways: a message our client
//! compressed goes compressed, in the same encoding, and one the server
//! compressed reaches our client compressed as it (and its `Response` or
//! `Streaming` names the encoding), if our client takes that encoding.

use super::codec::{from_grpc, metadata_from_grpc, metadata_to_grpc};
use super::framing::{Frames, Messages, status_of, timeout_value};
use super::runtime;
use crate::compression::{ACCEPT_ENCODING, ENCODING, Encoding, EncodingSet};
use crate::descriptor::ServiceDescriptor;
use crate::{
    Code, CompressionSwitch, Metadata, RawMessage, Request, Response, Status, Streaming, Trailers,
};
use futures_core::Stream;
use prost::bytes::Bytes;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

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

/// What a call through the gateway is sent to: the channel to the gRPC
/// server, the method's path, and the encodings our client takes back.
struct Target {
    channel: Result<tonic::transport::Channel, Status>,
    path: http::uri::PathAndQuery,
    accepts: EncodingSet,
    /// The largest message the gateway inflates (the limit of what it
    /// can send our client anyway).
    max: usize,
}

/// A gRPC server's answer: its headers as metadata, and its messages.
struct Answer {
    metadata: Metadata,
    messages: FromServer,
}

impl Target {
    /// Sends a call: its head (our metadata, gateway keys left out; what is
    /// left of its deadline; `declared`, the encoding its compressed
    /// messages are in) and its body; waits for the server's headers.
    async fn send(
        self,
        mut metadata: Metadata,
        deadline: Option<Instant>,
        declared: Option<Encoding>,
        body: RequestBody,
    ) -> Result<Answer, Status> {
        let mut channel = self.channel?;
        let failure = body.failure.clone();
        for key in [
            crate::conventions::GATEWAY_TARGET,
            crate::conventions::GATEWAY_PATH,
            crate::conventions::GATEWAY_TLS,
            crate::conventions::GATEWAY_ENCODING,
            crate::conventions::FALLBACK_KIND,
        ] {
            metadata.remove(key);
        }
        let mut request = http::Request::new(tonic::body::Body::new(body));
        *request.method_mut() = http::Method::POST;
        *request.version_mut() = http::Version::HTTP_2;
        *request.uri_mut() = http::Uri::from(self.path);
        let headers = request.headers_mut();
        *headers = metadata_to_grpc(&metadata).into_headers();
        let text = http::HeaderValue::from_static;
        headers.insert(http::header::CONTENT_TYPE, text("application/grpc"));
        headers.insert(http::header::TE, text("trailers"));
        headers.insert(
            http::header::USER_AGENT,
            text(concat!("rdma-rpc/", env!("CARGO_PKG_VERSION"))),
        );
        if let Some(at) = deadline {
            let left = at.saturating_duration_since(Instant::now());
            if let Ok(v) = http::HeaderValue::try_from(timeout_value(left)) {
                headers.insert("grpc-timeout", v);
            }
        }
        if let Some(e) = declared {
            headers.insert(ENCODING, text(e.as_str()));
        }
        if !self.accepts.is_empty() {
            if let Ok(v) = http::HeaderValue::try_from(self.accepts.header_value()) {
                headers.insert(ACCEPT_ENCODING, v);
            }
        }
        use tonic::codegen::Service;
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .map_err(|e| transport_status(&e))?;
        let response = channel
            .call(request)
            .await
            .map_err(|e| failure.or(transport_status(&e)))?;
        let (parts, body) = response.into_parts();
        // Trailers-only: the status in the headers, and nothing else.
        let status = status_of(&parts.headers);
        let grpc = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/grpc"));
        if parts.status != http::StatusCode::OK || (!grpc && status.is_none()) {
            return Err(http_status(parts.status, &parts.headers));
        }
        let ended = match status {
            Some(status) if status.code() != Code::Ok => return Err(status),
            Some(_) => Some(Metadata::new()),
            None => None,
        };
        // Any encoding the gateway can inflate: it compresses again for our
        // client only in one our client takes.
        let encoding = match parts.headers.get(ENCODING).map(|v| v.to_str()) {
            None => None,
            Some(Ok(name)) if name.trim().eq_ignore_ascii_case("identity") => None,
            Some(name) => {
                let name = name.unwrap_or("(not text)");
                match Encoding::from_name(name) {
                    Some(e) => Some(e),
                    None => {
                        return Err(Status::internal(format!(
                            "the gRPC server answered in grpc-encoding {name}, which was not \
                             offered ({})",
                            self.accepts.header_value()
                        )));
                    }
                }
            }
        };
        let on_error: fn(tonic::Status) -> Status = from_grpc;
        Ok(Answer {
            metadata: metadata_from_grpc(&tonic::metadata::MetadataMap::from_headers(
                parts.headers,
            )),
            messages: FromServer {
                messages: Messages::new(body, encoding, self.max, on_error),
                max: self.max,
                ended,
                done: false,
                failure,
                trailers: Trailers::new(),
            },
        })
    }
}

/// A transport error of tonic's channel as a status: the deadline
/// (tonic's own timer for `grpc-timeout`), or an unreachable server.
fn transport_status(error: &(dyn std::error::Error + 'static)) -> Status {
    let mut source = Some(error);
    while let Some(e) = source {
        if e.is::<tonic::TimeoutExpired>() {
            return Status::deadline_exceeded(format!("gRPC call: {error}"));
        }
        source = e.source();
    }
    let mut why = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        why = format!("{why}: {e}");
        source = e.source();
    }
    Status::unavailable(format!("gRPC server: {why}"))
}

/// A response that is not gRPC's (an HTTP status other than 200, or
/// another content type), as gRPC maps it
/// (`doc/http-grpc-status-mapping.md`).
fn http_status(status: http::StatusCode, headers: &http::HeaderMap) -> Status {
    if status == http::StatusCode::OK {
        let content_type = headers
            .get(http::header::CONTENT_TYPE)
            .map_or("none".into(), |v| String::from_utf8_lossy(v.as_bytes()));
        return Status::unknown(format!(
            "the server answered content-type {content_type}, not gRPC's"
        ));
    }
    let code = match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    };
    Status::new(code, format!("the gRPC server answered HTTP {status}"))
}

/// A request's body as the gateway sends it: each message of our
/// client's, compressed again in the declared encoding if it came
/// compressed (our side inflated it), then the end. A request stream
/// that fails (our client cancelled, or a message of it could not be
/// read) fails the body, which resets the HTTP/2 stream; the call then
/// ends with the stream's status ([`Failure`]), not the reset's.
struct RequestBody {
    frames: Frames,
    stream: Option<Streaming<RawMessage>>,
    declared: Option<Encoding>,
    failure: Failure,
    /// The stream failed: the body ends with an error, once.
    failed: bool,
}

/// Why our client's request stream failed, once it did: the call's
/// status, over the reset the gateway's HTTP/2 side then sees.
#[derive(Clone, Default)]
struct Failure(Arc<std::sync::Mutex<Option<Status>>>);

impl Failure {
    fn set(&self, status: Status) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(status);
    }

    /// The request stream's failure if there was one, else `status`.
    fn or(&self, status: Status) -> Status {
        let failed = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        failed.unwrap_or(status)
    }
}

impl RequestBody {
    /// A message as the server gets it: compressed in the declared
    /// encoding if it `arrived` compressed (and there is one).
    fn push(&mut self, message: RawMessage, arrived: Option<Encoding>) {
        let pushed = match self.declared.filter(|_| arrived.is_some()) {
            Some(e) => self.frames.push(e.compress(&message.0).into(), true),
            None => self.frames.push(message.0.into(), false),
        };
        if let Err(status) = pushed {
            self.fail(status);
        }
    }

    /// The request stream failed with `status`: nothing more is sent, and
    /// the body ends with an error.
    fn fail(&mut self, status: Status) {
        self.failure.set(status);
        self.stream = None;
        self.failed = true;
    }

    /// The body of a unary or server-streaming call: one message.
    fn one(message: RawMessage, arrived: Option<Encoding>) -> RequestBody {
        let mut body = RequestBody {
            frames: Frames::default(),
            stream: None,
            declared: arrived,
            failure: Failure::default(),
            failed: false,
        };
        body.push(message, arrived);
        body
    }

    /// The body of a call with a request stream.
    fn stream(stream: Streaming<RawMessage>, declared: Option<Encoding>) -> RequestBody {
        RequestBody {
            frames: Frames::default(),
            stream: Some(stream),
            declared,
            failure: Failure::default(),
            failed: false,
        }
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        // What our client's stream has sent at once goes in one frame.
        while let Some(stream) = this.stream.as_mut() {
            if this.frames.full() {
                break;
            }
            match Pin::new(&mut *stream).poll_next(cx) {
                Poll::Ready(Some(Ok(message))) => {
                    let arrived = stream.message_encoding();
                    this.push(message, arrived);
                }
                Poll::Ready(Some(Err(status))) => {
                    tracing::debug!(%status, "request stream failed");
                    this.fail(status);
                }
                Poll::Ready(None) => this.stream = None,
                Poll::Pending => break,
            }
        }
        if let Some(data) = this.frames.next() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
        }
        if this.stream.is_some() {
            return Poll::Pending;
        }
        // Ended, or failed: an error resets the HTTP/2 stream (once).
        if std::mem::take(&mut this.failed) {
            return Poll::Ready(Some(Err(tonic::Status::cancelled(
                "the caller's request stream failed",
            ))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.stream.is_none() && !self.failed
    }
}

/// A message from a gRPC server, inflated, and the encoding it came in.
type Arrived = (RawMessage, Option<Encoding>);

/// A gRPC server's response messages, inflated (our side compresses them
/// again for our client, as [`FromServer::switch`] says), then its status;
/// at a clean end, the server's trailing metadata goes into `trailers`.
struct FromServer {
    messages: Messages<tonic::body::Body>,
    max: usize,
    /// The metadata of a trailers-only success: the stream ended so.
    ended: Option<Metadata>,
    /// It ended (cleanly or not): nothing more comes.
    done: bool,
    /// Why our client's request stream failed, if it did.
    failure: Failure,
    trailers: Trailers,
}

impl FromServer {
    /// The next message and the encoding it came in; the end, or the
    /// call's error status.
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Arrived, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(metadata) = self.ended.take() {
            self.done = true;
            self.trailers.insert_all(&metadata);
            return Poll::Ready(None);
        }
        let next = std::task::ready!(Pin::new(&mut self.messages).poll_next(cx));
        self.done = !matches!(next, Some(Ok(_)));
        Poll::Ready(match next {
            Some(Ok(packed)) => Some(match packed.encoding {
                Some(e) => e
                    .decompress(&packed.bytes, self.max)
                    .map(|m| (RawMessage(m), Some(e))),
                None => Ok((RawMessage(packed.bytes.to_vec()), None)),
            }),
            Some(Err(status)) => Some(Err(self.failure.or(status))),
            None => match self.messages.take_trailers().as_ref().and_then(status_of) {
                Some(status) if status.code() == Code::Ok => {
                    self.trailers
                        .insert_all(&status.metadata().cloned().unwrap_or_default());
                    None
                }
                Some(status) => Some(Err(self.failure.or(status))),
                None => Some(Err(Status::internal(
                    "the gRPC server's response ended without a status",
                ))),
            },
        })
    }

    /// The one message of a unary or client-streaming call's answer, with
    /// the encoding it came in and the server's trailing metadata.
    async fn only(mut self) -> Result<(RawMessage, Option<Encoding>, Metadata), Status> {
        let mut only = None;
        while let Some(next) = std::future::poll_fn(|cx| self.poll_message(cx)).await {
            if only.replace(next?).is_some() {
                return Err(Status::internal(
                    "the gRPC server sent more than one response",
                ));
            }
        }
        let (message, encoding) =
            only.ok_or_else(|| Status::internal("the gRPC server sent no response"))?;
        Ok((message, encoding, self.trailers.get()))
    }
}

/// A gRPC server's response stream, as our handler returns it: each
/// message compressed again for our client as it came (through `switch`).
struct ResponseStream {
    from: FromServer,
    switch: CompressionSwitch,
}

impl Stream for ResponseStream {
    type Item = Result<RawMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        Poll::Ready(match std::task::ready!(this.from.poll_message(cx)) {
            Some(Ok((message, encoding))) => {
                // Read as the message is encoded, right after this.
                this.switch.set(encoding);
                Some(Ok(message))
            }
            Some(Err(status)) => Some(Err(status)),
            None => None,
        })
    }
}

/// The answer to a unary or client-streaming call, as our handler returns
/// it: the server's headers and trailing metadata, its message compressed
/// again as it came.
async fn one_answer(answer: Answer) -> Result<Response<RawMessage>, Status> {
    let Answer {
        mut metadata,
        messages,
    } = answer;
    let (message, encoding, trailing) = messages.only().await?;
    for (key, value) in trailing.iter() {
        // Keys were checked when `trailing` took them.
        let _ = metadata.insert_bin(key, value);
    }
    Ok(Response::from_parts(metadata, message).send_compressed(encoding))
}

/// The answer to a call with a response stream, as our handler returns it.
fn stream_answer(answer: Answer) -> Response<ResponseStream> {
    let trailers = answer.messages.trailers.clone();
    let switch = CompressionSwitch::new(None);
    let stream = ResponseStream {
        from: answer.messages,
        switch: switch.clone(),
    };
    Response::from_parts(answer.metadata, stream)
        .with_compression_switch(switch)
        .with_trailers(trailers)
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
        // What a request stream's compressed messages are in: the
        // channel's setting, named before any comes.
        let send = md
            .get(crate::conventions::GATEWAY_ENCODING)
            .and_then(Encoding::from_name);
        let (Some(target), Some(path), Some(kind)) = (target, path, kind) else {
            return call.unimplemented();
        };
        let to = Target {
            channel: self.channel(&target, tls.as_deref()),
            path,
            accepts: call.caller_accepts(),
            max: crate::dispatch::DEFAULT_MAX_MESSAGE,
        };
        match kind.as_str() {
            // A cancel by our caller drops the handler, and with it the
            // HTTP/2 call, which resets its stream.
            "unary" => call.unary_async(move |r: Request<RawMessage>| async move {
                let (arrived, deadline) = (r.message_encoding(), r.deadline());
                let metadata = r.metadata().clone();
                let message = r.into_inner();
                let body = RequestBody::one(message, arrived);
                one_answer(to.send(metadata, deadline, arrived, body).await?).await
            }),
            "server" => call.server_streaming(move |r: Request<RawMessage>| async move {
                let (arrived, deadline) = (r.message_encoding(), r.deadline());
                let metadata = r.metadata().clone();
                let message = r.into_inner();
                let body = RequestBody::one(message, arrived);
                Ok(stream_answer(
                    to.send(metadata, deadline, arrived, body).await?,
                ))
            }),
            "client" => {
                call.client_streaming(move |r: Request<Streaming<RawMessage>>| async move {
                    let deadline = r.deadline();
                    let metadata = r.metadata().clone();
                    let stream = r.into_inner();
                    let body = RequestBody::stream(stream, send);
                    one_answer(to.send(metadata, deadline, send, body).await?).await
                })
            }
            _ => call.streaming(move |r: Request<Streaming<RawMessage>>| async move {
                let deadline = r.deadline();
                let metadata = r.metadata().clone();
                let stream = r.into_inner();
                let body = RequestBody::stream(stream, send);
                Ok(stream_answer(
                    to.send(metadata, deadline, send, body).await?,
                ))
            }),
        }
    }
}
