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

use crate::dispatch::{OutFrame, encode_exact};
use crate::protocol::stream::{
    Inbound, MAX_BATCH, PIPELINED_MAX, RECORD_PREFIX, Records, RecvWindow, SendWindow, StreamError,
};
use crate::protocol::{CallId, FrameKind, Header, SendError};
use crate::{Code, Metadata, Request, Response, Status};
use futures_core::Stream;
use prost::bytes::Bytes;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker, ready};

/// Messages a producer takes from its stream per poll before it lets
/// others run.
const SEND_BUDGET: usize = 256;

/// A boxed stream of messages or errors, for handlers that return one
/// without naming its type: `type ListFeaturesStream = BoxStream<Feature>;`.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Sends frames on a connection, whatever its fabric.
pub(crate) trait Link: Send + Sync {
    /// Encodes and sends (or queues) a frame; with `cork`, the write may
    /// wait for [`Link::uncork`]. `fill` writes the payload.
    fn send(
        &self,
        frame: &OutFrame<'_>,
        cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError>;
    /// A buffer of this link's fabric to encode `frame`'s payload into
    /// ahead of its send, if a payload that size travels by rendezvous
    /// (lent to the peer and read from there); `None` if it travels in the
    /// ring. Checks the frame against the peer's limit before it allocates.
    fn lend_buffer(&self, frame: &OutFrame<'_>) -> Result<Option<LendBuf>, SendError> {
        let _ = frame;
        Ok(None)
    }
    /// Sends a frame whose payload is `buf` (from [`Link::lend_buffer`]
    /// for that frame) by lending it, with no copy, and posts it at once
    /// with what corked sends held before it.
    fn send_lent(&self, frame: &OutFrame<'_>, mut buf: LendBuf) -> Result<(), SendError> {
        let bytes = buf.bytes();
        self.send(frame, false, &mut |b| b.copy_from_slice(bytes))
    }
    /// Posts the writes held by corked sends.
    fn uncork(&self);
    /// The peer's address, for logs.
    fn peer(&self) -> &str;
    /// The largest message this side accepts on the link.
    fn max_message(&self) -> usize;
    /// Who the peer is, for handlers.
    fn remote(&self) -> Option<Arc<crate::Peer>>;
    /// Takes back the buffer a message arrived in, once decoded.
    fn recycle(&self, buf: crate::payload::Payload);
}

/// A payload encoded ahead of its send into a buffer of a link's fabric,
/// to be lent to the peer as it is ([`Link::lend_buffer`]).
pub(crate) struct LendBuf(Box<dyn LendBytes>);

/// A fabric's large-message buffer, its type erased.
trait LendBytes: Send + Sync {
    fn len(&self) -> usize;
    fn bytes(&mut self) -> &mut [u8];
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send + Sync>;
}

impl<B: crate::fabric::Buffer> LendBytes for B {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn bytes(&mut self) -> &mut [u8] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl LendBuf {
    /// Wraps a fabric's buffer.
    pub(crate) fn new<B: crate::fabric::Buffer>(buf: B) -> LendBuf {
        LendBuf(Box::new(buf))
    }

    /// Its length in bytes: the payload's.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Its bytes, to encode into.
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        self.0.bytes()
    }

    /// The fabric's buffer back, if it is a `B`.
    pub(crate) fn into_inner<B: crate::fabric::Buffer>(self) -> Option<B> {
        self.0.into_any().downcast::<B>().ok().map(|b| *b)
    }
}

impl fmt::Debug for LendBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LendBuf").finish_non_exhaustive()
    }
}

/// The link of a call that never started: nothing can be sent.
struct NoLink;

impl Link for NoLink {
    fn send(
        &self,
        _: &OutFrame<'_>,
        _: bool,
        _: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        Err(SendError::Closed("the call did not start".into()))
    }
    fn uncork(&self) {}
    fn peer(&self) -> &str {
        ""
    }
    fn max_message(&self) -> usize {
        0 // nothing arrives on a call that never started
    }
    fn remote(&self) -> Option<Arc<crate::Peer>> {
        None
    }
    fn recycle(&self, _: crate::payload::Payload) {}
}

/// Sends a frame with no payload (`HalfClose`, `Window`, `Cancel`,
/// `Release`).
pub(crate) fn send_control(
    link: &dyn Link,
    kind: FrameKind,
    call_id: CallId,
    value: u32,
) -> Result<(), Status> {
    let frame = OutFrame {
        kind,
        flags: 0,
        call_id,
        method_id: 0,
        status: 0,
        timeout_us: value,
        metadata: None,
        payload_len: 0,
    };
    link.send(&frame, false, &mut |_| {}).map_err(Status::from)
}

