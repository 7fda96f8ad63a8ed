//! Call metadata: small key/value pairs that travel beside a message, like
//! gRPC's headers. Keys are lowercase ASCII; values are text (printable
//! ASCII and tabs, what an HTTP/2 header value may hold) or bytes.

use std::fmt;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 255;
/// Largest encoded metadata block of one frame, in bytes (the header field is 16 bits).
pub const MAX_ENCODED_LEN: usize = u16::MAX as usize;

/// Keys gRPC and HTTP/2 keep for themselves, besides those that start
/// with `grpc-`: the transport sets them (or, for the connection-specific
/// ones, HTTP/2 forbids them), so they are not a call's metadata.
pub(crate) const RESERVED_KEYS: [&str; 11] = [
    "te",
    "content-type",
    "user-agent",
    "host",
    "accept-encoding",
    "content-length",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// Whether `key` (lowercase) is gRPC's own: it starts with `grpc-` or is
/// one of [`RESERVED_KEYS`].
pub(crate) fn is_reserved(key: &str) -> bool {
    key.starts_with("grpc-") || RESERVED_KEYS.contains(&key)
}

/// Why an entry could not be inserted: its key, or a text value, is not
/// one metadata can carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidMetadata {
    key: String,
    fault: Fault,
}

/// What is wrong with a refused entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The key's length or characters.
    Key,
    /// The key is gRPC's own ([`is_reserved`]).
    Reserved,
    /// This byte of a text value, at this offset.
    ValueByte(usize, u8),
}

impl InvalidMetadata {
    /// The key of the refused entry (lowercased).
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Display for InvalidMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.fault {
            Fault::Key => write!(
                f,
                "invalid metadata key {:?}: keys are 1..=255 bytes of a-z, 0-9, '-', '_' or '.'",
                self.key
            ),
            Fault::Reserved => write!(
                f,
                "metadata key {:?} is reserved: gRPC and HTTP/2 set it themselves (keys that \
                 start with \"grpc-\", and {}); use a key of your own",
                self.key,
                RESERVED_KEYS.join(", ")
            ),
            Fault::ValueByte(at, byte) => write!(
                f,
                "invalid text value for metadata key {:?}: byte {at} is {byte:#04x}; text \
                 values are printable ASCII (0x20..=0x7e) and tabs, as in a gRPC header; send other \
                 bytes with insert_bin under a key ending in \"-bin\"",
                self.key
            ),
        }
    }
}

impl std::error::Error for InvalidMetadata {}

/// Key/value pairs sent with a request or a response.
///
/// ```
/// let mut md = rpc_core::Metadata::new();
/// md.insert("tenant", "blue").unwrap();
/// md.insert_bin("trace-bin", [1u8, 2, 3]).unwrap();
/// assert_eq!(md.get("tenant"), Some("blue"));
/// assert_eq!(md.get_bin("trace-bin"), Some(&[1u8, 2, 3][..]));
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    entries: Vec<(String, Vec<u8>)>,
}

/// The first byte of `value` an HTTP/2 header value (and so a gRPC text
/// value) may not hold, and where it is.
fn invalid_text(value: &str) -> Option<(usize, u8)> {
    value
        .bytes()
        .enumerate()
        .find(|&(_, b)| !matches!(b, 0x20..=0x7e | b'\t'))
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'))
}

impl Metadata {
    /// Empty metadata.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Sets a text value, replacing any earlier value of the key.
    ///
    /// Text is printable ASCII (`0x20..=0x7e`) and tabs, what a gRPC header
    /// value may hold, so that it reaches gRPC peers unchanged: a value with
    /// a control character or a non-ASCII letter is refused. Send such bytes with
    /// [`Metadata::insert_bin`] under a key ending in `-bin`.
    ///
    /// ```
    /// let mut md = rpc_core::Metadata::new();
    /// assert!(md.insert("note", "line one\nline two").is_err());
    /// md.insert_bin("note-bin", "line one\nline two").unwrap();
    /// ```
    pub fn insert(&mut self, key: &str, value: impl Into<String>) -> Result<(), InvalidMetadata> {
        let value = value.into();
        if let Some(bad) = invalid_text(&value) {
            return Err(InvalidMetadata {
                key: key.to_ascii_lowercase(),
                fault: Fault::ValueByte(bad.0, bad.1),
            });
        }
        self.insert_bin(key, value.into_bytes())
    }

