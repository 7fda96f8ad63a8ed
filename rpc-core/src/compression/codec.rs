//! The three formats, compressed and inflated with state kept per thread:
//! a deflate compressor's tables (hundreds of KiB, zeroed when made) or a
//! zstd context cost more to set up than a small message takes to
//! compress, so each thread makes one of each once and resets it for the
//! next message. gzip is written and read around raw deflate here (its
//! 10-byte header, CRC-32 and length), zlib (gRPC's `deflate`) by the
//! deflate engine itself, zstd by its library's one-shot and streaming
//! calls. Inflating stops as soon as the output would pass its limit.

use std::cell::RefCell;

/// Why a message did not inflate.
#[derive(Debug)]
pub(super) enum Error {
    /// It inflates past the limit.
    TooLarge,
    /// It is not valid in its format.
    Corrupt(String),
}

/// The compression level of gzip and zlib (zlib's default).
const DEFLATE_LEVEL: u32 = 6;
/// The compression level of zstd (its library's default).
const ZSTD_LEVEL: i32 = 3;

thread_local! {
    static RAW_DEFLATE: RefCell<Option<flate2::Compress>> = const { RefCell::new(None) };
    static ZLIB_DEFLATE: RefCell<Option<flate2::Compress>> = const { RefCell::new(None) };
    static RAW_INFLATE: RefCell<Option<flate2::Decompress>> = const { RefCell::new(None) };
    static ZLIB_INFLATE: RefCell<Option<flate2::Decompress>> = const { RefCell::new(None) };
    static ZSTD_C: RefCell<Option<zstd::zstd_safe::CCtx<'static>>> = const { RefCell::new(None) };
    static ZSTD_D: RefCell<Option<zstd::zstd_safe::DCtx<'static>>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's `T` from `cell`, made by `make` the first
/// time (or again if a call panicked with it borrowed).
fn with<T, R>(
    cell: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    make: impl FnOnce() -> T,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    cell.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => f(slot.get_or_insert_with(make)),
        // Re-entered (a compressor used while this one is): one of its own.
        Err(_) => f(&mut make()),
    })
}

/// Compresses all of `input` into `out` (appended) with `c`, then resets it.
fn deflate_into(c: &mut flate2::Compress, input: &[u8], out: &mut Vec<u8>) {
    c.reset();
    let start_in = c.total_in();
    loop {
        if out.capacity() - out.len() < 64 {
            out.reserve(out.capacity().max(256));
        }
        let read = (c.total_in() - start_in) as usize;
        match c.compress_vec(&input[read..], out, flate2::FlushCompress::Finish) {
            Ok(flate2::Status::StreamEnd) => break,
            Ok(_) => {}
            // Compressing into a `Vec` with room left does not fail.
            Err(_) => break,
        }
    }
}

/// gzip (RFC 1952): a 10-byte header, raw deflate, CRC-32 and length.
pub(super) fn gzip(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len() / 2 + 64);
    // Magic, deflate, no flags, no time, no extra flags, unknown OS.
    out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
    with(
        &RAW_DEFLATE,
        || flate2::Compress::new(flate2::Compression::new(DEFLATE_LEVEL), false),
        |c| deflate_into(c, input, &mut out),
    );
    let mut crc = flate2::Crc::new();
    crc.update(input);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(input.len() as u32).to_le_bytes());
    out
}

/// zlib (RFC 1950), gRPC's `deflate`.
pub(super) fn zlib(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len() / 2 + 64);
    with(
        &ZLIB_DEFLATE,
        || flate2::Compress::new(flate2::Compression::new(DEFLATE_LEVEL), true),
        |c| deflate_into(c, input, &mut out),
    );
    out
}

/// zstd (RFC 8878), in one frame that records its size.
pub(super) fn zstd(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(input.len()));
    with(&ZSTD_C, zstd::zstd_safe::CCtx::create, |c| {
        // Cannot fail: the output has the bound's room.
        let _ = c.compress(&mut out, input, ZSTD_LEVEL);
    });
    out
}

