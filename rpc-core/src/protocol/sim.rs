//! Two connection ends driven against each other (property tests).
//!
//! Each end is the real protocol state of a connection, a [`Sender`] and a
//! [`Receiver`], as the dispatcher drives it; only the fabric is simulated,
//! and only as much as reliable-connection semantics require:
//!
//! - each end has its ring memory and its staging area (`Vec<u8>`s);
//! - a posted write goes on the wire, a FIFO per direction (RC delivers in
//!   order); when it is delivered, its staging bytes are copied into the
//!   peer's ring as they are then (so a sender that reused staging bytes
//!   before the write completed corrupts the frame), and its doorbell rings;
//! - a delivered signaled write queues its completion for its sender.
//!
//! End A sends frames with `call_id` = sequence number and bodies cut from a
//! pseudo-random pattern; end B checks each is exactly the next one, with
//! intact bytes, and may send small frames back (which carry its credits,
//! piggy-backed, as replies do). Both ends return credits as the dispatcher
//! does at the end of a batch. Every unit of B's ring is tagged with the
//! frame that owns it from reserve to consume, so a reserve landing on a
//! live frame is caught at once, not only when corrupted bytes are read
//! later. A frame that had to queue must go out once everything settles.

use std::collections::VecDeque;
use std::rc::Rc;

use proptest::prelude::*;

use super::connection::SIGNAL_EVERY;
use super::credits::{ACK_MODULUS, ack_for};
use super::{
    ALIGN, CallId, CreditError, Doorbell, FrameKind, HEADER_LEN, Header, Receiver, Reserved,
    SendError, Sender, Transmit, align_up, staging_size,
};

/// Largest ring simulated.
const MAX_CAP: usize = 1 << 16;
/// Number of distinct body shifts (prime, so consecutive frames differ).
const SHIFTS: usize = 4093;
/// Blocked sends per run checked for liveness (each clones the whole state).
const LIVENESS_CHECKS: usize = 32;
/// Bytes a sender may queue (large: the simulation never hits the limit).
const MAX_BACKLOG: usize = 1 << 30;
/// Settling rounds before declaring a deadlock.
const MAX_ROUNDS: usize = 10_000;

/// Pseudo-random bytes that frame bodies are cut from.
fn pattern() -> Rc<[u8]> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..MAX_CAP / 2 + SHIFTS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Ring bytes a frame occupies (the rule both ring sides follow).
fn footprint(len: usize) -> usize {
    align_up(len.max(1))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    A,
    B,
}

/// One end of the connection.
#[derive(Debug, Clone)]
struct End {
    tx: Sender,
    rx: Receiver,
    /// Where frames are encoded before they are written to the peer's ring.
    staging: Vec<u8>,
    /// The ring the peer writes into.
    mem: Vec<u8>,
    /// This end's writes on their way to the peer, in order.
    wire: VecDeque<Transmit>,
    /// This end's signaled writes that completed, not yet reported to it.
    completions: VecDeque<u64>,
    /// Whether its dispatcher is handling a batch of completions.
    batching: bool,
    /// Every ack its sender applied, for replaying old ones.
    applied: Vec<u32>,
}

impl End {
    fn new(cap: usize, base: u64, sq_depth: u64) -> End {
        End {
            tx: Sender::at_position(cap, cap, base, sq_depth, MAX_BACKLOG),
            rx: Receiver::at_position(cap, base),
            staging: vec![0; staging_size(cap)],
            mem: vec![0; cap],
            wire: VecDeque::new(),
            completions: VecDeque::new(),
            batching: false,
            applied: Vec::new(),
        }
    }

    /// Frames this end has handed to its sender and not yet put on the wire.
    fn unsent_frames(&self) -> usize {
        self.tx.queued()
            + self
                .tx
                .transmits()
                .iter()
                .map(|t| frames_in(&self.staging, t))
                .sum::<usize>()
    }
}

/// How many frames the write `t` carries (it may carry several back to
/// back), read from the staging area it was written from.
fn frames_in(staging: &[u8], t: &Transmit) -> usize {
    let Some((mut off, len)) = t.local else {
        return 0;
    };
    let end = off + len;
    let mut n = 0;
    while off < end {
        let header = Header::decode(&staging[off..]).expect("a staged frame");
        off += footprint(header.frame_len());
        n += 1;
    }
    n
}