    /// Sets a binary value, replacing any earlier value of the key.
    ///
    /// Any bytes travel between rdma-rpc peers. gRPC carries binary values
    /// only under keys that end in `-bin`: over a server's gRPC face, a
    /// value under another key must be text as [`Metadata::insert`] takes
    /// it, or it is left out (with a warning in the log).
    ///
    /// Keys are 1 to 255 bytes of `a-z`, `0-9`, `-`, `_` and `.`
    /// (uppercase letters are lowercased). Keys gRPC keeps for itself are
    /// refused, as they would not reach a gRPC peer as metadata: those
    /// that start with `grpc-`, and HTTP/2's and gRPC's own headers such
    /// as `te`, `content-type` and `user-agent`. (A deadline is the
    /// request's timeout, a status's details are
    /// [`Status::with_details`](crate::Status::with_details).)
    ///
    /// ```
    /// let mut md = rpc_core::Metadata::new();
    /// assert!(md.insert("grpc-timeout", "1S").is_err());
    /// assert!(md.insert("content-type", "text/plain").is_err());
    /// md.insert("x-content-type", "text/plain").unwrap();
    /// ```
    pub fn insert_bin(
        &mut self,
        key: &str,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), InvalidMetadata> {
        let key = key.to_ascii_lowercase();
        let fault = if !valid_key(&key) {
            Some(Fault::Key)
        } else if is_reserved(&key) {
            Some(Fault::Reserved)
        } else {
            None
        };
        if let Some(fault) = fault {
            return Err(InvalidMetadata { key, fault });
        }
        self.set(key, value.into());
        Ok(())
    }

