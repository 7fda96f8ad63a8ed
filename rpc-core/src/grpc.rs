//! The gRPC face of a server ([`ServerBuilder::grpc`](crate::ServerBuilder::grpc)):
//! standard gRPC over HTTP/2 on a TCP address, beside the server's own
//! URL, served by tonic, for callers that speak gRPC (other languages,
//! grpcurl, load balancers, Kubernetes probes).
//!
//! It also holds the gateway of `grpc://` URLs: our clients calling a
//! standard gRPC server (see [`gateway`]).
//!
//! Every gRPC call is started on the server's own routes as a dispatcher
//! starts a request, and its handler runs on the tokio worker that read
//! it, as tonic runs its handlers (see [`Local`]): the same handlers,
//! interceptors, blocking pool, deadlines (`grpc-timeout`), cancellation
//! (a reset HTTP/2 stream cancels the call), metadata and trailers,
//! status codes and streams of all four kinds, and the caller's address.
//! Messages pass as their encoded bytes: nothing is decoded twice. The
//! rdma:// and tcp:// paths do not change.

use crate::codegen::MethodKind;
use crate::dispatch::{Frame, OutFrame};
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, FrameKind, SendError};
use crate::server::{NewCall, Registry, ServerShared};
use crate::streaming::{CallOwner, Link, Outbox, Pump, RequestPump, StreamCore};
use crate::{Metadata, Peer, RawMessage, Request, Response, Status, Streaming};
use futures_core::Stream;
use prost::bytes::{Buf, BufMut, Bytes};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The face's TLS settings: the server's own, for tonic.
#[cfg(feature = "tls")]
pub(crate) type FaceTls = tonic::transport::ServerTlsConfig;
/// Without TLS there are none.
#[cfg(not(feature = "tls"))]
pub(crate) type FaceTls = std::convert::Infallible;

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
    /// starting each call on `shared` (the server's routes, interceptors
    /// and calls in flight), on `handle`'s runtime or one of its own.
    pub(crate) fn start(
        addr: &str,
        shared: Arc<ServerShared>,
        handle: Option<tokio::runtime::Handle>,
        tls: Option<FaceTls>,
    ) -> Result<GrpcFace, Status> {
        let mut server =
            tonic::transport::Server::builder().max_concurrent_streams(shared.max_streams());
        #[cfg(feature = "tls")]
        if let Some(tls) = tls {
            server = server
                .tls_config(tls)
                .map_err(|e| Status::invalid_argument(format!("gRPC face: TLS: {e}")))?;
        }
        #[cfg(not(feature = "tls"))]
        let _: Option<FaceTls> = tls;
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
            local: Arc::new(Local {
                shared,
                registry: Arc::default(),
                next_id: AtomicU64::new(1),
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
            let served = server
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

/// The server as the face calls it: each gRPC call is started on the
/// server's shared state as a dispatcher starts a request (routes,
/// interceptors, deadline, the blocking pool), with its handler run on the
/// tokio worker that read it. No ring and no dispatcher sit between them:
/// the call's frames pass through two [`LocalLink`]s, one towards each
/// end, into the same stream state (windows,
/// half-close, cancel) that a connection's frames reach.
struct Local {
    shared: Arc<ServerShared>,
    /// The face's calls that hear from their caller after the request.
    registry: Arc<Registry>,
    next_id: AtomicU64,
}

/// The face's calls' "queue pair": the face has a registry of its own.
const FACE_QP: u32 = 0;

/// The face's end of a started call: what arrives from the handler, and
/// the link for what the caller sends.
struct Started {
    core: Arc<StreamCore>,
    link: Arc<dyn Link>,
    call_id: CallId,
    owner: Arc<dyn CallOwner>,
}

impl Started {
    /// The stream of what the handler sends; `pump` sends the caller's
    /// request stream.
    fn stream(self, pump: Option<Box<dyn Pump>>) -> Streaming<RawMessage> {
        Streaming::new(self.core, self.link, self.call_id, Some(self.owner), pump)
    }

    /// The outbox of the caller's request stream.
    fn outbox(&self) -> Outbox {
        Outbox::new(self.core.clone(), self.link.clone(), self.call_id, 0, None)
    }
}

impl Local {
    /// Starts a call of the method `method_id` (of `kind`) with the
    /// request `first` (unary and server-streaming calls).
    fn start(
        self: &Arc<Self>,
        method_id: u32,
        kind: MethodKind,
        head: Head,
        first: Option<Bytes>,
    ) -> Started {
        let call_id = CallId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let core = StreamCore::new(DEFAULT_WINDOW, kind.server_streams());
        let max_message = self.shared.max_message();
        let to_face: Arc<dyn Link> = Arc::new(LocalLink {
            remote: head.remote.clone(),
            max_message,
            to: To::Face {
                core: core.clone(),
                final_message: !kind.server_streams(),
            },
        });
        let timeout_us = crate::protocol::timeout_field(head.timeout);
        self.shared.start_call_on_tokio(
            &self.registry,
            NewCall {
                qp_num: FACE_QP,
                call_id,
                method_id,
                timeout_us,
                metadata: Some(head.metadata),
                payload: first.map(Vec::from).unwrap_or_default().into(),
                sink: to_face,
                remote: &head.remote,
                kind: None,
            },
        );
        Started {
            core: core.clone(),
            link: Arc::new(LocalLink {
                remote: head.remote,
                max_message,
                to: To::Handler(self.clone()),
            }),
            call_id,
            owner: Arc::new(FaceOwner {
                local: self.clone(),
                core,
            }),
        }
    }
}

/// A frame of `out`, as a connection would deliver it: its payload
/// written by `fill`, checked against `max` bytes.
fn frame_of(
    out: &OutFrame<'_>,
    max: usize,
    fill: &mut dyn FnMut(&mut [u8]),
) -> Result<Frame, SendError> {
    let header = out.header(max)?;
    let mut payload = vec![0; out.payload_len];
    fill(&mut payload);
    Ok(Frame {
        header,
        metadata: Some(out.metadata.cloned().unwrap_or_default()),
        payload: payload.into(),
    })
}

/// One end of a face call's in-process link: what would be a connection.
struct LocalLink {
    remote: Arc<Peer>,
    max_message: usize,
    to: To,
}

/// Where a [`LocalLink`]'s frames go.
enum To {
    /// What the handler sends, to the face's end of the call: as a
    /// client's dispatcher applies a server's frames to a stream. With
    /// `final_message`, the response is one message, in the final frame
    /// (unary and client-streaming calls).
    Face {
        core: Arc<StreamCore>,
        final_message: bool,
    },
    /// What the caller sends after its request (stream messages,
    /// half-close, window), to the server's end of the call: as a
    /// server's dispatcher applies a client's frames.
    Handler(Arc<Local>),
}

impl LocalLink {
    /// Applies a handler's frame to the face's end of the call.
    fn to_face(core: &StreamCore, final_message: bool, frame: Frame) -> Result<(), SendError> {
        let h = frame.header;
        let applied = match h.kind {
            FrameKind::Message => {
                core.on_message(&h, frame.payload, frame.metadata.unwrap_or_default())
            }
            FrameKind::Window => core.on_grant(h.timeout_us),
            FrameKind::Response => {
                let last = final_message.then_some(frame.payload);
                core.on_end(Ok(()), last, frame.metadata, true)
            }
            FrameKind::Error => {
                let status = crate::client::error_status(&frame);
                core.on_end(Err(status), None, frame.metadata, true)
            }
            kind => {
                return Err(SendError::Closed(format!(
                    "a handler sent a {kind:?} frame to the gRPC face"
                )));
            }
        };
        applied.map_err(|e| {
            let why = format!("stream protocol violation: {e}");
            core.fail(Status::internal(why.clone()));
            SendError::Closed(why)
        })
    }
}

impl Link for LocalLink {
    fn send(
        &self,
        out: &OutFrame<'_>,
        _cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        if let To::Face { core, .. } = &self.to {
            if core.is_over() {
                return Err(SendError::Closed("the gRPC caller went away".into()));
            }
        }
        let frame = frame_of(out, self.max_message, fill)?;
        match &self.to {
            To::Face {
                core,
                final_message,
            } => LocalLink::to_face(core, *final_message, frame),
            To::Handler(local) => local
                .registry
                .on_call_frame(FACE_QP, frame)
                .map_err(SendError::Closed),
        }
    }

    fn uncork(&self) {}

    fn peer(&self) -> &str {
        &self.remote.addr
    }

    fn max_message(&self) -> usize {
        self.max_message
    }

    fn remote(&self) -> Option<Arc<Peer>> {
        Some(self.remote.clone())
    }

    fn recycle(&self, _: crate::payload::Payload) {}
}

/// Cancels a call the face lets go of before it ended (the caller reset
/// its HTTP/2 stream, or its deadline passed).
struct FaceOwner {
    local: Arc<Local>,
    core: Arc<StreamCore>,
}

impl CallOwner for FaceOwner {
    fn release(&self, call_id: CallId) {
        if self.core.end_code().is_some() {
            return;
        }
        self.core
            .fail(Status::cancelled("the gRPC caller cancelled the call"));
        let cancel = OutFrame {
            kind: FrameKind::Cancel,
            flags: 0,
            call_id,
            method_id: 0,
            status: 0,
            timeout_us: 0,
            metadata: None,
            payload_len: 0,
        };
        let sent = frame_of(&cancel, usize::MAX, &mut |_| {})
            .map_err(|e| Status::from(e).message().to_owned())
            .and_then(|frame| self.local.registry.on_call_frame(FACE_QP, frame));
        if let Err(why) = sent {
            tracing::debug!(%why, "could not cancel a call of the gRPC face");
        }
    }

    fn progress(&self) -> bool {
        false
    }

    fn ensure_polled(&self) {}
}

/// Every gRPC path, routed to the server's methods.
#[derive(Clone)]
struct Proxy {
    local: Arc<Local>,
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
        let local = self.local.clone();
        Box::pin(async move {
            let path = request.uri().path();
            let Some((method_id, kind)) = local.shared.method(path) else {
                let status = tonic::Status::unimplemented(format!("no method {path}"));
                return Ok(status.into_http());
            };
            let max = local.shared.max_message();
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(max)
                .max_encoding_message_size(max);
            let call = Call {
                local,
                method_id,
                kind,
            };
            let trailers = crate::Trailers::new();
            let response = match kind {
                MethodKind::Unary => return Ok(grpc.unary(call, request).await),
                MethodKind::ClientStreaming => {
                    return Ok(grpc.client_streaming(ClientStream(call), request).await);
                }
                MethodKind::ServerStreaming => {
                    let call = ServerStream(call, trailers.clone());
                    grpc.server_streaming(call, request).await
                }
                MethodKind::Streaming => {
                    grpc.streaming(Bidi(call, trailers.clone()), request).await
                }
            };
            // A stream's trailing metadata goes out with gRPC's status.
            Ok(response.map(|body| tonic::body::Body::new(WithTrailers { body, trailers })))
        })
    }
}

/// One gRPC call, started on the server's method `method_id`.
#[derive(Clone)]
struct Call {
    local: Arc<Local>,
    method_id: u32,
    kind: MethodKind,
}

/// A gRPC request's head as ours: its metadata (gRPC's own headers left
/// out), its deadline (`grpc-timeout`) and its caller.
struct Head {
    metadata: Metadata,
    timeout: Option<Duration>,
    remote: Arc<Peer>,
}

impl Call {
    /// Splits a gRPC request into our head and its message.
    fn head<T>(request: tonic::Request<T>) -> (Head, T) {
        let addr = request
            .remote_addr()
            .map_or_else(|| "unknown".to_owned(), |a| a.to_string());
        // The name in a client's certificate, under mutual TLS.
        #[cfg(feature = "tls")]
        let identity = request
            .peer_certs()
            .and_then(|certs| certs.first().and_then(crate::fabric::tls::identity_of));
        #[cfg(not(feature = "tls"))]
        let identity = None;
        let (metadata, _, message) = request.into_parts();
        let timeout = metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_timeout);
        let head = Head {
            metadata: metadata_from_grpc(&metadata),
            timeout,
            remote: Arc::new(Peer {
                addr,
                fabric: "grpc",
                identity,
            }),
        };
        (head, message)
    }

    /// Starts the call with the request `first` (unary and
    /// server-streaming calls) or the caller's request stream.
    fn start(
        &self,
        head: Head,
        first: Option<Bytes>,
        requests: Option<Incoming>,
    ) -> Streaming<RawMessage> {
        let started = self.local.start(self.method_id, self.kind, head, first);
        let pump =
            requests.map(|r| Box::new(RequestPump::new(r, started.outbox())) as Box<dyn Pump>);
        started.stream(pump)
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
        let (head, message) = Call::head(request);
        let stream = self.start(head, Some(message), None);
        Box::pin(answer(stream))
    }
}

/// The one response of a unary or client-streaming call, with its
/// metadata.
async fn answer(
    mut stream: Streaming<RawMessage>,
) -> Result<tonic::Response<Bytes>, tonic::Status> {
    let mut response = None;
    loop {
        match std::future::poll_fn(|cx| stream.poll_raw(cx)).await {
            Some(Ok(message)) => {
                if response.replace(message).is_some() {
                    return Err(tonic::Status::internal(
                        "the handler sent more than one response",
                    ));
                }
            }
            Some(Err(status)) => return Err(to_grpc(status)),
            None => break,
        }
    }
    let message = response
        .ok_or_else(|| tonic::Status::internal("the handler finished without a response"))?;
    let mut out = tonic::Response::new(message);
    *out.metadata_mut() = metadata_to_grpc(&stream.trailers().unwrap_or_default());
    Ok(out)
}

/// A response stream as tonic sends it; at its clean end, its trailing
/// metadata is left in `trailers`.
struct Outgoing {
    rest: Streaming<RawMessage>,
    trailers: crate::Trailers,
    /// Set when the call's request stream holds its end back (see
    /// [`UntilFailed`]); None for a call without a request stream.
    held: Option<HeldEnd>,
}

impl Stream for Outgoing {
    type Item = Result<Bytes, tonic::Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // tonic takes answers one after another in one poll of the body:
        // after the request stream held its end back, this gives the poll
        // up, so that hyper looks for a reset before the end goes on.
        if self.held.as_ref().is_some_and(HeldEnd::take) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let next = self.rest.poll_raw(cx);
        if let Poll::Ready(None) = next {
            if let Some(trailers) = self.rest.trailers() {
                self.trailers.insert_all(&trailers);
            }
        }
        next.map(|m| m.map(|m| m.map_err(to_grpc)))
    }
}

