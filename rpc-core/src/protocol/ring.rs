//! Ring arithmetic for a power-of-two receive ring.
//!
//! Positions are cumulative byte counts (`u64`, never wrapping in practice);
//! the ring offset is `pos % capacity`. Frames start at [`ALIGN`]-aligned
//! offsets and never straddle the end: when a frame does not fit in the space
//! left before the end, the sender skips that tail (it counts as consumed with
//! the frame) and places the frame at offset 0. The doorbell's offset tells the
//! receiver which happened.
//!
//! The sender's [`SendRing`] is its view of the peer's ring: what it has
//! written (`head`) and what the peer has released (`tail`). It never
//! reserves bytes past `tail + capacity`, so it can never overwrite bytes the
//! receiver has not released. The receiver's [`RecvRing`] checks every
//! doorbell against where the next frame must be.
//!
//! Both sides apply the same footprint rule: a frame of `len` bytes occupies
//! `align_up(max(len, 1))` ring bytes, so every frame, even a (never sent in
//! practice) zero-length one, advances the head by at least [`ALIGN`]. A
//! frame that ends exactly at the end of the ring leaves the next one at
//! offset 0 with nothing skipped.

/// Alignment of every frame in a ring, in bytes.
pub const ALIGN: usize = 64;
/// Smallest ring accepted.
pub const MIN_CAPACITY: usize = 4096;
/// Largest ring accepted (offsets travel in 30 bits of ALIGN units, and
/// credits modulo 2^30 units must stay unambiguous).
pub const MAX_CAPACITY: usize = 1 << 34;

/// Rounds `len` up to a multiple of [`ALIGN`].
pub const fn align_up(len: usize) -> usize {
    (len + ALIGN - 1) & !(ALIGN - 1)
}

/// Where a frame goes (sender) or was found (receiver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset of the frame in the ring (ALIGN-aligned).
    pub offset: usize,
    /// Bytes skipped at the end of the ring before this frame (0 unless wrapped).
    pub skipped: usize,
}

/// Why a ring operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingError {
    /// Capacity not a power of two in `MIN_CAPACITY..=MAX_CAPACITY`.
    Capacity(usize),
    /// A frame larger than the largest the ring can ever hold (`capacity / 2`).
    TooLarge(usize),
    /// A doorbell offset that is neither the expected head nor a valid wrap.
    Offset {
        /// Offset the doorbell named, in bytes.
        got: usize,
        /// Offset where the next frame must start.
        expected: usize,
    },
    /// A frame length that runs past the end of the ring from its offset.
    Overrun {
        /// Frame offset.
        offset: usize,
        /// Frame length (unaligned).
        len: usize,
    },
    /// A release beyond what was written, or going backwards.
    Release {
        /// Requested released position.
        to: u64,
        /// Current released position.
        tail: u64,
        /// Current written position.
        head: u64,
    },
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RingError::Capacity(c) => write!(
                f,
                "ring capacity {c} is not a power of two in {MIN_CAPACITY}..={MAX_CAPACITY}"
            ),
            RingError::TooLarge(len) => {
                write!(f, "frame of {len} bytes exceeds the ring's largest frame")
            }
            RingError::Offset { got, expected } => write!(
                f,
                "doorbell offset {got} is neither the expected head {expected} nor a wrap to 0"
            ),
            RingError::Overrun { offset, len } => {
                write!(
                    f,
                    "frame of {len} bytes at offset {offset} runs past the ring end"
                )
            }
            RingError::Release { to, tail, head } => write!(
                f,
                "release to {to} outside released {tail} ..= written {head}"
            ),
        }
    }
}

impl std::error::Error for RingError {}

/// Checks a capacity: a power of two in `MIN_CAPACITY..=MAX_CAPACITY`.
pub fn check_capacity(capacity: usize) -> Result<(), RingError> {
    if capacity.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        Ok(())
    } else {
        Err(RingError::Capacity(capacity))
    }
}

/// Ring bytes a frame of `len` bytes occupies: `align_up(max(len, 1))`.
/// Callers have bounded `len` by `capacity / 2`, so this cannot overflow.
const fn footprint(len: usize) -> usize {
    if len == 0 { ALIGN } else { align_up(len) }
}

