//! The software fabric: RDMA verbs semantics without RDMA hardware.
//!
//! A [`SoftFabric`] is a context like a verbs one: registered regions with
//! rkeys and one shared receive queue (a count of posted zero-length
//! receives), with completion queues ([`SoftCq`]) created from it, one per
//! dispatcher. Queue pairs come in two kinds:
//!
//! - `mem://name`: both ends in one process; a write-with-imm copies straight
//!   into the peer's region from the posting thread.
//! - `tcp://host:port`: a write-with-imm travels as a message over a TCP
//!   connection; whoever polls the receiving side's completion queue plays
//!   the NIC, reading the non-blocking sockets of its queue pairs.
//!
//! Either way the receiving side checks the rkey and bounds (a bad write is an
//! error completion on the sender, [`WcStatus::RemoteAccess`], and touches
//! nothing), consumes one shared-receive-queue entry (an empty queue behaves
//! like RNR: the write waits, then fails with [`WcStatus::RnrRetryExceeded`]),
//! copies the bytes, and posts a receive completion carrying the immediate,
//! the byte count and the local queue pair number.

mod mem;
mod queue;
#[cfg(feature = "testing")]
pub(crate) mod tcp;
#[cfg(not(feature = "testing"))]
mod tcp;

use super::cache::{self, Cache};
use super::{
    Admission, Buffer, Completion, CompletionKind, CompletionQueue, Connected, Fabric, FabricError,
    FabricUrl, LocalSetup, Probe, QueuePair, Region, RemoteBuf, Scheme, WcStatus, WriteImm,
};
use crate::pages::Pages;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

/// How long a write waits for a receive before failing like RNR retry exhaustion.
pub const DEFAULT_RNR_TIMEOUT: Duration = Duration::from_secs(5);
/// Send-queue depth the soft fabric reports (it never runs out itself).
const SOFT_SQ_DEPTH: usize = 4096;

static NEXT_QP_NUM: AtomicU32 = AtomicU32::new(1);
static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

fn next_qp_num() -> u32 {
    NEXT_QP_NUM.fetch_add(1, Ordering::Relaxed)
}

/// A software fabric context: registered regions and one shared receive
/// queue. Completion queues ([`SoftCq`]) are created from it, one per
/// dispatcher.
#[derive(Clone)]
pub struct SoftFabric {
    ctx: Arc<Ctx>,
}

impl std::fmt::Debug for SoftFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftFabric")
            .field("srq_posted", &self.ctx.srq.load(Ordering::Relaxed))
            .finish()
    }
}

pub(crate) struct Ctx {
    /// Large-message buffers kept for reuse.
    buffers: Arc<Cache<Pages>>,
    srq: AtomicU64,
    srq_waiters: Mutex<usize>,
    srq_cond: Condvar,
    rnr_timeout: Duration,
}

/// How a thread sleeps on an empty [`SoftCq`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sleep {
    Awake,
    /// On the condition variable (no sockets to watch).
    Cond,
    /// In the socket poller (tcp:// connections report to this queue).
    Io,
}

struct CqState {
    sleeping: Sleep,
    interrupted: bool,
}

/// A value alone on its cache lines (two, for the adjacent-line
/// prefetcher), so that one thread spinning on it does not take the line
/// from another thread writing its neighbours.
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// A poller counted in [`CqInner::sleepers`] until this is dropped, however
/// its sleep ends.
struct Sleeper<'a>(&'a AtomicUsize);

impl<'a> Sleeper<'a> {
    fn count_in(sleepers: &'a AtomicUsize) -> Sleeper<'a> {
        sleepers.fetch_add(1, Ordering::SeqCst);
        Sleeper(sleepers)
    }
}

impl Drop for Sleeper<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The shared part of a [`SoftCq`]: its entries, and the sockets of the
/// tcp:// queue pairs that report to it.
pub(crate) struct CqInner {
    entries: queue::EntryQueue,
    /// Pollers asleep or about to be: a push checks it after publishing
    /// its entry, a poller counts itself in before its last look.
    sleepers: Line<AtomicUsize>,
    state: Mutex<CqState>,
    cond: Condvar,
    /// The tcp:// sockets, set up with the first tcp:// queue pair.
    io: OnceLock<tcp::TcpIo>,
}

impl CqInner {
    pub(crate) fn push(&self, c: Completion) {
        self.entries.push(c);
        // Against the poller's count in `sleepers` and its last look at the
        // entries (Dekker): either it sees this entry or this sees it sleepy.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) == 0 {
            return;
        }
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match st.sleeping {
            Sleep::Awake => {}
            Sleep::Cond => self.cond.notify_one(),
            Sleep::Io => {
                if let Some(io) = self.io.get() {
                    io.wake();
                }
            }
        }
    }

