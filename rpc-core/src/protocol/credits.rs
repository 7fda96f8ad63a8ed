//! Credits: how consumed ring space returns to the sender.
//!
//! Credits are the receiver's cumulative consumed position in [`ALIGN`] units,
//! modulo 2^30 (it fits a doorbell's 30-bit field and the header's `ack`).
//! Because the value is cumulative, a duplicated or stale ack is harmless and
//! a lost one is repaired by the next. The sender turns an ack back into a
//! cumulative byte position with [`apply_ack`], which rejects values that
//! would release bytes never written.
//!
//! The receiver piggy-backs its ack on every frame it sends. When nothing
//! flows back, [`CreditReturn::needs_explicit`] says when to send a
//! zero-length [`Doorbell::Credit`](super::Doorbell): once a quarter of the
//! ring is released but unreported. Since a blocked sender has more than half
//! the ring in flight (frames are at most `capacity / 2`), a blocked sender is
//! always sent credits.
//!
//! That holds for a frame that fits before the end of the ring. A frame that
//! must wrap also needs the skipped tail, so a sender can be blocked with far
//! less in flight: on a 4096-byte ring with the head at 2112 and 128 bytes in
//! flight, a 2048-byte frame needs 1984 skipped + 2048 > 3968 free bytes,
//! while the receiver holds only 128 unreported bytes, below the quarter. With
//! no frame flowing back to carry an ack, both sides would wait forever.
//! [`CreditReturn::may_stall_sender`] detects exactly that case; send an
//! explicit credit when `needs_explicit() || may_stall_sender()`.

use super::{ALIGN, SendRing};

/// Modulus of ack values (units).
pub const ACK_MODULUS: u64 = 1 << 30;

/// Why an ack was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreditError {
    /// The ack would release more than is in flight.
    TooMuch {
        /// Units the ack would release.
        units: u64,
        /// Units actually in flight.
        in_flight: u64,
    },
}

impl std::fmt::Display for CreditError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            CreditError::TooMuch { units, in_flight } => write!(
                f,
                "ack releases {units} units but only {in_flight} are in flight"
            ),
        }
    }
}

impl std::error::Error for CreditError {}

/// The ack value for a cumulative consumed byte position (ALIGN-aligned).
pub fn ack_for(consumed: u64) -> u32 {
    ((consumed / ALIGN as u64) % ACK_MODULUS) as u32
}

/// Units from `tail` (a cumulative byte position) forward to `ack`, modulo
/// [`ACK_MODULUS`]. Only the low 30 bits of `ack` count.
fn ack_distance(tail: u64, ack: u32) -> u64 {
    let tail_units = (tail / ALIGN as u64) % ACK_MODULUS;
    (ack as u64 + ACK_MODULUS - tail_units) % ACK_MODULUS
}

/// Applies an ack to the sender's ring: releases up to the position it
/// denotes. Returns the bytes newly released (0 for a stale or duplicate ack).
///
/// The ack is read modulo 2^30 units as a distance forward from the ring's
/// tail. Up to [`SendRing::in_flight`] it releases that much. An ack behind
/// the tail (forward distance above half the modulus, i.e. less than 2^29
/// units back) is stale: `Ok(0)`, nothing changes. Anything else is ahead of
/// what was written: [`CreditError::TooMuch`], nothing changes. A ring holds
/// at most 2^28 units ([`MAX_CAPACITY`](super::ring::MAX_CAPACITY) / ALIGN),
/// so the two windows never overlap.
pub fn apply_ack(ring: &mut SendRing, ack: u32) -> Result<u64, CreditError> {
    let units = ack_distance(ring.tail(), ack);
    let in_flight = ring.in_flight();
    let bytes = units * ALIGN as u64;
    if bytes <= in_flight {
        ring.release(ring.tail() + bytes)
            .expect("tail + in_flight is the head");
        Ok(bytes)
    } else if units > ACK_MODULUS / 2 {
        Ok(0)
    } else {
        Err(CreditError::TooMuch {
            units,
            in_flight: in_flight / ALIGN as u64,
        })
    }
}

/// The receiver's bookkeeping of credits to return.
#[derive(Debug, Clone)]
pub struct CreditReturn {
    capacity: usize,
    consumed: u64,
    reported: u64,
}

impl CreditReturn {
    /// For a receive ring of `capacity` bytes.
    pub fn new(capacity: usize) -> CreditReturn {
        CreditReturn {
            capacity,
            consumed: 0,
            reported: 0,
        }
    }

    /// Records the ring's cumulative consumed position.
    /// A position behind the one already recorded is ignored.
    pub fn on_consumed(&mut self, consumed: u64) {
        self.consumed = self.consumed.max(consumed);
    }

