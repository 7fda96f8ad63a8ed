//! `rdma://`: the fabric over real RDMA verbs (InfiniBand, RoCE, Soft-RoCE).
//!
//! One [`VerbsFabric`] is one device context: a protection domain, a shared
//! receive queue of zero-length receives, a receive CQ and a send CQ that
//! share one completion channel. Every connection's RC queue pair is created
//! on that SRQ and those CQs, so receive resources do not grow with
//! connections. Receive rings are registered with local and remote write
//! only; frames arrive as RDMA WRITE WITH IMMEDIATE, and the receive
//! completion (`IBV_WC_RECV_RDMA_WITH_IMM`, `imm_data`, `qp_num`) is the
//! doorbell.
//!
//! Connections are set up by the `bootstrap` handshake
//! over TCP on the URL's port. That TCP connection stays open as a liveness
//! channel: when the peer process dies, its kernel closes it, and the
//! connection fails at once instead of at the next retry timeout; TCP
//! keepalive on it notices a dead host within [`KEEPALIVE_BOUND`]. QP errors
//! reported as asynchronous events (`ibv_get_async_event`) fail the
//! connection too, and fatal ones (device, CQ or SRQ error) fail every
//! connection of the context.
//!
//! The SRQ is kept full two ways: every receive completion polled posts one
//! receive (the fast path), and the SRQ limit event tops it up to capacity
//! when it runs low anyway (receives whose completions were never polled,
//! such as those of a destroyed queue pair, whose entries mlx5 removes from
//! the CQ), so a sender meets RNR only when the poller falls behind.
//!
//! The pieces: `device.rs` (which device, port and GID), `cq.rs` (a
//! dispatcher's completion queue), `qp.rs` (a queue pair's life cycle and
//! posts), `events.rs` (made-up completions, incarnations, async events),
//! `liveness.rs` (the liveness sockets and their watcher thread),
//! `region.rs` (registered memory) and `resources.rs` (RAII wrappers of the
//! verbs objects); this file holds the context and the `Fabric` impl.
//!
//! All `unsafe` code of the crate lives in this module.
#![allow(unsafe_code)]

mod cq;
mod device;
mod events;
mod liveness;
mod qp;
mod region;
mod resources;

use crate::fabric::cache::{self, Cache};
use cq::CqInner;
pub use cq::VerbsCq;
pub use device::DeviceChoice;
pub(crate) use device::DeviceSelection;
use device::choose;
use events::{LiveQp, Side, SideState};
use ibverbs_sys as ffi;
pub use liveness::KEEPALIVE_BOUND;
use liveness::{Liveness, Watched, set_keepalive};
pub use qp::VerbsQp;
use qp::{BIND_WR_ID, random_psn};
pub use region::{VerbsBuffer, VerbsRegion};
use resources::{CompChannel, Context, Cq, Mr, Mw, Pd, Qp, Srq, is_full};

use super::{
    Admission, Completion, CompletionKind, CompletionQueue, Connected, Fabric, FabricError,
    FabricErrorKind, FabricUrl, Listener, LocalSetup, PeerRing, Probe, QueuePair, Region,
    RemoteBuf, WcStatus, WriteImm,
};
use crate::fabric::bootstrap::{self, Hello, HelloFabric, Link};
use crate::fabric::gate::{Admitted, Gate};
use std::collections::{HashMap, VecDeque};
use std::net::Shutdown;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Send-queue entries asked for per queue pair: one less than a power of
/// two, because devices round the queue up to a power of two of slots and
/// Soft-RoCE keeps one slot more than asked. With 256 bytes of inline data
/// an entry takes 512 bytes in Soft-RoCE and 320 on mlx5, so this queue is
/// 64 KiB per connection (255 entries were 128 KiB). The protocol keeps at
/// most (127 - MAX_READS) / 2 = 55 writes in flight, each a whole batch of
/// frames: enough to keep a link busy with small messages, which is all
/// that goes through the ring.
const SQ_DEPTH: u32 = 127;
/// Reads of lent payloads a queue pair has in flight at most; more wait
/// in it for one to complete.
pub(super) const MAX_READS: usize = 16;
/// Most work requests chained in one `ibv_post_send`.
const MAX_CHAIN: usize = 16;
/// Zero-length receives kept on the SRQ at most.
const SRQ_MAX: u32 = 8192;
/// Completions polled per CQ per call.
const WC_BATCH: usize = 32;
/// The SRQ limit event fires when fewer than capacity / this receives remain.
const SRQ_LIMIT_FRACTION: u32 = 4;

