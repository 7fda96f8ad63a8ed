//! The dispatcher: each turns its own completion queue and maps each
//! completion to its connection (by `qp_num`) and each frame to the pending
//! call or the handler; connections own the send path.

mod config;
mod conn;
#[cfg(feature = "testing")]
pub(crate) use conn::READS_POSTED;
pub(crate) mod handoff;
mod spin;
mod srq;
pub(crate) mod wake;

pub(crate) use config::Config;
#[cfg(feature = "grpc")]
pub(crate) use config::DEFAULT_MAX_MESSAGE;
pub use config::{DEFAULT_HEARTBEAT, MIN_HEARTBEAT, heartbeat_bound};
pub(crate) use conn::staging_limit;
pub(crate) use conn::{Conn, LendBuf, Link, OutFrame, send_control};
use handoff::PollHandoff;
pub(crate) use spin::{AdaptiveSpin, future_spin_yield};
use spin::{POLL_NAP, crowded_pause, spin_pause};
use srq::SrqProvision;
use wake::Corked;

use crate::executor::Executor;
use crate::fabric::{
    Completion, CompletionKind, CompletionQueue, Connected, Fabric, QueuePair, Region, WcStatus,
};
use crate::idmap::IdMap;
use crate::protocol::{ALIGN, HEADER_LEN, Header};
use crate::{Metadata, Status};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Completions taken from the CQ per poll.
const POLL_BATCH: usize = 64;
/// Receives consumed before a turn that finds nothing restocks the shared
/// receive queue (a busy one restocks at a quarter of its depth, and a
/// poller about to sleep restocks whatever it owes). Restocking after
/// every idle turn made each message of a lone call move the queue's count
/// between the threads that post receives and the peer's writes consuming
/// them; the depth posted with the dispatcher covers what is owed.
const IDLE_RESTOCK: u32 = 64;
/// A decoded incoming frame, copied out of the ring.
#[derive(Debug)]
pub(crate) struct Frame {
    pub header: Header,
    pub metadata: Option<Metadata>,
    pub payload: crate::payload::Payload,
}

impl Frame {
    /// The status an `Error` frame carries.
    pub(crate) fn error_status(&self) -> Status {
        let message = String::from_utf8_lossy(&self.payload).into_owned();
        Status::from_wire(
            crate::Code::from_u16(self.header.status),
            message,
            self.metadata.as_ref(),
        )
    }
}

