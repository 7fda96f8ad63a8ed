//! # rpc-core
//!
//! The runtime of rdma-rpc: typed, message-passing RPC over RDMA.
//!
//! Services are defined in `.proto` files and compiled by `rpc-codegen` in a
//! build script into a client (`FooClient`), a server trait (`Foo`) and a
//! wrapper (`FooServer`) that this crate serves. Each call is one RDMA WRITE
//! WITH IMMEDIATE into a ring the peer registered in advance, and one back.
//!
//! ```ignore
//! // build.rs: rpc_codegen::compile_protos(&["proto/kv.proto"], &["proto"])
//! pub mod kv { rpc_core::include_proto!("kv"); }
//! use kv::{GetReply, GetRequest, kv_client::KvClient, kv_server::{Kv, KvServer}};
//! use rpc_core::{Request, Response, Server, Status};
//!
//! struct Store;
//! impl Kv for Store {
//!     async fn get(&self, r: Request<GetRequest>) -> Result<Response<GetReply>, Status> {
//!         Ok(Response::new(GetReply { value: None }))
//!     }
//!     // ...
//! }
//!
//! let server = Server::builder().add_service(KvServer::new(Store)).serve("tcp://0.0.0.0:7471")?;
//! let client = KvClient::connect("tcp://127.0.0.1:7471")?;
//! let reply = client.get(GetRequest { key: "a".into() }).wait()?;  // or .await
//! server.shutdown();
//! ```
//!
//! URLs choose the fabric: `rdma://host:port` (RDMA verbs), `tcp://host:port`
//! (the same semantics in software over TCP) or `mem://name` (in one
//! process). Everything above the [`fabric`] is the same code for all three.
//!
//! Handlers are `async fn`s that run to completion on the server's dispatcher
//! thread that received the call (one dispatcher per CPU by default); one that
//! awaits parks and lets its dispatcher go on. Blocking work belongs on the
//! blocking pool: [`ServerBuilder::add_blocking_service`],
//! [`ServerBuilder::blocking_method`] or [`blocking`]. Clients share one set
//! of dispatchers per process, so a [`Channel`] is a connection, not a thread.
//!
//! Layers, top to bottom: [`client`] and [`server`] (the API), the
//! dispatchers (each turning its own completion queue and running handler
//! tasks), `protocol` (pure
//! state: frame headers, doorbells, rings, credits, the call table),
//! [`fabric`] (the `Fabric` trait, its implementations and `bootstrap`,
//! the connection handshake).
#![deny(unsafe_code)]

pub mod auth;
mod blocking;
mod cancel;
pub mod client;
pub mod codegen;
pub mod compression;
mod conventions;
mod descriptor;
mod dispatch;
mod executor;
pub mod fabric;
#[cfg(feature = "grpc")]
mod grpc;
pub mod health;
mod idmap;
pub mod interceptor;
mod metadata;
pub mod observe;
mod pages;
mod payload;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod protocol;
#[cfg(not(feature = "testing"))]
mod protocol;
mod raw;
pub mod reflection;
mod request;
pub mod server;
mod slot;
pub mod stages;
mod status;
mod streaming;
mod sync;
#[cfg(feature = "tls")]
pub mod tls;

/// When `timeout` from now ends; `None` if the clock cannot say (a
/// timeout such as `Duration::MAX`, which means no deadline).
pub(crate) fn deadline_after(timeout: std::time::Duration) -> Option<std::time::Instant> {
    std::time::Instant::now().checked_add(timeout)
}

/// When `timeout` from now ends, a century on at most: for limits that
/// must have an end, where `Duration::MAX` means "never".
pub(crate) fn bounded_deadline(timeout: std::time::Duration) -> std::time::Instant {
    const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
    std::time::Instant::now() + timeout.min(CENTURY)
}

/// Internals for this workspace's tests and benchmarks (feature `testing`):
/// the wire protocol's pure state and the connection handshake, to build
/// misbehaving peers and measure the protocol core. Not a stable API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    pub use crate::fabric::bootstrap;
    pub use crate::fabric::gate::fuzzing as gate;
    pub use crate::fabric::soft::tcp::fuzzing as tcp_wire;
    pub use crate::protocol;
    pub use crate::server::fuzzing as server;

    /// The metadata block of a frame, as the receive path decodes it.
    pub mod metadata {
        use crate::Metadata;

        /// Parses untrusted bytes as a frame's metadata block; `None` if
        /// they are not well-formed metadata.
        pub fn decode(bytes: &[u8]) -> Option<Metadata> {
            Metadata::decode(bytes)
        }

        /// The wire form of `md`: what [`decode`] reads back.
        pub fn encode(md: &Metadata) -> Vec<u8> {
            let mut out = vec![0u8; md.encoded_len()];
            md.encode(&mut out);
            out
        }
    }

    /// Reads of lent (rendezvous) payloads this process has posted.
    pub fn reads_posted() -> u64 {
        crate::dispatch::READS_POSTED.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Faults injected into a server's dispatcher, to test what contains
    /// a bug of ours.
    pub mod faults {
        pub use crate::server::fault::panic_on_method;
    }

    /// The units of the hand-written concurrency that `scripts/loom`
    /// model-checks (`rpc-core/tests/loom_*.rs`), as production uses them.
    pub mod sync {
        pub use crate::client::stream_limit::{StreamLimit, StreamPermit, Waiting};
        pub use crate::dispatch::handoff::PollHandoff;
        pub use crate::dispatch::wake::Corked;
        pub use crate::executor::Executor;
        pub use crate::slot::{CallSlot, SlotPool};
    }
}

pub use auth::{Peer, SharedSecret, SharedSecrets};
pub use blocking::{Blocking, blocking};
pub use client::ChannelBuilder;
pub use client::{Backoff, Balance, Channel, UnaryCall};
pub use compression::{CompressionConfig, CompressionSwitch, Encoding, EncodingSet};
pub use dispatch::{DEFAULT_HEARTBEAT, MIN_HEARTBEAT, heartbeat_bound};
/// The `Stream` trait (of `futures-core`, the same as `futures::Stream`):
/// what streaming handlers return and streaming calls take.
pub use futures_core::Stream;
pub use metadata::{InvalidMetadata, Metadata};
/// The protobuf runtime generated messages are built on, at the version
/// the generated code uses: hand-written code that encodes or decodes a
/// message itself names it here (`use rpc_core::prost::Message;`) and
/// needs no `prost` dependency of its own.
pub use prost;
/// The type of generated `bytes` fields (the `bytes` crate's, through
/// prost): a large message's `Bytes` fields share the buffer it was read
/// into instead of copying out of it.
pub use prost::bytes::Bytes;
/// Protobuf's well-known types (`google.protobuf.Timestamp`, `Duration`,
/// `Any`, ...) as generated code names them: a handler that builds a
/// `Timestamp` writes `rpc_core::prost_types::Timestamp`.
pub use prost_types;
pub use raw::RawMessage;
pub use request::{IntoRequest, Request, Response, Trailers};
pub use server::{MethodKind, Server, ServerBuilder, ServerCall, ServerHandle, Service};
pub use status::{Code, Status};
pub use streaming::{
    BoxStream, ClientStreamingCall, IntoStreamingRequest, RequestSender, Streaming,
};
/// The blocking iterators of [`Streaming`].
pub mod streams {
    pub use crate::streaming::{IntoIter, IterMut};
}

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
