//! Reconnection: backoff, the process's reconnecting thread, and callers
//! that wait for a channel to be ready.
//!
//! A channel whose connection fails schedules a new attempt after a backoff
//! (exponential, with jitter, capped); one thread per process sleeps until
//! the next attempt is due and starts it on a short-lived thread of its own
//! (at most [`MAX_ATTEMPTS`] at a time), so that a slow connect to a host
//! that vanished never delays another channel's. The same thread wakes the
//! waiting callers whose deadline passed (see [`Ready`]).

use super::stream_limit::{Waiters, Waiting};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::Waker;
use std::time::{Duration, Instant};

/// How a channel spaces its attempts to reconnect: the first after
/// `initial`, each next one `multiplier` times longer, never longer than
/// `max`; each delay is drawn at random from its upper fifth and below
/// (`[0.8 × d, d]`), so that many clients of one restarted server do not
/// come back in step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay before the first attempt after a failure.
    pub initial: Duration,
    /// Longest delay between two attempts.
    pub max: Duration,
    /// Growth of the delay per failed attempt (at least 1).
    pub multiplier: f64,
}

impl Default for Backoff {
    /// 50 ms, growing 1.6 times per failed attempt up to 1 s: a server that
    /// comes back is in use again within a second, and a server that stays
    /// away costs each client one connection attempt a second.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(1),
            multiplier: 1.6,
        }
    }
}

impl Backoff {
    /// The delay before attempt `failures + 1`, after `failures` failed
    /// ones in a row (at least 1), before jitter.
    pub(crate) fn ceiling(&self, failures: u32) -> Duration {
        let grown = self.initial.as_secs_f64()
            * self
                .multiplier
                .max(1.0)
                .powi(failures.saturating_sub(1).min(64) as i32);
        Duration::from_secs_f64(grown.min(self.max.as_secs_f64()))
    }

    /// The jittered delay before the next attempt after `failures` failed ones.
    pub(crate) fn delay(&self, failures: u32) -> Duration {
        self.ceiling(failures).mul_f64(1.0 - 0.2 * unit_random())
    }
}

