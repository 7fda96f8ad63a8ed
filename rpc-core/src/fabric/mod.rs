//! Fabrics: what moves bytes between machines, with RDMA verbs semantics.
//!
//! A fabric offers exactly what the protocol needs from RDMA:
//!
//! - **registered memory** ([`Region`]): a buffer with an address and an
//!   rkey that a peer may write into (receive rings) or that the local side
//!   sends from (staging);
//! - **RC queue pairs** ([`QueuePair`]) connected one to one, that post
//!   [`WriteImm`]: an RDMA WRITE WITH IMMEDIATE to (remote address, rkey);
//! - **one shared receive queue** per context: zero-length receives that
//!   each incoming write-with-imm consumes ([`Fabric::post_recv`]);
//! - **completion queues** ([`CompletionQueue`]), one per dispatcher, each
//!   queue pair reporting to one: receive completions carry `imm`,
//!   `byte_len` and `qp_num`; send completions report signaled writes; an
//!   error completion means the queue pair is dead.
//!
//! [`soft`] implements these semantics in software, in one process
//! (`mem://`) or over TCP (`tcp://`). The verbs fabric (`rdma://`) maps them
//! onto `ibverbs`. Everything above the fabric is generic over [`Fabric`],
//! so tests on `mem://` run the real rings, credits and dispatcher.

#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod bootstrap;
#[cfg(not(feature = "testing"))]
pub(crate) mod bootstrap;
pub(crate) mod cache;
pub(crate) mod gate;
pub(crate) mod record;
pub mod soft;
pub mod tls;
#[cfg(feature = "verbs")]
pub mod verbs;

mod url;

#[cfg(test)]
pub(crate) mod conformance;

pub use cache::buffer_bytes;
pub use gate::Admission;
pub use tls::{ClientTls, ServerTls};
pub use url::{FabricUrl, Scheme};

use std::fmt;
use std::time::Duration;

/// Registered memory.
///
/// Reads and writes go through closures so that a software fabric can guard
/// the bytes against concurrent writes by a (possibly misbehaving) peer
/// without any `unsafe`.
pub trait Region: Send + Sync + 'static {
    /// Large-message buffers of this fabric (see [`Buffer`]).
    type Buffer: Buffer;
    /// The address a peer names in a write (for software fabrics, a virtual one).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True for a zero-length region.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The key a peer presents to write here (0 for local-only regions).
    fn rkey(&self) -> u32;
    /// Runs `f` on `len` bytes at `offset`. Panics if out of bounds: callers
    /// check bounds against [`Region::len`] first.
    fn read<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R;
    /// Runs `f` on `len` writable bytes at `offset`. Panics if out of bounds.
    fn write<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R;
    /// Copies `dst.len()` bytes at `offset` into `dst`, with no temporary
    /// buffer. Panics if out of bounds.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) {
        self.read(offset, dst.len(), |src| dst.copy_from_slice(src))
    }
}

/// Memory for one large message: plain bytes to the process, and, while a
/// queue pair lends it ([`QueuePair::lend`]) or reads into it
/// ([`QueuePair::post_read`]), memory the fabric may reach. Comes from the
/// fabric's registration cache ([`Fabric::buffer`]) and goes back to it
/// when dropped.
pub trait Buffer: std::ops::DerefMut<Target = [u8]> + Send + Sync + 'static {}

/// A buffer a peer lent: what an RDMA READ names to pull it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuf {
    /// Its address, as the peer's fabric names it.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The key that grants reading it, over this one connection.
    pub rkey: u32,
}

/// One RDMA WRITE WITH IMMEDIATE.
#[derive(Debug)]
pub struct WriteImm<'a, R> {
    /// Returned in the send completion if `signaled`.
    pub wr_id: u64,
    /// Local bytes to write: (region, offset, length); `None` for a zero-length write.
    pub local: Option<(&'a R, usize, usize)>,
    /// Remote address (the peer's region address plus offset).
    pub remote_addr: u64,
    /// The peer region's rkey.
    pub rkey: u32,
    /// Immediate data, delivered in the peer's receive completion.
    pub imm: u32,
    /// Whether to produce a send completion on success.
    pub signaled: bool,
}