struct Inner {
    choice: DeviceChoice,
    srq: Arc<Srq>,
    pd: Arc<Pd>,
    ctx: Arc<Context>,
    srq_depth: u32,
    /// CQ entries each completion queue gets.
    cqe: i32,
    /// The made-up completion queues of every completion queue created, so
    /// that async events reach the queue of their queue pair, and a fatal
    /// one all of them.
    sides: Mutex<Vec<std::sync::Weak<Side>>>,
    /// Why the context is unusable, after a fatal async event.
    fatal: Mutex<Option<String>>,
    /// Receives a failed post left unposted, retried at the next poll.
    srq_deficit: AtomicU32,
    /// SRQ limit events handled.
    srq_limit_events: AtomicU64,
    /// Receives posted by top-ups after SRQ limit events.
    srq_topped_up: AtomicU64,
    /// Watches the liveness connections of this context's queue pairs.
    liveness: Liveness,
    /// Whether each connection's ring is opened through a type-2 memory
    /// window bound to its queue pair (else: registered for remote write).
    windows: bool,
    /// Large-message buffers kept registered for reuse.
    buffers: Arc<Cache<Arc<Mr>>>,
    /// RDMA READs a queue pair keeps in flight (and serves for its peer).
    rd_atomic: u8,
}

/// A verbs device context with its SRQ and CQs; see the module docs.
#[derive(Clone)]
pub struct VerbsFabric {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("choice", &self.inner.choice)
            .finish()
    }
}

fn set_nonblocking(fd: i32, op: &'static str) -> Result<(), FabricError> {
    // SAFETY: fcntl on a file descriptor we own; no pointers involved.
    let rc = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        }
    };
    if rc < 0 {
        return Err(FabricError::io(op, std::io::Error::last_os_error()));
    }
    Ok(())
}

impl VerbsFabric {
    /// Opens the device the URL or environment selects (see module docs).
    pub fn open(url: &FabricUrl) -> Result<VerbsFabric, FabricError> {
        VerbsFabric::open_with(url, SRQ_MAX, true)
    }

    /// Opens with an SRQ of at most `srq_max` receives, and memory windows
    /// if `windows` and the device has them.
    fn open_with(url: &FabricUrl, srq_max: u32, windows: bool) -> Result<VerbsFabric, FabricError> {
        let (ctx, choice) = choose(url)?;
        let ctx = Arc::new(ctx);
        let attr = ctx.query_device()?;
        let srq_depth = srq_max.min(attr.max_srq_wr.max(16) as u32 - 1);
        let cqe = (srq_depth as i32 * 2).min(attr.max_cqe);
        let pd = Arc::new(Pd::new(ctx.clone())?);
        set_nonblocking(ctx.async_fd(), "fcntl(async fd)")?;
        let srq = Arc::new(Srq::new(pd.clone(), srq_depth)?);
        srq.fill()?;
        srq.arm_limit(srq.capacity / SRQ_LIMIT_FRACTION)?;
        let windows = windows && has_type2_windows(&attr, &pd, &choice.device);
        tracing::debug!(device = %choice.device, port = choice.port, gid_index = choice.gid_index, "opened RDMA device");
        let fabric = VerbsFabric {
            inner: Arc::new(Inner {
                choice,
                srq,
                pd,
                ctx,
                srq_depth,
                cqe,
                sides: Mutex::new(Vec::new()),
                fatal: Mutex::new(None),
                srq_deficit: 0.into(),
                srq_limit_events: 0.into(),
                srq_topped_up: 0.into(),
                liveness: Liveness::default(),
                windows,
                buffers: Arc::new(Cache::default()),
                rd_atomic: rd_atomic(&attr),
            }),
        };
        // Async events are read by the liveness watcher's thread, which
        // blocks on their fd, and by a dispatcher about to sleep; never by
        // a spinning poller (a syscall per look).
        let weak = Arc::downgrade(&fabric.inner);
        fabric.inner.liveness.on_async_events(
            fabric.inner.ctx.async_fd(),
            Arc::new(move || {
                if let Some(inner) = weak.upgrade() {
                    VerbsFabric { inner }.drain_async();
                }
            }),
        );
        Ok(fabric)
    }

