//! What a client and a server of this crate agree on beyond the frame
//! format: how a status about a method the server lacks begins, and the
//! metadata of calls through the `grpc://` gateway (the server it is for,
//! the method's path, the channel's TLS settings and encoding, and the kind of rpc a
//! call for a server's fallback service names). Both sides read and write
//! these, so they live below both.

use crate::Metadata;
use crate::descriptor::MethodKind;

/// How the status of a call to a method the server lacks begins (the
/// method's id follows): the client, which knows its path, names it.
pub(crate) const UNKNOWN_METHOD: &str = "method id ";

/// The metadata key naming a `grpc://` call's server, for the gateway.
pub(crate) const GATEWAY_TARGET: &str = "rpc-gateway-target";
/// The metadata key naming a `grpc://` call's method path, for the gateway.
pub(crate) const GATEWAY_PATH: &str = "rpc-gateway-path";
/// The metadata key naming the TLS settings of a `grpc://` call's channel
/// (registered with the gateway), if it has any.
pub(crate) const GATEWAY_TLS: &str = "rpc-gateway-tls";

/// The metadata key naming the encoding a `grpc://` stream's messages may
/// be compressed in (its channel's), for the gateway to declare it to the
/// server before they come.
pub(crate) const GATEWAY_ENCODING: &str = "rpc-gateway-encoding";

/// The metadata key in which a call to a server's fallback names its kind.
pub(crate) const FALLBACK_KIND: &str = "rpc-gateway-kind";

/// The kind of rpc a call for the fallback says it is.
pub(crate) fn fallback_kind(metadata: &Metadata) -> Option<MethodKind> {
    Some(match metadata.get(FALLBACK_KIND)? {
        "unary" => MethodKind::Unary,
        "server" => MethodKind::ServerStreaming,
        "client" => MethodKind::ClientStreaming,
        "bidi" => MethodKind::Streaming,
        _ => return None,
    })
}

/// The [`FALLBACK_KIND`] value of `kind`.
pub(crate) fn fallback_kind_name(kind: MethodKind) -> &'static str {
    match kind {
        MethodKind::Unary => "unary",
        MethodKind::ServerStreaming => "server",
        MethodKind::ClientStreaming => "client",
        MethodKind::Streaming => "bidi",
    }
}
