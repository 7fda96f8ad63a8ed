//! `tcp://host:port`: the soft fabric across processes and machines.
//!
//! After the [`bootstrap`](crate::fabric::bootstrap) handshake, the TCP connection
//! carries three messages:
//!
//! - `WRITE`: `tag=1` (unsignaled) or `tag=3` (signaled), `wr_id u64,
//!   remote_addr u64, rkey u32, imm u32, len u32`, then `len` bytes;
//! - `ACK`: `tag=4, wr_id u64`: a signaled write was applied; only now does
//!   the sender see its send completion, as with an RC acknowledgement;
//! - `NAK`: `tag=2, wr_id u64, status u8`: the receiver rejected a write
//!   (bad rkey or bounds, or RNR exhaustion) or a read; both queue pairs go
//!   to error;
//! - `READ`: `tag=5`, the fields of a `WRITE` (`imm` 0): an RDMA READ of
//!   `len` bytes at `remote_addr` of a buffer the peer lent under `rkey`;
//! - `READ_RESP`: `tag=6`, the fields of a `WRITE` (only `wr_id` and `len`
//!   set), then the `len` bytes read: they land straight in the buffer the
//!   read was posted with, and the reader reports the read complete.
//!
//! No thread per connection: each socket is non-blocking and belongs to the
//! completion queue its queue pair reports to ([`TcpIo`], one epoll set per
//! queue). Whoever polls that queue plays the receiving NIC: it reads every
//! ready socket (many messages per read, large payloads straight into their
//! region) and turns what it read into completions; a thread sleeping on the
//! queue sleeps in the socket poller. Posting writes a batch of messages
//! with one vectored write; what the socket cannot take at once waits in the
//! connection's queue and goes out when the socket is writable again, so a
//! post never blocks. Every length read from the wire is checked against
//! the target region before a byte of payload is accepted: nothing is
//! allocated on a peer's say-so.
//!
//! The connection ([`TcpConn`]) and a queue pair's sending half
//! ([`TcpWire`]) are here; `message` holds the wire's bytes, `writer` what
//! leaves, `reader` what arrives, `poller` the sockets of a completion
//! queue, `keepalive` the heartbeat's view of the socket and `connect` the
//! set-up.

mod connect;
#[cfg(feature = "testing")]
pub mod fuzzing;
mod keepalive;
mod message;
mod poller;
mod reader;
mod writer;

pub(super) use connect::{accept, connect};
#[cfg(test)]
pub(super) use keepalive::{KEEPALIVE_PROBES_FOR_HEARTBEAT, unacknowledged_for};
pub(crate) use poller::TcpIo;

use super::{CqInner, Ctx, Lending, RegionInner};
use crate::fabric::bootstrap::Hello;
use crate::fabric::tls::Session;
use crate::fabric::{Completion, CompletionKind, WcStatus};
use reader::Rx;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use writer::TxQueue;

/// Bytes read per `read(2)` into the queue's scratch buffer.
const SCRATCH: usize = 64 << 10;
/// Bytes a connection may hold for a peer that does not read them, beyond
/// twice its ring (see [`TcpConn::max_held`]).
const HELD_SLACK: usize = 1 << 20;

/// One tcp:// queue pair's socket: its receiving NIC and its send queue.
pub(super) struct TcpConn {
    qp_num: u32,
    /// The ring this queue pair advertised: the peer's writes may land
    /// only there.
    ring: Weak<RegionInner>,
    ctx: Arc<Ctx>,
    stream: TcpStream,
    /// Shared with the [`SoftQp`](super::SoftQp): set when either side
    /// fails or closes it.
    dead: Arc<AtomicBool>,
    /// Shared with the [`SoftQp`](super::SoftQp): the buffers it lends
    /// (this reader answers the peer's reads from them) and its reads
    /// (whose bytes this reader places).
    lending: Arc<Lending>,
    /// Whether the connection runs over TLS (its session is in `tx`).
    /// Lock order: `rx`, then `tx`, then a ring's bytes.
    tls: bool,
    /// The most the send queue may hold for the peer (see
    /// [`TxQueue::held`]) before the connection fails: twice the peer's
    /// ring and [`HELD_SLACK`]. A peer that reads keeps far less waiting,
    /// since what is in flight to its ring is bounded by the ring; one that
    /// returns credits and acknowledgements without reading would
    /// otherwise make it grow without bound.
    max_held: usize,
    rx: Mutex<Rx>,
    tx: Mutex<TxQueue>,
}

impl TcpConn {
    /// A connection on `stream` to a peer whose ring holds `peer_ring`
    /// bytes, its reader waiting for a write's header; over TLS if it has a
    /// `tls` session.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        qp_num: u32,
        ring: Weak<RegionInner>,
        ctx: Arc<Ctx>,
        stream: TcpStream,
        dead: Arc<AtomicBool>,
        lending: Arc<Lending>,
        tls: Option<Session>,
        peer_ring: u64,
    ) -> TcpConn {
        let peer_ring = usize::try_from(peer_ring).unwrap_or(usize::MAX);
        TcpConn {
            qp_num,
            ring,
            ctx,
            stream,
            dead,
            lending,
            tls: tls.is_some(),
            max_held: peer_ring.saturating_mul(2).saturating_add(HELD_SLACK),
            rx: Mutex::new(Rx::new()),
            tx: Mutex::new(TxQueue::new(tls)),
        }
    }

    fn tx(&self) -> MutexGuard<'_, TxQueue> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue pair failed: tells the dispatcher once, with an error
    /// completion on `cq` (the polling thread's queue).
    fn fail_local(&self, wr_id: u64, kind: CompletionKind, status: WcStatus, cq: &CqInner) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            cq.push(Completion {
                wr_id,
                qp_num: self.qp_num,
                kind,
                status,
            });
        }
        self.tx().failed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// The sending half of a TCP queue pair.
pub(super) struct TcpWire {
    conn: Arc<TcpConn>,
    key: usize,
    cq: Arc<CqInner>,
    pending_hello: Option<Hello>,
}

impl TcpWire {
    /// Closes once what was posted is written, like an orderly close.
    pub(super) fn close(&mut self) {
        if let Some(io) = self.cq.io.get() {
            io.close(self.key, &self.conn);
        }
    }
}

/// Listens on `tcp://host:port`.
pub type TcpListener = crate::fabric::gate::Gate;