/// A connected reliable queue pair.
pub trait QueuePair: Send + 'static {
    /// The region type writes are sent from.
    type Region: Region;
    /// This queue pair's number, as the peer's completions would name it locally.
    fn qp_num(&self) -> u32;
    /// Posts one write-with-imm. An `Err` means nothing was posted; a
    /// failure detected later arrives as an error completion.
    fn post_write_imm(&mut self, wr: &WriteImm<'_, Self::Region>) -> Result<(), FabricError>;
    /// Posts `count` write-with-imms, the `i`th being `wr(i)`, in order and
    /// as one batch where the fabric can (one doorbell on a NIC). An `Err`
    /// means some may not have been posted: the queue pair is then failed.
    fn post_write_imm_batch<'a>(
        &mut self,
        count: usize,
        wr: impl Fn(usize) -> WriteImm<'a, Self::Region>,
    ) -> Result<(), FabricError>
    where
        Self::Region: 'a,
    {
        (0..count).try_for_each(|i| self.post_write_imm(&wr(i)))
    }
    /// Most send-queue entries that may be outstanding (unreaped) at once.
    fn send_queue_depth(&self) -> usize;
    /// Lends `buf` to the peer for reading, over this queue pair only,
    /// until [`QueuePair::unlend`]: returns what the peer names it by. The
    /// queue pair keeps the buffer meanwhile (a lost connection frees it).
    fn lend(&mut self, buf: <Self::Region as Region>::Buffer) -> Result<RemoteBuf, FabricError>;
    /// Ends the loan of `rkey`: the peer can no longer read the buffer, which
    /// goes back to the cache once the fabric is done with it. `false` if
    /// nothing was lent under that key.
    fn unlend(&mut self, rkey: u32) -> bool;
    /// Posts an RDMA READ of the whole of `src` into the first `src.len`
    /// bytes of `dst`. It completes with a [`CompletionKind::Read`] of
    /// `wr_id`; then [`QueuePair::take_read`] gives `dst` back. An `Err`
    /// means nothing was posted (and `dst` is dropped).
    fn post_read(
        &mut self,
        wr_id: u64,
        dst: <Self::Region as Region>::Buffer,
        src: RemoteBuf,
    ) -> Result<(), FabricError>;
    /// The buffer of the read `wr_id`, once it completed.
    fn take_read(&mut self, wr_id: u64) -> Option<<Self::Region as Region>::Buffer>;
    /// Most reads this queue pair runs at once. One posted beyond them
    /// waits inside the queue pair, holding its buffer, where a cancel of
    /// its call cannot take it back; a dispatcher posts no more than this
    /// and keeps the rest waiting itself. Unlimited by default: a fabric
    /// whose reads all start when posted.
    fn max_reads(&self) -> usize {
        usize::MAX
    }
    /// Whether this queue pair lends buffers and reads (see
    /// [`QueuePair::lend`]); without, every message travels in the ring.
    fn lends(&self) -> bool {
        true
    }
    /// Called on an accepted queue pair once the local side is ready for the
    /// peer's traffic (the connection is registered with the dispatcher):
    /// sends the handshake's final message. The peer sends nothing before it.
    fn established(&mut self) -> Result<(), FabricError> {
        Ok(())
    }
    /// Sets up how a quiet connection proves its peer alive with heartbeats
    /// every `every` (see "Liveness" in `ARCHITECTURE.md`), and says how:
    /// by default with credit doorbells ([`Probe::Doorbell`]).
    fn probe_every(&mut self, every: Duration) -> Result<Probe, FabricError> {
        let _ = every;
        Ok(Probe::Doorbell)
    }
    /// Posts a zero-length RDMA WRITE without an immediate to the peer's
    /// `remote_addr` under `rkey`: a heartbeat its transport acknowledges
    /// and its process never sees ([`Probe::Silent`]). Only called when
    /// [`QueuePair::probe_every`] said so; an `Err` means nothing was posted.
    fn post_probe(
        &mut self,
        wr_id: u64,
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), FabricError> {
        let _ = (wr_id, remote_addr, rkey, signaled);
        Err(FabricError::invalid(
            "post_probe",
            "this fabric has no writes without an immediate",
        ))
    }
    /// How long the peer's transport has acknowledged nothing while writes
    /// sent on this queue pair wait for it, if the fabric can tell; `None`
    /// when nothing waits or it cannot. tcp:// asks the kernel; RDMA's
    /// reliable connections fail such writes themselves after their retries.
    fn unacknowledged_for(&self) -> Option<Duration> {
        None
    }
}

