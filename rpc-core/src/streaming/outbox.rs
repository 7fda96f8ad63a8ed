//! Sending a stream's messages: [`Outbox`], one direction's sending half,
//! which gathers messages into `Message` frames, sends them as the window
//! allows (a large one encoded ahead into the buffer it is lent in), and
//! half-closes; and [`NoLink`], the link of a call that never started.

use super::state::StreamCore;
use crate::compression::{Encoding, Outgoing, SendPolicy};
use crate::dispatch::{LendBuf, Link, OutFrame, send_control};
use crate::protocol::stream::{MAX_BATCH, PIPELINED_MAX, RECORD_PREFIX};
use crate::protocol::{CallId, FrameKind, SendError};
use crate::{Metadata, Status};
use std::sync::Arc;
use std::task::{Context, Poll, ready};

/// The link of a call that never started: nothing can be sent.
pub(super) struct NoLink;

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
    /// The encoding of what waits in `batch` or `lent`: a frame's messages
    /// share one, so a message in another goes in the next frame.
    pending_encoding: Option<Encoding>,
    /// How messages leave: compressed or not ([`Outbox::compress`]).
    compression: SendPolicy,
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
            pending_encoding: None,
            compression: SendPolicy::default(),
        }
    }

    /// Sends messages as `compression` says, from the next on.
    pub(crate) fn compress(mut self, compression: SendPolicy) -> Outbox {
        self.compression = compression;
        self
    }

    /// Sends the messages from the next on in `encoding` (`None`: as they
    /// are), if the peer accepts it: a sender's per-message switch.
    pub(crate) fn send_in(&mut self, encoding: Option<Encoding>) {
        self.compression.switch = None;
        self.compression.encoding = encoding;
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
    pub(super) fn poll_push<M: prost::Message>(
        &mut self,
        cx: &mut Context<'_>,
        message: &M,
    ) -> Poll<Result<(), Status>> {
        let encoding = self.compression.now();
        // Compressed before the window is asked for (a message that must
        // wait is compressed again when pushed again).
        self.poll_push_out(cx, Outgoing::new(message, encoding), encoding)
    }

    /// [`Outbox::poll_push`] for a message whose bytes are ready, in
    /// `encoding` or as they are: passed on without this outbox's policy.
    #[cfg(feature = "grpc")]
    fn poll_push_ready(
        &mut self,
        cx: &mut Context<'_>,
        bytes: &[u8],
        encoding: Option<Encoding>,
    ) -> Poll<Result<(), Status>> {
        self.poll_push_out(
            cx,
            Outgoing::<crate::RawMessage>::Packed(bytes.into()),
            encoding,
        )
    }

    fn poll_push_out<M: prost::Message>(
        &mut self,
        cx: &mut Context<'_>,
        out: Outgoing<'_, M>,
        encoding: Option<Encoding>,
    ) -> Poll<Result<(), Status>> {
        let len = out.len();
        let alone = self.lent.is_some() || len > MAX_BATCH;
        let other_encoding = self.count > 0 && self.pending_encoding != encoding;
        if alone
            || other_encoding
            || (self.count > 0 && self.batch.len() + RECORD_PREFIX + len > MAX_BATCH)
        {
            match self.poll_send_batch(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
        }
        self.pending_encoding = encoding;
        if len > MAX_BATCH {
            // Encoded now, into the buffer it will be lent in, while the
            // message before it is still being read: not in the batch and
            // again into that buffer once the window opens.
            match self.link.lend_buffer(&self.message_frame(1, len)) {
                Ok(Some(mut buf)) => {
                    out.write(buf.bytes());
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
        out.append_to(&mut self.batch);
        self.count += 1;
        Poll::Ready(Ok(()))
    }

    /// Whether a message above [`PIPELINED_MAX`], encoded ahead to be lent,
    /// waits for the window (which it takes alone).
    pub(super) fn waits_alone(&self) -> bool {
        self.lent
            .as_ref()
            .is_some_and(|buf| buf.len() as u64 > PIPELINED_MAX)
    }

    /// Sends the gathered messages as one `Message` frame once the window
    /// allows it, or the message encoded ahead to be lent. The write may
    /// stay corked until [`Outbox::flush`].
    pub(super) fn poll_send_batch(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
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
        let encoding = self.compression.now();
        self.pending_encoding = encoding;
        let out = Outgoing::new(message, encoding);
        self.poll_frame(cx, 1, out.len(), &mut |buf| out.write(buf))
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
            flags: self.pending_encoding.map_or(0, Encoding::flags),
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
    pub(super) fn half_close(&self) -> Result<(), Status> {
        if self.core.is_over() {
            return Ok(());
        }
        send_control(&*self.link, FrameKind::HalfClose, self.call_id, 0)
    }
}

/// What an [`Outbox`] sends: a message, encoded (and compressed, as the
/// outbox's policy says) as it goes, or a [`Packed`] one.
pub(crate) trait Outbound {
    /// Pushes this into `outbox` ([`Outbox::poll_push`]).
    fn poll_push_into(&self, cx: &mut Context<'_>, outbox: &mut Outbox)
    -> Poll<Result<(), Status>>;
}

impl<M: prost::Message> Outbound for M {
    fn poll_push_into(
        &self,
        cx: &mut Context<'_>,
        outbox: &mut Outbox,
    ) -> Poll<Result<(), Status>> {
        outbox.poll_push(cx, self)
    }
}

/// A message's bytes as they arrived from elsewhere, compressed in
/// `encoding` or as they are, passed on as they are: a gRPC caller's
/// request stream, through the face to its handler, which inflates it.
#[cfg(feature = "grpc")]
#[derive(Debug)]
pub(crate) struct Packed {
    pub(crate) bytes: prost::bytes::Bytes,
    pub(crate) encoding: Option<Encoding>,
}

#[cfg(feature = "grpc")]
impl Outbound for Packed {
    fn poll_push_into(
        &self,
        cx: &mut Context<'_>,
        outbox: &mut Outbox,
    ) -> Poll<Result<(), Status>> {
        outbox.poll_push_ready(cx, &self.bytes, self.encoding)
    }
}