/// Whether a call was cancelled, and who waits to hear it: what a server
/// handler sees through [`Request::cancelled`].
#[derive(Debug, Default)]
pub(crate) struct Signal {
    cancelled: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
    /// Live [`Request::cancelled`] futures: while the handler holds one, it
    /// watches for the cancel itself, and a cancel does not drop it.
    watchers: AtomicUsize,
    /// The handler learnt of the cancel ([`Request::cancelled`] completed,
    /// or [`Request::is_cancelled`] said so): it ends its call as it sees
    /// fit, and is not dropped.
    told: AtomicBool,
}

impl Signal {
    /// Marks the call cancelled and wakes whoever waits for that.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        for w in wakers {
            w.wake();
        }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// A [`Request::cancelled`] future was made (see `watchers`).
    pub(crate) fn watch(&self) {
        self.watchers.fetch_add(1, Ordering::AcqRel);
    }

    /// That future was dropped.
    pub(crate) fn unwatch(&self) {
        self.watchers.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether the call is cancelled, as the handler learns it (see `told`).
    pub(crate) fn tell(&self) -> bool {
        let cancelled = self.is_cancelled();
        if cancelled && !self.told.load(Ordering::Relaxed) {
            self.told.store(true, Ordering::Release);
        }
        cancelled
    }

    /// Whether the handler watches for cancellation itself, or has learnt
    /// of it: then it, not the server, ends its call.
    pub(crate) fn is_watched(&self) -> bool {
        self.told.load(Ordering::Acquire) || self.watchers.load(Ordering::Acquire) > 0
    }

    /// Whether the call is cancelled and its handler, not watching for
    /// that itself, is to be dropped.
    pub(crate) fn drops_handler(&self) -> bool {
        self.is_cancelled() && !self.is_watched()
    }

    /// [`Signal::drops_handler`]; until then, for a handler not watching
    /// for the cancel itself, wakes the task with `cx` when it comes.
    pub(crate) fn poll_drops_handler(&self, cx: &mut Context<'_>) -> bool {
        !self.is_watched() && self.poll_cancelled(cx).is_ready()
    }

    /// Makes a signal nobody else holds new again, for reuse.
    pub(crate) fn reset(&mut self) {
        *self.cancelled.get_mut() = false;
        *self.watchers.get_mut() = 0;
        *self.told.get_mut() = false;
        self.wakers
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    pub(crate) fn poll_cancelled(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_cancelled() {
            return Poll::Ready(());
        }
        let mut wakers = lock(&self.wakers);
        // Checked again under the lock: `cancel` takes the wakers under it.
        if self.is_cancelled() {
            return Poll::Ready(());
        }
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One stream's state, shared by the dispatcher and the stream's ends.
#[derive(Debug)]
pub(crate) struct StreamCore {
    st: Mutex<CoreState>,
    /// Set when the call is cancelled or its connection lost (servers).
    pub(crate) signal: Arc<Signal>,
    /// Whether the peer may send `Message`s on this stream.
    messages: bool,
    /// The call was cancelled or ran out of time: what arrived and was not
    /// read yet is dropped.
    dropped: AtomicBool,
}

#[derive(Debug)]
struct CoreState {
    /// Frames that arrived and were not taken yet.
    inbox: VecDeque<Entry>,
    recv: RecvWindow,
    inbound: Inbound,
    /// How the inbound direction ended, once it did (told after the inbox
    /// drains).
    end: Option<Result<(), Status>>,
    /// The metadata of the peer's first frame (the server's initial metadata).
    headers: Option<Metadata>,
    /// The metadata of the peer's last frame (the server's trailers).
    trailers: Option<Metadata>,
    reader: Option<Waker>,
    send: SendWindow,
    writer: Option<Waker>,
    /// Why nothing more may be sent, once the call is over for this side.
    over: Option<Status>,
}

impl StreamCore {
    /// A stream with windows of `window` bytes each way; the peer may send
    /// `Message`s only if `messages`.
    pub(crate) fn new(window: u32, messages: bool) -> Arc<StreamCore> {
        Arc::new(StreamCore {
            st: Mutex::new(CoreState {
                inbox: VecDeque::new(),
                recv: RecvWindow::new(window),
                inbound: Inbound::default(),
                end: None,
                headers: None,
                trailers: None,
                reader: None,
                send: SendWindow::new(window),
                writer: None,
                over: None,
            }),
            signal: Arc::new(Signal::default()),
            messages,
            dropped: AtomicBool::new(false),
        })
    }

    /// The core of a call that never started: it ends with `status`.
    fn failed(status: Status) -> Arc<StreamCore> {
        let core = StreamCore::new(crate::protocol::stream::DEFAULT_WINDOW, false);
        core.fail(status);
        core
    }

    fn state(&self) -> MutexGuard<'_, CoreState> {
        lock(&self.st)
    }

    /// A `Message` frame arrived (dispatcher), with its decoded metadata:
    /// its header says how many messages the payload holds, and its body
    /// (metadata and payload) is what the window counts.
    pub(crate) fn on_message(
        &self,
        header: &Header,
        payload: crate::payload::Payload,
        metadata: Metadata,
    ) -> Result<(), StreamError> {
        if !self.messages {
            return Err(StreamError::MessageNotExpected);
        }
        let count = header.timeout_us;
        let body_len = header.metadata_len as usize + header.payload_len as usize;
        Records::check(&payload, count)?;
        let waker = {
            let mut st = self.state();
            st.inbound.on_message(count)?;
            st.recv.on_message(body_len)?;
            if st.headers.is_none() {
                st.headers = Some(metadata);
            }
            st.inbox.push_back(Entry {
                data: payload,
                count,
                cost: Some(body_len),
            });
            st.reader.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// The peer ended its direction (dispatcher): a `HalfClose` (server),
    /// or the final `Response` or `Error` (client). A final message outside
    /// the window (a client-streaming call's response) and the frame's
    /// metadata come with it. `finished` ends the call for sends too.
    pub(crate) fn on_end(
        &self,
        result: Result<(), Status>,
        last: Option<crate::payload::Payload>,
        metadata: Option<Metadata>,
        finished: bool,
    ) -> Result<(), StreamError> {
        let (reader, writer) = {
            let mut st = self.state();
            st.inbound.on_close()?;
            if let Some(message) = last {
                st.inbox.push_back(Entry {
                    data: message,
                    count: 1,
                    cost: None,
                });
            }
            if let Some(md) = metadata {
                if st.headers.is_none() {
                    st.headers = Some(md.clone());
                }
                st.trailers = Some(md);
            }
            let status = result.as_ref().err().cloned();
            st.end = Some(result);
            let writer = if finished && st.over.is_none() {
                st.over = Some(
                    status.unwrap_or_else(|| Status::cancelled("the server finished the call")),
                );
                st.writer.take()
            } else {
                None
            };
            (st.reader.take(), writer)
        };
        for w in [reader, writer].into_iter().flatten() {
            w.wake();
        }
        Ok(())
    }

    /// How the call ended, once it has: `Ok` for success.
    pub(crate) fn end_code(&self) -> Option<Code> {
        self.state().end.as_ref().map(|e| match e {
            Ok(()) => Code::Ok,
            Err(status) => status.code(),
        })
    }

    /// The peer granted window back (dispatcher).
    pub(crate) fn on_grant(&self, grant: u32) -> Result<(), StreamError> {
        let waker = {
            let mut st = self.state();
            st.send.on_grant(grant)?;
            st.writer.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Ends the call on this side with `status`: cancelled, deadline
    /// passed, connection lost. The reader sees `status` next, and senders
    /// fail with it. A call cancelled or out of time drops what it received
    /// and did not read (nobody wants it any more); after any other failure
    /// what was received stays readable first.
    pub(crate) fn fail(&self, status: Status) {
        let drop_unread = matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded);
        let (reader, writer) = {
            let mut st = self.state();
            if drop_unread {
                st.inbox.clear();
                self.dropped.store(true, Ordering::Release);
            }
            if st.end.is_none() {
                st.end = Some(Err(status.clone()));
            }
            if st.over.is_none() {
                st.over = Some(status);
            }
            (st.reader.take(), st.writer.take())
        };
        for w in [reader, writer].into_iter().flatten() {
            w.wake();
        }
        self.signal.cancel();
    }

    /// Whether the call is over for sends.
    pub(crate) fn is_over(&self) -> bool {
        self.state().over.is_some()
    }

    /// The next frame's messages, once one is in, with the window grant to
    /// send back if one is due; `None` at the clean end.
    fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<Result<Received, Status>>> {
        let mut st = self.state();
        if let Some(Entry { data, count, cost }) = st.inbox.pop_front() {
            // A grant is worth sending only while the peer may still send.
            let grant = cost.and_then(|cost| {
                st.recv
                    .on_consumed(cost)
                    .filter(|_| st.over.is_none() && !st.inbound.is_closed())
            });
            return Poll::Ready(Some(Ok(Received { data, count, grant })));
        }
        match &st.end {
            Some(Ok(())) => Poll::Ready(None),
            Some(Err(status)) => Poll::Ready(Some(Err(status.clone()))),
            None => {
                st.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Ready once a message of `body_len` bytes may be sent (its window is
    /// then taken), or with the reason nothing may be sent any more.
    fn poll_window(&self, cx: &mut Context<'_>, body_len: usize) -> Poll<Result<(), Status>> {
        let mut st = self.state();
        if let Some(status) = &st.over {
            return Poll::Ready(Err(status.clone()));
        }
        if st.send.try_send(body_len) {
            return Poll::Ready(Ok(()));
        }
        st.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Gives back the window a message of `body_len` bytes took and that
    /// was not sent after all (its send failed): a later one may use it.
    fn unsend(&self, body_len: usize) {
        let mut st = self.state();
        st.send.unsend(body_len);
        if let Some(w) = st.writer.take() {
            w.wake();
        }
    }

    /// Wakes the task with `cx` once the call ends for sends, too (a
    /// producer waiting on something else still hears of a cancellation).
    fn watch_over(&self, cx: &mut Context<'_>) -> bool {
        let mut st = self.state();
        if st.over.is_some() {
            return true;
        }
        st.writer = Some(cx.waker().clone());
        false
    }

    fn metadata(&self) -> (Option<Metadata>, Option<Metadata>) {
        let st = self.state();
        (st.headers.clone(), st.trailers.clone())
    }

    /// The peer's initial metadata once it arrived (with its first frame,
    /// or with the end); the call's status if it failed before any frame
    /// came (a failed call's metadata is its status's). `None` before.
    fn headers_now(&self) -> Option<Result<Metadata, Status>> {
        Self::headers_of(&self.state())
    }

    fn headers_of(st: &CoreState) -> Option<Result<Metadata, Status>> {
        match (&st.end, &st.headers) {
            (Some(Err(status)), _) if !st.inbound.is_started() => Some(Err(status.clone())),
            (_, Some(headers)) => Some(Ok(headers.clone())),
            // A clean end that brought no metadata (a trailers-only answer
            // without any, a request stream half-closed at once).
            (Some(_), None) => Some(Ok(Metadata::default())),
            (None, None) => None,
        }
    }

    /// [`StreamCore::headers_now`], or `Pending` (woken as a reader is).
    fn poll_headers(&self, cx: &mut Context<'_>) -> Poll<Result<Metadata, Status>> {
        let mut st = self.state();
        match Self::headers_of(&st) {
            Some(headers) => Poll::Ready(headers),
            None => {
                st.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A frame in a stream's inbox: `count` messages ([`Records`]) and what
/// they cost the window.
#[derive(Debug)]
struct Entry {
    data: crate::payload::Payload,
    count: u32,
    /// The body length the window counted; `None` for a final message
    /// outside the window (an empty message inside it is `Some(0)`, which
    /// still costs a header's worth and must be granted back).
    cost: Option<usize>,
}

/// A frame taken from a stream's inbox.
struct Received {
    data: crate::payload::Payload,
    count: u32,
    grant: Option<u32>,
}

/// The sending half of one stream direction: gathers messages into
/// `Message` frames, sends them within the window, and `HalfClose` at the
/// end.
pub(crate) struct Outbox {
    pub(crate) core: Arc<StreamCore>,
    pub(crate) link: Arc<dyn Link>,
    pub(crate) call_id: CallId,
    pub(crate) method_id: u32,
    /// Metadata for the first message (a server's initial metadata);
    /// `None` once a message carried it.
    pub(crate) first_metadata: Option<Metadata>,
    /// Messages gathered for the next frame, each after its length.
    batch: Vec<u8>,
    count: u32,
    /// A message large enough to travel by rendezvous, encoded ahead into
    /// the buffer it will be lent in: it waits for the window (while the
    /// one before is read), then goes with no copy. Nothing is gathered
    /// into `batch` while it waits.
    lent: Option<LendBuf>,
}

impl Outbox {
    /// The outbox of stream `call_id` on `link`.
    pub(crate) fn new(
        core: Arc<StreamCore>,
        link: Arc<dyn Link>,
        call_id: CallId,
        method_id: u32,
        first_metadata: Option<Metadata>,
    ) -> Outbox {
        Outbox {
            core,
            link,
            call_id,
            method_id,
            first_metadata,
            batch: Vec::new(),
            count: 0,
            lent: None,
        }
    }

    /// The outbox of a call that did not start: every send fails.
    pub(crate) fn closed() -> Outbox {
        Outbox::new(
            StreamCore::failed(Status::unavailable("the call did not start")),
            Arc::new(NoLink),
            CallId(0),
            0,
            None,
        )
    }

    /// Adds `message` to the batch, or encodes it ahead into a buffer to be
    /// lent if it is that large; first sends what waits before it if the
    /// batch would grow past [`MAX_BATCH`] or the message goes alone
    /// (`Pending` while the window does not allow that: then `message` was
    /// not taken).
    fn poll_push<M: prost::Message>(
        &mut self,
        cx: &mut Context<'_>,
        message: &M,
    ) -> Poll<Result<(), Status>> {
        let len = message.encoded_len();
        let alone = self.lent.is_some() || len > MAX_BATCH;
        if alone || (self.count > 0 && self.batch.len() + RECORD_PREFIX + len > MAX_BATCH) {
            match self.poll_send_batch(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
        }
        if len > MAX_BATCH {
            // Encoded now, into the buffer it will be lent in, while the
            // message before it is still being read: not in the batch and
            // again into that buffer once the window opens.
            match self.link.lend_buffer(&self.message_frame(1, len)) {
                Ok(Some(mut buf)) => {
                    encode_exact(message, buf.bytes());
                    self.lent = Some(buf);
                    // It goes alone, so at once if the window allows, not
                    // after the next message is produced and encoded (the
                    // taken message stays here if it does not).
                    return match self.poll_send_batch(cx) {
                        Poll::Ready(Err(status)) => Poll::Ready(Err(status)),
                        _ => Poll::Ready(Ok(())),
                    };
                }
                Ok(None) => {}
                Err(e) => return Poll::Ready(Err(Status::from(e))),
            }
        }
        self.batch.reserve(RECORD_PREFIX + len);
        // A message fits in 32 bits: larger ones fail when sent.
        let prefix = u32::try_from(len).unwrap_or(u32::MAX);
        self.batch.extend_from_slice(&prefix.to_le_bytes());
        // Cannot fail: room for `encoded_len` bytes was reserved.
        let _ = message.encode(&mut self.batch);
        self.count += 1;
        Poll::Ready(Ok(()))
    }

    /// Whether a message above [`PIPELINED_MAX`], encoded ahead to be lent,
    /// waits for the window (which it takes alone).
    fn waits_alone(&self) -> bool {
        self.lent
            .as_ref()
            .is_some_and(|buf| buf.len() as u64 > PIPELINED_MAX)
    }

    /// Sends the gathered messages as one `Message` frame once the window
    /// allows it, or the message encoded ahead to be lent. The write may
    /// stay corked until [`Outbox::flush`].
    fn poll_send_batch(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        if let Some(len) = self.lent.as_ref().map(LendBuf::len) {
            let body_len = match ready!(self.poll_window_for(cx, len)) {
                Ok(body_len) => body_len,
                Err(status) => return Poll::Ready(Err(status)),
            };
            let buf = self.lent.take().expect("checked above");
            // Posted at once, with what was corked before it: the reader
            // of a lent message waits for its descriptor to start its
            // read, and the producer may take long over the next message.
            let sent = self.link.send_lent(&self.message_frame(1, len), buf);
            return Poll::Ready(self.after_send(sent, body_len));
        }
        if self.count == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut batch = std::mem::take(&mut self.batch);
        // One message travels without its length.
        let skip = if self.count == 1 { RECORD_PREFIX } else { 0 };
        let payload = &batch[skip..];
        let sent = self.poll_frame(cx, self.count, payload.len(), &mut |buf| {
            buf.copy_from_slice(payload)
        });
        if sent.is_ready() {
            batch.clear();
            self.count = 0;
        }
        self.batch = batch;
        sent
    }

    /// Sends the first metadata alone, in a `Message` frame with no
    /// messages, if no frame carried it yet and nothing waits to carry it:
    /// so that the peer learns it while the stream has nothing to send
    /// yet, as gRPC sends a response's headers before its first message.
    pub(crate) fn poll_send_headers(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        if self.first_metadata.is_none() || self.count > 0 || self.lent.is_some() {
            return Poll::Ready(Ok(()));
        }
        self.poll_frame(cx, 0, 0, &mut |_| {})
    }

    /// Sends `message` alone once the window allows it (after what was
    /// gathered before): `Pending` until then, and `message` was not taken.
    pub(crate) fn poll_send<M: prost::Message>(
        &mut self,
        cx: &mut Context<'_>,
        message: &M,
    ) -> Poll<Result<(), Status>> {
        match self.poll_send_batch(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        self.poll_frame(cx, 1, message.encoded_len(), &mut |buf| {
            encode_exact(message, buf)
        })
    }

    /// Sends a `Message` frame of `count` messages in `payload_len` bytes
    /// (`fill` writes them) once the window allows it.
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
        count: u32,
        payload_len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Poll<Result<(), Status>> {
        let body_len = match ready!(self.poll_window_for(cx, payload_len)) {
            Ok(body_len) => body_len,
            Err(status) => return Poll::Ready(Err(status)),
        };
        let frame = self.message_frame(count, payload_len);
        let sent = self.link.send(&frame, true, fill);
        Poll::Ready(self.after_send(sent, body_len))
    }

    /// What a send of a frame of `body_len` bytes came to. The first
    /// metadata went with a frame that left; one that did not gives its
    /// window back, and the metadata waits for the next.
    fn after_send(&mut self, sent: Result<(), SendError>, body_len: usize) -> Result<(), Status> {
        match sent {
            Ok(()) => {
                self.first_metadata = None;
                Ok(())
            }
            Err(e) => {
                self.core.unsend(body_len);
                Err(Status::from(e))
            }
        }
    }

    /// Waits for the window to allow a frame of `payload_len` bytes and the
    /// metadata it carries; then the frame's body length, whose window it
    /// took (given back by [`Outbox::after_send`] if the send fails).
    fn poll_window_for(
        &self,
        cx: &mut Context<'_>,
        payload_len: usize,
    ) -> Poll<Result<usize, Status>> {
        let body_len = self.first_md().map_or(0, Metadata::encoded_len) + payload_len;
        self.core
            .poll_window(cx, body_len)
            .map(|taken| taken.map(|()| body_len))
    }

    /// The metadata the next frame carries: the first metadata, until a
    /// frame carried it (none if empty).
    fn first_md(&self) -> Option<&Metadata> {
        self.first_metadata.as_ref().filter(|m| !m.is_empty())
    }

    /// The next `Message` frame: `count` messages in `payload_len` bytes.
    fn message_frame(&self, count: u32, payload_len: usize) -> OutFrame<'_> {
        OutFrame {
            kind: FrameKind::Message,
            flags: 0,
            call_id: self.call_id,
            method_id: self.method_id,
            status: 0,
            timeout_us: count,
            metadata: self.first_md(),
            payload_len,
        }
    }

    /// Posts what corked sends held.
    pub(crate) fn flush(&self) {
        self.link.uncork();
    }

    /// Ends this direction (client): the peer sees the request stream complete.
    fn half_close(&self) -> Result<(), Status> {
        if self.core.is_over() {
            return Ok(());
        }
        send_control(&*self.link, FrameKind::HalfClose, self.call_id, 0)
    }
}

/// How a server's response stream ended.
pub(crate) enum StreamEnd {
    /// It yielded its last message.
    Finished,
    /// It yielded an error, or a message could not be sent.
    Failed(Status),
    /// Polling it panicked, with this message.
    Panicked(String),
    /// The call is over (cancelled, connection lost): nobody reads more.
    Over,
}

/// Drives a stream of messages into an [`Outbox`]: what the stream yields
/// at once is gathered into batches, sent as the window allows, up to a
/// budget per poll.
pub(crate) struct Producer<M> {
    /// A message that waits for the batch before it to go.
    next: Option<M>,
    /// How the stream ended, told once its last batch went.
    end: Option<StreamEnd>,
}

impl<M: prost::Message> Producer<M> {
    pub(crate) fn new() -> Producer<M> {
        Producer {
            next: None,
            end: None,
        }
    }

    /// Ends the stream with `end` without polling it again (it panicked):
    /// what it yielded before still goes, then `end` is told.
    pub(crate) fn end_with(&mut self, end: StreamEnd) {
        self.end = Some(end);
    }

    /// Sends what `stream` yields; `Ready` once it ended and all it
    /// yielded went, or once nothing more can be sent.
    pub(crate) fn poll<S>(
        &mut self,
        cx: &mut Context<'_>,
        mut stream: Pin<&mut S>,
        outbox: &mut Outbox,
    ) -> Poll<StreamEnd>
    where
        S: Stream<Item = Result<M, Status>> + ?Sized,
    {
        let stopped = |status: Status, outbox: &Outbox| {
            if outbox.core.is_over() {
                StreamEnd::Over
            } else {
                StreamEnd::Failed(status)
            }
        };
        let mut budget = SEND_BUDGET;
        while self.end.is_none() && budget > 0 {
            let message = match self.next.take() {
                Some(m) => m,
                // A message that goes alone (above `PIPELINED_MAX`) is
                // encoded ahead and waits for the one before to be read:
                // the next is produced once it went, not now. A third
                // message of hundreds of megabytes would only hold memory
                // and take the CPU from the read under way (smaller ones
                // are produced ahead: two of them travel at once, and
                // producing the next meanwhile keeps that pipeline full).
                // (Waiting for the window, it hears of the call's end: the
                // window's waker is the one a failed call wakes.)
                None if outbox.waits_alone() => match outbox.poll_send_batch(cx) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
                    Poll::Pending => return Poll::Pending,
                },
                None => match stream.as_mut().poll_next(cx) {
                    Poll::Ready(Some(Ok(m))) => m,
                    Poll::Ready(Some(Err(status))) => {
                        self.end = Some(StreamEnd::Failed(status));
                        break;
                    }
                    Poll::Ready(None) => {
                        self.end = Some(StreamEnd::Finished);
                        break;
                    }
                    Poll::Pending => {
                        // Nothing more for now: what was gathered goes (or
                        // the initial metadata, if nothing carried it yet),
                        // and a cancel must still wake us.
                        let sent = match outbox.poll_send_batch(cx) {
                            Poll::Ready(Ok(())) => outbox.poll_send_headers(cx),
                            other => other,
                        };
                        return match sent {
                            Poll::Ready(Err(status)) => Poll::Ready(stopped(status, outbox)),
                            _ if outbox.core.watch_over(cx) => Poll::Ready(StreamEnd::Over),
                            _ => Poll::Pending,
                        };
                    }
                },
            };
            match outbox.poll_push(cx, &message) {
                Poll::Ready(Ok(())) => budget -= 1,
                Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
                Poll::Pending => {
                    self.next = Some(message);
                    return Poll::Pending;
                }
            }
        }
        match outbox.poll_send_batch(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
            Poll::Pending => return Poll::Pending,
        }
        match self.end.take() {
            Some(end) => Poll::Ready(end),
            None => {
                // Budget spent: let the others run, and come back at once.
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

/// Sends the messages of a `Stream` into a stream direction as the window
/// allows; polled by whoever waits on the call.
pub(crate) trait Pump: Send {
    /// Sends what is ready; `Ready` once the stream ended (and the
    /// direction is closed) or the call is over.
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<()>;
}

/// A stream of messages as a stream of `Ok` messages.
struct Oks<S>(Pin<Box<S>>);

impl<S: Stream> Stream for Oks<S> {
    type Item = Result<S::Item, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.as_mut().poll_next(cx).map(|m| m.map(Ok))
    }
}

/// A client's request stream, sent as it yields.
pub(crate) struct RequestPump<S: Stream> {
    stream: Oks<S>,
    outbox: Outbox,
    producer: Producer<S::Item>,
    done: bool,
}

impl<S> RequestPump<S>
where
    S: Stream + Send + 'static,
    S::Item: prost::Message,
{
    pub(crate) fn new(stream: S, outbox: Outbox) -> RequestPump<S> {
        RequestPump {
            stream: Oks(Box::pin(stream)),
            outbox,
            producer: Producer::new(),
            done: false,
        }
    }
}

impl<S> Pump for RequestPump<S>
where
    S: Stream + Send + 'static,
    S::Item: prost::Message + Send,
{
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.done {
            return Poll::Ready(());
        }
        let end = self
            .producer
            .poll(cx, Pin::new(&mut self.stream), &mut self.outbox);
        let Poll::Ready(end) = end else {
            self.outbox.flush();
            return Poll::Pending;
        };
        match end {
            StreamEnd::Finished => {
                if let Err(status) = self.outbox.half_close() {
                    tracing::debug!(%status, "could not half-close a request stream");
                }
            }
            // A message that cannot be sent (too large) fails the call; a
            // call that is over tells its own outcome.
            StreamEnd::Failed(status) => {
                tracing::debug!(%status, "request stream stopped");
                if !self.outbox.core.is_over() {
                    self.outbox.core.fail(status);
                }
            }
            StreamEnd::Panicked(_) | StreamEnd::Over => {}
        }
        self.outbox.flush();
        self.done = true;
        Poll::Ready(())
    }
}

/// What a stream opened later needs: its parts, as a call that starts at
/// once has them.
pub(crate) struct StreamParts {
    pub(crate) core: Arc<StreamCore>,
    pub(crate) link: Arc<dyn Link>,
    pub(crate) call_id: CallId,
    pub(crate) owner: Option<Arc<dyn CallOwner>>,
    pub(crate) pump: Option<Box<dyn Pump>>,
    /// The request sender's outbox, for a stream with a [`RequestSender`].
    pub(crate) outbox: Option<Outbox>,
}

/// Starts a stream once it can: polled by whichever of its handles is
/// used first; `Pending` while it waits (its waker registered).
pub(crate) type Opener =
    Box<dyn FnMut(&mut Context<'_>) -> Poll<Result<StreamParts, Status>> + Send>;

/// A client stream that waits for a connection before it starts
/// (wait-for-ready): shared by its [`Streaming`] and its
/// [`RequestSender`], each of which drives it and takes its own parts
/// once it has started.
pub(crate) struct Opening {
    state: Mutex<OpeningState>,
    /// The request sender was closed or dropped before the stream started:
    /// it half-closes as it starts.
    sender_done: AtomicBool,
}

enum OpeningState {
    Waiting(Opener),
    Open {
        /// Core, link, id, owner and pump, until the `Streaming` takes them.
        stream: Option<StreamParts>,
    },
    Failed(Status),
}

impl Opening {
    pub(crate) fn new(opener: Opener) -> Arc<Opening> {
        Arc::new(Opening {
            state: Mutex::new(OpeningState::Waiting(opener)),
            sender_done: AtomicBool::new(false),
        })
    }

    fn state(&self) -> MutexGuard<'_, OpeningState> {
        lock(&self.state)
    }

    /// Drives the opener: `Ready(Ok)` once the stream has started.
    fn poll_open(&self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let mut st = self.state();
        let OpeningState::Waiting(opener) = &mut *st else {
            return Poll::Ready(match &*st {
                OpeningState::Failed(status) => Err(status.clone()),
                _ => Ok(()),
            });
        };
        match opener(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(mut parts)) => {
                if self.sender_done.load(Ordering::Acquire) {
                    if let Some(outbox) = parts.outbox.take() {
                        let _ = outbox.half_close();
                    }
                }
                *st = OpeningState::Open {
                    stream: Some(parts),
                };
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(status)) => {
                *st = OpeningState::Failed(status.clone());
                Poll::Ready(Err(status))
            }
        }
    }

    /// The started stream's parts but the outbox (once).
    fn take_stream(&self) -> Option<StreamParts> {
        match &mut *self.state() {
            OpeningState::Open { stream } => stream.as_mut().map(|p| StreamParts {
                core: p.core.clone(),
                link: p.link.clone(),
                call_id: p.call_id,
                owner: p.owner.take(),
                pump: p.pump.take(),
                outbox: None,
            }),
            _ => None,
        }
    }

    /// The request sender is done before it had the outbox: the stream
    /// half-closes as it starts (or now, if it has).
    fn sender_done(&self) {
        self.sender_done.store(true, Ordering::Release);
        if let Some(outbox) = self.take_outbox() {
            let _ = outbox.half_close();
        }
    }

    /// The started stream's request outbox (once).
    fn take_outbox(&self) -> Option<Outbox> {
        match &mut *self.state() {
            OpeningState::Open { stream: Some(p) } => p.outbox.take(),
            _ => None,
        }
    }
}

impl Drop for Opening {
    /// A stream that started but whose `Streaming` was gone first: its
    /// call is let go of (cancelled if live), as the `Streaming` would.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let OpeningState::Open { stream: Some(p) } = st {
            if let Some(owner) = p.owner.take() {
                owner.release(p.call_id);
            }
        }
    }
}

/// What a client stream's handle does on drop, and how it turns the
/// completion queue itself (see `Channel`).
pub(crate) trait CallOwner: Send + Sync {
    /// The handle let go of the call: cancel it if it is still live.
    fn release(&self, call_id: CallId);
    /// Handles completions on this thread if nobody else is; true if it did.
    fn progress(&self) -> bool;
    /// The caller stops handling completions and waits to be woken: the
    /// dispatcher thread must take over (it naps while callers poll).
    fn ensure_polled(&self);
}

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
    /// The frame being read: its bytes, and the messages not yet taken.
    batch: Option<(Bytes, Records)>,
    /// The stream ended (cleanly or with its error).
    finished: bool,
    /// A server's request stream: its peer sends no initial metadata
    /// (the call's is the `Request`'s).
    requests: bool,
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
            finished: false,
            requests: false,
            _t: PhantomData,
        }
    }

    /// This as a server's request stream (see [`Streaming::initial_metadata`]).
    pub(crate) fn of_requests(mut self) -> Streaming<T> {
        self.requests = true;
        self
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
    fn next_in_batch(&mut self) -> Option<Bytes> {
        if self.batch.is_some() && self.core.dropped.load(Ordering::Acquire) {
            self.batch = None;
        }
        let (data, records) = self.batch.as_mut()?;
        // Checked when it arrived: every announced message is there.
        let message = records.next_range(data).map(|r| data.slice(r));
        if records.left() == 0 || message.is_none() {
            self.batch = None;
        }
        message
    }

    /// Polls for the next raw message, driving the request pump first.
    pub(crate) fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Status>>> {
        if self.poll_opened(cx).is_pending() {
            return Poll::Pending;
        }
        if let Some(message) = self.next_in_batch() {
            return Poll::Ready(Some(Ok(message)));
        }
        if self.finished {
            return Poll::Ready(None);
        }
        self.poll_pump(cx);
        let mut polled_queue = false;
        loop {
            match self.core.poll_recv(cx) {
                Poll::Ready(Some(Ok(Received { data, count, grant }))) => {
                    if let Some(grant) = grant {
                        // A failed grant means the call is over; its
                        // status arrives through the core.
                        let _ = send_control(&*self.link, FrameKind::Window, self.call_id, grant);
                    }
                    if count == 1 {
                        return Poll::Ready(Some(Ok(data.into_bytes())));
                    }
                    self.batch = Some((data.into_bytes(), Records::new(count)));
                    if let Some(message) = self.next_in_batch() {
                        return Poll::Ready(Some(Ok(message)));
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
            return self.decode(message).map(Some);
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
            _t: PhantomData,
        }
    }

    /// The sender of a stream that starts when `opening` has.
    pub(crate) fn waiting(opening: Arc<Opening>) -> RequestSender<T> {
        RequestSender {
            outbox: Outbox::closed(),
            opening: Some(opening),
            closed: false,
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
        let sent = std::future::poll_fn(|cx| self.outbox.poll_send(cx, &message)).await;
        self.outbox.flush();
        sent
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
