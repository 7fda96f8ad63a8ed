//! Call metadata: small key/value pairs that travel beside a message, like
//! gRPC's headers. Keys are lowercase ASCII; values are text or bytes.

use std::fmt;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 255;
/// Largest encoded metadata block of one frame, in bytes (the header field is 16 bits).
pub const MAX_ENCODED_LEN: usize = u16::MAX as usize;

/// Why a key could not be inserted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidMetadataKey(String);

impl fmt::Display for InvalidMetadataKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid metadata key {:?}: keys are 1..=255 bytes of a-z, 0-9, '-', '_' or '.'",
            self.0
        )
    }
}

impl std::error::Error for InvalidMetadataKey {}

impl From<InvalidMetadataKey> for crate::Status {
    /// `InvalidArgument`, naming the key.
    fn from(e: InvalidMetadataKey) -> crate::Status {
        crate::Status::invalid_argument(e.to_string())
    }
}

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
    pub fn insert(
        &mut self,
        key: &str,
        value: impl Into<String>,
    ) -> Result<(), InvalidMetadataKey> {
        self.insert_bin(key, value.into().into_bytes())
    }

    /// Sets a binary value, replacing any earlier value of the key.
    pub fn insert_bin(
        &mut self,
        key: &str,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), InvalidMetadataKey> {
        let key = key.to_ascii_lowercase();
        if !valid_key(&key) {
            return Err(InvalidMetadataKey(key));
        }
        let value = value.into();
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key, value)),
        }
        Ok(())
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
        md.insert("x-tenant", "b").unwrap();
        assert_eq!(md.len(), 1);
        assert_eq!(md.get("x-tenant"), Some("b"));
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
            for (k, v) in &entries { md.insert_bin(k, v.clone()).unwrap(); }
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
