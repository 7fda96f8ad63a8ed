//! Corked writes and a sleeping poller: a caller corks its request (it
//! leaves with the next post of its connection, see `Conn::send_corked`)
//! and notes the connection here, and the poller uncorks what is noted on
//! each turn, so a request leaves even if its call is never polled. A
//! poller about to sleep on its completion queue would not turn again
//! until something completes: so it says so (`asleep`) and flushes once
//! more, and a caller that notes a connection while it sleeps uncorks it
//! itself. Both store their flag, then read the other's (`SeqCst`): either
//! the poller's last flush sees the note, or the caller sees `asleep`.
//!
//! `scripts/loom` model-checks this: `rpc-core/tests/loom_wake.rs`.

use crate::sync::Mutex;
use crate::sync::atomic::{AtomicBool, Ordering};

/// Items (connections) whose corked writes wait for an uncork.
pub struct Corked<T> {
    list: Mutex<Vec<T>>,
    /// Whether `list` may be non-empty.
    any: AtomicBool,
    /// Whether the poller sleeps on the queue: then a corking caller
    /// uncorks at once instead of waiting for it.
    asleep: AtomicBool,
}

impl<T> std::fmt::Debug for Corked<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corked").finish_non_exhaustive()
    }
}

impl<T> Default for Corked<T> {
    fn default() -> Self {
        Corked::new()
    }
}

impl<T> Corked<T> {
    /// Nothing noted.
    pub fn new() -> Corked<T> {
        Corked {
            list: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
        }
    }

    /// Notes `item`: the poller uncorks it on its next turn, and if the
    /// poller sleeps, it is uncorked (with everything noted) now.
    pub fn note(&self, item: T, uncork: impl FnMut(T)) {
        self.list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(item);
        self.any.store(true, Ordering::SeqCst);
        // Pairs with the poller's store of `asleep` before its last flush:
        // either it sees `any`, or this sees `asleep`.
        if self.asleep.load(Ordering::SeqCst) {
            self.flush(uncork);
        }
    }

    /// Uncorks everything noted.
    pub fn flush(&self, mut uncork: impl FnMut(T)) {
        // A load first: a swap on every turn would take the cache line from
        // the callers that set it.
        if !self.any.load(Ordering::SeqCst) || !self.any.swap(false, Ordering::SeqCst) {
            return;
        }
        let lock = || self.list.lock().unwrap_or_else(|e| e.into_inner());
        let mut items = std::mem::take(&mut *lock());
        for item in items.drain(..) {
            uncork(item);
        }
        // Give the list its capacity back: no allocation per flush.
        let mut list = lock();
        if list.capacity() == 0 {
            *list = items;
        }
    }

    /// The poller sleeps in `wait`: flushes once more after saying so, so
    /// that what is noted from then on is uncorked by whoever notes it.
    pub fn sleep<R>(&self, uncork: impl FnMut(T), wait: impl FnOnce() -> R) -> R {
        self.asleep.store(true, Ordering::SeqCst);
        self.flush(uncork);
        let woke = wait();
        self.asleep.store(false, Ordering::SeqCst);
        woke
    }
}
