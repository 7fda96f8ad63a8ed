//! The streams a connection may have open at once, as its server said when
//! it connected (`ServerBuilder::max_concurrent_streams`): a stream opened
//! beyond them waits until one of the connection's streams ends, as an
//! HTTP/2 client waits for `SETTINGS_MAX_CONCURRENT_STREAMS`.

use crate::sync::atomic::{AtomicU32, Ordering};
use crate::sync::{Mutex, MutexGuard};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::task::Waker;

/// Waiters kept before those that gave up are swept out.
const SWEEP_AT: usize = 64;

/// One connection's stream limit and the streams open on it.
#[derive(Debug)]
pub struct StreamLimit {
    /// Streams at most; 0 for no limit.
    max: u32,
    /// Places taken: by open streams, and by places handed to a waiting
    /// stream that has not taken them up yet.
    open: AtomicU32,
    waiters: Mutex<Waiters>,
}

/// Streams waiting for something, in the order they came, held weakly:
/// one that gave up is never woken, and is swept out as the list grows.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    list: VecDeque<Weak<Waiting>>,
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
        self.list.push_back(Arc::downgrade(waiting));
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

    /// The longest-waiting waiter still there, taken off the list.
    fn pop_live(&mut self) -> Option<Arc<Waiting>> {
        std::iter::from_fn(|| self.list.pop_front()).find_map(|w| w.upgrade())
    }
}

/// A stream waiting for room: what to wake (each task that polls it: a
/// stream's `Streaming` and its `RequestSender` may wait in two), and the
/// places handed to it. Its opener holds it, the limits only a weak
/// reference, so one that gave up costs nothing and is never woken.
#[derive(Debug, Default)]
pub struct Waiting(Mutex<WaitingState>);

#[derive(Debug, Default)]
struct WaitingState {
    wakers: Vec<Waker>,
    /// The limits whose lists it is in (their addresses), each until that
    /// limit hands it a place.
    listed_on: Vec<usize>,
    /// Places handed to it by streams that ended, until it takes one up;
    /// any it does not take go on to the next stream waiting there when
    /// dropped.
    handed: Vec<StreamPermit>,
    /// It started, or gave up: it takes no more places.
    done: bool,
}

