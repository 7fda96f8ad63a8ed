//! Memory the process maps for itself: rings and staging areas.
//!
//! A connection's rings are megabytes. Taken from the allocator, such
//! buffers are not reliably given back to the system when a connection
//! closes (glibc serves them from its heap once its dynamic mmap threshold
//! has risen, and keeps the heap), so a server that saw many connections
//! stays large. Each [`Pages`] is its own anonymous mapping instead:
//! page-aligned (what memory registration prefers), zero-filled, resident
//! only where touched, and unmapped when dropped.

use memmap2::MmapMut;

/// An anonymous, private, page-aligned mapping of zeroed memory, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Pages(MmapMut);

impl Pages {
    /// Maps `len` zeroed bytes.
    pub(crate) fn new(len: usize) -> std::io::Result<Pages> {
        MmapMut::map_anon(len).map(Pages)
    }

    /// Maps `len` zeroed bytes for a large message: backed by huge pages
    /// where the system allows (fewer page faults and TLB misses as the
    /// buffer is first written), else as [`Pages::new`].
    pub(crate) fn large(len: usize) -> std::io::Result<Pages> {
        let map = MmapMut::map_anon(len)?;
        #[cfg(target_os = "linux")]
        if len >= 2 << 20 {
            // Advice only: without transparent huge pages it changes nothing.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(Pages(map))
    }

    /// The first byte of the mapping.
    #[cfg(feature = "verbs")]
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
}

impl std::ops::Deref for Pages {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::DerefMut for Pages {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_zeroed_aligned_and_writable() {
        let mut p = Pages::new(10_000).unwrap();
        assert_eq!(p.len(), 10_000);
        assert_eq!(p.as_ptr() as usize % 4096, 0);
        assert!(p.iter().all(|&b| b == 0));
        p[9_999] = 7;
        assert_eq!(p[9_999], 7);
        assert!(Pages::new(0).unwrap().is_empty());
    }
}
