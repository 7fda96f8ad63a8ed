//! The registration cache: large-message buffers kept for reuse.
//!
//! A large message (see rendezvous in `ARCHITECTURE.md`) needs a buffer
//! the fabric can reach: on rdma:// registered memory, whose registration
//! (`ibv_reg_mr`: pinning every page) costs far more than the copy it
//! saves; on every fabric, freshly mapped pages that fault in one by one.
//! So buffers are kept when dropped, by size class (powers of two from
//! [`MIN_CLASS`]), and handed out again: in the steady state a large
//! message registers and maps nothing. The cache is bounded
//! ([`CACHED_BYTES`] in all, [`PER_CLASS`] buffers per class) up to
//! [`LARGE`], a quarter of the bound. Above it a buffer is made close to
//! the message's size, not rounded up to a power of two: those classes are
//! multiples of a sixteenth of the next power of two, so a 256 MiB message
//! registers 288 MiB, not 512.
//!
//! Buffers above [`LARGE`] are kept one at a time: the last one given back,
//! for the next message of its class (a message of another size frees
//! it), and only for a while: twice as long as it was last in use, at
//! least [`LARGE_IDLE`] and at most [`LARGE_IDLE_MAX`]. A
//! stream or a run of calls moving messages of hundreds of megabytes then
//! maps and registers its buffers once, not per message (registering pins
//! and maps every page, which costs as much as moving the bytes), and a
//! process that moved one such message gives the memory back soon after:
//! the dispatchers trim the cache ([`Cache::trim`]) whenever they check
//! their timers, at least once a second even when idle, and the next
//! large message takes it or frees it. Where messages this size take
//! seconds to move (a slow link, an emulated device), the next one comes
//! seconds later too, and a fixed two seconds would free each buffer just
//! before it was needed again.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
/// The largest power-of-two size class; above it, classes are multiples
/// of a sixteenth of the next power of two, and one buffer is kept at a
/// time, for twice as long as it was in use (from [`LARGE_IDLE`] to
/// [`LARGE_IDLE_MAX`]).
pub(crate) const LARGE: usize = CACHED_BYTES / 4;
/// How long the one buffer above [`LARGE`] is kept unused, at least (it
/// is kept twice as long as it was last in use).
pub(crate) const LARGE_IDLE: Duration = Duration::from_secs(2);
/// How long the one buffer above [`LARGE`] is kept unused, at most.
pub(crate) const LARGE_IDLE_MAX: Duration = Duration::from_secs(30);

/// The size class that holds `len` bytes: a power of two, at least
/// [`MIN_CLASS`], up to [`LARGE`]; above that, `len` rounded up to a
/// sixteenth of its next power of two (at most 1/8 more than `len`, and a
/// whole number of pages). `None` above 2^40.
pub(crate) fn class_of(len: usize) -> Option<usize> {
    if len > 1 << 40 {
        return None;
    }
    let class = len.max(MIN_CLASS).next_power_of_two();
    Some(if class > LARGE {
        len.next_multiple_of(class / 16)
    } else {
        class
    })
}

/// Buffers of type `T` kept by size class.
pub(crate) struct Cache<T> {
    inner: Mutex<Inner<T>>,
    /// When the kept large buffer is due to be freed, in nanoseconds from
    /// `epoch` (0: none kept), so that [`Cache::trim`] costs one load
    /// until then: the dispatchers call it on every timer check. Written
    /// only with `inner` locked.
    large_until: AtomicU64,
    epoch: Instant,
}

struct Inner<T> {
    /// `(class, buffers)`, few entries: looked up linearly.
    classes: Vec<(usize, Vec<T>)>,
    /// Bytes in `classes`.
    bytes: usize,
    /// The one buffer above [`LARGE`] kept, with its class (when it is due
    /// to be freed is [`Cache::large_until`]).
    large: Option<(usize, T)>,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Cache {
            inner: Mutex::new(Inner {
                classes: Vec::new(),
                bytes: 0,
                large: None,
            }),
            large_until: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl<T> Drop for Cache<T> {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        let large = inner.large.as_ref().map_or(0, |(class, _)| *class);
        KEPT.fetch_sub(inner.bytes + large, Ordering::Relaxed);
    }
}

impl<T> Cache<T> {
    /// A kept buffer of size class `class`, if there is one.
    pub(crate) fn take(&self, class: usize) -> Option<T> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if class > LARGE {
            let (kept, buf) = self.take_large(&mut inner)?;
            drop(inner);
            if kept == class {
                return Some(buf);
            }
            // Of another size: freed (outside the lock) before a new one
            // is made, so that keeping it never adds to the peak.
            drop(buf);
            return None;
        }
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

    /// Keeps `buf` (of size class `class`, handed out at `taken`) for
    /// reuse if there is room; otherwise hands it back, to be freed.
    pub(crate) fn give(&self, class: usize, buf: T, taken: Instant) -> Option<T> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if class > LARGE {
            // Kept in place of the one before, which goes back to be freed,
            // for twice as long as it was in use.
            let now = Instant::now();
            let idle = (2 * now.saturating_duration_since(taken)).clamp(LARGE_IDLE, LARGE_IDLE_MAX);
            let old = inner.large.replace((class, buf));
            self.large_until
                .store(self.nanos(now + idle).max(1), Ordering::Relaxed);
            KEPT.fetch_add(class, Ordering::Relaxed);
            let (old_class, old) = old?;
            KEPT.fetch_sub(old_class, Ordering::Relaxed);
            return Some(old);
        }
        if inner.bytes + class > CACHED_BYTES {
            return Some(buf);
        }
        let Inner { classes, bytes, .. } = &mut *inner;
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

