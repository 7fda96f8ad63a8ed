//! An incoming message's bytes, wherever they landed.

use crate::fabric::Buffer;

/// The bytes of an incoming message: copied out of the receive ring into a
/// heap buffer that is reused once decoded, or, for a large message, read
/// by rendezvous straight into a fabric buffer that goes back to the
/// registration cache when dropped.
pub(crate) enum Payload {
    /// Copied out of the ring.
    Heap(Vec<u8>),
    /// Read from the peer's lent buffer.
    Lent(Box<dyn Buffer>),
}

impl Payload {
    /// Decodes a `M` from these bytes. A lent (large) payload is decoded
    /// from [`bytes::Bytes`] over its own buffer, from which prost copies a
    /// `bytes` field once (into a `Vec<u8>`) or not at all (into `Bytes`,
    /// which then keeps the buffer), where from a slice it copies it twice;
    /// a heap payload is decoded from a slice and handed to `recycle`.
    pub(crate) fn decode<M: prost::Message + Default>(
        self,
        recycle: impl FnOnce(Payload),
    ) -> Result<M, prost::DecodeError> {
        match self {
            Payload::Heap(_) => {
                let decoded = M::decode(&self[..]);
                recycle(self);
                decoded
            }
            Payload::Lent(_) => M::decode(self.into_bytes()),
        }
    }

    /// The bytes as [`bytes::Bytes`], without a copy.
    pub(crate) fn into_bytes(self) -> prost::bytes::Bytes {
        match self {
            Payload::Heap(v) => v.into(),
            Payload::Lent(b) => prost::bytes::Bytes::from_owner(self::Owned(b)),
        }
    }

    /// The heap buffer, for reuse; `None` for a lent one.
    pub(crate) fn into_heap(self) -> Option<Vec<u8>> {
        match self {
            Payload::Heap(v) => Some(v),
            Payload::Lent(_) => None,
        }
    }
}

/// A lent buffer as the owner of a `Bytes`.
struct Owned(Box<dyn Buffer>);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Default for Payload {
    fn default() -> Self {
        Payload::Heap(Vec::new())
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::Heap(v)
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Payload::Heap(v) => v,
            Payload::Lent(b) => b,
        }
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Payload::Heap(_) => "Heap",
            Payload::Lent(_) => "Lent",
        };
        f.debug_struct("Payload")
            .field("kind", &kind)
            .field("len", &self.len())
            .finish()
    }
}
