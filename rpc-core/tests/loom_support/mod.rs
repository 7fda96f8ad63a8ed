//! What the loom models share: a client dispatcher's call state (the call
//! table and its slots, glued as `ClientRole` glues them), and a completion
//! queue with the contract of `fabric::CompletionQueue` (a test double: the
//! fabrics' own queues are checked by `fabric/conformance.rs`).
#![allow(dead_code)] // each model uses part of it

use loom::sync::{Condvar, Mutex};
use rpc_core::testing::protocol::{CallId, CallTable};
use rpc_core::testing::sync::{CallSlot, SlotPool};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::Arc;
use std::time::Instant;

/// What a call ends with in the models.
pub type Outcome = Result<u32, &'static str>;
/// A call's slot.
pub type Slot = Arc<CallSlot<Outcome>>;

/// A client dispatcher's call state: the table and the spare slots.
#[derive(Default)]
pub struct Calls {
    /// The calls in flight.
    pub table: Mutex<CallTable<Slot>>,
    /// Spare slots.
    pub pool: SlotPool<Outcome>,
}

impl Calls {
    /// Starts a call, as `Client::start`: a slot from the pool, entered in
    /// the table.
    pub fn start(&self, deadline: Option<Instant>) -> (CallId, Slot) {
        let slot = self.pool.take();
        assert!(slot.is_fresh(), "a slot is reused only once both let go");
        let id = self.table.lock().unwrap().insert(slot.clone(), deadline);
        (id, slot)
    }

    /// A response for `id`, as `ClientRole::on_frame`: completes the call
    /// if it is still in the table. True if it did.
    pub fn respond(&self, id: CallId, value: u32) -> bool {
        let call = self.table.lock().unwrap().complete(id);
        match call {
            Some(slot) => {
                self.pool.finish(slot, Ok(value));
                true
            }
            None => false,
        }
    }

    /// The dispatcher's timer, as `ClientRole::on_tick`: fails the calls
    /// due by `now`. How many it failed.
    pub fn expire(&self, now: Instant) -> usize {
        let mut n = 0;
        loop {
            let expired = self.table.lock().unwrap().pop_expired(now);
            let Some((_, slot)) = expired else {
                return n;
            };
            self.pool.finish(slot, Err("deadline exceeded"));
            n += 1;
        }
    }

    /// The connection is lost, as `ClientRole::on_lost`: fails every call
    /// still in the table. How many it failed.
    pub fn lose(&self) -> usize {
        let lost = self.table.lock().unwrap().remove_where(|_| true);
        let n = lost.len();
        for (_, slot) in lost {
            self.pool.finish(slot, Err("connection lost"));
        }
        n
    }

    /// The caller gives up, as `UnaryCall`'s drop: takes the call out of
    /// the table. True if it was still there.
    pub fn cancel(&self, id: CallId) -> bool {
        self.table.lock().unwrap().remove(id).is_some()
    }

    /// The caller takes the outcome, blocking (`UnaryCall::wait`), and lets
    /// go of the slot (`Channel::finish_call`).
    pub fn wait(&self, slot: Slot) -> Outcome {
        let outcome = slot.wait().expect("the outcome is taken once");
        self.pool.release(slot);
        outcome
    }

    /// The caller awaits the outcome (`UnaryCall`'s `poll`) and lets go.
    pub fn wait_async(&self, slot: Slot) -> Outcome {
        let outcome = loom::future::block_on(poll_fn(|cx| slot.poll(cx)));
        let outcome = outcome.expect("the outcome is taken once");
        self.pool.release(slot);
        outcome
    }

    pub fn stale(&self) -> u64 {
        self.table.lock().unwrap().stale()
    }
}

/// A completion queue holding responses `(call, value)`. A waiter arms,
/// polls once more, then waits: the wait ends when a completion arrives
/// after the arm, or on an interrupt (sticky: a wait after it returns at
/// once), as verbs and the soft fabrics promise; never on a timeout.
#[derive(Default)]
pub struct Cq {
    state: Mutex<CqState>,
    cond: Condvar,
}

#[derive(Default)]
struct CqState {
    entries: VecDeque<(CallId, u32)>,
    armed: bool,
    event: bool,
    interrupted: bool,
}

impl Cq {
    /// A response arrives (the NIC, or the tcp:// reader).
    pub fn post(&self, id: CallId, value: u32) {
        let mut st = self.state.lock().unwrap();
        st.entries.push_back((id, value));
        if st.armed {
            st.armed = false;
            st.event = true;
            self.cond.notify_all();
        }
    }

    /// Takes one completion.
    pub fn poll(&self) -> Option<(CallId, u32)> {
        self.state.lock().unwrap().entries.pop_front()
    }

    /// Asks for the next completion to end a wait.
    pub fn arm(&self) {
        self.state.lock().unwrap().armed = true;
    }

    /// Sleeps until a completion after the arm, or an interrupt.
    pub fn wait(&self) {
        let mut st = self.state.lock().unwrap();
        while !st.event && !st.interrupted {
            st = self.cond.wait(st).unwrap();
        }
        st.event = false;
        st.interrupted = false;
    }

    /// Ends a wait, or the next one.
    pub fn interrupt(&self) {
        self.state.lock().unwrap().interrupted = true;
        self.cond.notify_all();
    }
}