    fn io(&self) -> Result<&tcp::TcpIo, FabricError> {
        if let Some(io) = self.io.get() {
            return Ok(io);
        }
        let io = tcp::TcpIo::new()?;
        // A racing thread may have set it first: either one serves.
        let _ = self.io.set(io);
        // A poller asleep on the condition variable cannot see sockets:
        // wake it, so that it sleeps in the socket poller from now on (it
        // checks for one under the same lock before sleeping).
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(st.sleeping, Sleep::Cond) {
            self.cond.notify_all();
        }
        drop(st);
        Ok(self.io.get().expect("just set"))
    }
}

/// A software completion queue. tcp:// queue pairs that report to it are
/// read by whoever polls it: the sockets are non-blocking and multiplexed
/// (epoll), and sleeping on an empty queue sleeps in the socket poller.
#[derive(Clone)]
pub struct SoftCq {
    inner: Arc<CqInner>,
}

impl std::fmt::Debug for SoftCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftCq")
            .field("entries", &self.inner.entries.len())
            .finish()
    }
}

impl SoftCq {
    fn new() -> SoftCq {
        SoftCq {
            inner: Arc::new(CqInner {
                entries: queue::EntryQueue::new(),
                sleepers: Line(AtomicUsize::new(0)),
                state: Mutex::new(CqState {
                    sleeping: Sleep::Awake,
                    interrupted: false,
                }),
                cond: Condvar::new(),
                io: OnceLock::new(),
            }),
        }
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let inner = &self.inner;
        if let Some(io) = inner.io.get() {
            io.poll_now(inner);
        }
        // An empty ring costs `pop_into` the same two loads as `is_empty`.
        inner.entries.pop_into(out, max)
    }

    fn wait(&self, timeout: Option<Duration>) {
        let inner = &self.inner;
        let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.interrupted {
            st.interrupted = false;
            return;
        }
        // Announce the sleep, then take a last look (see `CqInner::push`).
        // A push that sees the announcement takes the state lock, which
        // this thread holds until it sleeps, and then wakes it.
        let _counted = Sleeper::count_in(&inner.sleepers);
        std::sync::atomic::fence(Ordering::SeqCst);
        if !inner.entries.is_empty() {
            return;
        }
        if let Some(io) = inner.io.get() {
            st.sleeping = Sleep::Io;
            drop(st);
            io.wait(inner, timeout);
            let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            st.sleeping = Sleep::Awake;
            st.interrupted = false;
            return;
        }
        st.sleeping = Sleep::Cond;
        st = match timeout {
            Some(t) => {
                inner
                    .cond
                    .wait_timeout(st, t)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => inner.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
        };
        st.sleeping = Sleep::Awake;
        st.interrupted = false;
    }

    fn interrupt(&self) {
        let inner = &self.inner;
        let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.interrupted = true;
        match st.sleeping {
            Sleep::Awake => {}
            Sleep::Cond => inner.cond.notify_all(),
            Sleep::Io => {
                if let Some(io) = inner.io.get() {
                    io.wake();
                }
            }
        }
    }
}

impl Ctx {
    /// Takes one SRQ receive if one is posted.
    fn try_take_recv(&self) -> bool {
        let mut n = self.srq.load(Ordering::Acquire);
        while n > 0 {
            match self
                .srq
                .compare_exchange_weak(n, n - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(cur) => n = cur,
            }
        }
        false
    }

