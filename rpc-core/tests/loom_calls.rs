//! Model checks of a unary call's slot (`rpc-core/src/slot.rs`) with the
//! call table (`protocol/calls.rs`), as the client uses them: the
//! dispatcher completes a call it took out of the table by its response,
//! the timer one it took out by its deadline, the connection's loss every
//! call of the connection, the caller blocks (or
//! awaits) the outcome and lets go of the slot, or gives up and takes the
//! call out of the table itself. Every interleaving, up to
//! `LOOM_MAX_PREEMPTIONS`: run by `scripts/loom`.
//!
//! Properties: a call's outcome is delivered exactly once, or the call is
//! cancelled and nothing is delivered (never both, never lost, a late
//! response counted stale); a slot is released exactly once per call, kept
//! for reuse only when both its users let go, fresh when reused, and a
//! reused slot gets its new call's outcome only.
#![cfg(all(loom, feature = "testing"))]

mod loom_support;

use loom::thread;
use loom_support::Calls;
use std::sync::Arc;
use std::time::Instant;

/// A response and the deadline race while the caller waits: exactly one
/// completes the call, and that outcome is what the caller gets.
fn response_races_deadline(blocking: bool) {
    let due = Instant::now();
    loom::model(move || {
        let calls = Arc::new(Calls::default());
        let (id, slot) = calls.start(Some(due));
        let c = calls.clone();
        let responder = thread::spawn(move || c.respond(id, 7));
        let c = calls.clone();
        let timer = thread::spawn(move || c.expire(due));
        let got = if blocking {
            calls.wait(slot)
        } else {
            calls.wait_async(slot)
        };
        let responded = responder.join().unwrap();
        let expired = timer.join().unwrap();
        assert!(
            responded ^ (expired == 1),
            "exactly one of response and deadline completes the call"
        );
        let expected = if responded {
            Ok(7)
        } else {
            Err("deadline exceeded")
        };
        assert_eq!(got, expected);
        assert_eq!(calls.stale(), u64::from(!responded));
        assert_eq!(calls.pool.spare(), 1, "released by both, kept once");
        assert!(calls.table.lock().unwrap().is_empty());
    });
}

#[test]
fn blocked_caller_response_races_deadline() {
    response_races_deadline(true);
}

#[test]
fn awaiting_caller_response_races_deadline() {
    response_races_deadline(false);
}

/// A response, the deadline and the loss of the connection race while
/// the caller waits: one of them completes the call, the others find it
/// gone, and the caller gets that one's outcome.
#[test]
fn response_races_deadline_and_lost_connection() {
    let due = Instant::now();
    loom::model(move || {
        let calls = Arc::new(Calls::default());
        let (id, slot) = calls.start(Some(due));
        let c = calls.clone();
        let responder = thread::spawn(move || c.respond(id, 7));
        let c = calls.clone();
        let timer = thread::spawn(move || c.expire(due));
        let c = calls.clone();
        let reader = thread::spawn(move || c.lose());
        let got = calls.wait(slot);
        let responded = responder.join().unwrap();
        let expired = timer.join().unwrap() == 1;
        let lost = reader.join().unwrap() == 1;
        assert_eq!(
            [responded, expired, lost].iter().filter(|b| **b).count(),
            1,
            "exactly one completer"
        );
        let expected = if responded {
            Ok(7)
        } else if expired {
            Err("deadline exceeded")
        } else {
            Err("connection lost")
        };
        assert_eq!(got, expected);
        assert_eq!(calls.pool.spare(), 1, "released by both, kept once");
    });
}

/// The caller gives up while the response arrives: either the response
/// completes the call (and the caller drops the outcome unread) or the
/// cancel takes it (and the response is stale), never both; the slot is
/// not reused either way, as the caller never lets go of it.
#[test]
fn cancel_races_response() {
    loom::model(|| {
        let calls = Arc::new(Calls::default());
        let (id, slot) = calls.start(None);
        let c = calls.clone();
        let responder = thread::spawn(move || c.respond(id, 7));
        let cancelled = calls.cancel(id);
        drop(slot);
        let responded = responder.join().unwrap();
        assert!(responded ^ cancelled, "completed or cancelled, not both");
        assert_eq!(calls.stale(), u64::from(cancelled));
        assert_eq!(calls.pool.spare(), 0, "a dropped call's slot is not reused");
    });
}

/// A call ends and its slot is reused by the next call while the first
/// call's completer is still letting go and a duplicate of its response
/// arrives: the next call gets its own outcome only, and each slot is
/// fresh when taken.
#[test]
fn slot_reused_while_old_completer_finishes() {
    loom::model(|| {
        let calls = Arc::new(Calls::default());
        let (first, slot) = calls.start(None);
        let c = calls.clone();
        let late = thread::spawn(move || {
            let delivered = c.respond(first, 1);
            // The same response again (a forged or duplicated frame).
            let duplicate = c.respond(first, 1);
            (delivered, duplicate)
        });
        assert_eq!(calls.wait(slot), Ok(1));
        let (second, slot) = calls.start(None);
        let c = calls.clone();
        let responder = thread::spawn(move || c.respond(second, 2));
        assert_eq!(calls.wait(slot), Ok(2), "the new call's own outcome");
        assert_eq!(late.join().unwrap(), (true, false));
        assert!(responder.join().unwrap());
        assert_eq!(calls.stale(), 1, "the duplicate is stale");
        let spare = calls.pool.spare();
        assert!(
            (1..=2).contains(&spare),
            "both slots kept (or one, reused), got {spare}"
        );
        let slot = calls.pool.take();
        assert!(slot.is_fresh());
    });
}