    /// The ack to put in an outgoing frame; marks everything consumed as reported.
    pub fn take_ack(&mut self) -> u32 {
        self.reported = self.consumed;
        ack_for(self.consumed)
    }

    /// True when enough is released but unreported that an explicit credit
    /// doorbell should go out now (at least a quarter of the ring).
    ///
    /// See also [`CreditReturn::may_stall_sender`], which covers a sender
    /// blocked on a wrap with less than a quarter in flight.
    pub fn needs_explicit(&self) -> bool {
        self.unreported() >= (self.capacity / 4) as u64
    }

    /// True when the unreported bytes alone may keep the sender from
    /// wrapping: once everything is consumed, the sender's head is at the
    /// ring offset `consumed % capacity` with `left` bytes before the end,
    /// and a frame longer than `left` (up to `capacity / 2`) needs `left`
    /// skipped plus itself, which fits only if `unreported <= capacity / 2 -
    /// left`. Check after consuming, alongside [`CreditReturn::needs_explicit`]:
    /// if neither is true and every frame sent has been consumed, any frame
    /// the ring can hold fits in what the sender knows is released (once the
    /// acks already sent arrive).
    pub fn may_stall_sender(&self) -> bool {
        let unreported = self.unreported();
        if unreported == 0 || self.capacity == 0 {
            return false;
        }
        let half = (self.capacity / 2) as u64;
        let cap = self.capacity as u64;
        let left = cap - self.consumed % cap;
        left < half && unreported > half - left
    }

    /// Bytes consumed but not yet reported.
    pub fn unreported(&self) -> u64 {
        self.consumed - self.reported
    }
}

#[cfg(test)]
mod tests {
    use super::super::ring::{RecvRing, Slot, align_up};
    use super::*;

    const CAP: usize = 4096;
    const A: u64 = ALIGN as u64;

    /// A sender with `in_flight` bytes written but not released from
    /// cumulative position `pos`.
    fn ring_at(pos: u64, in_flight: u64) -> SendRing {
        SendRing::with_positions(CAP, pos, pos + in_flight)
    }

    #[test]
    fn ack_for_is_units_mod_2_30() {
        assert_eq!(ack_for(0), 0);
        assert_eq!(ack_for(64), 1);
        assert_eq!(ack_for(64 * 1000), 1000);
        assert_eq!(ack_for(ACK_MODULUS * A - 64), (ACK_MODULUS - 1) as u32);
        assert_eq!(ack_for(ACK_MODULUS * A), 0);
        assert_eq!(ack_for(ACK_MODULUS * A + 128), 2);
        assert_eq!(ack_for(5 * ACK_MODULUS * A + 64 * 7), 7);
    }

    #[test]
    fn ack_distance_modular() {
        assert_eq!(ack_distance(0, 0), 0);
        assert_eq!(ack_distance(0, 5), 5);
        assert_eq!(ack_distance(640, 15), 5);
        // Just below the modulus to just past it.
        let near = (ACK_MODULUS - 2) * A;
        assert_eq!(ack_distance(near, (ACK_MODULUS - 2) as u32), 0);
        assert_eq!(ack_distance(near, (ACK_MODULUS - 1) as u32), 1);
        assert_eq!(ack_distance(near, 0), 2);
        assert_eq!(ack_distance(near, 3), 5);
        // Behind the tail: distance wraps to just under the modulus.
        assert_eq!(ack_distance(640, 9), ACK_MODULUS - 1);
        assert_eq!(
            ack_distance(2 * A, (ACK_MODULUS - 1) as u32),
            ACK_MODULUS - 3
        );
        // Only the low 30 bits count.
        assert_eq!(ack_distance(0, (1 << 30) | 4), 4);
        assert_eq!(ack_distance(0, u32::MAX), ACK_MODULUS - 1);
        // Many laps of the modulus.
        let far = 7 * ACK_MODULUS * A + 100 * A;
        assert_eq!(ack_distance(far, 150), 50);
    }

    #[test]
    fn apply_ack_releases_in_order() {
        let mut ring = ring_at(0, 3072);
        assert_eq!(ring.in_flight(), 3072);
        assert_eq!(apply_ack(&mut ring, 0), Ok(0));
        assert_eq!(apply_ack(&mut ring, 16), Ok(1024));
        assert_eq!(ring.tail(), 1024);
        assert_eq!(apply_ack(&mut ring, 48), Ok(2048));
        assert_eq!(ring.tail(), 3072);
        assert_eq!(ring.in_flight(), 0);
    }