/// Where a frame of footprint `need` goes when the head is at ring offset
/// `off`: in place if it fits before the end, else at 0 after skipping the tail.
fn place(capacity: usize, off: usize, need: usize) -> Slot {
    let left = capacity - off;
    if need <= left {
        Slot {
            offset: off,
            skipped: 0,
        }
    } else {
        Slot {
            offset: 0,
            skipped: left,
        }
    }
}

/// Ring offset of a cumulative position.
fn ring_offset(capacity: usize, pos: u64) -> usize {
    // capacity is a power of two that fits in usize, so the remainder does too.
    (pos % capacity as u64) as usize
}

/// The sender's view of the peer's receive ring.
#[derive(Debug, Clone)]
pub struct SendRing {
    capacity: usize,
    head: u64,
    tail: u64,
}

impl SendRing {
    /// A view of an empty ring of `capacity` bytes.
    pub fn new(capacity: usize) -> Result<SendRing, RingError> {
        check_capacity(capacity)?;
        Ok(SendRing {
            capacity,
            head: 0,
            tail: 0,
        })
    }

    /// An empty ring whose cumulative head and tail both start at `pos`
    /// (ALIGN-aligned), to exercise large positions without the traffic.
    #[cfg(test)]
    pub(crate) fn at_position(capacity: usize, pos: u64) -> SendRing {
        check_capacity(capacity).unwrap();
        assert_eq!(pos % ALIGN as u64, 0);
        SendRing {
            capacity,
            head: pos,
            tail: pos,
        }
    }

    /// A ring with released position `tail` and written position `head`
    /// (both ALIGN-aligned, at most a capacity apart).
    #[cfg(test)]
    pub(crate) fn with_positions(capacity: usize, tail: u64, head: u64) -> SendRing {
        check_capacity(capacity).unwrap();
        assert_eq!(tail % ALIGN as u64, 0);
        assert_eq!(head % ALIGN as u64, 0);
        assert!(tail <= head && head - tail <= capacity as u64);
        SendRing {
            capacity,
            head,
            tail,
        }
    }

    /// Where `reserve(len)` would put the frame and whether it fits now.
    fn plan(&self, len: usize) -> Result<Option<Slot>, RingError> {
        if len > self.max_frame() {
            return Err(RingError::TooLarge(len));
        }
        let need = footprint(len);
        let slot = place(self.capacity, ring_offset(self.capacity, self.head), need);
        let free = self.capacity as u64 - self.in_flight();
        if (slot.skipped + need) as u64 <= free {
            Ok(Some(slot))
        } else {
            Ok(None)
        }
    }

    /// Ring size in bytes.
    #[cfg(any(test, feature = "testing"))]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest frame (unaligned length) this ring can ever hold: `capacity / 2`.
    pub fn max_frame(&self) -> usize {
        self.capacity / 2
    }

    /// Reserves room for a frame of `len` bytes (unaligned). `Ok(None)` when
    /// the ring has not enough released space now (retry after credits);
    /// `Err(TooLarge)` when it never will. On success `head` advances by
    /// `slot.skipped + align_up(len)`.
    ///
    /// The frame goes at the current head offset if `align_up(len)` bytes
    /// remain before the end of the ring, else at offset 0 with the tail
    /// skipped; the skipped bytes count as used until the receiver releases
    /// them with the frame. Since a frame is at most `capacity / 2`, skipped
    /// plus frame is always less than the capacity, so `Ok(None)` always
    /// turns into a success once everything in flight is released.
    pub fn reserve(&mut self, len: usize) -> Result<Option<Slot>, RingError> {
        let planned = self.plan(len)?;
        if let Some(slot) = planned {
            self.head += (slot.skipped + footprint(len)) as u64;
        }
        Ok(planned)
    }

    /// Whether `reserve(len)` would succeed now, without reserving.
    #[cfg(any(test, feature = "testing"))]
    pub fn fits(&self, len: usize) -> bool {
        matches!(self.plan(len), Ok(Some(_)))
    }

    /// Marks everything before cumulative position `to` as released by the
    /// receiver. Errors (and changes nothing) if `to` is behind the current
    /// tail or ahead of `head`.
    pub fn release(&mut self, to: u64) -> Result<(), RingError> {
        if to < self.tail || to > self.head {
            return Err(RingError::Release {
                to,
                tail: self.tail,
                head: self.head,
            });
        }
        self.tail = to;
        Ok(())
    }

