//! Streams: [`Streaming`] (the messages that arrive), [`RequestSender`]
//! (the blocking way to send them), [`ClientStreamingCall`], and the shared
//! state the dispatchers feed.
//!
//! A stream's two directions meet in a [`StreamCore`]: the dispatcher copies
//! each `Message` frame out of the ring into the core's inbox at once (so a
//! consumer that stops reading never holds up the ring the connection's
//! other calls share), and the window of `protocol::stream` bounds what the
//! inbox holds. The consumer takes messages from the inbox and grants window
//! back; the producer waits on the core for window before each message.
//! Nothing here runs on a thread of its own: a stream makes progress when
//! its consumer or producer polls it (or, on a server, when the
//! dispatcher runs the handler's task).
//!
//! This file holds [`Streaming`] and [`ClientStreamingCall`]; beside it are
//! the core (`state.rs`), sending (`outbox.rs`, `producer.rs`), the
//! client's request stream (`sender.rs`), and a client stream that waits
//! for its connection (`opening.rs`).

mod opening;
mod outbox;
mod producer;
mod sender;
mod state;

// What a stream holds of its call and its connection, named here for the
// client and the server as they name the rest.
pub(crate) use crate::cancel::Signal;
pub(crate) use crate::dispatch::{Link, send_control};
pub(crate) use opening::{CallOwner, Opening, StreamParts};
pub(crate) use outbox::Outbox;
#[cfg(feature = "grpc")]
pub(crate) use outbox::Packed;
pub(crate) use producer::{Producer, Pump, RequestPump, StreamEnd};
pub use sender::{IntoStreamingRequest, RequestSender};
pub(crate) use state::StreamCore;

use crate::compression::{Encoding, EncodingSet};
use crate::protocol::stream::Records;
use crate::protocol::{CallId, FrameKind};
use crate::{Metadata, Response, Status};
use futures_core::Stream;
use outbox::NoLink;
use prost::bytes::Bytes;
use state::Received;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