    /// Takes one SRQ receive, waiting up to the RNR timeout.
    fn take_recv(&self) -> bool {
        if self.try_take_recv() {
            return true;
        }
        // Receiver not ready: wait like RNR retries do, then give up.
        let deadline = Instant::now() + self.rnr_timeout;
        let mut waiters = self.srq_waiters.lock().unwrap_or_else(|e| e.into_inner());
        *waiters += 1;
        let got = loop {
            if self.try_take_recv() {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            waiters = self
                .srq_cond
                .wait_timeout(waiters, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        *waiters -= 1;
        got
    }

    /// What the receiving NIC does with an incoming write-with-imm of the
    /// queue pair `qp_num`, which reports to `cq` and whose peer may write
    /// only into `ring` (see [`target`]).
    #[allow(clippy::too_many_arguments)]
    fn deliver(
        &self,
        cq: &CqInner,
        qp_num: u32,
        ring: &Weak<RegionInner>,
        remote_addr: u64,
        rkey: u32,
        imm: u32,
        data: &[u8],
    ) -> Result<(), WcStatus> {
        let region = if data.is_empty() {
            None
        } else {
            Some(target(ring, remote_addr, rkey, data.len())?)
        };
        if !self.take_recv() {
            return Err(WcStatus::RnrRetryExceeded);
        }
        if let Some((region, start)) = region {
            let mut bytes = region.data.write().unwrap_or_else(|e| e.into_inner());
            bytes[start..start + data.len()].copy_from_slice(data);
        }
        cq.push(Completion {
            wr_id: 0,
            qp_num,
            kind: CompletionKind::RecvImm {
                imm,
                byte_len: data.len() as u32,
            },
            status: WcStatus::Success,
        });
        Ok(())
    }
}

impl SoftFabric {
    /// A new context with the default RNR timeout.
    pub fn new() -> SoftFabric {
        SoftFabric::with_rnr_timeout(DEFAULT_RNR_TIMEOUT)
    }

    /// A new context whose incoming writes wait at most `rnr_timeout` for a receive.
    pub fn with_rnr_timeout(rnr_timeout: Duration) -> SoftFabric {
        SoftFabric {
            ctx: Arc::new(Ctx {
                buffers: Arc::new(Cache::default()),
                srq: AtomicU64::new(0),
                srq_waiters: Mutex::new(0),
                srq_cond: Condvar::new(),
                rnr_timeout,
            }),
        }
    }

    /// Receives posted and not yet consumed.
    pub fn srq_posted(&self) -> u64 {
        self.ctx.srq.load(Ordering::Acquire)
    }
}

#[cfg(feature = "testing")]
impl SoftFabric {
    /// Connects a client queue pair on `self` to a server queue pair on
    /// `server`, in this process, without a listener or a handshake: for a
    /// harness that drives both ends on one thread. Returns (client, server).
    pub(crate) fn connect_pair(
        &self,
        client: (&SoftCq, LocalSetup<'_, SoftRegion>),
        server: (&SoftFabric, &SoftCq, LocalSetup<'_, SoftRegion>),
    ) -> (Connected<SoftQp>, Connected<SoftQp>) {
        mem::pair(
            (&self.ctx, &client.0.inner, client.1),
            (&server.0.ctx, &server.1.inner, server.2),
        )
    }
}

impl Default for SoftFabric {
    fn default() -> Self {
        SoftFabric::new()
    }
}

struct RegionInner {
    addr: u64,
    len: usize,
    /// 0 for a region peers may not write.
    rkey: u32,
    data: RwLock<Pages>,
}

/// Where a peer's write of `len` bytes at `remote_addr` with `rkey` lands
/// in `ring`, the one ring its queue pair advertised (the region and the
/// offset there); `RemoteAccess` if it has no right to. As a type-2 memory
/// window bound to the queue pair allows on verbs, a queue pair's peer can
/// reach only that ring: another connection's is out of reach even with
/// its address and rkey, and so is a ring already deregistered.
fn target(
    ring: &Weak<RegionInner>,
    remote_addr: u64,
    rkey: u32,
    len: usize,
) -> Result<(Arc<RegionInner>, usize), WcStatus> {
    let region = ring.upgrade().ok_or(WcStatus::RemoteAccess)?;
    if region.rkey == 0 || rkey != region.rkey {
        return Err(WcStatus::RemoteAccess);
    }
    let start = remote_addr
        .checked_sub(region.addr)
        .ok_or(WcStatus::RemoteAccess)?;
    let end = start
        .checked_add(len as u64)
        .ok_or(WcStatus::RemoteAccess)?;
    if end > region.len as u64 {
        return Err(WcStatus::RemoteAccess);
    }
    Ok((region, start as usize))
}

/// Memory registered with a [`SoftFabric`].
#[derive(Clone)]
pub struct SoftRegion {
    inner: Arc<RegionInner>,
}

impl SoftRegion {
    /// This region as the one ring a queue pair's peer may write into.
    fn binding(&self) -> Weak<RegionInner> {
        Arc::downgrade(&self.inner)
    }
}

impl std::fmt::Debug for SoftRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftRegion")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("rkey", &format_args!("{:#x}", self.inner.rkey))
            .finish()
    }
}

impl Region for SoftRegion {
    type Buffer = SoftBuffer;
    fn addr(&self) -> u64 {
        self.inner.addr
    }
    fn len(&self) -> usize {
        self.inner.len
    }
    fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    fn read<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let bytes = self.inner.data.read().unwrap_or_else(|e| e.into_inner());
        f(&bytes[offset..offset + len])
    }
    fn write<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut bytes = self.inner.data.write().unwrap_or_else(|e| e.into_inner());
        f(&mut bytes[offset..offset + len])
    }
}

/// A large-message buffer of the soft fabric: mapped pages, from the
/// context's cache and back to it when dropped.
pub struct SoftBuffer {
    pages: Option<Pages>,
    len: usize,
    class: usize,
    cache: Arc<Cache<Pages>>,
    /// When it was handed out (how long a large one is kept after).
    taken: std::time::Instant,
}

impl std::fmt::Debug for SoftBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl std::ops::Deref for SoftBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.pages.as_ref().expect("present until dropped")[..self.len]
    }
}

impl std::ops::DerefMut for SoftBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.pages.as_mut().expect("present until dropped")[..self.len]
    }
}