/// How a quiet connection's heartbeat reaches the peer (see
/// [`QueuePair::probe_every`]). Each must be acknowledged by the peer's
/// transport, not its process, so that a peer host that vanished is
/// noticed and a live but busy one never taken for dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// A zero-length credit doorbell: a write with an immediate, which
    /// takes a receive of the peer and wakes its dispatcher.
    Doorbell,
    /// A zero-length RDMA WRITE without an immediate
    /// ([`QueuePair::post_probe`]): the peer's NIC acknowledges it, and the
    /// peer's process spends nothing on it.
    Silent,
    /// The transport probes the peer itself (TCP keepalive at the
    /// heartbeat's interval): the dispatcher posts nothing.
    Transport,
}

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// A signaled write-with-imm (or any send, for error completions).
    Send,
    /// An RDMA READ posted with [`QueuePair::post_read`] (always reported).
    Read,
    /// An incoming write-with-imm consumed a shared-receive-queue entry.
    RecvImm {
        /// The immediate.
        imm: u32,
        /// Bytes written.
        byte_len: u32,
    },
}

/// Completion status, named after `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Success.
    Success,
    /// The peer rejected the write: unknown rkey or out of its region.
    RemoteAccess,
    /// The peer had no receive posted for too long (receiver not ready).
    RnrRetryExceeded,
    /// The peer is unreachable or closed its end.
    RetryExceeded,
    /// Flushed because the queue pair went to the error state.
    Flushed,
    /// The device reported an asynchronous error for the queue pair, or a
    /// fatal one for the whole context (device, completion or receive queue).
    DeviceError {
        /// The `ibv_event_type`.
        event: u32,
    },
    /// Another failure (the fabric's own code in `vendor`).
    Other {
        /// Fabric-specific status value.
        vendor: u32,
    },
}

/// One completion-queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id (receives: 0 on software fabrics).
    pub wr_id: u64,
    /// The local queue pair it belongs to.
    pub qp_num: u32,
    /// What completed.
    pub kind: CompletionKind,
    /// Success or why not. Any error means the queue pair is dead.
    pub status: WcStatus,
}

/// The peer's receive ring and limits, learned when connecting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRing {
    /// Address of the peer's receive ring.
    pub addr: u64,
    /// Its length (a power of two).
    pub len: u64,
    /// Its rkey.
    pub rkey: u32,
    /// Largest message (metadata + payload) the peer accepts.
    pub max_message: u32,
    /// Most streams the peer (a server) serves at once on the connection;
    /// 0 when it sets no limit (a client, or a server of a build before
    /// the limit). Up to 65,535 on the wire.
    pub max_streams: u32,
}

/// What a side brings to a connection.
pub struct LocalSetup<'a, R> {
    /// The receive ring the peer will write into.
    pub ring: &'a R,
    /// Largest message (metadata + payload) accepted.
    pub max_message: u32,
    /// Most streams served at once on the connection (a server's
    /// [`max_concurrent_streams`](crate::ServerBuilder::max_concurrent_streams));
    /// 0 for none (a client).
    pub max_streams: u32,
    /// How long the handshake may take.
    pub timeout: Duration,
    /// What the client presents to a server that asks for a credential
    /// (and requires the server to prove itself with); unused on accept.
    pub credential: Option<std::sync::Arc<dyn crate::auth::Credential>>,
    /// TLS for the client's connection (tcp://, and the rdma:// handshake);
    /// unused on accept and on mem://.
    pub tls: Option<tls::ClientTls>,
}

