//! The surface generated code uses. Not for hand-written code: its items may
//! change between releases as the generator changes with them.
#![doc(hidden)]

pub use crate::client::UnaryCall;
pub use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};
pub use crate::server::{ServerCall, Service};
pub use crate::{
    Channel, ClientStreamingCall, Code, CompressionConfig, Encoding, EncodingSet, IntoRequest,
    IntoStreamingRequest, Metadata, Request, RequestSender, Response, Status, Streaming,
};
pub use futures_core::Stream;
pub use prost;
pub use prost_types;

/// Starts a unary call of `method` on `channel`.
pub fn unary<Req, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<Req>,
) -> UnaryCall<Resp>
where
    Req: prost::Message,
    Resp: prost::Message + Default,
{
    channel.unary(method, request)
}

/// Starts a server-streaming call of `method` on `channel`.
pub fn server_streaming<Req, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<Req>,
) -> Streaming<Resp>
where
    Req: prost::Message,
{
    channel.server_streaming(method, request)
}

/// Starts a client-streaming call of `method` whose requests come from a stream.
pub fn client_streaming<S, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<S>,
) -> ClientStreamingCall<Resp>
where
    S: Stream + Send + 'static,
    S::Item: prost::Message + Send,
{
    channel.client_streaming(method, request)
}

/// Starts a client-streaming call of `method` whose requests go through a sender.
pub fn client_streaming_sender<Req, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<()>,
) -> (RequestSender<Req>, ClientStreamingCall<Resp>)
where
    Req: prost::Message,
{
    channel.client_streaming_sender(method, request)
}

/// Starts a bidirectional call of `method` whose requests come from a stream.
pub fn streaming<S, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<S>,
) -> Streaming<Resp>
where
    S: Stream + Send + 'static,
    S::Item: prost::Message + Send,
{
    channel.streaming(method, request)
}

/// Starts a bidirectional call of `method` whose requests go through a sender.
pub fn streaming_sender<Req, Resp>(
    channel: &Channel,
    method: &'static MethodDescriptor,
    request: Request<()>,
) -> (RequestSender<Req>, Streaming<Resp>)
where
    Req: prost::Message,
{
    channel.streaming_sender(method, request)
}
