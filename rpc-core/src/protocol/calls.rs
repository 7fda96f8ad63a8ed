//! The call table: in-flight calls keyed by id + generation.
//!
//! A [`CallId`] is a slab index and a generation. A response whose id does
//! not match a live entry (late after a timeout, duplicated, or forged) is
//! dropped and counted in [`CallTable::stale`], never handed to whichever
//! call now occupies the slot. Deadlines are kept in a min-heap; time is
//! passed in, never read.

use std::time::Instant;

/// Identifies one call on one connection: slab index (low 32 bits) and
/// generation (high 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

impl CallId {
    /// Builds from parts.
    pub fn new(index: u32, generation: u32) -> CallId {
        CallId(((generation as u64) << 32) | index as u64)
    }

    /// The slab index.
    pub fn index(self) -> u32 {
        self.0 as u32
    }

    /// The generation.
    pub fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// In-flight calls, each holding a `T` (the waiter).
#[derive(Debug)]
pub struct CallTable<T> {
    _todo: std::marker::PhantomData<T>,
}

impl<T> Default for CallTable<T> {
    fn default() -> Self {
        CallTable::new()
    }
}

impl<T> CallTable<T> {
    /// An empty table.
    pub fn new() -> CallTable<T> {
        todo!()
    }

    /// Adds a call, optionally with a deadline; returns its id.
    pub fn insert(&mut self, value: T, deadline: Option<Instant>) -> CallId {
        todo!("{deadline:?} {}", std::mem::size_of_val(&value))
    }

    /// Removes and returns the call `id` if it is live (index and generation
    /// match). Otherwise counts a stale id and returns `None`.
    pub fn complete(&mut self, id: CallId) -> Option<T> {
        todo!("{id:?}")
    }

    /// Like [`CallTable::complete`] but does not count a miss as stale (for
    /// local cancellation, which may race with completion).
    pub fn remove(&mut self, id: CallId) -> Option<T> {
        todo!("{id:?}")
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: CallId) -> bool {
        todo!("{id:?}")
    }

    /// The live call `id`, mutably.
    pub fn get_mut(&mut self, id: CallId) -> Option<&mut T> {
        todo!("{id:?}")
    }

    /// Removes and returns one call whose deadline is at or before `now`.
    /// Call repeatedly until `None`. Entries of completed calls left in the
    /// deadline heap are skipped lazily.
    pub fn pop_expired(&mut self, now: Instant) -> Option<(CallId, T)> {
        todo!("{now:?}")
    }

    /// The earliest deadline among live calls (may be one of an already
    /// completed call until lazily skipped; callers just wake early).
    pub fn next_deadline(&self) -> Option<Instant> {
        todo!()
    }

    /// Removes every live call (for a connection that failed).
    pub fn drain(&mut self) -> Vec<(CallId, T)> {
        todo!()
    }

    /// Live calls.
    pub fn len(&self) -> usize {
        todo!()
    }

    /// True when no call is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Responses dropped because their id was not live.
    pub fn stale(&self) -> u64 {
        todo!()
    }
}
