//! The standard health service, `grpc.health.v1.Health`: `Check` and the
//! streaming `Watch`, with the package, method and message names of gRPC's
//! `health.proto`, so health checkers that speak it understand ours.
//!
//! ```no_run
//! # fn main() -> Result<(), rpc_core::Status> {
//! use rpc_core::health::{self, ServingStatus};
//! let (reporter, health) = health::service();
//! # struct Kv; impl rpc_core::Service for Kv { fn descriptor(&self) -> &'static rpc_core::server::ServiceDescriptor { unimplemented!() } fn call(&self, _: rpc_core::ServerCall) {} }
//! let server = rpc_core::Server::builder()
//!     .add_service(Kv)
//!     .add_service(health)
//!     .serve("tcp://0.0.0.0:7471")?;
//! reporter.set_status("kv.Kv", ServingStatus::Serving);
//! // ... and to drain traffic some time before a planned shutdown:
//! reporter.set_status("", ServingStatus::NotServing);
//! # Ok(()) }
//! ```
//!
//! The empty service name stands for the server as a whole; it is
//! `Serving` from the start. When the server shuts down
//! ([`ServerHandle::shutdown`](crate::ServerHandle::shutdown)), every
//! status becomes `NotServing` for good (later changes are ignored) and
//! every `Watch` stream ends, after saying `NotServing` if its service has
//! a status: watchers learn at once, and the shutdown does not wait for
//! them. A health service added to several servers does this when the
//! first of them shuts down.

use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};

mod client;
mod server;

pub use client::HealthClient;
pub use server::{HealthReporter, HealthServer, service};

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct HealthCheckRequest {
    /// The service asked about (`package.Service`), or empty for the server.
    #[prost(string, tag = "1")]
    pub service: String,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct HealthCheckResponse {
    /// A [`ServingStatus`].
    #[prost(enumeration = "ServingStatus", tag = "1")]
    pub status: i32,
}

/// `grpc.health.v1.HealthCheckResponse.ServingStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ServingStatus {
    /// Not known.
    Unknown = 0,
    /// Serving.
    Serving = 1,
    /// Not serving (starting, draining, or failed).
    NotServing = 2,
    /// `Watch` only: the service is not known to this server.
    ServiceUnknown = 3,
}

static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
    name: "grpc.health.v1.Health",
    methods: &[
        MethodDescriptor {
            name: "Check",
            path: "/grpc.health.v1.Health/Check",
            id: method_id("/grpc.health.v1.Health/Check"),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Watch",
            path: "/grpc.health.v1.Health/Watch",
            id: method_id("/grpc.health.v1.Health/Watch"),
            kind: MethodKind::ServerStreaming,
        },
    ],
};
/// `grpc/health/v1/health.proto` (`rpc-core/proto`), encoded as a
/// `FileDescriptorSet`.
const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("health.fds.bin");

pub(crate) const CHECK: &MethodDescriptor = &DESCRIPTOR.methods[0];
pub(crate) const WATCH: &MethodDescriptor = &DESCRIPTOR.methods[1];
