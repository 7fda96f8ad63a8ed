//! How a server admits connections: the acceptor's loop (refusing clients
//! while it shuts down or is at its connection limit), the ring each
//! client is offered, and setting up an admitted connection on the least
//! loaded dispatcher.

use super::role::ServerRole;
use super::start::ServerShared;
use crate::dispatch::{Config, Endpoint, least_loaded, staging_limit};
use crate::fabric::{Fabric, Incoming, Listener, LocalSetup, PeerRing};
use crate::observe::Side;
use crate::{Code, Status};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Sets up the connections the listener admitted (their hellos read and
/// validated, their clients authenticated) one after the other: allocating
/// a ring and a queue pair and sending the server's hello does not wait
/// for the peer, so no connection needs a thread of its own.
pub(super) fn accept_loop<F: Fabric>(
    endpoints: &Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    shared: &ServerShared,
    listener: Arc<F::Listener>,
    max_connections: usize,
) {
    loop {
        let incoming = match listener.next() {
            Ok(Some(i)) => i,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "listener failed; no longer accepting");
                return;
            }
        };
        if shared.draining.load(Ordering::Acquire) {
            listener.refuse(incoming, Code::Unavailable, "the server is shutting down");
            continue;
        }
        let connections: usize = endpoints.iter().map(|ep| ep.load()).sum();
        if connections >= max_connections {
            listener.refuse(
                incoming,
                Code::ResourceExhausted,
                &format!("the server is at its limit of {max_connections} connections"),
            );
            continue;
        }
        let ep = least_loaded(endpoints);
        if let Err(status) = establish(ep, incoming) {
            tracing::warn!(%status, "connection attempt failed");
        }
    }
}

/// The receive ring (bytes) and largest request for a connection from a
/// client whose ring is `client`: each direction is its own agreement. The
/// client stages what it sends for this ring, and stages for at most
/// [`staging_limit`] of its own ring size: a server with a larger ring
/// offers that client only as much (and requests up to half of it), so
/// that a client with default settings can use any server.
pub(super) fn ring_for<F: Fabric>(config: &Config, client: &PeerRing) -> (usize, usize) {
    let client_ring = usize::try_from(client.len).unwrap_or(usize::MAX);
    let ring = config.ring_size::<F>().min(staging_limit(client_ring));
    (ring, config.max_message)
}

fn establish<F: Fabric>(ep: &Endpoint<F, ServerRole>, incoming: F::Incoming) -> Result<(), Status> {
    let (ring_len, max_message) = ring_for::<F>(&ep.config, &incoming.peer_ring());
    let ring = ep.register_ring(ring_len)?;
    let local = LocalSetup {
        ring: &ring,
        max_message: max_message as u32,
        max_streams: ep.role.shared.max_streams,
        timeout: ep.config.connect_timeout,
        credential: None,
        tls: None,
    };
    let connected = ep.fabric.accept(incoming, local, &ep.cq)?;
    let conn = ep.add(connected, ring, max_message)?;
    crate::observe::connection(Side::Server, 1.0);
    if let Err(status) = conn.established() {
        ep.close(&conn, "handshake failed");
        return Err(status);
    }
    // Only now: on tcp:// nothing may reach the client before the hello;
    // and heartbeats wait for the client's first write (on rdma://, its
    // ring's memory window is bound only then).
    if let Some(every) = ep.config.heartbeat {
        ep.start_heartbeat(&conn, every, true);
    }
    tracing::info!(
        peer = %conn.remote.addr,
        identity = conn.remote.identity.as_deref().unwrap_or("-"),
        qp_num = conn.qp_num,
        "client connected"
    );
    Ok(())
}
