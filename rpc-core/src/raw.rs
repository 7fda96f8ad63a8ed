//! A message whose type is known only at run time: its encoded bytes,
//! passed through the typed call API unchanged (the `rpc` tool, the gRPC
//! face and proxies).

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType, encode_key, encode_varint};
use prost::{DecodeError, Message};

/// Encoded protobuf bytes, sent and received as they are: a message of
/// any type, for code that learns types at run time (decode them with
/// `prost-reflect`, say) or passes messages on without looking.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RawMessage(pub Vec<u8>);

impl Message for RawMessage {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        // prost has read the field's key. The value is read with prost's
        // own decoders, which check lengths and the recursion limit, and
        // written back with its key.
        let out = &mut self.0;
        match wire_type {
            WireType::Varint => {
                let mut value = 0u64;
                encoding::uint64::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, out);
                encode_varint(value, out);
            }
            WireType::ThirtyTwoBit => {
                let mut value = 0u32;
                encoding::fixed32::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, out);
                out.put_u32_le(value);
            }
            WireType::SixtyFourBit => {
                let mut value = 0u64;
                encoding::fixed64::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, out);
                out.put_u64_le(value);
            }
            WireType::LengthDelimited => {
                let mut value = Vec::new();
                encoding::bytes::merge(wire_type, &mut value, buf, ctx)?;
                encode_key(tag, wire_type, out);
                encode_varint(value.len() as u64, out);
                out.extend_from_slice(&value);
            }
            WireType::StartGroup => {
                let mut group = RawMessage::default();
                encoding::group::merge(tag, wire_type, &mut group, buf, ctx)?;
                encode_key(tag, wire_type, out);
                out.extend_from_slice(&group.0);
                encode_key(tag, WireType::EndGroup, out);
            }
            // A stray end of group: prost's error for it.
            WireType::EndGroup => encoding::skip_field(wire_type, tag, buf, ctx)?,
        }
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wire_type_passes_through_unchanged() {
        let mut wire = Vec::new();
        encode_key(1, WireType::Varint, &mut wire);
        encode_varint(300, &mut wire);
        encode_key(2, WireType::LengthDelimited, &mut wire);
        encode_varint(3, &mut wire);
        wire.extend_from_slice(b"abc");
        encode_key(3, WireType::ThirtyTwoBit, &mut wire);
        wire.extend_from_slice(&7u32.to_le_bytes());
        encode_key(4, WireType::SixtyFourBit, &mut wire);
        wire.extend_from_slice(&9u64.to_le_bytes());
        encode_key(5, WireType::StartGroup, &mut wire);
        encode_key(6, WireType::Varint, &mut wire);
        encode_varint(1, &mut wire);
        encode_key(5, WireType::EndGroup, &mut wire);

        let raw = RawMessage::decode(&wire[..]).unwrap();
        assert_eq!(raw.0, wire);
        assert_eq!(raw.encode_to_vec(), wire);
    }

    #[test]
    fn truncated_or_mismatched_input_is_an_error() {
        // A length beyond the end, a fixed64 cut short, a stray end-group.
        for wire in [&[0x12, 0x05, b'a'][..], &[0x21, 1, 2, 3], &[0x2c]] {
            assert!(RawMessage::decode(wire).is_err(), "{wire:?}");
        }
    }
}