    /// Whether a connection's peer can write only into that connection's
    /// ring: each ring is opened through a type-2 memory window bound to
    /// its queue pair. `false` on a device without such windows (a warning
    /// said so when it was opened): rings are then writable by any queue
    /// pair connected to this context that knows their address and rkey.
    pub fn isolates_connections(&self) -> bool {
        self.inner.windows
    }

    /// The device, port and GID in use.
    pub fn choice(&self) -> &DeviceChoice {
        &self.inner.choice
    }

    /// How many zero-length receives the SRQ can hold.
    pub fn srq_depth(&self) -> u32 {
        self.inner.srq_depth
    }
}

/// Accepts `rdma://` connections (the handshake's TCP port).
#[derive(Debug)]
pub struct VerbsListener {
    acceptor: Gate,
}

impl Listener<VerbsFabric> for VerbsListener {
    fn next(&self) -> Result<Option<Admitted>, FabricError> {
        self.acceptor.next()
    }
    fn local_url(&self) -> String {
        self.acceptor.local_url("rdma")
    }
    fn close(&self) {
        self.acceptor.close();
    }
    fn refuse(&self, incoming: Admitted, code: crate::Code, why: &str) {
        incoming.refuse(code, why);
    }
}

impl Fabric for VerbsFabric {
    type Region = VerbsRegion;
    type Qp = VerbsQp;
    type Cq = VerbsCq;
    type Listener = VerbsListener;
    type Incoming = Admitted;

    /// 128 KiB, half the soft fabrics' ring: here every byte of a ring, and
    /// of the peer's staging area for it, is pinned while the connection
    /// lives. 128 KiB still holds twice the bandwidth-delay product of a
    /// 100 Gb/s link with a 5 µs round trip, and payloads above the
    /// rendezvous threshold travel outside the ring.
    const DEFAULT_RING_SIZE: usize = 128 << 10;

    /// Memory peers write is registered without remote access when the
    /// device has type-2 windows: each connection opens it to its own queue
    /// pair through a window.
    fn buffer(&self, len: usize) -> Result<VerbsBuffer, FabricError> {
        let i = &self.inner;
        VerbsBuffer::take(&i.buffers, &i.pd, len, i.windows)
    }

    fn trim_buffers(&self, now: std::time::Instant) {
        self.inner.buffers.trim(now);
    }

    fn register(&self, len: usize, remote_write: bool) -> Result<VerbsRegion, FabricError> {
        let i = &self.inner;
        Ok(VerbsRegion {
            mr: Arc::new(Mr::new(i.pd.clone(), len, remote_write, i.windows)?),
        })
    }

    /// Does nothing: this fabric keeps its SRQ full by itself. It fills the
    /// SRQ to capacity when opened, posts one receive for every receive
    /// completion it polls, and tops the SRQ up to capacity when the device
    /// raises the SRQ limit event (a quarter left), which covers receives
    /// whose completions are never polled. The dispatcher provisions for the
    /// worst case of every connection at once, more than a device SRQ holds;
    /// a burst beyond capacity is covered by RNR retries (`rnr_retry = 7`
    /// retries without limit), which delay a sender while receives are
    /// reposted, never fail it.
    fn post_recv(&self, _count: u32) -> Result<(), FabricError> {
        Ok(())
    }

