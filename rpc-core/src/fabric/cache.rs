//! The registration cache: large-message buffers kept for reuse.
//!
//! A large message (see rendezvous in `ARCHITECTURE.md`) needs a buffer
//! the fabric can reach: on rdma:// registered memory, whose registration
//! (`ibv_reg_mr`: pinning every page) costs far more than the copy it
//! saves; on every fabric, freshly mapped pages that fault in one by one.
//! So buffers are kept when dropped, by size class (powers of two from
//! [`MIN_CLASS`]), and handed out again: in the steady state a large
//! message registers and maps nothing. The cache is bounded
//! ([`CACHED_BYTES`] in all, [`PER_CLASS`] buffers per class); a buffer
//! larger than a quarter of the bound is never kept, so it is made to the
//! message's size (in whole pages), not rounded up to a power of two: a
//! 256 MiB message registers 256 MiB, not 512.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of large-message buffers in use in this process (lent, being
/// read into, or holding a message not yet decoded), and kept for reuse.
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// What large-message buffers hold in this process, in bytes: `(in use,
/// kept for reuse)`. Buffers in use are lent to a peer, being read into, or
/// hold a received message its handler or caller has not finished with; a
/// connection that fails returns its buffers, so with no calls under way
/// the first figure is 0.
pub fn buffer_bytes() -> (usize, usize) {
    (IN_USE.load(Ordering::Relaxed), KEPT.load(Ordering::Relaxed))
}

/// Counts `class` bytes of buffer handed out (`true`) or given back.
pub(crate) fn count_in_use(class: usize, out: bool) {
    if out {
        IN_USE.fetch_add(class, Ordering::Relaxed);
    } else {
        IN_USE.fetch_sub(class, Ordering::Relaxed);
    }
}

/// The smallest size class: 64 KiB.
pub(crate) const MIN_CLASS: usize = 64 << 10;
/// Most bytes kept for reuse in one cache.
pub(crate) const CACHED_BYTES: usize = 256 << 20;
/// Most buffers kept per size class.
pub(crate) const PER_CLASS: usize = 32;

/// The size class that holds `len` bytes: a power of two, at least
/// [`MIN_CLASS`], up to the largest kept ([`CACHED_BYTES`] / 4); above
/// that, `len` in whole pages (never kept, so never shared with another
/// size). `None` above 2^40.
pub(crate) fn class_of(len: usize) -> Option<usize> {
    const PAGE: usize = 4096;
    if len > 1 << 40 {
        return None;
    }
    let class = len.max(MIN_CLASS).next_power_of_two();
    Some(if class > CACHED_BYTES / 4 {
        len.next_multiple_of(PAGE)
    } else {
        class
    })
}

/// Buffers of type `T` kept by size class.
pub(crate) struct Cache<T> {
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    /// `(class, buffers)`, few entries: looked up linearly.
    classes: Vec<(usize, Vec<T>)>,
    bytes: usize,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Cache {
            inner: Mutex::new(Inner {
                classes: Vec::new(),
                bytes: 0,
            }),
        }
    }
}

impl<T> Drop for Cache<T> {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        KEPT.fetch_sub(inner.bytes, Ordering::Relaxed);
    }
}

impl<T> Cache<T> {
    /// A kept buffer of size class `class`, if there is one.
    pub(crate) fn take(&self, class: usize) -> Option<T> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let found = inner
            .classes
            .iter_mut()
            .find(|(c, _)| *c == class)
            .and_then(|(_, v)| v.pop());
        if found.is_some() {
            inner.bytes -= class;
            KEPT.fetch_sub(class, Ordering::Relaxed);
        }
        found
    }

    /// Keeps `buf` (of size class `class`) for reuse if there is room;
    /// otherwise hands it back, to be freed.
    pub(crate) fn give(&self, class: usize, buf: T) -> Option<T> {
        if class > CACHED_BYTES / 4 {
            return Some(buf);
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.bytes + class > CACHED_BYTES {
            return Some(buf);
        }
        let Inner { classes, bytes } = &mut *inner;
        let slot = match classes.iter().position(|(c, _)| *c == class) {
            Some(i) => &mut classes[i].1,
            None => {
                classes.push((class, Vec::new()));
                &mut classes.last_mut().expect("just pushed").1
            }
        };
        if slot.len() >= PER_CLASS {
            return Some(buf);
        }
        slot.push(buf);
        *bytes += class;
        KEPT.fetch_add(class, Ordering::Relaxed);
        None
    }

    /// Bytes kept.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_the_minimum() {
        assert_eq!(class_of(0), Some(MIN_CLASS));
        assert_eq!(class_of(MIN_CLASS), Some(MIN_CLASS));
        assert_eq!(class_of(MIN_CLASS + 1), Some(2 * MIN_CLASS));
        assert_eq!(class_of(CACHED_BYTES / 4), Some(CACHED_BYTES / 4));
        // Above what is kept: the size itself, in whole pages.
        assert_eq!(
            class_of(CACHED_BYTES / 4 + 1),
            Some(CACHED_BYTES / 4 + 4096)
        );
        assert_eq!(class_of((256 << 20) + 100), Some((256 << 20) + 4096));
        assert_eq!(class_of(1 << 30), Some(1 << 30));
        assert_eq!(class_of((1 << 40) + 1), None);
        assert_eq!(class_of(usize::MAX), None);
    }

    #[test]
    fn kept_buffers_come_back_and_the_bound_holds() {
        let cache = Cache::default();
        assert_eq!(cache.take(MIN_CLASS), None::<u32>);
        assert_eq!(cache.give(MIN_CLASS, 1), None);
        assert_eq!(cache.give(MIN_CLASS, 2), None);
        assert_eq!(cache.bytes(), 2 * MIN_CLASS);
        assert_eq!(cache.take(MIN_CLASS), Some(2));
        assert_eq!(cache.take(2 * MIN_CLASS), None);
        // Too large to keep at all.
        assert_eq!(cache.give(CACHED_BYTES / 2, 3), Some(3));
        // Fill to the bound: the next is refused.
        let big = CACHED_BYTES / 4;
        for i in 0..3 {
            assert_eq!(cache.give(big, 10 + i), None);
        }
        assert_eq!(cache.give(big, 20), Some(20));
        // Per class.
        let small = Cache::default();
        for i in 0..PER_CLASS {
            assert_eq!(small.give(MIN_CLASS, i), None);
        }
        assert_eq!(small.give(MIN_CLASS, 99), Some(99));
    }
}
