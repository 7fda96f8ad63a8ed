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
//! | 8 | 8 | call id ([`CallId`]) |
//! | 16 | 4 | payload length |
//! | 20 | 2 | metadata length |
//! | 22 | 2 | flags: [`FLAG_LENT`] and the messages' encoding (bits 3-4, [`crate::compression`]) on a `Request`, `Response` or `Message` frame; [`FLAG_REQUEST_STREAM`], [`FLAG_RESPONSE_STREAM`] and the encodings the caller accepts (bits 5-7) on a `Request`; the others reserved, 0 |
//! | 24 | 4 | timeout in microseconds (0 = none; saturates); in a `Window` frame, the grant; in a `Message` frame, how many messages it carries |
//! | 28 | 4 | ack: credits the sender returns for the ring it receives into ([`super::credits`]) |
//!
//! After the header come `metadata_len` bytes of metadata, then
//! `payload_len` bytes of payload (a protobuf message, or the status message
//! of an `Error` frame). A frame occupies `align_up(frame_len)` ring bytes.
//!
//! A frame with [`FLAG_LENT`] carries its message by rendezvous: its
//! payload in the ring is a [`LENT_LEN`]-byte descriptor (`addr u64, len
//! u32, rkey u32`) of a buffer the sender lent to this connection; the
//! receiver pulls the `len` bytes with an RDMA READ, then answers with a
//! `Release` frame.

use super::CallId;

/// A `Request`'s `timeout_us` for a timeout longer than the field can
/// say: the server sets no deadline of its own (the client still enforces
/// its timeout), rather than cut a long one short.
pub const NO_WIRE_DEADLINE: u32 = u32::MAX;

/// A caller's timeout as a `Request`'s `timeout_us`: 0 for none, at least
/// 1 otherwise, [`NO_WIRE_DEADLINE`] for one of about 71.6 minutes or more.
pub fn timeout_field(timeout: Option<std::time::Duration>) -> u32 {
    timeout.map_or(0, |t| {
        t.as_micros().clamp(1, u128::from(NO_WIRE_DEADLINE)) as u32
    })
}

/// The timeout a `Request`'s `timeout_us` gives the server: none for 0 and
/// for [`NO_WIRE_DEADLINE`].
pub fn field_timeout(timeout_us: u32) -> Option<std::time::Duration> {
    (timeout_us != 0 && timeout_us != NO_WIRE_DEADLINE)
        .then(|| std::time::Duration::from_micros(u64::from(timeout_us)))
}

/// Protocol version this build speaks (2: a `Message` frame carries a
/// batch, and one write may carry several frames; 3: lent payloads).
pub const VERSION: u8 = 3;
/// Flag: the payload is lent (a descriptor, see the module docs).
pub const FLAG_LENT: u16 = 1;
/// Flag on a `Request`: the caller sends a stream of requests (a
/// client-streaming or bidirectional call). With neither this nor
/// [`FLAG_RESPONSE_STREAM`] the call is unary. The server refuses a call
/// whose kind is not the method's: each side would otherwise read the
/// other's frames by the wrong rules.
pub const FLAG_REQUEST_STREAM: u16 = 2;
/// Flag on a `Request`: the caller reads a stream of responses (a
/// server-streaming or bidirectional call).
pub const FLAG_RESPONSE_STREAM: u16 = 4;
/// Flags of a `Request`, `Response` or `Message`: the encoding its
/// messages are compressed in (1 gzip, 2 zstd, 3 deflate; 0 none), as
/// [`crate::compression::Encoding`] maps them.
pub const FLAGS_ENCODING: u16 = 0b11 << 3;
/// Flags of a `Request`: the encodings its caller accepts for the answer,
/// one bit each (gzip, zstd, deflate), as
/// [`crate::compression::EncodingSet`] maps them.
pub const FLAGS_ACCEPT: u16 = 0b111 << 5;
/// Bytes of a lent payload's descriptor.
pub const LENT_LEN: usize = 16;
/// Size of an encoded [`Header`].
pub const HEADER_LEN: usize = 32;
/// Where the ack sits in an encoded header.
const ACK_AT: usize = 28;
/// Where the timeout sits in an encoded header.
const TIMEOUT_AT: usize = 24;

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
    /// Messages of a stream (`call_id`), either direction: metadata (on a
    /// stream's first frame from the server, its initial metadata) and
    /// `timeout_us` messages, one as is or several each after its length
    /// ([`super::stream::Records`]). Counts against the stream's window
    /// ([`super::stream`]).
    Message = 6,
    /// The client sends no more messages on the stream `call_id` (its
    /// request stream is complete); no payload.
    HalfClose = 7,
    /// The sender of this frame consumed messages of the stream `call_id`:
    /// the peer may send `timeout_us` (here: the grant, in window bytes)
    /// more ([`super::stream`]). No payload.
    Window = 8,
    /// The sender of this frame has read the lent payload whose rkey is in
    /// `timeout_us`, of a frame of the call `call_id`: the peer may reuse
    /// the buffer. No payload.
    Release = 9,
}