    /// Cumulative bytes reserved.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Cumulative bytes released by the receiver.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Bytes not yet released (`head - tail`).
    pub fn in_flight(&self) -> u64 {
        self.head - self.tail
    }
}

/// The receiver's own ring: where the next frame must be.
#[derive(Debug, Clone)]
pub struct RecvRing {
    capacity: usize,
    head: u64,
}

impl RecvRing {
    /// An empty ring of `capacity` bytes.
    pub fn new(capacity: usize) -> Result<RecvRing, RingError> {
        check_capacity(capacity)?;
        Ok(RecvRing { capacity, head: 0 })
    }

    /// An empty ring whose cumulative head starts at `pos` (ALIGN-aligned).
    #[cfg(test)]
    pub(crate) fn at_position(capacity: usize, pos: u64) -> RecvRing {
        check_capacity(capacity).unwrap();
        assert_eq!(pos % ALIGN as u64, 0);
        RecvRing {
            capacity,
            head: pos,
        }
    }

    /// The slot a frame at byte `offset` would be in now, if valid.
    fn slot_at(&self, offset: usize) -> Result<Slot, RingError> {
        let expected = ring_offset(self.capacity, self.head);
        if offset == expected {
            Ok(Slot { offset, skipped: 0 })
        } else if offset == 0 {
            // expected != 0 here: a wrap skipping the tail of the ring.
            Ok(Slot {
                offset: 0,
                skipped: self.capacity - expected,
            })
        } else {
            Err(RingError::Offset {
                got: offset,
                expected,
            })
        }
    }

    /// Ring size in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks a doorbell's offset (in ALIGN units) against the expected head:
    /// equal, or 0 when the head is not at 0 (a wrap, skipping the tail).
    ///
    /// Offsets at or beyond the capacity are refused like any other
    /// unexpected offset.
    pub fn locate(&self, offset_units: u32) -> Result<Slot, RingError> {
        // At most (2^32 - 1) * 64: fits a 64-bit usize.
        let offset = offset_units as usize * ALIGN;
        self.slot_at(offset)
    }

    /// Bytes from `slot.offset` to the end of the ring: the most a frame
    /// there may span. Read at most this much before validating lengths.
    pub fn room_at(&self, slot: Slot) -> usize {
        self.capacity.saturating_sub(slot.offset)
    }

    /// Consumes the frame at `slot` of `len` bytes (unaligned): validates that
    /// it fits before the end and is at most `capacity / 2`, then advances the
    /// head by `slot.skipped + align_up(len)`. Changes nothing on error.
    ///
    /// Errors: [`RingError::Offset`] if `slot` is not what
    /// [`RecvRing::locate`] returns for its offset now (for instance consumed
    /// twice), [`RingError::TooLarge`] if `len > capacity / 2`,
    /// [`RingError::Overrun`] if the frame runs past the end of the ring. The
    /// head advances by `slot.skipped + align_up(max(len, 1))`, the sender's
    /// footprint rule.
    pub fn consume(&mut self, slot: Slot, len: usize) -> Result<(), RingError> {
        if self.slot_at(slot.offset)? != slot {
            return Err(RingError::Offset {
                got: slot.offset,
                expected: ring_offset(self.capacity, self.head),
            });
        }
        if len > self.capacity / 2 {
            return Err(RingError::TooLarge(len));
        }
        if len > self.capacity - slot.offset {
            return Err(RingError::Overrun {
                offset: slot.offset,
                len,
            });
        }
        self.head += (slot.skipped + footprint(len)) as u64;
        Ok(())
    }

    /// Cumulative bytes consumed (what credits report).
    pub fn consumed(&self) -> u64 {
        self.head
    }
}

