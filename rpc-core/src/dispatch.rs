//! The dispatcher: one poller per context turns the completion queue and
//! maps each completion to its connection (by `qp_num`) and each frame to
//! the pending call or the handler; connections own the send path.

use crate::executor::Executor;
use crate::fabric::{
    Completion, CompletionKind, CompletionQueue, Connected, Fabric, PeerRing, QueuePair, Region,
    WcStatus, WriteImm,
};
use crate::idmap::IdMap;
use crate::protocol::{
    ALIGN, CallId, CreditReturn, Doorbell, FrameKind, HEADER_LEN, Header, RecvRing, SendRing,
    credits::apply_ack,
};
use crate::{Metadata, Status};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, TryLockError};
use std::time::{Duration, Instant};

/// One signaled write every this many, to reclaim send-queue entries.
pub(crate) const SIGNAL_EVERY: usize = 16;
/// Completions taken from the CQ per poll.
const POLL_BATCH: usize = 64;
/// Longest the poller thread naps while a caller polls in its place: a bound
/// on how late it notices that nobody polls any more, should every wake-up
/// meant for it be missed.
const CALLER_POLL_NAP: Duration = Duration::from_millis(5);
/// While callers' futures poll the queue themselves (see
/// [`Endpoint::try_progress`]), or callers did moments ago, the poller
/// thread naps this long at a time
/// instead of competing with them for the queue and a core. A future that
/// stops polling says so ([`Endpoint::ensure_polled`]), so this too only
/// bounds how late a missed wake-up is noticed: each nap costs a wake-up,
/// which on a loaded core (or an emulated one) takes a core from the
/// threads doing the work.
const SELF_POLL_NAP: Duration = Duration::from_millis(5);
/// Waits a moment in a spin loop; now and then lets another thread run
/// (one that delivers completions may share this core).
fn spin_pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if *spins % 64 == 0 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Longest wait that adaptive spinning covers: beyond it, sleeping is
/// cheaper than spinning.
const ADAPTIVE_SPIN_MAX: Duration = Duration::from_millis(1);

/// Spin-then-block that adapts to the traffic: a moving average of how long
/// waits took. While waits are short (up to [`ADAPTIVE_SPIN_MAX`]), a poller
/// spins for up to twice that average, so it is still spinning when the
/// next completion comes instead of paying a sleep and a wake-up for it;
/// when they are long (an idle server, slow handlers), it spins only for
/// the configured time before it blocks.
#[derive(Debug, Default)]
pub(crate) struct AdaptiveSpin {
    /// Moving average of recent waits, ns (1/8 weight per new one).
    average_ns: AtomicU64,
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

    /// How long to spin, at least `base`.
    pub(crate) fn budget(&self, base: Duration) -> Duration {
        let average = Duration::from_nanos(self.average_ns.load(Ordering::Relaxed));
        if average > ADAPTIVE_SPIN_MAX {
            base
        } else {
            base.max(average * 2).min(base.max(ADAPTIVE_SPIN_MAX))
        }
    }
}

/// Message buffers a connection keeps for reuse, and the largest it keeps.
const MAX_POOLED_BUFFERS: usize = 256;
const MAX_POOLED_BUFFER: usize = 256 << 10;
/// Largest peer receive ring accepted (unless the local ring is larger):
/// each connection stages its outgoing frames in a mirror of the peer's ring.
const MAX_PEER_RING: usize = 64 << 20;

/// Tunables shared by clients and servers.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Receive ring per connection, bytes (power of two).
    pub ring_size: usize,
    /// Largest message (metadata + payload) accepted, bytes.
    pub max_message: usize,
    /// Bytes of encoded frames a connection may queue while the peer's ring is full.
    pub max_backlog: usize,
    /// Zero-length receives kept posted on the shared receive queue.
    pub srq_depth: u32,
    /// How long the poller spins on an empty queue before it blocks.
    pub spin: Duration,
    /// Connection set-up time limit.
    pub connect_timeout: Duration,
}

impl Default for Config {
    fn default() -> Config {
        let ring_size = 1 << 21;
        Config {
            ring_size,
            max_message: ring_size / 2 - HEADER_LEN,
            max_backlog: 64 << 20,
            srq_depth: 4096,
            spin: Duration::from_micros(50),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    pub(crate) fn validate(&self) -> Result<(), Status> {
        crate::protocol::ring::check_capacity(self.ring_size)
            .map_err(|e| Status::invalid_argument(format!("ring size: {e}")))?;
        let largest = self.ring_size / 2 - HEADER_LEN;
        if self.max_message > largest || self.max_message > u32::MAX as usize {
            return Err(Status::invalid_argument(format!(
                "max message size {} exceeds what a {}-byte ring holds ({largest})",
                self.max_message, self.ring_size
            )));
        }
        Ok(())
    }
}

/// A decoded incoming frame, copied out of the ring.
#[derive(Debug)]
pub(crate) struct Frame {
    pub header: Header,
    pub metadata: Option<Metadata>,
    pub payload: Vec<u8>,
}

/// What a context does with frames: answer calls (client) or run handlers (server).
pub(crate) trait Role<F: Fabric>: Send + Sync + Sized + 'static {
    /// A well-formed frame arrived on `conn`.
    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame);
    /// `conn` failed or closed.
    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str);
    /// Timers: called when the poller wakes; returns when next to wake.
    fn on_tick(&self, ep: &Endpoint<F, Self>, now: Instant) -> Option<Instant>;
}

/// What one turn of the completion queue works with. Whoever polls holds it,
/// so completions are handled by one thread at a time, in order.
struct PollState<F: Fabric> {
    batch: Vec<Completion>,
    touched: Vec<Arc<Conn<F>>>,
    /// Receives consumed and not yet replaced.
    consumed_recvs: u32,
}

