//! Model checks of who turns a dispatcher's completion queue
//! (`dispatch/handoff.rs`): callers blocked on their responses poll it
//! themselves (`PollHandoff::poll_until`, as `UnaryCall::wait` does), one at
//! a time, while the poller thread naps; a caller that stops polling hands
//! over to the poller. The poller's loop below is `Endpoint::run`'s with
//! the clock taken out (no spinning, naps that only an unpark ends); turns
//! complete calls through the call table and slots as the client does.
//! Every interleaving, up to `LOOM_MAX_PREEMPTIONS`: run by `scripts/loom`.
//!
//! An `.await`ed call does as `UnaryCall`'s `poll` does: turns the queue
//! once per poll if nobody else does (`PollHandoff::try_turn`), asks to be
//! polled again while within its spin budget (here: one poll), and then
//! asks the poller to take over (`PollHandoff::ensure_polled`).
//!
//! Properties: every call gets its response (no caller waits forever: when
//! the last polling caller stops while others wait, the poller, woken if it
//! naps, polls), and exactly once.
#![cfg(all(loom, feature = "testing"))]

mod loom_support;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Condvar, Mutex};
use loom::thread::{self, JoinHandle};
use loom_support::{Calls, Cq, Outcome, Slot};
use rpc_core::testing::sync::PollHandoff;
use std::future::poll_fn;
use std::sync::Arc;

/// One dispatcher: its queue, its calls, and who polls.
#[derive(Default)]
struct Ep {
    poll: PollHandoff<()>,
    cq: Cq,
    calls: Calls,
    stop: AtomicBool,
    /// Set once the poller runs.
    started: (Mutex<bool>, Condvar),
}

impl Ep {
    /// One turn: handles at most one completion (a batch of one, so that a
    /// turn can end with responses still queued).
    fn turn(&self) -> usize {
        match self.cq.poll() {
            Some((id, value)) => {
                self.calls.respond(id, value);
                1
            }
            None => 0,
        }
    }

    /// `Endpoint::run`: nap while callers poll, else turn the queue; arm,
    /// look once more and sleep when it is empty.
    fn run(&self) {
        self.poll.register_poller();
        *self.started.0.lock().unwrap() = true;
        self.started.1.notify_all();
        let mut seen_polls = self.poll.self_polls();
        while !self.stop.load(Ordering::Acquire) {
            if self.poll.poller_naps(&mut seen_polls, thread::park) {
                continue;
            }
            let Some(st) = self.poll.try_lock() else {
                thread::yield_now();
                continue;
            };
            let found = self.turn();
            drop(st);
            if found > 0 {
                continue;
            }
            let Some(st) = self.poll.try_lock() else {
                continue;
            };
            self.cq.arm();
            let found = self.turn();
            drop(st);
            if found == 0 && self.poll.callers_polling() == 0 {
                self.cq.wait();
            }
        }
    }

    /// Starts the poller thread and waits until it runs: dispatchers start
    /// with their runtime, long before any call or stop.
    fn start(self: &Arc<Self>) -> JoinHandle<()> {
        let e = self.clone();
        let poller = thread::spawn(move || e.run());
        let mut started = self.started.0.lock().unwrap();
        while !*started {
            started = self.started.1.wait(started).unwrap();
        }
        poller
    }

    /// `Endpoint::stop`.
    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.cq.interrupt();
        self.poll.unpark_poller();
    }

    /// `UnaryCall::wait`: polls for the response until a turn finds
    /// nothing (the spin time, in a model without a clock), then sleeps on
    /// the slot; with `crowd`, alongside other polling callers, else only
    /// if none polls.
    fn wait(&self, slot: Slot, crowd: bool) -> Outcome {
        self.poll.poll_until(
            || slot.is_done(),
            || self.stop.load(Ordering::Acquire),
            |_| self.turn(),
            |progress| !progress,
            || !self.calls.table.lock().unwrap().is_empty(),
            crowd,
        );
        self.calls.wait(slot)
    }
}