/// Where a sender encodes frames before their writes are posted: a ring of
/// its own, half the size of the peer's, not a mirror of it.
///
/// A frame's bytes are needed until its write has executed, which a
/// reliable connection reports (in order) by completing a signaled write at
/// or after it, or which the peer's credit for the frame proves (it read
/// the frame, so the write had executed); the peer's ring holds them much
/// longer, until the receiver has consumed them and its credit came back.
/// So staging space is freed by send completions (or credits, whichever
/// comes first), and a frame's staging offset has nothing to do with its
/// offset in the peer's ring. Every frame fits: frames are at most half
/// the peer's ring, which is this ring's capacity, and an empty staging
/// ring places a frame at its start.
#[derive(Debug, Clone)]
pub struct Staging {
    capacity: usize,
    head: u64,
    tail: u64,
    /// Writes holding staged bytes, oldest first: `(wr_id, head after its
    /// bytes, peer ring position after its bytes)`. Completing `wr_id`, or
    /// the peer releasing its ring to that position, frees everything
    /// before that head.
    held: std::collections::VecDeque<(u64, u64, u64)>,
}

impl Staging {
    /// The staging ring for a peer ring of `peer_ring` bytes (a valid ring
    /// capacity): `peer_ring / 2` bytes, the largest frame it takes.
    pub fn for_peer_ring(peer_ring: usize) -> Result<Staging, RingError> {
        check_capacity(peer_ring)?;
        Ok(Staging {
            capacity: staging_size(peer_ring),
            head: 0,
            tail: 0,
            held: std::collections::VecDeque::new(),
        })
    }

    /// Bytes of the staging area.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Where a frame of `len` bytes would go now, and the head after it.
    fn plan(&self, len: usize) -> Option<(usize, u64)> {
        let need = footprint(len);
        if need > self.capacity {
            return None;
        }
        let off = ring_offset(self.capacity, self.head);
        let slot = place(self.capacity, off, need);
        let start = self.head + slot.skipped as u64;
        if self.head == self.tail {
            // Empty: the skipped tail is free to drop at once.
            return Some((slot.offset, start + need as u64));
        }
        let free = self.capacity as u64 - (self.head - self.tail);
        ((slot.skipped + need) as u64 <= free).then_some((slot.offset, start + need as u64))
    }

    /// Whether a frame of `len` bytes fits now.
    pub fn fits(&self, len: usize) -> bool {
        self.plan(len).is_some()
    }

    /// Reserves room for a frame of `len` bytes: its offset, or `None` until
    /// writes complete.
    pub fn reserve(&mut self, len: usize) -> Option<usize> {
        let (offset, head) = self.plan(len)?;
        if self.head == self.tail {
            self.tail = head - footprint(len) as u64;
        }
        self.head = head;
        Some(offset)
    }

    /// The frames reserved so far go out in the write `wr_id`, and end at
    /// cumulative position `ring_end` of the peer's ring.
    pub fn hold(&mut self, wr_id: u64, ring_end: u64) {
        match self.held.back_mut() {
            Some((id, end, ring)) if *id == wr_id => (*end, *ring) = (self.head, ring_end),
            _ => self.held.push_back((wr_id, self.head, ring_end)),
        }
    }

    /// The write `wr_id` and every one before it completed: their bytes are free.
    pub fn complete(&mut self, wr_id: u64) {
        self.free_while(|id, _| id <= wr_id);
    }

    /// The peer released its ring up to cumulative position `ring_tail`:
    /// it read the frames before it, so their writes executed.
    pub fn released(&mut self, ring_tail: u64) {
        self.free_while(|_, ring_end| ring_end <= ring_tail);
    }

    fn free_while(&mut self, done: impl Fn(u64, u64) -> bool) {
        while let Some(&(id, end, ring_end)) = self.held.front() {
            if !done(id, ring_end) {
                break;
            }
            self.tail = end;
            self.held.pop_front();
        }
    }

    /// Bytes reserved and not yet freed.
    #[cfg(test)]
    pub fn in_use(&self) -> u64 {
        self.head - self.tail
    }
}

