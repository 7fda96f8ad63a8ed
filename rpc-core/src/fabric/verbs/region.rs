//! Memory registered with the device, read and written safely while the
//! device may write it.

use super::*;

/// Memory registered with the device.
#[derive(Clone)]
pub struct VerbsRegion {
    pub(super) mr: Arc<Mr>,
}

impl std::fmt::Debug for VerbsRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.mr.len)
            .finish()
    }
}

/// A large-message buffer of the verbs fabric: registered memory from the
/// context's registration cache, back to it when dropped.
pub struct VerbsBuffer {
    /// Registered when taken; `None` only while dropping.
    pub(super) mr: Option<Arc<Mr>>,
    pub(super) len: usize,
    class: usize,
    cache: Arc<Cache<Arc<Mr>>>,
    /// When it was handed out (how long a large one is kept after).
    taken: std::time::Instant,
}

impl VerbsBuffer {
    /// `len` bytes of a registered region of size class `class`, from
    /// `cache` or registered now.
    pub(super) fn take(
        cache: &Arc<Cache<Arc<Mr>>>,
        pd: &Arc<Pd>,
        len: usize,
        through_window: bool,
    ) -> Result<VerbsBuffer, FabricError> {
        let class = cache::class_of(len)
            .ok_or_else(|| FabricError::invalid("buffer", format!("{len} bytes is too large")))?;
        let mr = match cache.take(class) {
            Some(mr) => mr,
            None => Arc::new(Mr::for_buffer(pd.clone(), class, through_window)?),
        };
        cache::count_in_use(class, true);
        Ok(VerbsBuffer {
            mr: Some(mr),
            len,
            class,
            taken: std::time::Instant::now(),
            cache: cache.clone(),
        })
    }

    pub(super) fn mr(&self) -> &Arc<Mr> {
        self.mr.as_ref().expect("present until dropped")
    }
}

impl std::fmt::Debug for VerbsBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl std::ops::Deref for VerbsBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes of the region this buffer holds alone (`len`
        // is at most its size class, the region's length). While a queue
        // pair lends it or reads into it, the queue pair owns this buffer,
        // so no view of it exists then.
        unsafe { std::slice::from_raw_parts(self.mr().buf.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for VerbsBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.mr().buf.as_ptr(), self.len) }
    }
}

impl Drop for VerbsBuffer {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            cache::count_in_use(self.class, false);
            // Kept registered for the next large message, or deregistered
            // and unmapped here.
            drop(self.cache.give(self.class, mr, self.taken));
        }
    }
}

impl crate::fabric::Buffer for VerbsBuffer {}

impl Region for VerbsRegion {
    type Buffer = VerbsBuffer;
    fn addr(&self) -> u64 {
        self.mr.buf.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.mr.len
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// Memory peers may write (receive rings) is copied out with volatile
    /// loads and `f` sees the copy, so a peer writing concurrently (against
    /// the protocol) can change what we copy but never a value after we
    /// checked it. Local-only memory (staging) is lent directly, under the
    /// region's lock.
    fn read<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check_bounds(offset, len);
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above).
        let src = unsafe { self.mr.buf.as_ptr().add(offset) };
        if self.mr.remote_write {
            let mut copy = vec![0u8; len];
            // SAFETY: `src` is valid for `len` bytes; volatile loads tolerate
            // the device writing them concurrently.
            unsafe { volatile_copy_from(src, &mut copy) };
            f(&copy)
        } else {
            // SAFETY: the device never writes local-only memory, and the lock
            // keeps every `&mut` view from `write` away while this one lives.
            f(unsafe { std::slice::from_raw_parts(src, len) })
        }
    }

    /// Memory peers may write is copied with volatile loads, straight into `dst`.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) {
        if !self.mr.remote_write {
            return self.read(offset, dst.len(), |src| dst.copy_from_slice(src));
        }
        self.check_bounds(offset, dst.len());
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above); volatile
        // loads tolerate the device writing these bytes concurrently.
        unsafe { volatile_copy_from(self.mr.buf.as_ptr().add(offset), dst) };
    }

    /// Local-only memory (staging) is lent as `&mut` under the region's lock;
    /// the device only reads it (for writes posted earlier, whose bytes the
    /// protocol no longer reuses until the peer released them). Memory peers
    /// may write is written through a copy with volatile stores.
    fn write<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.check_bounds(offset, len);
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above).
        let dst = unsafe { self.mr.buf.as_ptr().add(offset) };
        if self.mr.remote_write {
            let mut copy = vec![0u8; len];
            let r = f(&mut copy);
            for (i, b) in copy.iter().enumerate() {
                // SAFETY: `dst` is valid for `len` bytes.
                unsafe { dst.add(i).write_volatile(*b) };
            }
            r
        } else {
            // SAFETY: in bounds; the lock makes this the only view of the
            // buffer from Rust while it lives, and the device does not write
            // local-only memory.
            f(unsafe { std::slice::from_raw_parts_mut(dst, len) })
        }
    }
}

impl VerbsRegion {
    pub(super) fn check_bounds(&self, offset: usize, len: usize) {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.mr.len),
            "access out of region bounds"
        );
    }
}

/// Copies `dst.len()` bytes from `src` with volatile loads (8 bytes at a time
/// where aligned).
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` bytes.
pub(super) unsafe fn volatile_copy_from(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    let mut i = 0;
    while i < len && (src as usize + i) % 8 != 0 {
        // SAFETY: `i < len`: within the bytes the caller vouches for.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
    while i + 8 <= len {
        // SAFETY: `i + 8 <= len`, and `src + i` is 8-aligned after the loop above.
        let word = unsafe { src.add(i).cast::<u64>().read_volatile() };
        dst[i..i + 8].copy_from_slice(&word.to_ne_bytes());
        i += 8;
    }
    while i < len {
        // SAFETY: `i < len`: within the bytes the caller vouches for.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
}