/// A number in `[0, 1)`, different on every call (xorshift over a
/// process-wide counter seeded by the clock; no cryptographic quality).
fn unit_random() -> f64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    if x == 0 {
        x = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        STATE.store(x, Ordering::Relaxed);
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// Callers waiting for a channel to have a live connection: wakers of
/// tasks and a condition variable for blocked threads, both woken when a
/// connection comes up (and tasks also at their deadline, by the
/// reconnecting thread).
#[derive(Default)]
pub(crate) struct Ready {
    state: Mutex<ReadyState>,
    changed: Condvar,
}

#[derive(Default)]
struct ReadyState {
    wakers: Vec<Waker>,
    /// Bumped each time a connection comes up.
    generation: u64,
    /// Streams waiting at their connections' stream limits: a connection
    /// that comes up may have room. Held weakly, as a stream's limits hold
    /// them, until they are dropped.
    streams: Waiters,
}

impl Ready {
    fn lock(&self) -> MutexGuard<'_, ReadyState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current generation: pass it to [`Ready::wait`] after checking
    /// for a connection, so that one coming up in between is not missed.
    pub(crate) fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Wakes `waker` when a connection comes up (or at `deadline`).
    pub(crate) fn register(&self, waker: &Waker, deadline: Option<Instant>) {
        {
            let mut st = self.lock();
            if !st.wakers.iter().any(|w| w.will_wake(waker)) {
                st.wakers.push(waker.clone());
            }
        }
        if let Some(at) = deadline {
            reconnector().wake_at(at, waker.clone());
        }
    }

    /// Wakes `waiting`, a stream at its connections' stream limits, each
    /// time a connection comes up (it may have room), until it is dropped.
    pub(crate) fn register_stream(&self, waiting: &Arc<Waiting>) {
        self.lock().streams.push(waiting);
    }

    /// Blocks until a connection comes up after `generation`, or `deadline`.
    pub(crate) fn wait(&self, generation: u64, deadline: Option<Instant>) {
        let mut st = self.lock();
        while st.generation == generation {
            match deadline {
                None => st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(at) => {
                    let now = Instant::now();
                    if now >= at {
                        return;
                    }
                    st = self
                        .changed
                        .wait_timeout(st, at - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// A connection came up: wakes everyone waiting, for a connection or
    /// for room.
    pub(crate) fn notify(&self) {
        let (wakers, streams) = {
            let mut st = self.lock();
            st.generation += 1;
            let streams = st.streams.live();
            (std::mem::take(&mut st.wakers), streams)
        };
        self.changed.notify_all();
        for w in wakers {
            w.wake();
        }
        for waiting in streams {
            waiting.wake();
        }
    }
}

/// Connection attempts under way at most; more wait their turn.
pub(crate) const MAX_ATTEMPTS: usize = 16;

/// A job for the reconnecting thread.
type Attempt = Box<dyn FnOnce() + Send>;

/// The process's reconnecting thread: attempts due at an instant, and
/// wakers due at an instant.
struct Reconnector {
    state: Mutex<Due>,
    changed: Condvar,
    running: AtomicUsize,
}

#[derive(Default)]
struct Due {
    attempts: Vec<(Instant, Attempt)>,
    wakers: Vec<(Instant, Waker)>,
}

/// Wakes `waker` at `at` (from the reconnecting thread).
pub(crate) fn wake_at(at: Instant, waker: Waker) {
    reconnector().wake_at(at, waker);
}

fn reconnector() -> &'static Reconnector {
    static R: OnceLock<Reconnector> = OnceLock::new();
    R.get_or_init(|| {
        std::thread::Builder::new()
            .name("rpc-reconnect".into())
            .spawn(|| reconnector().run())
            .expect("cannot spawn the reconnecting thread");
        Reconnector {
            state: Mutex::new(Due::default()),
            changed: Condvar::new(),
            running: AtomicUsize::new(0),
        }
    })
}

/// Runs `attempt` on a thread of its own at `at` (or as soon after as
/// fewer than [`MAX_ATTEMPTS`] are under way).
pub(crate) fn schedule(at: Instant, attempt: impl FnOnce() + Send + 'static) {
    let r = reconnector();
    r.lock().attempts.push((at, Box::new(attempt)));
    r.changed.notify_one();
}

impl Reconnector {
    fn lock(&self) -> MutexGuard<'_, Due> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake_at(&self, at: Instant, waker: Waker) {
        self.lock().wakers.push((at, waker));
        self.changed.notify_one();
    }

    fn run(&'static self) {
        loop {
            let (attempts, wakers) = self.next_due();
            for w in wakers {
                w.wake();
            }
            for attempt in attempts {
                self.running.fetch_add(1, Ordering::AcqRel);
                let spawned = std::thread::Builder::new()
                    .name("rpc-connect".into())
                    .spawn(move || {
                        attempt();
                        let r = reconnector();
                        r.running.fetch_sub(1, Ordering::AcqRel);
                        r.changed.notify_one();
                    });
                if let Err(e) = spawned {
                    // Out of threads: this attempt is lost; its channel
                    // stays down until a call notices and schedules again.
                    self.running.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(error = %e, "cannot spawn a connection attempt");
                }
            }
        }
    }

    /// Waits for the next due attempts (as many as may start) and wakers.
    fn next_due(&self) -> (Vec<Attempt>, Vec<Waker>) {
        let mut due = self.lock();
        loop {
            let now = Instant::now();
            let room = MAX_ATTEMPTS.saturating_sub(self.running.load(Ordering::Acquire));
            let mut attempts = Vec::new();
            let mut i = 0;
            while i < due.attempts.len() && attempts.len() < room {
                if due.attempts[i].0 <= now {
                    attempts.push(due.attempts.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            let mut wakers = Vec::new();
            let mut i = 0;
            while i < due.wakers.len() {
                if due.wakers[i].0 <= now {
                    wakers.push(due.wakers.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            if !attempts.is_empty() || !wakers.is_empty() {
                return (attempts, wakers);
            }
            // Attempts that are due but have no room wait for one to end
            // (which notifies).
            let next = due
                .attempts
                .iter()
                .map(|(at, _)| *at)
                .filter(|at| *at > now)
                .chain(due.wakers.iter().map(|(at, _)| *at))
                .min();
            due = match next {
                Some(at) => {
                    self.changed
                        .wait_timeout(due, at - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.changed.wait(due).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter_below_it() {
        let b = Backoff::default();
        assert_eq!(b.ceiling(1), Duration::from_millis(50));
        assert_eq!(b.ceiling(2), Duration::from_millis(80));
        assert_eq!(b.ceiling(30), Duration::from_secs(1));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
        for failures in [1, 3, 10, 100] {
            let d = b.delay(failures);
            assert!(d <= b.ceiling(failures), "{d:?}");
            assert!(d >= b.ceiling(failures).mul_f64(0.8), "{d:?}");
        }
        // Jitter differs between draws.
        let draws: std::collections::HashSet<_> = (0..20).map(|_| b.delay(5)).collect();
        assert!(draws.len() > 10, "{draws:?}");
    }

    #[test]
    fn scheduled_attempts_run_when_due() {
        let (tx, rx) = std::sync::mpsc::channel();
        let start = Instant::now();
        for (i, ms) in [(1, 60u64), (0, 20)] {
            let tx = tx.clone();
            schedule(start + Duration::from_millis(ms), move || {
                tx.send((i, start.elapsed())).unwrap();
            });
        }
        let (first, t0) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let (second, t1) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((first, second), (0, 1));
        assert!(t0 >= Duration::from_millis(20) && t1 >= Duration::from_millis(60));
    }

    #[test]
    fn a_blocked_waiter_wakes_when_notified_or_at_its_deadline() {
        let ready = std::sync::Arc::new(Ready::default());
        let g = ready.generation();
        let started = Instant::now();
        ready.wait(g, Some(started + Duration::from_millis(30)));
        assert!(started.elapsed() >= Duration::from_millis(30));
        let r = ready.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            r.notify();
        });
        ready.wait(g, None);
        assert!(ready.generation() > g);
        t.join().unwrap();
    }
}