impl FrameKind {
    /// Parses the wire value.
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        match v {
            1 => Some(FrameKind::Request),
            2 => Some(FrameKind::Response),
            3 => Some(FrameKind::Error),
            4 => Some(FrameKind::Cancel),
            5 => Some(FrameKind::Credit),
            6 => Some(FrameKind::Message),
            7 => Some(FrameKind::HalfClose),
            8 => Some(FrameKind::Window),
            9 => Some(FrameKind::Release),
            _ => None,
        }
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
    /// Caller's timeout in microseconds; 0 means none, and
    /// [`NO_WIRE_DEADLINE`] one too long for this field (about 71.6
    /// minutes or more), which the server takes as none.
    pub timeout_us: u32,
    /// Piggy-backed credit return (see [`super::credits`]).
    pub ack: u32,
    /// Flags: [`FLAG_LENT`], and on a `Request` [`FLAG_REQUEST_STREAM`]
    /// and [`FLAG_RESPONSE_STREAM`].
    pub flags: u16,
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
        match *self {
            HeaderError::Short(n) => {
                write!(f, "frame header too short: {n} bytes, need {HEADER_LEN}")
            }
            HeaderError::Version(v) => {
                write!(
                    f,
                    "unsupported protocol version {v} (this build speaks {VERSION})"
                )
            }
            HeaderError::Kind(k) => write!(f, "unknown frame kind {k}"),
            HeaderError::Flags(flags) => write!(f, "reserved header flags set: {flags:#06x}"),
        }
    }
}

impl std::error::Error for HeaderError {}

impl Header {
    /// Total frame length: header + metadata + payload (not aligned).
    pub fn frame_len(&self) -> usize {
        // At most 32 + 65_535 + 4_294_967_295: cannot overflow a 64-bit usize.
        HEADER_LEN + self.metadata_len as usize + self.payload_len as usize
    }

    /// Writes the header into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = VERSION;
        out[1] = self.kind as u8;
        out[2..4].copy_from_slice(&self.status.to_le_bytes());
        out[4..8].copy_from_slice(&self.method_id.to_le_bytes());
        out[8..16].copy_from_slice(&self.call_id.0.to_le_bytes());
        out[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        out[20..22].copy_from_slice(&self.metadata_len.to_le_bytes());
        out[22..24].copy_from_slice(&self.flags.to_le_bytes());
        out[24..28].copy_from_slice(&self.timeout_us.to_le_bytes());
        out[ACK_AT..ACK_AT + 4].copy_from_slice(&self.ack.to_le_bytes());
    }

    /// Replaces the ack of an encoded frame (`frame` starts with a header).
    pub fn set_ack(frame: &mut [u8], ack: u32) {
        frame[ACK_AT..ACK_AT + 4].copy_from_slice(&ack.to_le_bytes());
    }

    /// Replaces the timeout of an encoded frame (`frame` starts with a header).
    pub fn set_timeout(frame: &mut [u8], timeout_us: u32) {
        frame[TIMEOUT_AT..TIMEOUT_AT + 4].copy_from_slice(&timeout_us.to_le_bytes());
    }

