//! The server side: [`Server`], [`Service`] and [`ServerCall`].

use crate::{Request, Response, Status};

/// Describes one rpc of a service.
#[derive(Debug)]
pub struct MethodDescriptor {
    /// The rpc's name as written in the .proto file (`Get`).
    pub name: &'static str,
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// Stable id: [`crate::codegen::method_id`] of `path`.
    pub id: u32,
}

/// Describes a service: its full name and its rpcs.
#[derive(Debug)]
pub struct ServiceDescriptor {
    /// `package.Service`.
    pub name: &'static str,
    /// The rpcs.
    pub methods: &'static [MethodDescriptor],
}

/// A service a [`Server`] can host. Generated `FooServer<T>` wrappers
/// implement it; it can be implemented by hand too.
pub trait Service: Send + Sync + 'static {
    /// The service's name and methods.
    fn descriptor(&self) -> &'static ServiceDescriptor;
    /// Handles one call to one of this service's methods.
    fn call(&self, call: ServerCall);
}

/// One incoming call, to be answered exactly once.
#[derive(Debug)]
pub struct ServerCall {}

impl ServerCall {
    /// The method id the caller asked for.
    pub fn method_id(&self) -> u32 {
        todo!()
    }

    /// Decodes the request as `Req`, runs `handler`, and sends its result.
    pub fn unary<Req, Resp, F>(self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message,
        F: FnOnce(Request<Req>) -> Result<Response<Resp>, Status>,
    {
        let _ = handler;
        todo!()
    }

    /// Answers `Unimplemented`.
    pub fn unimplemented(self) {
        todo!()
    }
}

/// The server (stub).
#[derive(Debug)]
pub struct Server {}
