//! Sending on a connection: frames staged in the peer's ring (or queued
//! while it is full), corked and batched writes, and posting them; the
//! completions of signaled writes and the fence that waits for them.

use super::frame::OutFrame;
use super::{Conn, SendState};
use crate::dispatch::{IN_TURN, LastFrame};
use crate::fabric::{Fabric, QueuePair, Region, WriteImm};
use crate::protocol::{FrameKind, HEADER_LEN, Header, Reserved, SendError, Sender};
use std::sync::OnceLock;
use std::time::Instant;

impl<F: Fabric> Conn<F> {
    /// Encodes and posts a frame, or queues it if the peer's ring is full;
    /// frames [`Conn::send_corked`] left staged go with it. `fill` writes
    /// exactly `frame.payload_len` payload bytes.
    pub(crate) fn send(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        self.send_with(frame, fail_fast, 0, fill).map(drop)
    }

    /// Like [`Conn::send`], but the write may stay staged, until it carries
    /// `batch` frames or [`Conn::uncork`] (or a full send queue): requests
    /// that callers issue back to back then leave in one post, one vectored
    /// write on tcp://. Returns whether this write corked the connection:
    /// then hand it to [`Endpoint::corked`], so that it leaves even if
    /// nobody uncorks it.
    pub(crate) fn send_corked(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        batch: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_with(frame, fail_fast, batch, fill)
    }

    /// Posts the writes [`Conn::send_corked`] left staged.
    pub(crate) fn uncork(&self) {
        let mut s = self.send_state();
        if s.proto.uncork() {
            self.post_if_due(&mut s);
        }
    }

    /// Whether writes wait for [`Conn::uncork`].
    pub(crate) fn is_corked(&self) -> bool {
        self.send_state().proto.is_corked()
    }

    pub(super) fn send_with(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_framed(frame, |header| {
            if self.lends(frame) {
                self.send_lent(header, frame, fail_fast, cork, fill)
            } else {
                self.stage(header, frame, fail_fast, cork, fill)
            }
        })
    }

    /// Checks `frame` against the peer's limit, sends it with `send`
    /// given its header, and counts its bytes if it went.
    pub(super) fn send_framed(
        &self,
        frame: &OutFrame<'_>,
        send: impl FnOnce(Header) -> Result<bool, SendError>,
    ) -> Result<bool, SendError> {
        let header = frame.header(self.peer_max_message())?;
        let body = header.metadata_len as usize + frame.payload_len;
        let sent = send(header);
        if sent.is_ok() {
            crate::observe::bytes(self.side, true, HEADER_LEN + body);
        }
        sent
    }

    /// Stages a frame with `header` in the peer's ring (or queues it).
    pub(super) fn stage(
        &self,
        header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let md_len = header.metadata_len as usize;
        let len = HEADER_LEN + md_len + header.payload_len as usize;
        let mut write = |buf: &mut [u8], ack: u32| {
            let mut h = header;
            h.ack = ack;
            h.encode((&mut buf[..HEADER_LEN]).try_into().expect("header slice"));
            if let Some(md) = frame.metadata {
                md.encode(&mut buf[HEADER_LEN..HEADER_LEN + md_len]);
            }
            fill(&mut buf[HEADER_LEN + md_len..]);
        };
        let mut s = self.send_state();
        let reserved = s.proto.reserve(len, fail_fast);
        match reserved {
            Ok(Reserved::Ring {
                offset,
                staged,
                ack,
            }) => {
                s.staging.write(staged, len, |buf| write(buf, ack));
                let corked = s.proto.sent(offset, staged, len, cork);
                let held = IN_TURN.get() && !LastFrame::take_post_first(self.qp_num);
                self.post_unless_held(&mut s, held);
                Ok(corked && s.proto.is_corked())
            }
            Err(e) => {
                // A full staging area may have asked for a signaled write.
                self.post_if_due(&mut s);
                drop(s);
                if crate::protocol::connection::is_bodiless(len) && matches!(e, SendError::Full(_))
                {
                    // Not even a grant or a cancel fits in the slack: the
                    // peer returns no credits, and losing the frame would
                    // stall or leak a stream. The connection fails.
                    self.set_failure(format!(
                        "the peer returned no ring credits while {} bytes of control frames \
                         waited for room",
                        crate::protocol::connection::CONTROL_SLACK
                    ));
                }
                Err(e)
            }
            Ok(Reserved::Queue) => {
                crate::observe::backpressure();
                let mut bytes = vec![0u8; len];
                write(&mut bytes, 0);
                // A request's timeout counts down while it waits here (one
                // too long for the wire stays none).
                let expires = (frame.kind == FrameKind::Request)
                    .then(|| crate::protocol::field_timeout(frame.timeout_us))
                    .flatten()
                    .map(|t| clock_us() + t.as_micros() as u64);
                s.proto.queue_until(bytes, expires);
                self.post_if_due(&mut s);
                Ok(false)
            }
        }
    }

    /// Posts what the sender handed out, unless it is held (corked, or
    /// batched by the dispatcher turn running on this thread).
    fn post_if_due(&self, s: &mut SendState<F>) {
        self.post_unless_held(s, IN_TURN.get());
    }

