//! Where a method's calls go: the [`Route`] of each method in a server's
//! table, and how a status names a method's kind.

use super::Service;
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
    /// The service's compression settings, or else the server's.
    pub(super) compression: crate::CompressionConfig,
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
