//! Model checks of the places a stream's end hands to streams waiting
//! under a server's stream limit (`client/stream_limit.rs`), as a waiting
//! stream's opener uses them: look for a place handed over, else take a
//! free one or list itself and wait to be woken. Every interleaving, up to
//! `LOOM_MAX_PREEMPTIONS`: run by `scripts/loom`.
//!
//! Properties: a stream waiting for a place is handed it or finds it free
//! when another stream ends, whatever the order; a wake-up that takes its
//! wakers (a connection came up) meanwhile does not lose the place; and
//! every place comes back once its holders are gone.
#![cfg(all(loom, feature = "testing"))]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use rpc_core::testing::sync::{StreamLimit, StreamPermit, Waiting};
use std::sync::Arc;
use std::task::{Wake, Waker};

/// A waker that unparks the waiting stream's thread.
struct Unpark {
    woken: AtomicBool,
    thread: thread::Thread,
}

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // A swap, not a store: loom 0.7 may order a plain store before a
        // swap that ran earlier, and the waiter's next swap would then
        // miss it (see rpc-core/src/sync.rs).
        self.woken.swap(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A stream waiting for a place on `limits`, on this thread, as the opener
/// does (`Handle::handed_place`, then `open_or_wake` on each full
/// connection): returns the place it got. A place that no one hands over
/// and that never frees leaves it parked: loom reports the deadlock.
fn wait_for_place(waiting: &Arc<Waiting>, limits: &[&Arc<StreamLimit>]) -> StreamPermit {
    let unpark = Arc::new(Unpark {
        woken: AtomicBool::new(false),
        thread: thread::current(),
    });
    let waker = Waker::from(unpark.clone());
    loop {
        let mut handed = waiting.take_handed();
        if let Some(place) = handed.pop() {
            waiting.finish();
            return place;
        }
        for limit in limits {
            if let Some(place) = limit.open_or_wake(waiting, &waker) {
                waiting.finish();
                return place;
            }
        }
        while !unpark.woken.swap(false, Ordering::Acquire) {
            thread::park();
        }
    }
}

/// A stream's end on another thread races a stream listing itself: the
/// waiter is handed the place or finds it free, and the place comes back
/// once the waiter is done with it.
#[test]
fn an_end_racing_a_listing_loses_no_place() {
    loom::model(|| {
        let limit = StreamLimit::new(1);
        let held = limit.try_open().expect("a first place");
        let ender = thread::spawn(move || drop(held));
        let waiting = Arc::new(Waiting::default());
        let place = wait_for_place(&waiting, &[&limit]);
        assert!(place.is_on(&limit));
        ender.join().unwrap();
        drop(place);
        assert!(limit.try_open().is_some(), "the place came back");
    });
}

/// A stream listed on `a` is woken by a connection coming up (its wakers
/// taken) while `a`'s stream ends, and it goes on to wait on `b`, which
/// stays full: it still gets `a`'s place.
#[test]
fn a_wake_that_takes_the_wakers_loses_no_place() {
    loom::model(|| {
        let (a, b) = (StreamLimit::new(1), StreamLimit::new(1));
        let held_a = a.try_open().expect("a's place");
        let held_b = b.try_open().expect("b's place");
        let waiting = Arc::new(Waiting::default());
        assert!(a.open_or_wake(&waiting, Waker::noop()).is_none());
        // The stream waits on a thread of its own: a wake that comes after
        // it got its place unparks that thread, not one that joins.
        let stream = {
            let (waiting, b) = (waiting.clone(), b.clone());
            thread::spawn(move || wait_for_place(&waiting, &[&b]))
        };
        let ender = thread::spawn(move || drop(held_a));
        waiting.wake();
        ender.join().unwrap();
        let place = stream.join().unwrap();
        assert!(place.is_on(&a), "only a's place frees");
        drop((place, held_b));
        assert!(a.try_open().is_some() && b.try_open().is_some());
    });
}

/// Two streams wait on one full connection; its stream ends and the first
/// waiter gives up at the same time, by failing (`finish`, then dropped)
/// or by being dropped only (an opener dropped while it waits): the second
/// gets the place either way (handed on from the first, or handed to it
/// directly).
#[test]
fn a_place_handed_to_a_stream_that_gives_up_goes_on() {
    for finishes in [true, false] {
        loom::model(move || gives_up_while_a_place_frees(finishes));
    }
}

fn gives_up_while_a_place_frees(finishes: bool) {
    let limit = StreamLimit::new(1);
    let held = limit.try_open().expect("a first place");
    let first = Arc::new(Waiting::default());
    assert!(limit.open_or_wake(&first, Waker::noop()).is_none());
    let second = Arc::new(Waiting::default());
    let gives_up = thread::spawn(move || {
        if finishes {
            first.finish();
        }
        drop(first);
    });
    let ender = thread::spawn(move || drop(held));
    let place = wait_for_place(&second, &[&limit]);
    gives_up.join().unwrap();
    ender.join().unwrap();
    drop(place);
    assert!(limit.try_open().is_some(), "the place came back");
}