/// A boxed stream of messages or errors, for handlers that return one
/// without naming its type: `type ListFeaturesStream = BoxStream<Feature>;`.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The incoming messages of a stream: a [`futures_core::Stream`] of
/// `Result<T, Status>`, and, through [`IntoIterator`], a blocking iterator
/// of the same (`for m in stream`, or `for m in &mut stream`).
///
/// On a client, it ends with `None` when the server finished the call with
/// success, or yields the call's error status last; dropping it before
/// then cancels the call (the server's handler sees it). On a server, it
/// ends when the client has sent its last message, and yields `Cancelled`
/// or `Unavailable` if the client gives up or goes away.
///
/// ```no_run
/// # async fn f(mut features: rpc_core::Streaming<u64>) -> Result<(), rpc_core::Status> {
/// while let Some(feature) = features.message().await? {
///     println!("{feature}");
/// }
/// # Ok(()) }
/// ```
pub struct Streaming<T> {
    core: Arc<StreamCore>,
    link: Arc<dyn Link>,
    call_id: CallId,
    /// A call waiting for a connection (wait-for-ready): the parts above
    /// are placeholders until it starts.
    opening: Option<Arc<Opening>>,
    /// The client's call, released on drop.
    owner: Option<Arc<dyn CallOwner>>,
    /// The request stream of a bidirectional call, driven while this is polled.
    pump: Option<Box<dyn Pump>>,
    /// The frame being read: its bytes, and the messages not yet taken,
    /// and its header's flags (their encoding).
    batch: Option<(Bytes, Records, u16)>,
    /// The encodings accepted from the peer (a server's, its service's).
    accept: EncodingSet,
    /// The encoding the message last returned arrived compressed in.
    last_encoding: Option<Encoding>,
    /// [`Streaming::cancel`] was called: the next read says so.
    cancelled: bool,
    /// The stream ended (cleanly or with its error).
    finished: bool,
    /// A server's request stream: its peer sends no initial metadata
    /// (the call's is the `Request`'s).
    requests: bool,
    /// Messages are returned as they arrived, compressed or not
    /// ([`Streaming::keeping_packed`]).
    keep_packed: bool,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Streaming<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Streaming")
            .field("call_id", &self.call_id.0)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<T> Streaming<T> {
    pub(crate) fn new(
        core: Arc<StreamCore>,
        link: Arc<dyn Link>,
        call_id: CallId,
        owner: Option<Arc<dyn CallOwner>>,
        pump: Option<Box<dyn Pump>>,
    ) -> Streaming<T> {
        Streaming {
            core,
            link,
            call_id,
            opening: None,
            owner,
            pump,
            batch: None,
            accept: EncodingSet::all(),
            last_encoding: None,
            cancelled: false,
            finished: false,
            requests: false,
            keep_packed: false,
            _t: PhantomData,
        }
    }

    /// This as a server's request stream (see [`Streaming::initial_metadata`]).
    pub(crate) fn of_requests(mut self) -> Streaming<T> {
        self.requests = true;
        self
    }

    /// Returns messages as they arrived, compressed or not (in the
    /// encoding [`Streaming::message_encoding`] names): the gRPC face
    /// passes them on so.
    #[cfg(feature = "grpc")]
    pub(crate) fn keeping_packed(mut self) -> Streaming<T> {
        self.keep_packed = true;
        self
    }

    /// Accepts messages compressed in the encodings of `set` only (a
    /// message in another fails the stream `Unimplemented`).
    pub(crate) fn accepting(mut self, set: EncodingSet) -> Streaming<T> {
        self.accept = set;
        self
    }

    /// Cancels the call (a client's): the server's handler sees it
    /// cancelled, messages not yet read are dropped, and the next read
    /// returns `Cancelled`, then the end. Dropping the stream cancels it
    /// too, without that last answer. Nothing happens to a stream that
    /// already ended.
    pub fn cancel(&mut self) {
        if self.finished {
            return;
        }
        self.batch = None;
        self.pump = None;
        if let Some(owner) = self.owner.take() {
            owner.release(self.call_id);
        }
        self.cancelled = true;
    }

    /// The encoding the message last returned arrived compressed in; `None`
    /// if it came as it is.
    pub fn message_encoding(&self) -> Option<Encoding> {
        self.last_encoding
    }

    /// `message`, from a frame whose header had `flags`, inflated if it was
    /// compressed; an error ends the stream.
    fn inflate(&mut self, message: Bytes, flags: u16) -> Result<Bytes, Status> {
        if self.keep_packed {
            self.last_encoding = Encoding::from_flags(flags);
            return Ok(message);
        }
        let link = &self.link;
        match crate::compression::unpack(flags, &message, self.accept, || link.max_message()) {
            Ok(Some((inflated, encoding))) => {
                self.last_encoding = Some(encoding);
                Ok(inflated.into())
            }
            Ok(None) => {
                self.last_encoding = None;
                Ok(message)
            }
            Err(status) => {
                self.batch = None;
                self.finish();
                Err(status)
            }
        }
    }

    /// A stream that starts when `opening` has (see [`Opening`]).
    pub(crate) fn waiting(opening: Arc<Opening>) -> Streaming<T> {
        let mut stream = Streaming::new(
            StreamCore::new(crate::protocol::stream::DEFAULT_WINDOW, false),
            Arc::new(NoLink),
            CallId(0),
            None,
            None,
        );
        stream.opening = Some(opening);
        stream
    }

    /// Drives a waiting stream's start: `Ready` once it has started (its
    /// parts in place) or failed (its core holding the status).
    fn poll_opened(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(opening) = &self.opening else {
            return Poll::Ready(());
        };
        let opened = match opening.poll_open(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(opened) => opened,
        };
        let opening = self.opening.take().expect("checked above");
        match opened.map(|()| opening.take_stream()) {
            Ok(Some(parts)) => {
                self.core = parts.core;
                self.link = parts.link;
                self.call_id = parts.call_id;
                self.owner = parts.owner;
                self.pump = parts.pump;
            }
            Ok(None) => {
                self.core =
                    StreamCore::failed(Status::internal("the stream's start was taken twice"));
            }
            Err(status) => self.core = StreamCore::failed(status),
        }
        Poll::Ready(())
    }

    /// A stream that yields `status` and ends (a call that could not start).
    pub(crate) fn failed(status: Status) -> Streaming<T> {
        Streaming::new(
            StreamCore::failed(status),
            Arc::new(NoLink),
            CallId(0),
            None,
            None,
        )
    }

    /// The server's initial metadata, once it arrived: before the first
    /// message, or with it, or with the final status (see
    /// [`Streaming::initial_metadata`] to wait for it).
    pub fn metadata(&self) -> Option<Metadata> {
        self.core.metadata().0
    }

    /// Waits for the server's initial metadata (the metadata of the
    /// handler's `Response`), without taking a message: it arrives once the
    /// handler has returned its response stream, before the stream's
    /// first message, as a gRPC response's headers do (tonic's awaited
    /// `Response`). If the call fails first, its status, which the stream
    /// then yields too. On a server, the client's request stream has no
    /// metadata of its own (the call's is the `Request`'s): this is empty,
    /// at once.
    ///
    /// ```no_run
    /// # async fn f(mut features: rpc_core::Streaming<u64>) -> Result<(), rpc_core::Status> {
    /// let headers = features.initial_metadata().await?;
    /// println!("session {:?}", headers.get("session"));
    /// # Ok(()) }
    /// ```
    pub async fn initial_metadata(&mut self) -> Result<Metadata, Status> {
        std::future::poll_fn(|cx| self.poll_initial_metadata(cx)).await
    }

    /// Like [`Streaming::initial_metadata`], blocking the current thread
    /// (not for async handlers: see
    /// [`UnaryCall::wait`](crate::UnaryCall::wait)).
    pub fn blocking_initial_metadata(&mut self) -> Result<Metadata, Status> {
        if self.requests {
            return Ok(Metadata::default());
        }
        if self.opening.is_none() {
            if let Some(headers) = self.core.headers_now() {
                return headers;
            }
        }
        crate::dispatch::warn_if_on_a_dispatcher("Streaming::blocking_initial_metadata");
        crate::executor::wait_on(self.initial_metadata())
    }

    /// Polls for the server's initial metadata ([`Streaming::initial_metadata`]),
    /// driving the request pump meanwhile.
    pub(crate) fn poll_initial_metadata(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Metadata, Status>> {
        if self.requests {
            return Poll::Ready(Ok(Metadata::default()));
        }
        if self.poll_opened(cx).is_pending() {
            return Poll::Pending;
        }
        self.poll_pump(cx);
        let mut polled_queue = false;
        loop {
            match self.core.poll_headers(cx) {
                Poll::Ready(headers) => return Poll::Ready(headers),
                Poll::Pending if self.progress_once(&mut polled_queue) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Drives the request stream of a bidirectional call, if it still runs.
    fn poll_pump(&mut self, cx: &mut Context<'_>) {
        if let Some(pump) = &mut self.pump {
            if pump.poll_pump(cx).is_ready() {
                self.pump = None;
            }
        }
    }

    /// Nothing came for this stream: handles completions on this thread
    /// once if nobody else is (saves a wake-up from the dispatcher); true
    /// if it did, and the caller should look again. Otherwise makes sure
    /// the dispatcher thread, which naps while callers poll, delivers what
    /// comes next.
    fn progress_once(&self, polled_queue: &mut bool) -> bool {
        let Some(owner) = &self.owner else {
            return false;
        };
        if !*polled_queue && owner.progress() {
            *polled_queue = true;
            return true;
        }
        if *polled_queue {
            owner.ensure_polled();
        }
        false
    }

    /// The server's trailing metadata, once the stream ended.
    pub fn trailers(&self) -> Option<Metadata> {
        self.core.metadata().1
    }

    /// The next message of the frame being read, if any is left.
    fn next_in_batch(&mut self) -> Option<Result<Bytes, Status>> {
        if self.batch.is_some() && self.core.dropped.load(Ordering::Acquire) {
            self.batch = None;
        }
        let (data, records, flags) = self.batch.as_mut()?;
        let flags = *flags;
        // Checked when it arrived: every announced message is there.
        let message = records.next_range(data).map(|r| data.slice(r));
        if records.left() == 0 || message.is_none() {
            self.batch = None;
        }
        message.map(|m| self.inflate(m, flags))
    }

    /// Polls for the next raw message, driving the request pump first.
    pub(crate) fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Status>>> {
        if std::mem::take(&mut self.cancelled) {
            self.finish();
            return Poll::Ready(Some(Err(Status::cancelled(
                "the caller cancelled the call",
            ))));
        }
        if self.poll_opened(cx).is_pending() {
            return Poll::Pending;
        }
        if let Some(message) = self.next_in_batch() {
            return Poll::Ready(Some(message));
        }
        if self.finished {
            return Poll::Ready(None);
        }
        self.poll_pump(cx);
        let mut polled_queue = false;
        loop {
            match self.core.poll_recv(cx) {
                Poll::Ready(Some(Ok(Received {
                    data,
                    count,
                    grant,
                    flags,
                }))) => {
                    if let Some(grant) = grant {
                        // A failed grant means the call is over; its
                        // status arrives through the core.
                        let _ = send_control(&*self.link, FrameKind::Window, self.call_id, grant);
                    }
                    if count == 1 {
                        return Poll::Ready(Some(self.inflate(data.into_bytes(), flags)));
                    }
                    self.batch = Some((data.into_bytes(), Records::new(count), flags));
                    if let Some(message) = self.next_in_batch() {
                        return Poll::Ready(Some(message));
                    }
                }
                Poll::Ready(Some(Err(status))) => {
                    self.finish();
                    return Poll::Ready(Some(Err(status)));
                }
                Poll::Ready(None) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Poll::Pending if self.progress_once(&mut polled_queue) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        self.pump = None;
        if let Some(owner) = self.owner.take() {
            owner.release(self.call_id);
        }
    }
}

impl<T: prost::Message + Default> Streaming<T> {
    fn decode(&self, buf: Bytes) -> Result<T, Status> {
        // From `Bytes`, a message's `bytes` fields share the frame's buffer
        // instead of copying out of it.
        T::decode(buf).map_err(|e| {
            Status::internal(format!(
                "stream message is not a valid {}: {e}",
                std::any::type_name::<T>()
            ))
        })
    }

    /// The next message: `Ok(None)` at the end of the stream.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx))
            .await
            .transpose()
    }

    /// Like [`Streaming::message`], blocking the current thread (not for
    /// async handlers: see [`UnaryCall::wait`](crate::UnaryCall::wait)).
    pub fn blocking_message(&mut self) -> Result<Option<T>, Status> {
        // The rest of a batch needs no waiting.
        if let Some(message) = self.next_in_batch() {
            return self.decode(message?).map(Some);
        }
        crate::dispatch::warn_if_on_a_dispatcher("Streaming::blocking_message");
        crate::executor::wait_on(self.message())
    }
}

impl<T: prost::Message + Default> Stream for Streaming<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.poll_raw(cx) {
            Poll::Ready(Some(Ok(buf))) => Poll::Ready(Some(this.decode(buf))),
            Poll::Ready(Some(Err(status))) => Poll::Ready(Some(Err(status))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A [`Streaming`] as a blocking iterator: each `next` blocks the current
/// thread until the next message (or the end). `for m in stream { .. }`.
#[derive(Debug)]
pub struct IntoIter<T>(Streaming<T>);

impl<T: prost::Message + Default> Iterator for IntoIter<T> {
    type Item = Result<T, Status>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.blocking_message().transpose()
    }
}

impl<T: prost::Message + Default> IntoIterator for Streaming<T> {
    type Item = Result<T, Status>;
    type IntoIter = IntoIter<T>;

    /// Iterates, blocking, over the messages left.
    fn into_iter(self) -> IntoIter<T> {
        IntoIter(self)
    }
}

/// A borrowed [`Streaming`] as a blocking iterator: `for m in &mut stream`
/// reads messages and leaves the stream usable (for its metadata) after.
#[derive(Debug)]
pub struct IterMut<'a, T>(&'a mut Streaming<T>);

impl<T: prost::Message + Default> Iterator for IterMut<'_, T> {
    type Item = Result<T, Status>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.blocking_message().transpose()
    }
}

impl<'a, T: prost::Message + Default> IntoIterator for &'a mut Streaming<T> {
    type Item = Result<T, Status>;
    type IntoIter = IterMut<'a, T>;

    fn into_iter(self) -> IterMut<'a, T> {
        IterMut(self)
    }
}

impl<T> Drop for Streaming<T> {
    fn drop(&mut self) {
        self.pump = None;
        if let Some(owner) = self.owner.take() {
            owner.release(self.call_id);
        }
    }
}

// The pump is only ever polled through `&mut self`.
impl<T> Unpin for Streaming<T> {}

// The response is only moved, never pinned.
impl<T> Unpin for ClientStreamingCall<T> {}

/// A client-streaming call in flight: `.await` it, or block on it with
/// [`ClientStreamingCall::wait`]. Its request stream is sent while it is
/// polled; dropping it unfinished cancels the call.
#[must_use = "a call does nothing useful unless awaited or waited on"]
pub struct ClientStreamingCall<T> {
    stream: Streaming<T>,
    response: Option<T>,
}

impl<T> fmt::Debug for ClientStreamingCall<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientStreamingCall")
            .field("call_id", &self.stream.call_id.0)
            .finish()
    }
}

impl<T> ClientStreamingCall<T> {
    pub(crate) fn new(stream: Streaming<T>) -> ClientStreamingCall<T> {
        ClientStreamingCall {
            stream,
            response: None,
        }
    }
}

impl<T> ClientStreamingCall<T> {
    /// Cancels the call: awaiting it then returns `Cancelled` (see
    /// [`Streaming::cancel`]).
    pub fn cancel(&mut self) {
        self.stream.cancel();
    }
}

impl<T: prost::Message + Default> ClientStreamingCall<T> {
    /// Blocks the current thread until the response arrives (not for
    /// async handlers: see [`UnaryCall::wait`](crate::UnaryCall::wait)).
    pub fn wait(self) -> Result<Response<T>, Status> {
        crate::dispatch::warn_if_on_a_dispatcher("ClientStreamingCall::wait");
        crate::executor::wait_on(self)
    }
}

impl<T: prost::Message + Default> Future for ClientStreamingCall<T> {
    type Output = Result<Response<T>, Status>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match Pin::new(&mut this.stream).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(status))) => return Poll::Ready(Err(status)),
                Poll::Ready(Some(Ok(message))) => {
                    if this.response.replace(message).is_some() {
                        return Poll::Ready(Err(Status::internal(
                            "the server sent more than one response to a client-streaming call",
                        )));
                    }
                }
                Poll::Ready(None) => {
                    let metadata = this.stream.trailers().unwrap_or_default();
                    return Poll::Ready(match this.response.take() {
                        Some(message) => Ok(Response::from_parts(metadata, message)),
                        None => Err(Status::internal(
                            "the server finished a client-streaming call without a response",
                        )),
                    });
                }
            }
        }
    }
}
