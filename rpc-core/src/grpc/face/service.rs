//! tonic's side of a face call: the one service every gRPC path reaches
//! ([`Proxy`]), routed to the server's method and served as the kind of
//! call it is; the request's head read as ours, and the response, its
//! initial metadata and its trailers written as gRPC's.

use super::local::{Head, Local};
use crate::descriptor::MethodKind;
use crate::grpc::codec::{RawCodec, metadata_from_grpc, metadata_to_grpc, parse_timeout, to_grpc};
use crate::grpc::relay::{HeldEnd, HoldEnd, UntilFailed};
use crate::streaming::{Pump, RequestPump};
use crate::{Peer, RawMessage, Streaming};
use futures_core::Stream;
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

/// A gRPC client's request stream, as our call on the face reads it.
type Incoming = UntilFailed<tonic::Streaming<Bytes>, fn(Bytes) -> RawMessage>;

fn incoming(stream: tonic::Streaming<Bytes>, hold_end: HoldEnd) -> Incoming {
    UntilFailed::new(stream, |b| RawMessage(Vec::from(b)), hold_end)
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
