//! The fixed-size frame header that starts every frame in a ring.
//!
//! Layout (little-endian, [`HEADER_LEN`] = 32 bytes):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version ([`VERSION`]) |
//! | 1 | 1 | kind ([`FrameKind`]) |
//! | 2 | 2 | status (gRPC code; 0 except in `Error` frames) |
//! | 4 | 4 | method id |
//! | 8 | 8 | call id ([`CallId`](super::CallId)) |
//! | 16 | 4 | payload length |
//! | 20 | 2 | metadata length |
//! | 22 | 2 | flags (reserved, must be 0) |
//! | 24 | 4 | timeout in microseconds (0 = none; saturates) |
//! | 28 | 4 | ack: credits the sender returns for the ring it receives into ([`super::credits`]) |
//!
//! After the header come `metadata_len` bytes of metadata, then
//! `payload_len` bytes of payload (a protobuf message, or the status message
//! of an `Error` frame). A frame occupies `align_up(frame_len)` ring bytes.

use super::CallId;

/// Protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Size of an encoded [`Header`].
pub const HEADER_LEN: usize = 32;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A call: `method_id`, metadata and the request message.
    Request = 1,
    /// A successful reply to `call_id`: metadata and the response message.
    Response = 2,
    /// A failed reply to `call_id`: `status`, metadata and the status message (UTF-8).
    Error = 3,
    /// The caller gave up on `call_id` (deadline or dropped future); no payload.
    Cancel = 4,
    /// Credits only: a header-only frame whose `ack` is the news. The usual
    /// explicit credit return is a zero-length [`Doorbell::Credit`](super::Doorbell)
    /// that needs no ring space; this kind exists for fabrics or peers that
    /// prefer a frame.
    Credit = 5,
}

impl FrameKind {
    /// Parses the wire value.
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        todo!("protocol: FrameKind::from_u8({v})")
    }
}

/// A decoded frame header. Every field is as received: callers bound-check
/// lengths against their limits (decode checks only what the header alone can).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// gRPC status code of an `Error` frame; 0 otherwise.
    pub status: u16,
    /// Method id of a `Request`; 0 otherwise.
    pub method_id: u32,
    /// The call this frame belongs to.
    pub call_id: CallId,
    /// Bytes of payload after the metadata.
    pub payload_len: u32,
    /// Bytes of metadata after the header.
    pub metadata_len: u16,
    /// Caller's timeout in microseconds; 0 means none.
    pub timeout_us: u32,
    /// Piggy-backed credit return (see [`super::credits`]).
    pub ack: u32,
}

/// Why bytes are not a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    Short(usize),
    /// A version this build does not speak.
    Version(u8),
    /// An unknown kind byte.
    Kind(u8),
    /// Non-zero reserved flags.
    Flags(u16),
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        todo!("protocol: HeaderError Display {self:?} {f:p}")
    }
}

impl std::error::Error for HeaderError {}

impl Header {
    /// Total frame length: header + metadata + payload (not aligned).
    pub fn frame_len(&self) -> usize {
        todo!()
    }

    /// Writes the header into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        todo!("{out:?}")
    }

    /// Parses untrusted bytes (at least [`HEADER_LEN`]; extra bytes are ignored).
    /// Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Header, HeaderError> {
        todo!("{bytes:?}")
    }
}
