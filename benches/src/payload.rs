//! Request payloads that say which call they belong to, so an echo that
//! comes back truncated, corrupted or for another call is counted as an
//! error.
//!
//! By default a payload repeats one byte (it compresses to almost
//! nothing); with [`set_random`] its bytes after the call's number are
//! random (nothing compresses them), the same for every call, so that
//! checking an echo stays a memory comparison.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

static RANDOM: AtomicBool = AtomicBool::new(false);

/// Random payloads from now on (`--payload random`), or the default's.
pub fn set_random(random: bool) {
    RANDOM.store(random, Ordering::Relaxed);
}

/// The random bytes payloads repeat (16 MiB: past any compressor's
/// window at the default levels).
fn random_block() -> &'static [u8] {
    static BLOCK: OnceLock<Vec<u8>> = OnceLock::new();
    BLOCK.get_or_init(|| {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut v = Vec::with_capacity(16 << 20);
        while v.len() < 16 << 20 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(&x.to_le_bytes());
        }
        v
    })
}

/// The random payload's bytes from `at` on, `len` of them.
fn random_bytes(at: usize, len: usize) -> impl Iterator<Item = &'static [u8]> {
    let block = random_block();
    let mut at = at % block.len();
    let mut left = len;
    std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let take = left.min(block.len() - at);
        let chunk = &block[at..at + take];
        at = (at + take) % block.len();
        left -= take;
        Some(chunk)
    })
}

/// The payload of call `seq`: `size` bytes, the first (up to) eight of them
/// `seq` in little-endian, the rest the low byte of `seq` (or random bytes,
/// see [`set_random`]).
pub fn make(size: usize, seq: u64) -> Vec<u8> {
    let n = size.min(8);
    let mut v = if RANDOM.load(Ordering::Relaxed) {
        let mut v = Vec::with_capacity(size);
        v.extend_from_slice(&[0; 8][..n]);
        random_bytes(n, size - n).for_each(|c| v.extend_from_slice(c));
        v
    } else {
        vec![seq as u8; size]
    };
    v[..n].copy_from_slice(&seq.to_le_bytes()[..n]);
    v
}

/// Checks that `got` is exactly [`make`]`(size, seq)`.
pub fn check(got: &[u8], size: usize, seq: u64) -> Result<(), String> {
    if got.len() != size {
        return Err(format!(
            "call {seq}: echoed {} bytes, sent {size}",
            got.len()
        ));
    }
    let n = size.min(8);
    if RANDOM.load(Ordering::Relaxed) {
        let mut at = n;
        let same = random_bytes(n, size - n).all(|c| {
            let ok = got[at..at + c.len()] == *c;
            at += c.len();
            ok
        });
        if got[..n] != seq.to_le_bytes()[..n] || !same {
            return Err(format!(
                "call {seq}: echoed payload differs from the one sent"
            ));
        }
        return Ok(());
    }
    let fill = seq as u8;
    // A large echo is compared a block at a time (memcmp), so that checking
    // it costs the measurement little next to moving it; a small one byte
    // by byte, without filling a 4 KiB block for it on every call.
    let rest = &got[n..];
    let differs = if rest.len() <= 256 {
        rest.iter().any(|&b| b != fill)
    } else {
        let block = [fill; 4096];
        rest.chunks(block.len()).any(|c| c != &block[..c.len()])
    };
    if got[..n] != seq.to_le_bytes()[..n] || differs {
        return Err(format!(
            "call {seq}: echoed payload differs from the one sent"
        ));
    }
    Ok(())
}

/// What a call came to, for the tally: its echo checked, or its error.
pub fn outcome(
    reply: Result<impl AsRef<[u8]>, impl std::fmt::Display>,
    size: usize,
    seq: u64,
) -> Result<(), String> {
    match reply {
        Ok(payload) => check(payload.as_ref(), size, seq),
        Err(e) => Err(format!("call {seq}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_wrap_around_their_block() {
        let block = random_block();
        let len = block.len();
        let got: Vec<u8> = random_bytes(len - 3, 10).flatten().copied().collect();
        assert_eq!(&got[..3], &block[len - 3..]);
        assert_eq!(&got[3..], &block[..7]);
        assert_eq!(random_bytes(5, 0).count(), 0);
    }

    #[test]
    fn round_trip_and_mismatches() {
        for size in [0, 1, 7, 8, 9, 64, 65536] {
            let p = make(size, 0x1234_5678_9abc);
            assert_eq!(p.len(), size);
            check(&p, size, 0x1234_5678_9abc).unwrap();
            if size > 0 {
                assert!(check(&p, size, 0x1234_5678_9abd).is_err());
                let mut bad = p.clone();
                *bad.last_mut().unwrap() ^= 1;
                assert!(check(&bad, size, 0x1234_5678_9abc).is_err());
                assert!(check(&p[..size - 1], size, 0x1234_5678_9abc).is_err());
            }
        }
    }
}
