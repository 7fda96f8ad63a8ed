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

use super::{
    CqInner, Ctx, Lending, RegionInner, SoftBuffer, SoftQp, SoftRegion, Wire, next_qp_num,
};
use crate::fabric::bootstrap::{self, Hello, HelloFabric, Link};
use crate::fabric::gate::Admitted;
use crate::fabric::tls::Session;
use crate::fabric::{
    Completion, CompletionKind, Connected, FabricError, FabricUrl, LocalSetup, PeerRing, Probe,
    Region, RemoteBuf, WcStatus, WriteImm,
};
use crate::pages::Pages;
use mio::unix::SourceFd;
use mio::{Interest, Token};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLockReadGuard, Weak};
use std::time::{Duration, Instant};

const TAG_WRITE: u8 = 1;
const TAG_NAK: u8 = 2;
const TAG_WRITE_SIGNALED: u8 = 3;
const TAG_ACK: u8 = 4;
const TAG_READ: u8 = 5;
const TAG_READ_RESP: u8 = 6;
/// Bytes of a lent buffer encrypted at a time on a TLS connection: the
/// session holds no more ciphertext than this waiting for the socket.
const LENT_TLS_CHUNK: usize = 256 << 10;
const WRITE_HEADER: usize = 1 + 8 + 8 + 4 + 4 + 4;
const ACK_LEN: usize = 1 + 8;
const NAK_LEN: usize = 1 + 8 + 1;
/// Bytes read per `read(2)` into the queue's scratch buffer.
const SCRATCH: usize = 64 << 10;
/// What one answered read holds in the send queue besides its bytes, which
/// are not copied: its `READ_RESP` head and its place in the queue.
const LENT_CHUNK_COST: usize = WRITE_HEADER + std::mem::size_of::<LentChunk>();
/// Bytes a connection may hold for a peer that does not read them, beyond
/// twice its ring (see [`TcpConn::max_held`]).
const HELD_SLACK: usize = 1 << 20;
/// A payload with at least this much still to come is read straight into
/// its region, not through the scratch buffer.
const DIRECT_READ: usize = 16 << 10;
/// Bytes read from one socket per poll before the others get their turn.
const READ_BUDGET: usize = 1 << 20;
/// A region read-locked while its bytes are written out.
type RegionGuard<'a> = (&'a SoftRegion, RwLockReadGuard<'a, Pages>);

#[cfg(feature = "testing")]
pub mod fuzzing;

/// Writes of one post gathered into one vectored write.
const MAX_GATHER: usize = 64;
/// How long a closing connection keeps trying to flush to a peer that does
/// not read before it gives up.
const CLOSE_LINGER: Duration = Duration::from_secs(5);
/// The poller's token for its waker.
const WAKER: Token = Token(usize::MAX);

fn status_code(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::RemoteAccess => 1,
        WcStatus::RnrRetryExceeded => 2,
        WcStatus::RetryExceeded => 3,
        WcStatus::Flushed => 4,
        WcStatus::Other { .. } | WcStatus::DeviceError { .. } => 5,
    }
}

/// The fixed part of a `WRITE` message for `w`, whose payload (`len`
/// bytes) follows it.
fn write_head(w: &WriteImm<'_, SoftRegion>, len: u32) -> [u8; WRITE_HEADER] {
    let mut h = [0u8; WRITE_HEADER];
    h[0] = if w.signaled {
        TAG_WRITE_SIGNALED
    } else {
        TAG_WRITE
    };
    h[1..9].copy_from_slice(&w.wr_id.to_le_bytes());
    h[9..17].copy_from_slice(&w.remote_addr.to_le_bytes());
    h[17..21].copy_from_slice(&w.rkey.to_le_bytes());
    h[21..25].copy_from_slice(&w.imm.to_le_bytes());
    h[25..29].copy_from_slice(&len.to_le_bytes());
    h
}

/// The fixed part of a `READ` (`tag` [`TAG_READ`]) or `READ_RESP`
/// ([`TAG_READ_RESP`]) message.
fn read_head(tag: u8, wr_id: u64, addr: u64, rkey: u32, len: u32) -> [u8; WRITE_HEADER] {
    let mut h = [0u8; WRITE_HEADER];
    h[0] = tag;
    h[1..9].copy_from_slice(&wr_id.to_le_bytes());
    h[9..17].copy_from_slice(&addr.to_le_bytes());
    h[17..21].copy_from_slice(&rkey.to_le_bytes());
    h[25..29].copy_from_slice(&len.to_le_bytes());
    h
}

/// An `ACK` message: the signaled write `wr_id` was applied.
fn ack_message(wr_id: u64) -> [u8; ACK_LEN] {
    let mut ack = [0u8; ACK_LEN];
    ack[0] = TAG_ACK;
    ack[1..9].copy_from_slice(&wr_id.to_le_bytes());
    ack
}

/// A `NAK` message: the write `wr_id` was rejected with `status`.
fn nak_message(wr_id: u64, status: WcStatus) -> [u8; NAK_LEN] {
    let mut nak = [0u8; NAK_LEN];
    nak[0] = TAG_NAK;
    nak[1..9].copy_from_slice(&wr_id.to_le_bytes());
    nak[9] = status_code(status);
    nak
}

fn status_from(code: u8) -> WcStatus {
    match code {
        1 => WcStatus::RemoteAccess,
        2 => WcStatus::RnrRetryExceeded,
        3 => WcStatus::RetryExceeded,
        4 => WcStatus::Flushed,
        v => WcStatus::Other { vendor: v as u32 },
    }
}

/// The sockets of the tcp:// queue pairs that report to one completion
/// queue, and the epoll set that watches them.
pub(crate) struct TcpIo {
    registry: mio::Registry,
    waker: mio::Waker,
    poll: Mutex<IoPoll>,
    conns: Mutex<Slab<Arc<TcpConn>>>,
    /// Entries in `conns`: a queue without sockets skips `epoll_wait`.
    live: AtomicUsize,
    /// Connections closed with bytes still to flush (see [`TcpIo::close`]).
    closing: Mutex<Vec<(usize, Instant)>>,
    has_closing: AtomicBool,
    /// TLS connections just registered: their session may already hold
    /// bytes the socket will never report again (decrypted during the
    /// handshake, or not yet written), so the next poll services them.
    kicked: Mutex<Vec<usize>>,
    has_kicked: AtomicBool,
}

/// What only the thread reading the sockets touches.
struct IoPoll {
    poll: mio::Poll,
    events: mio::Events,
    scratch: Box<[u8]>,
    /// Connections that stopped reading before their socket ran dry (read
    /// budget spent, or waiting for a receive): read again at the next poll,
    /// since an edge-triggered poller will not report them again.
    again: Vec<usize>,
    again_next: Vec<usize>,
}

