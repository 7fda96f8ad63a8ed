//! A channel's endpoints: each one's connection, which one a call goes to
//! ([`Balance`]), and reconnecting those that fail.

use super::Handle;
use super::connection::{Connection, Settings};
use super::reconnect;
use super::stream_limit::{StreamPermit, Waiting};
use crate::Status;
use crate::fabric::FabricUrl;
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Waker;
use std::time::Instant;

/// One endpoint of a channel.
pub(super) struct Target {
    pub(super) url: FabricUrl,
    /// Where to connect instead when `url` cannot be (see
    /// [`ChannelBuilder::fallback`](super::ChannelBuilder::fallback)).
    fallback: Option<FabricUrl>,
    /// The live connection, if any: read without a lock by every call.
    pub(super) current: ArcSwapOption<Connection>,
    state: Mutex<TargetState>,
    /// Whether the last health check found it serving (true until one
    /// says otherwise, and without health checks).
    pub(super) serving: AtomicBool,
    /// The resolver no longer names it: it is not reconnected.
    pub(super) removed: AtomicBool,
}

impl Target {
    pub(super) fn new(url: FabricUrl, fallback: Option<FabricUrl>) -> Arc<Target> {
        Arc::new(Target {
            url,
            fallback,
            current: ArcSwapOption::empty(),
            state: Mutex::new(TargetState::default()),
            serving: AtomicBool::new(true),
            removed: AtomicBool::new(false),
        })
    }

    /// Its live connection, if it has one and it is serving.
    fn usable(&self) -> Option<Arc<Connection>> {
        self.current
            .load_full()
            .filter(|_| self.serving.load(Ordering::Relaxed))
    }
}

#[derive(Default)]
pub(super) struct TargetState {
    /// Failed attempts in a row.
    failures: u32,
    /// An attempt is scheduled or under way.
    reconnecting: bool,
    /// Why the last connection or attempt failed.
    last_error: Option<Status>,
    /// What the last health check said.
    pub(super) health: Option<String>,
}

/// How a channel over several endpoints picks one for each call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Balance {
    /// Each connected endpoint in turn (the default).
    #[default]
    RoundRobin,
    /// The connected endpoint with the fewest calls and streams
    /// outstanding on this channel (ties in turn).
    LeastOutstanding,
}

