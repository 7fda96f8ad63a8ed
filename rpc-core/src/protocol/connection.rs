//! One connection's protocol state: what to write where, when credits are
//! owed, what waits for room. No I/O, no locks, no clock.
//!
//! A connection is a [`Sender`] (the peer's ring as seen from here, the
//! credits owed for ours, the frames queued for room, the send queue's
//! accounting and the writes ready to post) and a [`Receiver`] (our ring).
//! The I/O layer drives them with what the fabric reports and posts what
//! they ask for:
//!
//! ```text
//!  send a frame     Sender::reserve(len) -> Ring { offset, staged, ack } | Queue
//!                   encode at `staged` of the staging area,
//!                   Sender::sent(offset, staged, len, cork)  or  Sender::queue(bytes);
//!                   either way, then post if due (a full staging area
//!                   asks for a signaled write, see below)
//!  post             if Sender::should_post(): post Sender::transmits(),
//!                   then Sender::on_posted(result)
//!  frame doorbell   Receiver::on_frame(offset_units, byte_len, ..) -> Arrived
//!                   copy the frame out, then Sender::on_consumed + on_ack
//!  credit doorbell  Sender::on_ack(ack), then Sender::flush(..)
//!  send completion  Sender::on_completion(wr_id), then Sender::flush(..)
//!  end of a batch   Sender::end_batch(..): flush, and a credit if one is due
//! ```
//!
//! The two halves are separate so that the I/O layer can lock them
//! separately: a caller sending a request never waits for the dispatcher
//! copying a frame out of the receive ring.

use std::collections::VecDeque;

use super::credits::apply_ack;
use super::{
    ALIGN, CreditError, CreditReturn, Doorbell, HEADER_LEN, Header, RecvRing, RingError, SendRing,
    Staging, align_up,
};

/// Every this many writes, one is signaled, so that the send queue's
/// accounting advances even when nothing asks for a completion.
pub const SIGNAL_EVERY: u64 = 16;

/// Writes held (corked or batched) before they are posted anyway.
pub const MAX_HELD: usize = 64;

/// A write to post: frames (bytes of the staging area, written to the
/// peer's ring), a zero-length credit doorbell, or a silent heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// `(offset, len)` in the staging area; `None` for a zero-length write.
    pub local: Option<(usize, usize)>,
    /// Offset in the peer's ring the bytes go to (0 for a zero-length write).
    pub remote: usize,
    /// The doorbell immediate.
    pub imm: u32,
    /// Work request id: the write's sequence number on this connection.
    pub wr_id: u64,
    /// Whether its completion is reported.
    pub signaled: bool,
    /// A silent heartbeat: a zero-length write *without* an immediate
    /// (`imm` is not sent), which the peer's transport acknowledges and
    /// its process never sees (see [`Sender::heartbeat_tick`]).
    pub silent: bool,
}

/// Why a frame could not be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendError {
    /// The connection is gone.
    Closed(String),
    /// The frame can never fit (larger than the peer accepts).
    TooLarge {
        /// Bytes after the header.
        len: usize,
        /// Most bytes after the header the peer accepts.
        max: usize,
    },
    /// Ring full and the caller asked not to wait, or the backlog is full.
    Full(&'static str),
    /// Metadata larger than a frame can carry.
    Metadata(usize),
    /// No buffer for a large message could be had (the fabric says why).
    NoBuffer(String),
}

/// Where a frame goes, from [`Sender::reserve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// Encode it at `staged` of the staging area with this `ack` in its
    /// header, then call [`Sender::sent`].
    Ring {
        /// Offset in the peer's ring.
        offset: usize,
        /// Offset in the staging area.
        staged: usize,
        /// The credit return to stamp in its header.
        ack: u32,
    },
    /// No room now: encode it (any ack) and hand it to [`Sender::queue_until`].
    Queue,
}

/// Bytes of bodiless frames (window grants, cancels, half-closes,
/// releases) a sender queues beyond its bound rather than drop them.
pub const CONTROL_SLACK: usize = 1 << 20;

/// Whether a frame of `len` bytes, header included, is bodiless: one that
/// may use [`CONTROL_SLACK`].
pub fn is_bodiless(len: usize) -> bool {
    len <= HEADER_LEN
}

/// The sending half of a connection.
#[derive(Debug, Clone)]
pub struct Sender {
    ring: SendRing,
    staging: Staging,
    /// Staged bytes handed out since the last signaled write: a write is
    /// signaled once they reach a quarter of the staging area, so that
    /// completions keep freeing it.
    unsignaled_staged: usize,
    credits: CreditReturn,
    /// Frames waiting for ring space, each with when its timeout runs out
    /// (µs on the I/O layer's clock), if it carries one.
    backlog: VecDeque<(Vec<u8>, Option<u64>)>,
    backlog_bytes: usize,
    /// Queued frames that carry a timeout.
    timed: usize,
    /// The I/O layer's clock, as of [`Sender::set_clock`].
    now_us: u64,
    max_backlog: usize,
    /// Writes handed out, and the last one known complete.
    posted: u64,
    completed: u64,
    sq_depth: u64,
    dead: Option<String>,
    /// The dispatcher is handling a batch of completions for this
    /// connection: writes it causes are held until [`Sender::end_batch`].
    batching: bool,
    /// A caller's frame is held, to leave with the frames other callers
    /// send meanwhile.
    corked: bool,
    /// Frames handed out since the last post (corked or not): a corked
    /// write leaves once it carries the batch its sender asked for.
    held_frames: usize,
    transmits: Vec<Transmit>,
    /// `posted` at the last heartbeat tick, and how many ticks in a row
    /// found it unchanged (see [`Sender::heartbeat_tick`]).
    heartbeat_seen: u64,
    quiet_ticks: u32,
}