impl<R: fmt::Debug> fmt::Debug for LocalSetup<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalSetup")
            .field("ring", self.ring)
            .field("max_message", &self.max_message)
            .field("max_streams", &self.max_streams)
            .field("timeout", &self.timeout)
            .field("credential", &self.credential.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// A queue pair connected to a peer, with the peer's ring.
#[derive(Debug)]
pub struct Connected<Q> {
    /// The queue pair.
    pub qp: Q,
    /// The peer's receive ring.
    pub peer: PeerRing,
    /// The peer's address, for logs.
    pub peer_addr: String,
    /// The identity the server's authenticator admitted the peer under
    /// (server side, when it requires a credential).
    pub identity: Option<String>,
    /// The fabric's URL scheme: `"mem"`, `"tcp"` or `"rdma"`.
    pub fabric: &'static str,
}

/// A completion queue: where one dispatcher learns what its queue pairs
/// completed. Every queue pair is created on one completion queue (see
/// [`Fabric::connect`]), and only that queue reports its completions, so a
/// dispatcher that owns a queue owns its connections' traffic outright.
pub trait CompletionQueue: Send + Sync + 'static {
    /// Moves up to `max` completions into `out`; returns how many.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> usize;
    /// Asks for the next completion to end a [`CompletionQueue::wait`]. A
    /// waiter arms, polls once more (a completion that arrived before arming
    /// may not end the wait), then waits if that found nothing.
    fn arm(&self) {}
    /// Blocks until a completion may be ready (one that arrived after the
    /// last [`CompletionQueue::arm`]), [`CompletionQueue::interrupt`] is
    /// called, or `timeout` passes. Spurious returns are allowed.
    fn wait(&self, timeout: Option<Duration>);
    /// Wakes a thread blocked in [`CompletionQueue::wait`], or makes the
    /// next wait return at once.
    fn interrupt(&self);
}

/// The default receive ring per connection on mem:// and tcp://, each
/// side: 256 KiB (see [`Fabric::DEFAULT_RING_SIZE`]).
pub(crate) const DEFAULT_RING_SIZE: usize = 256 << 10;

/// A fabric context: one protection domain and one shared receive queue,
/// shared by every queue pair created from it, whichever completion queue
/// each reports to.
pub trait Fabric: Send + Sync + Sized + Clone + 'static {
    /// Registered memory.
    type Region: Region;
    /// Connected queue pairs.
    type Qp: QueuePair<Region = Self::Region>;
    /// Completion queues (one per dispatcher).
    type Cq: CompletionQueue;
    /// Accepts connection attempts.
    type Listener: Listener<Self>;
    /// A connection attempt accepted by a listener, not yet set up.
    type Incoming: Incoming;

    /// The receive ring per connection when none is configured (bytes, a
    /// power of two).
    const DEFAULT_RING_SIZE: usize = DEFAULT_RING_SIZE;

    /// Registers `len` bytes; `remote_write` makes them writable by peers.
    fn register(&self, len: usize, remote_write: bool) -> Result<Self::Region, FabricError>;
    /// A buffer of `len` bytes for a large message, from the registration
    /// cache: registered already in the steady state. Its bytes are
    /// whatever the last user left (callers overwrite them).
    fn buffer(&self, len: usize) -> Result<<Self::Region as Region>::Buffer, FabricError>;
    /// Frees what the registration cache kept longer than it keeps a
    /// buffer above its size classes (see `fabric/cache.rs`); the
    /// dispatchers call this whenever they check their timers.
    fn trim_buffers(&self, now: std::time::Instant);
    /// Posts `count` zero-length receives to the shared receive queue.
    fn post_recv(&self, count: u32) -> Result<(), FabricError>;
    /// Creates a completion queue on this context.
    fn create_cq(&self) -> Result<Self::Cq, FabricError>;
    /// Starts listening on `url`, admitting connections as `admission` says.
    fn listen(&self, url: &FabricUrl, admission: Admission) -> Result<Self::Listener, FabricError>;
    /// Connects to a listener at `url`; the queue pair reports to `cq`.
    fn connect(
        &self,
        url: &FabricUrl,
        local: LocalSetup<'_, Self::Region>,
        cq: &Self::Cq,
    ) -> Result<Connected<Self::Qp>, FabricError>;
    /// Completes the set-up of an accepted connection attempt; the queue
    /// pair reports to `cq`.
    fn accept(
        &self,
        incoming: Self::Incoming,
        local: LocalSetup<'_, Self::Region>,
        cq: &Self::Cq,
    ) -> Result<Connected<Self::Qp>, FabricError>;
}

/// A connection attempt admitted by a listener, not yet accepted.
pub trait Incoming: Send + 'static {
    /// The receive ring the peer offers (its size and message limit); the
    /// accepting side sizes its own ring for this connection from it.
    fn peer_ring(&self) -> PeerRing;
}

