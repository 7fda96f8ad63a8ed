//! When pollers and callers spin, nap or sleep: the spinning policy.

use super::*;

/// Longest the poller thread naps at a time while callers poll the queue in
/// its place: blocked in `wait` ([`Endpoint::poll_until`]), through their
/// futures ([`Endpoint::try_progress`]), or moments ago. A caller that stops
/// polling without its response says so ([`Endpoint::ensure_polled`]), so
/// this only bounds how late a missed wake-up is noticed; each nap costs a
/// wake-up, which on a loaded core (or an emulated one) takes a core from
/// the threads doing the work.
pub(super) const POLL_NAP: Duration = Duration::from_millis(5);
/// Waits a moment in a spin loop; now and then lets another thread run
/// (one that delivers completions may share this core): every 256 spins,
/// as a `sched_yield` is a syscall, and an expensive one under emulation.
pub(super) fn spin_pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if *spins % 256 == 0 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// [`spin_pause`] for a blocked caller while other callers poll too: lets
/// another thread run after every look. Callers that outnumber the cores
/// (four threads making blocking calls on two cores, one of them the
/// server's dispatcher) then take turns within microseconds, each finding
/// its response completed by whoever turned the queue, instead of one
/// polling while the others sleep and are woken one by one (a futex wake
/// and a context switch for nearly every call), or spinning out a time
/// slice. Where cores are free a yield returns at once. Only while waits
/// are short ([`AdaptiveSpin::short`]): with slow calls, callers beyond
/// the first sleep at once, as each one polling would spin out the
/// configured time for every call.
pub(super) fn crowded_pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    std::thread::yield_now();
}

/// Least time between two [`future_spin_yield`] yields, while they find
/// other threads waiting for the core.
const FUTURE_YIELD_MIN: Duration = Duration::from_micros(20);
/// Most time between two [`future_spin_yield`] yields, once they find
/// nobody waiting.
const FUTURE_YIELD_MAX: Duration = Duration::from_millis(1);

/// When a thread running callers' futures next gives up its core, and how
/// yields went on it (see [`future_spin_yield`]).
#[derive(Clone, Copy)]
struct FutureYields {
    next: Option<Instant>,
    interval: Duration,
    /// The quickest yield seen on this thread: one that found nobody
    /// waiting for the core, what a yield alone costs here.
    quickest: Duration,
}

thread_local! {
    static FUTURE_YIELDS: std::cell::Cell<FutureYields> = const {
        std::cell::Cell::new(FutureYields {
            next: None,
            interval: FUTURE_YIELD_MIN,
            quickest: Duration::MAX,
        })
    };
}

/// For a caller's future that asks to be polled again at once while it
/// waits for its response (`UnaryCall`'s `poll`, `now` being the clock it
/// just read): gives up the thread's core now and then, as [`spin_pause`]
/// does for a thread spinning in a loop. An executor re-polls such a
/// future without ever blocking, so its worker thread never leaves the
/// core on its own: with more such threads than cores (a tokio runtime's
/// workers, one per core, beside a dispatcher in the same process or on
/// the same host) the dispatcher that would deliver the responses waited
/// for the scheduler's next time slice, milliseconds, and calls stalled
/// that long (tcp:// at 64 in flight from tokio tasks on 2 cores: p99
/// 3.8-4.1 ms and 158-184k calls/s, against 0.68-0.78 ms and 373-516k
/// with this; `benches/results/future-yields.txt`).
/// A yield that took longer than twice the quickest one here (someone else
/// ran meanwhile) keeps the next one 20 µs away; one that found nobody
/// waiting doubles the gap, up to 1 ms, so that where a thread has a core
/// to itself yields cost next to nothing.
pub(crate) fn future_spin_yield(now: Instant) {
    let mut st = FUTURE_YIELDS.get();
    match st.next {
        Some(next) if now < next => return,
        None => st.next = Some(now + st.interval),
        Some(_) => {
            std::thread::yield_now();
            let after = Instant::now();
            let took = after.saturating_duration_since(now);
            st.quickest = st.quickest.min(took);
            st.interval = if took > 2 * st.quickest + Duration::from_micros(1) {
                FUTURE_YIELD_MIN
            } else {
                (st.interval * 2).min(FUTURE_YIELD_MAX)
            };
            st.next = Some(after + st.interval);
        }
    }
    FUTURE_YIELDS.set(st);
}

/// Longest wait that adaptive spinning covers: beyond it, sleeping is
/// cheaper than spinning.
pub(super) const ADAPTIVE_SPIN_MAX: Duration = Duration::from_millis(1);

/// Spin-then-block that adapts to the traffic: a moving average of how long
/// waits took. While waits are short (up to [`ADAPTIVE_SPIN_MAX`]), a poller
/// spins for up to twice that average, so it is still spinning when the
/// next completion comes instead of paying a sleep and a wake-up for it;
/// when they are long (an idle server, slow handlers), it spins only for
/// the configured time before it blocks.
#[derive(Debug, Default)]
pub(crate) struct AdaptiveSpin {
    /// Moving average of recent waits, ns (1/8 weight per new one).
    pub(super) average_ns: AtomicU64,
}

impl AdaptiveSpin {
    /// Notes how long a wait took.
    pub(crate) fn record(&self, wait: Duration) {
        let new = wait.as_nanos().min(u64::MAX as u128) as u64;
        let old = self.average_ns.load(Ordering::Relaxed);
        // Races between recorders only lose a sample.
        self.average_ns
            .store(old - old / 8 + new / 8, Ordering::Relaxed);
    }

    /// The average of recent waits if it is short enough to spin through
    /// (up to [`ADAPTIVE_SPIN_MAX`]; with none yet, zero).
    fn short_average(&self) -> Option<Duration> {
        let average = Duration::from_nanos(self.average_ns.load(Ordering::Relaxed));
        (average <= ADAPTIVE_SPIN_MAX).then_some(average)
    }

    /// Whether recent waits were short enough to spin through (none yet
    /// counts as short).
    pub(crate) fn short(&self) -> bool {
        self.short_average().is_some()
    }

    /// How long to spin, at least `base`.
    pub(crate) fn budget(&self, base: Duration) -> Duration {
        match self.short_average() {
            Some(average) => base.max(average * 2).min(base.max(ADAPTIVE_SPIN_MAX)),
            None => base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_spin_covers_short_waits_only() {
        let base = Duration::from_micros(50);
        let spin = AdaptiveSpin::default();
        assert_eq!(spin.budget(base), base, "no history: the configured spin");
        assert!(spin.short(), "no history counts as short waits");
        for _ in 0..64 {
            spin.record(Duration::from_micros(200));
        }
        let b = spin.budget(base);
        assert!(
            b > Duration::from_micros(300) && b <= Duration::from_micros(400),
            "short waits: spin about twice as long, got {b:?}"
        );
        assert!(spin.short());
        for _ in 0..64 {
            spin.record(Duration::from_millis(20));
        }
        assert_eq!(
            spin.budget(base),
            base,
            "long waits: back to the configured spin"
        );
        assert!(!spin.short(), "long waits: blocked callers do not crowd");
        let long_base = Duration::from_millis(5);
        assert_eq!(
            spin.budget(long_base),
            long_base,
            "never below the configured spin"
        );
    }
}
