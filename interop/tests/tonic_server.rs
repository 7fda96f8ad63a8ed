//! `interop-client --url grpc://` against a stock tonic `TestService`
//! server (tonic-build's code of the same `test.proto`, written here as
//! tonic's own interop server is): what our clients see of another team's
//! tonic service through the `grpc://` gateway.
//!
//! Three cases ask of the server what tonic cannot do, and are left out:
//! `client_compressed_unary` and `client_compressed_streaming` (their
//! probe needs the server to know that a request came uncompressed: a
//! tonic handler is not told) and `server_compressed_streaming` (one
//! message of a stream compressed and the next not: tonic compresses all
//! of a stream or none). The face runs all 19 (tests/cases.rs).

use std::pin::Pin;
use std::process::Command;
use std::task::{Context, Poll};
use std::time::Duration;
use stock::test_service_server::{TestService, TestServiceServer};
use stock::{
    Empty, Payload, SimpleRequest, SimpleResponse, StreamingInputCallRequest,
    StreamingInputCallResponse, StreamingOutputCallRequest, StreamingOutputCallResponse,
};
use tonic::codec::CompressionEncoding;
use tonic::codegen::http;
use tonic::{Request, Response, Status, Streaming};

/// tonic's code of gRPC's test service.
mod stock {
    #![allow(clippy::all, missing_docs, dead_code)]
    include!(concat!(env!("OUT_DIR"), "/tonic/grpc.testing.rs"));
}

const ECHO_INITIAL: &str = "x-grpc-test-echo-initial";
const ECHO_TRAILING: &str = "x-grpc-test-echo-trailing-bin";

/// The cases a tonic server can serve (all but the three above).
const CASES: &str = "empty_unary,large_unary,server_compressed_unary,client_streaming,\
    server_streaming,ping_pong,empty_stream,custom_metadata,status_code_and_message,\
    special_status_message,unimplemented_method,unimplemented_service,cancel_after_begin,\
    cancel_after_first_response,timeout_on_sleeping_server,concurrent_large_unary";

type Responses =
    Pin<Box<dyn futures::Stream<Item = Result<StreamingOutputCallResponse, Status>> + Send>>;

fn zeros(size: i32) -> Result<Payload, Status> {
    let size = usize::try_from(size).map_err(|_| Status::invalid_argument("a negative size"))?;
    Ok(Payload {
        r#type: 0,
        body: vec![0; size],
    })
}

fn echo_status(status: Option<&stock::EchoStatus>) -> Result<(), Status> {
    match status.filter(|s| s.code != 0) {
        Some(s) => Err(Status::new(tonic::Code::from(s.code), s.message.clone())),
        None => Ok(()),
    }
}

/// The responses each request of a stream asks for, in order; a
/// request's Echo Status ends the stream with it.
fn duplex(
    requests: impl futures::Stream<Item = Result<StreamingOutputCallRequest, Status>> + Send + 'static,
) -> Responses {
    use futures::StreamExt;
    let stream = requests
        .then(|request| async move {
            let request = match request {
                Ok(r) => r,
                Err(status) => return vec![Err(status)],
            };
            if let Err(status) = echo_status(request.response_status.as_ref()) {
                return vec![Err(status)];
            }
            let mut out = Vec::new();
            for p in request.response_parameters {
                if p.interval_us > 0 {
                    tokio::time::sleep(Duration::from_micros(p.interval_us as u64)).await;
                }
                out.push(zeros(p.size).map(|payload| StreamingOutputCallResponse {
                    payload: Some(payload),
                }));
            }
            out
        })
        .flat_map(futures::stream::iter);
    Box::pin(interop::server::until_first_error(stream))
}

struct Stock;

#[tonic::async_trait]
impl TestService for Stock {
    async fn empty_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }

    async fn unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        let request = request.into_inner();
        echo_status(request.response_status.as_ref())?;
        let mut response = Response::new(SimpleResponse {
            payload: Some(zeros(request.response_size)?),
            ..Default::default()
        });
        // The server sends gzip; a response asked not to be compressed is
        // not.
        if request.response_compressed.is_some_and(|c| !c.value) {
            response
                .extensions_mut()
                .insert(tonic::codec::SingleMessageCompressionOverride::Disable);
        }
        Ok(response)
    }

    async fn cacheable_unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        self.unary_call(request).await
    }

    type StreamingOutputCallStream = Responses;

    async fn streaming_output_call(
        &self,
        request: Request<StreamingOutputCallRequest>,
    ) -> Result<Response<Responses>, Status> {
        let requests = futures::stream::iter([Ok(request.into_inner())]);
        Ok(Response::new(duplex(requests)))
    }

    async fn streaming_input_call(
        &self,
        request: Request<Streaming<StreamingInputCallRequest>>,
    ) -> Result<Response<StreamingInputCallResponse>, Status> {
        let mut requests = request.into_inner();
        let mut total = 0;
        while let Some(message) = requests.message().await? {
            total += message.payload.map_or(0, |p| p.body.len());
        }
        Ok(Response::new(StreamingInputCallResponse {
            aggregated_payload_size: total as i32,
        }))
    }

    type FullDuplexCallStream = Responses;

    async fn full_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Responses>, Status> {
        Ok(Response::new(duplex(request.into_inner())))
    }

    type HalfDuplexCallStream = Responses;

    async fn half_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut requests = request.into_inner();
        let mut buffered = Vec::new();
        while let Some(message) = requests.message().await? {
            buffered.push(Ok(message));
        }
        Ok(Response::new(duplex(futures::stream::iter(buffered))))
    }

    async fn unimplemented_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Err(Status::unimplemented("UnimplementedCall"))
    }
}

/// Echo Metadata, as tonic's interop server does it (tonic's handlers
/// cannot set a stream's trailers): the request's
/// `x-grpc-test-echo-initial` goes back in the response's headers, its
/// `x-grpc-test-echo-trailing-bin` in the trailers.
#[derive(Clone)]
struct EchoMetadata<S>(S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for EchoMetadata<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<B>> for EchoMetadata<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let initial = request.headers().get(ECHO_INITIAL).cloned();
        let trailing = request.headers().get(ECHO_TRAILING).cloned();
        let response = self.0.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            if let Some(value) = initial {
                response.headers_mut().insert(ECHO_INITIAL, value);
            }
            Ok(match trailing {
                Some(value) => response.map(|body| {
                    tonic::body::Body::new(WithTrailer {
                        body,
                        trailer: Some(value),
                    })
                }),
                None => response,
            })
        })
    }
}

/// A body with one more trailer.
struct WithTrailer {
    body: tonic::body::Body,
    trailer: Option<http::HeaderValue>,
}

impl http_body::Body for WithTrailer {
    type Data = prost::bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Status>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(match frame.into_trailers() {
                Ok(mut trailers) => {
                    if let Some(value) = self.trailer.take() {
                        trailers.insert(ECHO_TRAILING, value);
                    }
                    http_body::Frame::trailers(trailers)
                }
                Err(frame) => frame,
            }))),
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}

#[test]
fn interop_client_passes_against_a_stock_tonic_server_through_grpc_urls() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let service = TestServiceServer::new(Stock)
        .send_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Zstd);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = rt.spawn(
        tonic::transport::Server::builder()
            .add_service(EchoMetadata(service))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_interop-client"))
        .args(["--url", &format!("grpc://{addr}"), "--test_case", CASES])
        .output()
        .expect("interop-client runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let _ = stop.send(());
    rt.block_on(served).unwrap().unwrap();
    assert!(
        out.status.success() && stdout.ends_with("16 passed, 0 failed\n"),
        "{}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