/// Bytes of the staging area for a peer ring of `peer_ring` bytes: half of
/// it, the largest frame the peer's ring takes.
pub const fn staging_size(peer_ring: usize) -> usize {
    peer_ring / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: usize = 4096;

    fn rings() -> (SendRing, RecvRing) {
        (SendRing::new(CAP).unwrap(), RecvRing::new(CAP).unwrap())
    }

    /// Receiver side of a frame the sender placed at `slot`.
    fn deliver(rx: &mut RecvRing, slot: Slot, len: usize) {
        let found = rx.locate((slot.offset / ALIGN) as u32).unwrap();
        assert_eq!(found, slot);
        rx.consume(found, len).unwrap();
    }

    #[test]
    fn align_up_and_footprint() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), 64);
        assert_eq!(align_up(64), 64);
        assert_eq!(align_up(65), 128);
        assert_eq!(footprint(0), 64);
        assert_eq!(footprint(1), 64);
        assert_eq!(footprint(64), 64);
        assert_eq!(footprint(129), 192);
    }

    #[test]
    fn capacity_checks() {
        for bad in [
            0,
            1,
            64,
            2048,
            4095,
            4097,
            6144,
            MAX_CAPACITY * 2,
            usize::MAX,
        ] {
            assert_eq!(check_capacity(bad), Err(RingError::Capacity(bad)));
            assert_eq!(SendRing::new(bad).unwrap_err(), RingError::Capacity(bad));
            assert_eq!(RecvRing::new(bad).unwrap_err(), RingError::Capacity(bad));
        }
        for good in [MIN_CAPACITY, 8192, 1 << 20, MAX_CAPACITY] {
            assert_eq!(check_capacity(good), Ok(()));
            let s = SendRing::new(good).unwrap();
            assert_eq!(s.capacity(), good);
            assert_eq!(s.max_frame(), good / 2);
            assert_eq!((s.head(), s.tail(), s.in_flight()), (0, 0, 0));
            let r = RecvRing::new(good).unwrap();
            assert_eq!((r.capacity(), r.consumed()), (good, 0));
        }
    }

    #[test]
    fn reserve_advances_by_aligned_length() {
        let (mut tx, mut rx) = rings();
        let a = tx.reserve(100).unwrap().unwrap();
        assert_eq!(
            a,
            Slot {
                offset: 0,
                skipped: 0
            }
        );
        assert_eq!(tx.head(), 128);
        let b = tx.reserve(64).unwrap().unwrap();
        assert_eq!(
            b,
            Slot {
                offset: 128,
                skipped: 0
            }
        );
        assert_eq!(tx.head(), 192);
        let c = tx.reserve(0).unwrap().unwrap();
        assert_eq!(
            c,
            Slot {
                offset: 192,
                skipped: 0
            }
        );
        assert_eq!(
            tx.head(),
            256,
            "a zero-length frame still occupies ALIGN bytes"
        );
        assert_eq!(tx.in_flight(), 256);
        deliver(&mut rx, a, 100);
        deliver(&mut rx, b, 64);
        deliver(&mut rx, c, 0);
        assert_eq!(rx.consumed(), tx.head());
    }

    #[test]
    fn reserve_blocks_until_released() {
        let (mut tx, _) = rings();
        assert!(tx.reserve(2048).unwrap().is_some());
        assert!(tx.reserve(2048).unwrap().is_some());
        assert_eq!(tx.in_flight(), CAP as u64);
        assert!(!tx.fits(1));
        assert_eq!(tx.reserve(1), Ok(None));
        assert_eq!(tx.head(), CAP as u64, "a refused reserve changes nothing");
        tx.release(64).unwrap();
        assert!(tx.fits(64));
        assert!(!tx.fits(65));
        assert_eq!(tx.reserve(65), Ok(None));
        assert_eq!(
            tx.reserve(64),
            Ok(Some(Slot {
                offset: 0,
                skipped: 0
            }))
        );
    }

    #[test]
    fn exact_fill_to_end_does_not_skip() {
        let (mut tx, mut rx) = rings();
        let a = tx.reserve(CAP / 2 - 64).unwrap().unwrap();
        let b = tx.reserve(CAP / 2 - 64).unwrap().unwrap();
        // 128 bytes left before the end: a 128-byte frame fills it exactly.
        let c = tx.reserve(100).unwrap().unwrap();
        assert_eq!(
            c,
            Slot {
                offset: CAP - 128,
                skipped: 0
            }
        );
        assert_eq!(tx.head(), CAP as u64);
        for (slot, len) in [(a, CAP / 2 - 64), (b, CAP / 2 - 64), (c, 100)] {
            deliver(&mut rx, slot, len);
        }
        tx.release(rx.consumed()).unwrap();
        // Next frame starts at 0 with nothing skipped.
        let d = tx.reserve(10).unwrap().unwrap();
        assert_eq!(
            d,
            Slot {
                offset: 0,
                skipped: 0
            }
        );
        assert_eq!(rx.locate(0), Ok(d));
        deliver(&mut rx, d, 10);
        assert_eq!(rx.consumed(), CAP as u64 + 64);
    }

    #[test]
    fn wrap_skips_the_tail() {
        let (mut tx, mut rx) = rings();
        // Fill up to offset 3072 with frames, then release them.
        let mut slots = Vec::new();
        for _ in 0..3 {
            slots.push(tx.reserve(1024).unwrap().unwrap());
        }
        assert_eq!(tx.head(), 3072);
        for s in slots {
            deliver(&mut rx, s, 1024);
        }
        tx.release(rx.consumed()).unwrap();
        // 1024 bytes left before the end; a 1025-byte frame wraps.
        assert!(tx.fits(1025));
        let w = tx.reserve(1025).unwrap().unwrap();
        assert_eq!(
            w,
            Slot {
                offset: 0,
                skipped: 1024
            }
        );
        assert_eq!(tx.head(), 3072 + 1024 + 1088);
        assert_eq!(tx.in_flight(), 1024 + 1088);
        // The receiver sees a doorbell at 0 while expecting 3072: a wrap.
        let found = rx.locate(0).unwrap();
        assert_eq!(found, w);
        assert_eq!(rx.room_at(found), CAP);
        rx.consume(found, 1025).unwrap();
        assert_eq!(rx.consumed(), tx.head());
        tx.release(rx.consumed()).unwrap();
        assert_eq!(tx.in_flight(), 0);
    }

    #[test]
    fn wrap_needs_room_for_skip_and_frame() {
        let (mut tx, _) = rings();
        // Head at 3072, tail at 1024: 2048 in flight, 2048 free, 1024 before the end.
        tx.reserve(2048).unwrap().unwrap();
        tx.reserve(1024).unwrap().unwrap();
        tx.release(1024).unwrap();
        // The frame would need 1024 skipped + 1088: 2112 > 2048 free.
        assert!(!tx.fits(1025));
        assert_eq!(tx.reserve(1025), Ok(None));
        assert_eq!(tx.head(), 3072);
        // A frame that fits before the end needs no skip.
        assert!(tx.fits(1024));
        // One more released unit makes the wrap fit.
        tx.release(1088).unwrap();
        assert_eq!(
            tx.reserve(1025),
            Ok(Some(Slot {
                offset: 0,
                skipped: 1024
            }))
        );
        assert_eq!(tx.in_flight(), CAP as u64);
    }

    #[test]
    fn too_large() {
        let (mut tx, mut rx) = rings();
        assert!(tx.fits(CAP / 2));
        assert!(!tx.fits(CAP / 2 + 1));
        assert_eq!(
            tx.reserve(CAP / 2 + 1),
            Err(RingError::TooLarge(CAP / 2 + 1))
        );
        assert_eq!(tx.reserve(usize::MAX), Err(RingError::TooLarge(usize::MAX)));
        assert_eq!(tx.head(), 0);
        let s = tx.reserve(CAP / 2).unwrap().unwrap();
        let slot = rx.locate(0).unwrap();
        assert_eq!(slot, s);
        assert_eq!(
            rx.consume(slot, CAP / 2 + 1),
            Err(RingError::TooLarge(CAP / 2 + 1))
        );
        assert_eq!(rx.consumed(), 0);
        rx.consume(slot, CAP / 2).unwrap();
        assert_eq!(rx.consumed(), (CAP / 2) as u64);
    }

    #[test]
    fn locate_checks_offsets() {
        let mut rx = RecvRing::new(CAP).unwrap();
        // At head 0 only offset 0 is valid, and it is not a wrap.
        assert_eq!(
            rx.locate(0),
            Ok(Slot {
                offset: 0,
                skipped: 0
            })
        );
        assert_eq!(
            rx.locate(1),
            Err(RingError::Offset {
                got: 64,
                expected: 0
            })
        );
        rx.consume(
            Slot {
                offset: 0,
                skipped: 0,
            },
            200,
        )
        .unwrap();
        assert_eq!(rx.consumed(), 256);
        assert_eq!(
            rx.locate(4),
            Ok(Slot {
                offset: 256,
                skipped: 0
            })
        );
        assert_eq!(
            rx.locate(0),
            Ok(Slot {
                offset: 0,
                skipped: CAP - 256
            })
        );
        for bad in [1u32, 3, 5, 63] {
            assert_eq!(
                rx.locate(bad),
                Err(RingError::Offset {
                    got: bad as usize * 64,
                    expected: 256
                })
            );
        }
        // Offsets at or past the end of the ring.
        for bad in [64u32, 65, 1 << 29, (1 << 30) - 1, u32::MAX] {
            assert_eq!(
                rx.locate(bad),
                Err(RingError::Offset {
                    got: bad as usize * 64,
                    expected: 256
                })
            );
        }
    }

    #[test]
    fn locate_after_full_lap() {
        let mut rx = RecvRing::at_position(CAP, 3 * CAP as u64);
        assert_eq!(
            rx.locate(0),
            Ok(Slot {
                offset: 0,
                skipped: 0
            })
        );
        rx.consume(
            Slot {
                offset: 0,
                skipped: 0,
            },
            CAP / 2,
        )
        .unwrap();
        rx.consume(
            Slot {
                offset: CAP / 2,
                skipped: 0,
            },
            CAP / 2,
        )
        .unwrap();
        assert_eq!(rx.consumed(), 4 * CAP as u64);
        assert_eq!(
            rx.locate(0),
            Ok(Slot {
                offset: 0,
                skipped: 0
            })
        );
    }

    #[test]
    fn consume_rejects_overrun() {
        let mut rx = RecvRing::new(CAP).unwrap();
        assert_eq!(
            rx.consume(
                Slot {
                    offset: 0,
                    skipped: 0
                },
                3072
            ),
            Err(RingError::TooLarge(3072))
        );
        // Move the head to 3072 with legal frames.
        for off in [0, 1024, 2048] {
            rx.consume(
                Slot {
                    offset: off,
                    skipped: 0,
                },
                1024,
            )
            .unwrap();
        }
        let slot = rx.locate(48).unwrap();
        assert_eq!(
            slot,
            Slot {
                offset: 3072,
                skipped: 0
            }
        );
        assert_eq!(rx.room_at(slot), 1024);
        assert_eq!(
            rx.consume(slot, 1025),
            Err(RingError::Overrun {
                offset: 3072,
                len: 1025
            })
        );
        assert_eq!(rx.consumed(), 3072, "errors change nothing");
        // Exactly to the end is fine.
        rx.consume(slot, 1024).unwrap();
        assert_eq!(rx.consumed(), CAP as u64);
        assert_eq!(
            rx.locate(0),
            Ok(Slot {
                offset: 0,
                skipped: 0
            })
        );
    }

    #[test]
    fn consume_rejects_stale_or_forged_slots() {
        let mut rx = RecvRing::new(CAP).unwrap();
        let first = rx.locate(0).unwrap();
        rx.consume(first, 100).unwrap();
        // Consuming the same slot twice: the head moved on.
        assert_eq!(
            rx.consume(first, 100),
            Err(RingError::Offset {
                got: 0,
                expected: 128
            })
        );
        let wrap = rx.locate(0).unwrap();
        assert_eq!(
            wrap,
            Slot {
                offset: 0,
                skipped: CAP - 128
            }
        );
        // Slots locate would not return now.
        for forged in [
            Slot {
                offset: 0,
                skipped: 64,
            },
            Slot {
                offset: 128,
                skipped: 64,
            },
            Slot {
                offset: 192,
                skipped: 0,
            },
            Slot {
                offset: 129,
                skipped: 0,
            },
            Slot {
                offset: CAP + 128,
                skipped: 0,
            },
        ] {
            assert!(
                matches!(rx.consume(forged, 64), Err(RingError::Offset { .. })),
                "{forged:?}"
            );
        }
        assert_eq!(rx.consumed(), 128);
        rx.consume(wrap, 64).unwrap();
        assert_eq!(rx.consumed(), CAP as u64 + 64);
    }

    #[test]
    fn room_at_never_panics() {
        let rx = RecvRing::new(CAP).unwrap();
        assert_eq!(
            rx.room_at(Slot {
                offset: 0,
                skipped: 0
            }),
            CAP
        );
        assert_eq!(
            rx.room_at(Slot {
                offset: 4032,
                skipped: 0
            }),
            64
        );
        assert_eq!(
            rx.room_at(Slot {
                offset: CAP * 2,
                skipped: 0
            }),
            0
        );
    }

    #[test]
    fn release_bounds() {
        let (mut tx, _) = rings();
        tx.reserve(1000).unwrap().unwrap();
        assert_eq!(
            tx.release(1025),
            Err(RingError::Release {
                to: 1025,
                tail: 0,
                head: 1024
            })
        );
        tx.release(512).unwrap();
        assert_eq!(tx.tail(), 512);
        assert_eq!(
            tx.release(448),
            Err(RingError::Release {
                to: 448,
                tail: 512,
                head: 1024
            })
        );
        assert_eq!(tx.tail(), 512, "errors change nothing");
        tx.release(512).unwrap();
        tx.release(1024).unwrap();
        assert_eq!(tx.in_flight(), 0);
    }

    #[test]
    fn large_positions() {
        let base = (1u64 << 40) + 3 * 64;
        let mut tx = SendRing::at_position(CAP, base);
        let mut rx = RecvRing::at_position(CAP, base);
        for len in [2000, 2048, 1, 2048, 1500, 700] {
            let slot = loop {
                match tx.reserve(len).unwrap() {
                    Some(s) => break s,
                    None => tx.release(rx.consumed()).unwrap(),
                }
            };
            deliver(&mut rx, slot, len);
        }
        assert_eq!(tx.head(), rx.consumed());
    }

    #[test]
    fn errors_display() {
        let errors = [
            RingError::Capacity(3),
            RingError::TooLarge(5),
            RingError::Offset {
                got: 64,
                expected: 0,
            },
            RingError::Overrun {
                offset: 64,
                len: 9000,
            },
            RingError::Release {
                to: 1,
                tail: 2,
                head: 3,
            },
        ];
        for e in errors {
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn staging_is_freed_by_completions() {
        let mut st = Staging::for_peer_ring(CAP).unwrap();
        assert_eq!(st.capacity(), CAP / 2);
        assert_eq!(st.reserve(1000), Some(0));
        st.hold(1, u64::MAX);
        assert_eq!(st.reserve(1000), Some(1024));
        st.hold(1, u64::MAX);
        // 2048 - 2048 = 0 left.
        assert_eq!(st.reserve(1), None);
        st.complete(0);
        assert_eq!(st.reserve(1), None, "write 1 has not completed");
        st.complete(1);
        assert_eq!(st.in_use(), 0);
        assert_eq!(
            st.reserve(2048),
            Some(0),
            "the largest frame fits when empty"
        );
        st.hold(2, u64::MAX);
        st.complete(2);
        // Empty at offset 0 after a full lap; a frame at 1024 then one that
        // must wrap: the skipped tail counts until freed.
        assert_eq!(st.reserve(1024), Some(0));
        st.hold(3, u64::MAX);
        assert_eq!(st.reserve(512), Some(1024));
        st.hold(4, u64::MAX);
        st.complete(3);
        // 512 skipped at the end plus 1088 at the start: more than is free.
        assert_eq!(st.reserve(1088), None);
        assert_eq!(st.reserve(1000), Some(0));
        st.hold(5, u64::MAX);
        st.complete(5);
        assert_eq!(st.in_use(), 0);
    }

    #[test]
    fn an_empty_staging_ring_takes_the_largest_frame_at_any_offset() {
        let mut st = Staging::for_peer_ring(CAP).unwrap();
        assert_eq!(st.reserve(64), Some(0));
        st.hold(1, u64::MAX);
        st.complete(1);
        // Head at 64: 2048 does not fit before the end, but nothing is held.
        assert_eq!(st.reserve(2048), Some(0));
        assert_eq!(st.in_use(), 2048);
        assert_eq!(st.reserve(2049), None);
    }

    #[test]
    fn staging_is_freed_by_the_peers_credits_too() {
        let mut st = Staging::for_peer_ring(CAP).unwrap();
        assert_eq!(st.reserve(1024), Some(0));
        st.hold(1, 1024);
        assert_eq!(st.reserve(1024), Some(1024));
        st.hold(1, 2048);
        assert_eq!(st.reserve(64), None);
        st.released(1024);
        assert_eq!(st.in_use(), 2048, "write 1 holds both frames");
        st.released(2048);
        assert_eq!(st.in_use(), 0);
    }
}