impl Drop for SoftBuffer {
    fn drop(&mut self) {
        if let Some(pages) = self.pages.take() {
            cache::count_in_use(self.class, false);
            // Not kept: unmapped here.
            drop(self.cache.give(self.class, pages, self.taken));
        }
    }
}

impl Buffer for SoftBuffer {}

/// A buffer a queue pair lends its peer, and where the peer names it.
struct Loan {
    addr: u64,
    buf: Arc<SoftBuffer>,
}

/// What a soft queue pair shares with whoever plays its NIC: the buffers
/// it lends (the peer's reads are served from them) and its reads under
/// way (their bytes land there).
#[derive(Default)]
pub(crate) struct Lending {
    loans: Mutex<HashMap<u32, Loan>>,
    next_key: AtomicU32,
    reads: Mutex<HashMap<u64, ReadSlot>>,
}

/// A read's destination: waiting for its bytes, or filled.
enum ReadSlot {
    /// Posted: `src.len` bytes are to come.
    Pending(SoftBuffer, RemoteBuf),
    /// Taken by the reader while the bytes arrive (tcp://).
    Receiving,
    /// Complete.
    Done(SoftBuffer),
}

impl Lending {
    fn lend(&self, buf: SoftBuffer) -> RemoteBuf {
        let n = self.next_key.fetch_add(1, Ordering::Relaxed);
        // Non-zero keys that do not repeat soon; virtual addresses like
        // regions', one 2^40-byte stretch per loan of a key.
        let rkey = (n.wrapping_mul(0x9E37_79B1) | 1).rotate_left(11);
        let addr = 0x8000_0000_0000u64 | (u64::from(n & 0x7f) << 40);
        let len = buf.len() as u64;
        let mut loans = self.loans.lock().unwrap_or_else(|e| e.into_inner());
        loans.insert(
            rkey,
            Loan {
                addr,
                buf: Arc::new(buf),
            },
        );
        RemoteBuf { addr, len, rkey }
    }

    fn unlend(&self, rkey: u32) -> bool {
        let mut loans = self.loans.lock().unwrap_or_else(|e| e.into_inner());
        loans.remove(&rkey).is_some()
    }

