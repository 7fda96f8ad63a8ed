//! The client's side of the protocol on each dispatcher ([`ClientRole`]):
//! its table of calls in flight, and the frames that complete them.

use super::stream_limit::StreamPermit;
use crate::compression::{Encoding, EncodingSet};
use crate::dispatch::{Conn, Endpoint, Frame, Role};
use crate::fabric::Fabric;
use crate::protocol::header::Header;
use crate::protocol::{CallId, CallTable, FrameKind};
use crate::slot::SlotPool;
use crate::streaming::{StreamCore, send_control};
use crate::{Metadata, Response, Status};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Who waits for a call's frames.
pub(super) enum Waiter {
    /// A unary call's caller.
    Unary(Arc<CallSlot>),
    /// A stream's consumer; with `final_message`, the final `Response`
    /// carries a message (client-streaming calls). The stream holds its
    /// place on the connection while it is in the table.
    Stream {
        core: Arc<StreamCore>,
        final_message: bool,
        _permit: StreamPermit,
    },
}

/// A call in flight on a dispatcher: who waits, and on which connection.
pub(super) struct Call {
    pub(super) waiter: Waiter,
    pub(super) qp_num: u32,
}

/// The client's side of one dispatcher: completes the calls of every
/// channel on it.
pub(super) struct ClientRole {
    calls: Mutex<CallTable<Call>>,
    /// Slots of finished calls, for reuse.
    slots: SlotPool<Outcome>,
    /// What to do when a connection fails, by its address (see
    /// [`ClientRole::watch`]).
    watchers: Mutex<HashMap<usize, Box<dyn FnOnce() + Send>>>,
}

impl Default for ClientRole {
    fn default() -> Self {
        ClientRole {
            calls: Mutex::new(CallTable::new()),
            slots: SlotPool::new(),
            watchers: Mutex::new(HashMap::new()),
        }
    }
}

/// A connection's key among the watchers.
fn conn_key<F: Fabric>(conn: &Arc<Conn<F>>) -> usize {
    Arc::as_ptr(conn) as usize
}

impl ClientRole {
    /// Calls `on_lost` when `conn` fails (from the dispatcher, after its
    /// calls failed), or now if it has already.
    pub(super) fn watch<F: Fabric>(&self, conn: &Arc<Conn<F>>, on_lost: Box<dyn FnOnce() + Send>) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if conn.is_alive() {
            watchers.insert(conn_key(conn), on_lost);
            return;
        }
        drop(watchers);
        on_lost();
    }

    /// Forgets `conn`'s watcher (it is being closed on purpose).
    pub(super) fn unwatch<F: Fabric>(&self, conn: &Arc<Conn<F>>) {
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn_key(conn));
    }

    pub(super) fn calls(&self) -> std::sync::MutexGuard<'_, CallTable<Call>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn take_slot(&self) -> Arc<CallSlot> {
        self.slots.take()
    }

    /// Completes the call of `slot` and lets go of it.
    fn finish(&self, slot: Arc<CallSlot>, result: Outcome) {
        self.slots.finish(slot, result);
    }

    /// Lets go of a finished call's slot (see [`SlotPool::release`]).
    pub(super) fn release_slot(&self, slot: Arc<CallSlot>) {
        self.slots.release(slot);
    }
}

impl<F: Fabric> Role<F> for ClientRole {
    const SIDE: crate::observe::Side = crate::observe::Side::Client;