    /// [`Conn::post_if_due`], with `in_batch_turn` saying whether the
    /// dispatcher's turn holds writes now.
    fn post_unless_held(&self, s: &mut SendState<F>, in_batch_turn: bool) {
        if s.proto.should_post(in_batch_turn) {
            self.post_transmits(s);
        }
    }

    /// Posts the writes the sender handed out, in order, as one batch.
    /// Marks the connection failed on error.
    pub(super) fn post_transmits(&self, s: &mut SendState<F>) {
        let SendState {
            qp, staging, proto, ..
        } = s;
        let transmits = proto.transmits();
        if transmits.is_empty() {
            proto.on_posted(Ok(()));
            return;
        }
        let peer = self.peer;
        // A silent heartbeat is another kind of work request. It is only
        // ever handed out last, and posted at once (`heartbeat_tick`): it
        // goes alone, after the batch of the writes before it.
        let (batch, probe) = match transmits.split_last() {
            Some((last, before)) if last.silent => (before, Some(last)),
            _ => (transmits, None),
        };
        debug_assert!(batch.iter().all(|t| !t.silent), "a silent write is last");
        let client = self.side == crate::observe::Side::Client;
        crate::stages::mark(if client {
            crate::stages::Stage::RequestPost
        } else {
            crate::stages::Stage::ResponsePost
        });
        let result = match qp.as_mut() {
            // An empty batch (a heartbeat alone) posts nothing.
            Some(qp) => qp
                .post_write_imm_batch(batch.len(), |i| {
                    let t = &batch[i];
                    WriteImm {
                        wr_id: t.wr_id,
                        local: t.local.map(|(off, len)| (&*staging, off, len)),
                        remote_addr: peer.addr + t.remote as u64,
                        rkey: peer.rkey,
                        imm: t.imm,
                        signaled: t.signaled,
                    }
                })
                .and_then(|()| {
                    probe.map_or(Ok(()), |t| {
                        qp.post_probe(t.wr_id, peer.addr, peer.rkey, t.signaled)
                    })
                })
                .map_err(|e| e.to_string()),
            None => Err("queue pair destroyed".to_owned()),
        };
        crate::stages::mark(if client {
            crate::stages::Stage::RequestPosted
        } else {
            crate::stages::Stage::ResponsePosted
        });
        if let Err(why) = &result {
            self.set_failure(why.clone());
        }
        proto.on_posted(result);
    }

    /// Moves queued frames into the peer's ring while there is room, and
    /// posts them unless writes are held.
    pub(super) fn flush(&self, s: &mut SendState<F>) {
        tell_time(&mut s.proto);
        s.proto.flush(copy_into(&s.staging));
        self.post_if_due(s);
    }

    /// The poller starts handling a batch of completions for this connection:
    /// writes are staged until [`Conn::after_batch`].
    pub(in crate::dispatch) fn begin_batch(&self) {
        self.send_state().proto.begin_batch();
    }

    /// A signaled write completed. `Err` is a protocol violation: no such
    /// write was posted.
    pub(in crate::dispatch) fn on_send_completion(&self, wr_id: u64) -> Result<(), String> {
        let mut s = self.send_state();
        s.proto.on_completion(wr_id)?;
        self.flush(&mut s);
        Ok(())
    }

    /// After a batch of frames: return credits if needed, flush the backlog,
    /// and post everything staged meanwhile.
    pub(in crate::dispatch) fn after_batch(&self) {
        let mut s = self.send_state();
        let SendState { staging, proto, .. } = &mut *s;
        tell_time(proto);
        proto.end_batch(copy_into(staging));
        self.post_if_due(&mut s);
    }

    /// Posts a signaled credit doorbell and returns its work request id, or
    /// `None` if it cannot be posted now (send queue full) or the connection
    /// is dead. Once that write completes, every write posted before it has
    /// executed: a reliable connection completes writes in order.
    pub(crate) fn post_fence(&self) -> Option<u64> {
        let mut s = self.send_state();
        let wr_id = s.proto.fence()?;
        // Held by a batch under way on this thread? Post it now anyway.
        self.post_transmits(&mut s);
        Some(wr_id)
    }

    /// Whether the write `wr_id` (and so every one before it) completed, or
    /// the connection died: either way nothing is left to wait for.
    pub(crate) fn completed_through(&self, wr_id: u64) -> bool {
        self.send_state().proto.completed_through(wr_id)
    }

    /// Whether frames wait to be posted: queued for the peer's ring, or
    /// staged until the batch being handled ends.
    pub(crate) fn has_unsent(&self) -> bool {
        self.send_state().proto.has_unsent()
    }
}

/// Microseconds on the clock queued frames' deadlines are kept on.
fn clock_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Gives the sender the time, if a queued frame's timeout needs it.
fn tell_time(proto: &mut Sender) {
    if proto.has_timed_backlog() {
        proto.set_clock(clock_us());
    }
}

/// Copies a queued frame the sender places at `offset` of the staging area there.
fn copy_into<R: Region>(staging: &R) -> impl FnMut(usize, &[u8]) + '_ {
    move |offset, frame| staging.write(offset, frame.len(), |buf| buf.copy_from_slice(frame))
}