    /// The lent bytes a peer's read of `len` bytes at `addr` with `rkey`
    /// names: the buffer and the offset there; `RemoteAccess` if nothing
    /// lent under that key covers them.
    fn find(&self, addr: u64, rkey: u32, len: u64) -> Result<(Arc<SoftBuffer>, usize), WcStatus> {
        let loans = self.loans.lock().unwrap_or_else(|e| e.into_inner());
        let loan = loans.get(&rkey).ok_or(WcStatus::RemoteAccess)?;
        let start = addr.checked_sub(loan.addr).ok_or(WcStatus::RemoteAccess)?;
        let end = start.checked_add(len).ok_or(WcStatus::RemoteAccess)?;
        if end > loan.buf.len() as u64 {
            return Err(WcStatus::RemoteAccess);
        }
        Ok((loan.buf.clone(), start as usize))
    }

    fn post(&self, wr_id: u64, dst: SoftBuffer, src: RemoteBuf) {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        reads.insert(wr_id, ReadSlot::Pending(dst, src));
    }

    /// The destination of the read `wr_id` as its bytes start to arrive,
    /// if it expects exactly `len`.
    fn receive(&self, wr_id: u64, len: u64) -> Option<SoftBuffer> {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        match reads.get(&wr_id) {
            Some(ReadSlot::Pending(_, src)) if src.len == len => {}
            _ => return None,
        }
        match reads.insert(wr_id, ReadSlot::Receiving) {
            Some(ReadSlot::Pending(buf, _)) => Some(buf),
            _ => unreachable!("checked above"),
        }
    }

    fn done(&self, wr_id: u64, buf: SoftBuffer) {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        reads.insert(wr_id, ReadSlot::Done(buf));
    }

    fn take(&self, wr_id: u64) -> Option<SoftBuffer> {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        match reads.remove(&wr_id) {
            Some(ReadSlot::Done(buf)) => Some(buf),
            Some(other) => {
                reads.insert(wr_id, other);
                None
            }
            None => None,
        }
    }
}

/// How a soft queue pair reaches its peer.
enum Wire {
    Mem(mem::MemWire),
    Tcp(tcp::TcpWire),
}

/// A connected soft queue pair.
pub struct SoftQp {
    qp_num: u32,
    /// Its loans and reads.
    lending: Arc<Lending>,
    /// The completion queue this queue pair reports to.
    cq: Arc<CqInner>,
    dead: Arc<AtomicBool>,
    wire: Wire,
}

impl std::fmt::Debug for SoftQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftQp")
            .field("qp_num", &self.qp_num)
            .field("dead", &self.dead.load(Ordering::Relaxed))
            .finish()
    }
}

impl SoftQp {
    fn fail(&self, wr_id: u64, status: WcStatus) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            self.cq.push(Completion {
                wr_id,
                qp_num: self.qp_num,
                kind: CompletionKind::Send,
                status,
            });
        }
    }

    fn check_alive(&self) -> Result<(), FabricError> {
        if self.dead.load(Ordering::Acquire) {
            return Err(FabricError {
                op: "post_write_imm",
                kind: super::FabricErrorKind::QpDead,
            });
        }
        Ok(())
    }
}

impl QueuePair for SoftQp {
    type Region = SoftRegion;

    fn probe_every(&mut self, every: Duration) -> Result<Probe, FabricError> {
        match &self.wire {
            Wire::Mem(_) => Ok(Probe::Doorbell),
            Wire::Tcp(w) => w.probe_every(every),
        }
    }

    fn unacknowledged_for(&self) -> Option<Duration> {
        match &self.wire {
            Wire::Mem(_) => None,
            Wire::Tcp(w) => w.unacknowledged_for(),
        }
    }

    fn qp_num(&self) -> u32 {
        self.qp_num
    }

    fn post_write_imm(&mut self, wr: &WriteImm<'_, SoftRegion>) -> Result<(), FabricError> {
        self.post_write_imm_batch(1, |_| WriteImm { ..*wr })
    }