/// Which units of B's ring belong to which of A's frames.
#[derive(Debug, Clone)]
struct Owners {
    cap: usize,
    owner: Vec<Option<u64>>,
    owned_units: usize,
    /// A's cumulative head, as placed frames say it must be.
    head: u64,
    wraps: u64,
}

impl Owners {
    fn mark(&mut self, from: usize, to: usize, seq: u64) {
        for unit in from / ALIGN..to / ALIGN {
            assert_eq!(
                self.owner[unit], None,
                "frame {seq} reserved unit {unit}, still owned by an unconsumed frame"
            );
            self.owner[unit] = Some(seq);
        }
        self.owned_units += (to - from) / ALIGN;
    }

    /// A placed frame `seq` of `len` bytes at `offset`: it goes at the head
    /// if it fits before the end of the ring, else at 0 with the end skipped.
    fn claim(&mut self, offset: usize, len: usize, seq: u64) {
        let at = (self.head % self.cap as u64) as usize;
        let need = footprint(len);
        if offset == at {
            assert!(at + need <= self.cap, "frame {seq} runs past the ring");
        } else {
            assert_eq!(offset, 0, "frame {seq} neither at the head nor wrapped");
            assert!(at + need > self.cap, "frame {seq} wrapped although it fit");
            self.mark(at, self.cap, seq);
            self.head += (self.cap - at) as u64;
            self.wraps += 1;
        }
        self.mark(offset, offset + need, seq);
        self.head += need as u64;
    }

    /// Claims the next frame `seq` of `len` bytes where the ring's rule
    /// puts it: at the head, or at 0 if it does not fit before the end.
    fn claim_next(&mut self, len: usize, seq: u64) {
        let at = (self.head % self.cap as u64) as usize;
        let offset = if at + footprint(len) <= self.cap {
            at
        } else {
            0
        };
        self.claim(offset, len, seq);
    }

    /// B released its ring from cumulative position `from` to `to`, all of
    /// it frame `seq`'s.
    fn release(&mut self, from: u64, to: u64, seq: u64) {
        for pos in (from..to).step_by(ALIGN) {
            let unit = (pos % self.cap as u64) as usize / ALIGN;
            assert_eq!(self.owner[unit], Some(seq), "unit {unit} of frame {seq}");
            self.owner[unit] = None;
        }
        self.owned_units -= ((to - from) / ALIGN as u64) as usize;
    }
}

#[derive(Debug, Clone, Default)]
struct Stats {
    sent: u64,
    wraps: u64,
    blocked: u64,
    liveness_checks: usize,
    stale_acks: u64,
    explicit_credits: u64,
    replies: u64,
}

#[derive(Debug, Clone)]
struct Sim {
    cap: usize,
    pattern: Rc<[u8]>,
    a: End,
    b: End,
    owners: Owners,
    /// A's frames: the next to send, and the next B expects.
    next_seq: u64,
    expected_seq: u64,
    /// B's frames back: the next to send, and the next A expects.
    next_reply: u64,
    expected_reply: u64,
    /// Fences A posted, all of which must complete.
    fences: Vec<u64>,
    stats: Stats,
}

