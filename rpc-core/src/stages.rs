//! Where a lone unary call's time goes, stage by stage (feature `stages`).
//!
//! With the feature on, the call path stamps the cycle counter at each
//! stage of a call (caller → encode → post → server poll → decode →
//! handler → encode → post → client poll → caller) into one global slot
//! per stage, and the caller, as its call returns, keeps the stamps of
//! that call. With one call in flight at a time, client and server in one
//! process (as `rpc-bench --concurrency 1` runs them), every slot holds
//! the stamp of the call that is ending, and [`report`] gives the median
//! time of each stage over the calls kept. With more calls in flight the
//! slots mix calls: the figures mean nothing there.
//!
//! Without the feature every function here is empty and inlined away:
//! the default build carries no stamping on its data path.

/// A point in a unary call's life, in the order a lone call passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Stage {
    /// The client's `Channel::unary` is entered.
    CallStart = 0,
    /// The request is encoded and staged; its write is about to be posted.
    RequestPost,
    /// The post of the request returned.
    RequestPosted,
    /// The server's dispatcher polled the request's completion.
    ServerPolled,
    /// The request's frame is out of the ring, handed to the server's role.
    ServerFrame,
    /// The handler's future returned the response.
    HandlerDone,
    /// The response is encoded and staged; its write is about to be posted.
    ResponsePost,
    /// The post of the response returned.
    ResponsePosted,
    /// The client polled the response's completion.
    ClientPolled,
    /// The response's frame is out of the ring, handed to the client's role.
    ClientFrame,
    /// The caller's poll of the completion queue that delivered the
    /// response is over.
    ClientTurnDone,
    /// The caller took the response from its slot, before decoding it.
    ClientTaken,
    /// The caller has its response.
    CallDone,
}

/// How many stages there are.
pub const STAGES: usize = Stage::CallDone as usize + 1;

/// Names of the stages, in order.
pub const NAMES: [&str; STAGES] = [
    "call_start",
    "request_post",
    "request_posted",
    "server_polled",
    "server_frame",
    "handler_done",
    "response_post",
    "response_posted",
    "client_polled",
    "client_frame",
    "client_turn_done",
    "client_taken",
    "call_done",
];

#[cfg(feature = "stages")]
mod imp {
    use super::{STAGES, Stage};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    /// The stages a call passes one after the other; the returns of the
    /// posts are timed from their start instead.
    const CHAIN: [Stage; 11] = [
        Stage::CallStart,
        Stage::RequestPost,
        Stage::ServerPolled,
        Stage::ServerFrame,
        Stage::HandlerDone,
        Stage::ResponsePost,
        Stage::ClientPolled,
        Stage::ClientFrame,
        Stage::ClientTurnDone,
        Stage::ClientTaken,
        Stage::CallDone,
    ];
    /// Each post, from its start to its return: off the chain, since on
    /// Soft-RoCE the peer's completion is made inside the posting syscall
    /// and may be polled before it returns.
    const POSTS: [(Stage, Stage); 2] = [
        (Stage::RequestPost, Stage::RequestPosted),
        (Stage::ResponsePost, Stage::ResponsePosted),
    ];

    /// Every span a stage is timed over: from the stage before it on the
    /// chain, or from the start of its post.
    fn spans() -> impl Iterator<Item = (usize, usize)> {
        let chain = CHAIN.windows(2).map(|w| (w[0], w[1]));
        chain.chain(POSTS).map(|(a, b)| (a as usize, b as usize))
    }

    static STAMPS: [AtomicU64; STAGES] = [const { AtomicU64::new(0) }; STAGES];
    static KEPT: Mutex<Vec<[u64; STAGES]>> = Mutex::new(Vec::new());
    static CLOCK: Mutex<Option<(Instant, u64)>> = Mutex::new(None);