/// What a context does with frames: answer calls (client) or run handlers (server).
pub(crate) trait Role<F: Fabric>: Send + Sync + Sized + 'static {
    /// A well-formed frame arrived on `conn`.
    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame);
    /// `conn` failed or closed.
    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str);
    /// Timers: called when the poller wakes; returns when next to wake.
    fn on_tick(&self, ep: &Endpoint<F, Self>, now: Instant) -> Option<Instant>;
    /// Which end of its connections this role is (for metrics).
    const SIDE: crate::observe::Side;
    /// Whether a frame whose payload `conn`'s peer lent is worth reading:
    /// not if its call is over (the frame would be dropped once read).
    fn wants_lent(&self, _conn: &Arc<Conn<F>>, _header: &Header) -> bool {
        true
    }
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
/// others still wait (see [`PollHandoff`]).
pub(crate) struct Endpoint<F: Fabric, R> {
    pub fabric: F,
    /// This dispatcher's completion queue: its connections report here.
    pub cq: F::Cq,
    pub config: Config,
    /// The tasks of handlers that wait (servers only).
    pub(crate) exec: Option<Arc<Executor>>,
    pub role: R,
    conns: RwLock<IdMap<Arc<Conn<F>>>>,
    /// The poll state, who holds it, and the poller's naps.
    poll: PollHandoff<PollState<F>>,
    /// How long the poller thread waited for work after going idle.
    pub(crate) idle_gaps: AdaptiveSpin,
    /// How long callers waited for their responses.
    pub(crate) call_waits: AdaptiveSpin,
    stop: AtomicBool,
    /// When the poller plans to wake (ns since `epoch`; 0 while awake).
    planned_wake: AtomicU64,
    /// The earliest timer others asked for since the last tick (ns since `epoch`).
    timer_hint: AtomicU64,
    /// When the next heartbeat tick of a connection is due (ns since
    /// `epoch`; `u64::MAX`: none).
    next_heartbeat: AtomicU64,
    epoch: Instant,
    /// What this dispatcher owes the shared receive queue.
    srq: SrqProvision,
    /// Connections handled by this dispatcher.
    load: AtomicUsize,
    /// Connections whose writes wait for an uncork ([`Conn::send_corked`]):
    /// the poller flushes them on its next turn, so a request leaves even if
    /// its call is never polled, and they flush themselves while it sleeps.
    corked: Corked<Arc<Conn<F>>>,
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
                poll: PollHandoff::new(PollState {
                    batch: Vec::with_capacity(POLL_BATCH),
                    touched: Vec::new(),
                    consumed_recvs: 0,
                }),
                idle_gaps: AdaptiveSpin::default(),
                call_waits: AdaptiveSpin::default(),
                stop: AtomicBool::new(false),
                planned_wake: AtomicU64::new(0),
                timer_hint: AtomicU64::new(u64::MAX),
                next_heartbeat: AtomicU64::new(u64::MAX),
                epoch: Instant::now(),
                srq: SrqProvision::default(),
                load: AtomicUsize::new(0),
                corked: Corked::new(),
            }
        }))
    }

    /// Connections this dispatcher handles.
    pub(crate) fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }

    /// Registers the receive ring of a new connection, `len` bytes.
    pub(crate) fn register_ring(&self, len: usize) -> Result<F::Region, Status> {
        Ok(self.fabric.register(len, true)?)
    }

    /// Adds a connected queue pair; from now on its completions are dispatched.
    ///
    /// Frames are staged in half as many bytes as the peer's ring, whose
    /// size the peer chose (see [`Staging`](crate::protocol::Staging)): the
    /// staging area is registered here, once that size is known. Each side
    /// stages for at most [`staging_limit`] of its own ring, so each direction uses
    /// `min(receiver's ring, sender's staging limit)` of the receiver's
    /// ring (see [`ring_shares`]): both sides compute the same from the two
    /// hellos, and any two sides can talk, each message limited by what
    /// its direction holds.
    ///
    /// `max_message` is the largest message accepted on it.
    pub(crate) fn add(
        &self,
        mut c: Connected<F::Qp>,
        recv: F::Region,
        max_message: usize,
    ) -> Result<Arc<Conn<F>>, Status> {
        let peer_ring = usize::try_from(c.peer.len)
            .map_err(|_| Status::resource_exhausted("peer ring too large"))?;
        let (recv_cap, send_cap) = ring_shares(recv.len(), peer_ring);
        // What fits in half of each direction's share.
        let largest = |cap: usize| cap / 2 - HEADER_LEN;
        c.peer.len = send_cap as u64;
        let staging = self
            .fabric
            .register(crate::protocol::staging_size(send_cap), false)?;
        let recvs = SrqProvision::for_connection(recv_cap, send_cap)?;
        let lends = c.qp.lends();
        if !lends {
            c.peer.max_message = c.peer.max_message.min(largest(send_cap) as u32);
        }
        let mut conn = Conn::new(
            self.fabric.clone(),
            recv,
            recv_cap,
            staging,
            self.config.max_backlog,
            c,
        )?;
        conn.recvs = recvs;
        conn.side = R::SIDE;
        if lends {
            conn.max_message = max_message;
            conn.lend_above = self.config.lend_above.min(largest(send_cap));
        } else {
            conn.max_message = max_message.min(largest(recv_cap));
        }
        self.fabric.post_recv(recvs)?;
        let conn = Arc::new(conn);
        self.conns
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn.qp_num, conn.clone());
        self.load.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(qp_num = conn.qp_num, peer = %conn.remote.addr, "connection established");
        Ok(conn)
    }

    /// `conn` beats every `every` when idle (see [`Conn::heartbeat_tick`]),
    /// from now: once the peer may receive (after the server's hello).
    /// Starts `conn`'s heartbeat; a server's (`after_peer`) beats only once
    /// its client has written to it.
    pub(crate) fn start_heartbeat(&self, conn: &Conn<F>, every: Duration, after_peer: bool) {
        let at = conn.start_heartbeat(every, after_peer, Instant::now());
        self.next_heartbeat
            .fetch_min(self.nanos(at), Ordering::SeqCst);
        self.wake_by(at);
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
            self.srq.returned(conn.recvs);
            self.role.on_lost(conn, why);
        }
    }

    /// Closes the connection whose completion the poller panicked on.
    fn close_after_panic(&self, qp_num: u32, panic: &(dyn std::any::Any + Send)) {
        let what = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic");
        tracing::error!(
            qp_num,
            panic = what,
            "closing connection: internal error handling its completion"
        );
        if let Some(conn) = self.conn(qp_num) {
            self.close(&conn, &format!("internal error: {what}"));
        }
    }

    /// Closes `conn` because its peer broke the protocol: a warning with
    /// the peer and `why`, then [`Endpoint::close`] with `why`.
    pub(crate) fn close_for_violation(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::warn!(qp_num = conn.qp_num, peer = %conn.remote.addr, %why, "closing connection: protocol violation");
        self.close(conn, why);
    }

    /// Posts receives in place of the `owed` consumed ones (see
    /// [`SrqProvision`]) and clears the count; on error it stays owed.
    fn restock(&self, owed: &mut u32) -> Result<(), Status> {
        self.srq.replenish(&self.fabric, *owed)?;
        *owed = 0;
        Ok(())
    }

    /// Takes note of a connection that [`Conn::send_corked`] corked: the
    /// poller uncorks it on its next turn unless its callers do first, and if
    /// the poller sleeps, it is uncorked now.
    pub(crate) fn corked(&self, conn: &Arc<Conn<F>>) {
        self.corked.note(Arc::clone(conn), |c| c.uncork());
    }

    /// Posts the writes of the connections [`Endpoint::corked`] noted.
    fn flush_corked(&self) {
        self.corked.flush(|c| c.uncork());
    }

    /// Asks the poller to exit.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.cq.interrupt();
        self.unpark_poller();
    }

    fn unpark_poller(&self) {
        self.poll.unpark_poller();
    }

    /// Makes sure the poller thread polls if no caller does: called before
    /// a caller waits for a response without polling itself.
    pub(crate) fn ensure_polled(&self) {
        self.poll.ensure_polled();
    }

    fn nanos(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Makes the poller run its timers by `at`.
    pub(crate) fn wake_by(&self, at: Instant) {
        let at = self.nanos(at);
        // An earlier or equal hint not yet taken by a tick wakes the poller
        // in time already (the common case: calls of one timeout).
        if self.timer_hint.load(Ordering::SeqCst) <= at {
            return;
        }
        self.timer_hint.fetch_min(at, Ordering::SeqCst);
        let planned = self.planned_wake.load(Ordering::SeqCst);
        if planned != 0 && at < planned {
            self.cq.interrupt();
            self.unpark_poller();
        }
    }

    /// Runs the role's timers if due (or if someone asked); returns the next tick.
    fn tick(&self, next_tick: Instant, now: Instant) -> Instant {
        // On every check, not only when a timer is due: a large buffer may
        // be kept while no timer runs (no connections, no heartbeats), and
        // an idle dispatcher still wakes at least once a second.
        self.fabric.trim_buffers(now);
        let hint = self.timer_hint.load(Ordering::SeqCst);
        if now < next_tick && self.nanos(now) < hint {
            return next_tick.min(self.epoch + Duration::from_nanos(hint));
        }
        self.timer_hint.store(u64::MAX, Ordering::SeqCst);
        let role = self
            .role
            .on_tick(self, now)
            .unwrap_or(now + Duration::from_secs(3600));
        match self.heartbeats(now) {
            Some(beat) => role.min(beat),
            None => role,
        }
    }

    /// Runs the heartbeat ticks due by `now` (see [`Conn::heartbeat_tick`]);
    /// returns when the next is due.
    fn heartbeats(&self, now: Instant) -> Option<Instant> {
        let due = self.next_heartbeat.load(Ordering::SeqCst);
        if due == u64::MAX {
            return None;
        }
        if self.nanos(now) < due {
            return Some(self.epoch + Duration::from_nanos(due));
        }
        // Taken before the pass: a connection added meanwhile lowers it.
        self.next_heartbeat.store(u64::MAX, Ordering::SeqCst);
        let mut next = None::<Instant>;
        for conn in self.connections() {
            match conn.heartbeat_tick(now) {
                Ok(at) => {
                    if let Some(at) = at {
                        next = Some(next.map_or(at, |n| n.min(at)));
                    }
                    // The heartbeat's post failed: the queue pair is dead.
                    if let Some(why) = conn.take_failure() {
                        self.close(&conn, &why);
                    }
                }
                Err(why) => {
                    tracing::warn!(qp_num = conn.qp_num, peer = %conn.remote.addr, %why, "closing connection: peer unreachable");
                    self.close(&conn, &why);
                }
            }
        }
        let next = next?;
        self.next_heartbeat
            .fetch_min(self.nanos(next), Ordering::SeqCst);
        Some(next)
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
            if *consumed_recvs >= IDLE_RESTOCK {
                let _ = self.restock(consumed_recvs);
            }
            return 0;
        }
        for (i, c) in batch.iter().enumerate() {
            if let CompletionKind::RecvImm { .. } = c.kind {
                *consumed_recvs += 1;
                crate::stages::mark_once(if R::SIDE == crate::observe::Side::Client {
                    crate::stages::Stage::ClientPolled
                } else {
                    crate::stages::Stage::ServerPolled
                });
            }
            LAST_COMPLETION.set(i + 1 == n);
            // A bug met while handling one connection's completion ends
            // that connection, not the thread that polls everyone's.
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.handle(c, touched);
            }));
            if let Err(panic) = handled {
                self.close_after_panic(c.qp_num, panic.as_ref());
            }
        }
        for conn in touched.drain(..) {
            conn.after_batch();
            if let Some(why) = conn.take_failure() {
                self.close(&conn, &why);
            }
        }
        // Keep the SRQ stocked well above what is in flight.
        if *consumed_recvs >= self.config.srq_depth / 4 {
            if let Err(e) = self.restock(consumed_recvs) {
                tracing::error!(error = %e, "cannot replenish the shared receive queue")
            }
        }
        n
    }

    /// Handles completions on the calling thread until `done()` holds or
    /// none came for the spin time (counted from `since`, when given, or
    /// else from when the queue is first found empty); returns `done()`.
    /// Meanwhile the poller
    /// thread naps instead of competing for the queue. While recent waits
    /// were short every blocked caller polls, and while others do too, each
    /// gives up its core after every look ([`crowded_pause`]); after long
    /// ones a caller that finds another polling sleeps at once instead of
    /// spinning out its time beside it.
    ///
    /// `others_waiting()` tells, once the last polling caller stops, whether
    /// anyone else still needs completions handled: then the poller thread
    /// is woken to take over.
    pub(crate) fn poll_until(
        self: &Arc<Self>,
        spin: Duration,
        since: Option<Instant>,
        done: impl Fn() -> bool,
        others_waiting: impl FnOnce() -> bool,
    ) -> bool {
        let mut budget = None;
        let mut idle_since = since;
        let mut spins = 0u32;
        let idle = |progress: bool| {
            if progress {
                idle_since = None;
                return false;
            }
            // The clock is read every 128 spins, not on the first: where it
            // is slow (a syscall under emulation) reading it often costs
            // the spin, and a response within 128 spins needs no clock.
            if spins % 128 == 127 {
                let now = Instant::now();
                let spin = *budget.get_or_insert_with(|| self.call_waits.budget(spin));
                if now.duration_since(*idle_since.get_or_insert(now)) >= spin {
                    return true;
                }
            }
            if self.poll.callers_polling() > 1 {
                crowded_pause(&mut spins);
            } else {
                spin_pause(&mut spins);
            }
            false
        };
        self.poll.poll_until(
            done,
            || self.stop.load(Ordering::Acquire),
            |st| {
                let handled = self.turn(st);
                if handled > 0 {
                    crate::stages::mark(crate::stages::Stage::ClientTurnDone);
                }
                handled
            },
            idle,
            others_waiting,
            self.call_waits.short(),
        )
    }

    /// Turns the queue once on the calling thread if nobody else is turning
    /// it, for a caller's future that checks on its response (see
    /// `UnaryCall`'s `poll`); returns whether it did. While futures do this,
    /// the poller thread naps instead of competing with them.
    pub(crate) fn try_progress(self: &Arc<Self>, seen: &mut u64) -> bool {
        self.poll.try_turn(seen, |st| self.turn(st)).is_some()
    }

    /// One round of the poller's loop on the calling thread, for a harness
    /// that drives a dispatcher by hand (and has entered its executor):
    /// posts corked writes, turns the queue once and runs the woken tasks.
    /// Returns the completions and tasks handled.
    #[cfg(feature = "testing")]
    pub(crate) fn turn_by_hand(self: &Arc<Self>) -> usize {
        self.flush_corked();
        let found = self.poll.try_lock().map_or(0, |mut st| self.turn(&mut st));
        found + self.run_tasks()
    }

    /// Runs the tasks woken since last time; returns how many ran.
    fn run_tasks(&self) -> usize {
        self.exec.as_ref().map_or(0, |e| e.run_woken())
    }

    /// The poller: run to completion what the queue brings, spin briefly on
    /// an empty queue, then block. While a caller polls in its place, nap.
    pub(crate) fn run(self: &Arc<Self>) {
        self.poll.register_poller();
        if let Some(exec) = &self.exec {
            exec.enter();
        }
        let mut idle_since: Option<Instant> = None;
        // When the queue last went empty after work, across sleeps.
        let mut gap_start: Option<Instant> = None;
        let mut next_tick = Instant::now();
        let mut spins = 0u32;
        let mut busy = 0u32;
        // `self_polls` when the poller last looked: callers polled since
        // if it grew.
        let mut seen_polls = self.poll.self_polls();
        while !self.stop.load(Ordering::Acquire) {
            self.flush_corked();
            let napped = self.poll.poller_naps(&mut seen_polls, || {
                let now = Instant::now();
                next_tick = self.tick(next_tick, now);
                let nap = next_tick
                    .saturating_duration_since(now)
                    .clamp(Duration::from_micros(20), POLL_NAP);
                self.planned_wake
                    .store(self.nanos(now + nap).max(1), Ordering::SeqCst);
                // A timer asked for before `planned_wake` was set did not
                // unpark: look once more.
                let hint = self.timer_hint.load(Ordering::SeqCst);
                if self.epoch + Duration::from_nanos(hint) > now + nap {
                    crate::sync::thread::park_timeout(nap);
                }
                self.planned_wake.store(0, Ordering::SeqCst);
            });
            if napped {
                idle_since = None;
                gap_start = None;
                self.run_tasks();
                continue;
            }
            let Some(mut st) = self.poll.try_lock() else {
                // A caller finishing its last turn: it lets go at once.
                spin_pause(&mut spins);
                continue;
            };
            let found = self.turn(&mut st);
            drop(st);
            if found + self.run_tasks() > 0 {
                idle_since = None;
                // While busy, the clock (for timers) is read now and then,
                // and when a gap of idleness ends (for the spin policy).
                busy = busy.wrapping_add(1);
                if gap_start.is_some() || busy % 16 == 0 {
                    let now = Instant::now();
                    if let Some(start) = gap_start.take() {
                        self.idle_gaps.record(now.duration_since(start));
                    }
                    next_tick = self.tick(next_tick, now);
                }
                continue;
            }
            // Spinning: read the clock only every 128 spins.
            if idle_since.is_some() && spins % 128 != 0 {
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
            let Some(mut st) = self.poll.try_lock() else {
                continue;
            };
            self.cq.arm();
            let found = self.turn(&mut st);
            // Owe nothing while asleep.
            if st.consumed_recvs > 0 {
                let _ = self.restock(&mut st.consumed_recvs);
            }
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
            if !sleep.is_zero() && self.poll.callers_polling() == 0 {
                self.corked.sleep(
                    |c| c.uncork(),
                    || self.cq.wait(Some(sleep.min(Duration::from_secs(1)))),
                );
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
            CompletionKind::Send => {
                if let Err(why) = conn.on_send_completion(c.wr_id) {
                    self.close_for_violation(&conn, &why);
                }
            }
            CompletionKind::Read => {
                if !touched.iter().any(|t| Arc::ptr_eq(t, &conn)) {
                    conn.begin_batch();
                    touched.push(conn.clone());
                }
                let deliver = &mut |frame| self.role.on_frame(self, &conn, frame);
                if let Err(why) = conn.on_read_completion(c.wr_id, deliver) {
                    self.close_for_violation(&conn, &why);
                }
            }
            CompletionKind::RecvImm { imm, byte_len } => {
                // Writes this batch causes (responses of inline handlers,
                // credits, the backlog) are posted together after it.
                if !touched.iter().any(|t| Arc::ptr_eq(t, &conn)) {
                    conn.begin_batch();
                    touched.push(conn.clone());
                }
                let deliver = &mut |frame| self.role.on_frame(self, &conn, frame);
                let wants = &|header: &Header| self.role.wants_lent(&conn, header);
                match conn.on_doorbell(imm, byte_len, conn.max_message, deliver, wants) {
                    Ok(()) => {}
                    Err(why) => self.close_for_violation(&conn, &why),
                }
            }
        }
    }
}

/// Marks the calling thread as a server's dispatcher, for
/// [`warn_if_on_a_dispatcher`].
pub(crate) fn mark_server_dispatcher() {
    SERVER_DISPATCHER.set(true);
}

/// Warns, once per process, when `what` would block a server's dispatcher
/// thread (a handler waiting for a call with `wait()` rather than `.await`):
/// every connection of that dispatcher waits meanwhile, and a call to the
/// same server can wait for itself.
pub(crate) fn warn_if_on_a_dispatcher(what: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if SERVER_DISPATCHER.get() && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "{what} blocks a server dispatcher thread: the connections it serves wait, \
             and a call to this same server can wait for itself forever; in an async \
             handler use .await, or make the method blocking (ServerBuilder::blocking_method)"
        );
    }
}

