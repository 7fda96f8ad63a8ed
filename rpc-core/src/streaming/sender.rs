//! What a client sends on a client-streaming or bidirectional call:
//! [`RequestSender`], which sends messages one at a time as the window
//! allows, and [`IntoStreamingRequest`], which takes a `Stream` of them.

use super::opening::Opening;
use super::outbox::Outbox;
use crate::compression::Encoding;
use crate::{Request, Status};
use futures_core::Stream;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// Sends the messages of a client-streaming or bidirectional call one at a
/// time: [`RequestSender::send`] blocks while the stream's window is full,
/// [`RequestSender::send_async`] waits for it. Closing it (or dropping it)
/// tells the server the request stream is complete.
pub struct RequestSender<T> {
    outbox: Outbox,
    /// A call waiting for a connection: `outbox` is taken from it once it
    /// has started.
    opening: Option<Arc<Opening>>,
    closed: bool,
    /// Set by [`RequestSender::set_compression`]: applied to the outbox
    /// once the stream has started.
    encoding: Option<Option<Encoding>>,
    _t: PhantomData<fn(T)>,
}

impl<T> fmt::Debug for RequestSender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestSender")
            .field("call_id", &self.outbox.call_id.0)
            .field("closed", &self.closed)
            .finish()
    }
}

impl<T: prost::Message> RequestSender<T> {
    pub(crate) fn new(outbox: Outbox) -> RequestSender<T> {
        RequestSender {
            outbox,
            opening: None,
            closed: false,
            encoding: None,
            _t: PhantomData,
        }
    }

    /// The sender of a stream that starts when `opening` has.
    pub(crate) fn waiting(opening: Arc<Opening>) -> RequestSender<T> {
        RequestSender {
            outbox: Outbox::closed(),
            opening: Some(opening),
            closed: false,
            encoding: None,
            _t: PhantomData,
        }
    }

    /// Waits for a waiting stream to start and takes its outbox.
    async fn opened(&mut self) -> Result<(), Status> {
        let Some(opening) = &self.opening else {
            return Ok(());
        };
        let opened = std::future::poll_fn(|cx| opening.poll_open(cx)).await;
        let opening = self.opening.take().expect("checked above");
        opened?;
        if let Some(outbox) = opening.take_outbox() {
            self.outbox = outbox;
        }
        Ok(())
    }

    /// Sends `message`, waiting while the stream's window is full. Fails
    /// once the call is over (the server finished it, it was cancelled, or
    /// the connection failed): the call's outcome says how.
    pub async fn send_async(&mut self, message: T) -> Result<(), Status> {
        if self.closed {
            return Err(Status::failed_precondition("the request stream is closed"));
        }
        self.opened().await?;
        if let Some(encoding) = self.encoding.take() {
            self.outbox.send_in(encoding);
        }
        let sent = std::future::poll_fn(|cx| self.outbox.poll_send(cx, &message)).await;
        self.outbox.flush();
        sent
    }

    /// The messages sent from now on leave compressed in `encoding`
    /// (`None`: as they are), whatever the channel's setting: one message
    /// can go uncompressed in a compressed stream, or the other way round.
    pub fn set_compression(&mut self, encoding: Option<Encoding>) {
        self.encoding = Some(encoding);
    }

    /// Like [`RequestSender::send_async`], blocking the current thread.
    pub fn send(&mut self, message: T) -> Result<(), Status> {
        crate::executor::wait_on(self.send_async(message))
    }

    /// Tells the server the request stream is complete (for a call still
    /// waiting for a connection, once it has started).
    pub fn close(mut self) -> Result<(), Status> {
        self.closed = true;
        if let Some(opening) = self.opening.take() {
            opening.sender_done();
            return Ok(());
        }
        self.outbox.half_close()
    }
}

impl<T> Drop for RequestSender<T> {
    fn drop(&mut self) {
        if !self.closed {
            self.closed = true;
            // Still waiting: the stream half-closes as it starts.
            match self.opening.take() {
                Some(opening) => opening.sender_done(),
                None => {
                    let _ = self.outbox.half_close();
                }
            }
        }
    }
}

/// Converts a stream of messages, or a [`Request`] wrapping one, into the
/// request of a client-streaming or bidirectional call; generated client
/// methods take `impl IntoStreamingRequest<Message = M>`.
pub trait IntoStreamingRequest {
    /// The stream.
    type Stream: Stream<Item = Self::Message> + Send + 'static;
    /// The messages it yields.
    type Message: prost::Message + Send;
    /// Does the conversion.
    fn into_streaming_request(self) -> Request<Self::Stream>;
}

impl<S> IntoStreamingRequest for S
where
    S: Stream + Send + 'static,
    S::Item: prost::Message + Send,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        Request::new(self)
    }
}

impl<S> IntoStreamingRequest for Request<S>
where
    S: Stream + Send + 'static,
    S::Item: prost::Message + Send,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        self
    }
}