/// A fabric context, its connections, and what to do with their frames.
///
/// The completion queue is turned by whoever holds `poll`: normally the
/// poller thread ([`Endpoint::run`]), but a caller blocked on its own
/// response may take it ([`Endpoint::poll_until`]) and handle completions
/// on its own thread, which saves two thread hand-offs per call. Meanwhile
/// the poller thread naps, and is woken when the caller stops polling while
/// others still wait.
pub(crate) struct Endpoint<F: Fabric, R> {
    pub fabric: F,
    /// This dispatcher's completion queue: its connections report here.
    pub cq: F::Cq,
    pub config: Config,
    /// The tasks of handlers that wait (servers only).
    pub(crate) exec: Option<Arc<Executor>>,
    pub role: R,
    conns: RwLock<IdMap<Arc<Conn<F>>>>,
    poll: Mutex<PollState<F>>,
    /// The poller thread, once it runs.
    poller: OnceLock<std::thread::Thread>,
    /// Callers polling for their responses ([`Endpoint::poll_until`]).
    callers_polling: AtomicUsize,
    /// How long the poller thread waited for work after going idle.
    pub(crate) idle_gaps: AdaptiveSpin,
    /// How long callers waited for their responses.
    pub(crate) call_waits: AdaptiveSpin,
    /// Whether the poller thread is napping because a caller polls.
    poller_napping: AtomicBool,
    stop: AtomicBool,
    /// When the poller plans to wake (ns since `epoch`; 0 while awake).
    planned_wake: AtomicU64,
    /// The earliest timer others asked for since the last tick (ns since `epoch`).
    timer_hint: AtomicU64,
    epoch: Instant,
    /// Receives posted for connections since closed: consumed receives up
    /// to this many are not replenished.
    surplus_recvs: AtomicU64,
    /// When a caller (blocked in `wait`, or its future) last turned the
    /// queue itself (ns since `epoch`; 0: one stopped and asked the poller
    /// to take over).
    last_self_poll: AtomicU64,
    /// Connections handled by this dispatcher.
    load: AtomicUsize,
    /// Connections whose writes wait for an uncork ([`Conn::send_corked`]):
    /// the poller flushes them on its next turn, so a request leaves even if
    /// its call is never polled.
    corked: Mutex<Vec<Arc<Conn<F>>>>,
    /// Whether `corked` may be non-empty.
    any_corked: AtomicBool,
    /// Whether the poller sleeps on the queue: then a corking caller
    /// uncorks at once instead of waiting for it.
    asleep: AtomicBool,
}