impl Sim {
    /// Both ends empty at cumulative position `base` (ALIGN-aligned).
    fn new(cap: usize, base: u64, sq_depth: u64, pattern: Rc<[u8]>) -> Sim {
        Sim {
            cap,
            pattern,
            a: End::new(cap, base, sq_depth),
            b: End::new(cap, base, sq_depth),
            owners: Owners {
                cap,
                owner: vec![None; cap / ALIGN],
                owned_units: 0,
                head: base,
                wraps: 0,
            },
            next_seq: 0,
            expected_seq: 0,
            next_reply: 0,
            expected_reply: 0,
            fences: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn end(&mut self, side: Side) -> &mut End {
        match side {
            Side::A => &mut self.a,
            Side::B => &mut self.b,
        }
    }

    fn body(pattern: &[u8], seq: u64, len: usize) -> &[u8] {
        let shift = (seq.wrapping_mul(0x9e37_79b9) % SHIFTS as u64) as usize;
        &pattern[shift..shift + len]
    }

    /// A's frame `seq` of `len` bytes, but for the ack.
    fn header_for(seq: u64, len: usize) -> Header {
        let body = len - HEADER_LEN;
        let metadata_len = if seq % 2 == 0 {
            (body / 4).min(1000)
        } else {
            0
        };
        Header {
            flags: 0,
            kind: FrameKind::Request,
            status: 0,
            method_id: seq as u32 ^ 0xa5a5_a5a5,
            call_id: CallId(seq),
            payload_len: (body - metadata_len) as u32,
            metadata_len: metadata_len as u16,
            timeout_us: (seq % 1000) as u32,
            ack: 0,
        }
    }

    /// Encodes A's frame `seq` into `out` (exactly its length).
    fn encode(pattern: &[u8], seq: u64, ack: u32, out: &mut [u8]) {
        let mut header = Self::header_for(seq, out.len());
        header.ack = ack;
        header.encode((&mut out[..HEADER_LEN]).try_into().unwrap());
        let body = Self::body(pattern, seq, out.len() - HEADER_LEN);
        out[HEADER_LEN..].copy_from_slice(body);
    }

    /// A sends a frame of `len` bytes (header included); `cork` holds its
    /// write for the frames that follow until it carries that many.
    fn send(&mut self, len: usize, cork: usize) {
        assert!((HEADER_LEN..=self.cap / 2).contains(&len));
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stats.sent += 1;
        match self.a.tx.reserve(len, false) {
            Ok(Reserved::Ring {
                offset,
                staged,
                ack,
            }) => {
                self.owners.claim(offset, len, seq);
                assert_eq!(self.owners.head, self.a.tx.ring().head());
                Self::encode(
                    &self.pattern,
                    seq,
                    ack,
                    &mut self.a.staging[staged..staged + len],
                );
                self.a.tx.sent(offset, staged, len, cork);
                self.post(Side::A, false);
            }
            Ok(Reserved::Queue) => {
                let mut frame = vec![0; len];
                Self::encode(&self.pattern, seq, 0, &mut frame);
                self.a.tx.queue_until(frame, None);
                // A full staging area may have handed out a signaled write.
                self.post(Side::A, false);
                self.stats.blocked += 1;
                if self.stats.liveness_checks < LIVENESS_CHECKS {
                    self.stats.liveness_checks += 1;
                    let mut settled = self.clone();
                    settled.settle();
                    assert!(settled.expected_seq > seq, "queued frame {seq} never sent");
                }
            }
            Err(e) => panic!("frame {seq} of {len} bytes refused: {e:?}"),
        }
    }

    /// B sends a small frame back (a reply), carrying its credits.
    fn reply(&mut self, len: usize, in_turn: bool) {
        let seq = self.next_reply;
        self.next_reply += 1;
        self.stats.replies += 1;
        let header = |ack| Header {
            flags: 0,
            kind: FrameKind::Response,
            status: 0,
            method_id: 0,
            call_id: CallId(seq),
            payload_len: (len - HEADER_LEN) as u32,
            metadata_len: 0,
            timeout_us: 0,
            ack,
        };
        match self.b.tx.reserve(len, false) {
            Ok(Reserved::Ring {
                offset,
                staged,
                ack,
            }) => {
                let out = &mut self.b.staging[staged..staged + len];
                header(ack).encode((&mut out[..HEADER_LEN]).try_into().unwrap());
                out[HEADER_LEN..].fill(seq as u8);
                self.b.tx.sent(offset, staged, len, 0);
                self.post(Side::B, in_turn);
            }
            Ok(Reserved::Queue) => {
                let mut frame = vec![seq as u8; len];
                header(0).encode((&mut frame[..HEADER_LEN]).try_into().unwrap());
                self.b.tx.queue_until(frame, None);
                self.post(Side::B, in_turn);
            }
            Err(e) => panic!("reply {seq} refused: {e:?}"),
        }
    }

    /// Posts `side`'s writes if they are due (`in_turn`: the caller is its
    /// dispatcher, within a batch).
    fn post(&mut self, side: Side, in_turn: bool) {
        if self.end(side).tx.should_post(in_turn) {
            self.post_now(side);
        }
    }

    /// Posts `side`'s writes: they go on the wire.
    fn post_now(&mut self, side: Side) {
        let from = self.end(side);
        from.wire.extend(from.tx.transmits().iter().copied());
        from.tx.on_posted(Ok(()));
    }

    /// Moves `side`'s queued frames into the peer's ring where there is room.
    fn flush(&mut self, side: Side, end_batch: bool) {
        let (end, owners) = match side {
            Side::A => (&mut self.a, Some(&mut self.owners)),
            Side::B => (&mut self.b, None),
        };
        let End { tx, staging, .. } = end;
        let mut owners = owners;
        let write = |staged: usize, frame: &[u8]| {
            if let Some(owners) = owners.as_deref_mut() {
                let header = Header::decode(frame).expect("queued frame");
                owners.claim_next(frame.len(), header.call_id.0);
            }
            staging[staged..staged + frame.len()].copy_from_slice(frame);
        };
        if end_batch {
            tx.end_batch(write);
        } else {
            tx.flush(write);
        }
        if side == Side::A {
            assert_eq!(self.owners.head, self.a.tx.ring().head());
        }
    }

    /// `side` handles the next doorbell from its peer. False if none.
    fn deliver(&mut self, side: Side) -> bool {
        let Sim {
            cap,
            pattern,
            a,
            b,
            owners,
            expected_seq,
            expected_reply,
            stats,
            ..
        } = self;
        let (to, from) = match side {
            Side::A => (a, b),
            Side::B => (b, a),
        };
        let Some(t) = from.wire.pop_front() else {
            return false;
        };
        if let Some((staged, len)) = t.local {
            to.mem[t.remote..t.remote + len].copy_from_slice(&from.staging[staged..staged + len]);
        }
        if t.signaled {
            from.completions.push_back(t.wr_id);
        }
        if !to.batching {
            to.batching = true;
            to.tx.begin_batch();
        }
        match Doorbell::decode(t.imm) {
            Some(Doorbell::Credit { ack }) => {
                assert_eq!(t.local, None, "a credit carries no bytes");
                to.tx.on_ack(ack).expect("credits from the peer are valid");
                to.applied.push(ack);
                if side == Side::A {
                    stats.explicit_credits += 1;
                }
                self.flush(side, false);
            }
            Some(Doorbell::Frame { offset_units }) => {
                let (_, write_len) = t.local.expect("a frame carries bytes");
                let first = t.remote;
                assert_eq!(first, offset_units as usize * ALIGN);
                let mut at = Some((offset_units, write_len as u32));
                while let Some((offset_units, left)) = at {
                    let off = offset_units as usize * ALIGN;
                    let before = to.rx.consumed();
                    let mem = &to.mem;
                    let arrived = to
                        .rx
                        .on_frame(offset_units, left, *cap, |at| {
                            mem[at..at + HEADER_LEN].try_into().unwrap()
                        })
                        .expect("a valid frame");
                    assert_eq!(arrived.offset, off);
                    at = arrived.next;
                    let header = arrived.header;
                    let len = header.frame_len();
                    if at.is_none() {
                        assert_eq!(
                            off + len,
                            first + write_len,
                            "the write ends with its last frame"
                        );
                    }
                    let body = &to.mem[off + HEADER_LEN..off + len];
                    match side {
                        Side::B => {
                            let seq = *expected_seq;
                            assert_eq!(
                                header.call_id,
                                CallId(seq),
                                "frame lost, duplicated or reordered"
                            );
                            assert_eq!(Header { ack: 0, ..header }, Self::header_for(seq, len));
                            assert!(
                                body == Self::body(pattern, seq, len - HEADER_LEN),
                                "body of frame {seq} corrupted"
                            );
                            owners.release(before, arrived.consumed, seq);
                            *expected_seq += 1;
                        }
                        Side::A => {
                            let seq = *expected_reply;
                            assert_eq!(header.call_id, CallId(seq), "reply lost or reordered");
                            assert!(body.iter().all(|&b| b == seq as u8));
                            *expected_reply += 1;
                        }
                    }
                    // A consumed frame must never be read again: poison it.
                    to.mem[off..off + footprint(len)].fill(0xee);
                    to.tx.on_consumed(arrived.consumed);
                    to.tx
                        .on_ack(header.ack)
                        .expect("piggy-backed credits are valid");
                    to.applied.push(header.ack);
                }
            }
            None => panic!("bad doorbell {:#x}", t.imm),
        }
        self.post(side, true);
        true
    }

    /// `side`'s dispatcher ends its batch: flush, credits due, post.
    fn end_batch(&mut self, side: Side) -> bool {
        if !self.end(side).batching {
            return false;
        }
        self.flush(side, true);
        self.end(side).batching = false;
        self.post_now(side);
        true
    }

    /// `side` sees its next send completion. False if none.
    fn complete(&mut self, side: Side) -> bool {
        let Some(wr_id) = self.end(side).completions.pop_front() else {
            return false;
        };
        self.end(side)
            .tx
            .on_completion(wr_id)
            .expect("the fabric completes only posted writes");
        self.flush(side, false);
        self.post(side, true);
        true
    }

    /// A's caller stops holding its corked frames.
    fn uncork(&mut self) {
        if self.a.tx.uncork() {
            self.post(Side::A, false);
        }
    }

    /// A posts a fence, if the send queue has room.
    fn fence(&mut self) {
        if let Some(wr_id) = self.a.tx.fence() {
            self.post_now(Side::A);
            self.fences.push(wr_id);
        }
    }

    /// A sees an ack it already applied again: nothing changes.
    fn duplicate_old_ack(&mut self, which: usize) {
        if self.a.applied.is_empty() {
            return;
        }
        let ack = self.a.applied[which % self.a.applied.len()];
        let (head, tail) = (self.a.tx.ring().head(), self.a.tx.ring().tail());
        assert_eq!(self.a.tx.on_ack(ack), Ok(()), "old ack {ack}");
        assert_eq!(
            (self.a.tx.ring().head(), self.a.tx.ring().tail()),
            (head, tail)
        );
        self.stats.stale_acks += 1;
    }

    /// An ack ahead of everything written is refused and changes nothing.
    fn bogus_ack(&mut self, ahead_units: u16) {
        let ring = self.a.tx.ring();
        let ahead = u64::from(ahead_units.max(1));
        let ack = ack_for(ring.head() + ahead * ALIGN as u64);
        let (head, tail) = (ring.head(), ring.tail());
        let in_flight = ring.in_flight() / ALIGN as u64;
        assert_eq!(
            self.a.tx.on_ack(ack),
            Err(CreditError::TooMuch {
                units: in_flight + ahead,
                in_flight
            })
        );
        assert_eq!(
            (self.a.tx.ring().head(), self.a.tx.ring().tail()),
            (head, tail)
        );
    }

    /// A frame over the ring's limit is refused for good and changes nothing.
    fn send_too_large(&mut self, extra: u16) {
        let len = self.cap / 2 + 1 + usize::from(extra);
        let (head, tail) = (self.a.tx.ring().head(), self.a.tx.ring().tail());
        assert!(matches!(
            self.a.tx.reserve(len, false),
            Err(SendError::TooLarge { .. })
        ));
        assert_eq!(
            (self.a.tx.ring().head(), self.a.tx.ring().tail()),
            (head, tail)
        );
    }

    /// Runs both ends until nothing moves: every frame delivered, every
    /// queue empty.
    fn settle(&mut self) {
        self.uncork();
        for _ in 0..MAX_ROUNDS {
            let mut moved = false;
            for side in [Side::B, Side::A] {
                while self.deliver(side) {
                    moved = true;
                }
            }
            for side in [Side::A, Side::B] {
                moved |= self.end_batch(side);
                while self.complete(side) {
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for end in [&self.a, &self.b] {
            assert!(
                end.wire.is_empty() && end.completions.is_empty() && !end.tx.has_unsent(),
                "deadlock: {} frames and {} writes stuck",
                end.unsent_frames(),
                end.wire.len(),
            );
        }
        assert_eq!(self.expected_seq, self.next_seq, "every frame delivered");
        assert_eq!(
            self.expected_reply, self.next_reply,
            "every reply delivered"
        );
        self.check_invariants();
    }

    fn check_invariants(&self) {
        let ring = self.a.tx.ring();
        let (tail, consumed, head) = (ring.tail(), self.b.rx.consumed(), ring.head());
        assert!(
            tail <= consumed && consumed <= head,
            "credits not conserved: tail {tail} consumed {consumed} head {head}"
        );
        assert!(ring.in_flight() <= self.cap as u64);
        assert_eq!(
            (self.owners.owned_units * ALIGN) as u64,
            head - consumed,
            "reserved-but-unconsumed bytes are exactly the owned ones"
        );
        let on_wire: usize = self
            .a
            .wire
            .iter()
            .map(|t| frames_in(&self.a.staging, t))
            .sum();
        assert_eq!(
            (on_wire + self.a.unsent_frames()) as u64,
            self.next_seq - self.expected_seq,
            "every frame sent is on the wire, queued or delivered"
        );
        assert!(self.b.tx.credits().unreported() <= consumed - tail);
    }

    fn apply(&mut self, action: &Action) {
        let max = self.cap / 2;
        match *action {
            Action::SendSmall(n) => self.send(HEADER_LEN + usize::from(n) % 257, 0),
            Action::SendAny(n) => {
                self.send(HEADER_LEN + n as usize % (max - HEADER_LEN + 1), 0);
            }
            Action::SendMax => self.send(max, 0),
            Action::SendCorked(n) => {
                // Held until uncorked, or until its write carries 2 to 5
                // frames.
                let batch = match usize::from(n) / 257 % 5 {
                    0 => usize::MAX,
                    k => k + 1,
                };
                self.send(HEADER_LEN + usize::from(n) % 257, batch);
            }
            Action::Uncork => self.uncork(),
            Action::SendTooLarge(extra) => self.send_too_large(extra),
            Action::Deliver(side) => {
                self.deliver(side);
            }
            Action::DeliverBurst(side, n) => {
                for _ in 0..n {
                    self.deliver(side);
                }
            }
            Action::EndBatch(side) => {
                self.end_batch(side);
            }
            Action::Complete(side) => {
                self.complete(side);
            }
            Action::Reply(n, in_turn) => self.reply(HEADER_LEN + usize::from(n) % 64, in_turn),
            Action::Fence => self.fence(),
            Action::DuplicateOldAck(which) => self.duplicate_old_ack(which),
            Action::BogusAck(ahead) => self.bogus_ack(ahead),
        }
        self.check_invariants();
    }

    /// After the run: everything drains, nothing is lost, the ring is whole.
    fn finish(mut self) -> Stats {
        self.settle();
        // A reply carries B's last credits.
        self.reply(HEADER_LEN, false);
        self.settle();
        let ring = self.a.tx.ring();
        assert_eq!(ring.in_flight(), 0);
        assert_eq!(ring.tail(), self.b.rx.consumed());
        assert_eq!(self.owners.owned_units, 0);
        assert_eq!(self.b.tx.credits().unreported(), 0);
        for &fence in &self.fences {
            assert!(
                self.a.tx.completed_through(fence),
                "fence {fence} completed"
            );
        }
        let expected = self.expected_seq;
        self.send(self.cap / 2, 0);
        assert_eq!(
            self.a.tx.queued(),
            0,
            "a whole free ring takes the largest frame"
        );
        self.settle();
        assert_eq!(self.expected_seq, expected + 1);
        self.stats.wraps = self.owners.wraps;
        self.stats
    }
}

#[derive(Debug, Clone)]
enum Action {
    /// A sends a frame of at most 256 bytes after the header.
    SendSmall(u16),
    /// A sends a frame of any length up to the ring's limit.
    SendAny(u32),
    /// A sends a frame of exactly the ring's limit.
    SendMax,
    /// A sends a small frame, corked (for good, or for a few frames).
    SendCorked(u16),
    /// A's caller uncorks.
    Uncork,
    /// A tries a frame over the ring's limit.
    SendTooLarge(u16),
    /// An end handles one doorbell.
    Deliver(Side),
    /// An end handles up to this many doorbells.
    DeliverBurst(Side, u8),
    /// An end's dispatcher ends its batch.
    EndBatch(Side),
    /// An end sees one send completion.
    Complete(Side),
    /// B sends a reply of at most 63 bytes after the header, from its
    /// dispatcher's turn or not.
    Reply(u8, bool),
    /// A posts a fence.
    Fence,
    /// A sees an old ack again.
    DuplicateOldAck(usize),
    /// A sees an ack ahead of what it wrote.
    BogusAck(u16),
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::A), Just(Side::B)]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => any::<u16>().prop_map(Action::SendSmall),
        4 => any::<u32>().prop_map(Action::SendAny),
        1 => Just(Action::SendMax),
        2 => any::<u16>().prop_map(Action::SendCorked),
        1 => Just(Action::Uncork),
        1 => any::<u16>().prop_map(Action::SendTooLarge),
        6 => Just(Action::Deliver(Side::B)),
        2 => Just(Action::Deliver(Side::A)),
        1 => (side(), 1u8..16).prop_map(|(s, n)| Action::DeliverBurst(s, n)),
        3 => side().prop_map(Action::EndBatch),
        3 => side().prop_map(Action::Complete),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(n, t)| Action::Reply(n, t)),
        1 => Just(Action::Fence),
        1 => any::<usize>().prop_map(Action::DuplicateOldAck),
        1 => any::<u16>().prop_map(Action::BogusAck),
    ]
}

fn capacity() -> impl Strategy<Value = usize> {
    (12u32..=16).prop_map(|shift| 1usize << shift)
}

/// Send-queue depth: barely more than a signaling interval (writes queue
/// for the send queue, not only for the ring), typical, or unlimited.
fn sq_depth() -> impl Strategy<Value = u64> {
    prop_oneof![Just(SIGNAL_EVERY + 3), Just(128u64), Just(1u64 << 20)]
}

/// Starting cumulative position in bytes: zero, just before a lap of the
/// 2^30-unit ack modulus (so acks wrap during the run), or anywhere.
fn base() -> impl Strategy<Value = u64> {
    let units = prop_oneof![
        Just(0u64),
        (0u64..4096).prop_map(|k| ACK_MODULUS - k),
        (1u64..8, 0u64..4096).prop_map(|(m, k)| m * ACK_MODULUS - k),
        0u64..(1 << 40),
    ];
    units.prop_map(|u| u * ALIGN as u64)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    })]

    #[test]
    fn prop_sim_connection_pair(
        cap in capacity(),
        base in base(),
        sq_depth in sq_depth(),
        actions in proptest::collection::vec(action(), 1..=500),
    ) {
        let mut sim = Sim::new(cap, base, sq_depth, pattern());
        for action in &actions {
            sim.apply(action);
        }
        sim.finish();
    }
}