thread_local! {
    /// Whether this thread is a server's dispatcher (see
    /// [`warn_if_on_a_dispatcher`]).
    static SERVER_DISPATCHER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread is handling a batch of completions: only its
    /// writes are staged (another thread's could wait on a batch that
    /// already ended).
    static IN_TURN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether the completion this thread's turn is handling is the turn's
    /// last (see [`LastFrame`]).
    static LAST_COMPLETION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The connection whose last frame of a turn is being delivered, until
    /// the first write staged on it (see [`LastFrame`]).
    static POST_FIRST: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
    /// The clock as first read in this thread's current turn (see [`turn_now`]).
    static TURN_NOW: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// How many calls awaited on this thread have finished (see
    /// [`calls_finished_here`]).
    static FINISHED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many calls whose futures were polled on this thread have finished,
/// on any endpoint: while it grows, responses keep coming for this
/// thread's calls, and a future waiting among many on it keeps polling
/// however long its own call takes. Other threads' calls do not count,
/// even when this thread's turn of a shared queue completed them: a
/// future whose thread only waits does not spin for their traffic.
pub(crate) fn calls_finished_here() -> u64 {
    FINISHED_HERE.get()
}

/// Counts a call finished on this thread (see [`calls_finished_here`]).
pub(crate) fn note_call_finished_here() {
    FINISHED_HERE.set(FINISHED_HERE.get().wrapping_add(1));
}

/// The time now, for what arrived in a batch of completions: read once per
/// turn of the queue, at the first call in it, so a batch of requests costs
/// one clock read (what they arrived with came before the turn began).
/// Outside a turn, the clock itself.
pub(crate) fn turn_now() -> Instant {
    if !IN_TURN.get() {
        return Instant::now();
    }
    TURN_NOW.get().unwrap_or_else(|| {
        let now = Instant::now();
        TURN_NOW.set(Some(now));
        now
    })
}

/// Marks this thread as handling a batch while it lives; restores what was
/// there before (a turn may nest: an inline handler's own blocking call).
struct InTurn(bool, bool, Option<u32>);

impl InTurn {
    fn enter() -> InTurn {
        TURN_NOW.set(None);
        InTurn(
            IN_TURN.replace(true),
            LAST_COMPLETION.replace(false),
            POST_FIRST.replace(None),
        )
    }
}

impl Drop for InTurn {
    fn drop(&mut self) {
        IN_TURN.set(self.0);
        LAST_COMPLETION.set(self.1);
        POST_FIRST.set(self.2);
        // A turn that ends inside another (a handler's blocking call) took
        // time: the outer one reads the clock afresh.
        TURN_NOW.set(None);
    }
}

/// Delivers the last frame of a turn: nothing else this turn holds can
/// join the write its answer causes, so the first write staged meanwhile
/// (an inline handler's response, typically) is posted at once instead of
/// after the call's teardown and the rest of the turn. Later writes are
/// batched as before (a stream's messages, written in one poll, go
/// together at the turn's end).
pub(super) struct LastFrame(Option<u32>);

impl LastFrame {
    /// Marks the frame of connection `qp_num` about to be delivered, the
    /// last of its write when `last_of_write`, until dropped.
    pub(super) fn mark(qp_num: u32, last_of_write: bool) -> LastFrame {
        let last = last_of_write && LAST_COMPLETION.get();
        LastFrame(POST_FIRST.replace(last.then_some(qp_num)))
    }

    /// Whether a write staged now on connection `qp_num`, in a turn, is to
    /// be posted at once (the first one per frame marked).
    pub(super) fn take_post_first(qp_num: u32) -> bool {
        if POST_FIRST.get() != Some(qp_num) {
            return false;
        }
        POST_FIRST.set(None);
        true
    }
}

impl Drop for LastFrame {
    fn drop(&mut self) {
        POST_FIRST.set(self.0);
    }
}

/// How much of each ring a connection uses, from this side's receive ring
/// (`own`) and the peer's (`peer`): (of this side's ring, of the peer's).
/// A sender stages at most [`staging_limit`] of its own ring size, so it
/// uses no more of the receiver's ring; the peer computes the same pair,
/// swapped.
pub(crate) fn ring_shares(own: usize, peer: usize) -> (usize, usize) {
    (own.min(staging_limit(peer)), peer.min(staging_limit(own)))
}

/// The dispatcher of `endpoints` a new connection goes to: the one with the
/// fewest connections.
pub(crate) fn least_loaded<F: Fabric, R: Role<F>>(
    endpoints: &[Arc<Endpoint<F, R>>],
) -> &Arc<Endpoint<F, R>> {
    endpoints
        .iter()
        .min_by_key(|ep| ep.load())
        .expect("at least one dispatcher")
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