impl<F: Fabric, R: Role<F>> Endpoint<F, R> {
    /// A dispatcher on `fabric` with a completion queue of its own; with
    /// `tasks`, handlers that wait park on it (servers).
    pub(crate) fn new(
        fabric: F,
        config: Config,
        role: R,
        tasks: bool,
    ) -> Result<Arc<Self>, Status> {
        let cq = fabric.create_cq()?;
        fabric.post_recv(config.srq_depth)?;
        Ok(Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let exec = tasks.then(|| {
                let me = me.clone();
                Executor::new(move || {
                    if let Some(ep) = me.upgrade() {
                        ep.cq.interrupt();
                        ep.unpark_poller();
                    }
                })
            });
            Endpoint {
                fabric,
                cq,
                config,
                exec,
                role,
                conns: RwLock::new(IdMap::default()),
                poll: Mutex::new(PollState {
                    batch: Vec::with_capacity(POLL_BATCH),
                    touched: Vec::new(),
                    consumed_recvs: 0,
                }),
                poller: OnceLock::new(),
                callers_polling: AtomicUsize::new(0),
                idle_gaps: AdaptiveSpin::default(),
                call_waits: AdaptiveSpin::default(),
                poller_napping: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                planned_wake: AtomicU64::new(0),
                timer_hint: AtomicU64::new(u64::MAX),
                epoch: Instant::now(),
                surplus_recvs: AtomicU64::new(0),
                last_self_poll: AtomicU64::new(0),
                load: AtomicUsize::new(0),
                corked: Mutex::new(Vec::new()),
                any_corked: AtomicBool::new(false),
                asleep: AtomicBool::new(false),
            }
        }))
    }

    /// Connections this dispatcher handles.
    pub(crate) fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }

    /// Registers the receive ring of a new connection.
    pub(crate) fn register_ring(&self) -> Result<F::Region, Status> {
        Ok(self.fabric.register(self.config.ring_size, true)?)
    }

    /// Adds a connected queue pair; from now on its completions are dispatched.
    ///
    /// Frames are staged at the offset they will take in the peer's ring, so
    /// the staging area mirrors the peer's ring, whose size the peer chose:
    /// it is registered here, once that size is known.
    ///
    /// `max_message` is the largest message accepted on it.
    pub(crate) fn add(
        &self,
        c: Connected<F::Qp>,
        recv: F::Region,
        max_message: usize,
    ) -> Result<Arc<Conn<F>>, Status> {
        let ring_size = recv.len();
        let limit = MAX_PEER_RING.max(ring_size);
        let peer_cap = usize::try_from(c.peer.len)
            .ok()
            .filter(|&len| len <= limit)
            .ok_or_else(|| {
                Status::resource_exhausted(format!(
                    "peer ring of {} bytes is larger than the {limit} bytes this side stages",
                    c.peer.len
                ))
            })?;
        let staging = self.fabric.register(peer_cap, false)?;
        // Every incoming write consumes a receive, and the peer may send a
        // frame per ALIGN bytes of this ring, plus a credit per frame it
        // received, before the poller gets to replenish: provision for all
        // of it, so that a busy poller delays the peer instead of failing it
        // with RNR errors.
        let recvs = u32::try_from((ring_size + peer_cap) / ALIGN)
            .map_err(|_| Status::resource_exhausted("rings too large to provision receives"))?;
        let mut conn = Conn::new(recv, staging, self.config.max_backlog, c)?;
        conn.recvs = recvs;
        conn.max_message = max_message;
        self.fabric.post_recv(recvs)?;
        let conn = Arc::new(conn);
        self.conns
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn.qp_num, conn.clone());
        self.load.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(qp_num = conn.qp_num, peer = %conn.peer_addr, "connection established");
        Ok(conn)
    }

    pub(crate) fn conn(&self, qp_num: u32) -> Option<Arc<Conn<F>>> {
        self.conns
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qp_num)
            .cloned()
    }

    pub(crate) fn connections(&self) -> Vec<Arc<Conn<F>>> {
        self.conns
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Fails `conn`: its queue pair is destroyed and the role told.
    pub(crate) fn close(&self, conn: &Arc<Conn<F>>, why: &str) {
        let removed = self
            .conns
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn.qp_num)
            .is_some();
        conn.kill(why);
        if removed {
            self.load.fetch_sub(1, Ordering::Relaxed);
            self.surplus_recvs
                .fetch_add(conn.recvs as u64, Ordering::AcqRel);
            self.role.on_lost(conn, why);
        }
    }

    /// Posts receives in place of `consumed` ones, less any surplus left by
    /// closed connections.
    fn replenish(&self, consumed: u32) -> Result<(), Status> {
        let mut surplus = self.surplus_recvs.load(Ordering::Acquire);
        let absorbed = loop {
            let absorbed = surplus.min(consumed as u64);
            match self.surplus_recvs.compare_exchange_weak(
                surplus,
                surplus - absorbed,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break absorbed as u32,
                Err(now) => surplus = now,
            }
        };
        if consumed > absorbed {
            if let Err(e) = self.fabric.post_recv(consumed - absorbed) {
                // The caller retries with the same count: give the surplus back.
                self.surplus_recvs
                    .fetch_add(absorbed as u64, Ordering::AcqRel);
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Takes note of a connection that [`Conn::send_corked`] corked: the
    /// poller uncorks it on its next turn unless its callers do first, and if
    /// the poller sleeps, it is uncorked now.
    pub(crate) fn corked(&self, conn: &Arc<Conn<F>>) {
        self.corked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(conn));
        self.any_corked.store(true, Ordering::SeqCst);
        // Pairs with the poller's store of `asleep` before its last flush:
        // either it sees `any_corked`, or this sees `asleep`.
        if self.asleep.load(Ordering::SeqCst) {
            self.flush_corked();
        }
    }

    /// Posts the writes of the connections [`Endpoint::corked`] noted.
    fn flush_corked(&self) {
        if !self.any_corked.swap(false, Ordering::SeqCst) {
            return;
        }
        let lock = || self.corked.lock().unwrap_or_else(|e| e.into_inner());
        let mut conns = std::mem::take(&mut *lock());
        for conn in conns.drain(..) {
            conn.uncork();
        }
        // Give the list its capacity back: no allocation per flush.
        let mut list = lock();
        if list.capacity() == 0 {
            *list = conns;
        }
    }

    /// Asks the poller to exit.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.cq.interrupt();
        self.unpark_poller();
    }

    fn unpark_poller(&self) {
        if let Some(t) = self.poller.get() {
            t.unpark();
        }
    }

    /// Makes sure the poller thread polls if no caller does: called before
    /// a caller waits for a response without polling itself.
    pub(crate) fn ensure_polled(&self) {
        // A future giving up on polling: the poller need not wait for the
        // futures' polls to grow old before it takes over again.
        self.last_self_poll.store(0, Ordering::SeqCst);
        if self.poller_napping.load(Ordering::SeqCst) {
            self.unpark_poller();
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Makes the poller run its timers by `at`.
    pub(crate) fn wake_by(&self, at: Instant) {
        let at = self.nanos(at);
        self.timer_hint.fetch_min(at, Ordering::SeqCst);
        let planned = self.planned_wake.load(Ordering::SeqCst);
        if planned != 0 && at < planned {
            self.cq.interrupt();
            self.unpark_poller();
        }
    }

    /// Runs the role's timers if due (or if someone asked); returns the next tick.
    fn tick(&self, next_tick: Instant, now: Instant) -> Instant {
        let hint = self.timer_hint.load(Ordering::SeqCst);
        if now < next_tick && self.nanos(now) < hint {
            return next_tick.min(self.epoch + Duration::from_nanos(hint));
        }
        self.timer_hint.store(u64::MAX, Ordering::SeqCst);
        self.role
            .on_tick(self, now)
            .unwrap_or(now + Duration::from_secs(3600))
    }

    /// The poll state, unless another thread holds it (a poisoned lock is
    /// taken over: its state stays consistent between turns).
    fn try_poll_state(&self) -> Option<MutexGuard<'_, PollState<F>>> {
        match self.poll.try_lock() {
            Ok(st) => Some(st),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Polls the completion queue once and handles what it held; returns
    /// how many completions that was.
    fn turn(self: &Arc<Self>, st: &mut PollState<F>) -> usize {
        let PollState {
            batch,
            touched,
            consumed_recvs,
        } = st;
        batch.clear();
        let n = self.cq.poll(batch, POLL_BATCH);
        let _in_turn = InTurn::enter();
        if n == 0 {
            if *consumed_recvs > 0 && self.replenish(*consumed_recvs).is_ok() {
                *consumed_recvs = 0;
            }
            return 0;
        }
        for c in batch.iter() {
            if let CompletionKind::RecvImm { .. } = c.kind {
                *consumed_recvs += 1;
            }
            self.handle(c, touched);
        }
        for conn in touched.drain(..) {
            conn.after_batch();
            if let Some(why) = conn.take_failure() {
                self.close(&conn, &why);
            }
        }
        // Keep the SRQ stocked well above what is in flight.
        if *consumed_recvs >= self.config.srq_depth / 4 {
            match self.replenish(*consumed_recvs) {
                Ok(()) => *consumed_recvs = 0,
                Err(e) => {
                    tracing::error!(error = %e, "cannot replenish the shared receive queue")
                }
            }
        }
        n
    }

    /// Handles completions on the calling thread until `done()` holds or
    /// none came for the spin time; returns `done()`. Meanwhile the poller
    /// thread naps instead of competing for the queue. One caller polls at
    /// a time: if another already does, returns at once.
    ///
    /// `others_waiting()` tells, once the last polling caller stops, whether
    /// anyone else still needs completions handled: then the poller thread
    /// is woken to take over.
    pub(crate) fn poll_until(
        self: &Arc<Self>,
        spin: Duration,
        done: impl Fn() -> bool,
        others_waiting: impl FnOnce() -> bool,
    ) -> bool {
        let prior = self.callers_polling.fetch_add(1, Ordering::SeqCst);
        let counted = PollingCaller(&self.callers_polling);
        if prior > 0 {
            // Another caller polls, and completes this call too: spinning
            // alongside it would only take a core from it.
            return done();
        }
        let spin = self.call_waits.budget(spin);
        let mut idle_since = None;
        let mut spins = 0u32;
        let finished = loop {
            if done() {
                break true;
            }
            if self.stop.load(Ordering::Acquire) {
                break false;
            }
            let progress = self.try_poll_state().map_or(0, |mut st| self.turn(&mut st));
            if progress > 0 {
                idle_since = None;
                continue;
            }
            if spins % 16 == 0 {
                let now = Instant::now();
                if now.duration_since(*idle_since.get_or_insert(now)) >= spin {
                    break done();
                }
            }
            spin_pause(&mut spins);
        };
        // A caller that got its response is likely to make the next call
        // soon (a synchronous loop): the poller keeps napping meanwhile
        // instead of arming the queue and being woken by that call's
        // response, which its caller handles anyway.
        self.last_self_poll
            .store(self.nanos(Instant::now()).max(1), Ordering::SeqCst);
        let last = counted.leave();
        if last && (!finished || others_waiting()) {
            self.ensure_polled();
        }
        finished
    }

    /// Turns the queue once on the calling thread if nobody else is turning
    /// it, for a caller's future that checks on its response (see
    /// `UnaryCall`'s `poll`); returns whether it did. While futures do this,
    /// the poller thread naps instead of competing with them.
    pub(crate) fn try_progress(self: &Arc<Self>) -> bool {
        let Some(mut st) = self.try_poll_state() else {
            return false;
        };
        self.last_self_poll
            .store(self.nanos(Instant::now()).max(1), Ordering::SeqCst);
        self.turn(&mut st);
        true
    }

    /// Runs the tasks woken since last time; returns how many ran.
    fn run_tasks(&self) -> usize {
        self.exec.as_ref().map_or(0, |e| e.run_woken())
    }

    /// The poller: run to completion what the queue brings, spin briefly on
    /// an empty queue, then block. While a caller polls in its place, nap.
    pub(crate) fn run(self: &Arc<Self>) {
        let _ = self.poller.set(std::thread::current());
        if let Some(exec) = &self.exec {
            exec.enter();
        }
        let mut idle_since: Option<Instant> = None;
        // When the queue last went empty after work, across sleeps.
        let mut gap_start: Option<Instant> = None;
        let mut next_tick = Instant::now();
        let mut spins = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            self.flush_corked();
            let self_polled = || {
                let last = self.last_self_poll.load(Ordering::SeqCst);
                last != 0
                    && self.nanos(Instant::now()).saturating_sub(last)
                        < SELF_POLL_NAP.as_nanos() as u64 * 4
            };
            if self.callers_polling.load(Ordering::SeqCst) > 0 || self_polled() {
                // Say so, then look once more: the last caller (or future)
                // may have stopped before it could see the flag.
                self.poller_napping.store(true, Ordering::SeqCst);
                let callers = self.callers_polling.load(Ordering::SeqCst) > 0;
                if callers || self_polled() {
                    let now = Instant::now();
                    next_tick = self.tick(next_tick, now);
                    let cap = if callers {
                        CALLER_POLL_NAP
                    } else {
                        SELF_POLL_NAP
                    };
                    let nap = next_tick
                        .saturating_duration_since(now)
                        .clamp(Duration::from_micros(20), cap);
                    self.planned_wake
                        .store(self.nanos(now + nap).max(1), Ordering::SeqCst);
                    // A timer asked for before `planned_wake` was set did not
                    // unpark: look once more.
                    let hint = self.timer_hint.load(Ordering::SeqCst);
                    if self.epoch + Duration::from_nanos(hint) > now + nap {
                        std::thread::park_timeout(nap);
                    }
                    self.planned_wake.store(0, Ordering::SeqCst);
                }
                self.poller_napping.store(false, Ordering::SeqCst);
                idle_since = None;
                gap_start = None;
                self.run_tasks();
                continue;
            }
            let Some(mut st) = self.try_poll_state() else {
                // A caller finishing its last turn: it lets go at once.
                spin_pause(&mut spins);
                continue;
            };
            let found = self.turn(&mut st);
            drop(st);
            if found + self.run_tasks() > 0 {
                idle_since = None;
                let now = Instant::now();
                if let Some(start) = gap_start.take() {
                    self.idle_gaps.record(now.duration_since(start));
                }
                next_tick = self.tick(next_tick, now);
                continue;
            }
            // Spinning: read the clock only now and then.
            if idle_since.is_some() && spins % 16 != 0 {
                spin_pause(&mut spins);
                continue;
            }
            let now = Instant::now();
            next_tick = self.tick(next_tick, now);
            let idle = *idle_since.get_or_insert(now);
            gap_start.get_or_insert(now);
            if now.duration_since(idle) < self.idle_gaps.budget(self.config.spin) {
                spin_pause(&mut spins);
                continue;
            }
            // Arm, look once more (what came before arming would not end
            // the wait), then sleep without holding the queue, so a caller
            // can take it meanwhile.
            let Some(mut st) = self.try_poll_state() else {
                continue;
            };
            self.cq.arm();
            let found = self.turn(&mut st);
            drop(st);
            if found > 0 || self.exec.as_ref().is_some_and(|e| e.has_woken()) {
                idle_since = None;
                continue;
            }
            self.planned_wake
                .store(self.nanos(next_tick).max(1), Ordering::SeqCst);
            // A timer asked for after the tick above but before `planned_wake`
            // was set did not interrupt: look once more before sleeping.
            let hint = self.timer_hint.load(Ordering::SeqCst);
            let next_tick = next_tick.min(self.epoch + Duration::from_nanos(hint));
            let sleep = next_tick.saturating_duration_since(now);
            if !sleep.is_zero() && self.callers_polling.load(Ordering::SeqCst) == 0 {
                self.asleep.store(true, Ordering::SeqCst);
                self.flush_corked();
                self.cq.wait(Some(sleep.min(Duration::from_secs(1))));
                self.asleep.store(false, Ordering::SeqCst);
            }
            self.planned_wake.store(0, Ordering::SeqCst);
            idle_since = None;
        }
        if let Some(exec) = &self.exec {
            exec.clear();
        }
    }

    fn handle(self: &Arc<Self>, c: &Completion, touched: &mut Vec<Arc<Conn<F>>>) {
        let Some(conn) = self.conn(c.qp_num) else {
            tracing::trace!(qp_num = c.qp_num, ?c.status, "completion for a closed connection");
            return;
        };
        if c.status != WcStatus::Success {
            let why = match c.status {
                WcStatus::RetryExceeded => {
                    "peer closed the connection or is unreachable".to_owned()
                }
                WcStatus::RemoteAccess => "remote access error (bad rkey or bounds)".to_owned(),
                WcStatus::RnrRetryExceeded => {
                    "peer not ready to receive (RNR retries exhausted)".to_owned()
                }
                WcStatus::DeviceError { event } => {
                    format!("RDMA device error (async event {event})")
                }
                s => format!("completion error {s:?}"),
            };
            self.close(&conn, &why);
            return;
        }
        match c.kind {
            CompletionKind::Send => conn.on_send_completion(c.wr_id),
            CompletionKind::RecvImm { imm, byte_len } => {
                // Writes this batch causes (responses of inline handlers,
                // credits, the backlog) are posted together after it.
                if !touched.iter().any(|t| Arc::ptr_eq(t, &conn)) {
                    conn.begin_batch();
                    touched.push(conn.clone());
                }
                match conn.on_doorbell(imm, byte_len, conn.max_message) {
                    Ok(Some(frame)) => self.role.on_frame(self, &conn, frame),
                    Ok(None) => {}
                    Err(why) => {
                        tracing::warn!(qp_num = conn.qp_num, peer = %conn.peer_addr, %why, "closing connection: protocol violation");
                        self.close(&conn, &why);
                    }
                }
            }
        }
    }
}

/// A write staged while the poller handles a batch, posted with the others
/// at the end of it.
struct StagedWrite {
    local: Option<(usize, usize)>,
    imm: u32,
    wr_id: u64,
    signaled: bool,
}

/// Most writes posted as one batch.
const MAX_POST_BATCH: usize = 64;

thread_local! {
    /// Whether this thread is handling a batch of completions: only its
    /// writes are staged (another thread's could wait on a batch that
    /// already ended).
    static IN_TURN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as handling a batch while it lives; restores what was
/// there before (a turn may nest: an inline handler's own blocking call).
struct InTurn(bool);

impl InTurn {
    fn enter() -> InTurn {
        InTurn(IN_TURN.replace(true))
    }
}

impl Drop for InTurn {
    fn drop(&mut self) {
        IN_TURN.set(self.0);
    }
}

/// Counts a caller in `callers_polling` while it lives, so that a panic in
/// a turn (a waker's, say) cannot leave the count up and the poller napping.
struct PollingCaller<'a>(&'a AtomicUsize);

impl PollingCaller<'_> {
    /// Stops counting; true if this was the last polling caller.
    fn leave(self) -> bool {
        let last = self.0.fetch_sub(1, Ordering::SeqCst) == 1;
        std::mem::forget(self);
        last
    }
}

impl Drop for PollingCaller<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Frames waiting for ring (or send-queue) space, fully encoded.
struct Backlog {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
}

struct SendState<F: Fabric> {
    qp: Option<F::Qp>,
    staging: F::Region,
    ring: SendRing,
    credits: CreditReturn,
    backlog: Backlog,
    /// Writes posted, and the last one known complete (send-queue accounting).
    posted: u64,
    completed: u64,
    sq_depth: u64,
    dead: Option<String>,
    /// While the poller handles a batch of completions for this connection,
    /// writes are staged here and posted together after it.
    batching: bool,
    /// A caller's request is staged, to go out with the requests other
    /// callers issue meanwhile (see [`Conn::send_corked`]).
    corked: bool,
    staged: Vec<StagedWrite>,
}

/// Why a frame could not be sent.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The connection is gone.
    Closed(String),
    /// The frame can never fit (larger than the peer accepts).
    TooLarge { len: usize, max: usize },
    /// Ring full and the caller asked not to wait, or the backlog is full.
    Full(&'static str),
    /// Metadata larger than a frame can carry.
    Metadata(usize),
}

impl From<SendError> for Status {
    fn from(e: SendError) -> Status {
        match e {
            SendError::Closed(why) => Status::unavailable(format!("connection closed: {why}")),
            SendError::TooLarge { len, max } => Status::resource_exhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {max} bytes"
            )),
            SendError::Full(why) => Status::resource_exhausted(why),
            SendError::Metadata(len) => Status::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {} bytes",
                crate::metadata::MAX_ENCODED_LEN
            )),
        }
    }
}