    /// Sets `key` (valid and lowercase, reserved or not) to `value`.
    pub(crate) fn set(&mut self, key: String, value: Vec<u8>) {
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key, value)),
        }
    }

    /// The value of `key` as text, if present and valid UTF-8.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.get_bin(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The value of `key` as bytes, if present.
    pub fn get_bin(&self, key: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_slice())
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Vec<u8>> {
        let i = self
            .entries
            .iter()
            .position(|(k, _)| k.eq_ignore_ascii_case(key))?;
        Some(self.entries.swap_remove(i).1)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in insertion order (removal may reorder).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
    }

    /// Bytes [`Metadata::encode`] writes.
    pub(crate) fn encoded_len(&self) -> usize {
        self.entries
            .iter()
            .map(|(k, v)| 1 + k.len() + 4 + v.len())
            .sum()
    }

    /// Appends the wire form: per entry `key_len: u8, key, value_len: u32 LE, value`.
    pub(crate) fn encode(&self, out: &mut [u8]) {
        let mut at = 0;
        for (k, v) in &self.entries {
            out[at] = k.len() as u8;
            out[at + 1..at + 1 + k.len()].copy_from_slice(k.as_bytes());
            at += 1 + k.len();
            out[at..at + 4].copy_from_slice(&(v.len() as u32).to_le_bytes());
            out[at + 4..at + 4 + v.len()].copy_from_slice(v);
            at += 4 + v.len();
        }
    }

    /// Parses untrusted bytes; `None` if they are not well-formed metadata.
    pub(crate) fn decode(mut bytes: &[u8]) -> Option<Metadata> {
        let mut md = Metadata::new();
        while let Some((&klen, rest)) = bytes.split_first() {
            let klen = klen as usize;
            let key = std::str::from_utf8(rest.get(..klen)?).ok()?;
            if !valid_key(key) {
                return None;
            }
            let rest = &rest[klen..];
            let vlen = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            let value = rest.get(4..4usize.checked_add(vlen)?)?;
            md.entries.push((key.to_owned(), value.to_vec()));
            bytes = &rest[4 + vlen..];
        }
        Some(md)
    }
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.entries {
            match std::str::from_utf8(v) {
                Ok(s) => m.entry(k, &s),
                Err(_) => m.entry(k, v),
            };
        }
        m.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_are_validated_and_lowercased() {
        let mut md = Metadata::new();
        md.insert("X-Tenant", "a").unwrap();
        assert_eq!(md.get("x-tenant"), Some("a"));
        assert!(md.insert("bad key", "a").is_err());
        assert!(md.insert("", "a").is_err());
        assert!(md.insert(&"k".repeat(256), "a").is_err());
        let e = md.insert("bad key", "a").unwrap_err();
        assert_eq!(e.key(), "bad key");
        assert!(e.to_string().contains("invalid metadata key"), "{e}");
        // gRPC's own keys, in any case, are refused; keys like them are not.
        for reserved in [
            "grpc-timeout",
            "GRPC-Status",
            "grpc-x-bin",
            "te",
            "Content-Type",
        ] {
            let e = md.insert(reserved, "a").unwrap_err();
            assert_eq!(e.key(), reserved.to_ascii_lowercase());
            assert!(e.to_string().contains("is reserved"), "{e}");
            assert!(md.insert_bin(reserved, [1u8]).is_err());
        }
        let mut ours = Metadata::new();
        for key in [
            "grpcx",
            "my-grpc-timeout",
            "tenant",
            "x-content-type",
            "ten",
        ] {
            ours.insert(key, "a").unwrap();
        }
        assert_eq!(ours.len(), 5);
        md.insert("x-tenant", "b").unwrap();
        assert_eq!(md.len(), 1);
        assert_eq!(md.get("x-tenant"), Some("b"));
    }

    #[test]
    fn text_values_are_printable_ascii() {
        let mut md = Metadata::new();
        md.insert("ok", " !~ printable ASCII, spaces\tand tabs too ")
            .unwrap();
        for (bad, at, byte) in [
            ("two\nlines", 3, b'\n'),
            ("cr\rhere", 2, b'\r'),
            ("caf\u{e9}", 3, 0xc3),
            ("del\u{7f}", 3, 0x7f),
            ("\0", 0, 0),
        ] {
            let e = md.insert("X-Note", bad).unwrap_err();
            assert_eq!(e.key(), "x-note");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("byte {at} is {byte:#04x}")) && msg.contains("-bin"),
                "{msg}"
            );
            // The error changes nothing: the entry is not there.
            assert_eq!(md.get_bin("x-note"), None);
        }
        assert_eq!(md.len(), 1);
        // The same bytes are fine as a binary value.
        md.insert_bin("note-bin", "two\nlines").unwrap();
        assert_eq!(md.get_bin("note-bin"), Some(&b"two\nlines"[..]));
    }

    #[test]
    fn malformed_bytes_are_rejected() {
        assert_eq!(Metadata::decode(&[]), Some(Metadata::new()));
        assert_eq!(Metadata::decode(&[3, b'a']), None); // key runs past the end
        assert_eq!(Metadata::decode(&[1, b'A', 0, 0, 0, 0]), None); // uppercase key
        assert_eq!(Metadata::decode(&[1, b'a', 9, 0, 0, 0, 1]), None); // value runs past the end
        assert_eq!(Metadata::decode(&[1, b'a', 0xff, 0xff, 0xff, 0xff]), None);
    }

    proptest! {
        #[test]
        fn round_trips(entries in proptest::collection::vec(("[a-z0-9._-]{1,20}", proptest::collection::vec(any::<u8>(), 0..40)), 0..8)) {
            let mut md = Metadata::new();
            // Any valid key travels, gRPC's own included (`insert` refuses
            // those, the wire does not).
            for (k, v) in &entries { md.set(k.clone(), v.clone()); }
            let mut buf = vec![0; md.encoded_len()];
            md.encode(&mut buf);
            prop_assert_eq!(Metadata::decode(&buf), Some(md));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Metadata::decode(&bytes);
        }
    }
}
