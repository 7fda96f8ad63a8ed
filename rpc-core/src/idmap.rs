//! Hash maps keyed by 32-bit ids (queue pair numbers, method ids, rkeys),
//! looked up on every completion: a multiplicative hash instead of SipHash.
//! The keys come from this process or are checked after lookup, so
//! resistance to chosen keys buys nothing here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from 32-bit ids.
pub(crate) type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// Fibonacci hashing of one integer key; other input falls back to FNV-1a.
#[derive(Debug, Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write_u32(&mut self, key: u32) {
        self.0 = (u64::from(key) ^ self.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_and_round_trip() {
        let mut m: IdMap<u32> = IdMap::default();
        for k in 0..10_000u32 {
            m.insert(k, k * 2);
        }
        for k in 0..10_000u32 {
            assert_eq!(m.get(&k), Some(&(k * 2)));
        }
        assert_eq!(m.get(&10_000), None);
    }
}