    /// Parses untrusted bytes (at least [`HEADER_LEN`]; extra bytes are ignored).
    /// Never panics.
    ///
    /// Checks, in order: length ([`HeaderError::Short`]), version
    /// ([`HeaderError::Version`]), kind ([`HeaderError::Kind`]) and reserved
    /// flags ([`HeaderError::Flags`]).
    pub fn decode(bytes: &[u8]) -> Result<Header, HeaderError> {
        let Some(b) = bytes.first_chunk::<HEADER_LEN>() else {
            return Err(HeaderError::Short(bytes.len()));
        };
        if b[0] != VERSION {
            return Err(HeaderError::Version(b[0]));
        }
        let kind = FrameKind::from_u8(b[1]).ok_or(HeaderError::Kind(b[1]))?;
        let flags = u16_at(b, 22);
        let allowed = match kind {
            FrameKind::Request => {
                FLAG_LENT
                    | FLAG_REQUEST_STREAM
                    | FLAG_RESPONSE_STREAM
                    | FLAGS_ENCODING
                    | FLAGS_ACCEPT
            }
            FrameKind::Response | FrameKind::Message => FLAG_LENT | FLAGS_ENCODING,
            _ => 0,
        };
        if flags & !allowed != 0 {
            return Err(HeaderError::Flags(flags));
        }
        Ok(Header {
            kind,
            status: u16_at(b, 2),
            method_id: u32_at(b, 4),
            call_id: CallId(u64::from_le_bytes([
                b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15],
            ])),
            payload_len: u32_at(b, 16),
            metadata_len: u16_at(b, 20),
            timeout_us: u32_at(b, 24),
            ack: u32_at(b, ACK_AT),
            flags,
        })
    }

    /// Whether the payload is lent ([`FLAG_LENT`]).
    pub fn is_lent(&self) -> bool {
        self.flags & FLAG_LENT != 0
    }

    /// The flags a `Request` of a call of `kind` carries.
    pub fn kind_flags(kind: crate::descriptor::MethodKind) -> u16 {
        let mut flags = 0;
        if kind.client_streams() {
            flags |= FLAG_REQUEST_STREAM;
        }
        if kind.server_streams() {
            flags |= FLAG_RESPONSE_STREAM;
        }
        flags
    }

    /// The kind of call a `Request` opens, from its flags.
    pub fn call_kind(&self) -> crate::descriptor::MethodKind {
        crate::descriptor::MethodKind::of(
            self.flags & FLAG_REQUEST_STREAM != 0,
            self.flags & FLAG_RESPONSE_STREAM != 0,
        )
    }
}

/// A lent payload's descriptor: where the sender's buffer is, how long,
/// and the key that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    /// The buffer's address, as the sender's fabric names it.
    pub addr: u64,
    /// The payload's length.
    pub len: u32,
    /// The key that grants reading it over this connection.
    pub rkey: u32,
}

