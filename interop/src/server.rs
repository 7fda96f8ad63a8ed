//! `grpc.testing.TestService` with every server feature of gRPC's
//! interop document that is not cloud-only: the payload sizes asked for,
//! statuses echoed (Echo Status), metadata echoed (Echo Metadata),
//! compression asked for and expected (CompressedResponse,
//! CompressedRequest), the intervals between stream messages, and
//! `UnimplementedCall` left unimplemented.

use crate::pb::test_service_server::TestService;
use crate::pb::{
    EchoStatus, Empty, Payload, ResponseParameters, SimpleRequest, SimpleResponse,
    StreamingInputCallRequest, StreamingInputCallResponse, StreamingOutputCallRequest,
    StreamingOutputCallResponse,
};
use futures::StreamExt;
use rpc_core::{
    BoxStream, Code, CompressionSwitch, Encoding, Metadata, Request, Response, Status, Streaming,
    Trailers,
};
use std::time::Duration;

/// The metadata key whose value the server sends back as initial metadata.
pub const ECHO_INITIAL: &str = "x-grpc-test-echo-initial";
/// The metadata key whose value the server sends back as trailing metadata.
pub const ECHO_TRAILING: &str = "x-grpc-test-echo-trailing-bin";

/// The encoding a response asked to be compressed goes in: gzip, which
/// every gRPC implementation knows.
pub const RESPONSE_ENCODING: Encoding = Encoding::Gzip;

/// The interop test service.
#[derive(Debug, Default, Clone, Copy)]
pub struct TestServer;

/// What a request's Echo Metadata asks for: the initial metadata to send,
/// and the trailers.
fn echoed(request: &Metadata) -> (Metadata, Trailers) {
    let mut initial = Metadata::new();
    if let Some(value) = request.get(ECHO_INITIAL) {
        let _ = initial.insert(ECHO_INITIAL, value);
    }
    let trailers = Trailers::new();
    if let Some(value) = request.get_bin(ECHO_TRAILING) {
        let _ = trailers.insert_bin(ECHO_TRAILING, value.to_vec());
    }
    (initial, trailers)
}

/// A payload of `size` zero bytes (`INVALID_ARGUMENT` for a negative size).
fn zeros(size: i32) -> Result<Payload, Status> {
    let size = usize::try_from(size)
        .map_err(|_| Status::invalid_argument(format!("a payload of {size} bytes")))?;
    Ok(Payload {
        r#type: 0,
        body: vec![0; size].into(),
    })
}

/// The status an Echo Status asks for, if any (a non-zero code).
fn echo_status(status: Option<&EchoStatus>) -> Option<Status> {
    let status = status.filter(|s| s.code != 0)?;
    let code = u16::try_from(status.code).map_or(Code::Unknown, Code::from_u16);
    Some(Status::new(code, status.message.clone()))
}

/// `INVALID_ARGUMENT` if a message that expected compression did not come
/// compressed (CompressedRequest).
fn check_compressed(expect: bool, arrived: Option<Encoding>) -> Result<(), Status> {
    if expect && arrived.is_none() {
        return Err(Status::invalid_argument(
            "expected a compressed message, and this one was not",
        ));
    }
    Ok(())
}

/// Answers a `SimpleRequest` (UnaryCall, CacheableUnaryCall).
fn simple(request: Request<SimpleRequest>) -> Result<Response<SimpleResponse>, Status> {
    let (initial, trailers) = echoed(request.metadata());
    let arrived = request.message_encoding();
    let message = request.into_inner();
    check_compressed(message.expect_compressed.is_some_and(|b| b.value), arrived)?;
    if let Some(status) = echo_status(message.response_status.as_ref()) {
        return Err(status.with_metadata(trailers.get()));
    }
    let reply = SimpleResponse {
        payload: Some(zeros(message.response_size)?),
        ..SimpleResponse::default()
    };
    let mut response = Response::from_parts(initial, reply).with_trailers(trailers);
    if let Some(compressed) = message.response_compressed {
        response = response.send_compressed(compressed.value.then_some(RESPONSE_ENCODING));
    }
    Ok(response)
}

/// The responses one `StreamingOutputCallRequest` asks for, each after its
/// interval, compressed or not as its parameters say (through `switch`).
async fn respond(
    parameters: Vec<ResponseParameters>,
    switch: CompressionSwitch,
) -> Vec<Result<(StreamingOutputCallResponse, Option<Encoding>), Status>> {
    let mut out = Vec::with_capacity(parameters.len());
    for p in parameters {
        if p.interval_us > 0 {
            let pause = Duration::from_micros(p.interval_us as u64);
            rpc_core::blocking(move || std::thread::sleep(pause)).await;
        }
        let encoding = match p.compressed {
            Some(c) => c.value.then_some(RESPONSE_ENCODING),
            None => switch.get(),
        };
        out.push(zeros(p.size).map(|payload| {
            (
                StreamingOutputCallResponse {
                    payload: Some(payload),
                },
                encoding,
            )
        }));
    }
    out
}