    fn post_write_imm_batch<'a>(
        &mut self,
        count: usize,
        wr: impl Fn(usize) -> WriteImm<'a, SoftRegion>,
    ) -> Result<(), FabricError>
    where
        SoftRegion: 'a,
    {
        self.check_alive()?;
        let result = match &mut self.wire {
            // In one process each write is applied before this returns: the
            // acknowledgement, and so the send completion, is immediate.
            Wire::Mem(w) => (0..count).try_for_each(|i| {
                let wr = wr(i);
                let r = match wr.local {
                    Some((region, off, len)) => region.read(off, len, |data| w.write(&wr, data)),
                    None => w.write(&wr, &[]),
                };
                if r.is_ok() && wr.signaled {
                    self.cq.push(Completion {
                        wr_id: wr.wr_id,
                        qp_num: self.qp_num,
                        kind: CompletionKind::Send,
                        status: WcStatus::Success,
                    });
                }
                r.map_err(|s| (wr.wr_id, s))
            }),
            // Over TCP the receiver's ACK produces the send completion.
            Wire::Tcp(w) => w.write_batch(count, &wr),
        };
        if let Err((wr_id, status)) = result {
            self.fail(wr_id, status);
        }
        Ok(())
    }

    fn send_queue_depth(&self) -> usize {
        SOFT_SQ_DEPTH
    }

    fn lend(&mut self, buf: SoftBuffer) -> Result<RemoteBuf, FabricError> {
        self.check_alive()?;
        Ok(self.lending.lend(buf))
    }

    fn unlend(&mut self, rkey: u32) -> bool {
        self.lending.unlend(rkey)
    }

    fn post_read(
        &mut self,
        wr_id: u64,
        dst: SoftBuffer,
        src: RemoteBuf,
    ) -> Result<(), FabricError> {
        self.check_alive()?;
        if src.len > dst.len() as u64 {
            return Err(FabricError::invalid(
                "post_read",
                format!("reading {} bytes into a buffer of {}", src.len, dst.len()),
            ));
        }
        self.lending.post(wr_id, dst, src);
        let result = match &mut self.wire {
            Wire::Mem(w) => w.read(wr_id, src, &self.lending, &self.cq, self.qp_num),
            Wire::Tcp(w) => w.read(wr_id, src),
        };
        if let Err(status) = result {
            self.fail(wr_id, status);
        }
        Ok(())
    }

    fn take_read(&mut self, wr_id: u64) -> Option<SoftBuffer> {
        self.lending.take(wr_id)
    }

    fn established(&mut self) -> Result<(), FabricError> {
        match &mut self.wire {
            Wire::Mem(w) => w.established(),
            Wire::Tcp(w) => w.established(),
        }
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.dead.store(true, Ordering::Release);
        match &mut self.wire {
            Wire::Mem(w) => w.close(),
            Wire::Tcp(w) => w.close(),
        }
    }
}

/// Listens for `mem://` or `tcp://` connections.
pub enum SoftListener {
    /// In-process.
    Mem(mem::MemListener),
    /// Over TCP.
    Tcp(tcp::TcpListener),
}

impl std::fmt::Debug for SoftListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use super::Listener;
        write!(f, "SoftListener({})", self.local_url())
    }
}

/// A connection attempt accepted by a [`SoftListener`].
pub enum SoftIncoming {
    /// In-process.
    Mem(mem::MemIncoming),
    /// Over TCP, its hello read.
    Tcp(crate::fabric::gate::Admitted),
}

impl crate::fabric::Incoming for SoftIncoming {
    fn peer_ring(&self) -> crate::fabric::PeerRing {
        match self {
            SoftIncoming::Mem(i) => i.peer_ring(),
            SoftIncoming::Tcp(a) => a.peer_ring(),
        }
    }
}

impl super::Listener<SoftFabric> for SoftListener {
    fn next(&self) -> Result<Option<SoftIncoming>, FabricError> {
        match self {
            SoftListener::Mem(l) => Ok(l.next().map(SoftIncoming::Mem)),
            SoftListener::Tcp(l) => Ok(l.next()?.map(SoftIncoming::Tcp)),
        }
    }
    fn local_url(&self) -> String {
        match self {
            SoftListener::Mem(l) => l.local_url(),
            SoftListener::Tcp(l) => l.local_url("tcp"),
        }
    }
    fn close(&self) {
        match self {
            SoftListener::Mem(l) => l.close(),
            SoftListener::Tcp(l) => l.close(),
        }
    }
    fn refuse(&self, incoming: SoftIncoming, code: crate::Code, why: &str) {
        match incoming {
            SoftIncoming::Mem(i) => i.refuse(code, why),
            SoftIncoming::Tcp(a) => a.refuse(code, why),
        }
    }
}