/// Accepts connection attempts for a [`Fabric`].
pub trait Listener<F: Fabric>: Send + Sync + 'static {
    /// Blocks for the next attempt; `Ok(None)` once [`Listener::close`] was called.
    fn next(&self) -> Result<Option<F::Incoming>, FabricError>;
    /// Where peers connect, as a URL (with the actual port if 0 was asked).
    fn local_url(&self) -> String;
    /// Stops listening and unblocks [`Listener::next`].
    fn close(&self);
    /// Turns an attempt away, telling the peer why: its connect fails with
    /// `code`.
    fn refuse(&self, incoming: F::Incoming, code: crate::Code, why: &str);
}

/// A fabric-level failure, naming the operation.
#[derive(Debug)]
pub struct FabricError {
    /// What was attempted (for verbs, the failing `ibv_*` call).
    pub op: &'static str,
    /// What went wrong.
    pub kind: FabricErrorKind,
}

/// Categories of [`FabricError`].
#[derive(Debug)]
pub enum FabricErrorKind {
    /// An OS error.
    Io(std::io::Error),
    /// No such listener, or the peer refused or vanished.
    Unreachable(String),
    /// The peer broke the handshake or protocol.
    Protocol(String),
    /// Invalid arguments or configuration.
    Invalid(String),
    /// The queue pair is in the error state.
    QpDead,
    /// No RDMA device or support on this host.
    NoDevice(String),
    /// The peer refused the connection (or this side refused the peer),
    /// with the status code the caller should see.
    Refused(crate::Code, String),
}

impl FabricError {
    pub(crate) fn io(op: &'static str, e: std::io::Error) -> FabricError {
        FabricError {
            op,
            kind: FabricErrorKind::Io(e),
        }
    }
    pub(crate) fn unreachable(op: &'static str, why: impl Into<String>) -> FabricError {
        FabricError {
            op,
            kind: FabricErrorKind::Unreachable(why.into()),
        }
    }
    pub(crate) fn protocol(op: &'static str, why: impl Into<String>) -> FabricError {
        FabricError {
            op,
            kind: FabricErrorKind::Protocol(why.into()),
        }
    }
    pub(crate) fn refused(
        code: crate::Code,
        op: &'static str,
        why: impl Into<String>,
    ) -> FabricError {
        FabricError {
            op,
            kind: FabricErrorKind::Refused(code, why.into()),
        }
    }
    pub(crate) fn invalid(op: &'static str, why: impl Into<String>) -> FabricError {
        FabricError {
            op,
            kind: FabricErrorKind::Invalid(why.into()),
        }
    }
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            FabricErrorKind::Io(e) => write!(f, "{}: {e}", self.op),
            FabricErrorKind::Unreachable(s)
            | FabricErrorKind::Protocol(s)
            | FabricErrorKind::Invalid(s)
            | FabricErrorKind::NoDevice(s)
            | FabricErrorKind::Refused(_, s) => write!(f, "{}: {s}", self.op),
            FabricErrorKind::QpDead => write!(f, "{}: queue pair is in the error state", self.op),
        }
    }
}

impl std::error::Error for FabricError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            FabricErrorKind::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<FabricError> for crate::Status {
    fn from(e: FabricError) -> crate::Status {
        match e.kind {
            FabricErrorKind::Invalid(_) => crate::Status::invalid_argument(e.to_string()),
            FabricErrorKind::Refused(code, _) => crate::Status::new(code, e.to_string()),
            _ => crate::Status::unavailable(e.to_string()),
        }
    }
}

/// The `Status` for an `rdma://` URL this build or host cannot serve:
/// names the software fabrics as the alternative.
pub(crate) fn rdma_unavailable(why: &str) -> crate::Status {
    crate::Status::unavailable(format!(
        "rdma://: {why}; use tcp://host:port for the software fabric over TCP, or mem://name within one process"
    ))
}

/// Opens the verbs fabric for `url`, mapping "no device" to a clear status.
#[cfg(feature = "verbs")]
pub(crate) fn open_verbs(url: &FabricUrl) -> Result<verbs::VerbsFabric, crate::Status> {
    verbs::VerbsFabric::open(url).map_err(|e| match e.kind {
        FabricErrorKind::NoDevice(why) => rdma_unavailable(&why),
        _ => crate::Status::from(e),
    })
}

/// Without the `verbs` feature there is no `rdma://`.
#[cfg(not(feature = "verbs"))]
pub(crate) fn open_verbs(_url: &FabricUrl) -> Result<std::convert::Infallible, crate::Status> {
    Err(rdma_unavailable(
        "this build has no verbs fabric (rpc-core's `verbs` feature is off)",
    ))
}
