//! Simulated sender/receiver pair over the pure protocol (property tests).
//!
//! One direction of a connection, built only from [`SendRing`], [`RecvRing`],
//! [`CreditReturn`], [`apply_ack`], [`Doorbell`] and [`Header`]:
//!
//! - the receiver's ring memory is a `Vec<u8>` of `capacity` bytes;
//! - the sender reserves, writes a real encoded frame (header with
//!   `call_id` = sequence number, metadata and payload cut from a
//!   pseudo-random pattern at a shift derived from the sequence number) and
//!   queues the doorbell immediate on the wire, a FIFO (RC delivers in order);
//! - the receiver pops doorbells, locates and decodes the frame from memory,
//!   checks it is exactly the next sequence number with intact bytes, and
//!   consumes it;
//! - credits flow back on a second FIFO, either piggy-backed in a frame
//!   header or as an explicit credit doorbell, and the sender applies them.
//!
//! Every ring unit is tagged with the frame that owns it from reserve to
//! consume, so a reserve landing on a live frame is caught at once, not only
//! when corrupted bytes are read later.

use std::collections::VecDeque;
use std::rc::Rc;

use proptest::prelude::*;

use super::credits::{ACK_MODULUS, ack_for, apply_ack};
use super::{
    ALIGN, CallId, CreditError, CreditReturn, Doorbell, FrameKind, HEADER_LEN, Header, RecvRing,
    RingError, SendRing, Slot, align_up,
};

/// Largest ring simulated.
const MAX_CAP: usize = 1 << 16;
/// Number of distinct body shifts (prime, so consecutive frames differ).
const SHIFTS: usize = 4093;
/// Blocked sends per run checked for liveness (each clones the whole state).
const LIVENESS_CHECKS: usize = 32;

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

/// A doorbell on the wire, with what the sender knew for cross-checks.
#[derive(Debug, Clone)]
struct Sent {
    imm: u32,
    seq: u64,
    slot: Slot,
    len: usize,
}

/// A credit return on its way back to the sender.
#[derive(Debug, Clone)]
enum Back {
    /// Piggy-backed in the header of a frame going the other way.
    Piggy([u8; HEADER_LEN]),
    /// An explicit zero-length write's immediate.
    Explicit(u32),
}

/// How the receiver returns credits while settling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CreditRule {
    /// A piggy-backed ack at the end (a frame flows back).
    Piggy,
    /// Only explicit credits, when `needs_explicit() || may_stall_sender()`
    /// after each consume (nothing flows back).
    ExplicitOnly,
}

#[derive(Debug, Clone, Default)]
struct Stats {
    sent: u64,
    wraps: u64,
    blocked: u64,
    liveness_checks: usize,
    stale_acks: u64,
    explicit_credits: u64,
}

#[derive(Debug, Clone)]
struct Sim {
    cap: usize,
    pattern: Rc<[u8]>,
    /// The receiver's ring memory.
    mem: Vec<u8>,
    /// Per ALIGN unit: the frame owning it, from reserve until consume.
    owner: Vec<Option<u64>>,
    owned_units: usize,
    tx: SendRing,
    next_seq: u64,
    wire: VecDeque<Sent>,
    rx: RecvRing,
    credits: CreditReturn,
    expected_seq: u64,
    back: VecDeque<Back>,
    /// Every ack the sender applied, for replaying old ones.
    applied: Vec<u32>,
    stats: Stats,
}