/// A frame to send: everything but the ack, which is stamped at posting.
pub(crate) struct OutFrame<'a> {
    pub kind: FrameKind,
    pub call_id: CallId,
    pub method_id: u32,
    pub status: u16,
    pub timeout_us: u32,
    pub metadata: Option<&'a Metadata>,
    pub payload_len: usize,
}

/// One connection: its queue pair, its receive ring and the peer's.
pub(crate) struct Conn<F: Fabric> {
    pub qp_num: u32,
    pub peer_addr: String,
    peer: PeerRing,
    recv_region: F::Region,
    recv: Mutex<RecvRing>,
    send: Mutex<SendState<F>>,
    failure: Mutex<Option<String>>,
    max_backlog: usize,
    /// Receives posted for this connection (see [`Endpoint::add`]).
    recvs: u32,
    /// Largest message (metadata + payload) accepted from the peer.
    max_message: usize,
    /// Responses that named no live call of this connection.
    stale: AtomicU64,
    /// Buffers incoming messages are copied into, for reuse.
    buffers: Mutex<Vec<Vec<u8>>>,
}

/// The queue pair goes first, whatever path drops a connection: the device
/// must stop using the rings and staging area before they are deregistered.
impl<F: Fabric> Drop for Conn<F> {
    fn drop(&mut self) {
        let send = self.send.get_mut().unwrap_or_else(|e| e.into_inner());
        send.qp = None;
    }
}