impl Ep {
    /// `UnaryCall`'s `poll`, `.await`ed: checks the slot, turns the queue
    /// once if nobody else does (nor did since its last look), and asks to
    /// be polled again at once on its first two misses (the first look may
    /// find another caller's turn and skip its own), then for the poller to
    /// take over.
    fn wait_async(&self, slot: Slot) -> Outcome {
        let mut misses = 0;
        let mut seen = 0;
        let outcome = loom::future::block_on(poll_fn(|cx| {
            let mut outcome = slot.poll(cx);
            if outcome.is_pending()
                && self.poll.try_turn(&mut seen, |_| self.turn()).is_some()
                && slot.is_done()
            {
                outcome = slot.poll(cx);
            }
            if outcome.is_pending() {
                misses += 1;
                if misses <= 2 {
                    cx.waker().wake_by_ref();
                } else {
                    self.poll.ensure_polled();
                }
            }
            outcome
        }));
        let outcome = outcome.expect("the outcome is taken once");
        self.calls.pool.release(slot);
        outcome
    }
}

/// Two callers wait for their calls with the poller running, polling side
/// by side if `crowd`; `early` responses are in the queue before anyone
/// looks, the others arrive meanwhile.
fn two_callers(early: &'static [bool; 2], crowd: bool) {
    loom::model(move || {
        let ep = Arc::new(Ep::default());
        let (a, slot_a) = ep.calls.start(None);
        let (b, slot_b) = ep.calls.start(None);
        let responses = [(a, 1), (b, 2)];
        for (&(id, value), _) in responses.iter().zip(early).filter(|(_, e)| **e) {
            ep.cq.post(id, value);
        }
        let poller = ep.start();
        let e = ep.clone();
        let caller_a = thread::spawn(move || e.wait(slot_a, crowd));
        let e = ep.clone();
        let caller_b = thread::spawn(move || e.wait(slot_b, crowd));
        for (&(id, value), _) in responses.iter().zip(early).filter(|(_, e)| !**e) {
            ep.cq.post(id, value);
        }
        assert_eq!(caller_a.join().unwrap(), Ok(1));
        assert_eq!(caller_b.join().unwrap(), Ok(2));
        ep.stop();
        poller.join().unwrap();
        assert!(ep.calls.table.lock().unwrap().is_empty());
        assert_eq!(ep.calls.stale(), 0, "each response delivered once");
    });
}

/// One caller's response is there at once, the other's comes later: the
/// first caller finishes polling while the second still waits.
#[test]
fn last_polling_caller_hands_over_to_the_poller() {
    two_callers(&[true, false], false);
}

/// The same with both callers polling.
#[test]
fn last_of_a_crowd_of_callers_hands_over_to_the_poller() {
    two_callers(&[true, false], true);
}

/// Both responses come while the callers poll or sleep.
#[test]
fn callers_that_give_up_polling_hand_over() {
    two_callers(&[false, false], false);
}

/// The same with both callers polling.
#[test]
fn a_crowd_of_callers_that_give_up_polling_hands_over() {
    two_callers(&[false, false], true);
}

/// A blocked caller and an awaiting one, the awaiting one's response
/// coming late: its future polls, then hands over to the poller.
#[test]
fn awaiting_caller_hands_over_to_the_poller() {
    loom::model(|| {
        let ep = Arc::new(Ep::default());
        let (a, slot_a) = ep.calls.start(None);
        let (b, slot_b) = ep.calls.start(None);
        ep.cq.post(a, 1);
        let poller = ep.start();
        let e = ep.clone();
        let caller_a = thread::spawn(move || e.wait(slot_a, true));
        let e = ep.clone();
        let caller_b = thread::spawn(move || e.wait_async(slot_b));
        ep.cq.post(b, 2);
        assert_eq!(caller_a.join().unwrap(), Ok(1));
        assert_eq!(caller_b.join().unwrap(), Ok(2));
        ep.stop();
        poller.join().unwrap();
        assert_eq!(ep.calls.stale(), 0, "each response delivered once");
    });
}