/// Grows `out` for more output: doubling, but to at most `limit + 1`
/// bytes (one past the limit tells that it was passed); `TooLarge` if it
/// holds more than `limit` already.
fn room(out: &mut Vec<u8>, limit: usize) -> Result<(), Error> {
    if out.len() > limit {
        return Err(Error::TooLarge);
    }
    if out.len() == out.capacity() {
        let want = (out.capacity() * 2).max(4096).min(limit.saturating_add(1));
        out.reserve_exact(want.saturating_sub(out.len()).max(1));
    }
    Ok(())
}

/// Inflates one deflate stream from the start of `input` with `d` into
/// `out` (appended); returns the input bytes it took.
fn inflate_into(
    d: &mut flate2::Decompress,
    zlib_header: bool,
    input: &[u8],
    out: &mut Vec<u8>,
    limit: usize,
) -> Result<usize, Error> {
    d.reset(zlib_header);
    let start_in = d.total_in();
    loop {
        room(out, limit)?;
        let read = (d.total_in() - start_in) as usize;
        let before = (d.total_in(), d.total_out());
        let status = d
            .decompress_vec(&input[read..], out, flate2::FlushDecompress::None)
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        if out.len() > limit {
            return Err(Error::TooLarge);
        }
        match status {
            flate2::Status::StreamEnd => return Ok((d.total_in() - start_in) as usize),
            _ if before == (d.total_in(), d.total_out()) && out.len() < out.capacity() => {
                return Err(Error::Corrupt("the stream ends early".into()));
            }
            _ => {}
        }
    }
}

/// gzip's header: its length, or why it is not one.
fn gzip_header(input: &[u8]) -> Result<usize, Error> {
    let bad = |why: &str| Error::Corrupt(format!("gzip header: {why}"));
    if input.len() < 10 || input[0] != 0x1f || input[1] != 0x8b {
        return Err(bad("not gzip"));
    }
    if input[2] != 8 {
        return Err(bad("not deflate"));
    }
    let flags = input[3];
    let mut at = 10;
    let need = |at: usize, n: usize| {
        if input.len() < at + n {
            Err(bad("cut short"))
        } else {
            Ok(())
        }
    };
    if flags & 0x04 != 0 {
        // FEXTRA: a 2-byte length, then that much.
        need(at, 2)?;
        let n = u16::from_le_bytes([input[at], input[at + 1]]) as usize;
        need(at + 2, n)?;
        at += 2 + n;
    }
    for flag in [0x08, 0x10] {
        // FNAME, FCOMMENT: zero-terminated.
        if flags & flag != 0 {
            let end = input[at..]
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| bad("unterminated name or comment"))?;
            at += end + 1;
        }
    }
    if flags & 0x02 != 0 {
        // FHCRC.
        need(at, 2)?;
        at += 2;
    }
    if flags & 0xe0 != 0 {
        return Err(bad("reserved flags set"));
    }
    Ok(at)
}

/// Inflates gzip: one member or several, each checked against its CRC-32
/// and length.
pub(super) fn gunzip(input: &[u8], limit: usize) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < input.len() {
        at += gzip_header(&input[at..])?;
        let start = out.len();
        at += with(
            &RAW_INFLATE,
            || flate2::Decompress::new(false),
            |d| inflate_into(d, false, &input[at..], &mut out, limit),
        )?;
        let trailer = input
            .get(at..at + 8)
            .ok_or_else(|| Error::Corrupt("gzip trailer cut short".into()))?;
        let mut crc = flate2::Crc::new();
        crc.update(&out[start..]);
        let want_crc = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
        let want_len = u32::from_le_bytes([trailer[4], trailer[5], trailer[6], trailer[7]]);
        if crc.sum() != want_crc || (out.len() - start) as u32 != want_len {
            return Err(Error::Corrupt("gzip checksum or length mismatch".into()));
        }
        at += 8;
    }
    if at == 0 {
        return Err(Error::Corrupt("empty gzip message".into()));
    }
    Ok(out)
}

/// Inflates zlib; nothing may follow its stream.
pub(super) fn unzlib(input: &[u8], limit: usize) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    let used = with(
        &ZLIB_INFLATE,
        || flate2::Decompress::new(true),
        |d| inflate_into(d, true, input, &mut out, limit),
    )?;
    if used != input.len() {
        return Err(Error::Corrupt("bytes after the zlib stream".into()));
    }
    Ok(out)
}

