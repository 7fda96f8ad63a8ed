//! Where a method's calls go: the [`Route`] of each method in a server's
//! table, and the kind a call for the fallback service (the gateway of
//! `grpc://` clients) names in its metadata.

use super::Service;
use crate::Metadata;
use crate::descriptor::MethodKind;
use std::sync::Arc;

/// Where a method's calls go.
pub(super) struct Route {
    /// `/package.Service/Method`.
    pub(super) path: &'static str,
    pub(super) service: Arc<dyn Service>,
    /// On the blocking pool, not the dispatcher.
    pub(super) blocking: bool,
    pub(super) kind: MethodKind,
}

/// The metadata key in which a call to a server's fallback names its kind.
pub(crate) const FALLBACK_KIND: &str = "rpc-gateway-kind";

/// The kind of rpc a call for the fallback says it is.
pub(super) fn fallback_kind(metadata: &Metadata) -> Option<MethodKind> {
    Some(match metadata.get(FALLBACK_KIND)? {
        "unary" => MethodKind::Unary,
        "server" => MethodKind::ServerStreaming,
        "client" => MethodKind::ClientStreaming,
        "bidi" => MethodKind::Streaming,
        _ => return None,
    })
}

/// How a status names a method's `kind`.
pub(super) fn kind_name(kind: MethodKind) -> &'static str {
    match kind {
        MethodKind::Unary => "unary",
        MethodKind::ServerStreaming => "server-streaming",
        MethodKind::ClientStreaming => "client-streaming",
        MethodKind::Streaming => "bidirectional-streaming",
    }
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