    #[allow(unsafe_code)]
    pub(super) fn now() -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: RDTSC has no preconditions on x86_64.
            unsafe { core::arch::x86_64::_rdtsc() }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            START.get_or_init(Instant::now).elapsed().as_nanos() as u64
        }
    }

    pub(super) fn mark(stage: Stage) {
        STAMPS[stage as usize].store(now(), Ordering::Relaxed);
    }

    pub(super) fn mark_once(stage: Stage) {
        // The first of a call's events: a later one (another frame of the
        // same turn) does not move it.
        let start = STAMPS[Stage::CallStart as usize].load(Ordering::Relaxed);
        let slot = &STAMPS[stage as usize];
        if slot.load(Ordering::Relaxed) <= start {
            slot.store(now(), Ordering::Relaxed);
        }
    }

    pub(super) fn finish() {
        let mut stamps = [0u64; STAGES];
        for (s, a) in stamps.iter_mut().zip(&STAMPS) {
            *s = a.load(Ordering::Relaxed);
        }
        stamps[Stage::CallDone as usize] = now();
        // Only a call whose every stage was stamped after it started, in
        // order along each span (a heartbeat or another call's write would
        // break it).
        let ordered = spans().all(|(a, b)| stamps[a] != 0 && stamps[a] <= stamps[b]);
        if ordered {
            let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
            if kept.len() < 1 << 20 {
                kept.push(stamps);
            }
        }
        let mut clock = CLOCK.lock().unwrap_or_else(|e| e.into_inner());
        if clock.is_none() {
            *clock = Some((Instant::now(), now()));
        }
    }

    pub(super) fn report() -> Option<super::Report> {
        let kept = std::mem::take(&mut *KEPT.lock().unwrap_or_else(|e| e.into_inner()));
        let (t0, c0) = CLOCK.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        let ticks = now().saturating_sub(c0).max(1);
        let ns_per_tick = t0.elapsed().as_nanos() as f64 / ticks as f64;
        if kept.is_empty() {
            return None;
        }
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2] as f64 * ns_per_tick / 1000.0
        };
        let mut stage_us = [0.0; STAGES];
        for (a, b) in spans() {
            stage_us[b] = median(kept.iter().map(|s| s[b] - s[a]).collect());
        }
        let total_us = median(
            kept.iter()
                .map(|s| s[STAGES - 1] - s[0])
                .collect::<Vec<_>>(),
        );
        Some(super::Report {
            calls: kept.len(),
            stage_us,
            total_us,
        })
    }
}

/// The medians of the calls kept since the last report.
#[derive(Debug, Clone)]
pub struct Report {
    /// Calls whose every stage was stamped in order.
    pub calls: usize,
    /// `stage_us[i]`: median µs from the stage before `i` on the call's
    /// chain to stage `i`; for the two `*Posted` stages, from the start of
    /// their post (how long the post took). 0 for the first stage.
    pub stage_us: [f64; STAGES],
    /// Median µs from the first stage to the last.
    pub total_us: f64,
}

/// Stamps `stage` for the call in flight.
#[inline(always)]
pub(crate) fn mark(stage: Stage) {
    #[cfg(feature = "stages")]
    imp::mark(stage);
    #[cfg(not(feature = "stages"))]
    let _ = stage;
}

/// Stamps `stage` unless it was stamped already since the call started.
#[inline(always)]
pub(crate) fn mark_once(stage: Stage) {
    #[cfg(feature = "stages")]
    imp::mark_once(stage);
    #[cfg(not(feature = "stages"))]
    let _ = stage;
}

/// The call in flight is over: keeps its stamps.
#[inline(always)]
pub(crate) fn finish() {
    #[cfg(feature = "stages")]
    imp::finish();
}

/// The medians of the stages of the calls kept since the last report, and
/// forgets them; `None` without the feature or with no call kept.
pub fn report() -> Option<Report> {
    #[cfg(feature = "stages")]
    return imp::report();
    #[cfg(not(feature = "stages"))]
    None
}
