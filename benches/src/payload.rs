//! Request payloads that say which call they belong to, so an echo that
//! comes back truncated, corrupted or for another call is counted as an
//! error.

/// The payload of call `seq`: `size` bytes, the first (up to) eight of them
/// `seq` in little-endian, the rest the low byte of `seq`.
pub fn make(size: usize, seq: u64) -> Vec<u8> {
    let mut v = vec![seq as u8; size];
    let n = size.min(8);
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
