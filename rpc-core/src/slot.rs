//! Call slots: where whoever handles a unary call's response (the
//! dispatcher, or a caller polling for its own) leaves the call's outcome
//! for its caller, a thread blocked in `wait` or a task that `.await`s.
//!
//! A slot has two users while its call runs: the completer, which got the
//! call out of the call table (by its response, its deadline, or a lost
//! connection: the table hands a call to one of them only), and the caller.
//! Each lets go once ([`SlotPool::release`]); the second to do so resets
//! the slot and keeps it for another call, and neither touches it after. A
//! caller that gives up (drops its call) takes the call out of the table
//! instead, so no completer ever sees the slot, and drops it.
//!
//! `scripts/loom` model-checks this: `rpc-core/tests/loom_calls.rs`.

use crate::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use crate::sync::{Condvar, Mutex};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// Call slots a pool keeps for reuse.
const MAX_SPARE_SLOTS: usize = 1024;

enum SlotState<T> {
    Waiting,
    /// A thread sleeps on the condition variable.
    Blocked,
    /// A task waits for this waker.
    Parked(Waker),
    Done(T),
    Taken,
}

/// Where a call's outcome `T` is left for its caller.
pub struct CallSlot<T> {
    state: Mutex<SlotState<T>>,
    cond: Condvar,
    /// Set once the outcome is in: lets a polling caller check cheaply.
    done: AtomicBool,
    /// How many of the call's two users (the completer, the caller) have let
    /// go of the slot (see [`SlotPool::release`]).
    releases: AtomicU8,
}

impl<T> fmt::Debug for CallSlot<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallSlot")
            .field("done", &self.is_done())
            .finish()
    }
}

impl<T> Default for CallSlot<T> {
    fn default() -> Self {
        CallSlot::new()
    }
}

impl<T> CallSlot<T> {
    /// An empty slot.
    pub fn new() -> CallSlot<T> {
        CallSlot {
            state: Mutex::new(SlotState::Waiting),
            cond: Condvar::new(),
            done: AtomicBool::new(false),
            releases: AtomicU8::new(0),
        }
    }

    /// Leaves the outcome and wakes the caller; false if the call already
    /// had one (which stays).
    pub fn complete(&self, outcome: T) -> bool {
        let prev = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *state, SlotState::Done(outcome)) {
                // Already completed (deadline raced a response): keep the first outcome.
                prev @ (SlotState::Done(_) | SlotState::Taken) => {
                    *state = prev;
                    return false;
                }
                prev => {
                    self.done.store(true, Ordering::Release);
                    prev
                }
            }
        };
        match prev {
            SlotState::Blocked => self.cond.notify_all(),
            SlotState::Parked(w) => w.wake(),
            _ => {}
        }
        true
    }

    /// Whether the outcome is in.
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Blocks until the outcome is in and takes it; `None` if it was taken
    /// already.
    pub fn wait(&self) -> Option<T> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match std::mem::replace(&mut *state, SlotState::Taken) {
                SlotState::Done(r) => return Some(r),
                SlotState::Taken => return None,
                _ => {
                    *state = SlotState::Blocked;
                    state = self.cond.wait(state).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// Takes the outcome if it is in; otherwise `cx`'s waker is woken when
    /// it comes. `Ready(None)` if it was taken already.
    pub fn poll(&self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *state, SlotState::Taken) {
            SlotState::Done(r) => Poll::Ready(Some(r)),
            SlotState::Taken => Poll::Ready(None),
            SlotState::Parked(w) if w.will_wake(cx.waker()) => {
                *state = SlotState::Parked(w);
                Poll::Pending
            }
            SlotState::Parked(_) | SlotState::Waiting | SlotState::Blocked => {
                *state = SlotState::Parked(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Whether the slot is as new: no outcome, no waiter, nobody let go.
    #[cfg(any(test, feature = "testing"))]
    pub fn is_fresh(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        matches!(*state, SlotState::Waiting)
            && !self.done.load(Ordering::Acquire)
            && self.releases.load(Ordering::Acquire) == 0
    }
}

/// The slots of finished calls, kept for new ones: no allocation per call.
pub struct SlotPool<T> {
    spare: Mutex<Vec<Arc<CallSlot<T>>>>,
}

impl<T> fmt::Debug for SlotPool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPool").finish_non_exhaustive()
    }
}

impl<T> Default for SlotPool<T> {
    fn default() -> Self {
        SlotPool::new()
    }
}

impl<T> SlotPool<T> {
    /// An empty pool.
    pub fn new() -> SlotPool<T> {
        SlotPool {
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A fresh slot for a new call: a spare one if there is one.
    pub fn take(&self) -> Arc<CallSlot<T>> {
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    /// Completes the call of `slot` with `outcome` and lets go of it: for
    /// the one completer that took the call out of the table.
    pub fn finish(&self, slot: Arc<CallSlot<T>>, outcome: T) {
        if slot.complete(outcome) {
            self.release(slot);
        }
    }

    /// Lets go of a finished call's slot: called once by the thread that
    /// completed it and once by the caller that took the outcome. The second
    /// to let go keeps the slot for another call; neither touches it after.
    pub fn release(&self, slot: Arc<CallSlot<T>>) {
        if slot.releases.fetch_add(1, Ordering::AcqRel) != 1 {
            return;
        }
        *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Waiting;
        slot.done.store(false, Ordering::Release);
        slot.releases.store(0, Ordering::Release);
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < MAX_SPARE_SLOTS {
            spare.push(slot);
        }
    }

    /// Slots kept for reuse.
    #[cfg(any(test, feature = "testing"))]
    pub fn spare(&self) -> usize {
        self.spare.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_kept_once_both_users_let_go() {
        let pool = SlotPool::<u32>::new();
        let slot = pool.take();
        assert!(slot.is_fresh());
        pool.finish(slot.clone(), 7);
        assert!(slot.is_done());
        assert_eq!(pool.spare(), 0, "the caller still holds it");
        assert!(!slot.complete(8), "the first outcome stays");
        assert_eq!(slot.wait(), Some(7));
        assert_eq!(slot.wait(), None, "taken once");
        pool.release(slot);
        assert_eq!(pool.spare(), 1);
        let again = pool.take();
        assert!(again.is_fresh());
        assert_eq!(pool.spare(), 0);
    }

    #[test]
    fn a_blocked_caller_is_woken() {
        let slot = Arc::new(CallSlot::<u32>::new());
        let s = slot.clone();
        let waiter = std::thread::spawn(move || s.wait());
        while !matches!(*slot.state.lock().unwrap(), SlotState::Blocked) {
            std::thread::yield_now();
        }
        assert!(slot.complete(3));
        assert_eq!(waiter.join().unwrap(), Some(3));
    }
}