impl Handle {
    /// A live connection for the next call, as [`Balance`] says; marks the
    /// dead ones it meets for reconnection.
    pub(super) fn pick(self: &Arc<Self>) -> Result<Arc<Connection>, Status> {
        if let Some(target) = &self.single {
            return self.pick_from(target);
        }
        let targets = self.targets.load();
        let n = targets.len();
        if n == 1 {
            return self.pick_from(&targets[0]);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<Arc<Connection>> = None;
        for k in 0..n {
            let target = &targets[(start + k) % n];
            let Some(c) = target.usable() else {
                continue;
            };
            if !c.is_alive() {
                self.lost(target, &c);
                continue;
            }
            match self.balance {
                Balance::RoundRobin => return Ok(c),
                Balance::LeastOutstanding => {
                    let fewer = best.as_ref().is_none_or(|b| {
                        c.outstanding.load(Ordering::Relaxed)
                            < b.outstanding.load(Ordering::Relaxed)
                    });
                    if fewer {
                        best = Some(c);
                    }
                }
            }
        }
        best.ok_or_else(|| self.unavailable())
    }

    /// [`Handle::pick`] for a stream: a connection with room for one more
    /// under its server's stream limit, if any has; else any.
    pub(super) fn pick_for_stream(self: &Arc<Self>) -> Result<Arc<Connection>, Status> {
        let picked = self.pick()?;
        if picked.streams.has_room() || self.single.is_some() {
            return Ok(picked);
        }
        let targets = self.targets.load();
        let n = targets.len();
        let start = self.next.load(Ordering::Relaxed);
        let roomy = (0..n)
            .filter_map(|k| targets[(start + k) % n].usable())
            .find(|c| c.is_alive() && c.streams.has_room());
        Ok(roomy.unwrap_or(picked))
    }

    /// For a stream that found `full` at its server's stream limit: a place
    /// on another of the channel's live connections, if one has room;
    /// otherwise `waker` is woken (through `waiting`) once a stream ends on
    /// any of them, not only on `full`.
    pub(super) fn open_elsewhere(
        &self,
        full: &Arc<Connection>,
        waiting: &Arc<Waiting>,
        waker: &Waker,
    ) -> Option<(Arc<Connection>, StreamPermit)> {
        if self.single.is_some() {
            return None;
        }
        let targets = self.targets.load();
        targets
            .iter()
            .filter_map(|t| t.usable())
            .filter(|c| !Arc::ptr_eq(c, full) && c.is_alive())
            .find_map(|c| c.streams.open_or_wake(waiting, waker).map(|p| (c, p)))
    }

    /// Of the places `handed` to a waiting stream, one on `picked` or on
    /// another of the channel's live connections, with that connection;
    /// the others go on to the next streams waiting for them.
    pub(super) fn handed_place(
        &self,
        picked: &Arc<Connection>,
        handed: Vec<StreamPermit>,
    ) -> Option<(Arc<Connection>, StreamPermit)> {
        if handed.is_empty() {
            return None;
        }
        let targets = self.targets.load();
        handed.into_iter().find_map(|permit| {
            let conn = if permit.is_on(&picked.streams) {
                Some(picked.clone())
            } else {
                targets
                    .iter()
                    .filter_map(|t| t.usable())
                    .find(|c| c.is_alive() && permit.is_on(&c.streams))
            };
            conn.map(|c| (c, permit))
        })
    }

    /// `target`'s live connection, if it serves; a dead one is taken out.
    fn pick_from(self: &Arc<Self>, target: &Arc<Target>) -> Result<Arc<Connection>, Status> {
        match target.usable() {
            Some(c) if c.is_alive() => Ok(c),
            dead => {
                if let Some(c) = dead {
                    self.lost(target, &c);
                }
                Err(self.unavailable())
            }
        }
    }

    /// The status of a call made with no connection up.
    pub(super) fn unavailable(&self) -> Status {
        let targets = self.targets.load();
        let not_serving = targets
            .iter()
            .find(|t| t.current.load().is_some() && !t.serving.load(Ordering::Relaxed));
        let why = targets
            .iter()
            .find_map(|t| t.lock().last_error.as_ref().map(|s| s.message().to_owned()))
            .or_else(|| not_serving.map(|t| self.not_serving_reason(t)))
            .or_else(|| self.resolver.as_ref().and_then(|r| r.last_error()))
            .unwrap_or_else(|| "not connected yet".to_owned());
        let retry = if self.settings.backoff.is_some() {
            "; reconnecting"
        } else {
            "; reconnection is off: open a new channel"
        };
        Status::unavailable(format!("no connection to {}: {why}{retry}", self.url))
    }

    /// Whether callers may wait for a connection: one may come.
    pub(super) fn may_reconnect(&self) -> bool {
        self.settings.backoff.is_some()
    }

    /// Connection `dead` of `target` failed: takes it out and schedules
    /// a reconnection (once).
    fn lost(self: &Arc<Self>, target: &Arc<Target>, dead: &Arc<Connection>) {
        let current = target.current.load();
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, dead)) {
            return; // already replaced
        }
        target.current.store(None);
        let why = dead.death();
        tracing::info!(url = %target.url, %why, "connection lost; reconnecting");
        self.failed(
            target,
            Status::unavailable(format!("connection lost: {why}")),
        );
    }

    /// `target` has no connection because of `status`: schedules the
    /// next attempt after the backoff.
    pub(super) fn failed(self: &Arc<Self>, target: &Arc<Target>, status: Status) {
        let Some(backoff) = self.settings.backoff else {
            target.lock().last_error = Some(status);
            return;
        };
        if target.removed.load(Ordering::Relaxed) {
            return;
        }
        let delay = {
            let mut st = target.lock();
            st.last_error = Some(status);
            if st.reconnecting {
                return;
            }
            st.failures = st.failures.saturating_add(1);
            backoff.delay(st.failures)
        };
        self.schedule(target, Instant::now() + delay);
    }

    /// Attempts to connect `target` at `at`, unless an attempt is due.
    pub(super) fn schedule(self: &Arc<Self>, target: &Arc<Target>, at: Instant) {
        {
            let mut st = target.lock();
            if st.reconnecting {
                return;
            }
            st.reconnecting = true;
        }
        let weak = Arc::downgrade(self);
        let weak_target = Arc::downgrade(target);
        reconnect::schedule(at, move || Handle::attempt(weak, weak_target));
    }

    /// One attempt to connect `target`, on a thread of its own. Neither
    /// the channel nor the target is kept alive meanwhile: if every handle
    /// to the channel goes away, or the resolver drops the target, the new
    /// connection is closed.
    fn attempt(weak: Weak<Handle>, weak_target: Weak<Target>) {
        let (Some(h), Some(target)) = (weak.upgrade(), weak_target.upgrade()) else {
            return;
        };
        let settings = h.settings.clone();
        drop(h);
        let outcome = Target::connect(&target.url, target.fallback.as_ref(), &settings);
        let Some(handle) = weak.upgrade() else {
            return;
        };
        target.lock().reconnecting = false;
        if target.removed.load(Ordering::Relaxed) {
            return;
        }
        let url = &target.url;
        if target.current.load().as_ref().is_some_and(|c| c.is_alive()) {
            // Connected meanwhile by another way (`connect`): keep that one,
            // whose calls are under way; this one closes unused.
            return;
        }
        match outcome {
            Ok(conn) => {
                tracing::info!(%url, "reconnected");
                crate::observe::reconnected();
                handle.install(&target, conn);
            }
            Err(status) => {
                tracing::debug!(%url, %status, "reconnection attempt failed");
                handle.failed(&target, status);
            }
        }
    }

    /// Makes `conn` `target`'s connection and wakes whoever waits.
    pub(super) fn install(self: &Arc<Self>, target: &Arc<Target>, conn: Connection) {
        let conn = Arc::new(conn);
        {
            let mut st = target.lock();
            st.failures = 0;
            st.last_error = None;
        }
        target.serving.store(true, Ordering::Relaxed);
        // Learn of its failure as it happens, not only at the next call,
        // so that reconnection starts at once.
        let weak = Arc::downgrade(self);
        let weak_target = Arc::downgrade(target);
        let dead = Arc::downgrade(&conn);
        conn.watch(Box::new(move || {
            if let (Some(h), Some(t), Some(c)) =
                (weak.upgrade(), weak_target.upgrade(), dead.upgrade())
            {
                h.lost(&t, &c);
            }
        }));
        target.current.store(Some(conn.clone()));
        // After the store: a check finding another connection there ends.
        if self.health.is_some() {
            Handle::schedule_health_check(self, target, &conn, Instant::now());
        }
        self.ready.notify();
    }
}

impl Target {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, TargetState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connects this endpoint (or its fallback).
    pub(super) fn open(&self, settings: &Settings) -> Result<Connection, Status> {
        Target::connect(&self.url, self.fallback.as_ref(), settings)
    }

    /// Connects to `url`, or if that fails, to `fallback`; the error is
    /// `url`'s when both fail.
    fn connect(
        url: &FabricUrl,
        fallback: Option<&FabricUrl>,
        settings: &Settings,
    ) -> Result<Connection, Status> {
        let status = match Connection::open(url, settings) {
            Ok(conn) => return Ok(conn),
            Err(status) => status,
        };
        let Some(fallback) = fallback else {
            return Err(status);
        };
        match Connection::open(fallback, settings) {
            Ok(conn) => {
                tracing::warn!(%url, %fallback, %status, "cannot connect; using the fallback");
                Ok(conn)
            }
            Err(second) => Err(Status::new(
                status.code(),
                format!(
                    "{}; fallback {fallback}: {}",
                    status.message(),
                    second.message()
                ),
            )),
        }
    }
}
