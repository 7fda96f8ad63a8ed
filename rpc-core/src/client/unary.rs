//! A unary call: starting it, and the [`UnaryCall`] its caller awaits
//! or waits on (spinning on the completion queue for a while, then
//! sleeping).

use super::connection::{Connection, Sent};
use super::role::{CallSlot, Outcome, decode_reply};
use super::{Channel, Handle};
use crate::compression::Outgoing;
use crate::descriptor::MethodDescriptor;
use crate::observe::{CallObs, TRACEPARENT};
use crate::protocol::CallId;
use crate::{Code, Metadata, Request, Response, Status};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// A call in flight: `.await` it from any executor, or block on it with
/// [`UnaryCall::wait`]. Dropping it unfinished cancels the call.
///
/// The request is encoded into the connection's send ring when the call is
/// made, and leaves when the call is first waited on or awaited, together
/// with the requests other callers made meanwhile (one post, one vectored
/// write on tcp://), as a tonic call leaves when first polled.
#[must_use = "a call does nothing useful unless awaited or waited on"]
pub struct UnaryCall<T> {
    slot: Option<Arc<CallSlot>>,
    id: CallId,
    canceller: Option<Arc<Connection>>,
    /// A call waiting for a connection (wait-for-ready), not started yet.
    pending: Option<Box<Pending>>,
    /// Its span and metrics.
    obs: Option<CallObs>,
    /// When the request was sent, or else when an `.await` first found the
    /// response missing: where its spin budget starts.
    started: Option<Instant>,
    /// Polls that found the response missing (the clock is read on every
    /// eighth only).
    misses: u32,
    /// The request may still be staged (see `Conn::send_corked`).
    corked: bool,
    /// Callers' turns of the queue as of this call's last look (see
    /// `PollHandoff::try_turn`).
    turns_seen: u64,
    /// `dispatch::calls_finished_here` as of this call's last look at its
    /// spin budget.
    finished_seen: u64,
    /// When that look last saw it grow: the budget runs from then.
    spin_from: Option<Instant>,
    /// The first poll let other tasks stage their requests (see `poll`).
    yielded: bool,
    /// The waker the slot holds, from the last poll that registered one.
    parked: Option<Waker>,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for UnaryCall<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnaryCall").field("id", &self.id.0).finish()
    }
}

/// A unary call sent on a connection.
type Started = Result<(Arc<Connection>, Sent), Status>;

/// A unary call waiting for its channel to connect: its request, encoded.
struct Pending {
    handle: Arc<Handle>,
    method: &'static MethodDescriptor,
    metadata: Metadata,
    payload: Vec<u8>,
    /// The request frame's compression flags (the payload is compressed
    /// already if they say so).
    flags: u16,
    fail_fast: bool,
    deadline: Option<Instant>,
}

impl Pending {
    /// Starts the call on a connection if one is up: `None` while there is
    /// none and the deadline has not passed.
    fn try_start(&self) -> Option<Started> {
        let timeout = match self.deadline {
            Some(at) => match at.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => {
                    return Some(Err(Status::deadline_exceeded(format!(
                        "deadline exceeded waiting for a connection ({})",
                        self.handle.unavailable().message()
                    ))));
                }
            },
            None => None,
        };
        let conn = self.handle.pick().ok()?;
        let metadata = conn.gateway_metadata(self.method, &self.metadata, None);
        let started = conn.start(
            self.method.id,
            &metadata,
            self.fail_fast,
            timeout,
            self.flags,
            self.payload.len(),
            &mut |buf| buf.copy_from_slice(&self.payload),
        );
        Some(started.map(|sent| (conn, sent)))
    }
}

impl<T> UnaryCall<T> {
    /// Starts a unary call on `channel` (see [`Channel::unary`]): sends
    /// it, or, with no connection up, fails it or lets it wait for one.
    pub(super) fn start<Req: prost::Message>(
        channel: &Channel,
        method: &'static MethodDescriptor,
        request: Request<Req>,
    ) -> UnaryCall<T> {
        crate::stages::mark(crate::stages::Stage::CallStart);
        let mut request = request;
        if let Err(status) = channel.intercept(method, request.metadata_mut()) {
            return UnaryCall::failed(status);
        }
        let (obs, trace) = CallObs::client(method.path, &channel.inner.url, request.metadata());
        if let Some(trace) = trace {
            let _ = request.metadata_mut().insert(TRACEPARENT, trace);
        }
        let _in = obs.span().clone().entered();
        let timeout = request.budget(channel.inner.default_timeout);
        let conn = match channel.inner.pick() {
            Ok(conn) => conn,
            Err(status) => {
                if !channel.waits_for_ready(&request) {
                    return UnaryCall::failed(status).observed_by(obs);
                }
                let message = request.get_ref();
                return UnaryCall::waiting(Pending {
                    handle: channel.inner.clone(),
                    method,
                    metadata: request.metadata().clone(),
                    payload: Outgoing::new(message, channel.compression.send()).into_vec(),
                    flags: channel.compression.request_flags(true),
                    fail_fast: request.fail_fast(),
                    deadline: timeout.and_then(crate::deadline_after),
                })
                .observed_by(obs);
            }
        };
        let message = request.get_ref();
        let metadata = conn.gateway_metadata(method, request.metadata(), None);
        let out = Outgoing::new(message, channel.compression.send());
        let started = conn.start(
            method.id,
            &metadata,
            request.fail_fast(),
            timeout,
            channel.compression.request_flags(true),
            out.len(),
            &mut |buf| out.write(buf),
        );
        match started {
            Ok(sent) => UnaryCall::started(conn, sent),
            Err(status) => UnaryCall::failed(status),
        }
        .observed_by(obs)
    }

