//! The streams a connection may have open at once, as its server said when
//! it connected (`ServerBuilder::max_concurrent_streams`): a stream opened
//! beyond them waits until one of the connection's streams ends, as an
//! HTTP/2 client waits for `SETTINGS_MAX_CONCURRENT_STREAMS`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Waker;

/// Waiters kept before those that gave up are swept out.
const SWEEP_AT: usize = 64;

/// One connection's stream limit and the streams open on it.
#[derive(Debug)]
pub(super) struct StreamLimit {
    /// Streams at most; 0 for no limit.
    max: u32,
    open: AtomicU32,
    waiters: Mutex<Waiters>,
}

/// Streams waiting for something, held weakly: one that gave up is never
/// woken, and is swept out as the list grows.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    list: Vec<Weak<Waiting>>,
    /// Length at which the list is next swept of waiters that gave up.
    sweep_at: usize,
}

impl Waiters {
    /// Lists `waiting`, first sweeping out those that gave up if the list
    /// has grown enough.
    pub(super) fn push(&mut self, waiting: &Arc<Waiting>) {
        if self.list.len() >= self.sweep_at.max(SWEEP_AT) {
            self.list.retain(|w| w.strong_count() > 0);
            self.sweep_at = self.list.len() * 2;
        }
        self.list.push(Arc::downgrade(waiting));
    }

    /// The waiters still there, which stay listed (those that gave up go).
    pub(super) fn live(&mut self) -> Vec<Arc<Waiting>> {
        let mut live = Vec::new();
        self.list.retain(|w| match w.upgrade() {
            Some(waiting) => {
                live.push(waiting);
                true
            }
            None => false,
        });
        live
    }