/// A fixed pseudo-random schedule, long enough to cross the ack modulus,
/// checking that the simulation really exercises what it claims to.
#[test]
fn sim_fixed_schedule_covers_wraps_blocking_and_modulus() {
    let cap = 4096;
    let base = (ACK_MODULUS - 100) * ALIGN as u64;
    let mut sim = Sim::new(cap, base, SIGNAL_EVERY + 3, pattern());
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let r = next();
        let side = if r & 256 == 0 { Side::A } else { Side::B };
        let action = match r % 24 {
            0..=2 => Action::SendSmall((r >> 9) as u16),
            3 => Action::SendAny((r >> 9) as u32),
            4 if r & 1024 == 0 => Action::SendMax,
            4 | 5 => Action::SendCorked((r >> 9) as u16),
            6..=10 => Action::Deliver(Side::B),
            11..=13 => Action::Deliver(Side::A),
            14..=15 => Action::EndBatch(side),
            16..=17 => Action::Complete(side),
            18 => Action::Reply((r >> 9) as u8, r & 512 == 0),
            19 => Action::Uncork,
            20 => Action::Fence,
            _ => Action::DuplicateOldAck((r >> 9) as usize),
        };
        sim.apply(&action);
    }
    let crossed = sim.b.rx.consumed() > ACK_MODULUS * ALIGN as u64;
    let stats = sim.finish();
    assert!(crossed, "the run crosses the 2^30-unit ack modulus");
    assert!(stats.sent > 1000, "{stats:?}");
    assert!(stats.wraps > 50, "{stats:?}");
    assert!(stats.blocked > 50, "{stats:?}");
    assert!(stats.stale_acks > 50, "{stats:?}");
    assert!(stats.explicit_credits > 10, "{stats:?}");
    assert!(stats.replies > 500, "{stats:?}");
}
