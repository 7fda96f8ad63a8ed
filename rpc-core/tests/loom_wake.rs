//! Model checks of a dispatcher going to sleep on its completion queue
//! while work arrives that is not a completion: a parked handler task
//! woken from another thread (`executor.rs`), and a request corked by a
//! caller (`dispatch/wake.rs`). The dispatcher's steps are those of
//! `Endpoint::run` before it sleeps. Every interleaving, up to
//! `LOOM_MAX_PREEMPTIONS`: run by `scripts/loom`.
//!
//! Properties: a task woken while its dispatcher goes to sleep runs (and
//! one woken while the dispatcher runs another); a
//! corked request leaves though the dispatcher sleeps, by the dispatcher's
//! last flush or by its caller.
#![cfg(all(loom, feature = "testing"))]

mod loom_support;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Condvar, Mutex};
use loom::thread;
use loom_support::Cq;
use rpc_core::testing::sync::{Corked, Executor};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// What a parked handler waits for: opened from another thread.
#[derive(Default)]
struct Gate {
    open: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Gate {
    fn open(&self) {
        self.open.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap().take() {
            w.wake();
        }
    }
}

/// Ready once its gate is open.
struct Opened(Arc<Gate>);

impl Future for Opened {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        *self.0.waker.lock().unwrap() = Some(cx.waker().clone());
        if self.0.open.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// Two handlers park on the dispatcher; two other threads wake them while
/// the dispatcher runs what was woken, arms its queue, looks at the
/// executor once more and sleeps (`Endpoint::run`): both tasks run, and
/// the dispatcher does not sleep through a wake-up, one that comes while
/// it runs the other task included.
#[test]
fn woken_tasks_run_though_their_dispatcher_sleeps() {
    loom::model(|| {
        let cq = Arc::new(Cq::default());
        let c = cq.clone();
        // The waker's interrupt, as `Endpoint::new` gives it.
        let exec = Executor::new(move || c.interrupt());
        let ran = Arc::new(AtomicUsize::new(0));
        let mut openers = Vec::new();
        for _ in 0..2 {
            let gate = Arc::new(Gate::default());
            let (g, r) = (gate.clone(), ran.clone());
            exec.spawn(async move {
                Opened(g).await;
                r.fetch_add(1, Ordering::Relaxed);
            });
            openers.push(thread::spawn(move || gate.open()));
        }
        while ran.load(Ordering::Relaxed) < 2 {
            if exec.run_woken() > 0 {
                continue;
            }
            cq.arm();
            if exec.has_woken() {
                continue;
            }
            cq.wait();
        }
        for opener in openers {
            opener.join().unwrap();
        }
        assert_eq!(ran.load(Ordering::Relaxed), 2, "each task ran once");
        assert_eq!(exec.run_woken(), 0);
    });
}

/// Whether the dispatcher sleeps, and when to stop it.
#[derive(Default)]
struct Sleeper {
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Sleeper {
    /// The dispatcher sleeps until stopped.
    fn sleep(&self) {
        let mut st = self.state.lock().unwrap();
        st.0 = true;
        self.cond.notify_all();
        while !st.1 {
            st = self.cond.wait(st).unwrap();
        }
    }

    /// Waits until the dispatcher sleeps.
    fn until_asleep(&self) {
        let mut st = self.state.lock().unwrap();
        while !st.0 {
            st = self.cond.wait(st).unwrap();
        }
    }

    fn stop(&self) {
        self.state.lock().unwrap().1 = true;
        self.cond.notify_all();
    }
}

/// A caller corks a request while the dispatcher turns, then goes to sleep
/// with nothing to wake it: once the caller is done and the dispatcher
/// asleep, the request has left, once.
#[test]
fn corked_request_leaves_though_its_dispatcher_sleeps() {
    loom::model(|| {
        let corked = Arc::new(Corked::<u32>::new());
        let sent = Arc::new(Mutex::new(Vec::new()));
        let sleeper = Arc::new(Sleeper::default());
        let (c, s, z) = (corked.clone(), sent.clone(), sleeper.clone());
        let dispatcher = thread::spawn(move || {
            let uncork = |conn| s.lock().unwrap().push(conn);
            // A turn, then the sleep.
            c.flush(uncork);
            c.sleep(uncork, || z.sleep());
        });
        let (c, s) = (corked.clone(), sent.clone());
        let caller = thread::spawn(move || c.note(7, |conn| s.lock().unwrap().push(conn)));
        caller.join().unwrap();
        sleeper.until_asleep();
        assert_eq!(
            *sent.lock().unwrap(),
            [7],
            "uncorked once, before the sleep"
        );
        sleeper.stop();
        dispatcher.join().unwrap();
    });
}
