//! A call's cancellation: [`Signal`], set when a call is cancelled or its
//! connection lost, and watched by the call's handler
//! ([`Request::cancelled`](crate::Request::cancelled)), the server's call
//! table and a stream's shared state.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Whether a call was cancelled, and who waits to hear it: what a server
/// handler sees through [`Request::cancelled`].
#[derive(Debug, Default)]
pub(crate) struct Signal {
    cancelled: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
    /// Live [`Request::cancelled`] futures: while the handler holds one, it
    /// watches for the cancel itself, and a cancel does not drop it.
    watchers: AtomicUsize,
    /// The handler learnt of the cancel ([`Request::cancelled`] completed,
    /// or [`Request::is_cancelled`] said so): it ends its call as it sees
    /// fit, and is not dropped.
    told: AtomicBool,
}

impl Signal {
    /// Marks the call cancelled and wakes whoever waits for that.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        for w in wakers {
            w.wake();
        }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// A [`Request::cancelled`] future was made (see `watchers`).
    pub(crate) fn watch(&self) {
        self.watchers.fetch_add(1, Ordering::AcqRel);
    }

    /// That future was dropped.
    pub(crate) fn unwatch(&self) {
        self.watchers.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether the call is cancelled, as the handler learns it (see `told`).
    pub(crate) fn tell(&self) -> bool {
        let cancelled = self.is_cancelled();
        if cancelled && !self.told.load(Ordering::Relaxed) {
            self.told.store(true, Ordering::Release);
        }
        cancelled
    }

    /// Whether the handler watches for cancellation itself, or has learnt
    /// of it: then it, not the server, ends its call.
    pub(crate) fn is_watched(&self) -> bool {
        self.told.load(Ordering::Acquire) || self.watchers.load(Ordering::Acquire) > 0
    }

    /// Whether the call is cancelled and its handler, not watching for
    /// that itself, is to be dropped.
    pub(crate) fn drops_handler(&self) -> bool {
        self.is_cancelled() && !self.is_watched()
    }

    /// [`Signal::drops_handler`]; until then, for a handler not watching
    /// for the cancel itself, wakes the task with `cx` when it comes.
    pub(crate) fn poll_drops_handler(&self, cx: &mut Context<'_>) -> bool {
        !self.is_watched() && self.poll_cancelled(cx).is_ready()
    }

    /// Makes a signal nobody else holds new again, for reuse.
    pub(crate) fn reset(&mut self) {
        *self.cancelled.get_mut() = false;
        *self.watchers.get_mut() = 0;
        *self.told.get_mut() = false;
        self.wakers
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    pub(crate) fn poll_cancelled(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_cancelled() {
            return Poll::Ready(());
        }
        let mut wakers = lock(&self.wakers);
        // Checked again under the lock: `cancel` takes the wakers under it.
        if self.is_cancelled() {
            return Poll::Ready(());
        }
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