impl TcpIo {
    pub(super) fn new() -> Result<TcpIo, FabricError> {
        let poll = mio::Poll::new().map_err(|e| FabricError::io("epoll_create", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| FabricError::io("epoll registry", e))?;
        let waker = mio::Waker::new(&registry, WAKER).map_err(|e| FabricError::io("eventfd", e))?;
        Ok(TcpIo {
            registry,
            waker,
            poll: Mutex::new(IoPoll {
                poll,
                events: mio::Events::with_capacity(256),
                scratch: vec![0u8; SCRATCH].into_boxed_slice(),
                again: Vec::new(),
                again_next: Vec::new(),
            }),
            conns: Mutex::new(Slab::new()),
            live: AtomicUsize::new(0),
            closing: Mutex::new(Vec::new()),
            has_closing: AtomicBool::new(false),
            kicked: Mutex::new(Vec::new()),
            has_kicked: AtomicBool::new(false),
        })
    }

    fn conns(&self) -> MutexGuard<'_, Slab<Arc<TcpConn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes a thread sleeping in [`TcpIo::wait`].
    pub(super) fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake a completion queue's poller");
        }
    }

    /// Starts watching `conn`'s socket; returns its key.
    fn register(&self, conn: Arc<TcpConn>) -> Result<usize, FabricError> {
        let mut conns = self.conns();
        let entry = conns.vacant_entry();
        let key = entry.key();
        self.registry
            .register(
                &mut SourceFd(&conn.stream.as_raw_fd()),
                Token(key),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| FabricError::io("epoll_ctl(ADD)", e))?;
        let tls = conn.tls;
        entry.insert(conn);
        self.live.fetch_add(1, Ordering::Release);
        drop(conns);
        if tls {
            self.kicked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(key);
            self.has_kicked.store(true, Ordering::Release);
            self.wake();
        }
        Ok(key)
    }

    /// Stops watching the connection at `key` (if it is still `conn`) and
    /// shuts its socket down.
    fn remove(&self, key: usize, conn: &Arc<TcpConn>) {
        let removed = {
            let mut conns = self.conns();
            match conns.get(key) {
                Some(c) if Arc::ptr_eq(c, conn) => Some(conns.remove(key)),
                _ => None,
            }
        };
        if let Some(c) = removed {
            self.live.fetch_sub(1, Ordering::Release);
            let _ = self
                .registry
                .deregister(&mut SourceFd(&c.stream.as_raw_fd()));
            let _ = c.stream.shutdown(Shutdown::Both);
        }
    }

    /// Closes `conn` once what was posted is written, like an orderly close;
    /// a peer that does not read gets [`CLOSE_LINGER`].
    fn close(&self, key: usize, conn: &Arc<TcpConn>) {
        let flushed = {
            let mut tx = conn.tx();
            tx.closing = true;
            tx.sent_since_look = true;
            if !tx.failed {
                if let Some(session) = &mut tx.tls {
                    // The peer learns that the end is ours, not a cut.
                    session.close_notify();
                    let _ = session.flush(&conn.stream);
                }
            }
            tx.flushed() || tx.failed
        };
        if flushed {
            self.remove(key, conn);
        } else {
            self.closing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((key, Instant::now() + CLOSE_LINGER));
            self.has_closing.store(true, Ordering::Release);
            self.wake();
        }
    }

    /// Reads what the sockets have, without blocking: called by every poll
    /// of the queue. Skipped while another thread reads them.
    pub(super) fn poll_now(&self, cq: &CqInner) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let Ok(mut io) = self.poll.try_lock() else {
            return;
        };
        self.turn(&mut io, cq, Some(Duration::ZERO));
    }

    /// Sleeps until a socket is ready, the waker fires or `timeout` passes,
    /// then reads what is ready.
    pub(super) fn wait(&self, cq: &CqInner, timeout: Option<Duration>) {
        let mut io = self.poll.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = if io.again.is_empty() {
            timeout
        } else {
            Some(Duration::ZERO)
        };
        self.turn(&mut io, cq, timeout);
    }

    fn turn(&self, io: &mut IoPoll, cq: &CqInner, timeout: Option<Duration>) {
        let IoPoll {
            poll,
            events,
            scratch,
            again,
            again_next,
        } = io;
        if let Err(e) = poll.poll(events, timeout) {
            if e.kind() != ErrorKind::Interrupted {
                tracing::error!(error = %e, "epoll_wait failed");
            }
            return;
        }
        again_next.clear();
        for key in again.drain(..) {
            self.service(key, true, false, scratch, cq, again_next);
        }
        for ev in events.iter() {
            if ev.token() == WAKER {
                continue;
            }
            let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
            let writable = ev.is_writable() || ev.is_write_closed();
            self.service(ev.token().0, readable, writable, scratch, cq, again_next);
        }
        if self.has_kicked.load(Ordering::Acquire) {
            let kicked =
                std::mem::take(&mut *self.kicked.lock().unwrap_or_else(|e| e.into_inner()));
            self.has_kicked.store(false, Ordering::Release);
            for key in kicked {
                self.service(key, true, true, scratch, cq, again_next);
            }
        }
        std::mem::swap(again, again_next);
        again.sort_unstable();
        again.dedup();
        if self.has_closing.load(Ordering::Acquire) {
            self.linger();
        }
    }

    /// Handles a ready socket.
    fn service(
        &self,
        key: usize,
        readable: bool,
        writable: bool,
        scratch: &mut [u8],
        cq: &CqInner,
        again: &mut Vec<usize>,
    ) {
        let Some(conn) = self.conns().get(key).cloned() else {
            return; // closed meanwhile
        };
        if writable {
            conn.flush(cq);
        }
        if readable {
            match conn.read_ready(scratch, cq) {
                ReadOutcome::Drained => {}
                ReadOutcome::More => again.push(key),
                ReadOutcome::Closed => self.remove(key, &conn),
            }
        }
        if conn.tx().closing {
            let flushed = {
                let tx = conn.tx();
                tx.flushed() || tx.failed
            };
            if flushed {
                self.remove(key, &conn);
            }
        }
    }

    /// Gives up on closing connections whose peer did not read in time, and
    /// forgets those already gone.
    fn linger(&self) {
        let mut closing = self.closing.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        closing.retain(|&(key, deadline)| {
            let Some(conn) = self.conns().get(key).cloned() else {
                return false;
            };
            if !conn.tx().closing {
                return false; // the key belongs to a newer connection
            }
            if now < deadline {
                return true;
            }
            tracing::debug!("giving up flushing to a peer that does not read");
            self.remove(key, &conn);
            false
        });
        self.has_closing
            .store(!closing.is_empty(), Ordering::Release);
    }
}

/// What reading a ready socket came to.
enum ReadOutcome {
    /// Read until it would block.
    Drained,
    /// Stopped early: read again at the next poll.
    More,
    /// The connection is over: stop watching it.
    Closed,
}