    /// An answer or a stream message is read only for a call of this
    /// connection still in the table: one cancelled or past its deadline
    /// would be dropped once read.
    fn wants_lent(&self, conn: &Arc<Conn<F>>, header: &Header) -> bool {
        self.calls()
            .get_mut(header.call_id)
            .is_some_and(|c| c.qp_num == conn.qp_num)
    }

    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        crate::stages::mark_once(crate::stages::Stage::ClientFrame);
        let h = frame.header;
        match h.kind {
            FrameKind::Response | FrameKind::Error | FrameKind::Message | FrameKind::Window => {}
            FrameKind::Credit => return,
            kind => {
                ep.close_for_violation(conn, &format!("server sent a {kind:?} frame"));
                return;
            }
        }
        let id = h.call_id;
        let mut calls = self.calls();
        // Only a call of this connection: another channel's server cannot
        // complete it.
        let stream = match calls.get_mut(id) {
            Some(c) if c.qp_num == conn.qp_num => match &c.waiter {
                Waiter::Unary(_) => None,
                Waiter::Stream {
                    core,
                    final_message,
                    ..
                } => Some((core.clone(), *final_message)),
            },
            _ => {
                drop(calls);
                conn.note_stale();
                tracing::debug!(
                    call_id = id.0,
                    kind = ?h.kind,
                    "dropped a frame of a call that already ended"
                );
                return;
            }
        };
        let Some((core, final_message)) = stream else {
            // A unary call: completed by a response or an error. A stream
            // frame means the server serves the method as a stream (a
            // client built from another version of the .proto): that call
            // fails, and its stream is cancelled; the connection and its
            // other calls are not at fault.
            let mismatch = !matches!(h.kind, FrameKind::Response | FrameKind::Error);
            let call = calls.complete(id);
            drop(calls);
            let outcome = if mismatch {
                send_cancel(conn, id);
                Err(Status::internal(
                    "the server answered this unary call with a stream: the method streams \
                     on the server (is the client's .proto the server's?)",
                ))
            } else {
                unary_outcome(frame, crate::dispatch::Link::max_message(&**conn))
            };
            if let Some(Call {
                waiter: Waiter::Unary(slot),
                ..
            }) = call
            {
                self.finish(slot, outcome);
            }
            return;
        };
        // The stream's place on the connection is given back (below,
        // outside the lock): the server counted it until it sent this.
        let _ended =
            matches!(h.kind, FrameKind::Response | FrameKind::Error).then(|| calls.complete(id));
        drop(calls);
        let applied = match h.kind {
            FrameKind::Message => match frame.metadata {
                Some(md) => core.on_message(&h, frame.payload, md),
                None => {
                    self.fail_stream(conn, id, &core, "server sent malformed stream metadata");
                    return;
                }
            },
            FrameKind::Window => core.on_grant(h.timeout_us),
            // A stream's end carries no message (but a client stream's
            // answer): a message there is a single answer to a method the
            // server serves as unary or client-streaming. The call fails,
            // as a unary call answered with a stream does.
            FrameKind::Response if !final_message && !frame.payload.is_empty() => core.on_end(
                Err(Status::internal(
                    "the server answered this streaming call with a single response: the \
                     method is unary or client-streaming in the server's .proto; build this \
                     client from the same .proto as the server",
                )),
                None,
                None,
                true,
            ),
            FrameKind::Response => {
                let last = final_message.then_some((frame.payload, h.flags));
                core.on_end(Ok(()), last, frame.metadata, true)
            }
            _ => {
                let status = frame.error_status();
                core.on_end(Err(status), None, frame.metadata, true)
            }
        };
        if let Err(e) = applied {
            ep.close_for_violation(conn, &format!("stream protocol violation: {e}"));
        }
    }

    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::info!(%why, "connection lost");
        crate::observe::connection(crate::observe::Side::Client, -1.0);
        let calls = self.calls().remove_where(|c| c.qp_num == conn.qp_num);
        for (_, call) in calls {
            let status = Status::unavailable(format!("connection lost: {why}"));
            match call.waiter {
                Waiter::Unary(slot) => self.finish(slot, Err(status)),
                Waiter::Stream { core, .. } => core.fail(status),
            }
        }
        let watcher = self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn_key(conn));
        if let Some(on_lost) = watcher {
            on_lost();
        }
    }

    fn on_tick(&self, ep: &Endpoint<F, Self>, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let next = {
            let mut calls = self.calls();
            while let Some(e) = calls.pop_expired(now) {
                expired.push(e);
            }
            calls.next_deadline()
        };
        for (id, call) in expired {
            let status = Status::deadline_exceeded("deadline exceeded before the call finished");
            // A stream's place on the connection (in its waiter) goes only
            // after the cancel.
            let permit = match call.waiter {
                Waiter::Unary(slot) => {
                    self.finish(slot, Err(status));
                    None
                }
                Waiter::Stream {
                    core,
                    _permit: permit,
                    ..
                } => {
                    core.fail(status);
                    Some(permit)
                }
            };
            if let Some(conn) = ep.conn(call.qp_num) {
                send_cancel(&conn, id);
            }
            drop(permit);
        }
        next
    }
}

impl ClientRole {
    /// Ends a stream the server broke: its consumer sees `why`, the server a cancel.
    fn fail_stream<F: Fabric>(&self, conn: &Conn<F>, id: CallId, core: &StreamCore, why: &str) {
        let call = self.calls().remove(id);
        core.fail(Status::internal(why));
        send_cancel(conn, id);
        // Its place on the connection goes only after the cancel.
        drop(call);
    }
}

/// Tells the server the call `id` is cancelled; what it lent for the call
/// and this side has not started to read is not read.
pub(super) fn send_cancel<F: Fabric>(conn: &Conn<F>, id: CallId) {
    conn.cancel_reads(id);
    let _ = send_control(conn, FrameKind::Cancel, id, 0);
}

/// What a unary call's `Response` or `Error` frame tells its caller: a
/// compressed response inflated (at most `limit` bytes; the client accepts
/// every encoding it knows, as its requests said unless narrowed, and a
/// server sends no other).
fn unary_outcome(frame: Frame, limit: usize) -> Result<RawReply, Status> {
    match frame.header.kind {
        FrameKind::Response => match frame.metadata {
            Some(metadata) => {
                let (payload, encoding) = crate::compression::inflate(
                    frame.payload,
                    frame.header.flags,
                    EncodingSet::all(),
                    || limit,
                    drop,
                )?;
                Ok(RawReply {
                    metadata,
                    payload,
                    encoding,
                })
            }
            None => Err(Status::internal("server sent malformed response metadata")),
        },
        _ => Err(frame.error_status()),
    }
}

/// A response as received, before decoding.
#[derive(Debug)]
pub(super) struct RawReply {
    metadata: Metadata,
    payload: crate::payload::Payload,
    /// The encoding it arrived compressed in.
    encoding: Option<Encoding>,
}

/// What a unary call ends with, left in its slot.
pub(super) type Outcome = Result<RawReply, Status>;
/// Where a unary call's outcome is left for its caller.
pub(super) type CallSlot = crate::slot::CallSlot<Outcome>;

/// Decodes a response; hands the buffer it arrived in to `recycle`.
pub(super) fn decode_reply<T: prost::Message + Default>(
    r: Result<RawReply, Status>,
    recycle: impl FnOnce(crate::payload::Payload),
) -> Result<Response<T>, Status> {
    let RawReply {
        metadata,
        payload,
        encoding,
    } = r?;
    let message = payload.decode::<T>(recycle).map_err(|e| {
        Status::internal(format!(
            "response is not a valid {}: {e}",
            std::any::type_name::<T>()
        ))
    })?;
    Ok(Response::from_parts(metadata, message).with_encoding(encoding))
}
