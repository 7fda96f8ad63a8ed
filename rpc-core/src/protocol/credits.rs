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
        todo!("{self:?} {f:p}")
    }
}

impl std::error::Error for CreditError {}

/// The ack value for a cumulative consumed byte position (ALIGN-aligned).
pub fn ack_for(consumed: u64) -> u32 {
    todo!("{consumed} {ALIGN}")
}

/// Applies an ack to the sender's ring: releases up to the position it
/// denotes. Returns the bytes newly released (0 for a stale or duplicate ack).
pub fn apply_ack(ring: &mut SendRing, ack: u32) -> Result<u64, CreditError> {
    todo!("{ring:?} {ack}")
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
    pub fn on_consumed(&mut self, consumed: u64) {
        todo!("{consumed}")
    }

    /// The ack to put in an outgoing frame; marks everything consumed as reported.
    pub fn take_ack(&mut self) -> u32 {
        todo!()
    }

    /// True when enough is released but unreported that an explicit credit
    /// doorbell should go out now (at least a quarter of the ring).
    pub fn needs_explicit(&self) -> bool {
        todo!("{}", self.capacity)
    }

    /// Bytes consumed but not yet reported.
    pub fn unreported(&self) -> u64 {
        todo!()
    }
}