impl Waiting {
    /// Wakes every task waiting on this stream, which stays listed where
    /// it is (a connection came up: it may have room).
    pub fn wake(&self) {
        let wakers = std::mem::take(&mut lock(&self.0).wakers);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// The places handed to this stream since it last looked.
    pub fn take_handed(&self) -> Vec<StreamPermit> {
        std::mem::take(&mut lock(&self.0).handed)
    }

    /// The stream started or gave up: it takes no more places, and those
    /// handed to it meanwhile go on to the next streams waiting.
    pub fn finish(&self) {
        let handed = {
            let mut st = lock(&self.0);
            st.done = true;
            std::mem::take(&mut st.handed)
        };
        drop(handed);
    }
}

impl StreamLimit {
    /// A connection whose server serves `max` streams at once (0: any).
    pub fn new(max: u32) -> Arc<StreamLimit> {
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
    pub fn try_open(self: &Arc<Self>) -> Option<StreamPermit> {
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
    /// (through `waiting`) once a stream of the connection ends and hands
    /// its place to `waiting` ([`Waiting::take_handed`]).
    pub fn open_or_wake(
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
            // A place handed over while it had no waker (its wakers were
            // taken by a wake, and it had not looked again since): it
            // looks again at once. One handed over from now on wakes it.
            if !st.handed.is_empty() {
                waker.wake_by_ref();
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
        // A stream that ended before this one was listed gave its place
        // back rather than hand it on (see `close_one`).
        self.try_open()
    }

    /// This limit's address, which names it in [`WaitingState::listed_on`].
    fn address(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// A stream's place is free: it goes to the stream that has waited
    /// longest here, which alone is woken; with none waiting, it is given
    /// back. Deciding under the list's lock makes a stream being listed
    /// meanwhile either be handed the place or find it free.
    fn close_one(self: &Arc<Self>) {
        let here = self.address();
        // What leaves the lock: the waiter handed the place and its wakers,
        // and any that finished meanwhile (dropped outside the lock: the
        // last reference to a waiter drops the places it holds).
        let mut passed_over = Vec::new();
        let handed_to = {
            let mut waiters = lock(&self.waiters);
            loop {
                let Some(waiting) = waiters.pop_live() else {
                    self.open.fetch_sub(1, Ordering::AcqRel);
                    break None;
                };
                let wakers = {
                    let mut st = lock(&waiting.0);
                    st.listed_on.retain(|&l| l != here);
                    (!st.done).then(|| {
                        st.handed.push(StreamPermit(Some(self.clone())));
                        std::mem::take(&mut st.wakers)
                    })
                };
                match wakers {
                    Some(wakers) => break Some((waiting, wakers)),
                    None => passed_over.push(waiting),
                }
            }
        };
        drop(passed_over);
        if let Some((waiting, wakers)) = handed_to {
            wakers.into_iter().for_each(Waker::wake);
            drop(waiting);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One open stream's place on its connection, given back when dropped: when
/// the stream's call leaves the client's table, after its end arrived or
/// after its cancel was sent (the server counts it until then). A place
/// handed to a waiting stream that does not take it up goes on the same
/// way.
#[derive(Debug)]
pub struct StreamPermit(Option<Arc<StreamLimit>>);

impl StreamPermit {
    /// Whether this is a place on `limit`.
    pub fn is_on(&self, limit: &Arc<StreamLimit>) -> bool {
        self.0.as_ref().is_some_and(|l| Arc::ptr_eq(l, limit))
    }
}

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
        let mut handed = waiting.take_handed();
        assert_eq!(handed.len(), 1, "and hands it the place");
        assert!(handed[0].is_on(&limit));
        assert!(limit.try_open().is_none(), "which no one else takes");
        let _c = handed.pop();
        waiting.finish();
        assert!(limit.try_open().is_none(), "and the limit holds");
    }

    #[test]
    fn an_end_wakes_only_the_stream_that_waited_longest() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let waiters: Vec<_> = (0..100)
            .map(|_| {
                let (woken, waker) = counter();
                let waiting = Arc::new(Waiting::default());
                assert!(limit.open_or_wake(&waiting, &waker).is_none());
                (woken, waiting)
            })
            .collect();
        drop(held);
        let woken: Vec<_> = waiters
            .iter()
            .map(|(w, _)| w.0.load(Ordering::SeqCst))
            .collect();
        assert_eq!(woken[0], 1, "the first waiter");
        assert_eq!(woken[1..].iter().sum::<usize>(), 0, "and no other");
        // Each end passes the place on, in order.
        for (i, (_, waiting)) in waiters.iter().enumerate() {
            let handed = waiting.take_handed();
            assert_eq!(handed.len(), 1, "waiter {i}");
            waiting.finish();
            drop(handed);
            if let Some((next, _)) = waiters.get(i + 1) {
                assert_eq!(next.0.load(Ordering::SeqCst), 1, "waiter {}", i + 1);
            }
        }
        assert!(limit.try_open().is_some(), "the last end gives it back");
    }

    #[test]
    fn a_place_is_not_handed_to_a_stream_that_no_longer_waits() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let started = Arc::new(Waiting::default());
        let next = Arc::new(Waiting::default());
        let (woken, waker) = counter();
        assert!(limit.open_or_wake(&started, &waker).is_none());
        assert!(limit.open_or_wake(&next, &waker).is_none());
        // The first started on another connection before this end.
        started.finish();
        drop(held);
        assert!(started.take_handed().is_empty(), "passed over");
        assert_eq!(next.take_handed().len(), 1, "the next is handed it");
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "and alone woken");
    }

    #[test]
    fn places_handed_to_a_stream_that_started_elsewhere_go_on() {
        let (a, b) = (StreamLimit::new(1), StreamLimit::new(1));
        let (held_a, held_b) = (a.try_open().unwrap(), b.try_open().unwrap());
        let both = Arc::new(Waiting::default());
        let (behind_a, behind_b) = (Arc::new(Waiting::default()), Arc::new(Waiting::default()));
        let (_, waker) = counter();
        assert!(a.open_or_wake(&both, &waker).is_none());
        assert!(b.open_or_wake(&both, &waker).is_none());
        assert!(a.open_or_wake(&behind_a, &waker).is_none());
        assert!(b.open_or_wake(&behind_b, &waker).is_none());
        // Both end before the stream waiting on both looks: it takes one
        // place, and the other goes on when it finishes.
        drop((held_a, held_b));
        let mut handed = both.take_handed();
        assert_eq!(handed.len(), 2);
        let taken = handed.remove(0);
        assert!(taken.is_on(&a));
        drop(handed);
        both.finish();
        assert!(behind_a.take_handed().is_empty());
        assert_eq!(behind_b.take_handed().len(), 1, "b's place went on");
        drop(taken);
        assert_eq!(behind_a.take_handed().len(), 1, "and a's when it ended");
    }

    #[test]
    fn a_stream_listed_while_a_place_frees_gets_it_or_finds_it() {
        // Many rounds of one stream's end racing another's listing: the
        // waiter is either handed the place or opens it itself, never
        // neither (a lost wake-up would leave it waiting with room free).
        for _ in 0..2_000 {
            let limit = StreamLimit::new(1);
            let held = limit.try_open().unwrap();
            let waiting = Arc::new(Waiting::default());
            let (_, waker) = counter();
            let ender = std::thread::spawn(move || drop(held));
            let opened = limit.open_or_wake(&waiting, &waker);
            ender.join().unwrap();
            let handed = waiting.take_handed();
            assert!(
                opened.is_some() || handed.len() == 1,
                "neither handed the place nor found it free"
            );
            drop((opened, handed));
            waiting.finish();
            assert!(limit.try_open().is_some(), "every place came back");
        }
    }

    #[test]
    fn a_place_handed_over_while_no_waker_is_in_place_is_not_lost() {
        let (a, b) = (StreamLimit::new(1), StreamLimit::new(1));
        let (held_a, held_b) = (a.try_open().unwrap(), b.try_open().unwrap());
        let waiting = Arc::new(Waiting::default());
        let (woken, waker) = counter();
        assert!(a.open_or_wake(&waiting, &waker).is_none());
        // A connection came up: its wakers are taken, it stays listed.
        waiting.wake();
        assert_eq!(woken.0.load(Ordering::SeqCst), 1);
        // It looks for a place handed to it (none), then a's place is
        // handed over before its waker is back in place...
        assert!(waiting.take_handed().is_empty());
        drop(held_a);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "no waker to wake");
        // ...and, finding b full, it waits there: it is woken at once to
        // take up the place it holds.
        assert!(b.open_or_wake(&waiting, &waker).is_none());
        assert_eq!(woken.0.load(Ordering::SeqCst), 2, "woken to take it");
        let handed = waiting.take_handed();
        assert_eq!(handed.len(), 1);
        assert!(handed[0].is_on(&a));
        drop(held_b);
    }

    #[test]
    fn a_dropped_stream_passes_on_the_place_it_was_handed() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let gone = Arc::new(Waiting::default());
        let next = Arc::new(Waiting::default());
        let (woken, waker) = counter();
        assert!(limit.open_or_wake(&gone, &waker).is_none());
        assert!(limit.open_or_wake(&next, &waker).is_none());
        drop(held);
        assert!(next.take_handed().is_empty(), "the first in line has it");
        drop(gone);
        assert_eq!(next.take_handed().len(), 1, "then the next");
        assert_eq!(woken.0.load(Ordering::SeqCst), 2);
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