    fn failed(status: Status) -> UnaryCall<T> {
        let slot = CallSlot::new();
        let _ = slot.complete(Err(status));
        UnaryCall::new(Some(Arc::new(slot)), CallId(0), None, None, None, false)
    }

    fn started(conn: Arc<Connection>, sent: Sent) -> UnaryCall<T> {
        UnaryCall::new(Some(sent.slot), sent.id, Some(conn), None, sent.at, true)
    }

    fn waiting(pending: Pending) -> UnaryCall<T> {
        UnaryCall::new(None, CallId(0), None, Some(Box::new(pending)), None, true)
    }

    /// A call in the given state, not yet polled.
    fn new(
        slot: Option<Arc<CallSlot>>,
        id: CallId,
        canceller: Option<Arc<Connection>>,
        pending: Option<Box<Pending>>,
        started: Option<Instant>,
        corked: bool,
    ) -> UnaryCall<T> {
        UnaryCall {
            slot,
            id,
            canceller,
            pending,
            obs: None,
            started,
            misses: 0,
            corked,
            turns_seen: 0,
            finished_seen: 0,
            spin_from: None,
            yielded: false,
            parked: None,
            _t: PhantomData,
        }
    }

    /// Moves a waiting call on to `started` (or to its failure).
    fn begin(&mut self, started: Started) {
        self.pending = None;
        let obs = self.obs.take();
        *self = match started {
            Ok((conn, sent)) => UnaryCall::started(conn, sent),
            Err(status) => UnaryCall::failed(status),
        };
        self.obs = obs;
    }

    /// Records the call's end in `obs` (its span and metrics).
    fn observed_by(mut self, obs: CallObs) -> UnaryCall<T> {
        self.obs = Some(obs);
        self
    }