impl<F: Fabric> Conn<F> {
    /// `c` comes last so that, on an error return, the queue pair it holds is
    /// dropped before the regions (parameters drop in reverse order).
    fn new(
        recv_region: F::Region,
        staging: F::Region,
        max_backlog: usize,
        c: Connected<F::Qp>,
    ) -> Result<Conn<F>, Status> {
        let cap = recv_region.len();
        let ring_err = |e: crate::protocol::RingError| Status::internal(format!("ring: {e}"));
        let peer_cap =
            usize::try_from(c.peer.len).map_err(|_| Status::internal("peer ring too large"))?;
        if staging.len() < peer_cap {
            return Err(Status::resource_exhausted(format!(
                "peer ring of {peer_cap} bytes is larger than the local staging area of {} bytes",
                staging.len()
            )));
        }
        let sq_depth = c.qp.send_queue_depth() as u64;
        Ok(Conn {
            qp_num: c.qp.qp_num(),
            peer_addr: c.peer_addr,
            peer: c.peer,
            recv: Mutex::new(RecvRing::new(cap).map_err(ring_err)?),
            recv_region,
            send: Mutex::new(SendState {
                qp: Some(c.qp),
                staging,
                ring: SendRing::new(peer_cap).map_err(ring_err)?,
                credits: CreditReturn::new(cap),
                backlog: Backlog {
                    frames: VecDeque::new(),
                    bytes: 0,
                },
                posted: 0,
                completed: 0,
                sq_depth,
                dead: None,
                batching: false,
                corked: false,
                staged: Vec::with_capacity(MAX_POST_BATCH),
            }),
            failure: Mutex::new(None),
            max_backlog,
            recvs: 0,
            max_message: 0,
            stale: AtomicU64::new(0),
            buffers: Mutex::new(Vec::new()),
        })
    }