    #[test]
    fn duplicate_and_stale_acks_release_nothing() {
        let mut ring = ring_at(0, 4096);
        assert_eq!(apply_ack(&mut ring, 10), Ok(640));
        assert_eq!(apply_ack(&mut ring, 10), Ok(0), "duplicate");
        assert_eq!(apply_ack(&mut ring, 4), Ok(0), "stale");
        assert_eq!(apply_ack(&mut ring, 0), Ok(0), "stale");
        assert_eq!(ring.tail(), 640);
        assert_eq!(ring.in_flight(), 4096 - 640);
        assert_eq!(apply_ack(&mut ring, 64), Ok(4096 - 640));
        // Stale acks keep releasing nothing with nothing in flight.
        assert_eq!(apply_ack(&mut ring, 63), Ok(0));
        assert_eq!(apply_ack(&mut ring, 64), Ok(0));
        assert_eq!(ring.tail(), 4096);
    }

    #[test]
    fn too_much_is_rejected_and_changes_nothing() {
        let mut ring = ring_at(1 << 20, 1024);
        let tail_units = ack_for(ring.tail());
        // One unit past the head.
        assert_eq!(
            apply_ack(&mut ring, tail_units + 17),
            Err(CreditError::TooMuch {
                units: 17,
                in_flight: 16
            })
        );
        assert_eq!(ring.tail(), 1 << 20);
        assert_eq!(ring.in_flight(), 1024);
        // Far ahead, up to half the modulus.
        let half = (ACK_MODULUS / 2) as u32;
        assert_eq!(
            apply_ack(&mut ring, tail_units + half),
            Err(CreditError::TooMuch {
                units: ACK_MODULUS / 2,
                in_flight: 16
            })
        );
        // Nothing in flight: any ack ahead of the tail is too much.
        let mut empty = ring_at(0, 0);
        assert_eq!(
            apply_ack(&mut empty, 1),
            Err(CreditError::TooMuch {
                units: 1,
                in_flight: 0
            })
        );
        assert_eq!(empty.tail(), 0);
        assert!(
            !CreditError::TooMuch {
                units: 1,
                in_flight: 0
            }
            .to_string()
            .is_empty()
        );
    }

    #[test]
    fn acks_across_the_2_30_wrap() {
        // Tail 3 units before the modulus; 4096 bytes (64 units) in flight.
        let start = (ACK_MODULUS - 3) * A;
        let mut ring = ring_at(start, 4096);
        assert_eq!(ack_for(ring.tail()), (ACK_MODULUS - 3) as u32);
        assert_eq!(apply_ack(&mut ring, (ACK_MODULUS - 1) as u32), Ok(2 * A));
        // The ack value wraps to small numbers; the position keeps counting.
        assert_eq!(apply_ack(&mut ring, 0), Ok(A));
        assert_eq!(ring.tail(), ACK_MODULUS * A);
        assert_eq!(apply_ack(&mut ring, 5), Ok(5 * A));
        // A pre-wrap ack is now stale, not a huge release.
        assert_eq!(apply_ack(&mut ring, (ACK_MODULUS - 2) as u32), Ok(0));
        assert_eq!(
            apply_ack(&mut ring, 62),
            Err(CreditError::TooMuch {
                units: 57,
                in_flight: 56
            })
        );
        assert_eq!(apply_ack(&mut ring, 61), Ok(56 * A));
        assert_eq!(ring.in_flight(), 0);
        assert_eq!(ring.tail(), start + 4096);
    }

    #[test]
    fn sender_and_receiver_across_the_2_30_wrap() {
        // Both sides start just before the ack modulus and push ten rings'
        // worth of frames through, acking after every frame.
        let start = ACK_MODULUS * A - 5 * CAP as u64;
        let mut tx = SendRing::at_position(CAP, start);
        let mut rx = RecvRing::at_position(CAP, start);
        let mut credits = CreditReturn::new(CAP);
        credits.on_consumed(start);
        let _ = credits.take_ack();
        for i in 0..200usize {
            let len = 32 + (i * 97) % 2000;
            let slot = tx.reserve(len).unwrap().expect("acked after every frame");
            let found = rx.locate((slot.offset / ALIGN) as u32).unwrap();
            assert_eq!(found, slot);
            rx.consume(found, len).unwrap();
            credits.on_consumed(rx.consumed());
            let ack = credits.take_ack();
            assert_eq!(
                apply_ack(&mut tx, ack),
                Ok((slot.skipped + align_up(len)) as u64)
            );
            assert_eq!(tx.in_flight(), 0);
        }
        assert!(tx.head() > ACK_MODULUS * A + 5 * CAP as u64);
        assert_eq!(tx.head(), rx.consumed());
    }

