//! The server side: [`Server`], [`Service`], [`ServerCall`] and [`ServerHandle`].

mod accept;
mod builder;
mod call;
#[cfg(feature = "testing")]
pub(crate) mod fault;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;
mod registry;
mod role;
mod route;
mod shutdown;
mod start;
mod task;

pub use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor};
pub use builder::{DEFAULT_MAX_CONCURRENT_STREAMS, DEFAULT_MAX_CONNECTIONS, Server, ServerBuilder};
pub use call::ServerCall;
#[cfg(feature = "grpc")]
pub(crate) use registry::Registry;
pub use shutdown::{DEFAULT_SHUTDOWN_GRACE, ServerHandle};
#[cfg(feature = "grpc")]
pub(crate) use start::{NewCall, ServerShared};

/// A service a [`Server`] can host. Generated `FooServer<T>` wrappers
/// implement it; it can be implemented by hand too.
pub trait Service: Send + Sync + 'static {
    /// The service's name and methods.
    fn descriptor(&self) -> &'static ServiceDescriptor;
    /// Handles one call to one of this service's methods. The call must be
    /// answered (through [`ServerCall::unary`] or [`ServerCall::unimplemented`]);
    /// a call dropped unanswered is answered `Internal`.
    fn call(&self, call: ServerCall);
    /// An encoded `google.protobuf.FileDescriptorSet` holding the `.proto`
    /// file that declares this service and every file it imports, for the
    /// reflection service ([`ServerBuilder::add_reflection`]). Generated
    /// servers return their package's `FILE_DESCRIPTOR_SET`; the default,
    /// empty, means the service is listed but cannot be described.
    fn file_descriptor_set(&self) -> &'static [u8] {
        &[]
    }
    /// Called once when a server serving this service begins to shut down
    /// ([`ServerHandle::shutdown`]), after it stopped taking new calls and
    /// before it waits for those under way. A service whose streams would
    /// run on by themselves (a watch, a subscription) ends them here, so
    /// that shutting down need not wait out its grace period; the built-in
    /// health service sends each watcher `NotServing` and ends its stream.
    /// The default does nothing.
    fn shutting_down(&self) {}
    /// The service's own compression settings, over the server's
    /// (`ServerBuilder::send_compressed` and the like): generated servers
    /// return those their `send_compressed`, `accept_compressed` and
    /// `accept_encodings` set. The default, `None`, keeps the server's.
    fn compression(&self) -> Option<crate::CompressionConfig> {
        None
    }
}