/// Inflates zstd: one frame or several.
pub(super) fn unzstd(input: &[u8], limit: usize) -> Result<Vec<u8>, Error> {
    use zstd::zstd_safe::{DCtx, InBuffer, OutBuffer, ResetDirective};
    let mut out = Vec::new();
    with(&ZSTD_D, DCtx::create, |d| {
        let _ = d.reset(ResetDirective::SessionOnly);
        let mut src = InBuffer::around(input);
        let mut frame_done = true;
        let result = loop {
            if src.pos() == input.len() && frame_done {
                break if input.is_empty() {
                    Err(Error::Corrupt("empty zstd message".into()))
                } else {
                    Ok(())
                };
            }
            if let Err(e) = room(&mut out, limit) {
                break Err(e);
            }
            let (before_in, before_out) = (src.pos(), out.len());
            let mut dst = OutBuffer::around_pos(&mut out, before_out);
            match d.decompress_stream(&mut dst, &mut src) {
                Ok(hint) => frame_done = hint == 0,
                Err(code) => {
                    break Err(Error::Corrupt(
                        zstd::zstd_safe::get_error_name(code).to_owned(),
                    ));
                }
            }
            if out.len() > limit {
                break Err(Error::TooLarge);
            }
            // No progress with input left and room to write: cut short.
            if src.pos() == before_in && out.len() == before_out && out.len() < out.capacity() {
                break Err(Error::Corrupt("the frame ends early".into()));
            }
        };
        if result.is_err() {
            let _ = d.reset(ResetDirective::SessionOnly);
        }
        result
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn sample() -> Vec<u8> {
        (0..50_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect()
    }

    #[test]
    fn what_we_write_other_implementations_read() {
        let input = sample();
        let mut back = Vec::new();
        flate2::read::GzDecoder::new(&gzip(&input)[..])
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, input);
        back.clear();
        flate2::read::ZlibDecoder::new(&zlib(&input)[..])
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, input);
        assert_eq!(zstd::decode_all(&zstd(&input)[..]).unwrap(), input);
    }

    #[test]
    fn what_other_implementations_write_we_read() {
        let input = sample();
        // gzip with a file name and a comment, in two members.
        let member = |part: &[u8]| {
            let mut w = flate2::GzBuilder::new()
                .filename("part")
                .comment("a comment")
                .write(Vec::new(), flate2::Compression::fast());
            w.write_all(part).unwrap();
            w.finish().unwrap()
        };
        let (a, b) = input.split_at(12_345);
        let two = [member(a), member(b)].concat();
        assert_eq!(gunzip(&two, input.len()).unwrap(), input);
        let mut w = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        w.write_all(&input).unwrap();
        assert_eq!(unzlib(&w.finish().unwrap(), input.len()).unwrap(), input);
        // zstd in two frames, from the library's streaming encoder.
        let frames = [
            zstd::encode_all(a, 1).unwrap(),
            zstd::encode_all(b, 19).unwrap(),
        ]
        .concat();
        assert_eq!(unzstd(&frames, input.len()).unwrap(), input);
    }

    #[test]
    fn cut_or_trailing_bytes_are_corrupt() {
        let input = sample();
        for (packed, inflate) in [
            (
                gzip(&input),
                gunzip as fn(&[u8], usize) -> Result<Vec<u8>, Error>,
            ),
            (zlib(&input), unzlib),
            (zstd(&input), unzstd),
        ] {
            for cut in [0, 1, 9, packed.len() / 2, packed.len() - 1] {
                let got = inflate(&packed[..cut], usize::MAX);
                assert!(
                    matches!(got, Err(Error::Corrupt(_))),
                    "cut at {cut}: {got:?}"
                );
            }
            let mut more = packed.clone();
            more.push(0);
            assert!(matches!(inflate(&more, usize::MAX), Err(Error::Corrupt(_))));
            // The state reused after a failure still works.
            assert_eq!(inflate(&packed, input.len()).unwrap(), input);
        }
    }
}
