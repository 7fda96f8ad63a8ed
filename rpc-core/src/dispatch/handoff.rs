//! Who turns a dispatcher's completion queue: the poll state `S` (what one
//! turn works with) is held by one thread at a time, normally the poller
//! thread, or a caller polling for its own response while the poller naps.
//!
//! The hand-shakes, all `SeqCst` (each side stores its flag, then looks at
//! the other's):
//!
//! - A caller counts itself in `callers_polling` while it polls
//!   ([`PollHandoff::poll_until`]). The poller, seeing callers (or recent
//!   polls, `self_polls`), sets `poller_napping`, looks once more, and naps.
//! - Whoever leaves `callers_polling` last, its call unfinished or others
//!   still waiting, sets `take_over` and unparks the poller if it naps
//!   ([`PollHandoff::ensure_polled`]). The poller sets `poller_napping`
//!   before its second look, the caller `take_over` before reading
//!   `poller_napping`: either the poller sees `take_over` (or the caller
//!   still counted) and does not nap, or the caller sees it napping and
//!   unparks it. A nap is also bounded by a timeout, but no wake-up waits
//!   for it.
//!
//! `scripts/loom` model-checks this with naps that only an unpark ends:
//! `rpc-core/tests/loom_poll.rs`.

use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::thread::{self, Thread};
use crate::sync::{Mutex, MutexGuard};
use std::sync::{OnceLock, TryLockError};

/// The poll state of one completion queue and who holds it.
pub struct PollHandoff<S> {
    state: Mutex<S>,
    /// The poller thread, once it runs.
    poller: OnceLock<Thread>,
    /// Callers polling for their responses ([`PollHandoff::poll_until`]).
    callers_polling: AtomicUsize,
    /// Whether the poller thread is napping because a caller polls.
    poller_napping: AtomicBool,
    /// How many times callers (blocked in `wait`, or their futures) turned
    /// the queue themselves: while this grows, the poller naps. A counter,
    /// not a time: the hot path reads no clock for it.
    self_polls: AtomicU64,
    /// A caller or future stopped polling without its response, or with
    /// others waiting, and asked the poller to take over
    /// ([`PollHandoff::ensure_polled`]).
    take_over: AtomicBool,
}

impl<S> std::fmt::Debug for PollHandoff<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollHandoff")
            .field("callers_polling", &self.callers_polling())
            .finish_non_exhaustive()
    }
}

impl<S: Default> Default for PollHandoff<S> {
    fn default() -> Self {
        PollHandoff::new(S::default())
    }
}

impl<S> PollHandoff<S> {
    /// Holds `state`, with no poller yet.
    pub fn new(state: S) -> PollHandoff<S> {
        PollHandoff {
            state: Mutex::new(state),
            poller: OnceLock::new(),
            callers_polling: AtomicUsize::new(0),
            poller_napping: AtomicBool::new(false),
            self_polls: AtomicU64::new(0),
            take_over: AtomicBool::new(false),
        }
    }