impl Lent {
    /// The descriptor's bytes.
    pub fn encode(&self) -> [u8; LENT_LEN] {
        let mut b = [0u8; LENT_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Parses untrusted bytes: exactly [`LENT_LEN`] of them. Never panics.
    pub fn decode(b: &[u8]) -> Option<Lent> {
        let b: &[u8; LENT_LEN] = b.try_into().ok()?;
        Some(Lent {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            len: u32::from_le_bytes(b[8..12].try_into().ok()?),
            rkey: u32::from_le_bytes(b[12..].try_into().ok()?),
        })
    }
}

fn u16_at(b: &[u8; HEADER_LEN], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::MethodKind;
    use proptest::prelude::*;

    #[test]
    fn timeouts_the_field_cannot_say_are_none_at_the_server() {
        use std::time::Duration;
        assert_eq!(timeout_field(None), 0);
        assert_eq!(field_timeout(0), None);
        assert_eq!(timeout_field(Some(Duration::ZERO)), 1, "0 would mean none");
        let hour = Duration::from_secs(3600);
        assert_eq!(field_timeout(timeout_field(Some(hour))), Some(hour));
        for long in [Duration::from_secs(2 * 3600), Duration::MAX] {
            assert_eq!(timeout_field(Some(long)), NO_WIRE_DEADLINE);
        }
        assert_eq!(field_timeout(NO_WIRE_DEADLINE), None);
        assert_eq!(
            field_timeout(NO_WIRE_DEADLINE - 1),
            Some(Duration::from_micros(u64::from(NO_WIRE_DEADLINE - 1)))
        );
    }

    fn sample() -> Header {
        Header {
            flags: 0,
            kind: FrameKind::Error,
            status: 0x0102,
            method_id: 0x0304_0506,
            call_id: CallId(0x0708_090a_0b0c_0d0e),
            payload_len: 0x0f10_1112,
            metadata_len: 0x1314,
            timeout_us: 0x1516_1718,
            ack: 0x191a_1b1c,
        }
    }

    fn encoded(h: &Header) -> [u8; HEADER_LEN] {
        let mut out = [0xAA; HEADER_LEN];
        h.encode(&mut out);
        out
    }

    #[test]
    fn encode_matches_documented_layout() {
        let bytes = encoded(&sample());
        let expected: [u8; HEADER_LEN] = [
            VERSION, 3, // version, kind
            0x02, 0x01, // status
            0x06, 0x05, 0x04, 0x03, // method id
            0x0e, 0x0d, 0x0c, 0x0b, 0x0a, 0x09, 0x08, 0x07, // call id
            0x12, 0x11, 0x10, 0x0f, // payload len
            0x14, 0x13, // metadata len
            0x00, 0x00, // flags
            0x18, 0x17, 0x16, 0x15, // timeout
            0x1c, 0x1b, 0x1a, 0x19, // ack
        ];
        assert_eq!(bytes, expected);
    }

    #[test]
    fn round_trip_every_kind() {
        for kind in [
            FrameKind::Request,
            FrameKind::Response,
            FrameKind::Error,
            FrameKind::Cancel,
            FrameKind::Credit,
            FrameKind::Message,
            FrameKind::HalfClose,
            FrameKind::Window,
            FrameKind::Release,
        ] {
            assert_eq!(FrameKind::from_u8(kind as u8), Some(kind));
            let h = Header { kind, ..sample() };
            assert_eq!(Header::decode(&encoded(&h)), Ok(h));
        }
        assert_eq!(FrameKind::from_u8(0), None);
        assert_eq!(FrameKind::from_u8(10), None);
        assert_eq!(FrameKind::from_u8(255), None);
    }

    #[test]
    fn decode_ignores_trailing_bytes() {
        let h = sample();
        let mut buf = [0x55u8; 100];
        buf[..HEADER_LEN].copy_from_slice(&encoded(&h));
        assert_eq!(Header::decode(&buf), Ok(h));
    }

    #[test]
    fn decode_short() {
        let bytes = encoded(&sample());
        for n in 0..HEADER_LEN {
            assert_eq!(Header::decode(&bytes[..n]), Err(HeaderError::Short(n)));
        }
    }

    #[test]
    fn decode_bad_version() {
        let mut bytes = encoded(&sample());
        for v in [0u8, 1, VERSION + 1, 255] {
            bytes[0] = v;
            assert_eq!(Header::decode(&bytes), Err(HeaderError::Version(v)));
        }
    }

    #[test]
    fn decode_bad_kind() {
        let mut bytes = encoded(&sample());
        for k in [0u8, 10, 200] {
            bytes[1] = k;
            assert_eq!(Header::decode(&bytes), Err(HeaderError::Kind(k)));
        }
    }

    #[test]
    fn decode_reserved_flags() {
        let mut bytes = encoded(&sample());
        bytes[22] = 0x01;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(0x0001)));
        bytes[22] = 0;
        bytes[23] = 0x80;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(0x8000)));
    }

    #[test]
    fn decode_checks_version_before_kind_before_flags() {
        let mut bytes = encoded(&sample());
        bytes[0] = 10;
        bytes[1] = 10;
        bytes[23] = 10;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Version(10)));
        bytes[0] = VERSION;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Kind(10)));
        bytes[1] = FrameKind::Request as u8;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(0x0a00)));
        bytes[23] = 0;
        // An encoding: on the kinds that carry a message; the encodings
        // accepted: on a request only.
        let encoding = crate::compression::Encoding::Zstd.flags();
        let accepts = crate::compression::EncodingSet::all().flags();
        bytes[22] = (encoding | accepts) as u8;
        assert!(Header::decode(&bytes).is_ok());
        bytes[1] = FrameKind::Response as u8;
        assert_eq!(
            Header::decode(&bytes),
            Err(HeaderError::Flags(encoding | accepts))
        );
        bytes[22] = encoding as u8;
        assert!(Header::decode(&bytes).is_ok());
        bytes[1] = FrameKind::Error as u8;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(encoding)));
        bytes[1] = FrameKind::Request as u8;
        // Lent: on the kinds that carry a message only.
        bytes[22] = FLAG_LENT as u8;
        assert!(Header::decode(&bytes).is_ok_and(|h| h.is_lent()));
        // A call's kind: on a request only.
        for kind in [
            MethodKind::Unary,
            MethodKind::ServerStreaming,
            MethodKind::ClientStreaming,
            MethodKind::Streaming,
        ] {
            let flags = Header::kind_flags(kind) | FLAG_LENT;
            bytes[1] = FrameKind::Request as u8;
            bytes[22] = flags as u8;
            let h = Header::decode(&bytes).unwrap();
            assert_eq!((h.call_kind(), h.is_lent()), (kind, true));
            for other in [FrameKind::Response, FrameKind::Message] {
                bytes[1] = other as u8;
                let decoded = Header::decode(&bytes);
                assert_eq!(
                    decoded.is_ok(),
                    kind == MethodKind::Unary,
                    "{other:?} {kind:?}"
                );
            }
        }
        bytes[1] = FrameKind::Cancel as u8;
        bytes[22] = FLAG_LENT as u8;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(1)));
        // Past the encodings accepted (bits 5-7), reserved.
        bytes[1] = FrameKind::Request as u8;
        bytes[22] = 0;
        bytes[23] = 1;
        assert_eq!(Header::decode(&bytes), Err(HeaderError::Flags(0x100)));
    }

    #[test]
    fn frame_len_adds_header_metadata_payload() {
        let h = Header {
            payload_len: 100,
            metadata_len: 7,
            ..sample()
        };
        assert_eq!(h.frame_len(), HEADER_LEN + 107);
        let max = Header {
            payload_len: u32::MAX,
            metadata_len: u16::MAX,
            ..sample()
        };
        assert_eq!(
            max.frame_len() as u64,
            HEADER_LEN as u64 + u16::MAX as u64 + u32::MAX as u64
        );
    }

    #[test]
    fn errors_display() {
        for e in [
            HeaderError::Short(3),
            HeaderError::Version(7),
            HeaderError::Kind(8),
            HeaderError::Flags(1),
        ] {
            assert!(!e.to_string().is_empty());
        }
        assert!(HeaderError::Short(3).to_string().contains('3'));
    }

    fn kind_strategy() -> impl Strategy<Value = FrameKind> {
        prop_oneof![
            Just(FrameKind::Request),
            Just(FrameKind::Response),
            Just(FrameKind::Error),
            Just(FrameKind::Cancel),
            Just(FrameKind::Credit),
            Just(FrameKind::Message),
            Just(FrameKind::HalfClose),
            Just(FrameKind::Window),
        ]
    }

    prop_compose! {
        fn header_strategy()(
            kind in kind_strategy(),
            status in any::<u16>(),
            method_id in any::<u32>(),
            call_id in any::<u64>(),
            payload_len in any::<u32>(),
            metadata_len in any::<u16>(),
            timeout_us in any::<u32>(),
            ack in any::<u32>(),
        ) -> Header {
            Header {
                flags: 0,
                kind,
                status,
                method_id,
                call_id: CallId(call_id),
                payload_len,
                metadata_len,
                timeout_us,
                ack,
            }
        }
    }

    proptest! {
        #[test]
        fn prop_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            match Header::decode(&bytes) {
                Ok(h) => {
                    // Whatever decodes re-encodes to the same 32 bytes.
                    prop_assert!(bytes.len() >= HEADER_LEN);
                    prop_assert_eq!(&encoded(&h)[..], &bytes[..HEADER_LEN]);
                }
                Err(HeaderError::Short(n)) => {
                    prop_assert_eq!(n, bytes.len());
                    prop_assert!(n < HEADER_LEN);
                }
                Err(HeaderError::Version(v)) => prop_assert_ne!(v, VERSION),
                Err(HeaderError::Kind(k)) => prop_assert!(FrameKind::from_u8(k).is_none()),
                Err(HeaderError::Flags(f)) => prop_assert_ne!(f, 0),
            }
        }

        #[test]
        fn prop_decode_never_panics_near_valid(
            h in header_strategy(),
            flips in proptest::collection::vec((0..HEADER_LEN, any::<u8>()), 0..4),
            cut in 0..=HEADER_LEN,
        ) {
            let mut bytes = encoded(&h);
            for (i, x) in flips {
                bytes[i] ^= x;
            }
            let _ = Header::decode(&bytes);
            let _ = Header::decode(&bytes[..cut]);
        }

        #[test]
        fn prop_round_trip(h in header_strategy()) {
            let bytes = encoded(&h);
            prop_assert_eq!(Header::decode(&bytes), Ok(h));
            prop_assert_eq!(
                h.frame_len(),
                HEADER_LEN + h.metadata_len as usize + h.payload_len as usize
            );
        }
    }
}