/// The response stream of FullDuplexCall and HalfDuplexCall: the responses
/// each request asks for, in order; a request's Echo Status ends the
/// stream with that status.
fn duplex(
    requests: impl futures::Stream<Item = Result<StreamingOutputCallRequest, Status>> + Send + 'static,
    switch: CompressionSwitch,
) -> BoxStream<StreamingOutputCallResponse> {
    let set = switch.clone();
    let stream = requests
        .then(move |request| {
            let switch = switch.clone();
            async move {
                let request = match request {
                    Ok(request) => request,
                    Err(status) => return vec![Err(status)],
                };
                if let Some(status) = echo_status(request.response_status.as_ref()) {
                    return vec![Err(status)];
                }
                respond(request.response_parameters, switch).await
            }
        })
        .flat_map(futures::stream::iter);
    let stream = until_first_error(stream).map(move |item| {
        item.map(|(response, encoding)| {
            set.set(encoding);
            response
        })
    });
    Box::pin(stream)
}

/// `stream` up to and including its first error: a response stream ends
/// with the status a request asked for, nothing after it.
pub fn until_first_error<S, T, E>(stream: S) -> impl futures::Stream<Item = Result<T, E>>
where
    S: futures::Stream<Item = Result<T, E>>,
{
    stream.scan(false, |failed, item| {
        if *failed {
            return futures::future::ready(None);
        }
        *failed = item.is_err();
        futures::future::ready(Some(item))
    })
}

impl TestService for TestServer {
    async fn empty_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }

    async fn unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        simple(request)
    }

    async fn cacheable_unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        simple(request)
    }

    type StreamingOutputCallStream = BoxStream<StreamingOutputCallResponse>;

    async fn streaming_output_call(
        &self,
        request: Request<StreamingOutputCallRequest>,
    ) -> Result<Response<Self::StreamingOutputCallStream>, Status> {
        let (initial, trailers) = echoed(request.metadata());
        let switch = CompressionSwitch::new(None);
        let requests = futures::stream::iter([Ok(request.into_inner())]);
        let stream = duplex(requests, switch.clone());
        Ok(Response::from_parts(initial, stream)
            .with_trailers(trailers)
            .with_compression_switch(switch))
    }

    async fn streaming_input_call(
        &self,
        request: Request<Streaming<StreamingInputCallRequest>>,
    ) -> Result<Response<StreamingInputCallResponse>, Status> {
        let (initial, trailers) = echoed(request.metadata());
        let mut requests = request.into_inner();
        let mut total = 0usize;
        while let Some(message) = requests.message().await? {
            let expect = message.expect_compressed.is_some_and(|b| b.value);
            check_compressed(expect, requests.message_encoding())?;
            total += message.payload.map_or(0, |p| p.body.len());
        }
        let reply = StreamingInputCallResponse {
            aggregated_payload_size: i32::try_from(total)
                .map_err(|_| Status::out_of_range(format!("{total} bytes aggregated")))?,
        };
        Ok(Response::from_parts(initial, reply).with_trailers(trailers))
    }

    type FullDuplexCallStream = BoxStream<StreamingOutputCallResponse>;

    async fn full_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Self::FullDuplexCallStream>, Status> {
        let (initial, trailers) = echoed(request.metadata());
        let switch = CompressionSwitch::new(None);
        let stream = duplex(request.into_inner(), switch.clone());
        Ok(Response::from_parts(initial, stream)
            .with_trailers(trailers)
            .with_compression_switch(switch))
    }

    type HalfDuplexCallStream = BoxStream<StreamingOutputCallResponse>;

    async fn half_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Self::HalfDuplexCallStream>, Status> {
        let (initial, trailers) = echoed(request.metadata());
        // Every request first, then the responses.
        let mut requests = request.into_inner();
        let mut buffered = Vec::new();
        while let Some(message) = requests.message().await? {
            buffered.push(Ok(message));
        }
        let switch = CompressionSwitch::new(None);
        let stream = duplex(futures::stream::iter(buffered), switch.clone());
        Ok(Response::from_parts(initial, stream)
            .with_trailers(trailers)
            .with_compression_switch(switch))
    }

    async fn unimplemented_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Err(Status::unimplemented(
            "grpc.testing.TestService/UnimplementedCall is not implemented, as the interop tests \
             expect",
        ))
    }
}
