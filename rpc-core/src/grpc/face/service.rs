//! The face's side of a gRPC call: the one service every path reaches
//! ([`Proxy`]), routed to the server's method and served as the kind of
//! call it is. The request's head is read as ours and its messages as
//! gRPC frames them, each with its compressed flag ([`Messages`]); the
//! response, its initial metadata and its trailers are written as gRPC's,
//! each message compressed as its handler sent it ([`ResponseBody`]).
//! tonic's server does the HTTP/2 (and TLS); the framing is ours so that
//! a compressed message crosses the face as it is, both ways.

use super::local::{Head, Local};
use super::relay::{HeldEnd, HoldEnd, UntilFailed};
use crate::compression::{ACCEPT_ENCODING, ENCODING, Encoding, EncodingSet};
use crate::descriptor::MethodKind;
use crate::grpc::codec::{metadata_from_grpc, metadata_to_grpc, parse_timeout, to_grpc};
use crate::grpc::framing::{Frames, Messages, reencode, status_trailers};
use crate::streaming::{Packed, Pump, RequestPump};
use crate::{Metadata, Peer, RawMessage, Status, Streaming};
use prost::bytes::Bytes;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Every gRPC path, routed to the server's methods.
#[derive(Clone)]
pub(super) struct Proxy {
    pub(super) local: Arc<Local>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A response as the face writes it.
type HttpResponse = http::Response<tonic::body::Body>;

impl tonic::codegen::Service<http::Request<axum::body::Body>> for Proxy {
    type Response = HttpResponse;
    type Error = Infallible;
    type Future = BoxFuture<Result<HttpResponse, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let local = self.local.clone();
        Box::pin(async move { Ok(serve(local, request).await) })
    }
}

/// A status as a trailers-only response.
fn failed(status: tonic::Status) -> HttpResponse {
    status.into_http()
}

/// Serves one gRPC call: routes it, reads its head and, for a unary or
/// server-streaming call, its one message, starts it on the server, and
/// answers as the kind of call it is.
async fn serve(local: Arc<Local>, request: http::Request<axum::body::Body>) -> HttpResponse {
    let path = request.uri().path();
    let Some((method_id, kind, compression)) = local.shared.method(path) else {
        return failed(tonic::Status::unimplemented(format!("no method {path}")));
    };
    let (parts, body) = request.into_parts();
    let accepted = compression.accepts();
    // gRPC's compression negotiation: what the caller's messages come in
    // (refused with the list the server takes, as gRPC says), and what
    // it takes back.
    let encoding = match parts.headers.get(ENCODING).map(|v| v.to_str()) {
        None => None,
        Some(Ok(name)) if name.trim().eq_ignore_ascii_case("identity") => None,
        Some(name) => {
            let name = name.unwrap_or("(not text)");
            match Encoding::from_name(name).filter(|e| accepted.contains(*e)) {
                Some(e) => Some(e),
                None => {
                    let status = crate::compression::unsupported(name, accepted);
                    let mut response = failed(to_grpc(status));
                    if let Ok(v) = http::HeaderValue::try_from(accepted.header_value()) {
                        response.headers_mut().insert(ACCEPT_ENCODING, v);
                    }
                    return response;
                }
            }
        }
    };
    let caller_accepts = parts
        .headers
        .get(ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map_or_else(EncodingSet::none, EncodingSet::parse);
    let head = head(parts);
    let max = local.shared.max_message();
    let mut messages = Messages::new(body, encoding, max, |e: axum::Error| {
        Status::cancelled(format!("the gRPC caller's request body failed: {e}"))
    });
    let call = Call {
        local,
        method_id,
        kind,
        caller_accepts,
    };
    // The encoding a response stream's compressed messages go in, named
    // in its headers before any is sent: the server's, if the caller
    // takes it, else the first the caller takes (a handler compresses
    // only in one of those). A message in another is re-encoded.
    let declared = compression
        .send()
        .filter(|e| caller_accepts.contains(*e))
        .or_else(|| caller_accepts.iter().next());
    let reply = Reply {
        accepted,
        declared,
        max,
    };
    match kind {
        MethodKind::Unary | MethodKind::ServerStreaming => {
            let first = match messages.next().await {
                Some(Ok(first)) => first,
                Some(Err(status)) => return failed(to_grpc(status)),
                None => return failed(tonic::Status::internal("the gRPC request has no message")),
            };
            // One message, then the request's end (as tonic reads a
            // unary request: the body to its end).
            match messages.next().await {
                None => {}
                Some(Ok(_)) => {
                    return failed(tonic::Status::internal(
                        "more than one request message for a method that takes one",
                    ));
                }
                Some(Err(status)) => return failed(to_grpc(status)),
            }
            let (stream, trailers) = call.start(head, Some(first), None);
            if kind == MethodKind::Unary {
                reply.answer(stream, trailers).await
            } else {
                reply.stream(stream, None).await
            }
        }
        MethodKind::ClientStreaming => {
            let requests = incoming(messages, HoldEnd::Alone);
            let (stream, trailers) = call.start(head, None, Some(requests));
            reply.answer(stream, trailers).await
        }
        MethodKind::Streaming => {
            let held = HeldEnd::default();
            let requests = incoming(messages, HoldEnd::Told(held.clone()));
            let (stream, _) = call.start(head, None, Some(requests));
            reply.stream(stream, Some(held)).await
        }
    }
}

/// A gRPC request's head as ours: its metadata, deadline and caller.
fn head(parts: http::request::Parts) -> Head {
    let request = tonic::Request::from_http(http::Request::from_parts(parts, ()));
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
    let metadata = request.metadata();
    let timeout = metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_timeout);
    Head {
        metadata: metadata_from_grpc(metadata),
        timeout,
        remote: Arc::new(Peer {
            addr,
            fabric: "grpc",
            identity,
        }),
    }
}