    fn create_cq(&self) -> Result<VerbsCq, FabricError> {
        let i = &self.inner;
        let channel = Arc::new(CompChannel::new(i.ctx.clone())?);
        set_nonblocking(channel.fd(), "fcntl(comp channel)")?;
        let recv_cq = Arc::new(Cq::new(&i.ctx, i.cqe, channel.clone())?);
        let send_cq = Arc::new(Cq::new(&i.ctx, i.cqe, channel.clone())?);
        let side = Side::new()?;
        if let Some(why) = &*i.fatal.lock().unwrap_or_else(|e| e.into_inner()) {
            side.lock().fatal = Some(why.clone());
        }
        i.sides
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&side));
        Ok(VerbsCq {
            inner: Arc::new(CqInner {
                send_cq,
                recv_cq,
                channel,
                side,
                fabric: self.clone(),
            }),
        })
    }

    fn listen(&self, url: &FabricUrl, admission: Admission) -> Result<VerbsListener, FabricError> {
        Ok(VerbsListener {
            acceptor: Gate::bind(url, HelloFabric::Rdma, admission)?,
        })
    }

    fn connect(
        &self,
        url: &FabricUrl,
        local: LocalSetup<'_, VerbsRegion>,
        cq: &VerbsCq,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        // The whole connect, dial and handshakes, is bounded by the timeout.
        let deadline = crate::bounded_deadline(local.timeout);
        let stream = bootstrap::dial(url, local.timeout)?;
        stream
            .set_nodelay(true)
            .map_err(|e| FabricError::io("set_nodelay", e))?;
        stream
            .set_read_timeout(Some(local.timeout))
            .map_err(|e| FabricError::io("set_read_timeout", e))?;
        // TLS, if asked, before anything of ours crosses the wire: the
        // hellos carry the rings' addresses and keys.
        let mut link = Link::client(stream, local.tls.as_ref(), url, deadline)?;
        let mut qp = self.new_qp(cq)?;
        let window = self.window(local.ring)?;
        let psn = random_psn();
        // The window's rkey is known before its bind: the server writes to
        // it only after our first write, which follows the bind.
        let hello = self.hello(&qp.qp, psn, &local, window.as_ref());
        bootstrap::send(&mut link, &hello)?;
        let peer = bootstrap::client_exchange(
            &mut link,
            &hello,
            HelloFabric::Rdma,
            local.credential.as_deref(),
        )?;
        self.connect_qp(&qp.qp, psn, &peer)?;
        let window = self.bind(&mut qp, window, cq, deadline)?;
        self.finish(link, qp, window, peer, None, None)
    }

    fn accept(
        &self,
        admitted: Admitted,
        local: LocalSetup<'_, VerbsRegion>,
        cq: &VerbsCq,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        let deadline = crate::bounded_deadline(local.timeout);
        let peer = admitted.hello;
        let identity = admitted.identity.clone();
        let mut qp = self.new_qp(cq)?;
        let psn = random_psn();
        self.connect_qp(&qp.qp, psn, &peer)?;
        // Bound before the client learns the rkey: it writes as soon as it
        // has our hello.
        let window = self.window(local.ring)?;
        let window = self.bind(&mut qp, window, cq, deadline)?;
        let hello = self.hello(&qp.qp, psn, &local, window.as_ref());
        self.finish(
            admitted.into_link(),
            qp,
            window,
            peer,
            Some(hello),
            identity,
        )
    }
}

/// How many RDMA READs a queue pair keeps in flight, as initiator and as
/// responder: [`MAX_READS`], or fewer if the device allows fewer.
fn rd_atomic(attr: &ffi::ibv_device_attr) -> u8 {
    let device = attr.max_qp_rd_atom.min(attr.max_qp_init_rd_atom).max(1);
    (MAX_READS as i32).min(device) as u8
}

/// Whether the device has type-2 memory windows (and the provider the
/// verbs to use them): asked of the device, then tried once. Warns when it
/// has none, since connections are then not isolated from each other.
fn has_type2_windows(attr: &ffi::ibv_device_attr, pd: &Arc<Pd>, device: &str) -> bool {
    let caps = ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2A | ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2B;
    let why = if attr.device_cap_flags & caps == 0 {
        Some("the device has no type-2 memory windows".to_owned())
    } else {
        // A small region and one window, freed at once: the provider must
        // really allocate them.
        Mr::new(pd.clone(), 4096, true, true)
            .and_then(|mr| Mw::alloc(pd.clone(), Arc::new(mr)))
            .err()
            .map(|e| e.to_string())
    };
    match why {
        None => true,
        Some(why) => {
            tracing::warn!(
                device,
                %why,
                "RDMA connections are not isolated from each other: every receive ring is \
                 registered for remote write, so a peer that learns another connection's ring \
                 address and rkey can write into it (see ARCHITECTURE.md, \"Isolation\")"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests;
