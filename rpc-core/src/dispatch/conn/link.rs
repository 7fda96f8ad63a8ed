//! What calls and streams send through: [`Link`], a connection's send path
//! with its fabric erased, and [`Conn`]'s implementation of it; [`LendBuf`],
//! a payload encoded ahead into a fabric's buffer to be lent; and
//! [`send_control`], for frames with no payload.

use super::Conn;
use super::frame::OutFrame;
use crate::Status;
use crate::auth::Peer;
use crate::fabric::{Fabric, Region};
use crate::protocol::{CallId, FrameKind, SendError};
use std::fmt;
use std::sync::Arc;

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
    /// Takes a unary response's trailing metadata apart from its headers,
    /// if the peer keeps them apart (the gRPC face: HTTP/2 trailers), and
    /// says so; otherwise (our frames) they go in the response's metadata.
    fn keep_trailers_apart(&self, trailers: &crate::Metadata) -> bool {
        let _ = trailers;
        false
    }
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

impl<F: Fabric> Link for Conn<F> {
    fn send(
        &self,
        frame: &OutFrame<'_>,
        cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        // A stream's producer uncorks after each of its turns.
        let cork = if cork { usize::MAX } else { 0 };
        self.send_with(frame, false, cork, fill).map(drop)
    }
    fn lend_buffer(&self, frame: &OutFrame<'_>) -> Result<Option<LendBuf>, SendError> {
        if !self.lends(frame) {
            return Ok(None);
        }
        // The checks of the send, before anything is allocated.
        frame.header(self.peer_max_message())?;
        Ok(Some(LendBuf::new(self.lend_buffer_for(frame)?)))
    }
    fn send_lent(&self, frame: &OutFrame<'_>, buf: LendBuf) -> Result<(), SendError> {
        let Some(buf) = buf.into_inner::<<F::Region as Region>::Buffer>() else {
            return Err(SendError::NoBuffer(
                "a buffer of another fabric was lent".into(),
            ));
        };
        self.send_framed(frame, |header| {
            self.lend_filled(header, frame, false, 0, buf)
        })
        .map(drop)
    }
    fn uncork(&self) {
        Conn::uncork(self)
    }
    fn peer(&self) -> &str {
        &self.remote.addr
    }
    fn max_message(&self) -> usize {
        self.max_message
    }
    fn remote(&self) -> Option<Arc<Peer>> {
        Some(self.remote.clone())
    }
    fn recycle(&self, buf: crate::payload::Payload) {
        Conn::recycle(self, buf)
    }
}
