//! gRPC server reflection, `grpc.reflection.v1.ServerReflection`: a server
//! that adds it ([`crate::ServerBuilder::add_reflection`]) answers which
//! services it serves and, with the `.proto` files that `rpc-codegen`
//! embeds in the generated code, what their methods and messages are. The
//! `rpc` command line tool (and grpcurl, over gRPC) reads it to list,
//! describe and call any method without the caller's own `.proto` files.
//!
//! ```no_run
//! # fn main() -> Result<(), rpc_core::Status> {
//! # struct Kv; impl rpc_core::Service for Kv { fn descriptor(&self) -> &'static rpc_core::server::ServiceDescriptor { unimplemented!() } fn call(&self, _: rpc_core::ServerCall) {} }
//! let server = rpc_core::Server::builder()
//!     .add_service(Kv)
//!     .add_reflection()
//!     .serve("tcp://0.0.0.0:7471")?;
//!
//! let client = rpc_core::reflection::ReflectionClient::connect("tcp://127.0.0.1:7471")?;
//! for service in client.list_services()? {
//!     println!("{service}");
//! }
//! # Ok(()) }
//! ```

use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};

mod client;
pub(crate) mod server;

pub use client::ReflectionClient;
pub use server::ReflectionServer;

/// The messages of `grpc.reflection.v1`, generated from
/// `rpc-core/proto/grpc/reflection/v1/reflection.proto`.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!("grpc.reflection.v1.rs");
}

/// `grpc/reflection/v1/reflection.proto`, encoded as a `FileDescriptorSet`.
const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("reflection.fds.bin");

static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
    name: "grpc.reflection.v1.ServerReflection",
    methods: &[MethodDescriptor {
        name: "ServerReflectionInfo",
        path: "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        id: method_id("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
        kind: MethodKind::Streaming,
    }],
};
const INFO: &MethodDescriptor = &DESCRIPTOR.methods[0];