    fn send_state(&self) -> MutexGuard<'_, SendState<F>> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The largest message the peer accepts.
    pub(crate) fn peer_max_message(&self) -> usize {
        self.peer.max_message as usize
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.send_state().dead.is_none()
    }

    /// Why the connection died, if it did.
    pub(crate) fn death(&self) -> Option<String> {
        self.send_state().dead.clone()
    }

    /// Counts a response that named no live call of this connection.
    pub(crate) fn note_stale(&self) {
        self.stale.fetch_add(1, Ordering::Relaxed);
    }

    /// Responses that named no live call of this connection.
    pub(crate) fn stale_responses(&self) -> u64 {
        self.stale.load(Ordering::Relaxed)
    }

    /// Tells the handshake's last message (server side) once registered.
    pub(crate) fn established(&self) -> Result<(), Status> {
        let mut s = self.send_state();
        match s.qp.as_mut() {
            Some(qp) => qp.established().map_err(Status::from),
            None => Err(Status::unavailable("connection closed during set-up")),
        }
    }

    /// Destroys the queue pair (the peer sees it) and drops queued frames.
    pub(crate) fn kill(&self, why: &str) {
        let mut s = self.send_state();
        if s.dead.is_none() {
            s.dead = Some(why.to_owned());
        }
        s.backlog.frames.clear();
        s.backlog.bytes = 0;
        s.staged.clear();
        s.batching = false;
        s.qp = None;
    }

