//! gRPC both ways, over tonic: the gRPC face of a server (standard gRPC
//! over HTTP/2 beside its own URL, for callers that speak gRPC: [`face`])
//! and the gateway of `grpc://` URLs, our clients calling a standard gRPC
//! server ([`gateway()`]). What both use sits below either: `codec`
//! (metadata and statuses as gRPC's) and `framing` (gRPC's messages on
//! HTTP/2, each with its compressed flag).

mod codec;
pub(crate) mod face;
mod framing;
pub(crate) mod gateway;

use crate::Status;

/// A runtime of its own for `what`: two `rpc-grpc` threads.
fn runtime(what: &str) -> Result<tokio::runtime::Runtime, Status> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rpc-grpc")
        .enable_all()
        .build()
        .map_err(|e| Status::internal(format!("{what}: no runtime: {e}")))
}