    /// The waiters still there, taken off the list.
    fn take(&mut self) -> Vec<Arc<Waiting>> {
        std::mem::take(&mut self.list)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// A stream waiting for room: what to wake (each task that polls it: a
/// stream's `Streaming` and its `RequestSender` may wait in two). Its
/// opener holds it, the limits only a weak reference, so one that gave up
/// costs nothing and is never woken.
#[derive(Debug, Default)]
pub(super) struct Waiting(Mutex<WaitingState>);

#[derive(Debug, Default)]
struct WaitingState {
    wakers: Vec<Waker>,
    /// The limits whose lists it is in (their addresses), each until a
    /// stream's end there takes its list.
    listed_on: Vec<usize>,
}

impl Waiting {
    /// Wakes every task waiting on this stream, which stays listed where
    /// it is (a connection came up: it may have room).
    pub(super) fn wake(&self) {
        let wakers = std::mem::take(&mut lock(&self.0).wakers);
        wakers.into_iter().for_each(Waker::wake);
    }
}

impl StreamLimit {
    /// A connection whose server serves `max` streams at once (0: any).
    pub(super) fn new(max: u32) -> Arc<StreamLimit> {
        Arc::new(StreamLimit {
            max,
            open: AtomicU32::new(0),
            waiters: Mutex::new(Waiters::default()),
        })
    }

    /// The limit; 0 for none.
    pub(super) fn max(&self) -> u32 {
        self.max
    }

    /// Whether a stream may open now.
    pub(super) fn has_room(&self) -> bool {
        self.max == 0 || self.open.load(Ordering::Acquire) < self.max
    }

    /// A place for one more stream, if the connection has one free.
    pub(super) fn try_open(self: &Arc<Self>) -> Option<StreamPermit> {
        if self.max == 0 {
            return Some(StreamPermit(None));
        }
        let mut open = self.open.load(Ordering::Acquire);
        loop {
            if open >= self.max {
                return None;
            }
            match self.open.compare_exchange_weak(
                open,
                open + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(StreamPermit(Some(self.clone()))),
                Err(now) => open = now,
            }
        }
    }

    /// A place for one more stream, or, if none is free, `waker` woken
    /// (through `waiting`) once a stream of the connection ends.
    pub(super) fn open_or_wake(
        self: &Arc<Self>,
        waiting: &Arc<Waiting>,
        waker: &Waker,
    ) -> Option<StreamPermit> {
        if let Some(permit) = self.try_open() {
            return Some(permit);
        }
        let here = self.address();
        let list = {
            let mut st = lock(&waiting.0);
            if !st.wakers.iter().any(|w| w.will_wake(waker)) {
                st.wakers.push(waker.clone());
            }
            let list = !st.listed_on.contains(&here);
            if list {
                st.listed_on.push(here);
            }
            list
        };
        if list {
            lock(&self.waiters).push(waiting);
        }
        // A stream that ended before the waker was in place.
        self.try_open()
    }

    /// This limit's address, which names it in [`Waiting::listed_on`].
    fn address(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    fn close_one(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        let here = self.address();
        let list = lock(&self.waiters).take();
        for waiting in list {
            let wakers = {
                let mut st = lock(&waiting.0);
                st.listed_on.retain(|&l| l != here);
                std::mem::take(&mut st.wakers)
            };
            wakers.into_iter().for_each(Waker::wake);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One open stream's place on its connection, given back when dropped: when
/// the stream's call leaves the client's table, after its end arrived or
/// after its cancel was sent (the server counts it until then).
#[derive(Debug)]
pub(super) struct StreamPermit(Option<Arc<StreamLimit>>);

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if let Some(limit) = self.0.take() {
            limit.close_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }

    #[test]
    fn a_stream_beyond_the_limit_waits_for_one_to_end() {
        let limit = StreamLimit::new(2);
        let a = limit.try_open().expect("first");
        let _b = limit.try_open().expect("second");
        assert!(!limit.has_room());
        let (woken, waker) = counter();
        let waiting = Arc::new(Waiting::default());
        assert!(
            limit.open_or_wake(&waiting, &waker).is_none(),
            "a third waits"
        );
        assert!(
            limit.open_or_wake(&waiting, &waker).is_none(),
            "polled again"
        );
        assert_eq!(woken.0.load(Ordering::SeqCst), 0);
        drop(a);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "an end wakes it, once");
        let _c = limit.open_or_wake(&waiting, &waker).expect("then it opens");
        assert!(limit.try_open().is_none(), "and the limit holds again");
    }

    #[test]
    fn no_limit_counts_nothing() {
        let limit = StreamLimit::new(0);
        let permits: Vec<_> = (0..10_000).map(|_| limit.try_open().unwrap()).collect();
        assert_eq!(limit.open.load(Ordering::SeqCst), 0);
        drop(permits);
    }

    #[test]
    fn waiters_that_gave_up_are_neither_kept_nor_woken() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let (gone, gone_waker) = counter();
        for _ in 0..10_000 {
            let waiting = Arc::new(Waiting::default());
            assert!(limit.open_or_wake(&waiting, &gone_waker).is_none());
        }
        assert!(lock(&limit.waiters).list.len() <= 2 * SWEEP_AT);
        let (woken, waker) = counter();
        let waiting = Arc::new(Waiting::default());
        assert!(limit.open_or_wake(&waiting, &waker).is_none());
        drop(held);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(gone.0.load(Ordering::SeqCst), 0, "no wake for those gone");
    }

    #[test]
    fn every_task_waiting_on_one_stream_is_woken() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let waiting = Arc::new(Waiting::default());
        let (sender, sender_waker) = counter();
        let (reader, reader_waker) = counter();
        assert!(limit.open_or_wake(&waiting, &sender_waker).is_none());
        assert!(limit.open_or_wake(&waiting, &reader_waker).is_none());
        drop(held);
        assert_eq!(sender.0.load(Ordering::SeqCst), 1, "the sender's task");
        assert_eq!(reader.0.load(Ordering::SeqCst), 1, "the reader's task");
    }

    #[test]
    fn a_stream_that_moves_to_another_full_connection_waits_there() {
        let (a, b) = (StreamLimit::new(1), StreamLimit::new(1));
        let (held_a, held_b) = (a.try_open().unwrap(), b.try_open().unwrap());
        let waiting = Arc::new(Waiting::default());
        let (woken, waker) = counter();
        assert!(a.open_or_wake(&waiting, &waker).is_none());
        assert!(b.open_or_wake(&waiting, &waker).is_none());
        // Found full by turns, it is listed once on each.
        for _ in 0..100 {
            assert!(a.open_or_wake(&waiting, &waker).is_none());
            assert!(b.open_or_wake(&waiting, &waker).is_none());
        }
        assert_eq!(lock(&a.waiters).list.len(), 1);
        assert_eq!(lock(&b.waiters).list.len(), 1);
        drop(held_b);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "b's end wakes it");
        drop(held_a);
    }
}
