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
        match self {
            Doorbell::Frame { offset_units } => {
                (TAG_FRAME << TAG_SHIFT) | (offset_units & VALUE_MASK)
            }
            Doorbell::Credit { ack } => (TAG_CREDIT << TAG_SHIFT) | (ack & VALUE_MASK),
        }
    }

    /// Decodes an untrusted immediate; `None` for an unknown tag.
    pub fn decode(imm: u32) -> Option<Doorbell> {
        let value = imm & VALUE_MASK;
        match imm >> TAG_SHIFT {
            TAG_FRAME => Some(Doorbell::Frame {
                offset_units: value,
            }),
            TAG_CREDIT => Some(Doorbell::Credit { ack: value }),
            _ => None,
        }
    }
}

/// Position of the 2-bit tag.
const TAG_SHIFT: u32 = 30;
/// Tag of [`Doorbell::Frame`].
const TAG_FRAME: u32 = 0b00;
/// Tag of [`Doorbell::Credit`].
const TAG_CREDIT: u32 = 0b01;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        for units in [0, 1, 63, 12345, VALUE_MASK] {
            let d = Doorbell::Frame {
                offset_units: units,
            };
            let imm = d.encode();
            assert_eq!(imm >> 30, 0b00);
            assert_eq!(imm & VALUE_MASK, units);
            assert_eq!(Doorbell::decode(imm), Some(d));
        }
        assert_eq!(
            Doorbell::decode(0),
            Some(Doorbell::Frame { offset_units: 0 })
        );
    }

    #[test]
    fn credit_round_trip() {
        for ack in [0, 1, 4096, VALUE_MASK] {
            let d = Doorbell::Credit { ack };
            let imm = d.encode();
            assert_eq!(imm >> 30, 0b01);
            assert_eq!(imm & VALUE_MASK, ack);
            assert_eq!(Doorbell::decode(imm), Some(d));
        }
        assert_eq!(
            Doorbell::decode(0x4000_0000),
            Some(Doorbell::Credit { ack: 0 })
        );
        assert_eq!(
            Doorbell::decode(0x7fff_ffff),
            Some(Doorbell::Credit { ack: VALUE_MASK })
        );
    }

    #[test]
    fn encode_masks_values_to_30_bits() {
        assert_eq!(
            Doorbell::Frame {
                offset_units: u32::MAX
            }
            .encode(),
            VALUE_MASK
        );
        assert_eq!(
            Doorbell::Frame {
                offset_units: (1 << 30) | 5
            }
            .encode(),
            5
        );
        assert_eq!(
            Doorbell::Credit { ack: u32::MAX }.encode(),
            (1 << 30) | VALUE_MASK
        );
        assert_eq!(
            Doorbell::decode(Doorbell::Credit { ack: (3 << 30) | 7 }.encode()),
            Some(Doorbell::Credit { ack: 7 })
        );
    }

    #[test]
    fn bad_tags() {
        for imm in [
            0x8000_0000u32,
            0xbfff_ffff,
            0xc000_0000,
            0xffff_ffff,
            0x8000_1234,
        ] {
            assert_eq!(Doorbell::decode(imm), None, "{imm:#x}");
        }
    }

    #[test]
    fn decode_total_over_tag_space() {
        // Every immediate either decodes and re-encodes to itself, or has a bad tag.
        for tag in 0u32..4 {
            for value in [0u32, 1, 0x1555_5555, VALUE_MASK] {
                let imm = (tag << 30) | value;
                match Doorbell::decode(imm) {
                    Some(d) => {
                        assert!(tag < 2);
                        assert_eq!(d.encode(), imm);
                    }
                    None => assert!(tag >= 2),
                }
            }
        }
    }
}
