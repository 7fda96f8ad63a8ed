//! What happens when a frame arrives on a server connection: a request
//! starts a call, stream traffic and cancels go to the call they name, a
//! frame a client may not send closes the connection; and a lost
//! connection cancels its calls.

#[cfg(feature = "testing")]
use super::fault;
use super::registry::Registry;
use super::start::{NewCall, ServerShared};
use crate::Status;
use crate::dispatch::{Conn, Endpoint, Frame, Role};
use crate::fabric::Fabric;
use crate::observe::Side;
use crate::protocol::FrameKind;
use crate::streaming::Link;
use std::sync::Arc;
use std::time::Instant;

/// The server's side of one dispatcher: routes requests to handlers.
pub(super) struct ServerRole {
    pub(super) shared: Arc<ServerShared>,
    pub(super) registry: Arc<Registry>,
}

impl<F: Fabric> Role<F> for ServerRole {
    const SIDE: Side = Side::Server;

    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        crate::stages::mark_once(crate::stages::Stage::ServerFrame);
        let h = frame.header;
        #[cfg(feature = "testing")]
        fault::check(h.method_id);
        match h.kind {
            FrameKind::Request => {}
            FrameKind::Message | FrameKind::HalfClose | FrameKind::Window | FrameKind::Cancel => {
                return self.on_call_frame(ep, conn, frame);
            }
            FrameKind::Credit => return,
            kind => {
                ep.close_for_violation(conn, &format!("client sent a {kind:?} frame"));
                return;
            }
        }
        // An id names one live call of the connection. Every call that
        // outlives its request frame is registered by now (streams and
        // blocking calls here, waiting handlers at their first wait): a
        // request reusing the id of one would take its place, and the
        // earlier call could then never be cancelled, nor its task ended
        // when the connection goes.
        if self.registry.contains(conn.qp_num, h.call_id) {
            ep.close_for_violation(
                conn,
                &format!("client reused the id {:#x} of a live call", h.call_id.0),
            );
            return;
        }
        let sink: Arc<dyn Link> = conn.clone();
        self.shared.start_call(
            &self.registry,
            NewCall {
                qp_num: conn.qp_num,
                call_id: h.call_id,
                method_id: h.method_id,
                timeout_us: h.timeout_us,
                metadata: frame.metadata,
                payload: frame.payload,
                sink,
                remote: &conn.remote,
                kind: Some(h.call_kind()),
                flags: h.flags,
            },
        );
    }

    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::info!(peer = %conn.remote.addr, qp_num = conn.qp_num, %why, "client disconnected");
        crate::observe::connection(Side::Server, -1.0);
        for call in self.registry.take_connection(conn.qp_num) {
            call.cancel(Status::unavailable(format!("connection lost: {why}")));
        }
    }

    fn on_tick(&self, _ep: &Endpoint<F, Self>, _now: Instant) -> Option<Instant> {
        None
    }

    /// A request is read (it starts a call); a stream message only for a
    /// call still registered: one cancelled or finished would be dropped
    /// once read.
    fn wants_lent(&self, conn: &Arc<Conn<F>>, header: &crate::protocol::Header) -> bool {
        header.kind != FrameKind::Message || self.registry.contains(conn.qp_num, header.call_id)
    }
}

impl ServerRole {
    /// A frame for a call after its request: stream traffic or a cancel.
    fn on_call_frame<F: Fabric>(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        if let Err(violation) = self.registry.on_call_frame(conn.qp_num, frame) {
            ep.close_for_violation(conn, &violation);
        }
    }
}
