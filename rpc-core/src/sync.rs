//! The synchronization primitives of the hand-written concurrency that
//! `scripts/loom` model-checks: call slots (`slot.rs`), the poll hand-off
//! between callers and the poller (`dispatch/handoff.rs`), the corked
//! writes a sleeping poller must not miss (`dispatch/wake.rs`), the
//! wake-ups of parked handler tasks (`executor.rs`), and the places a
//! stream's end hands to streams waiting under a server's stream limit
//! (`client/stream_limit.rs`).
//!
//! A normal build re-exports `std`'s, so nothing changes. Under
//! `--cfg loom` they are the loom crate's, and the model checks in
//! `rpc-core/tests/loom_*.rs` run that production code under every
//! interleaving (up to a preemption bound) and every outcome the memory
//! model allows. Three adjustments keep the checks honest (each works
//! around a gap in loom 0.7's memory model that makes it report outcomes
//! the real one forbids; none hides a weakened ordering of ours):
//!
//! - loom treats a `SeqCst` load or store as `AcqRel` (its README,
//!   "Unsupported features"), and so reports store-buffering outcomes
//!   that `SeqCst` forbids: the flag-then-check hand-shakes here (a
//!   caller's flag against the poller's) would fail for no fault of theirs.
//!   Under loom, the atomics below place a `SeqCst` fence after every
//!   `SeqCst` store or read-modify-write and before every `SeqCst` load,
//!   which gives them back their single total order. Weaker orderings get
//!   no fence, so weakening one of ours is still caught.
//! - loom builds an atomic's modification order lazily, from causality,
//!   and may place a plain store before a read-modify-write that ran
//!   earlier and did not read it; a later swap can then read the value
//!   the store overwrote, even when the store happens-before that swap (a
//!   woken task's flag was lost that way). Under loom every store is
//!   therefore a swap with the same ordering, whose read part adds no
//!   synchronization: it goes after the latest value, as a store that
//!   reaches memory when it runs.
//! - A timed park is an untimed one: loom has no clock, and a wake-up that
//!   only a timeout would deliver is exactly the lost wake-up to find.
//!
//! `Arc` and `OnceLock` stay `std`'s in both builds: loom's `Arc` has no
//! `Weak` and cannot make a `Waker`, and loom has no `OnceLock`; the protocols
//! checked do not rest on reference counts. Of the two `OnceLock`s, the
//! poller's thread handle is set before the poller looks at any flag, and
//! a task's first-poll waker (`executor.rs`) is made under the task
//! table's lock: only its thread's own clone takes it in the models.

#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

/// Atomics (see the module's notes on `SeqCst` under loom).
pub(crate) mod atomic {
    #[cfg(loom)]
    pub(crate) use super::sc::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize};
    pub(crate) use std::sync::atomic::Ordering;
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize};
}

/// Threads: the current one, and parking.
pub(crate) mod thread {
    #[cfg(loom)]
    pub(crate) use loom::thread::{Thread, current};
    #[cfg(not(loom))]
    pub(crate) use std::thread::{Thread, current, park_timeout};

    /// Parks the current thread; loom has no clock, so the timeout never
    /// ends the park: only an unpark does.
    #[cfg(loom)]
    pub(crate) fn park_timeout(_: std::time::Duration) {
        loom::thread::park();
    }
}

/// Atomics for loom whose `SeqCst` accesses are fenced and whose stores
/// are swaps (see the module's notes).
#[cfg(loom)]
mod sc {
    use loom::sync::atomic::{Ordering, fence};

    /// A `SeqCst` fence before a `SeqCst` load.
    fn before(order: Ordering) {
        if order == Ordering::SeqCst {
            fence(Ordering::SeqCst);
        }
    }

    /// A `SeqCst` fence after a `SeqCst` store.
    fn after(order: Ordering) {
        if order == Ordering::SeqCst {
            fence(Ordering::SeqCst);
        }
    }

    macro_rules! fenced {
        ($name:ident, $t:ty) => {
            #[derive(Default)]
            pub(crate) struct $name(loom::sync::atomic::$name);

            #[allow(dead_code)] // not every atomic uses every operation
            impl $name {
                pub(crate) fn new(v: $t) -> Self {
                    Self(loom::sync::atomic::$name::new(v))
                }

                pub(crate) fn load(&self, order: Ordering) -> $t {
                    before(order);
                    self.0.load(order)
                }

                pub(crate) fn store(&self, v: $t, order: Ordering) {
                    self.0.swap(v, order);
                    after(order);
                }

                pub(crate) fn swap(&self, v: $t, order: Ordering) -> $t {
                    before(order);
                    let prev = self.0.swap(v, order);
                    after(order);
                    prev
                }
            }

            impl std::fmt::Debug for $name {
                fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str(stringify!($name))
                }
            }
        };
    }

    macro_rules! fenced_int {
        ($name:ident, $t:ty) => {
            fenced!($name, $t);

            #[allow(dead_code)] // not every atomic uses every operation
            impl $name {
                pub(crate) fn fetch_add(&self, v: $t, order: Ordering) -> $t {
                    before(order);
                    let prev = self.0.fetch_add(v, order);
                    after(order);
                    prev
                }

                pub(crate) fn fetch_sub(&self, v: $t, order: Ordering) -> $t {
                    before(order);
                    let prev = self.0.fetch_sub(v, order);
                    after(order);
                    prev
                }

                pub(crate) fn fetch_min(&self, v: $t, order: Ordering) -> $t {
                    before(order);
                    let prev = self.0.fetch_min(v, order);
                    after(order);
                    prev
                }

                pub(crate) fn compare_exchange_weak(
                    &self,
                    current: $t,
                    new: $t,
                    success: Ordering,
                    failure: Ordering,
                ) -> Result<$t, $t> {
                    // Its load is `failure`'s when it fails, `success`'s
                    // when it succeeds (a read-modify-write then).
                    if success == Ordering::SeqCst || failure == Ordering::SeqCst {
                        before(Ordering::SeqCst);
                    }
                    let r = self.0.compare_exchange_weak(current, new, success, failure);
                    if r.is_ok() {
                        after(success);
                    }
                    r
                }
            }
        };
    }

    fenced!(AtomicBool, bool);
    fenced_int!(AtomicU8, u8);
    fenced_int!(AtomicU32, u32);
    fenced_int!(AtomicUsize, usize);
    fenced_int!(AtomicU64, u64);
}
