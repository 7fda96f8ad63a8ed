//! The calls of one dispatcher that can still hear from their client after
//! the request (streams, and unary calls whose handlers wait): the
//! [`Registry`] keyed by connection and call id, what a stream frame or a
//! cancel does to a registered call, and how many streams each connection
//! has open against its limit.

use crate::Status;
use crate::dispatch::Frame;
use crate::protocol::{CallId, FrameKind};
use crate::streaming::{Signal, StreamCore};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Calls of one dispatcher that can hear from their client after the
/// request: streams (their messages, half-close, window and cancel) and
/// unary calls whose handlers wait (their cancel).
#[derive(Default)]
pub(crate) struct Registry {
    calls: Mutex<Calls>,
    /// How many calls `calls` holds, kept under its lock: a request looks
    /// for a live call of its id (see `contains`), and with unary handlers
    /// that answer at once there is none, so it need not take the lock.
    len: AtomicUsize,
    /// Most streams one connection may have at once; 0 for no limit (the
    /// gRPC face, whose HTTP/2 server limits each of its connections).
    stream_limit: u32,
}

/// The registered calls, and how many of them are streams per connection.
#[derive(Default)]
struct Calls {
    by_id: HashMap<(u32, CallId), Registered>,
    streams: HashMap<u32, u32>,
}

impl Calls {
    fn remove(&mut self, key: &(u32, CallId)) -> Option<Registered> {
        let removed = self.by_id.remove(key);
        if let Some(Registered::Stream(_)) = removed {
            if let Some(n) = self.streams.get_mut(&key.0) {
                *n -= 1;
                if *n == 0 {
                    self.streams.remove(&key.0);
                }
            }
        }
        removed
    }
}

#[derive(Clone)]
pub(super) enum Registered {
    Unary(Arc<Signal>),
    Stream(Arc<StreamCore>),
}

impl Registered {
    /// Ends the call for the handler: it sees `status` (streams) and its
    /// cancellation signal fires.
    pub(super) fn cancel(&self, status: Status) {
        match self {
            Registered::Unary(signal) => signal.cancel(),
            Registered::Stream(core) => core.fail(status),
        }
    }
}

impl Registry {
    /// A registry whose connections may each have `stream_limit` streams
    /// at once (0: any number).
    pub(super) fn with_stream_limit(stream_limit: u32) -> Registry {
        Registry {
            stream_limit,
            ..Registry::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a unary call whose handler waits (or runs elsewhere).
    pub(super) fn insert(&self, qp_num: u32, id: CallId, signal: Arc<Signal>) {
        let mut calls = self.lock();
        calls.by_id.insert((qp_num, id), Registered::Unary(signal));
        self.len.store(calls.by_id.len(), Ordering::Release);
    }

    /// Registers a stream, unless its connection has as many as the limit:
    /// then `Err(limit)`, and nothing is registered.
    pub(super) fn insert_stream(
        &self,
        qp_num: u32,
        id: CallId,
        core: Arc<StreamCore>,
    ) -> Result<(), u32> {
        let mut calls = self.lock();
        let open = calls.streams.entry(qp_num).or_insert(0);
        if self.stream_limit != 0 && *open >= self.stream_limit {
            return Err(self.stream_limit);
        }
        *open += 1;
        calls.by_id.insert((qp_num, id), Registered::Stream(core));
        self.len.store(calls.by_id.len(), Ordering::Release);
        Ok(())
    }

    fn get(&self, qp_num: u32, id: CallId) -> Option<Registered> {
        self.lock().by_id.get(&(qp_num, id)).cloned()
    }

    /// Whether `id` names a live call of `qp_num`. A call is registered by
    /// the thread that handles its connection's frames, the thread that
    /// asks, so an empty count read here is never stale for this
    /// connection.
    pub(super) fn contains(&self, qp_num: u32, id: CallId) -> bool {
        self.len.load(Ordering::Acquire) > 0 && self.lock().by_id.contains_key(&(qp_num, id))
    }

    pub(super) fn remove(&self, qp_num: u32, id: CallId) -> Option<Registered> {
        let mut calls = self.lock();
        let removed = calls.remove(&(qp_num, id));
        self.len.store(calls.by_id.len(), Ordering::Release);
        removed
    }

    /// Applies a frame that names a call after its request (stream
    /// traffic or a cancel) to the call; a frame that breaks the protocol
    /// is refused with what it broke (the connection is then closed).
    pub(crate) fn on_call_frame(&self, qp_num: u32, frame: Frame) -> Result<(), String> {
        let h = frame.header;
        let Some(call) = self.get(qp_num, h.call_id) else {
            // The call ended (its answer crossed this frame), or its
            // handler finished without waiting: nothing to tell.
            tracing::trace!(call_id = h.call_id.0, kind = ?h.kind, "frame for a call that is not live");
            return Ok(());
        };
        let applied = match (&call, h.kind) {
            (_, FrameKind::Cancel) => {
                self.remove(qp_num, h.call_id);
                call.cancel(Status::cancelled("the client cancelled the call"));
                Ok(())
            }
            (Registered::Stream(core), FrameKind::Message) => match frame.metadata {
                Some(md) => core.on_message(&h, frame.payload, md),
                None => return Err("client sent malformed stream metadata".into()),
            },
            (Registered::Stream(core), FrameKind::HalfClose) => {
                core.on_end(Ok(()), None, None, false)
            }
            (Registered::Stream(core), FrameKind::Window) => core.on_grant(h.timeout_us),
            (Registered::Unary(_), kind) => {
                return Err(format!("client sent a {kind:?} frame for a unary call"));
            }
            // Only the kinds above are routed here.
            (Registered::Stream(_), _) => Ok(()),
        };
        applied.map_err(|e| format!("stream protocol violation: {e}"))
    }

    /// Takes every call of connection `qp_num`.
    pub(super) fn take_connection(&self, qp_num: u32) -> Vec<Registered> {
        let mut calls = self.lock();
        let keys: Vec<_> = calls
            .by_id
            .keys()
            .filter(|k| k.0 == qp_num)
            .copied()
            .collect();
        let taken = keys.iter().filter_map(|k| calls.remove(k)).collect();
        self.len.store(calls.by_id.len(), Ordering::Release);
        taken
    }
}