impl Sim {
    /// Both sides empty at cumulative position `base` (ALIGN-aligned).
    fn new(cap: usize, base: u64, pattern: Rc<[u8]>) -> Sim {
        let mut credits = CreditReturn::new(cap);
        credits.on_consumed(base);
        let _ = credits.take_ack();
        Sim {
            cap,
            pattern,
            mem: vec![0; cap],
            owner: vec![None; cap / ALIGN],
            owned_units: 0,
            tx: SendRing::at_position(cap, base),
            next_seq: 0,
            wire: VecDeque::new(),
            rx: RecvRing::at_position(cap, base),
            credits,
            expected_seq: 0,
            back: VecDeque::new(),
            applied: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn body(&self, seq: u64, len: usize) -> &[u8] {
        let shift = (seq.wrapping_mul(0x9e37_79b9) % SHIFTS as u64) as usize;
        &self.pattern[shift..shift + len]
    }

    fn header_for(seq: u64, len: usize) -> Header {
        let body = len - HEADER_LEN;
        let metadata_len = if seq % 2 == 0 {
            (body / 4).min(1000)
        } else {
            0
        };
        Header {
            kind: FrameKind::Request,
            status: 0,
            method_id: seq as u32 ^ 0xa5a5_a5a5,
            call_id: CallId(seq),
            payload_len: (body - metadata_len) as u32,
            metadata_len: metadata_len as u16,
            timeout_us: (seq % 1000) as u32,
            ack: seq.wrapping_mul(7) as u32,
        }
    }

    fn claim(&mut self, from: usize, to: usize, seq: u64) {
        for unit in from / ALIGN..to / ALIGN {
            assert_eq!(
                self.owner[unit], None,
                "frame {seq} reserved unit {unit}, still owned by an unconsumed frame"
            );
            self.owner[unit] = Some(seq);
        }
        self.owned_units += (to - from) / ALIGN;
    }

    fn unclaim(&mut self, from: usize, to: usize, seq: u64) {
        for unit in from / ALIGN..to / ALIGN {
            assert_eq!(self.owner[unit], Some(seq), "unit {unit} of frame {seq}");
            self.owner[unit] = None;
        }
        self.owned_units -= (to - from) / ALIGN;
    }

    /// The sender tries to send a frame of `len` bytes (header included).
    fn send(&mut self, len: usize) {
        assert!((HEADER_LEN..=self.tx.max_frame()).contains(&len));
        let (head, tail) = (self.tx.head(), self.tx.tail());
        let fits = self.tx.fits(len);
        let reserved = self.tx.reserve(len).expect("at most max_frame");
        assert_eq!(reserved.is_some(), fits, "fits() agrees with reserve()");
        let Some(slot) = reserved else {
            assert_eq!((self.tx.head(), self.tx.tail()), (head, tail));
            self.stats.blocked += 1;
            if self.stats.liveness_checks < LIVENESS_CHECKS {
                self.stats.liveness_checks += 1;
                self.check_unblocks(len);
            }
            return;
        };
        let off = (head % self.cap as u64) as usize;
        let need = footprint(len);
        if slot.skipped == 0 {
            assert_eq!(slot.offset, off);
            assert!(off + need <= self.cap);
        } else {
            assert_eq!(
                slot,
                Slot {
                    offset: 0,
                    skipped: self.cap - off
                }
            );
            assert!(need > slot.skipped, "wrapped although the frame fit");
            self.stats.wraps += 1;
        }
        assert_eq!(self.tx.head(), head + (slot.skipped + need) as u64);
        assert!(self.tx.in_flight() <= self.cap as u64);

        let seq = self.next_seq;
        self.next_seq += 1;
        if slot.skipped > 0 {
            self.claim(off, self.cap, seq);
        }
        self.claim(slot.offset, slot.offset + need, seq);

        let header = Self::header_for(seq, len);
        assert_eq!(header.frame_len(), len);
        let mut bytes = [0; HEADER_LEN];
        header.encode(&mut bytes);
        let at = slot.offset;
        self.mem[at..at + HEADER_LEN].copy_from_slice(&bytes);
        let body = self.body(seq, len - HEADER_LEN).to_vec();
        self.mem[at + HEADER_LEN..at + len].copy_from_slice(&body);

        let offset_units = u32::try_from(slot.offset / ALIGN).unwrap();
        self.wire.push_back(Sent {
            imm: Doorbell::Frame { offset_units }.encode(),
            seq,
            slot,
            len,
        });
        self.stats.sent += 1;
    }

    /// A blocked send must go through once everything in flight is
    /// delivered, consumed and credited, under either credit rule.
    fn check_unblocks(&self, len: usize) {
        for rule in [CreditRule::Piggy, CreditRule::ExplicitOnly] {
            let mut settled = self.clone();
            settled.settle(rule);
            assert!(
                settled.tx.fits(len),
                "deadlock under {rule:?}: {len}-byte frame blocked with {} in flight, head {}",
                settled.tx.in_flight(),
                settled.tx.head(),
            );
            assert!(settled.tx.reserve(len).unwrap().is_some());
        }
    }

    /// The receiver handles the next doorbell. False if the wire is empty.
    fn deliver(&mut self) -> bool {
        let Some(sent) = self.wire.pop_front() else {
            return false;
        };
        let Some(Doorbell::Frame { offset_units }) = Doorbell::decode(sent.imm) else {
            panic!("bad doorbell {:#x}", sent.imm);
        };
        let slot = self
            .rx
            .locate(offset_units)
            .expect("doorbell at the expected head");
        assert_eq!(slot, sent.slot, "receiver and sender agree on the slot");
        let room = self.rx.room_at(slot);
        assert!(room >= HEADER_LEN);
        let at = slot.offset;
        let header = Header::decode(&self.mem[at..at + HEADER_LEN]).expect("intact header");
        let seq = self.expected_seq;
        assert_eq!(
            header.call_id,
            CallId(seq),
            "frame lost, duplicated or reordered"
        );
        assert_eq!(sent.seq, seq);
        let len = header.frame_len();
        assert!(len <= room);
        assert_eq!(len, sent.len);
        assert_eq!(header, Self::header_for(seq, len));
        assert!(
            self.mem[at + HEADER_LEN..at + len] == *self.body(seq, len - HEADER_LEN),
            "body of frame {seq} corrupted"
        );

        let need = footprint(len);
        if slot.skipped > 0 {
            self.unclaim(self.cap - slot.skipped, self.cap, seq);
        }
        self.unclaim(at, at + need, seq);
        let before = self.rx.consumed();
        self.rx.consume(slot, len).expect("valid frame");
        assert_eq!(self.rx.consumed(), before + (slot.skipped + need) as u64);
        // A consumed frame must never be read again: poison it.
        self.mem[at..at + need].fill(0xee);
        self.credits.on_consumed(self.rx.consumed());
        self.expected_seq += 1;
        true
    }

    /// The receiver piggy-backs its ack on a frame going back.
    fn return_piggy(&mut self) {
        let ack = self.credits.take_ack();
        assert_eq!(ack, ack_for(self.rx.consumed()));
        assert_eq!(self.credits.unreported(), 0);
        let header = Header {
            kind: FrameKind::Credit,
            status: 0,
            method_id: 0,
            call_id: CallId(0),
            payload_len: 0,
            metadata_len: 0,
            timeout_us: 0,
            ack,
        };
        let mut bytes = [0; HEADER_LEN];
        header.encode(&mut bytes);
        self.back.push_back(Back::Piggy(bytes));
    }

    /// The receiver sends an explicit credit doorbell if one is due.
    fn return_explicit(&mut self) {
        if self.credits.needs_explicit() || self.credits.may_stall_sender() {
            let ack = self.credits.take_ack();
            self.back
                .push_back(Back::Explicit(Doorbell::Credit { ack }.encode()));
            self.stats.explicit_credits += 1;
        }
    }

    /// The sender handles the next credit return. False if none is pending.
    fn deliver_credit(&mut self) -> bool {
        let Some(msg) = self.back.pop_front() else {
            return false;
        };
        let ack = match msg {
            Back::Piggy(bytes) => Header::decode(&bytes).expect("intact header").ack,
            Back::Explicit(imm) => match Doorbell::decode(imm) {
                Some(Doorbell::Credit { ack }) => ack,
                other => panic!("bad credit doorbell {imm:#x}: {other:?}"),
            },
        };
        let tail = self.tx.tail();
        let released = apply_ack(&mut self.tx, ack).expect("acks from the receiver are valid");
        assert_eq!(released % ALIGN as u64, 0);
        assert_eq!(self.tx.tail(), tail + released);
        // In-order acks each land exactly on the position they denote.
        assert_eq!(ack_for(self.tx.tail()), ack);
        self.applied.push(ack);
        true
    }

    /// The sender sees an ack it already applied again: nothing changes.
    fn duplicate_old_ack(&mut self, which: usize) {
        if self.applied.is_empty() {
            return;
        }
        let ack = self.applied[which % self.applied.len()];
        let (head, tail) = (self.tx.head(), self.tx.tail());
        assert_eq!(apply_ack(&mut self.tx, ack), Ok(0), "old ack {ack}");
        assert_eq!((self.tx.head(), self.tx.tail()), (head, tail));
        self.stats.stale_acks += 1;
    }

    /// An ack ahead of everything written is refused and changes nothing.
    fn bogus_ack(&mut self, ahead_units: u16) {
        let ahead = u64::from(ahead_units.max(1));
        let ack = ack_for(self.tx.head() + ahead * ALIGN as u64);
        let (head, tail) = (self.tx.head(), self.tx.tail());
        let in_flight = self.tx.in_flight() / ALIGN as u64;
        assert_eq!(
            apply_ack(&mut self.tx, ack),
            Err(CreditError::TooMuch {
                units: in_flight + ahead,
                in_flight
            })
        );
        assert_eq!((self.tx.head(), self.tx.tail()), (head, tail));
    }

    /// A frame over `max_frame` is refused for good and changes nothing.
    fn send_too_large(&mut self, extra: u16) {
        let len = self.tx.max_frame() + 1 + usize::from(extra);
        let (head, tail) = (self.tx.head(), self.tx.tail());
        assert!(!self.tx.fits(len));
        assert_eq!(self.tx.reserve(len), Err(RingError::TooLarge(len)));
        assert_eq!((self.tx.head(), self.tx.tail()), (head, tail));
    }

    /// Delivers every frame and every credit, returning credits by `rule`.
    fn settle(&mut self, rule: CreditRule) {
        if rule == CreditRule::ExplicitOnly {
            // The receiver applies the rule after every consume, including
            // the last one before settling.
            self.return_explicit();
        }
        loop {
            while self.deliver() {
                if rule == CreditRule::ExplicitOnly {
                    self.return_explicit();
                }
            }
            if !self.deliver_credit() && self.wire.is_empty() {
                break;
            }
        }
        if rule == CreditRule::Piggy {
            self.return_piggy();
            while self.deliver_credit() {}
            assert_eq!(self.tx.in_flight(), 0);
        }
        self.check_invariants();
    }

    fn check_invariants(&self) {
        let (tail, consumed, head) = (self.tx.tail(), self.rx.consumed(), self.tx.head());
        assert!(
            tail <= consumed && consumed <= head,
            "credits not conserved: tail {tail} consumed {consumed} head {head}"
        );
        assert!(self.tx.in_flight() <= self.cap as u64);
        assert_eq!(
            (self.owned_units * ALIGN) as u64,
            head - consumed,
            "reserved-but-unconsumed bytes are exactly the owned ones"
        );
        assert_eq!(self.wire.len() as u64, self.next_seq - self.expected_seq);
        assert!(self.credits.unreported() <= consumed - tail);
    }

    fn apply(&mut self, action: &Action) {
        let max = self.tx.max_frame();
        match *action {
            Action::SendSmall(n) => self.send(HEADER_LEN + usize::from(n) % 257),
            Action::SendAny(n) => self.send(HEADER_LEN + n as usize % (max - HEADER_LEN + 1)),
            Action::SendMax => self.send(max),
            Action::SendTooLarge(extra) => self.send_too_large(extra),
            Action::Deliver => {
                self.deliver();
            }
            Action::DeliverBurst(n) => {
                for _ in 0..n {
                    self.deliver();
                }
            }
            Action::ReturnPiggy => self.return_piggy(),
            Action::ReturnExplicit => self.return_explicit(),
            Action::DeliverCredit => {
                self.deliver_credit();
            }
            Action::DuplicateOldAck(which) => self.duplicate_old_ack(which),
            Action::BogusAck(ahead) => self.bogus_ack(ahead),
        }
        self.check_invariants();
    }

    /// After the run: everything drains, nothing is lost, the ring is whole.
    fn finish(mut self) -> Stats {
        self.settle(CreditRule::Piggy);
        assert_eq!(self.expected_seq, self.next_seq, "every frame delivered");
        assert_eq!(self.tx.in_flight(), 0);
        assert_eq!(self.tx.tail(), self.rx.consumed());
        assert_eq!(self.tx.head(), self.rx.consumed());
        assert_eq!(self.cap as u64 - self.tx.in_flight(), self.cap as u64);
        assert_eq!(self.owned_units, 0);
        assert_eq!(self.credits.unreported(), 0);
        let max = self.tx.max_frame();
        assert!(self.tx.fits(max));
        self.send(max);
        assert!(self.deliver());
        self.stats
    }
}

#[derive(Debug, Clone)]
enum Action {
    /// Send a frame of at most 256 bytes after the header.
    SendSmall(u16),
    /// Send a frame of any length up to `max_frame`.
    SendAny(u32),
    /// Send a frame of exactly `max_frame`.
    SendMax,
    /// Try a frame over `max_frame`.
    SendTooLarge(u16),
    /// The receiver handles one doorbell.
    Deliver,
    /// The receiver handles up to this many doorbells.
    DeliverBurst(u8),
    /// The receiver piggy-backs its ack on a frame going back.
    ReturnPiggy,
    /// The receiver sends an explicit credit, if due.
    ReturnExplicit,
    /// The sender handles one credit return.
    DeliverCredit,
    /// The sender sees an old ack again.
    DuplicateOldAck(usize),
    /// The sender sees an ack ahead of what it wrote.
    BogusAck(u16),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => any::<u16>().prop_map(Action::SendSmall),
        4 => any::<u32>().prop_map(Action::SendAny),
        1 => Just(Action::SendMax),
        1 => any::<u16>().prop_map(Action::SendTooLarge),
        6 => Just(Action::Deliver),
        1 => (1u8..16).prop_map(Action::DeliverBurst),
        2 => Just(Action::ReturnPiggy),
        2 => Just(Action::ReturnExplicit),
        4 => Just(Action::DeliverCredit),
        1 => any::<usize>().prop_map(Action::DuplicateOldAck),
        1 => any::<u16>().prop_map(Action::BogusAck),
    ]
}

fn capacity() -> impl Strategy<Value = usize> {
    (12u32..=16).prop_map(|shift| 1usize << shift)
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
    fn prop_sim_sender_receiver(
        cap in capacity(),
        base in base(),
        actions in proptest::collection::vec(action(), 1..=500),
    ) {
        let mut sim = Sim::new(cap, base, pattern());
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
    let mut sim = Sim::new(cap, base, pattern());
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let r = next();
        let action = match r % 16 {
            0..=3 => Action::SendSmall((r >> 8) as u16),
            4..=6 => Action::SendAny((r >> 8) as u32),
            7 => Action::SendMax,
            8..=10 => Action::Deliver,
            11 => Action::ReturnPiggy,
            12 => Action::ReturnExplicit,
            13 | 14 => Action::DeliverCredit,
            _ => Action::DuplicateOldAck((r >> 8) as usize),
        };
        sim.apply(&action);
    }
    let crossed = sim.rx.consumed() > ACK_MODULUS * ALIGN as u64;
    let stats = sim.finish();
    assert!(crossed, "the run crosses the 2^30-unit ack modulus");
    assert!(stats.sent > 1000, "{stats:?}");
    assert!(stats.wraps > 50, "{stats:?}");
    assert!(stats.blocked > 50, "{stats:?}");
    assert!(stats.stale_acks > 50, "{stats:?}");
    assert!(stats.explicit_credits > 10, "{stats:?}");
}