/// A gRPC response body whose trailers (gRPC's status) also carry the
/// stream's trailing metadata. gRPC's own keys win over a handler's.
struct WithTrailers {
    body: tonic::body::Body,
    trailers: crate::Trailers,
}

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        let Poll::Ready(Some(Ok(frame))) = polled else {
            return polled;
        };
        let frame = match frame.into_trailers() {
            Ok(mut trailers) => {
                for (key, value) in metadata_to_grpc(&self.trailers.get()).into_headers() {
                    if let Some(key) = key {
                        if !trailers.contains_key(&key) {
                            trailers.insert(key, value);
                        }
                    }
                }
                http_body::Frame::trailers(trailers)
            }
            Err(frame) => frame,
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A request stream passed on to the other side (a gRPC client's to our
/// call on the face, our client's to a gRPC server through the gateway):
/// each message through `map`, until the stream ends, which half-closes the
/// call on the other side. One that fails (its caller cancelled, reset its
/// HTTP/2 stream or lost its connection) does not end: an end would let
/// the handler take the messages so far for the whole stream. It stays
/// pending until the call is dropped, which cancels it on the other side
/// too.
///
/// On the face, hyper reports a reset with `NO_ERROR` as the body's end,
/// as it does a half-close (`CANCEL`, what a gRPC client sends when it
/// drops a call, is an error). So the face holds an end back for one
/// poll (`hold_end`), waking itself, and so does the call's response body
/// ([`Outgoing`], which tonic may poll many times in one poll of its own).
/// hyper looks for a reset each time the call's future is pending and
/// before each poll of its response body, and drops them on one: a reset
/// is not passed on as an end.
struct UntilFailed<S, F> {
    stream: S,
    map: F,
    failed: bool,
    /// Whether an end is held back for a poll, and who is told.
    hold_end: HoldEnd,
    /// The inner stream ended (and is not polled again).
    ended: bool,
}

/// Whether an [`UntilFailed`] holds its end back for a poll.
enum HoldEnd {
    /// The end goes on at once (the gateway's streams).
    No,
    /// Held back; nobody else is told (a client-streaming call on the
    /// face: its answer comes in its last frame, once its handler is
    /// done, so the answer's own poll is all it takes).
    Alone,
    /// Held back, and the call's response body is told, to give up its
    /// poll as well (a bidirectional call on the face).
    Told(HeldEnd),
}

/// That a face call's request stream held its end back, for its response
/// body to give up its poll as well (see [`UntilFailed`]).
#[derive(Clone, Default)]
struct HeldEnd(Arc<std::sync::atomic::AtomicBool>);

impl HeldEnd {
    fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether an end was held back since the last look.
    fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

impl<S, F> UntilFailed<S, F> {
    fn new(stream: S, map: F, hold_end: HoldEnd) -> UntilFailed<S, F> {
        UntilFailed {
            stream,
            map,
            failed: false,
            hold_end,
            ended: false,
        }
    }
}

impl<S, F, T, U, E> Stream for UntilFailed<S, F>
where
    S: Stream<Item = Result<T, E>> + Unpin,
    F: FnMut(T) -> U + Unpin,
    E: std::fmt::Display,
{
    type Item = U;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<U>> {
        if self.failed {
            return Poll::Pending;
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match std::task::ready!(Pin::new(&mut self.stream).poll_next(cx)) {
            Some(Ok(m)) => Poll::Ready(Some((self.map)(m))),
            Some(Err(e)) => {
                tracing::debug!(error = %e, "request stream failed");
                self.failed = true;
                Poll::Pending
            }
            None => {
                self.ended = true;
                match &self.hold_end {
                    HoldEnd::No => return Poll::Ready(None),
                    HoldEnd::Alone => {}
                    HoldEnd::Told(held) => held.set(),
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

/// A gRPC client's request stream, as our call on the face reads it.
type Incoming = UntilFailed<tonic::Streaming<Bytes>, fn(Bytes) -> RawMessage>;

fn incoming(stream: tonic::Streaming<Bytes>, hold_end: HoldEnd) -> Incoming {
    UntilFailed::new(stream, |b| RawMessage(Vec::from(b)), hold_end)
}

/// Our client's request stream, as the gateway sends it to a gRPC server.
fn to_server(
    stream: Streaming<RawMessage>,
) -> UntilFailed<Streaming<RawMessage>, fn(RawMessage) -> Bytes> {
    UntilFailed::new(stream, |m| Bytes::from(m.0), HoldEnd::No)
}

/// A server-streaming call (tonic's service traits, one type per kind),
/// and where its trailing metadata goes.
struct ServerStream(Call, crate::Trailers);

/// A client-streaming call.
struct ClientStream(Call);

/// A bidirectional call, and where its trailing metadata goes.
struct Bidi(Call, crate::Trailers);

impl tonic::server::ServerStreamingService<Bytes> for ServerStream {
    type Response = Bytes;
    type ResponseStream = Outgoing;
    type Future = BoxFuture<Result<tonic::Response<Outgoing>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let (head, message) = Call::head(request);
        Box::pin(started(
            self.0.start(head, Some(message), None),
            self.1.clone(),
            None,
        ))
    }
}

impl tonic::server::ClientStreamingService<Bytes> for ClientStream {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Bytes>>) -> Self::Future {
        let (head, requests) = Call::head(request);
        Box::pin(answer(self.0.start(
            head,
            None,
            Some(incoming(requests, HoldEnd::Alone)),
        )))
    }
}

impl tonic::server::StreamingService<Bytes> for Bidi {
    type Response = Bytes;
    type ResponseStream = Outgoing;
    type Future = BoxFuture<Result<tonic::Response<Outgoing>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Bytes>>) -> Self::Future {
        let (head, requests) = Call::head(request);
        let held = HeldEnd::default();
        Box::pin(started(
            self.0.start(
                head,
                None,
                Some(incoming(requests, HoldEnd::Told(held.clone()))),
            ),
            self.1.clone(),
            Some(held),
        ))
    }
}

/// A response stream, once its start is known: gRPC sends the initial
/// metadata before the first message, so this waits for it (the handler
/// sends it once it returned its stream); a stream that fails before is a
/// status.
async fn started(
    mut stream: Streaming<RawMessage>,
    trailers: crate::Trailers,
    held: Option<HeldEnd>,
) -> Result<tonic::Response<Outgoing>, tonic::Status> {
    let metadata = std::future::poll_fn(|cx| stream.poll_initial_metadata(cx))
        .await
        .map_err(to_grpc)?;
    let mut response = tonic::Response::new(Outgoing {
        rest: stream,
        trailers,
        held,
    });
    *response.metadata_mut() = metadata_to_grpc(&metadata);
    Ok(response)
}

/// A gRPC request's metadata as ours; keys ours refuses are left out.
fn metadata_from_grpc(map: &tonic::metadata::MetadataMap) -> Metadata {
    use tonic::metadata::KeyAndValueRef;
    let mut ours = Metadata::new();
    for entry in map.iter() {
        let _ = match entry {
            KeyAndValueRef::Ascii(key, value) => {
                if crate::metadata::is_reserved(key.as_str()) {
                    continue;
                }
                match value.to_str() {
                    Ok(v) => ours.insert(key.as_str(), v),
                    Err(_) => continue,
                }
            }
            KeyAndValueRef::Binary(key, _) if crate::metadata::is_reserved(key.as_str()) => {
                continue;
            }
            KeyAndValueRef::Binary(key, value) => match value.to_bytes() {
                Ok(v) => ours.insert_bin(key.as_str(), v.to_vec()),
                Err(_) => continue,
            },
        };
    }
    ours
}

/// Our metadata as gRPC's: `-bin` keys binary, the rest text, gRPC's own
/// keys left out. A binary
/// value under a text key (set with `insert_bin`) that HTTP/2 cannot carry
/// is left out, with a warning: gRPC has no way to send it under that key.
fn metadata_to_grpc(metadata: &Metadata) -> tonic::metadata::MetadataMap {
    use tonic::metadata::{BinaryMetadataKey, MetadataKey, MetadataValue};
    let mut map = tonic::metadata::MetadataMap::new();
    for (key, value) in metadata.iter() {
        // gRPC's own keys, which only a peer can have put here (ours
        // refuses them): they would break the HTTP/2 message.
        if crate::metadata::is_reserved(key) {
            continue;
        }
        if key.ends_with("-bin") {
            if let Ok(k) = BinaryMetadataKey::from_bytes(key.as_bytes()) {
                map.insert_bin(k, MetadataValue::from_bytes(value));
            }
        } else if let (Ok(k), Some(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            std::str::from_utf8(value)
                .ok()
                .and_then(|v| MetadataValue::try_from(v).ok()),
        ) {
            map.insert(k, v);
        } else {
            tracing::warn!(
                key,
                "metadata entry left out of a gRPC message: its value is not text a gRPC \
                 header can hold, and its key does not end in -bin"
            );
        }
    }
    map
}

/// Our status as gRPC's (same codes), its metadata sent as trailers and
/// its details as `grpc-status-details-bin`.
fn to_grpc(status: Status) -> tonic::Status {
    let metadata = status.metadata().map(metadata_to_grpc).unwrap_or_default();
    tonic::Status::with_details_and_metadata(
        tonic::Code::from_i32(status.code() as i32),
        status.message().to_owned(),
        Bytes::copy_from_slice(status.details()),
        metadata,
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

/// The TLS settings of `grpc://` channels, numbered: a call names its
/// channel's by number ([`crate::client::GATEWAY_TLS`]). Equal settings
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
        crate::client::GATEWAY_TARGET,
        crate::client::GATEWAY_PATH,
        crate::client::GATEWAY_TLS,
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
    use std::error::Error;
    // A status tonic made of a transport error (it has a source): the
    // connection failed or the server hung up (a TLS handshake that
    // refused us, say), whatever code tonic chose for it.
    if let (Some(source), tonic::Code::Cancelled | tonic::Code::Unknown) =
        (status.source(), status.code())
    {
        return Status::unavailable(format!("gRPC server: {}: {source}", status.message()));
    }
    Status::with_details(
        crate::Code::from_u16(status.code() as u16),
        status.message().to_owned(),
        status.details().to_vec(),
    )
    .with_metadata(metadata_from_grpc(status.metadata()))
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
        let tls = md.get(crate::client::GATEWAY_TLS).map(str::to_owned);
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
