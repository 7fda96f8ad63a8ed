//! The streams a connection may have open at once, as its server said when
//! it connected (`ServerBuilder::max_concurrent_streams`): a stream opened
//! beyond them waits until one of the connection's streams ends, as an
//! HTTP/2 client waits for `SETTINGS_MAX_CONCURRENT_STREAMS`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;

/// Wakers kept at most before they are all woken (they register again if
/// they still wait): one for each opener that gave up waiting would
/// otherwise stay until a stream ends.
const MAX_WAITERS: usize = 1024;

/// One connection's stream limit and the streams open on it.
#[derive(Debug)]
pub(super) struct StreamLimit {
    /// Streams at most; 0 for no limit.
    max: u32,
    open: AtomicU32,
    waiters: Mutex<Vec<Waker>>,
}

impl StreamLimit {
    /// A connection whose server serves `max` streams at once (0: any).
    pub(super) fn new(max: u32) -> Arc<StreamLimit> {
        Arc::new(StreamLimit {
            max,
            open: AtomicU32::new(0),
            waiters: Mutex::new(Vec::new()),
        })
    }

    /// The limit; 0 for none.
    pub(super) fn max(&self) -> u32 {
        self.max
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
    /// once one is (and `None`).
    pub(super) fn open_or_wake(self: &Arc<Self>, waker: &Waker) -> Option<StreamPermit> {
        if let Some(permit) = self.try_open() {
            return Some(permit);
        }
        let stale = {
            let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            let stale = if waiters.len() >= MAX_WAITERS {
                std::mem::take(&mut *waiters)
            } else {
                Vec::new()
            };
            if !waiters.iter().any(|w| w.will_wake(waker)) {
                waiters.push(waker.clone());
            }
            stale
        };
        stale.into_iter().for_each(Waker::wake);
        // A stream that ended before the waker was in place.
        self.try_open()
    }

    fn close_one(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|e| e.into_inner()));
        waiters.into_iter().for_each(Waker::wake);
    }
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

    #[test]
    fn a_stream_beyond_the_limit_waits_for_one_to_end() {
        let limit = StreamLimit::new(2);
        let a = limit.try_open().expect("first");
        let _b = limit.try_open().expect("second");
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        assert!(limit.open_or_wake(&waker).is_none(), "a third waits");
        assert_eq!(woken.0.load(Ordering::SeqCst), 0);
        drop(a);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "an end wakes it");
        let _c = limit.open_or_wake(&waker).expect("then it opens");
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
    fn waiters_that_gave_up_are_bounded() {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().unwrap();
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        for _ in 0..MAX_WAITERS * 3 {
            // A new task each time (a waker that will not wake the others).
            let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
            assert!(limit.open_or_wake(&waker).is_none());
        }
        assert!(limit.waiters.lock().unwrap().len() <= MAX_WAITERS);
        let waker = Waker::from(woken.clone());
        assert!(limit.open_or_wake(&waker).is_none());
        drop(held);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1);
    }
}