impl Sender {
    /// A sender into a peer ring of `peer_ring` bytes (staging its frames
    /// in [`staging_size`](super::staging_size)`(peer_ring)` bytes),
    /// returning credits for a local ring of `local_ring` bytes, with
    /// `sq_depth` writes in flight at most and `max_backlog` bytes queued
    /// at most.
    pub fn new(
        peer_ring: usize,
        local_ring: usize,
        sq_depth: u64,
        max_backlog: usize,
    ) -> Result<Sender, RingError> {
        Ok(Sender::with_rings(
            SendRing::new(peer_ring)?,
            Staging::for_peer_ring(peer_ring)?,
            CreditReturn::new(local_ring),
            sq_depth,
            max_backlog,
        ))
    }

    fn with_rings(
        ring: SendRing,
        staging: Staging,
        credits: CreditReturn,
        sq_depth: u64,
        max_backlog: usize,
    ) -> Sender {
        Sender {
            ring,
            staging,
            unsignaled_staged: 0,
            credits,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            timed: 0,
            now_us: 0,
            max_backlog,
            posted: 0,
            completed: 0,
            sq_depth,
            dead: None,
            batching: false,
            corked: false,
            held_frames: 0,
            transmits: Vec::with_capacity(MAX_HELD),
            heartbeat_seen: 0,
            quiet_ticks: 0,
        }
    }

    /// Both rings empty at cumulative position `pos` (ALIGN-aligned), to
    /// exercise large positions without the traffic.
    #[cfg(test)]
    pub(crate) fn at_position(
        peer_ring: usize,
        local_ring: usize,
        pos: u64,
        sq_depth: u64,
        max_backlog: usize,
    ) -> Sender {
        let mut credits = CreditReturn::new(local_ring);
        credits.on_consumed(pos);
        let _ = credits.take_ack();
        Sender::with_rings(
            SendRing::at_position(peer_ring, pos),
            Staging::for_peer_ring(peer_ring).expect("valid ring"),
            credits,
            sq_depth,
            max_backlog,
        )
    }

    /// The peer's ring as seen from here.
    #[cfg(test)]
    pub(crate) fn ring(&self) -> &SendRing {
        &self.ring
    }

    /// The credits owed for the local ring.
    #[cfg(test)]
    pub(crate) fn credits(&self) -> &CreditReturn {
        &self.credits
    }

