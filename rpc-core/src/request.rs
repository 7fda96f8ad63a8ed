//! `Request<T>` and `Response<T>`: a message with its metadata and call options.

use crate::Metadata;
use std::time::{Duration, Instant};

/// A request: the message, its metadata, and options for this one call.
///
/// On the client, build one with [`Request::new`] (or pass a bare message,
/// which converts through [`IntoRequest`]). On the server, the handler
/// receives one with the caller's metadata and the call's deadline.
#[derive(Debug, Clone)]
pub struct Request<T> {
    message: T,
    metadata: Metadata,
    timeout: Option<Duration>,
    fail_fast: bool,
    deadline: Option<Instant>,
}

impl<T> Request<T> {
    /// Wraps a message with empty metadata and the channel's default options.
    pub fn new(message: T) -> Request<T> {
        Request {
            message,
            metadata: Metadata::new(),
            timeout: None,
            fail_fast: false,
            deadline: None,
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Unwraps the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets how long the caller waits for the response, overriding the
    /// channel's default. A call still running after it fails with
    /// `DeadlineExceeded`; the server sees the remaining budget as
    /// [`Request::deadline`] and drops work whose deadline has passed.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// The timeout set with [`Request::set_timeout`].
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// When `true`, a call that finds the server's receive ring full fails at
    /// once with `ResourceExhausted` instead of waiting for ring space.
    pub fn set_fail_fast(&mut self, fail_fast: bool) {
        self.fail_fast = fail_fast;
    }

    /// Whether this call fails rather than waits on a full ring.
    pub fn fail_fast(&self) -> bool {
        self.fail_fast
    }

    /// On the server: the instant by which the caller stops waiting, if it set a timeout.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Replaces the message, keeping metadata and options.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Request<U> {
        Request {
            message: f(self.message),
            metadata: self.metadata,
            timeout: self.timeout,
            fail_fast: self.fail_fast,
            deadline: self.deadline,
        }
    }

    pub(crate) fn from_wire(
        message: T,
        metadata: Metadata,
        deadline: Option<Instant>,
    ) -> Request<T> {
        Request {
            message,
            metadata,
            timeout: None,
            fail_fast: false,
            deadline,
        }
    }
}

/// Converts a message, or a request, into a [`Request`]; generated client
/// methods take `impl IntoRequest<M>` so callers may pass either.
pub trait IntoRequest<T> {
    /// Does the conversion.
    fn into_request(self) -> Request<T>;
}

impl<T> IntoRequest<T> for Request<T> {
    fn into_request(self) -> Request<T> {
        self
    }
}

impl<T: prost::Message> IntoRequest<T> for T {
    fn into_request(self) -> Request<T> {
        Request::new(self)
    }
}

/// A response: the message and its metadata.
#[derive(Debug, Clone)]
pub struct Response<T> {
    message: T,
    metadata: Metadata,
}

impl<T> Response<T> {
    /// Wraps a message with empty metadata.
    pub fn new(message: T) -> Response<T> {
        Response {
            message,
            metadata: Metadata::new(),
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Unwraps the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Splits into metadata and message.
    pub fn into_parts(self) -> (Metadata, T) {
        (self.metadata, self.message)
    }

    /// Builds from metadata and message.
    pub fn from_parts(metadata: Metadata, message: T) -> Response<T> {
        Response { message, metadata }
    }
}
