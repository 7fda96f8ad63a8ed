//! Message compression, as gRPC defines it (grpc/grpc `doc/compression.md`):
//! each message on its own, compressed or not, with an encoding both sides
//! know ([`Encoding`]: gzip, zstd, deflate).
//!
//! What a side sends compressed is its choice ([`CompressionConfig::send`],
//! set by `send_compressed` on builders, clients and servers; by default
//! nothing is); what it accepts it says ([`CompressionConfig::accepts`],
//! every encoding by default, `accept_encodings` to narrow it). A
//! server compresses its responses only in an encoding its caller
//! accepts, and answers a message in an encoding it does not accept with
//! `Unimplemented`; a message that does not inflate fails `Internal`, and
//! one that inflates past the receiver's `max_message_size` fails
//! `ResourceExhausted` before more than that limit is allocated.
//!
//! On rdma://, tcp:// and mem:// a frame header's flags name the encoding
//! of the messages it carries, so each frame stands alone, and a
//! `Request`'s flags also name the encodings its caller accepts (what
//! gRPC's `grpc-accept-encoding` header says): a call carries and parses
//! nothing more than it did without compression. On
//! the gRPC face and `grpc://` the same settings map to gRPC's headers and
//! its per-message compressed flag.

use crate::Status;
use crate::payload::Payload;
use std::fmt;

/// gRPC's header that lists the encodings a side accepts, comma separated.
pub const ACCEPT_ENCODING: &str = "grpc-accept-encoding";
/// gRPC's header that names the encoding of the messages a side sends.
pub const ENCODING: &str = "grpc-encoding";

/// A message encoding both sides know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Encoding {
    /// gzip (RFC 1952), compression level 6 as zlib's default.
    Gzip,
    /// Zstandard (RFC 8878), level 3 as its library's default.
    Zstd,
    /// gRPC's `deflate`: zlib's format (RFC 1950), level 6.
    Deflate,
}

use crate::protocol::header::{FLAGS_ACCEPT as ACCEPT_MASK, FLAGS_ENCODING as FLAGS_MASK};

mod codec;

/// Where an encoding sits in a frame header's flags.
const FLAGS_SHIFT: u16 = FLAGS_MASK.trailing_zeros() as u16;
/// Where the set of encodings a caller accepts sits in a `Request`'s flags.
const ACCEPT_SHIFT: u16 = ACCEPT_MASK.trailing_zeros() as u16;

impl Encoding {
    /// Every encoding this build knows.
    pub const ALL: [Encoding; 3] = [Encoding::Gzip, Encoding::Zstd, Encoding::Deflate];

