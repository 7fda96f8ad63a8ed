//! Interceptors: code that sees every call before it starts, on a client
//! or a server, may change its metadata and may reject it with a
//! [`Status`]: authentication tokens, tenant tags, logging, quotas.
//!
//! ```
//! use rpc_core::{Channel, Server, Status};
//! use rpc_core::interceptor::CallInfo;
//!
//! // Client: add a token to every call.
//! let builder = Channel::builder("tcp://127.0.0.1:7471").interceptor(|call: &mut CallInfo<'_>| {
//!     call.metadata_mut().insert("authorization", "Bearer s3cret")?;
//!     Ok(())
//! });
//! // Server: reject calls without it.
//! let server = Server::builder().interceptor(|call: &mut CallInfo<'_>| {
//!     match call.metadata().get("authorization") {
//!         Some("Bearer s3cret") => Ok(()),
//!         _ => Err(Status::unauthenticated("no valid token")),
//!     }
//! });
//! # drop((builder, server));
//! ```
//!
//! Interceptors run in the order they were added; the first to reject a
//! call ends it with its status (on a client, before anything is sent; on
//! a server, before the handler runs, and the client gets the status).
//! They apply to unary calls and streams alike, once per call. They run on
//! the caller's thread (client) or the dispatcher's (server): they must be
//! quick and must not block.

use crate::auth::Peer;
use crate::{Metadata, Status};
use std::sync::Arc;

/// What an interceptor sees of a call as it starts.
#[derive(Debug)]
pub struct CallInfo<'a> {
    method: &'static str,
    metadata: &'a mut Metadata,
    peer: Option<&'a Peer>,
}

impl<'a> CallInfo<'a> {
    pub(crate) fn new(
        method: &'static str,
        metadata: &'a mut Metadata,
        peer: Option<&'a Peer>,
    ) -> CallInfo<'a> {
        CallInfo {
            method,
            metadata,
            peer,
        }
    }

    /// The method's path, `/package.Service/Method`.
    pub fn method(&self) -> &'static str {
        self.method
    }

    /// The call's metadata.
    pub fn metadata(&self) -> &Metadata {
        self.metadata
    }

    /// The call's metadata, to change: what a client interceptor adds is
    /// sent; what a server interceptor changes is what the handler sees.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        self.metadata
    }

    /// On a server, who calls (address, fabric, authenticated identity);
    /// `None` on a client.
    pub fn peer(&self) -> Option<&Peer> {
        self.peer
    }
}

/// Sees each call as it starts; `Err` rejects it with that status.
/// Closures `Fn(&mut CallInfo<'_>) -> Result<(), Status>` are interceptors.
pub trait Interceptor: Send + Sync + 'static {
    /// Looks at (and may change) `call`, or rejects it.
    fn intercept(&self, call: &mut CallInfo<'_>) -> Result<(), Status>;
}

impl<F> Interceptor for F
where
    F: Fn(&mut CallInfo<'_>) -> Result<(), Status> + Send + Sync + 'static,
{
    fn intercept(&self, call: &mut CallInfo<'_>) -> Result<(), Status> {
        self(call)
    }
}

/// Interceptors in the order they run.
#[derive(Clone, Default)]
pub(crate) struct Chain(Vec<Arc<dyn Interceptor>>);

impl Chain {
    pub(crate) fn push(&mut self, interceptor: impl Interceptor) {
        self.0.push(Arc::new(interceptor));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Runs every interceptor on the call; the first rejection wins.
    pub(crate) fn run(
        &self,
        method: &'static str,
        metadata: &mut Metadata,
        peer: Option<&Peer>,
    ) -> Result<(), Status> {
        let mut info = CallInfo::new(method, metadata, peer);
        for i in &self.0 {
            i.intercept(&mut info)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} interceptors", self.0.len())
    }
}