impl Fabric for SoftFabric {
    type Region = SoftRegion;
    type Qp = SoftQp;
    type Cq = SoftCq;
    type Listener = SoftListener;
    type Incoming = SoftIncoming;

    fn register(&self, len: usize, remote_write: bool) -> Result<SoftRegion, FabricError> {
        let id = NEXT_REGION.fetch_add(1, Ordering::Relaxed);
        // Virtual addresses: disjoint per region, with a guard gap between them.
        let addr = 0x1000_0000_0000u64 + (id << 36);
        // Non-zero, hard-to-guess-by-accident rkeys.
        let rkey = if remote_write {
            ((id as u32).wrapping_mul(0x9E37_79B1) | 1).rotate_left(7)
        } else {
            0
        };
        let inner = Arc::new(RegionInner {
            addr,
            len,
            rkey,
            data: RwLock::new(Pages::new(len).map_err(|e| FabricError::io("mmap", e))?),
        });
        Ok(SoftRegion { inner })
    }

    fn buffer(&self, len: usize) -> Result<SoftBuffer, FabricError> {
        let class = cache::class_of(len)
            .ok_or_else(|| FabricError::invalid("buffer", format!("{len} bytes is too large")))?;
        let cache = self.ctx.buffers.clone();
        let pages = match cache.take(class) {
            Some(p) => p,
            None => Pages::large(class).map_err(|e| FabricError::io("mmap", e))?,
        };
        cache::count_in_use(class, true);
        Ok(SoftBuffer {
            pages: Some(pages),
            len,
            class,
            taken: std::time::Instant::now(),
            cache,
        })
    }

    fn trim_buffers(&self, now: std::time::Instant) {
        self.ctx.buffers.trim(now);
    }

    fn post_recv(&self, count: u32) -> Result<(), FabricError> {
        self.ctx.srq.fetch_add(count as u64, Ordering::AcqRel);
        let waiters = self
            .ctx
            .srq_waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *waiters > 0 {
            self.ctx.srq_cond.notify_all();
        }
        Ok(())
    }

    fn create_cq(&self) -> Result<SoftCq, FabricError> {
        Ok(SoftCq::new())
    }

    fn listen(&self, url: &FabricUrl, admission: Admission) -> Result<SoftListener, FabricError> {
        match url.scheme {
            Scheme::Mem => Ok(SoftListener::Mem(mem::MemListener::bind(
                &url.host, admission,
            )?)),
            Scheme::Tcp => Ok(SoftListener::Tcp(tcp::TcpListener::bind(
                url,
                crate::fabric::bootstrap::HelloFabric::Tcp,
                admission,
            )?)),
            Scheme::Rdma | Scheme::Grpc => Err(FabricError::invalid(
                "listen",
                "the soft fabric serves mem:// and tcp:// only",
            )),
        }
    }

    fn connect(
        &self,
        url: &FabricUrl,
        local: LocalSetup<'_, SoftRegion>,
        cq: &SoftCq,
    ) -> Result<Connected<SoftQp>, FabricError> {
        match url.scheme {
            Scheme::Mem => mem::connect(&self.ctx, &cq.inner, &url.host, local),
            Scheme::Tcp => tcp::connect(&self.ctx, &cq.inner, url, local),
            Scheme::Rdma | Scheme::Grpc => Err(FabricError::invalid(
                "connect",
                "the soft fabric serves mem:// and tcp:// only",
            )),
        }
    }

    fn accept(
        &self,
        incoming: SoftIncoming,
        local: LocalSetup<'_, SoftRegion>,
        cq: &SoftCq,
    ) -> Result<Connected<SoftQp>, FabricError> {
        match incoming {
            SoftIncoming::Mem(i) => mem::accept(&self.ctx, &cq.inner, i, local),
            SoftIncoming::Tcp(s) => tcp::accept(&self.ctx, &cq.inner, s, local),
        }
    }
}

#[cfg(test)]
mod tests;