/// One gRPC call, to be started on the server's method `method_id`.
struct Call {
    local: Arc<Local>,
    method_id: u32,
    kind: MethodKind,
    /// The encodings the caller takes back (`grpc-accept-encoding`).
    caller_accepts: EncodingSet,
}

impl Call {
    /// Starts the call with the request `first` (unary and
    /// server-streaming calls) or the caller's request stream; what the
    /// handler sends comes back as it was sent, compressed or not.
    fn start(
        &self,
        head: Head,
        first: Option<Packed>,
        requests: Option<Incoming>,
    ) -> (Streaming<RawMessage>, crate::Trailers) {
        let started = self
            .local
            .start(self.method_id, self.kind, head, first, self.caller_accepts);
        let pump =
            requests.map(|r| Box::new(RequestPump::fallible(r, started.outbox())) as Box<dyn Pump>);
        let trailers = started.trailers.clone();
        (started.stream(pump), trailers)
    }
}

/// How a call's response is written.
#[derive(Clone, Copy)]
struct Reply {
    /// The encodings the server takes (its `grpc-accept-encoding`).
    accepted: EncodingSet,
    /// See `serve`: the encoding of a response stream's compressed messages.
    declared: Option<Encoding>,
    /// The largest message, inflated, the face re-encodes.
    max: usize,
}

impl Reply {
    /// The response's headers: `metadata`, and gRPC's own.
    fn head(
        &self,
        metadata: &Metadata,
        encoding: Option<Encoding>,
        body: ResponseBody,
    ) -> HttpResponse {
        let mut response = http::Response::new(tonic::body::Body::new(body));
        let headers = response.headers_mut();
        *headers = metadata_to_grpc(metadata).into_headers();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        if let Some(e) = encoding {
            headers.insert(ENCODING, http::HeaderValue::from_static(e.as_str()));
        }
        if let Ok(v) = http::HeaderValue::try_from(self.accepted.header_value()) {
            if !self.accepted.is_empty() {
                headers.insert(ACCEPT_ENCODING, v);
            }
        }
        response
    }