/// Bytes posted but not yet taken by the socket, in order: `bytes`, then
/// each of `lent`.
#[derive(Default)]
struct TxQueue {
    bytes: Vec<u8>,
    /// How much of `bytes` is written.
    sent: usize,
    /// Reads of lent buffers being answered: their bytes go to the socket
    /// from the buffer itself, with no copy.
    lent: VecDeque<LentChunk>,
    /// Shut down once everything queued is written.
    closing: bool,
    /// The socket failed: nothing more is written.
    failed: bool,
    /// The connection's TLS session, if it uses TLS: then everything
    /// posted is encrypted into it at once and waits there for the socket
    /// (`bytes` stays empty), and the reader decrypts through it too.
    tls: Option<Session>,
    /// Something was sent since the heartbeat last looked at the socket
    /// ([`TcpWire::unacknowledged_for`]).
    sent_since_look: bool,
    /// At that look everything sent before had been acknowledged, and
    /// nothing waited here or in the socket: until the next send, nothing
    /// can be in flight, and the look needs no `TCP_INFO`.
    settled: bool,
    /// The signaled writes sent and not yet acknowledged, oldest first: the
    /// peer acknowledges them in this order, and an `ACK` for anything
    /// else is a lie that closes the connection (a completion for a write
    /// never posted would corrupt the sender's count of writes in flight).
    /// At most a send queue's depth.
    acks_due: VecDeque<u64>,
    /// Over TLS: plaintext bytes put into the session since it last wrote
    /// everything it held to the socket (what it may hold, as ciphertext).
    tls_held: usize,
}

/// Bytes of a lent buffer to send (`at..end`), and what was posted after them.
struct LentChunk {
    buf: Arc<SoftBuffer>,
    at: usize,
    end: usize,
    then: Vec<u8>,
}

impl TxQueue {
    fn unsent(&self) -> usize {
        self.bytes.len() - self.sent
    }

    /// What waits here for a socket the peer reads: bytes queued, answered
    /// reads (their heads, not the lent bytes, which are not copied) and
    /// what the TLS session holds.
    fn held(&self) -> usize {
        let lent: usize = self
            .lent
            .iter()
            .map(|c| LENT_CHUNK_COST + c.then.len())
            .sum();
        self.unsent() + lent + self.tls_held
    }

    /// Whether nothing waits for the socket (or the TLS session) here.
    fn idle(&self) -> bool {
        self.unsent() == 0 && self.lent.is_empty()
    }

    /// Whether everything posted has been written to the socket.
    fn flushed(&self) -> bool {
        self.idle() && !self.tls.as_ref().is_some_and(Session::wants_write)
    }

    /// Queues `bufs` behind everything queued, skipping their first `skip` bytes.
    fn queue(&mut self, bufs: &[IoSlice<'_>], mut skip: usize) {
        let to = match self.lent.back_mut() {
            Some(chunk) => &mut chunk.then,
            None => &mut self.bytes,
        };
        for b in bufs.iter() {
            let take = skip.min(b.len());
            skip -= take;
            to.extend_from_slice(&b[take..]);
        }
    }

    /// Writes what is queued, as far as the socket (or, over TLS, the
    /// session, a chunk of a lent buffer at a time) takes it. `Err` if the
    /// socket failed.
    fn pump(&mut self, stream: &TcpStream) -> Result<(), ()> {
        if let Some(session) = &mut self.tls {
            if self.bytes.len() > self.sent {
                let rest = IoSlice::new(&self.bytes[self.sent..]);
                session.queue(&[rest]).map_err(drop)?;
                self.tls_held += rest.len();
                self.bytes.clear();
                self.sent = 0;
            }
            loop {
                if session.flush(stream).map_err(drop)? {
                    self.tls_held = 0;
                } else {
                    return Ok(());
                }
                let Some(front) = self.lent.front_mut() else {
                    return Ok(());
                };
                if front.at < front.end {
                    let n = (front.end - front.at).min(LENT_TLS_CHUNK);
                    let piece = IoSlice::new(&front.buf[front.at..front.at + n]);
                    session.queue(&[piece]).map_err(drop)?;
                    self.tls_held += n;
                    front.at += n;
                } else {
                    let chunk = self.lent.pop_front().expect("front exists");
                    if !chunk.then.is_empty() {
                        session.queue(&[IoSlice::new(&chunk.then)]).map_err(drop)?;
                        self.tls_held += chunk.then.len();
                    }
                }
            }
        }
        loop {
            if self.unsent() > 0 {
                let left = self.unsent();
                let n = write_nonblocking(stream, &[IoSlice::new(&self.bytes[self.sent..])])?;
                self.sent += n;
                if n < left {
                    return Ok(());
                }
                self.bytes.clear();
                self.sent = 0;
                if self.bytes.capacity() > SCRATCH {
                    self.bytes.shrink_to(SCRATCH);
                }
            } else if let Some(front) = self.lent.front_mut() {
                if front.at < front.end {
                    let left = front.end - front.at;
                    let piece = IoSlice::new(&front.buf[front.at..front.end]);
                    let n = write_nonblocking(stream, &[piece])?;
                    front.at += n;
                    if n < left {
                        return Ok(());
                    }
                } else {
                    let chunk = self.lent.pop_front().expect("front exists");
                    self.bytes = chunk.then;
                    self.sent = 0;
                }
            } else {
                return Ok(());
            }
        }
    }
}

/// The bytes of a read this side posted, arriving.
struct InRead {
    wr_id: u64,
    buf: SoftBuffer,
    len: usize,
    have: usize,
}

/// An incoming write whose header was read.
struct InWrite {
    wr_id: u64,
    imm: u32,
    len: usize,
    signaled: bool,
    /// Where the payload goes (none for a zero-length write).
    target: Option<(Arc<RegionInner>, usize)>,
    /// Payload bytes placed so far.
    have: usize,
}

enum RxState {
    /// Reading a message's tag and fixed fields into `head`.
    Head {
        head: [u8; WRITE_HEADER],
        have: usize,
    },
    /// Reading a write's payload into its region.
    Payload(InWrite),
    /// Reading the bytes of a read this side posted into its buffer.
    ReadData(InRead),
    /// A write is in, but the shared receive queue is empty: waiting for a
    /// receive, as RNR retries do, until `since` + the RNR timeout.
    Stalled { write: InWrite, since: Instant },
    /// The connection failed; what else arrives is ignored.
    Done,
}

struct Rx {
    state: RxState,
    /// Bytes read but not yet parsed (only after a stall).
    carry: Vec<u8>,
}

impl Rx {
    /// With at least [`DIRECT_READ`] bytes of a payload (or read data) to
    /// come, runs `read` on where they go and counts what it placed; `None`
    /// otherwise (read into the scratch buffer).
    fn direct(
        &mut self,
        read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> Option<std::io::Result<usize>> {
        let (r, have) = match &mut self.state {
            RxState::Payload(w) if w.len - w.have >= DIRECT_READ => {
                let (region, start) = w.target.as_ref()?;
                let mut bytes = region.data.write().unwrap_or_else(|e| e.into_inner());
                (read(&mut bytes[start + w.have..start + w.len]), &mut w.have)
            }
            RxState::ReadData(r) if r.len - r.have >= DIRECT_READ => {
                (read(&mut r.buf[r.have..r.len]), &mut r.have)
            }
            _ => return None,
        };
        if let Ok(n) = r {
            *have += n;
        }
        Some(r)
    }
}

/// One tcp:// queue pair's socket: its receiving NIC and its send queue.
pub(super) struct TcpConn {
    qp_num: u32,
    /// The ring this queue pair advertised: the peer's writes may land
    /// only there.
    ring: Weak<RegionInner>,
    ctx: Arc<Ctx>,
    stream: TcpStream,
    /// Shared with the [`SoftQp`]: set when either side fails or closes it.
    dead: Arc<AtomicBool>,
    /// Shared with the [`SoftQp`]: the buffers it lends (this reader
    /// answers the peer's reads from them) and its reads (whose bytes this
    /// reader places).
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

/// Writes `bufs` to a non-blocking socket until done or it would block;
/// returns the bytes written, or `Err` if the socket failed. `bufs` is left
/// as it was: the caller queues what was not written by counting from the
/// start (advancing the slices in place would shorten the one a partial
/// write stopped in, and those bytes would be skipped twice).
fn write_nonblocking(stream: &TcpStream, bufs: &[IoSlice<'_>]) -> Result<usize, ()> {
    let mut copy = [IoSlice::new(&[]); 2 * MAX_GATHER];
    let copy = &mut copy[..bufs.len()];
    copy.copy_from_slice(bufs);
    let mut bufs = copy;
    let mut written = 0;
    while !bufs.is_empty() {
        match (&*stream).write_vectored(bufs) {
            Ok(0) => return Err(()),
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(_) => return Err(()),
        }
    }
    Ok(written)
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
            rx: Mutex::new(Rx {
                state: RxState::Head {
                    head: [0; WRITE_HEADER],
                    have: 0,
                },
                carry: Vec::new(),
            }),
            tx: Mutex::new(TxQueue {
                tls,
                ..TxQueue::default()
            }),
        }
    }