    /// The call ended with `result`: its span and metrics say so.
    fn note_end<R>(&mut self, result: &mut Result<R, Status>) {
        if let Some(obs) = &mut self.obs {
            obs.finish(result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok));
            // The server knows a method by its id only: name it here.
            if let Err(status) = result {
                if status.code() == Code::Unimplemented
                    && status
                        .message()
                        .starts_with(crate::conventions::UNKNOWN_METHOD)
                {
                    status.add_context(obs.method());
                }
            }
        }
    }

    /// Waits on this thread for a waiting call's connection.
    fn block_until_started(&mut self) {
        while let Some(p) = &self.pending {
            let generation = p.handle.ready.generation();
            if let Some(started) = p.try_start() {
                self.begin(started);
                return;
            }
            p.handle.ready.wait(generation, p.deadline);
        }
    }

    /// Polls a waiting call's connection: ready once started (or failed).
    fn poll_started(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(p) = &self.pending else {
            return Poll::Ready(());
        };
        if let Some(started) = p.try_start() {
            self.begin(started);
            return Poll::Ready(());
        }
        p.handle.ready.register(cx.waker(), p.deadline);
        // A connection that came up before the waker was in place.
        if let Some(started) = p.try_start() {
            self.begin(started);
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// Blocks until the outcome of `slot` is in and takes it.
fn wait_slot(slot: &CallSlot) -> Outcome {
    slot.wait()
        .unwrap_or_else(|| Err(Status::internal("call result already taken")))
}

/// Takes the outcome of `slot` if it is in.
fn poll_slot(slot: &CallSlot, cx: &mut Context<'_>) -> Poll<Outcome> {
    slot.poll(cx)
        .map(|r| r.unwrap_or_else(|| Err(Status::internal("call polled after completion"))))
}

impl<T: prost::Message + Default> UnaryCall<T> {
    /// Blocks the current thread until the response arrives.
    ///
    /// While it waits, the thread first handles completions itself for a
    /// short while (the channel's spin time), so a quick response reaches it
    /// without a hand-off from the dispatcher thread; then it sleeps.
    ///
    /// Not for async handlers, which run on the server's dispatcher
    /// threads: `.await` the call there (a warning is logged otherwise).
    pub fn wait(mut self) -> Result<Response<T>, Status> {
        crate::dispatch::warn_if_on_a_dispatcher("UnaryCall::wait");
        let mut result = self.wait_inner();
        crate::stages::finish();
        self.note_end(&mut result);
        result
    }

    fn wait_inner(&mut self) -> Result<Response<T>, Status> {
        self.block_until_started();
        let slot = self.slot.take().expect("slot present until completion");
        let Some(conn) = self.canceller.take() else {
            return decode_reply(wait_slot(&slot), drop);
        };
        conn.uncork();
        // One wait in four is timed, for the average that sets the spin
        // budget: from the clock read for the deadline at send time, or
        // from now if there was none.
        let sampled = self.id.generation() % 4 == 0;
        let started = self.started.take().or_else(|| sampled.then(Instant::now));
        conn.poll_for(&slot, started);
        // Sleep without holding the connection: if the last handle to it
        // goes away meanwhile, the call fails `Unavailable` instead of
        // waiting forever.
        let weak = Arc::downgrade(&conn);
        drop(conn);
        let outcome = wait_slot(&slot);
        crate::stages::mark(crate::stages::Stage::ClientTaken);
        match weak.upgrade() {
            Some(conn) => {
                if let Some(t) = started.filter(|_| sampled) {
                    conn.note_wait(t.elapsed());
                }
                conn.finish_call(slot, outcome)
            }
            None => decode_reply(outcome, drop),
        }
    }
}

impl<T: prost::Message + Default> Future for UnaryCall<T> {
    type Output = Result<Response<T>, Status>;

    /// Checks for the response. While it is missing, the task turns the
    /// completion queue itself, as a blocking [`UnaryCall::wait`] does
    /// (unless another waiting call turned it since this one last looked:
    /// many calls polled in a row turn it once per round), and asks to be
    /// polled again soon, for up to the channel's spin time from its start
    /// or from the last turn on this thread that found responses: a quick
    /// response then completes on the task's own thread with no hand-off.
    /// After that the channel's dispatcher takes over and wakes the task.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.pending.is_some() && self.poll_started(cx).is_pending() {
            return Poll::Pending;
        }
        if self.slot.is_none() {
            return Poll::Ready(Err(Status::internal("call polled after completion")));
        }
        if self.corked {
            if let Some(channel) = &self.canceller {
                if !self.yielded && channel.is_corked() {
                    // First poll: let the tasks that run next issue their
                    // requests too; they all leave in one post at the next
                    // poll of any of them.
                    self.yielded = true;
                    self.started.get_or_insert_with(Instant::now);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                channel.uncork();
            }
            self.corked = false;
        }
        let this = &mut *self;
        let slot = this.slot.as_ref().expect("checked above");
        // The slot holds a waker of this task from an earlier poll, and the
        // outcome is not in: no need to lock the slot to look.
        let parked = !slot.is_done()
            && this
                .parked
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()));
        let mut outcome = if parked {
            Poll::Pending
        } else {
            poll_slot(slot, cx)
        };
        if outcome.is_pending() {
            if let Some(channel) = &this.canceller {
                if channel.try_progress(&mut this.turns_seen) && slot.is_done() {
                    outcome = poll_slot(slot, cx);
                }
            }
        }
        if outcome.is_pending() && !parked {
            this.parked = Some(cx.waker().clone());
        }
        match outcome {
            Poll::Ready(r) => {
                crate::dispatch::note_call_finished_here();
                self.parked = None;
                let slot = self.slot.take().expect("checked above");
                let started = self.started.take();
                let mut result = match self.canceller.take() {
                    Some(channel) => {
                        // One call in four is enough for the average wait
                        // (the clock costs as much as a tenth of a call).
                        if let Some(t) = started.filter(|_| self.id.generation() % 4 == 0) {
                            channel.note_wait(t.elapsed());
                        }
                        channel.finish_call(slot, r)
                    }
                    None => decode_reply(r, drop),
                };
                self.note_end(&mut result);
                Poll::Ready(result)
            }
            Poll::Pending => {
                let this = &mut *self;
                this.misses = this.misses.wrapping_add(1);
                let within_budget = match this.started {
                    None => {
                        this.started = Some(Instant::now());
                        true
                    }
                    // Polls come a few hundred nanoseconds apart: reading
                    // the clock on every one of them costs more than
                    // overshooting the budget by seven.
                    Some(_) if this.misses % 8 != 0 => true,
                    // The budget runs from the last time a call awaited on
                    // this thread finished, not from the call's start:
                    // with many calls in flight each waits long, but the
                    // queue delivers often, and spinning on it pays.
                    Some(started) => match &this.canceller {
                        Some(c) => {
                            let now = Instant::now();
                            let finished = crate::dispatch::calls_finished_here();
                            if finished != this.finished_seen {
                                this.finished_seen = finished;
                                this.spin_from = Some(now);
                            }
                            let from = this.spin_from.unwrap_or(started);
                            crate::dispatch::future_spin_yield(now);
                            now.duration_since(from) < c.spin_budget()
                        }
                        None => false,
                    },
                };
                if let Some(channel) = &this.canceller {
                    if within_budget {
                        cx.waker().wake_by_ref();
                    } else {
                        channel.ensure_polled();
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl<T> Drop for UnaryCall<T> {
    fn drop(&mut self) {
        if let (Some(_), Some(conn)) = (self.slot.take(), self.canceller.take()) {
            conn.cancel(self.id);
            conn.ended();
        }
    }
}