    /// Frames queued for room.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.backlog.len()
    }

    /// Why the connection died, if it did.
    pub fn death(&self) -> Option<&str> {
        self.dead.as_deref()
    }

    /// Room in the send queue for one more write (keeps one for a credit).
    fn sq_room(&self) -> bool {
        self.posted - self.completed + 2 < self.sq_depth
    }

    /// First step of sending a frame of `len` bytes, header included.
    pub fn reserve(&mut self, len: usize, fail_fast: bool) -> Result<Reserved, SendError> {
        if let Some(why) = &self.dead {
            return Err(SendError::Closed(why.clone()));
        }
        if len > self.ring.max_frame() {
            return Err(SendError::TooLarge {
                len: len.saturating_sub(HEADER_LEN),
                max: self.ring.max_frame().saturating_sub(HEADER_LEN),
            });
        }
        if self.backlog.is_empty() && self.sq_room() {
            if !self.staging.fits(len) {
                self.signal_staged();
            } else if let Ok(Some(slot)) = self.ring.reserve(len) {
                let staged = self.staging.reserve(len).expect("checked it fits");
                return Ok(Reserved::Ring {
                    offset: slot.offset,
                    staged,
                    ack: self.credits.take_ack(),
                });
            }
        }
        if fail_fast {
            return Err(SendError::Full(
                "the peer's receive ring is full (fail-fast call)",
            ));
        }
        if self.backlog_bytes + len > self.max_backlog {
            // A frame without a body (a window grant, a cancel, a
            // half-close, a release) is never dropped for a full queue: a
            // lost one stalls or leaks a stream for good. It may go over
            // the bound by CONTROL_SLACK; a peer that leaves even that
            // queued returns no credits at all (the connection then fails).
            if is_bodiless(len) && self.backlog_bytes + len <= self.max_backlog + CONTROL_SLACK {
                return Ok(Reserved::Queue);
            }
            return Err(SendError::Full(
                "too many bytes queued for the peer's full receive ring",
            ));
        }
        Ok(Reserved::Queue)
    }

    /// The frame [`Sender::reserve`] placed at `offset` of the peer's ring
    /// and `staged` of the staging area is written there. Its write is held
    /// (see [`Sender::should_post`]) for frames that follow until it carries
    /// `cork` frames (those held since the last post, this one included);
    /// then, or with `cork` 0 or 1, it leaves with the held ones. Returns
    /// whether this frame corked the connection.
    pub fn sent(&mut self, offset: usize, staged: usize, len: usize, cork: usize) -> bool {
        let was_corked = self.corked;
        self.held_frames += 1;
        self.corked = self.held_frames < cork;
        self.push_frame(offset, staged, len);
        self.corked && !was_corked
    }

    /// The staging area is too full for the next frame: makes sure a
    /// signaled write covers every staged byte, so that its completion
    /// frees them (unsignaled writes report nothing).
    fn signal_staged(&mut self) {
        if self.unsignaled_staged == 0 {
            return;
        }
        if let Some(last) = self.transmits.last_mut() {
            // Not posted yet, and after every staged write: signal it.
            last.signaled = true;
            self.unsignaled_staged = 0;
        } else if self.dead.is_none() && self.sq_room() {
            self.push_credit(true);
        }
    }

    /// Queues a frame [`Sender::reserve`] had no room for, encoded whole.
    /// A frame whose header's timeout runs out at `expires` (µs on the I/O
    /// layer's clock) has it rewritten when it leaves to what remains then,
    /// so the peer does not count the time it waited here as its own.
    pub fn queue_until(&mut self, frame: Vec<u8>, expires: Option<u64>) {
        self.backlog_bytes += frame.len();
        self.timed += usize::from(expires.is_some());
        self.backlog.push_back((frame, expires));
    }

    /// Whether queued frames carry timeouts: then the I/O layer tells the
    /// time ([`Sender::set_clock`]) before flushing.
    pub fn has_timed_backlog(&self) -> bool {
        self.timed > 0
    }

    /// The time now on the clock `queue_until` was given deadlines on.
    pub fn set_clock(&mut self, now_us: u64) {
        self.now_us = now_us;
    }

    /// Hands out the write of a frame: appended to the write before it
    /// when that one is not posted yet and ends where this frame starts,
    /// in the staging area and in the peer's ring, so that frames sent
    /// together travel as one write with one doorbell (the receiver walks
    /// the frames the write's length covers).
    fn push_frame(&mut self, offset: usize, staged: usize, len: usize) {
        let appended = match self.transmits.last_mut() {
            Some(Transmit {
                local: Some((first, total)),
                remote,
                ..
            }) if *first + align_up(*total) == staged && *remote + align_up(*total) == offset => {
                *total = staged + len - *first;
                true
            }
            _ => false,
        };
        if !appended {
            let imm = Doorbell::Frame {
                offset_units: (offset / ALIGN) as u32,
            }
            .encode();
            self.push(Some((staged, len)), offset, imm, false);
        }
        let last = self.transmits.last_mut().expect("just pushed or extended");
        self.staging.hold(last.wr_id, self.ring.head());
        if !last.signaled {
            self.unsignaled_staged += align_up(len);
            if self.unsignaled_staged >= self.staging.capacity() / 4 {
                last.signaled = true;
                self.unsignaled_staged = 0;
            }
        }
    }

    fn push(
        &mut self,
        local: Option<(usize, usize)>,
        remote: usize,
        imm: u32,
        signal: bool,
    ) -> u64 {
        self.posted += 1;
        let wr_id = self.posted;
        let signaled = signal || wr_id % SIGNAL_EVERY == 0;
        if signaled {
            // It completes after every write before it.
            self.unsignaled_staged = 0;
        }
        self.transmits.push(Transmit {
            local,
            remote,
            imm,
            wr_id,
            signaled,
            silent: false,
        });
        wr_id
    }

    fn push_credit(&mut self, signal: bool) -> u64 {
        let ack = self.credits.take_ack();
        self.push(None, 0, Doorbell::Credit { ack }.encode(), signal)
    }

    /// Whether the writes handed out should be posted now: they are not
    /// held (corked, or batched by the dispatcher when `in_batch_turn`, the
    /// caller being the dispatcher handling this connection's batch), or
    /// too many are.
    pub fn should_post(&self, in_batch_turn: bool) -> bool {
        !self.transmits.is_empty()
            && (!(self.corked || (self.batching && in_batch_turn))
                || self.transmits.len() >= MAX_HELD)
    }

    /// The writes to post, in order.
    pub fn transmits(&self) -> &[Transmit] {
        &self.transmits
    }

    /// The writes of [`Sender::transmits`] were posted, or failed to be
    /// (the connection is then dead).
    pub fn on_posted(&mut self, result: Result<(), String>) {
        self.corked = false;
        self.held_frames = 0;
        self.transmits.clear();
        if let Err(why) = result {
            self.dead.get_or_insert(why);
        }
    }

    /// Whether a caller's frame is held for the frames that follow.
    pub fn is_corked(&self) -> bool {
        self.corked
    }

    /// Ends a cork: the held writes are to be posted. Returns whether it was corked.
    pub fn uncork(&mut self) -> bool {
        std::mem::replace(&mut self.corked, false)
    }

    /// The peer returned credits (`ack` from a header or a credit doorbell).
    pub fn on_ack(&mut self, ack: u32) -> Result<(), CreditError> {
        apply_ack(&mut self.ring, ack)?;
        self.staging.released(self.ring.tail());
        Ok(())
    }

    /// Our ring was consumed up to the cumulative position `consumed`: the
    /// next write carries the credit.
    pub fn on_consumed(&mut self, consumed: u64) {
        self.credits.on_consumed(consumed);
    }

    /// The signaled write `wr_id` completed, and so every write before it:
    /// their staged bytes are free. `Err` if no such write was posted (a
    /// fabric that reports what a peer claims could be told anything).
    pub fn on_completion(&mut self, wr_id: u64) -> Result<(), String> {
        if wr_id > self.posted {
            return Err(format!(
                "completion of write {wr_id}, but only {} were posted",
                self.posted
            ));
        }
        self.completed = self.completed.max(wr_id);
        self.staging.complete(self.completed);
        Ok(())
    }

    /// Moves queued frames into the peer's ring while it, the staging area
    /// and the send queue have room: `write(staged, frame)` copies each (its
    /// ack already stamped) into the staging area at `staged`.
    pub fn flush(&mut self, mut write: impl FnMut(usize, &[u8])) {
        while self.dead.is_none() && self.sq_room() {
            let Some(len) = self.backlog.front().map(|(f, _)| f.len()) else {
                break;
            };
            if !self.staging.fits(len) {
                self.signal_staged();
                break;
            }
            let Ok(Some(slot)) = self.ring.reserve(len) else {
                break;
            };
            let staged = self.staging.reserve(len).expect("checked it fits");
            let (mut frame, expires) = self.backlog.pop_front().expect("front exists");
            self.backlog_bytes -= len;
            if let Some(expires) = expires {
                self.timed -= 1;
                // At least 1 µs: 0 would mean no timeout at all.
                let left = expires
                    .saturating_sub(self.now_us)
                    .clamp(1, u64::from(u32::MAX));
                Header::set_timeout(&mut frame, left as u32);
            }
            Header::set_ack(&mut frame, self.credits.take_ack());
            write(staged, &frame);
            self.push_frame(slot.offset, staged, len);
        }
    }

    /// The dispatcher starts handling a batch of completions for this
    /// connection: the writes it causes are held until [`Sender::end_batch`].
    pub fn begin_batch(&mut self) {
        self.batching = true;
    }

    /// After a batch: flush the queue (see [`Sender::flush`]) and owe a
    /// credit doorbell if credits are due. The writes are then to be posted.
    pub fn end_batch(&mut self, write: impl FnMut(usize, &[u8])) {
        self.flush(write);
        // A quarter of the ring unreported, or few bytes that still block a
        // sender whose next frame must wrap: either way, nothing may be
        // flowing back to carry the ack, so send it alone.
        if self.dead.is_none() && (self.credits.needs_explicit() || self.credits.may_stall_sender())
        {
            self.push_credit(false);
        }
        self.batching = false;
        if self.dead.is_some() {
            self.transmits.clear();
        }
    }

    /// Hands out a signaled credit doorbell and returns its work request id,
    /// or `None` if the send queue has no room or the connection is dead.
    /// Once it completes, every write before it has executed (a reliable
    /// connection completes writes in order).
    pub fn fence(&mut self) -> Option<u64> {
        if self.dead.is_some() || !self.sq_room() {
            return None;
        }
        Some(self.push_credit(true))
    }

    /// The heartbeat, called every half heartbeat interval: when nothing
    /// was handed out for two ticks in a row (between one and one and a
    /// half intervals), hands out a heartbeat and returns its work request
    /// id: a signaled credit doorbell, or if `silent`, an unsignaled
    /// zero-length write without an immediate (which the peer's process
    /// never sees, and which reports itself only if it fails). The peer's
    /// transport must acknowledge either (an RC ack, a TCP ack), so a peer
    /// host that vanished is noticed on an idle connection, or one that
    /// only waits for responses, within the transport's retry budget; a
    /// live but busy peer process is never taken for dead, since its kernel
    /// or NIC acknowledges for it.
    pub fn heartbeat_tick(&mut self, silent: bool) -> Option<u64> {
        if self.posted != self.heartbeat_seen {
            self.heartbeat_seen = self.posted;
            self.quiet_ticks = 0;
            return None;
        }
        self.quiet_ticks += 1;
        if self.quiet_ticks < 2 || self.dead.is_some() || !self.sq_room() {
            return None;
        }
        let wr_id = if silent {
            // No ack taken: the peer sees nothing of it.
            let wr_id = self.push(None, 0, 0, false);
            self.transmits.last_mut().expect("just pushed").silent = true;
            wr_id
        } else {
            self.push_credit(true)
        };
        self.heartbeat_seen = self.posted;
        self.quiet_ticks = 0;
        Some(wr_id)
    }

    /// Whether the write `wr_id` (and so every one before it) completed, or
    /// the connection died: either way nothing is left to wait for.
    pub fn completed_through(&self, wr_id: u64) -> bool {
        self.dead.is_some() || self.completed >= wr_id
    }

    /// Whether frames wait: queued for room, or handed out and not posted.
    pub fn has_unsent(&self) -> bool {
        self.backlog_bytes > 0 || !self.transmits.is_empty()
    }

    /// The connection is dead: nothing more is sent, queued frames are dropped.
    pub fn kill(&mut self, why: &str) {
        if self.dead.is_none() {
            self.dead = Some(why.to_owned());
        }
        self.backlog.clear();
        self.backlog_bytes = 0;
        self.timed = 0;
        self.transmits.clear();
        self.batching = false;
        self.corked = false;
    }
}

