//! The client side: [`Channel`] and [`UnaryCall`].

use crate::server::MethodDescriptor;
use crate::{Request, Response, Status};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A connection to a server (stub).
#[derive(Clone, Debug)]
pub struct Channel {}

impl Channel {
    /// Connects to `url`.
    pub fn connect(url: &str) -> Result<Channel, Status> {
        todo!("{url}")
    }

    /// Starts a unary call.
    pub fn unary<Req, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<Req>,
    ) -> UnaryCall<Resp>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        todo!("{method:?} {}", request.get_ref().encoded_len())
    }
}

/// A call in flight: `.await` it, or block on it with [`UnaryCall::wait`].
#[derive(Debug)]
pub struct UnaryCall<T> {
    _t: PhantomData<T>,
}

impl<T: prost::Message + Default> UnaryCall<T> {
    /// Blocks the current thread until the response arrives.
    pub fn wait(self) -> Result<Response<T>, Status> {
        todo!()
    }
}

impl<T: prost::Message + Default> Future for UnaryCall<T> {
    type Output = Result<Response<T>, Status>;
    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Self::Output> {
        todo!()
    }
}