    /// The one response of a unary or client-streaming call, with its
    /// metadata (its trailing metadata, kept apart, in the trailers), in
    /// the encoding its handler sent it in.
    async fn answer(
        self,
        mut stream: Streaming<RawMessage>,
        trailers: crate::Trailers,
    ) -> HttpResponse {
        let mut response = None;
        loop {
            match std::future::poll_fn(|cx| stream.poll_raw(cx)).await {
                Some(Ok(message)) => {
                    if response
                        .replace((message, stream.message_encoding()))
                        .is_some()
                    {
                        return failed(tonic::Status::internal(
                            "the handler sent more than one response",
                        ));
                    }
                }
                Some(Err(status)) => return failed(to_grpc(status)),
                None => break,
            }
        }
        let Some((message, encoding)) = response else {
            return failed(tonic::Status::internal(
                "the handler finished without a response",
            ));
        };
        let mut body = ResponseBody {
            frames: Frames::default(),
            rest: None,
            trailers: Some(status_trailers(Ok(trailers.get()))),
            reply: self,
            held: None,
        };
        if let Err(status) = body.frames.push(message, encoding.is_some()) {
            return failed(to_grpc(status));
        }
        self.head(&stream.trailers().unwrap_or_default(), encoding, body)
    }

    /// A response stream, once its start is known: gRPC sends the initial
    /// metadata before the first message, so this waits for it (the
    /// handler sends it once it returned its stream); a stream that fails
    /// before is a status.
    async fn stream(
        self,
        mut stream: Streaming<RawMessage>,
        held: Option<HeldEnd>,
    ) -> HttpResponse {
        let metadata = match std::future::poll_fn(|cx| stream.poll_initial_metadata(cx)).await {
            Ok(metadata) => metadata,
            Err(status) => return failed(to_grpc(status)),
        };
        let body = ResponseBody {
            frames: Frames::default(),
            rest: Some(stream),
            trailers: None,
            reply: self,
            held,
        };
        self.head(&metadata, self.declared, body)
    }
}

/// A response's body: its messages as gRPC frames them (those the
/// handler sent at once gathered into one data frame), then trailers with
/// gRPC's status and, after a clean end, the stream's trailing metadata.
struct ResponseBody {
    frames: Frames,
    /// The handler's stream, until it ended.
    rest: Option<Streaming<RawMessage>>,
    /// The trailers, once known: they go after the last frame.
    trailers: Option<http::HeaderMap>,
    reply: Reply,
    /// Set when the call's request stream holds its end back (see
    /// [`UntilFailed`]); None for a call without a request stream.
    held: Option<HeldEnd>,
}

impl ResponseBody {
    /// Gathers what the handler sent, up to a frame's worth; `Ready` when
    /// a frame (or the end) should go, `Pending` when nothing can.
    fn poll_gather(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while let Some(rest) = self.rest.as_mut() {
            if self.frames.full() {
                return Poll::Ready(());
            }
            // hyper takes the frames one after another in one poll of
            // its own: after the request stream held its end back, this
            // gives the poll up, so that hyper looks for a reset before
            // the end goes on.
            if self.held.as_ref().is_some_and(HeldEnd::take) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let outcome = match rest.poll_raw(cx) {
                Poll::Pending if self.frames.is_empty() => return Poll::Pending,
                Poll::Pending => return Poll::Ready(()),
                Poll::Ready(Some(Ok(message))) => {
                    let r = self.reply;
                    let pushed = reencode(message, rest.message_encoding(), r.declared, r.max)
                        .and_then(|(bytes, compressed)| self.frames.push(bytes, compressed));
                    match pushed {
                        Ok(()) => continue,
                        Err(status) => Err(status),
                    }
                }
                Poll::Ready(Some(Err(status))) => Err(status),
                Poll::Ready(None) => Ok(rest.trailers().unwrap_or_default()),
            };
            // Dropping the stream cancels a handler still sending.
            self.rest = None;
            self.trailers = Some(status_trailers(outcome));
        }
        Poll::Ready(())
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        std::task::ready!(this.poll_gather(cx));
        if let Some(data) = this.frames.next() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
        }
        Poll::Ready(
            this.trailers
                .take()
                .map(|trailers| Ok(http_body::Frame::trailers(trailers))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.trailers.is_none() && self.rest.is_none()
    }
}

/// A gRPC client's request stream, as our call on the face reads it.
type Incoming = UntilFailed<Messages<axum::body::Body>>;

fn incoming(messages: Messages<axum::body::Body>, hold_end: HoldEnd) -> Incoming {
    UntilFailed::new(messages, hold_end)
}