/// A frame that arrived, from [`Receiver::on_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrived {
    /// Its header, checked against the ring and the message limit.
    pub header: Header,
    /// Offset of the header in the ring; metadata and payload follow it.
    pub offset: usize,
    /// The ring's cumulative consumed position once this frame is released:
    /// give it to [`Sender::on_consumed`] after copying the frame out (the
    /// peer may overwrite it as soon as the credit goes back).
    pub consumed: u64,
    /// The write carries more frames after this one: the next one's offset
    /// (in ALIGN units) and the bytes of the write from there, to hand to
    /// [`Receiver::on_frame`] in turn.
    pub next: Option<(u32, u32)>,
}

/// The receiving half of a connection.
#[derive(Debug, Clone)]
pub struct Receiver {
    ring: RecvRing,
}

impl Receiver {
    /// A receiver for a local ring of `capacity` bytes.
    pub fn new(capacity: usize) -> Result<Receiver, RingError> {
        Ok(Receiver {
            ring: RecvRing::new(capacity)?,
        })
    }

    /// An empty ring at cumulative position `pos` (see [`Sender::at_position`]).
    #[cfg(test)]
    pub(crate) fn at_position(capacity: usize, pos: u64) -> Receiver {
        Receiver {
            ring: RecvRing::at_position(capacity, pos),
        }
    }

