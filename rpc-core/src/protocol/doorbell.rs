//! The 32-bit immediate of each RDMA WRITE WITH IMMEDIATE: the doorbell.
//!
//! The receive completion tells the receiver *that* something arrived and on
//! which queue pair; the immediate tells it *what*:
//!
//! - bits 31..30 = `00`: [`Doorbell::Frame`]; bits 29..0 are the frame's
//!   offset in the receiver's ring in [`ALIGN`](super::ALIGN) units. The
//!   offset is the receiver's expected head, or 0 when the sender wrapped.
//! - bits 31..30 = `01`: [`Doorbell::Credit`]; bits 29..0 are the sender's
//!   cumulative released units modulo 2^30 (see [`super::credits`]). The write
//!   is zero-length and touches no ring memory, so credits can always flow,
//!   even when both rings are full.
//! - other tags are invalid.

/// Mask of the 30-bit value field.
pub const VALUE_MASK: u32 = (1 << 30) - 1;

/// A decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doorbell {
    /// A frame starts at this offset (in ALIGN units) of the receiver's ring.
    Frame {
        /// Offset in [`ALIGN`](super::ALIGN) units.
        offset_units: u32,
    },
    /// Credits only (zero-length write).
    Credit {
        /// Cumulative released units modulo 2^30.
        ack: u32,
    },
}

impl Doorbell {
    /// Encodes into an immediate. Values are masked to 30 bits.
    pub fn encode(self) -> u32 {
        todo!("{self:?}")
    }

    /// Decodes an untrusted immediate; `None` for an unknown tag.
    pub fn decode(imm: u32) -> Option<Doorbell> {
        todo!("{imm}")
    }
}