    fn tx(&self) -> MutexGuard<'_, TxQueue> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `bufs` after everything sent before: straight to the socket
    /// when nothing waits ahead of them, and what it cannot take now is
    /// queued for when it is writable. Never blocks. `acks_due` are the
    /// signaled writes among them, in order. `Err` once the socket failed
    /// or the connection is closing.
    fn send(&self, bufs: &[IoSlice<'_>], acks_due: &[u64]) -> Result<(), ()> {
        let mut tx = self.tx();
        if tx.failed || tx.closing {
            return Err(());
        }
        tx.sent_since_look = true;
        tx.acks_due.extend(acks_due);
        if !tx.idle() {
            // Behind what waits, in order.
            tx.queue(bufs, 0);
            return self.within_bound(&mut tx);
        }
        if let Some(session) = &mut tx.tls {
            match session
                .queue(bufs)
                .and_then(|()| session.flush(&self.stream))
            {
                Ok(true) => tx.tls_held = 0,
                Ok(false) => {
                    tx.tls_held += bufs.iter().map(|b| b.len()).sum::<usize>();
                    return self.within_bound(&mut tx);
                }
                Err(_) => {
                    tx.failed = true;
                    return Err(());
                }
            }
            return Ok(());
        }
        let written = match write_nonblocking(&self.stream, bufs) {
            Ok(n) => n,
            Err(()) => {
                tx.failed = true;
                return Err(());
            }
        };
        tx.bytes.clear();
        tx.sent = 0;
        tx.queue(bufs, written);
        self.within_bound(&mut tx)
    }

    /// `Err` (and the socket failed) if the send queue holds more than
    /// [`TcpConn::max_held`] for a peer that is not reading it.
    fn within_bound(&self, tx: &mut TxQueue) -> Result<(), ()> {
        let held = tx.held();
        if held <= self.max_held {
            return Ok(());
        }
        tracing::warn!(
            qp_num = self.qp_num,
            held,
            max = self.max_held,
            "closing connection: the peer is not reading what is sent to it"
        );
        tx.failed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        Err(())
    }

    /// Sends `head`, then `buf[start..end]` from the buffer itself, after
    /// everything sent before. Never blocks; `Err` as [`TcpConn::send`].
    fn send_lent(
        &self,
        head: &[u8],
        buf: Arc<SoftBuffer>,
        start: usize,
        end: usize,
    ) -> Result<(), ()> {
        let mut tx = self.tx();
        if tx.failed || tx.closing {
            return Err(());
        }
        tx.sent_since_look = true;
        tx.queue(&[IoSlice::new(head)], 0);
        tx.lent.push_back(LentChunk {
            buf,
            at: start,
            end,
            then: Vec::new(),
        });
        if tx.pump(&self.stream).is_err() {
            tx.failed = true;
            return Err(());
        }
        self.within_bound(&mut tx)
    }

    /// Writes what is queued, as far as the socket takes it; a socket that
    /// failed fails the queue pair, told on `cq` (the polling thread's).
    fn flush(&self, cq: &CqInner) {
        let mut tx = self.tx();
        // Whatever it writes (a TLS session's own records too) is looked
        // at by the next heartbeat.
        tx.sent_since_look = true;
        if tx.failed {
            return;
        }
        if tx.pump(&self.stream).is_err() {
            tx.failed = true;
            drop(tx);
            // Told now: the read that finds the socket closed next would
            // find the queue pair dead already and tell nobody, leaving
            // its calls (and a cancel the peer sent before it went) unheard.
            self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
        }
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

    /// Rejects a write: the NAK goes out, then the connection closes.
    fn nak(&self, wr_id: u64, imm: u32, status: WcStatus, cq: &CqInner) {
        let _ = self.send(&[IoSlice::new(&nak_message(wr_id, status))], &[]);
        self.tx().closing = true;
        if !self.dead.swap(true, Ordering::AcqRel) {
            cq.push(Completion {
                wr_id: 0,
                qp_num: self.qp_num,
                kind: CompletionKind::RecvImm { imm, byte_len: 0 },
                status,
            });
        }
    }

    /// Where a read picks up: `Some` if the connection is over or still
    /// stalled, after bytes left over from a stall.
    fn resume(&self, rx: &mut Rx, cq: &CqInner) -> Option<ReadOutcome> {
        if matches!(rx.state, RxState::Done) {
            return Some(ReadOutcome::Closed);
        }
        // Bytes left over from a stall come first.
        if let RxState::Stalled { .. } = rx.state {
            match self.retry_stalled(rx, cq) {
                Step::Go => {}
                Step::Wait => return Some(ReadOutcome::More),
                Step::Stop => return Some(ReadOutcome::Closed),
            }
        }
        if !rx.carry.is_empty() {
            let carry = std::mem::take(&mut rx.carry);
            match self.parse(rx, &carry, cq) {
                Parsed::All => {}
                Parsed::Stalled(rest) => {
                    rx.carry = carry[carry.len() - rest..].to_vec();
                    return Some(ReadOutcome::More);
                }
                Parsed::Stop => return Some(ReadOutcome::Closed),
            }
        }
        None
    }

    /// Reads what the socket has, up to the read budget.
    fn read_ready(&self, scratch: &mut [u8], cq: &CqInner) -> ReadOutcome {
        if self.tls {
            return self.read_ready_tls(scratch, cq);
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(outcome) = self.resume(&mut rx, cq) {
            return outcome;
        }
        let mut budget = READ_BUDGET;
        loop {
            let read = match rx.direct(|dst| (&self.stream).read(dst)) {
                Some(r) => r.map(|n| (n, true)),
                None => (&self.stream).read(scratch).map(|n| (n, false)),
            };
            match read {
                // Peer gone (or we closed: then `dead` is set and nothing is pushed).
                Ok((0, _)) => return self.end_read(&mut rx, cq),
                Ok((n, direct)) => {
                    budget = budget.saturating_sub(n);
                    if let Some(outcome) = self.take_read(&mut rx, n, direct, scratch, cq) {
                        return outcome;
                    }
                    if budget == 0 {
                        return ReadOutcome::More;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(_) => return self.end_read(&mut rx, cq),
            }
        }
    }

    /// Takes the `n` bytes a read placed in the ring (`direct`: into the
    /// payload under way, which completes once whole) or in `scratch`
    /// (parsed as the stream's continuation); `Some` when reading must
    /// stop for now.
    fn take_read(
        &self,
        rx: &mut Rx,
        n: usize,
        direct: bool,
        scratch: &[u8],
        cq: &CqInner,
    ) -> Option<ReadOutcome> {
        if direct {
            if matches!(&rx.state, RxState::ReadData(r) if r.have == r.len) {
                self.read_done(rx, cq);
                return None;
            }
            if !matches!(&rx.state, RxState::Payload(w) if w.have == w.len) {
                return None;
            }
            let RxState::Payload(w) = std::mem::replace(&mut rx.state, RxState::Done) else {
                unreachable!("checked above")
            };
            return match self.complete(rx, w, cq, None) {
                Step::Go => None,
                Step::Wait => Some(ReadOutcome::More),
                Step::Stop => Some(ReadOutcome::Closed),
            };
        }
        match self.parse(rx, &scratch[..n], cq) {
            Parsed::All => None,
            Parsed::Stalled(rest) => {
                rx.carry = scratch[n - rest..n].to_vec();
                Some(ReadOutcome::More)
            }
            Parsed::Stop => Some(ReadOutcome::Closed),
        }
    }

    /// The peer is gone or the socket failed: the reader stops and the
    /// connection fails.
    fn end_read(&self, rx: &mut Rx, cq: &CqInner) -> ReadOutcome {
        rx.state = RxState::Done;
        self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
        ReadOutcome::Closed
    }

    /// [`TcpConn::read_ready`] over TLS: rustls reads and decrypts the
    /// socket's bytes, and the plaintext goes through the same state
    /// machine and bounds checks; a payload with at least [`DIRECT_READ`]
    /// bytes to come is copied from rustls straight into its ring. The
    /// budget counts the bytes read from the socket.
    fn read_ready_tls(&self, scratch: &mut [u8], cq: &CqInner) -> ReadOutcome {
        /// What one look at the session found.
        enum Got {
            /// Plaintext, placed in the ring (`true`) or in `scratch`.
            Bytes(usize, bool),
            /// Ciphertext read from the socket: look again.
            Again,
            /// The socket is empty.
            Drained,
            /// The budget is spent: read again at the next poll.
            Budget,
            /// The connection is over (why, if it failed).
            Ended(Option<String>),
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(outcome) = self.resume(&mut rx, cq) {
            return outcome;
        }
        let mut budget = READ_BUDGET;
        loop {
            let got = {
                let mut guard = self.tx();
                let tx = &mut *guard;
                let Some(session) = &mut tx.tls else {
                    unreachable!("a TLS connection has a session")
                };
                let read = match rx.direct(|dst| session.read_plaintext(dst)) {
                    Some(r) => r.map(|n| (n, true)),
                    None => session.read_plaintext(scratch).map(|n| (n, false)),
                };
                match read {
                    Ok((0, _)) => Got::Ended(None), // the peer's close_notify
                    Ok((n, direct)) => Got::Bytes(n, direct),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        // Nothing decrypted is left: read the socket.
                        let r = session.read_tls(&self.stream);
                        // Alerts and key updates rustls answers with,
                        // looked at by the next heartbeat as any write.
                        if session.wants_write() {
                            tx.sent_since_look = true;
                            let _ = session.flush(&self.stream);
                        }
                        match r {
                            Ok(0) => Got::Ended(None),
                            Ok(n) => {
                                budget = budget.saturating_sub(n);
                                if budget == 0 { Got::Budget } else { Got::Again }
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => Got::Drained,
                            Err(e) if e.kind() == ErrorKind::Interrupted => Got::Again,
                            Err(e) if e.kind() == ErrorKind::InvalidData => {
                                Got::Ended(Some(e.to_string()))
                            }
                            Err(_) => Got::Ended(None),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => Got::Ended(None),
                    Err(e) => Got::Ended(Some(e.to_string())),
                }
            };
            match got {
                Got::Again => {}
                Got::Drained => return ReadOutcome::Drained,
                Got::Budget => return ReadOutcome::More,
                Got::Ended(why) => {
                    if let Some(why) = why {
                        tracing::warn!(qp_num = self.qp_num, %why, "closing connection: TLS failed");
                    }
                    // Peer gone (or we closed: then `dead` is set and nothing is pushed).
                    return self.end_read(&mut rx, cq);
                }
                Got::Bytes(n, direct) => {
                    if let Some(outcome) = self.take_read(&mut rx, n, direct, scratch, cq) {
                        return outcome;
                    }
                }
            }
        }
    }

    /// Parses `data` as the continuation of the byte stream.
    fn parse(&self, rx: &mut Rx, mut data: &[u8], cq: &CqInner) -> Parsed {
        while !data.is_empty() {
            match &mut rx.state {
                RxState::Head { head, have } => {
                    let need = match head[0] {
                        _ if *have == 0 => 1,
                        TAG_WRITE | TAG_WRITE_SIGNALED | TAG_READ | TAG_READ_RESP => WRITE_HEADER,
                        TAG_ACK => ACK_LEN,
                        TAG_NAK => NAK_LEN,
                        other => {
                            tracing::warn!(
                                qp_num = self.qp_num,
                                tag = other,
                                "peer sent an unknown message"
                            );
                            rx.state = RxState::Done;
                            let status = WcStatus::Other {
                                vendor: other as u32,
                            };
                            self.fail_local(0, CompletionKind::Send, status, cq);
                            return Parsed::Stop;
                        }
                    };
                    let take = (need - *have).min(data.len());
                    head[*have..*have + take].copy_from_slice(&data[..take]);
                    *have += take;
                    data = &data[take..];
                    if *have == 1 {
                        continue; // the tag says how much more to read
                    }
                    if *have < need {
                        continue;
                    }
                    let head = *head;
                    match self.on_head(rx, &head, cq) {
                        Step::Go => {}
                        Step::Wait => return Parsed::Stalled(data.len()),
                        Step::Stop => return Parsed::Stop,
                    }
                }
                RxState::Payload(w) => {
                    let take = (w.len - w.have).min(data.len());
                    if let Some((region, start)) = &w.target {
                        let mut bytes = region.data.write().unwrap_or_else(|e| e.into_inner());
                        let at = start + w.have;
                        bytes[at..at + take].copy_from_slice(&data[..take]);
                    }
                    w.have += take;
                    data = &data[take..];
                    if w.have == w.len {
                        let RxState::Payload(w) = std::mem::replace(&mut rx.state, RxState::Done)
                        else {
                            unreachable!("matched above")
                        };
                        match self.complete(rx, w, cq, None) {
                            Step::Go => {}
                            Step::Wait => return Parsed::Stalled(data.len()),
                            Step::Stop => return Parsed::Stop,
                        }
                    }
                }
                RxState::ReadData(r) => {
                    let take = (r.len - r.have).min(data.len());
                    r.buf[r.have..r.have + take].copy_from_slice(&data[..take]);
                    r.have += take;
                    data = &data[take..];
                    if r.have == r.len {
                        self.read_done(rx, cq);
                    }
                }
                RxState::Stalled { .. } => return Parsed::Stalled(data.len()),
                RxState::Done => return Parsed::Stop,
            }
        }
        Parsed::All
    }

    /// The peer claimed what this side never did (`why`): the connection
    /// fails, reported as the work request `wr_id` of `kind`.
    fn refuse(
        &self,
        rx: &mut Rx,
        wr_id: u64,
        kind: CompletionKind,
        why: &str,
        cq: &CqInner,
    ) -> Step {
        tracing::warn!(qp_num = self.qp_num, wr_id, "closing connection: {why}");
        rx.state = RxState::Done;
        self.fail_local(wr_id, kind, WcStatus::Other { vendor: 0 }, cq);
        Step::Stop
    }

    /// A message's fixed part is in `head`.
    fn on_head(&self, rx: &mut Rx, head: &[u8; WRITE_HEADER], cq: &CqInner) -> Step {
        let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8"));
        let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4"));
        rx.state = RxState::Head {
            head: [0; WRITE_HEADER],
            have: 0,
        };
        match head[0] {
            TAG_ACK => {
                let wr_id = u64_at(1);
                let due = self.tx().acks_due.pop_front();
                if due != Some(wr_id) {
                    let why =
                        "the peer acknowledged a write that was not the next one sent signaled";
                    return self.refuse(rx, wr_id, CompletionKind::Send, why, cq);
                }
                cq.push(Completion {
                    wr_id,
                    qp_num: self.qp_num,
                    kind: CompletionKind::Send,
                    status: WcStatus::Success,
                });
                Step::Go
            }
            TAG_READ => self.serve_read(rx, u64_at(1), u64_at(9), u32_at(17), u32_at(25), cq),
            TAG_READ_RESP => {
                let (wr_id, len) = (u64_at(1), u32_at(25) as usize);
                // Only a read this side posted, of exactly its length:
                // nothing is allocated on the peer's say-so.
                let Some(buf) = self.lending.receive(wr_id, len as u64) else {
                    let why = "the peer answered a read that was not posted (or not of its length)";
                    return self.refuse(rx, wr_id, CompletionKind::Read, why, cq);
                };
                rx.state = RxState::ReadData(InRead {
                    wr_id,
                    buf,
                    len,
                    have: 0,
                });
                if len == 0 {
                    self.read_done(rx, cq);
                }
                Step::Go
            }
            TAG_NAK => {
                rx.state = RxState::Done;
                self.fail_local(u64_at(1), CompletionKind::Send, status_from(head[9]), cq);
                Step::Stop
            }
            tag => {
                let (wr_id, addr, rkey, imm) = (u64_at(1), u64_at(9), u32_at(17), u32_at(21));
                let len = u32_at(25) as usize;
                // Checked against the target region before any payload is
                // accepted: the length cannot make this side allocate.
                let target = if len == 0 {
                    None
                } else {
                    match super::target(&self.ring, addr, rkey, len) {
                        Ok(t) => Some(t),
                        Err(status) => {
                            tracing::warn!(
                                qp_num = self.qp_num,
                                len,
                                "closing connection: the peer wrote outside its ring"
                            );
                            rx.state = RxState::Done;
                            self.nak(wr_id, imm, status, cq);
                            return Step::Stop;
                        }
                    }
                };
                let w = InWrite {
                    wr_id,
                    imm,
                    len,
                    signaled: tag == TAG_WRITE_SIGNALED,
                    target,
                    have: 0,
                };
                if len == 0 {
                    self.complete(rx, w, cq, None)
                } else {
                    rx.state = RxState::Payload(w);
                    Step::Go
                }
            }
        }
    }

    /// A write's payload is placed: consume a receive, report it, and
    /// acknowledge it if it was signaled. With no receive posted, stall
    /// (stop reading) until one is, or fail after the RNR timeout counted
    /// from `stalled_since`.
    fn complete(
        &self,
        rx: &mut Rx,
        w: InWrite,
        cq: &CqInner,
        stalled_since: Option<Instant>,
    ) -> Step {
        if self.dead.load(Ordering::Acquire) {
            // Closed locally: nothing is delivered any more.
            rx.state = RxState::Done;
            return Step::Stop;
        }
        if !self.ctx.try_take_recv() {
            let since = stalled_since.unwrap_or_else(Instant::now);
            if since.elapsed() >= self.ctx.rnr_timeout {
                rx.state = RxState::Done;
                self.nak(w.wr_id, w.imm, WcStatus::RnrRetryExceeded, cq);
                return Step::Stop;
            }
            rx.state = RxState::Stalled { write: w, since };
            return Step::Wait;
        }
        rx.state = RxState::Head {
            head: [0; WRITE_HEADER],
            have: 0,
        };
        cq.push(Completion {
            wr_id: 0,
            qp_num: self.qp_num,
            kind: CompletionKind::RecvImm {
                imm: w.imm,
                byte_len: w.len as u32,
            },
            status: WcStatus::Success,
        });
        if w.signaled
            && self
                .send(&[IoSlice::new(&ack_message(w.wr_id))], &[])
                .is_err()
        {
            // Told now: nobody else learns that the socket failed.
            rx.state = RxState::Done;
            self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
            return Step::Stop;
        }
        Step::Go
    }

    /// The peer reads `len` bytes at `addr` of what this side lent under
    /// `rkey`: the bytes go out from the buffer itself. A read of anything
    /// not lent is rejected, and the connection closes.
    fn serve_read(
        &self,
        rx: &mut Rx,
        wr_id: u64,
        addr: u64,
        rkey: u32,
        len: u32,
        cq: &CqInner,
    ) -> Step {
        match self.lending.find(addr, rkey, u64::from(len)) {
            Ok((buf, start)) => {
                let head = read_head(TAG_READ_RESP, wr_id, 0, 0, len);
                if self
                    .send_lent(&head, buf, start, start + len as usize)
                    .is_err()
                {
                    rx.state = RxState::Done;
                    self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
                    return Step::Stop;
                }
                Step::Go
            }
            Err(status) => {
                tracing::warn!(
                    qp_num = self.qp_num,
                    len,
                    "closing connection: the peer read memory that was not lent to it"
                );
                rx.state = RxState::Done;
                self.nak(wr_id, 0, status, cq);
                Step::Stop
            }
        }
    }

    /// The bytes of the read under way are all in: it is complete.
    fn read_done(&self, rx: &mut Rx, cq: &CqInner) {
        let state = std::mem::replace(
            &mut rx.state,
            RxState::Head {
                head: [0; WRITE_HEADER],
                have: 0,
            },
        );
        let RxState::ReadData(r) = state else {
            unreachable!("called with a read under way")
        };
        self.lending.done(r.wr_id, r.buf);
        cq.push(Completion {
            wr_id: r.wr_id,
            qp_num: self.qp_num,
            kind: CompletionKind::Read,
            status: WcStatus::Success,
        });
    }

    fn retry_stalled(&self, rx: &mut Rx, cq: &CqInner) -> Step {
        match std::mem::replace(&mut rx.state, RxState::Done) {
            RxState::Stalled { write, since } => self.complete(rx, write, cq, Some(since)),
            other => {
                rx.state = other;
                Step::Go
            }
        }
    }
}

enum Step {
    Go,
    /// Stalled for a receive: stop reading for now.
    Wait,
    /// The connection failed.
    Stop,
}

enum Parsed {
    All,
    /// Stalled with this many bytes of the input still unparsed.
    Stalled(usize),
    Stop,
}

/// The sending half of a TCP queue pair.
pub(super) struct TcpWire {
    conn: Arc<TcpConn>,
    key: usize,
    cq: Arc<CqInner>,
    pending_hello: Option<Hello>,
}

/// Unanswered keepalive probes after which the kernel fails a tcp://
/// connection whose heartbeat it keeps ([`TcpWire::probe_every`]): the
/// first goes after one interval of silence, the rest one interval apart,
/// so a vanished host is noticed within four intervals of the last thing
/// it sent, inside [`crate::heartbeat_bound`].
pub(super) const KEEPALIVE_PROBES_FOR_HEARTBEAT: u32 = 3;

/// How long the peer's kernel has acknowledged nothing while bytes of
/// `stream` wait for it, from `TCP_INFO`; `None` unless bytes are in flight
/// and their retransmission timer ran out twice in a row (0.6 s at least),
/// or two window probes went unanswered.
/// That second condition keeps out a connection that merely has not heard
/// from its peer for a while: a dispatcher that stopped reading (a long
/// handler) and now sends again, whose peer's acks are on their way. A
/// peer that stopped reading (a zero window) acknowledges the window
/// probes, and nothing is in flight meanwhile: that is not silence either.
#[cfg(test)]
pub(super) fn unacknowledged_for(stream: &TcpStream) -> Option<Duration> {
    tcp_info(stream).and_then(|(info, _)| unacknowledged(&info))
}

/// See [`unacknowledged_for`].
fn unacknowledged(info: &libc::tcp_info) -> Option<Duration> {
    // Bytes in flight, sent twice more without an ack; or window probes
    // (the peer had advertised a zero window) twice unanswered: a live
    // peer's kernel answers every probe, which resets the count.
    let retried = info.tcpi_unacked > 0 && info.tcpi_retransmits >= 2;
    let probed = info.tcpi_probes >= 2;
    if !(retried || probed) {
        return None;
    }
    Some(Duration::from_millis(u64::from(info.tcpi_last_ack_recv)))
}

/// `TCP_INFO` of `stream`, if the kernel gives it, and whether it gave it
/// up to `tcpi_notsent_bytes` (Linux 4.6 on; older kernels fill less).
///
/// The soft fabrics' one use of `unsafe`: `TCP_INFO` is not in the
/// socket crates' safe APIs.
#[allow(unsafe_code)]
fn tcp_info(stream: &TcpStream) -> Option<(libc::tcp_info, bool)> {
    // SAFETY: plain old data; zero is valid.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for writes of `len` bytes, and `len` tells
    // the kernel so; the socket is open (`stream` owns it).
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    let full = len as usize
        >= std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + std::mem::size_of::<u32>();
    (rc == 0).then_some((info, full))
}

impl TcpWire {
    /// The socket, for tests that look at its options.
    #[cfg(test)]
    pub(super) fn stream(&self) -> &TcpStream {
        &self.conn.stream
    }

    /// Whether the last look found everything sent acknowledged (and the
    /// next may skip `TCP_INFO` unless something is sent meanwhile).
    #[cfg(test)]
    pub(super) fn settled(&self) -> bool {
        self.conn.tx().settled
    }

    /// See [`unacknowledged_for`]. A connection that sent nothing since a
    /// look found all it had sent acknowledged is not asked again: on a
    /// quiet connection the heartbeat's look then costs no system call.
    pub(super) fn unacknowledged_for(&self) -> Option<Duration> {
        let flushed = {
            let mut tx = self.conn.tx();
            if tx.settled && !tx.sent_since_look {
                return None;
            }
            tx.sent_since_look = false;
            tx.flushed()
        };
        let Some((info, full)) = tcp_info(&self.conn.stream) else {
            self.conn.tx().settled = false;
            return None;
        };
        let settled = flushed && full && info.tcpi_unacked == 0 && info.tcpi_notsent_bytes == 0;
        // A send meanwhile set `sent_since_look` again: the next look asks.
        self.conn.tx().settled = settled;
        unacknowledged(&info)
    }

    /// Heartbeats every `every`: from a second up, the kernel's keepalive
    /// probes the quiet connection, every whole second of `every`, and
    /// fails it after [`KEEPALIVE_PROBES_FOR_HEARTBEAT`] unanswered ones;
    /// neither side's process wakes up for it. Below a second (keepalive
    /// counts whole seconds), credit doorbells.
    ///
    /// `TCP_USER_TIMEOUT` is turned off then: it would also end the
    /// keepalive's probing no sooner than itself (20 s), and data left
    /// unacknowledged is what the dispatcher's heartbeat looks for
    /// ([`unacknowledged_for`]) at the same pace.
    pub(super) fn probe_every(&self, every: Duration) -> Result<Probe, FabricError> {
        let secs = every.as_secs();
        if secs == 0 {
            return Ok(Probe::Doorbell);
        }
        let every = Duration::from_secs(secs);
        bootstrap::keep_alive(
            &self.conn.stream,
            every,
            every,
            KEEPALIVE_PROBES_FOR_HEARTBEAT,
            None,
        )?;
        Ok(Probe::Transport)
    }

    /// Sends `count` writes with one vectored write. `Err` names the work
    /// request that failed and why.
    pub(super) fn write_batch<'a>(
        &mut self,
        count: usize,
        wr: &impl Fn(usize) -> WriteImm<'a, SoftRegion>,
    ) -> Result<(), (u64, WcStatus)> {
        let mut first = 0;
        while first < count {
            let n = (count - first).min(MAX_GATHER);
            let mut heads = [[0u8; WRITE_HEADER]; MAX_GATHER];
            let mut locals: [Option<(&SoftRegion, usize, usize)>; MAX_GATHER] = [None; MAX_GATHER];
            let mut signaled = [0u64; MAX_GATHER];
            let mut acks_due = 0;
            let mut last_wr = 0;
            for i in 0..n {
                let w = wr(first + i);
                let len = w.local.map_or(0, |(_, _, len)| len);
                heads[i] = write_head(&w, len as u32);
                locals[i] = w.local;
                last_wr = w.wr_id;
                if w.signaled {
                    signaled[acks_due] = w.wr_id;
                    acks_due += 1;
                }
            }
            // One read guard per distinct region (a batch comes from one
            // staging area): a second read lock on one RwLock could wait
            // behind a writer.
            let mut guards: [Option<RegionGuard<'_>>; MAX_GATHER] = [const { None }; MAX_GATHER];
            for (i, local) in locals[..n].iter().enumerate() {
                if let Some((region, _, _)) = local {
                    let known = guards[..i]
                        .iter()
                        .flatten()
                        .any(|(r, _)| Arc::ptr_eq(&r.inner, &region.inner));
                    if !known {
                        guards[i] = Some((
                            region,
                            region.inner.data.read().unwrap_or_else(|e| e.into_inner()),
                        ));
                    }
                }
            }
            let mut slices: [IoSlice<'_>; 2 * MAX_GATHER] = [IoSlice::new(&[]); 2 * MAX_GATHER];
            let mut used = 0;
            for i in 0..n {
                slices[used] = IoSlice::new(&heads[i]);
                used += 1;
                if let Some((region, off, len)) = locals[i] {
                    if len > 0 {
                        let (_, bytes) = guards
                            .iter()
                            .flatten()
                            .find(|(r, _)| Arc::ptr_eq(&r.inner, &region.inner))
                            .expect("a guard for every region");
                        slices[used] = IoSlice::new(&bytes[off..off + len]);
                        used += 1;
                    }
                }
            }
            self.conn
                .send(&slices[..used], &signaled[..acks_due])
                .map_err(|()| (last_wr, WcStatus::RetryExceeded))?;
            first += n;
        }
        Ok(())
    }

    /// Asks the peer for the bytes of `src` (a `READ`); its `READ_RESP`
    /// completes the read posted as `wr_id`.
    pub(super) fn read(&mut self, wr_id: u64, src: RemoteBuf) -> Result<(), WcStatus> {
        let len = u32::try_from(src.len).map_err(|_| WcStatus::Other { vendor: 0 })?;
        let head = read_head(TAG_READ, wr_id, src.addr, src.rkey, len);
        self.conn
            .send(&[IoSlice::new(&head)], &[])
            .map_err(|()| WcStatus::RetryExceeded)
    }

    pub(super) fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending_hello.take() {
            let bytes = hello.encode();
            self.conn.send(&[IoSlice::new(&bytes)], &[]).map_err(|()| {
                FabricError::unreachable("accept", "the connection failed during the handshake")
            })?;
        }
        Ok(())
    }

    /// Closes once what was posted is written, like an orderly close.
    pub(super) fn close(&mut self) {
        if let Some(io) = self.cq.io.get() {
            io.close(self.key, &self.conn);
        }
    }
}

/// Listens on `tcp://host:port`.
pub type TcpListener = crate::fabric::gate::Gate;

fn local_hello(qp_num: u32, local: &LocalSetup<'_, SoftRegion>) -> Hello {
    Hello {
        fabric: HelloFabric::Tcp,
        qp_num,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 0,
        ring: PeerRing {
            addr: local.ring.addr(),
            len: local.ring.len() as u64,
            rkey: local.ring.rkey(),
            max_message: local.max_message,
            max_streams: local.max_streams,
        },
    }
}

pub(super) fn connect(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    url: &FabricUrl,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    // The whole connect, dial and handshakes, is bounded by the timeout.
    let deadline = crate::bounded_deadline(local.timeout);
    let stream = bootstrap::dial(url, local.timeout)?;
    let qp_num = next_qp_num();
    setup(&stream, local.timeout)?;
    let mut link = Link::client(stream, local.tls.as_ref(), url, deadline)?;
    let hello = local_hello(qp_num, &local);
    bootstrap::send(&mut link, &hello)?;
    let peer = bootstrap::client_exchange(
        &mut link,
        &hello,
        HelloFabric::Tcp,
        local.credential.as_deref(),
    )?;
    finish(ctx, cq, link, qp_num, local.ring.binding(), peer, None)
}

pub(super) fn accept(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    admitted: Admitted,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    let qp_num = next_qp_num();
    let hello = local_hello(qp_num, &local);
    let (peer, identity) = (admitted.hello, admitted.identity.clone());
    finish(
        ctx,
        cq,
        admitted.into_link(),
        qp_num,
        local.ring.binding(),
        peer,
        Some((hello, identity)),
    )
}

fn setup(stream: &TcpStream, timeout: Duration) -> Result<(), FabricError> {
    stream
        .set_nodelay(true)
        .map_err(|e| FabricError::io("set_nodelay", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| FabricError::io("set_read_timeout", e))
}

fn finish(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    link: Link,
    qp_num: u32,
    ring: Weak<RegionInner>,
    peer: Hello,
    accepted: Option<(Hello, Option<String>)>,
) -> Result<Connected<SoftQp>, FabricError> {
    // Server side: the hello to send once established, and who the peer is.
    let (pending_hello, identity) = accepted.map_or((None, None), |(h, id)| (Some(h), id));
    let Link { stream, tls, .. } = link;
    stream
        .set_read_timeout(None)
        .map_err(|e| FabricError::io("set_read_timeout", e))?;
    bootstrap::set_keepalive(&stream)?;
    stream
        .set_nonblocking(true)
        .map_err(|e| FabricError::io("set_nonblocking", e))?;
    let peer_addr = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let dead = Arc::new(AtomicBool::new(false));
    let lending = Arc::new(Lending::default());
    let conn = Arc::new(TcpConn::new(
        qp_num,
        ring,
        ctx.clone(),
        stream,
        dead.clone(),
        lending.clone(),
        tls,
        peer.ring.len,
    ));
    let key = cq.io()?.register(conn.clone())?;
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            lending,
            cq: cq.clone(),
            dead,
            wire: Wire::Tcp(TcpWire {
                conn,
                key,
                cq: cq.clone(),
                pending_hello,
            }),
        },
        peer: peer.ring,
        peer_addr,
        identity,
        fabric: "tcp",
    })
}