    /// The ring's cumulative consumed position.
    #[cfg(test)]
    pub(crate) fn consumed(&self) -> u64 {
        self.ring.consumed()
    }

    /// A frame doorbell at `offset_units` for a write of `byte_len` bytes
    /// (0 where the fabric does not report it): `read_header(offset)` reads
    /// the header bytes there. Checks the header against the ring and
    /// `max_message` (bytes after the header), and releases the frame's
    /// ring space. `Err` is a protocol violation: close the connection.
    ///
    /// One write may carry several frames back to back (each at the aligned
    /// end of the one before): then [`Arrived::next`] says where the next
    /// one starts and what is left of the write.
    pub fn on_frame(
        &mut self,
        offset_units: u32,
        byte_len: u32,
        max_message: usize,
        read_header: impl FnOnce(usize) -> [u8; HEADER_LEN],
    ) -> Result<Arrived, String> {
        let slot = self.ring.locate(offset_units).map_err(|e| e.to_string())?;
        let room = self.ring.room_at(slot);
        if room < HEADER_LEN {
            return Err(format!(
                "frame at offset {} has no room for a header",
                slot.offset
            ));
        }
        let header = Header::decode(&read_header(slot.offset))
            .map_err(|e| format!("bad frame header: {e}"))?;
        let len = header.frame_len();
        let body = len - HEADER_LEN;
        if body > max_message {
            return Err(format!(
                "frame body of {body} bytes exceeds the limit of {max_message}"
            ));
        }
        if len > room {
            return Err(format!(
                "frame of {len} bytes at offset {} runs past the ring",
                slot.offset
            ));
        }
        let write = byte_len as usize;
        let next = if write == 0 || write <= align_up(len) {
            None
        } else {
            let end = slot.offset + align_up(len);
            let rest = write - align_up(len);
            if rest < HEADER_LEN || end + rest > self.ring.capacity() {
                return Err(format!(
                    "write of {byte_len} bytes does not end on a frame (frame of {len} bytes at offset {})",
                    slot.offset
                ));
            }
            // Both fit in 30 bits: the ring is at most 2^30 units.
            Some(((end / ALIGN) as u32, rest as u32))
        };
        if write != 0 && write < len {
            return Err(format!(
                "write of {byte_len} bytes carries a frame of {len}"
            ));
        }
        self.ring.consume(slot, len).map_err(|e| e.to_string())?;
        Ok(Arrived {
            header,
            offset: slot.offset,
            consumed: self.ring.consumed(),
            next,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{CallId, FrameKind};

    fn frame(len: usize, ack: u32) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        let header = Header {
            flags: 0,
            kind: FrameKind::Request,
            status: 0,
            method_id: 1,
            call_id: CallId(7),
            payload_len: (len - HEADER_LEN) as u32,
            metadata_len: 0,
            timeout_us: 0,
            ack,
        };
        header.encode((&mut bytes[..HEADER_LEN]).try_into().unwrap());
        bytes
    }

    #[test]
    fn a_full_queue_still_takes_bodiless_frames_up_to_the_slack() {
        let mut s = Sender::new(4096, 4096, 128, 4096).unwrap();
        // Fill the ring, then the queue up to its bound.
        while let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(2048, false) {
            s.sent(offset, staged, 2048, 0);
        }
        s.queue_until(frame(2048, 0), None);
        assert_eq!(s.reserve(2048, false), Ok(Reserved::Queue));
        s.queue_until(frame(2048, 0), None);
        assert!(matches!(
            s.reserve(HEADER_LEN + 64, false),
            Err(SendError::Full(_))
        ));
        // A grant or a cancel is queued all the same, up to the slack.
        let mut control = 0;
        while s.reserve(HEADER_LEN, false) == Ok(Reserved::Queue) {
            s.queue_until(frame(HEADER_LEN, 0), None);
            control += HEADER_LEN;
        }
        assert_eq!(control, CONTROL_SLACK);
        assert!(matches!(
            s.reserve(HEADER_LEN, false),
            Err(SendError::Full(_))
        ));
    }

    #[test]
    fn a_full_ring_queues_and_a_credit_flushes() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        let Ok(Reserved::Ring { offset: 0, .. }) = s.reserve(2048, false) else {
            panic!("first frame fits");
        };
        assert!(!s.sent(0, 0, 2048, 0));
        assert!(s.should_post(false));
        assert!(s.transmits()[0].signaled, "half the staging area");
        s.on_posted(Ok(()));
        // Executed: its staging bytes are free, its ring bytes are not.
        s.on_completion(1).unwrap();
        let Ok(Reserved::Ring {
            offset: 2048,
            staged: 0,
            ..
        }) = s.reserve(2048, false)
        else {
            panic!("second frame fits");
        };
        s.sent(2048, 0, 2048, 0);
        s.on_posted(Ok(()));
        s.on_completion(2).unwrap();
        assert_eq!(
            s.reserve(2048, true),
            Err(SendError::Full(
                "the peer's receive ring is full (fail-fast call)"
            ))
        );
        assert_eq!(s.reserve(2048, false), Ok(Reserved::Queue));
        s.queue_until(frame(2048, 0), None);
        assert!(s.has_unsent());
        // The peer consumed the first frame.
        s.on_ack(crate::protocol::credits::ack_for(2048)).unwrap();
        let mut written = Vec::new();
        s.flush(|offset, bytes| written.push((offset, bytes.len())));
        assert_eq!(written, vec![(0, 2048)]);
        assert_eq!(s.transmits().len(), 1);
        assert_eq!(s.transmits()[0].local, Some((0, 2048)));
        assert_eq!(s.transmits()[0].remote, 0);
        assert!(!s.has_unsent() || !s.transmits().is_empty());
    }

    #[test]
    fn a_full_staging_area_signals_and_a_completion_flushes() {
        // A peer ring of 8 KiB: 4 KiB of staging, a signal every 1 KiB.
        let mut s = Sender::new(8192, 4096, 128, 1 << 20).unwrap();
        let mut signaled = Vec::new();
        for i in 0..5 {
            let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(640, false) else {
                panic!("frame {i} fits");
            };
            assert_eq!((offset, staged), (i * 640, i * 640));
            s.sent(offset, staged, 640, 0);
            signaled.push(s.transmits()[0].signaled);
            s.on_posted(Ok(()));
        }
        assert_eq!(signaled, [false, true, false, true, false]);
        // The peer's ring has room; the staging area has 896 bytes left at
        // its end and nothing at its start until a write completes. The last
        // write was not signaled: a signaled credit doorbell follows it.
        assert_eq!(s.reserve(1000, false), Ok(Reserved::Queue));
        let [credit] = s.transmits() else {
            panic!("{:?}", s.transmits());
        };
        assert!(credit.signaled && credit.local.is_none());
        assert_eq!(credit.wr_id, 6);
        s.on_posted(Ok(()));
        s.queue_until(frame(1000, 0), None);
        let mut written = Vec::new();
        s.flush(|staged, bytes| written.push((staged, bytes.len())));
        assert!(written.is_empty(), "nothing completed yet");
        s.on_completion(2).unwrap();
        s.flush(|staged, bytes| written.push((staged, bytes.len())));
        assert_eq!(written, [(0, 1000)]);
        let [t] = s.transmits() else {
            panic!("{:?}", s.transmits());
        };
        assert_eq!((t.local, t.remote), (Some((0, 1000)), 5 * 640));
    }

    #[test]
    fn a_queued_request_leaves_with_the_timeout_that_remains() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        for _ in 0..2 {
            let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(2048, false) else {
                panic!("fits");
            };
            s.sent(offset, staged, 2048, 0);
            let wr = s.transmits()[0].wr_id;
            s.on_posted(Ok(()));
            s.on_completion(wr).unwrap();
        }
        assert_eq!(s.reserve(64, false), Ok(Reserved::Queue));
        // Queued at t = 1000 µs with a 500 µs timeout; an untimed one behind it.
        s.queue_until(frame(64, 0), Some(1500));
        s.queue_until(frame(64, 0), None);
        assert!(s.has_timed_backlog());
        s.on_ack(crate::protocol::credits::ack_for(2048)).unwrap();
        s.set_clock(1200);
        let mut timeouts = Vec::new();
        s.flush(|_, bytes| timeouts.push(Header::decode(bytes).unwrap().timeout_us));
        assert_eq!(timeouts, vec![300, 0]);
        assert!(!s.has_timed_backlog());
        s.on_posted(Ok(()));
        // One whose time ran out in the queue still says it has a deadline.
        assert_eq!(s.reserve(2048, false), Ok(Reserved::Queue));
        s.queue_until(frame(64, 0), Some(1500));
        s.on_ack(crate::protocol::credits::ack_for(4096 + 128))
            .unwrap();
        s.set_clock(9999);
        let mut timeouts = Vec::new();
        s.flush(|_, bytes| timeouts.push(Header::decode(bytes).unwrap().timeout_us));
        assert_eq!(timeouts, vec![1]);
    }