    /// Its name in gRPC's headers: `gzip`, `zstd` or `deflate`.
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip",
            Encoding::Zstd => "zstd",
            Encoding::Deflate => "deflate",
        }
    }

    /// The encoding gRPC's headers name `name`; `None` for `identity` and
    /// any this build does not know.
    pub fn from_name(name: &str) -> Option<Encoding> {
        Encoding::ALL
            .into_iter()
            .find(|e| e.as_str().eq_ignore_ascii_case(name.trim()))
    }

    fn bit(self) -> u8 {
        match self {
            Encoding::Gzip => 1,
            Encoding::Zstd => 2,
            Encoding::Deflate => 4,
        }
    }

    /// Its bits in a frame header's flags.
    pub(crate) fn flags(self) -> u16 {
        let code = match self {
            Encoding::Gzip => 1,
            Encoding::Zstd => 2,
            Encoding::Deflate => 3,
        };
        code << FLAGS_SHIFT
    }

    /// The encoding a frame header's flags name: `None` for messages sent
    /// as they are.
    pub(crate) fn from_flags(flags: u16) -> Option<Encoding> {
        match (flags & FLAGS_MASK) >> FLAGS_SHIFT {
            1 => Some(Encoding::Gzip),
            2 => Some(Encoding::Zstd),
            3 => Some(Encoding::Deflate),
            _ => None,
        }
    }

    /// `message` compressed. The compressor's state is kept per thread
    /// and reused: setting one up costs more than compressing a small
    /// message.
    pub fn compress(self, message: &[u8]) -> Vec<u8> {
        match self {
            Encoding::Gzip => codec::gzip(message),
            Encoding::Deflate => codec::zlib(message),
            Encoding::Zstd => codec::zstd(message),
        }
    }

    /// `message` inflated, at most `limit` bytes of it: `Internal` if it
    /// is not valid in this encoding, `ResourceExhausted` if it inflates
    /// past `limit` (found without holding more than `limit` bytes).
    pub fn decompress(self, message: &[u8], limit: usize) -> Result<Vec<u8>, Status> {
        let inflated = match self {
            Encoding::Gzip => codec::gunzip(message, limit),
            Encoding::Deflate => codec::unzlib(message, limit),
            Encoding::Zstd => codec::unzstd(message, limit),
        };
        inflated.map_err(|e| match e {
            codec::Error::TooLarge => Status::resource_exhausted(format!(
                "a {self}-compressed message inflates past the limit of {limit} bytes"
            )),
            codec::Error::Corrupt(why) => Status::internal(format!(
                "a {self}-compressed message does not decompress: {why}"
            )),
        })
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Encoding {
    type Err = Status;
    fn from_str(s: &str) -> Result<Encoding, Status> {
        Encoding::from_name(s).ok_or_else(|| unsupported(s, EncodingSet::all()))
    }
}

/// `Unimplemented`, for a message in an encoding this side does not accept.
pub(crate) fn unsupported(name: &str, accepted: EncodingSet) -> Status {
    Status::unimplemented(format!(
        "message compressed with {name}, which this side does not accept (it accepts: {})",
        accepted.header_value()
    ))
}

/// A set of encodings: those a side accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct EncodingSet(u8);

impl EncodingSet {
    /// No encoding: messages only as they are.
    pub const fn none() -> EncodingSet {
        EncodingSet(0)
    }

    /// Every encoding this build knows.
    pub fn all() -> EncodingSet {
        Encoding::ALL
            .into_iter()
            .fold(EncodingSet::none(), EncodingSet::with)
    }

    /// This set and `encoding`.
    pub fn with(self, encoding: Encoding) -> EncodingSet {
        EncodingSet(self.0 | encoding.bit())
    }

    /// Whether `encoding` is in the set.
    pub fn contains(self, encoding: Encoding) -> bool {
        self.0 & encoding.bit() != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The encodings in the set, in [`Encoding::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = Encoding> {
        Encoding::ALL.into_iter().filter(move |e| self.contains(*e))
    }

    /// As gRPC's `grpc-accept-encoding` header says it: `identity` first,
    /// then the set's names, comma separated.
    pub fn header_value(self) -> String {
        std::iter::once("identity")
            .chain(self.iter().map(Encoding::as_str))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The set as a `Request` frame header's flags carry it.
    pub(crate) fn flags(self) -> u16 {
        u16::from(self.0) << ACCEPT_SHIFT
    }

    /// The set a `Request` frame header's flags carry.
    pub(crate) fn from_flags(flags: u16) -> EncodingSet {
        EncodingSet(((flags & ACCEPT_MASK) >> ACCEPT_SHIFT) as u8)
    }

    /// The known encodings a `grpc-accept-encoding` value names (unknown
    /// names and `identity` left out).
    pub fn parse(value: &str) -> EncodingSet {
        value
            .split(',')
            .filter_map(Encoding::from_name)
            .fold(EncodingSet::none(), EncodingSet::with)
    }
}

impl FromIterator<Encoding> for EncodingSet {
    fn from_iter<I: IntoIterator<Item = Encoding>>(iter: I) -> EncodingSet {
        iter.into_iter()
            .fold(EncodingSet::none(), EncodingSet::with)
    }
}

/// One side's compression settings: the encoding it sends messages in and
/// the encodings it accepts.
///
/// The default sends messages as they are and accepts every encoding this
/// build knows, as grpc-go and grpc-java accept gzip unasked (inflating is
/// bounded by the receive limit). [`CompressionConfig::send_compressed`]
/// compresses what this side sends; [`CompressionConfig::accept_compressed`]
/// names an accepted encoding, and once one is named only those named are
/// accepted (tonic's way); [`CompressionConfig::accept_encodings`] sets the
/// whole set. The builders, `Channel`, and the generated clients and
/// servers have the same three methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CompressionConfig {
    send: Option<Encoding>,
    /// `None`: every encoding known.
    accept: Option<EncodingSet>,
}

impl CompressionConfig {
    /// Sends messages compressed in `encoding` (those of a server only if
    /// its caller accepts it; otherwise as they are).
    pub fn send_compressed(mut self, encoding: Encoding) -> CompressionConfig {
        self.send = Some(encoding);
        self
    }

    /// Sends messages as they are.
    pub fn send_uncompressed(mut self) -> CompressionConfig {
        self.send = None;
        self
    }

    /// Accepts messages compressed in `encoding`; once any is named, only
    /// those named are accepted.
    pub fn accept_compressed(mut self, encoding: Encoding) -> CompressionConfig {
        self.accept = Some(self.accept.unwrap_or_default().with(encoding));
        self
    }

    /// Accepts exactly the encodings in `set` (none: messages only as they
    /// are; a compressed one fails `Unimplemented`).
    pub fn accept_encodings(mut self, set: EncodingSet) -> CompressionConfig {
        self.accept = Some(set);
        self
    }

    /// The encoding messages are sent in; `None` if as they are.
    pub fn send(&self) -> Option<Encoding> {
        self.send
    }

    /// The encodings accepted.
    pub fn accepts(&self) -> EncodingSet {
        self.accept.unwrap_or_else(EncodingSet::all)
    }

    /// A caller's `Request` frame flags: the encodings it accepts, and the
    /// encoding of its message if it carries one.
    pub(crate) fn request_flags(&self, message: bool) -> u16 {
        let encoding = self.send.filter(|_| message).map_or(0, Encoding::flags);
        self.accepts().flags() | encoding
    }
}

/// An incoming message whose frame had `flags`: as it is (`None`), or
/// inflated (at most `limit()` bytes, asked for only then), with the
/// encoding it arrived in; `Unimplemented` if `accepted` does not hold
/// that encoding.
pub(crate) fn unpack(
    flags: u16,
    message: &[u8],
    accepted: EncodingSet,
    limit: impl FnOnce() -> usize,
) -> Result<Option<(Vec<u8>, Encoding)>, Status> {
    match Encoding::from_flags(flags) {
        None => Ok(None),
        Some(e) if accepted.contains(e) => Ok(Some((e.decompress(message, limit())?, e))),
        Some(e) => Err(unsupported(e.as_str(), accepted)),
    }
}

/// A message's bytes as they arrived, inflated if `flags` say they are
/// compressed (in an encoding of `accepted`, to at most `limit()` bytes),
/// with the encoding they arrived in; the compressed bytes go to
/// `recycle`.
pub(crate) fn inflate(
    payload: Payload,
    flags: u16,
    accepted: EncodingSet,
    limit: impl FnOnce() -> usize,
    recycle: impl FnOnce(Payload),
) -> Result<(Payload, Option<Encoding>), Status> {
    match unpack(flags, &payload, accepted, limit)? {
        None => Ok((payload, None)),
        Some((inflated, encoding)) => {
            recycle(payload);
            Ok((inflated.into(), Some(encoding)))
        }
    }
}

/// How a call's messages leave: in the encoding its sender wants (a
/// response's [`CompressionSwitch`], read as each message is encoded, else
/// a fixed one), if the peer accepts it; otherwise as they are.
#[derive(Debug, Clone, Default)]
pub(crate) struct SendPolicy {
    /// Read as each message is encoded, over `encoding`.
    pub(crate) switch: Option<CompressionSwitch>,
    /// The encoding wanted when there is no switch.
    pub(crate) encoding: Option<Encoding>,
    /// What the peer accepts (the encodings its `Request` named; every
    /// known one for a server, which answers one it does not take with
    /// `Unimplemented`).
    pub(crate) peer_accepts: EncodingSet,
}

impl SendPolicy {
    /// The encoding of the message encoded now.
    pub(crate) fn now(&self) -> Option<Encoding> {
        let wanted = match &self.switch {
            Some(switch) => switch.get(),
            None => self.encoding,
        }?;
        self.peer_accepts.contains(wanted).then_some(wanted)
    }
}

/// A message as a frame carries it: encoded straight into the frame, or
/// compressed ahead of it.
pub(crate) enum Outgoing<'a, M> {
    /// Encoded into the frame as it is.
    Plain(&'a M),
    /// Its bytes ready: compressed ahead here, or passed on from
    /// elsewhere (compressed or not, as the frame's flags say).
    Packed(std::borrow::Cow<'a, [u8]>),
}

impl<'a, M: prost::Message> Outgoing<'a, M> {
    /// `message`, compressed in `encoding` if there is one.
    pub(crate) fn new(message: &'a M, encoding: Option<Encoding>) -> Outgoing<'a, M> {
        match encoding {
            Some(e) => Outgoing::Packed(e.compress(&message.encode_to_vec()).into()),
            None => Outgoing::Plain(message),
        }
    }

    /// The bytes it takes in the frame.
    pub(crate) fn len(&self) -> usize {
        match self {
            Outgoing::Plain(m) => m.encoded_len(),
            Outgoing::Packed(bytes) => bytes.len(),
        }
    }

    /// Writes it into `buf`, of exactly [`Outgoing::len`] bytes.
    pub(crate) fn write(&self, buf: &mut [u8]) {
        match self {
            Outgoing::Plain(m) => crate::dispatch::encode_exact(*m, buf),
            Outgoing::Packed(bytes) => buf.copy_from_slice(bytes),
        }
    }

    /// Appends it to `out`.
    pub(crate) fn append_to(&self, out: &mut Vec<u8>) {
        match self {
            // Cannot fail: a `Vec` grows.
            Outgoing::Plain(m) => {
                let _ = m.encode(out);
            }
            Outgoing::Packed(bytes) => out.extend_from_slice(bytes),
        }
    }

    /// Its bytes, owned.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            Outgoing::Plain(m) => m.encode_to_vec(),
            Outgoing::Packed(bytes) => bytes.into_owned(),
        }
    }
}

/// Which encoding a call's messages leave in, changeable message by
/// message while it sends them: a handler's response stream (through
/// `Response::with_compression_switch`) reads it as each message is
/// encoded, so setting it before yielding a message decides how that
/// message travels. Clones share the setting.
#[derive(Debug, Clone, Default)]
pub struct CompressionSwitch(std::sync::Arc<std::sync::atomic::AtomicU8>);

impl CompressionSwitch {
    /// A switch set to `encoding` (`None`: as they are).
    pub fn new(encoding: Option<Encoding>) -> CompressionSwitch {
        let switch = CompressionSwitch::default();
        switch.set(encoding);
        switch
    }

    /// The messages encoded from now on leave in `encoding` (if the peer
    /// accepts it).
    pub fn set(&self, encoding: Option<Encoding>) {
        let code = encoding.map_or(0, |e| (e.flags() >> FLAGS_SHIFT) as u8);
        self.0.store(code, std::sync::atomic::Ordering::Relaxed);
    }

    /// The encoding set now.
    pub fn get(&self) -> Option<Encoding> {
        let code = self.0.load(std::sync::atomic::Ordering::Relaxed);
        Encoding::from_flags(u16::from(code) << FLAGS_SHIFT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Code;

    fn sample() -> Vec<u8> {
        (0..100_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect()
    }

    #[test]
    fn every_encoding_round_trips_and_shrinks_what_repeats() {
        let message = sample();
        for e in Encoding::ALL {
            let packed = e.compress(&message);
            assert!(
                packed.len() < message.len() / 4,
                "{e}: {} bytes",
                packed.len()
            );
            assert_eq!(
                e.decompress(&packed, message.len()).unwrap(),
                message,
                "{e}"
            );
            assert_eq!(
                e.decompress(&e.compress(&[]), 0).unwrap(),
                Vec::<u8>::new(),
                "{e}"
            );
        }
    }

    #[test]
    fn a_corrupt_message_fails_internal() {
        let message = sample();
        for e in Encoding::ALL {
            let mut packed = e.compress(&message);
            let mid = packed.len() / 2;
            packed[mid] ^= 0xff;
            packed.truncate(mid + 8);
            let err = e.decompress(&packed, 1 << 30).unwrap_err();
            assert_eq!(err.code(), Code::Internal, "{e}: {err}");
            let err = e.decompress(b"not compressed at all", 1 << 30).unwrap_err();
            assert_eq!(err.code(), Code::Internal, "{e}: {err}");
        }
    }

    #[test]
    fn a_bomb_stops_at_the_limit() {
        // 64 MiB of zeros compress to a few KiB.
        let zeros = vec![0u8; 64 << 20];
        for e in Encoding::ALL {
            let bomb = e.compress(&zeros);
            assert!(bomb.len() < 1 << 20, "{e}: {}", bomb.len());
            let err = e.decompress(&bomb, 1 << 20).unwrap_err();
            assert_eq!(err.code(), Code::ResourceExhausted, "{e}: {err}");
            // Exactly at the limit passes.
            let fits = e.compress(&zeros[..1 << 20]);
            assert_eq!(e.decompress(&fits, 1 << 20).unwrap().len(), 1 << 20, "{e}");
        }
    }

    #[test]
    fn flags_name_each_encoding_and_nothing_else() {
        for e in Encoding::ALL {
            assert_eq!(Encoding::from_flags(e.flags()), Some(e));
            assert_eq!(e.flags() & !FLAGS_MASK, 0);
        }
        assert_eq!(Encoding::from_flags(0), None);
        for set in [
            EncodingSet::none(),
            EncodingSet::all(),
            EncodingSet::parse("zstd"),
        ] {
            assert_eq!(EncodingSet::from_flags(set.flags() | FLAGS_MASK | 7), set);
            assert_eq!(set.flags() & !ACCEPT_MASK, 0);
        }
        assert_eq!(
            Encoding::from_flags(crate::protocol::header::FLAG_LENT),
            None
        );
    }

    #[test]
    fn names_and_accept_headers() {
        assert_eq!(Encoding::from_name("GZIP"), Some(Encoding::Gzip));
        assert_eq!(Encoding::from_name("identity"), None);
        assert_eq!(Encoding::from_name("snappy"), None);
        let set = EncodingSet::parse("identity, zstd,snappy ,gzip");
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [Encoding::Gzip, Encoding::Zstd]
        );
        assert_eq!(set.header_value(), "identity,gzip,zstd");
        assert_eq!(EncodingSet::none().header_value(), "identity");
        assert_eq!("deflate".parse::<Encoding>().unwrap(), Encoding::Deflate);
        assert_eq!(
            "br".parse::<Encoding>().unwrap_err().code(),
            Code::Unimplemented
        );
    }

    #[test]
    fn unpack_refuses_what_is_not_accepted() {
        let message = sample();
        let packed = Encoding::Zstd.compress(&message);
        let flags = Encoding::Zstd.flags();
        let gzip_only = CompressionConfig::default().accept_compressed(Encoding::Gzip);
        assert_eq!(
            gzip_only.accepts().iter().collect::<Vec<_>>(),
            [Encoding::Gzip]
        );
        let err = unpack(flags, &packed, gzip_only.accepts(), || 1 << 30).unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err}");
        assert!(err.message().contains("identity,gzip"), "{err}");
        let all = CompressionConfig::default();
        assert_eq!(all.accepts(), EncodingSet::all());
        let (inflated, e) = unpack(flags, &packed, all.accepts(), || 1 << 30)
            .unwrap()
            .unwrap();
        assert_eq!((inflated, e), (message.clone(), Encoding::Zstd));
        assert!(
            unpack(0, &message, all.accepts(), || 1 << 30)
                .unwrap()
                .is_none()
        );
        assert_eq!(all.send(), None, "nothing to send compressed");
        let zstd = CompressionConfig::default().send_compressed(Encoding::Zstd);
        assert_eq!(zstd.send(), Some(Encoding::Zstd));
        assert_eq!(zstd.send_uncompressed().send(), None);
        let none = all.accept_encodings(EncodingSet::none());
        assert!(unpack(flags, &packed, none.accepts(), || 1 << 30).is_err());
    }

    #[test]
    fn a_switch_reads_back_what_was_set() {
        let switch = CompressionSwitch::new(Some(Encoding::Deflate));
        let other = switch.clone();
        assert_eq!(other.get(), Some(Encoding::Deflate));
        for e in [None, Some(Encoding::Gzip), Some(Encoding::Zstd)] {
            switch.set(e);
            assert_eq!(other.get(), e);
        }
    }
}
