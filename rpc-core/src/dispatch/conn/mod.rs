//! One connection: [`Conn`], its rings, credits and queue pair, and its
//! life (set-up, liveness, failure, teardown). What it does lives beside
//! it: sending (`send.rs`, and `lend.rs` for large payloads), receiving
//! (`recv.rs`, and `rendezvous.rs` for what the peer lent), the heartbeat
//! (`heartbeat.rs`), and the [`Link`] calls and streams send through.

mod frame;
mod heartbeat;
mod lend;
mod link;
mod recv;
mod rendezvous;
mod send;

pub(crate) use frame::OutFrame;
pub(crate) use link::{LendBuf, Link, send_control};
#[cfg(feature = "testing")]
pub(crate) use rendezvous::READS_POSTED;

use crate::Status;
use crate::auth::Peer;
use crate::fabric::{Connected, Fabric, PeerRing, QueuePair, Region};
use crate::observe::Side;
use crate::protocol::{Receiver, Sender, staging_size};
use heartbeat::Heartbeat;
use lend::Loans;
use rendezvous::Rendezvous;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest peer receive ring accepted (unless the local ring is larger):
/// each connection stages its outgoing frames in half as many bytes.
pub(super) const MAX_PEER_RING: usize = 64 << 20;

/// The largest peer ring a side whose own ring is `own_ring` bytes stages
/// for: [`MAX_PEER_RING`], or its own ring if larger.
pub(crate) fn staging_limit(own_ring: usize) -> usize {
    MAX_PEER_RING.max(own_ring)
}

/// The send path's state: the protocol's [`Sender`] and what it needs from
/// the fabric (the queue pair and the staging area).
pub(super) struct SendState<F: Fabric> {
    pub(super) qp: Option<F::Qp>,
    pub(super) staging: F::Region,
    pub(super) proto: Sender,
    /// The heartbeat, if on (see [`Conn::heartbeat_tick`]).
    pub(super) heartbeat: Option<Heartbeat>,
    /// Payloads lent to the peer and not yet released.
    pub(super) loans: Loans,
}

/// One connection: its queue pair, its receive ring and the peer's. The
/// protocol state is pure ([`Sender`], [`Receiver`]); this drives it with
/// the fabric: copies frames in and out of registered memory and posts.
pub(crate) struct Conn<F: Fabric> {
    pub qp_num: u32,
    /// Who is at the other end.
    pub remote: Arc<Peer>,
    pub(super) peer: PeerRing,
    pub(super) recv_region: F::Region,
    pub(super) recv: Mutex<Receiver>,
    pub(super) send: Mutex<SendState<F>>,
    pub(super) failure: Mutex<Option<String>>,
    /// Receives posted for this connection (see [`Endpoint::add`]).
    pub(super) recvs: u32,
    /// Largest message (metadata + payload) accepted from the peer.
    pub(super) max_message: usize,
    /// The fabric: large messages' buffers come from its cache.
    pub(super) fabric: F,
    /// Payloads larger than this travel by rendezvous (lent, and read by
    /// the peer) instead of in the ring; `usize::MAX` when the queue pair
    /// does not lend.
    pub(super) lend_above: usize,
    /// The peer's lent payloads being read.
    pub(super) rendezvous: Mutex<Rendezvous>,
    /// Responses that named no live call of this connection.
    pub(super) stale: AtomicU64,
    /// Buffers incoming messages are copied into, for reuse.
    pub(super) buffers: Mutex<Vec<Vec<u8>>>,
    /// Whether a doorbell arrived from the peer. A client writes first
    /// (see [`Conn::post_fence`]), and only once its ring can take our
    /// writes (on rdma://, once its memory window is bound): a server sends
    /// nothing of its own accord before that.
    pub(super) heard: AtomicBool,
    /// Which end of its connections this side is, for the byte counters
    /// (set by the endpoint after construction).
    pub(super) side: Side,
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
    /// Of `recv_region`, the first `cap` bytes are the ring (see
    /// [`super::ring_shares`]); of the peer's ring, `c.peer.len`.
    pub(super) fn new(
        fabric: F,
        recv_region: F::Region,
        cap: usize,
        staging: F::Region,
        max_backlog: usize,
        c: Connected<F::Qp>,
    ) -> Result<Conn<F>, Status> {
        debug_assert!(cap <= recv_region.len());
        let ring_err = |e: crate::protocol::RingError| Status::internal(format!("ring: {e}"));
        let peer_cap =
            usize::try_from(c.peer.len).map_err(|_| Status::internal("peer ring too large"))?;
        if staging.len() < staging_size(peer_cap) {
            return Err(Status::resource_exhausted(format!(
                "a peer ring of {peer_cap} bytes needs a staging area of {} bytes, not {}",
                staging_size(peer_cap),
                staging.len()
            )));
        }
        let sq_depth = c.qp.send_queue_depth() as u64;
        let max_reads = c.qp.max_reads();
        Ok(Conn {
            qp_num: c.qp.qp_num(),
            remote: Arc::new(Peer {
                addr: c.peer_addr,
                fabric: c.fabric,
                identity: c.identity,
            }),
            peer: c.peer,
            recv: Mutex::new(Receiver::new(cap).map_err(ring_err)?),
            recv_region,
            send: Mutex::new(SendState {
                qp: Some(c.qp),
                staging,
                proto: Sender::new(peer_cap, cap, sq_depth, max_backlog).map_err(ring_err)?,
                heartbeat: None,
                loans: Loans::default(),
            }),
            failure: Mutex::new(None),
            recvs: 0,
            max_message: 0,
            fabric,
            lend_above: usize::MAX,
            rendezvous: Mutex::new(Rendezvous::new(max_reads)),
            stale: AtomicU64::new(0),
            buffers: Mutex::new(Vec::new()),
            heard: AtomicBool::new(false),
            side: Side::Client,
        })
    }

    pub(super) fn send_state(&self) -> MutexGuard<'_, SendState<F>> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The largest message the peer accepts.
    pub(crate) fn peer_max_message(&self) -> usize {
        self.peer.max_message as usize
    }

    /// Most streams the peer serves at once on this connection; 0 for no
    /// limit.
    pub(crate) fn peer_max_streams(&self) -> u32 {
        self.peer.max_streams
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.send_state().proto.death().is_none()
    }

    /// Why the connection died, if it did.
    pub(crate) fn death(&self) -> Option<String> {
        self.send_state().proto.death().map(str::to_owned)
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
        s.proto.kill(why);
        s.qp = None;
    }

    pub(super) fn set_failure(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(why);
        }
    }

    pub(super) fn take_failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}
