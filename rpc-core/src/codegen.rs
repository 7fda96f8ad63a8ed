//! The surface generated code uses. Not for hand-written code: its items may
//! change between releases as the generator changes with them.
#![doc(hidden)]

pub use crate::client::UnaryCall;
pub use crate::descriptor::{MethodDescriptor, ServiceDescriptor, method_id};
pub use crate::server::{ServerCall, Service};
pub use crate::{Channel, Code, IntoRequest, Metadata, Request, Response, Status};
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