    /// Frees the buffer above [`LARGE`] if it was kept unused as long as it
    /// is kept (see [`Cache::give`]) by `now`.
    pub(crate) fn trim(&self, now: Instant) {
        let due = |until: u64| until != 0 && self.nanos(now) >= until;
        if !due(self.large_until.load(Ordering::Relaxed)) {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Again under the lock: a buffer given back meanwhile is fresh.
        if !due(self.large_until.load(Ordering::Relaxed)) {
            return;
        }
        let stale = self.take_large(&mut inner);
        // Deregistered and unmapped outside the lock.
        drop(inner);
        drop(stale);
    }

    /// Takes the large buffer out of `inner` (locked), with its class.
    fn take_large(&self, inner: &mut Inner<T>) -> Option<(usize, T)> {
        let (class, buf) = inner.large.take()?;
        self.large_until.store(0, Ordering::Relaxed);
        KEPT.fetch_sub(class, Ordering::Relaxed);
        Some((class, buf))
    }

    /// `at` in nanoseconds from the cache's epoch.
    fn nanos(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch)
            .as_nanos()
            .min(u64::MAX as u128) as u64
    }

    /// Bytes kept.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.bytes + inner.large.as_ref().map_or(0, |(class, _)| *class)
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
        // Above: sixteenths of the next power of two.
        assert_eq!(class_of(LARGE + 1), Some(LARGE + (8 << 20)));
        assert_eq!(class_of((256 << 20) + 100), Some(288 << 20));
        assert_eq!(class_of(1 << 30), Some(1 << 30));
        assert_eq!(class_of((1 << 30) + 1), Some((1 << 30) + (128 << 20)));
        assert_eq!(class_of((1 << 40) + 1), None);
        assert_eq!(class_of(usize::MAX), None);
    }

    #[test]
    fn kept_buffers_come_back_and_the_bound_holds() {
        let now = Instant::now();
        let cache = Cache::default();
        assert_eq!(cache.take(MIN_CLASS), None::<u32>);
        assert_eq!(cache.give(MIN_CLASS, 1, now), None);
        assert_eq!(cache.give(MIN_CLASS, 2, now), None);
        assert_eq!(cache.bytes(), 2 * MIN_CLASS);
        assert_eq!(cache.take(MIN_CLASS), Some(2));
        assert_eq!(cache.take(2 * MIN_CLASS), None);
        // Fill to the bound: the next is refused.
        let big = CACHED_BYTES / 4;
        for i in 0..3 {
            assert_eq!(cache.give(big, 10 + i, now), None);
        }
        assert_eq!(cache.give(big, 20, now), Some(20));
        // Per class.
        let small = Cache::default();
        for i in 0..PER_CLASS {
            assert_eq!(small.give(MIN_CLASS, i, now), None);
        }
        assert_eq!(small.give(MIN_CLASS, 99, now), Some(99));
    }

    #[test]
    fn one_large_buffer_is_kept_for_a_while() {
        let now = Instant::now();
        let cache = Cache::default();
        let (a, b) = (class_of(LARGE + 1).unwrap(), class_of(4 * LARGE).unwrap());
        assert_eq!(cache.give(a, 1, now), None, "kept");
        assert_eq!(cache.bytes(), a);
        assert_eq!(cache.take(a), Some(1));
        assert_eq!(cache.bytes(), 0);
        // Another size is asked for: the kept one is freed first.
        assert_eq!(cache.give(a, 1, now), None);
        assert_eq!(cache.take(b), None);
        assert_eq!(cache.bytes(), 0);
        // One at a time: the newest stays, the one before goes back.
        assert_eq!(cache.give(a, 2, now), None);
        assert_eq!(cache.give(b, 3, now), Some(2));
        assert_eq!(cache.bytes(), b);
        // Not yet idle long enough, then freed.
        cache.trim(Instant::now());
        assert_eq!(cache.bytes(), b);
        cache.trim(Instant::now() + LARGE_IDLE);
        assert_eq!(cache.bytes(), 0);
        assert_eq!(cache.take(b), None);
    }

    #[test]
    fn a_large_buffer_long_in_use_is_kept_twice_as_long() {
        let cache = Cache::default();
        let a = class_of(4 * LARGE).unwrap();
        // In use for 10 s (a message that took that long to move): kept
        // for 20 s, not the minimum.
        let ago = |secs| Instant::now().checked_sub(Duration::from_secs(secs));
        let Some(taken) = ago(10) else {
            return; // a clock that cannot reach back that far
        };
        assert_eq!(cache.give(a, 1, taken), None);
        cache.trim(Instant::now() + 3 * LARGE_IDLE);
        assert_eq!(cache.bytes(), a, "kept past the minimum");
        cache.trim(Instant::now() + Duration::from_secs(25));
        assert_eq!(cache.bytes(), 0, "freed once idle twice as long");
        // However long in use, at most LARGE_IDLE_MAX.
        let Some(taken) = ago(3600) else { return };
        assert_eq!(cache.give(a, 2, taken), None);
        cache.trim(Instant::now() + LARGE_IDLE_MAX + Duration::from_secs(1));
        assert_eq!(cache.bytes(), 0);
    }
}