    fn set_failure(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(why);
        }
    }

    fn take_failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Encodes and posts a frame, or queues it if the peer's ring is full.
    /// `fill` writes exactly `frame.payload_len` payload bytes.
    pub(crate) fn send(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        self.send_with(frame, fail_fast, false, fill).map(drop)
    }

    /// Like [`Conn::send`], but the write may stay staged until
    /// [`Conn::uncork`] (or a full batch, or a turn of the dispatcher that
    /// touches this connection): requests that callers issue back to back
    /// then leave in one post, one vectored write on tcp://. Returns whether
    /// this write corked the connection: then hand it to
    /// [`Endpoint::corked`], so that it leaves even if nobody uncorks it.
    pub(crate) fn send_corked(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_with(frame, fail_fast, true, fill)
    }

    /// Posts the writes [`Conn::send_corked`] left staged.
    pub(crate) fn uncork(&self) {
        let mut s = self.send_state();
        if s.corked {
            s.corked = false;
            if !(s.batching && IN_TURN.get()) {
                self.post_staged(&mut s);
            }
        }
    }

    /// Whether writes wait for [`Conn::uncork`].
    pub(crate) fn is_corked(&self) -> bool {
        self.send_state().corked
    }

    fn send_with(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let md_len = frame.metadata.map_or(0, Metadata::encoded_len);
        if md_len > crate::metadata::MAX_ENCODED_LEN {
            return Err(SendError::Metadata(md_len));
        }
        let body = md_len + frame.payload_len;
        if body > self.peer_max_message() {
            return Err(SendError::TooLarge {
                len: body,
                max: self.peer_max_message(),
            });
        }
        let len = HEADER_LEN + body;
        let header = Header {
            kind: frame.kind,
            status: frame.status,
            method_id: frame.method_id,
            call_id: frame.call_id,
            payload_len: frame.payload_len as u32,
            metadata_len: md_len as u16,
            timeout_us: frame.timeout_us,
            ack: 0,
        };
        let mut write = |buf: &mut [u8], ack: u32| {
            let mut h = header;
            h.ack = ack;
            h.encode((&mut buf[..HEADER_LEN]).try_into().expect("header slice"));
            if let Some(md) = frame.metadata {
                md.encode(&mut buf[HEADER_LEN..HEADER_LEN + md_len]);
            }
            fill(&mut buf[HEADER_LEN + md_len..]);
        };
        let mut s = self.send_state();
        if let Some(why) = &s.dead {
            return Err(SendError::Closed(why.clone()));
        }
        if s.backlog.frames.is_empty() && s.sq_room() {
            match s.ring.reserve(len) {
                Ok(Some(slot)) => {
                    let ack = s.credits.take_ack();
                    s.staging.write(slot.offset, len, |buf| write(buf, ack));
                    let was_corked = s.corked;
                    if cork {
                        s.corked = true;
                    }
                    self.post(&mut s, slot.offset, len);
                    return Ok(s.corked && !was_corked);
                }
                Ok(None) => {}
                Err(_) => {
                    return Err(SendError::TooLarge {
                        len: body,
                        max: s.ring.max_frame() - HEADER_LEN,
                    });
                }
            }
        }
        if fail_fast {
            return Err(SendError::Full(
                "the peer's receive ring is full (fail-fast call)",
            ));
        }
        if s.backlog.bytes + len > self.max_backlog {
            return Err(SendError::Full(
                "too many bytes queued for the peer's full receive ring",
            ));
        }
        let mut bytes = vec![0u8; len];
        write(&mut bytes, 0);
        s.backlog.bytes += len;
        s.backlog.frames.push_back(bytes);
        Ok(false)
    }

    /// Posts the frame staged at `offset`. Marks the connection failed on error.
    fn post(&self, s: &mut SendState<F>, offset: usize, len: usize) {
        let imm = Doorbell::Frame {
            offset_units: (offset / ALIGN) as u32,
        }
        .encode();
        self.post_write(s, Some((offset, len)), imm, false);
    }

    /// Posts a write, or stages it while the poller handles a batch; returns
    /// its work request id. It is signaled if `signal`, and anyway one in
    /// [`SIGNAL_EVERY`].
    fn post_write(
        &self,
        s: &mut SendState<F>,
        local: Option<(usize, usize)>,
        imm: u32,
        signal: bool,
    ) -> u64 {
        s.posted += 1;
        let wr_id = s.posted;
        s.staged.push(StagedWrite {
            local,
            imm,
            wr_id,
            signaled: signal || wr_id % SIGNAL_EVERY as u64 == 0,
        });
        let held = s.corked || (s.batching && IN_TURN.get());
        if !held || s.staged.len() >= MAX_POST_BATCH {
            self.post_staged(s);
        }
        wr_id
    }

    /// Posts a credit doorbell carrying the current ack; returns its id.
    fn post_credit(&self, s: &mut SendState<F>, signal: bool) -> u64 {
        let ack = s.credits.take_ack();
        self.post_write(s, None, Doorbell::Credit { ack }.encode(), signal)
    }

    /// Posts the staged writes, in order, as one batch.
    fn post_staged(&self, s: &mut SendState<F>) {
        s.corked = false;
        if s.staged.is_empty() {
            return;
        }
        let SendState {
            qp,
            staging,
            staged,
            ..
        } = s;
        let peer = self.peer;
        let result = match qp.as_mut() {
            Some(qp) => qp
                .post_write_imm_batch(staged.len(), |i| {
                    let w = &staged[i];
                    WriteImm {
                        wr_id: w.wr_id,
                        local: w.local.map(|(off, len)| (&*staging, off, len)),
                        remote_addr: peer.addr + w.local.map_or(0, |(off, _)| off as u64),
                        rkey: peer.rkey,
                        imm: w.imm,
                        signaled: w.signaled,
                    }
                })
                .map_err(|e| e.to_string()),
            None => Err("queue pair destroyed".to_owned()),
        };
        staged.clear();
        if let Err(why) = result {
            s.dead.get_or_insert_with(|| why.clone());
            self.set_failure(why);
        }
    }

    /// The poller starts handling a batch of completions for this connection:
    /// writes are staged until [`Conn::after_batch`].
    fn begin_batch(&self) {
        self.send_state().batching = true;
    }

    fn on_send_completion(&self, wr_id: u64) {
        let mut s = self.send_state();
        s.completed = s.completed.max(wr_id);
        self.flush(&mut s);
    }

    /// Handles a doorbell. `Ok(Some)` is a frame for the role; `Err` a protocol violation.
    fn on_doorbell(
        &self,
        imm: u32,
        byte_len: u32,
        max_message: usize,
    ) -> Result<Option<Frame>, String> {
        match Doorbell::decode(imm) {
            None => Err(format!("invalid immediate {imm:#010x}")),
            Some(Doorbell::Credit { ack }) => {
                let mut s = self.send_state();
                apply_ack(&mut s.ring, ack).map_err(|e| format!("bad credit: {e}"))?;
                self.flush(&mut s);
                Ok(None)
            }
            Some(Doorbell::Frame { offset_units }) => {
                let mut recv = self.recv.lock().unwrap_or_else(|e| e.into_inner());
                let slot = recv.locate(offset_units).map_err(|e| e.to_string())?;
                let room = recv.room_at(slot);
                if room < HEADER_LEN {
                    return Err(format!(
                        "frame at offset {} has no room for a header",
                        slot.offset
                    ));
                }
                let mut raw = [0u8; HEADER_LEN];
                self.recv_region.copy_to(slot.offset, &mut raw);
                let header = Header::decode(&raw).map_err(|e| format!("bad frame header: {e}"))?;
                let len = header.frame_len();
                let body = len - HEADER_LEN;
                if body > max_message {
                    return Err(format!(
                        "frame body of {body} bytes exceeds the limit of {max_message}"
                    ));
                }
                if len > room {
                    return Err(format!(
                        "frame of {len} bytes at offset {} runs past the ring",
                        slot.offset
                    ));
                }
                if byte_len != 0 && byte_len as usize != len {
                    return Err(format!(
                        "write of {byte_len} bytes carries a frame of {len}"
                    ));
                }
                let md_len = header.metadata_len as usize;
                let metadata = if md_len == 0 {
                    Some(Metadata::new())
                } else {
                    self.recv_region
                        .read(slot.offset + HEADER_LEN, md_len, Metadata::decode)
                };
                let mut payload = self.take_buffer();
                payload.resize(body - md_len, 0);
                self.recv_region
                    .copy_to(slot.offset + HEADER_LEN + md_len, &mut payload);
                recv.consume(slot, len).map_err(|e| e.to_string())?;
                let consumed = recv.consumed();
                drop(recv);
                let mut s = self.send_state();
                s.credits.on_consumed(consumed);
                apply_ack(&mut s.ring, header.ack).map_err(|e| format!("bad credit: {e}"))?;
                drop(s);
                Ok(Some(Frame {
                    header,
                    metadata,
                    payload,
                }))
            }
        }
    }

    /// After a batch of frames: return credits if needed, flush the backlog,
    /// and post everything staged meanwhile.
    fn after_batch(&self) {
        let mut s = self.send_state();
        self.flush(&mut s);
        // A quarter of the ring unreported, or few bytes that still block a
        // sender whose next frame must wrap: either way, nothing may be
        // flowing back to carry the ack, so send it alone.
        if (s.credits.needs_explicit() || s.credits.may_stall_sender()) && s.dead.is_none() {
            self.post_credit(&mut s, false);
        }
        s.batching = false;
        if s.dead.is_none() {
            self.post_staged(&mut s);
        } else {
            s.staged.clear();
        }
    }

    /// Posts queued frames while the peer's ring and the send queue have room.
    fn flush(&self, s: &mut SendState<F>) {
        while s.dead.is_none() && s.sq_room() {
            let Some(len) = s.backlog.frames.front().map(Vec::len) else {
                break;
            };
            let Ok(Some(slot)) = s.ring.reserve(len) else {
                break;
            };
            let bytes = s.backlog.frames.pop_front().expect("front exists");
            s.backlog.bytes -= len;
            let ack = s.credits.take_ack();
            s.staging.write(slot.offset, len, |buf| {
                buf.copy_from_slice(&bytes);
                buf[28..32].copy_from_slice(&ack.to_le_bytes());
            });
            self.post(s, slot.offset, len);
        }
    }

    /// A buffer for an incoming message, reused if one was given back.
    fn take_buffer(&self) -> Vec<u8> {
        let mut buf = self
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.clear();
        buf
    }

    /// Gives back a buffer that held an incoming message, once decoded.
    pub(crate) fn recycle(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > MAX_POOLED_BUFFER {
            return;
        }
        let mut pool = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < MAX_POOLED_BUFFERS {
            pool.push(buf);
        }
    }

    /// Posts a signaled credit doorbell and returns its work request id, or
    /// `None` if it cannot be posted now (send queue full) or the connection
    /// is dead. Once that write completes, every write posted before it has
    /// executed: a reliable connection completes writes in order.
    pub(crate) fn post_fence(&self) -> Option<u64> {
        let mut s = self.send_state();
        if s.dead.is_some() || !s.sq_room() {
            return None;
        }
        let wr_id = self.post_credit(&mut s, true);
        // Staged by a batch under way on this thread? Post it now anyway.
        self.post_staged(&mut s);
        Some(wr_id)
    }

    /// Whether the write `wr_id` (and so every one before it) completed, or
    /// the connection died: either way nothing is left to wait for.
    pub(crate) fn completed_through(&self, wr_id: u64) -> bool {
        let s = self.send_state();
        s.dead.is_some() || s.completed >= wr_id
    }

    /// Whether frames wait to be posted: queued for the peer's ring, or
    /// staged until the batch being handled ends.
    pub(crate) fn has_unsent(&self) -> bool {
        let s = self.send_state();
        s.backlog.bytes > 0 || !s.staged.is_empty()
    }
}

