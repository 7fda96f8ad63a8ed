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
        todo!("{self:?} {f:p}")
    }
}

impl std::error::Error for RingError {}

/// Checks a capacity: a power of two in `MIN_CAPACITY..=MAX_CAPACITY`.
pub fn check_capacity(capacity: usize) -> Result<(), RingError> {
    todo!("{capacity}")
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
        todo!("{capacity}")
    }

    /// Ring size in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest frame (unaligned length) this ring can ever hold: `capacity / 2`.
    pub fn max_frame(&self) -> usize {
        todo!()
    }

    /// Reserves room for a frame of `len` bytes (unaligned). `Ok(None)` when
    /// the ring has not enough released space now (retry after credits);
    /// `Err(TooLarge)` when it never will. On success `head` advances by
    /// `slot.skipped + align_up(len)`.
    pub fn reserve(&mut self, len: usize) -> Result<Option<Slot>, RingError> {
        todo!("{len}")
    }

    /// Whether `reserve(len)` would succeed now, without reserving.
    pub fn fits(&self, len: usize) -> bool {
        todo!("{len}")
    }

    /// Marks everything before cumulative position `to` as released by the
    /// receiver. Errors (and changes nothing) if `to` is behind the current
    /// tail or ahead of `head`.
    pub fn release(&mut self, to: u64) -> Result<(), RingError> {
        todo!("{to}")
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
        todo!()
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
        todo!("{capacity}")
    }

    /// Ring size in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks a doorbell's offset (in ALIGN units) against the expected head:
    /// equal, or 0 when the head is not at 0 (a wrap, skipping the tail).
    pub fn locate(&self, offset_units: u32) -> Result<Slot, RingError> {
        todo!("{offset_units}")
    }

    /// Bytes from `slot.offset` to the end of the ring: the most a frame
    /// there may span. Read at most this much before validating lengths.
    pub fn room_at(&self, slot: Slot) -> usize {
        todo!("{slot:?}")
    }

    /// Consumes the frame at `slot` of `len` bytes (unaligned): validates that
    /// it fits before the end and is at most `capacity / 2`, then advances the
    /// head by `slot.skipped + align_up(len)`. Changes nothing on error.
    pub fn consume(&mut self, slot: Slot, len: usize) -> Result<(), RingError> {
        todo!("{slot:?} {len}")
    }

    /// Cumulative bytes consumed (what credits report).
    pub fn consumed(&self) -> u64 {
        self.head
    }
}
