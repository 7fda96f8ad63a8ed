//! # rpc-core
//!
//! The runtime of rdma-rpc: typed, message-passing RPC over RDMA.
#![deny(unsafe_code)]

pub mod bootstrap;
pub mod client;
pub mod codegen;
mod dispatch;
pub mod fabric;
mod metadata;
pub mod protocol;
mod request;
pub mod server;
mod status;

pub use client::ChannelBuilder;
pub use client::{Channel, UnaryCall};
pub use metadata::{InvalidMetadataKey, Metadata};
pub use request::{IntoRequest, Request, Response};
pub use server::{Server, ServerBuilder, ServerCall, ServerHandle, Service};
pub use status::{Code, Status};

/// Includes the code `rpc_codegen` generated for a protobuf package.
///
/// ```ignore
/// pub mod kv {
///     rpc_core::include_proto!("kv");
/// }
/// ```
#[macro_export]
macro_rules! include_proto {
    ($package:literal) => {
        include!(concat!(env!("OUT_DIR"), concat!("/", $package, ".rs")));
    };
}