impl<F: Fabric> SendState<F> {
    /// Room in the send queue for one more write (keeps one for a credit).
    fn sq_room(&self) -> bool {
        self.posted - self.completed + 2 < self.sq_depth
    }
}

/// The number of CPUs this process may use (at least 1): the default
/// number of dispatchers, for servers and for the client runtime.
pub(crate) fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// Encodes `message` into a buffer of exactly its encoded length.
pub(crate) fn encode_exact(message: &impl prost::Message, mut buf: &mut [u8]) {
    message.encode_raw(&mut buf);
    debug_assert!(buf.is_empty(), "encoded_len disagreed with encode");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_spin_covers_short_waits_only() {
        let base = Duration::from_micros(50);
        let spin = AdaptiveSpin::default();
        assert_eq!(spin.budget(base), base, "no history: the configured spin");
        for _ in 0..64 {
            spin.record(Duration::from_micros(200));
        }
        let b = spin.budget(base);
        assert!(
            b > Duration::from_micros(300) && b <= Duration::from_micros(400),
            "short waits: spin about twice as long, got {b:?}"
        );
        for _ in 0..64 {
            spin.record(Duration::from_millis(20));
        }
        assert_eq!(
            spin.budget(base),
            base,
            "long waits: back to the configured spin"
        );
        let long_base = Duration::from_millis(5);
        assert_eq!(
            spin.budget(long_base),
            long_base,
            "never below the configured spin"
        );
    }
}