    #[test]
    fn credit_return_bookkeeping() {
        let mut c = CreditReturn::new(CAP);
        assert_eq!(c.unreported(), 0);
        assert!(!c.needs_explicit());
        assert!(!c.may_stall_sender());
        c.on_consumed(640);
        assert_eq!(c.unreported(), 640);
        // Positions going backwards are ignored.
        c.on_consumed(320);
        assert_eq!(c.unreported(), 640);
        assert!(!c.needs_explicit());
        c.on_consumed(1024);
        assert!(c.needs_explicit(), "a quarter of the ring unreported");
        assert_eq!(c.take_ack(), 16);
        assert_eq!(c.unreported(), 0);
        assert!(!c.needs_explicit());
        // Taking again repeats the same cumulative ack.
        assert_eq!(c.take_ack(), 16);
        c.on_consumed(1024 + 1023);
        assert!(!c.needs_explicit());
        c.on_consumed(1024 + 1024);
        assert!(c.needs_explicit());
        assert_eq!(c.take_ack(), 32);
    }

    /// The counterexample from the module docs: a wrap-blocked sender with
    /// less than a quarter of the ring unreported.
    #[test]
    fn wrap_blocked_sender_is_detected() {
        let mut tx = SendRing::new(CAP).unwrap();
        let mut rx = RecvRing::new(CAP).unwrap();
        let mut c = CreditReturn::new(CAP);
        // Frames up to 1984 acked; then two 64-byte frames not yet acked.
        for len in [1984, 64, 64] {
            let slot = tx.reserve(len).unwrap().unwrap();
            rx.consume(rx.locate((slot.offset / ALIGN) as u32).unwrap(), len)
                .unwrap();
            c.on_consumed(rx.consumed());
            if len == 1984 {
                apply_ack(&mut tx, c.take_ack()).unwrap();
            }
        }
        assert_eq!((tx.head(), tx.tail()), (2112, 1984));
        assert_eq!(tx.reserve(CAP / 2), Ok(None), "blocked on the wrap");
        assert_eq!(c.unreported(), 128);
        assert!(!c.needs_explicit(), "below a quarter of the ring");
        assert!(c.may_stall_sender());
        apply_ack(&mut tx, c.take_ack()).unwrap();
        assert_eq!(
            tx.reserve(CAP / 2),
            Ok(Some(Slot {
                offset: 0,
                skipped: 1984
            }))
        );
        assert!(!c.may_stall_sender());
    }

    #[test]
    fn may_stall_sender_thresholds() {
        let cap = CAP as u64;
        let mut c = CreditReturn::new(CAP);
        c.on_consumed(cap + 1984);
        let _ = c.take_ack();
        assert!(!c.may_stall_sender(), "nothing unreported");
        // Head at the middle: a frame of at most half the ring never wraps.
        c.on_consumed(cap + 2048);
        assert!(!c.may_stall_sender());
        // left = 1984: a 2048-byte frame needs 4032 bytes, 3968 are free.
        c.on_consumed(cap + 2112);
        assert!(c.may_stall_sender());
        assert!(!c.needs_explicit());
        // Late in the ring the quarter rule fires first.
        let mut d = CreditReturn::new(CAP);
        d.on_consumed(cap + 2944);
        let _ = d.take_ack();
        d.on_consumed(cap + 3008);
        assert!(
            !d.may_stall_sender(),
            "left = 1088 needs more than 960 unreported"
        );
        d.on_consumed(cap + 3968);
        assert!(!d.may_stall_sender());
        assert!(d.needs_explicit());
        // At the ring start nothing is skipped.
        let mut e = CreditReturn::new(CAP);
        e.on_consumed(2 * cap);
        assert!(!e.may_stall_sender());
        assert!(e.needs_explicit());
    }

    /// Exhaustive over one 4096-byte ring: with everything consumed and every
    /// ack sent so far applied, the sender is blocked for some frame size
    /// exactly when `may_stall_sender` holds or more than half the ring is
    /// unreported; and whenever it is blocked, an explicit credit is due.
    #[test]
    fn explicit_credit_rules_cover_every_blocked_sender() {
        let cap = CAP as u64;
        for head_units in 0..(2 * cap / A) {
            let head = 3 * cap + head_units * A;
            for unreported_units in 0..=(cap / A) {
                let unreported = unreported_units * A;
                let tx = SendRing::with_positions(CAP, head - unreported, head);
                let mut c = CreditReturn::new(CAP);
                c.on_consumed(head - unreported);
                let _ = c.take_ack();
                c.on_consumed(head);
                assert_eq!(c.unreported(), tx.in_flight());
                let blocked = (1..=CAP / 2).step_by(ALIGN).any(|len| !tx.fits(len));
                if blocked {
                    assert!(
                        c.needs_explicit() || c.may_stall_sender(),
                        "head {head} unreported {unreported}"
                    );
                }
                assert_eq!(
                    blocked,
                    c.may_stall_sender() || unreported > cap / 2,
                    "head {head} unreported {unreported}"
                );
            }
        }
    }
}
