//! The surface generated code uses. Not for hand-written code: its items may
//! change between releases as the generator changes with them.
#![doc(hidden)]

pub use crate::client::UnaryCall;
pub use crate::server::{MethodDescriptor, ServerCall, Service, ServiceDescriptor};
pub use crate::{Channel, Code, IntoRequest, Metadata, Request, Response, Status};
pub use prost;
pub use prost_types;

/// The stable id of a method: 32-bit FNV-1a of its path `/package.Service/Method`,
/// with 0 (reserved) mapped to 1. Generated code carries the value computed at
/// build time; [`crate::Server`] recomputes it and refuses a mismatch.
pub const fn method_id(path: &str) -> u32 {
    let bytes = path.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if hash == 0 { 1 } else { hash }
}

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

#[cfg(test)]
mod tests {
    use super::method_id;

    #[test]
    fn method_id_is_fnv1a_and_never_zero() {
        // Reference values of 32-bit FNV-1a.
        assert_eq!(method_id(""), 0x811c_9dc5);
        assert_eq!(method_id("a"), 0xe40c_292c);
        assert_eq!(method_id("/kv.Kv/Get"), method_id("/kv.Kv/Get"));
        assert_ne!(method_id("/kv.Kv/Get"), method_id("/kv.Kv/Put"));
    }
}