    #[test]
    fn corked_frames_leave_with_the_next_uncorked_one() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        for i in 0..3 {
            let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) else {
                panic!("fits");
            };
            assert_eq!(
                s.sent(offset, staged, 64, usize::MAX),
                i == 0,
                "only the first corks"
            );
            assert!(!s.should_post(false));
        }
        let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) else {
            panic!("fits");
        };
        assert!(!s.sent(offset, staged, 64, 0));
        assert!(s.should_post(false));
        // Back to back in the ring: one write carries all four.
        assert_eq!(s.transmits().len(), 1);
        assert_eq!(s.transmits()[0].local, Some((0, 4 * 64)));
    }

    #[test]
    fn a_corked_write_leaves_once_it_carries_its_batch() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        let send = |s: &mut Sender, batch| {
            let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) else {
                panic!("fits");
            };
            s.sent(offset, staged, 64, batch)
        };
        assert!(!send(&mut s, 1), "a batch of one is not held");
        assert!(s.should_post(false));
        s.on_posted(Ok(()));
        assert!(send(&mut s, 3), "the first of three corks");
        assert!(!send(&mut s, 3));
        assert!(!s.should_post(false), "two of three held");
        assert!(!send(&mut s, 3));
        assert!(s.should_post(false), "the third completes the batch");
        assert_eq!(s.transmits().len(), 1, "one write carries the three");
        assert_eq!(s.transmits()[0].local, Some((64, 3 * 64)));
        s.on_posted(Ok(()));
        assert!(send(&mut s, 3), "counting starts again after a post");
    }

    #[test]
    fn frames_of_one_write_arrive_one_by_one() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        let mut ring = vec![0u8; 4096];
        let lens = [40, 200, 64, 33];
        for (i, &len) in lens.iter().enumerate() {
            let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(len, false) else {
                panic!("fits");
            };
            let mut bytes = frame(len, 0);
            let mut h = Header::decode(&bytes).unwrap();
            h.call_id = CallId(i as u64);
            h.encode((&mut bytes[..HEADER_LEN]).try_into().unwrap());
            ring[offset..offset + len].copy_from_slice(&bytes);
            s.sent(offset, staged, len, usize::MAX);
        }
        s.uncork();
        let [t] = s.transmits() else {
            panic!("one write: {:?}", s.transmits());
        };
        let (first, total) = t.local.unwrap();
        assert_eq!((first, total), (0, 64 + 256 + 64 + 33));
        let mut r = Receiver::new(4096).unwrap();
        let mut at = Some((0, total as u32));
        let mut seen = Vec::new();
        while let Some((units, left)) = at {
            let arrived = r
                .on_frame(units, left, 4096, |o| {
                    ring[o..o + HEADER_LEN].try_into().unwrap()
                })
                .unwrap();
            seen.push((arrived.header.call_id.0, arrived.header.frame_len()));
            at = arrived.next;
        }
        assert_eq!(seen, vec![(0, 40), (1, 200), (2, 64), (3, 33)]);
        assert_eq!(r.consumed(), 64 + 256 + 64 + 64);
    }

    #[test]
    fn a_write_must_end_on_a_frame() {
        let mut ring = vec![0u8; 4096];
        ring[..64].copy_from_slice(&frame(64, 0));
        let read = |o: usize| -> [u8; HEADER_LEN] { ring[o..o + HEADER_LEN].try_into().unwrap() };
        // Shorter than its frame, or ending inside the next header.
        for byte_len in [40, 64 + 10] {
            let mut r = Receiver::new(4096).unwrap();
            assert!(r.on_frame(0, byte_len, 4096, read).is_err(), "{byte_len}");
        }
        // Past the end of the ring.
        let mut r = Receiver::new(4096).unwrap();
        assert!(r.on_frame(0, 8192, 4096, read).is_err());
        // Exactly its frame, or its aligned footprint: one frame.
        for byte_len in [64, 0] {
            let mut r = Receiver::new(4096).unwrap();
            assert_eq!(r.on_frame(0, byte_len, 4096, read).unwrap().next, None);
        }
    }

    #[test]
    fn a_batch_holds_writes_only_on_its_own_turn() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        s.begin_batch();
        let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) else {
            panic!("fits");
        };
        s.sent(offset, staged, 64, 0);
        assert!(!s.should_post(true));
        assert!(s.should_post(false), "another thread's reply is not held");
        s.end_batch(|_, _| unreachable!("nothing queued"));
        assert!(s.should_post(true));
    }

    #[test]
    fn a_completion_of_a_write_never_posted_is_refused() {
        let mut s = Sender::new(1 << 16, 4096, 8, 1 << 20).unwrap();
        let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) else {
            panic!("room for a frame");
        };
        s.sent(offset, staged, 64, 0);
        s.on_posted(Ok(()));
        assert!(s.on_completion(2).is_err());
        assert!(s.on_completion(u64::MAX).is_err());
        s.on_completion(1).unwrap();
        assert!(s.completed_through(1));
        // The send queue's room is as before: nothing was counted twice.
        assert!(matches!(s.reserve(64, false), Ok(Reserved::Ring { .. })));
    }

    #[test]
    fn the_send_queue_bounds_writes_in_flight() {
        let mut s = Sender::new(1 << 16, 4096, 8, 1 << 20).unwrap();
        let mut ring = 0;
        while let Ok(Reserved::Ring { offset, staged, .. }) = s.reserve(64, false) {
            s.sent(offset, staged, 64, 0);
            s.on_posted(Ok(()));
            ring += 1;
        }
        // Two slots stay free: one for a credit doorbell, one spare.
        assert_eq!(ring, 6);
        assert_eq!(s.fence(), None);
        s.on_completion(6).unwrap();
        let fence = s.fence().expect("room again");
        assert_eq!(fence, 7);
        assert!(!s.completed_through(fence));
        s.on_completion(fence).unwrap();
        assert!(s.completed_through(fence));
        assert!(matches!(s.reserve(64, false), Ok(Reserved::Ring { .. })));
    }

    #[test]
    fn a_credit_is_owed_after_a_quarter_of_the_ring() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        let mut r = Receiver::new(4096).unwrap();
        let bytes = frame(1024, 0);
        let arrived = r
            .on_frame(0, 1024, 4096, |off| {
                assert_eq!(off, 0);
                bytes[..HEADER_LEN].try_into().unwrap()
            })
            .unwrap();
        assert_eq!(arrived.consumed, 1024);
        s.on_consumed(arrived.consumed);
        s.begin_batch();
        s.end_batch(|_, _| {});
        let t = s.transmits();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].local, None);
        assert_eq!(
            Doorbell::decode(t[0].imm),
            Some(Doorbell::Credit {
                ack: crate::protocol::credits::ack_for(1024)
            })
        );
    }

    #[test]
    fn violations_are_errors_not_panics() {
        let mut r = Receiver::new(4096).unwrap();
        let bytes = frame(1024, 0);
        let header: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
        assert!(
            r.on_frame(3, 0, 4096, |_| header).is_err(),
            "not at the head"
        );
        assert!(r.on_frame(0, 0, 100, |_| header).is_err(), "over the limit");
        assert!(
            r.on_frame(0, 64, 4096, |_| header).is_err(),
            "length mismatch"
        );
        assert!(r.on_frame(0, 0, 4096, |_| [0xff; HEADER_LEN]).is_err());
        assert_eq!(r.consumed(), 0, "nothing consumed by a violation");
        let big = frame(4096, 0);
        let header: [u8; HEADER_LEN] = big[..HEADER_LEN].try_into().unwrap();
        assert!(
            r.on_frame(0, 0, 1 << 20, |_| header).is_err(),
            "past the ring"
        );
    }

    #[test]
    fn a_heartbeat_leaves_after_two_quiet_ticks_only() {
        let mut tx = Sender::new(4096, 4096, 64, 1 << 20).unwrap();
        assert_eq!(tx.heartbeat_tick(false), None, "first quiet tick");
        let wr = tx
            .heartbeat_tick(false)
            .expect("second quiet tick: a heartbeat");
        let t = tx.transmits();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].wr_id, wr);
        assert!(t[0].local.is_none(), "zero-length");
        assert!(t[0].signaled);
        assert!(!t[0].silent);
        assert_eq!(
            Doorbell::decode(t[0].imm),
            Some(Doorbell::Credit { ack: 0 })
        );
        tx.on_posted(Ok(()));
        // Its own write counts as traffic: the next one needs two more.
        assert_eq!(tx.heartbeat_tick(false), None);
        assert!(tx.heartbeat_tick(false).is_some());
        tx.on_posted(Ok(()));

        // Any write between ticks keeps the heartbeat away.
        for _ in 0..5 {
            let Reserved::Ring { offset, staged, .. } = tx.reserve(64, false).unwrap() else {
                panic!("room")
            };
            tx.sent(offset, staged, 64, 0);
            tx.on_posted(Ok(()));
            assert_eq!(tx.heartbeat_tick(false), None);
        }
        assert_eq!(tx.heartbeat_tick(false), None);
        assert!(tx.heartbeat_tick(false).is_some());

        // A dead connection beats no more.
        tx.on_posted(Ok(()));
        tx.kill("gone");
        for _ in 0..4 {
            assert_eq!(tx.heartbeat_tick(false), None);
        }
    }

    #[test]
    fn a_silent_heartbeat_takes_no_ack_and_reports_only_failure() {
        let mut tx = Sender::new(4096, 4096, 64, 1 << 20).unwrap();
        assert_eq!(tx.heartbeat_tick(true), None, "first quiet tick");
        let wr = tx.heartbeat_tick(true).expect("second quiet tick");
        let t = tx.transmits()[0];
        assert_eq!(t.wr_id, wr);
        assert!(t.silent && t.local.is_none(), "{t:?}");
        assert!(
            !t.signaled,
            "unsignaled unless the send queue needs reaping"
        );
        tx.on_posted(Ok(()));
        // A silent heartbeat is traffic too, and they go on while quiet;
        // every SIGNAL_EVERY-th write is signaled, so the send queue of a
        // connection that stays quiet is reaped.
        let mut signaled = 0;
        for _ in 0..2 * SIGNAL_EVERY {
            assert_eq!(tx.heartbeat_tick(true), None);
            let wr = tx.heartbeat_tick(true).expect("a heartbeat");
            let t = tx.transmits()[0];
            signaled += u32::from(t.signaled);
            tx.on_posted(Ok(()));
            if t.signaled {
                tx.on_completion(wr).unwrap();
            }
        }
        assert_eq!(signaled, 2);
    }

    #[test]
    fn a_dead_sender_refuses_and_drops_its_queue() {
        let mut s = Sender::new(4096, 4096, 128, 1 << 20).unwrap();
        s.queue_until(frame(64, 0), None);
        s.kill("peer gone");
        assert!(!s.has_unsent());
        assert_eq!(
            s.reserve(64, false),
            Err(SendError::Closed("peer gone".into()))
        );
        assert_eq!(s.fence(), None);
        assert!(s.completed_through(u64::MAX));
        let too_big = s.reserve(4096, false);
        assert!(matches!(too_big, Err(SendError::Closed(_))));
    }
}