    /// The poll state, unless another thread holds it (a poisoned lock is
    /// taken over: its state stays consistent between turns).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, S>> {
        match self.state.try_lock() {
            Ok(st) => Some(st),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Makes the calling thread the poller that [`PollHandoff::ensure_polled`]
    /// and [`PollHandoff::unpark_poller`] wake; before it looks at any flag.
    pub fn register_poller(&self) {
        let _ = self.poller.set(thread::current());
    }

    /// Wakes the poller if it naps or parks.
    pub fn unpark_poller(&self) {
        if let Some(t) = self.poller.get() {
            t.unpark();
        }
    }

    /// Callers polling right now.
    pub fn callers_polling(&self) -> usize {
        self.callers_polling.load(Ordering::SeqCst)
    }

    /// How many times callers turned the queue themselves so far.
    pub fn self_polls(&self) -> u64 {
        self.self_polls.load(Ordering::SeqCst)
    }

    /// Makes sure the poller thread polls if no caller does: called when a
    /// caller waits for a response without polling itself.
    pub fn ensure_polled(&self) {
        // A waiter giving up on polling: the poller need not wait for the
        // others' polls to stop before it takes over again.
        self.take_over.store(true, Ordering::SeqCst);
        if self.poller_napping.load(Ordering::SeqCst) {
            self.unpark_poller();
        }
    }

    /// Turns the queue with `turn` until `done()` holds, `stopped()` holds,
    /// or `idle(progress)` says to give up (it is told after each turn
    /// whether that turn handled anything); returns `done()`.
    ///
    /// With `crowd`, every blocked caller polls: one at a time holds the
    /// state and turns the queue (completing the others' calls too), the
    /// others find it held, look at their own call and go round again, so a
    /// response that another caller's turn completes reaches its caller
    /// with no wake-up (see `idle` in `Endpoint::poll_until` for how they
    /// share cores). Without it, a caller that finds another polling
    /// returns at once, to sleep until that one completes its call.
    ///
    /// `others_waiting()` tells, once the last polling caller stops, whether
    /// anyone else still needs completions handled: then the poller is asked
    /// to take over, as it is when this call is not done.
    pub fn poll_until(
        &self,
        done: impl Fn() -> bool,
        stopped: impl Fn() -> bool,
        mut turn: impl FnMut(&mut S) -> usize,
        mut idle: impl FnMut(bool) -> bool,
        others_waiting: impl FnOnce() -> bool,
        crowd: bool,
    ) -> bool {
        let prior = self.callers_polling.fetch_add(1, Ordering::SeqCst);
        let counted = PollingCaller(&self.callers_polling);
        if prior > 0 && !crowd {
            // Another caller polls, and completes this call too. But it may
            // have stopped meanwhile, seeing this one still counted: then
            // this one is the last to leave, and hands over as it would
            // have.
            let finished = done();
            if counted.leave() && (!finished || others_waiting()) {
                self.ensure_polled();
            }
            return finished;
        }
        let finished = loop {
            if done() {
                break true;
            }
            if stopped() {
                break false;
            }
            let progress = self.try_lock().map_or(0, |mut st| turn(&mut st));
            if idle(progress > 0) {
                break done();
            }
        };
        // A caller that got its response is likely to make the next call
        // soon (a synchronous loop): the poller keeps napping meanwhile
        // instead of arming the queue and being woken by that call's
        // response, which its caller handles anyway.
        self.self_polls.fetch_add(1, Ordering::SeqCst);
        if counted.leave() && (!finished || others_waiting()) {
            self.ensure_polled();
        }
        finished
    }

    /// Turns the queue once with `turn` if nobody else holds it, for a
    /// caller's future that checks on its response; returns what `turn`
    /// returned (the completions it handled), or `None` if it did not turn.
    /// While futures do this, the poller naps instead of competing with them.
    ///
    /// `seen` is the count of callers' turns this future saw when it last
    /// looked (0 at first). If another caller turned the queue since, this
    /// one does not, and only notes the count: a thread that polls many
    /// waiting futures in a row (a task joining many calls, an executor
    /// running many tasks) then turns the queue once per round of them
    /// instead of once per future, and each turn finds more.
    pub fn try_turn(&self, seen: &mut u64, turn: impl FnOnce(&mut S) -> usize) -> Option<usize> {
        let polls = self.self_polls.load(Ordering::Relaxed);
        if polls != *seen {
            *seen = polls;
            return None;
        }
        let mut st = self.try_lock()?;
        *seen = self.self_polls.fetch_add(1, Ordering::Relaxed) + 1;
        Some(turn(&mut st))
    }

    /// The poller's look, each time around its loop: true if callers poll
    /// (or polled since `seen_polls`, the count at its last look) and it
    /// napped with `nap`, which parks (with a timeout, or until
    /// [`PollHandoff::ensure_polled`] unparks it); false if it is to turn
    /// the queue itself.
    pub fn poller_naps(&self, seen_polls: &mut u64, nap: impl FnOnce()) -> bool {
        if self.take_over.swap(false, Ordering::SeqCst) {
            // Take over now, whatever was polled before.
            *seen_polls = self.self_polls.load(Ordering::SeqCst);
            return false;
        }
        let mut self_polled = || {
            let polls = self.self_polls.load(Ordering::SeqCst);
            let grew = polls != *seen_polls;
            *seen_polls = polls;
            grew && !self.take_over.load(Ordering::SeqCst)
        };
        if self.callers_polling.load(Ordering::SeqCst) == 0 && !self_polled() {
            return false;
        }
        // Say so, then look once more: the last caller (or future) may have
        // stopped before it could see the flag.
        self.poller_napping.store(true, Ordering::SeqCst);
        let callers = self.callers_polling.load(Ordering::SeqCst) > 0;
        if callers || !self.take_over.load(Ordering::SeqCst) {
            nap();
        }
        self.poller_napping.store(false, Ordering::SeqCst);
        true
    }
}

/// Counts a caller in `callers_polling` while it lives, so that a panic in
/// a turn (a waker's, say) cannot leave the count up and the poller napping.
struct PollingCaller<'a>(&'a AtomicUsize);

impl PollingCaller<'_> {
    /// Stops counting; true if this was the last polling caller.
    fn leave(self) -> bool {
        let last = self.0.fetch_sub(1, Ordering::SeqCst) == 1;
        std::mem::forget(self);
        last
    }
}

impl Drop for PollingCaller<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
