//! Sending by rendezvous: a large payload is encoded into a buffer of the
//! fabric's and lent to the peer, which reads it and releases it; the ring
//! carries only its descriptor. [`Loans`] bounds what the peer may hold.

use super::Conn;
use super::frame::OutFrame;
use super::rendezvous::MAX_READING;
use crate::fabric::{Fabric, QueuePair, Region};
use crate::protocol::header::{FLAG_LENT, LENT_LEN, Lent};
use crate::protocol::{FrameKind, Header, SendError};
use std::collections::HashMap;

/// Bytes of large messages one connection may have lent to its peer and
/// not had released, at least (twice the largest message this side takes,
/// if more: the peer's claim does not raise it): a peer that does not release what it read (or never reads)
/// holds at most this much of this side's memory. A send past it fails
/// with `ResourceExhausted`; one message is always lent, however large.
/// An honest peer holds less while it keeps up: it reads [`MAX_READING`]
/// at a time and releases each payload once read.
pub(crate) const MIN_MAX_LENT: usize = 4 * MAX_READING;

/// The payloads a connection lent and the peer has not released.
#[derive(Default)]
pub(in crate::dispatch) struct Loans {
    /// Each loan's bytes, by its key.
    by_rkey: HashMap<u32, usize>,
    /// Their sum.
    bytes: usize,
}

impl Loans {
    /// Whether `len` more bytes may be lent by a side that takes messages
    /// of up to `max_message` bytes (see [`MIN_MAX_LENT`]).
    fn check(&self, len: usize, max_message: usize) -> Result<(), SendError> {
        let max = MIN_MAX_LENT.max(max_message.saturating_mul(2));
        if self.bytes == 0 || self.bytes.saturating_add(len) <= max {
            return Ok(());
        }
        Err(SendError::NoBuffer(format!(
            "the peer holds {} bytes of large messages it has not released; \
             {len} more would pass the {max} bytes a connection lends",
            self.bytes
        )))
    }

    fn lent(&mut self, rkey: u32, len: usize) {
        self.bytes += len;
        if let Some(old) = self.by_rkey.insert(rkey, len) {
            self.bytes -= old;
        }
    }

    pub(super) fn released(&mut self, rkey: u32) {
        if let Some(len) = self.by_rkey.remove(&rkey) {
            self.bytes -= len;
        }
    }
}

impl<F: Fabric> Conn<F> {
    /// Whether `frame`'s payload travels by rendezvous.
    pub(super) fn lends(&self, frame: &OutFrame<'_>) -> bool {
        let kind = matches!(
            frame.kind,
            FrameKind::Request | FrameKind::Response | FrameKind::Message
        );
        kind && frame.payload_len > self.lend_above
    }

    /// Sends a large message by rendezvous: its payload is encoded into a
    /// buffer from the fabric's cache and lent to the peer, and the frame
    /// in the ring carries only its descriptor. The peer reads it, then
    /// releases it ([`FrameKind::Release`]).
    pub(super) fn send_lent(
        &self,
        header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let mut buf = self.lend_buffer_for(frame)?;
        fill(&mut buf);
        self.lend_filled(header, frame, fail_fast, cork, buf)
    }

    /// A buffer from the fabric's cache for `frame`'s payload, to lend, if
    /// the peer may be lent it now (see [`MIN_MAX_LENT`]).
    pub(super) fn lend_buffer_for(
        &self,
        frame: &OutFrame<'_>,
    ) -> Result<<F::Region as Region>::Buffer, SendError> {
        // Checked again when it is lent; here so that a payload that will
        // not be lent is not encoded.
        self.send_state()
            .loans
            .check(frame.payload_len, self.max_message)?;
        self.fabric
            .buffer(frame.payload_len)
            .map_err(|e| SendError::NoBuffer(e.to_string()))
    }

    /// Lends `buf`, which holds the frame's payload, and stages the
    /// frame's descriptor of it.
    pub(super) fn lend_filled(
        &self,
        mut header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        buf: <F::Region as Region>::Buffer,
    ) -> Result<bool, SendError> {
        let remote = {
            let mut s = self.send_state();
            if let Some(why) = s.proto.death() {
                return Err(SendError::Closed(why.to_owned()));
            }
            let len = header.payload_len as usize;
            s.loans.check(len, self.max_message)?;
            let remote = match s.qp.as_mut() {
                Some(qp) => qp.lend(buf).map_err(|e| SendError::Closed(e.to_string()))?,
                None => return Err(SendError::Closed("queue pair destroyed".into())),
            };
            s.loans.lent(remote.rkey, len);
            remote
        };
        let descriptor = Lent {
            addr: remote.addr,
            len: header.payload_len,
            rkey: remote.rkey,
        }
        .encode();
        header.flags |= FLAG_LENT;
        header.payload_len = LENT_LEN as u32;
        let sent = self.stage(
            header,
            &OutFrame {
                payload_len: LENT_LEN,
                ..*frame
            },
            fail_fast,
            cork,
            &mut |b| b.copy_from_slice(&descriptor),
        );
        if sent.is_err() {
            let mut s = self.send_state();
            s.loans.released(remote.rkey);
            if let Some(qp) = s.qp.as_mut() {
                qp.unlend(remote.rkey);
            }
        }
        sent
    }
}
