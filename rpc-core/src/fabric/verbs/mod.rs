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
//! Connections are set up by the [`bootstrap`](crate::bootstrap) handshake
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
//! All `unsafe` code of the crate lives in this module.
#![allow(unsafe_code)]

mod liveness;
mod resources;

use ibverbs_sys as ffi;
pub use liveness::KEEPALIVE_BOUND;
use liveness::{Liveness, Watched, set_keepalive};
use resources::{CompChannel, Context, Cq, Mr, Pd, Qp, Srq, is_full};

use super::{
    Completion, CompletionKind, CompletionQueue, Connected, Fabric, FabricError, FabricErrorKind,
    FabricUrl, Listener, LocalSetup, PeerRing, QueuePair, Region, WcStatus, WriteImm,
};
use crate::bootstrap::{self, Acceptor, Hello, HelloFabric};
use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Send-queue entries per queue pair.
const SQ_DEPTH: u32 = 256;
/// Most work requests chained in one `ibv_post_send`.
const MAX_CHAIN: usize = 16;
/// Zero-length receives kept on the SRQ at most.
const SRQ_MAX: u32 = 8192;
/// Completions polled per CQ per call.
const WC_BATCH: usize = 32;
/// The SRQ limit event fires when fewer than capacity / this receives remain.
const SRQ_LIMIT_FRACTION: u32 = 4;
/// Busy polls between two looks at the async event queue (an idle poller
/// sees events at once: it blocks on their file descriptor).
const ASYNC_EVERY: u32 = 256;

/// Where the chosen device, port and GID came from.
#[derive(Debug, Clone)]
pub struct DeviceChoice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID index used for RoCE (and IB with a GRH).
    pub gid_index: u8,
    /// The GID.
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Whether the link layer is Ethernet (RoCE): addressing by GID.
    pub ethernet: bool,
    /// Active MTU (`ibv_mtu` value).
    mtu: ffi::ibv_mtu,
}

fn no_device(why: impl Into<String>) -> FabricError {
    FabricError {
        op: "rdma",
        kind: FabricErrorKind::NoDevice(why.into()),
    }
}

/// The GID's type as the kernel names it ("IB/RoCE v1", "RoCE v2").
fn gid_type(device: &str, port: u8, index: u8) -> Option<String> {
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path)
        .ok()
        .map(|t| t.trim().to_owned())
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// Finds the device, port and GID to use: `device=`/`port=`/`gid=` URL
/// parameters, else `RDMA_DEVICE`/`RDMA_PORT`/`RDMA_GID_INDEX`, else the first
/// active port of the first device that has one, and its first IPv4-mapped
/// GID (RoCE v2), else its first non-zero GID.
fn choose(url: &FabricUrl) -> Result<(Context, DeviceChoice), FabricError> {
    let param = |k: &str, env: &str| {
        url.param(k)
            .map(str::to_owned)
            .or_else(|| std::env::var(env).ok())
    };
    let want_device = param("device", "RDMA_DEVICE");
    let want_port = match param("port", "RDMA_PORT") {
        Some(p) => Some(p.parse::<u8>().map_err(|_| {
            FabricError::invalid("rdma", format!("port {p:?} is not a port number"))
        })?),
        None => None,
    };
    let want_gid = match param("gid", "RDMA_GID_INDEX") {
        Some(g) => Some(g.parse::<u8>().map_err(|_| {
            FabricError::invalid("rdma", format!("gid index {g:?} is not a number"))
        })?),
        None => None,
    };
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(no_device(format!(
            "no RDMA device was found (ibv_get_device_list: {e})"
        )));
    }
    struct List(*mut *mut ffi::ibv_device);
    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the list came from ibv_get_device_list; opened contexts stay valid after it is freed.
            unsafe { ffi::ibv_free_device_list(self.0) };
        }
    }
    let list = List(list);
    // SAFETY: the list holds `n` valid device pointers.
    let devices: Vec<*mut ffi::ibv_device> = (0..n.max(0) as usize)
        .map(|i| unsafe { *list.0.add(i) })
        .collect();
    if devices.is_empty() {
        return Err(no_device("no RDMA device was found"));
    }
    let mut seen = Vec::new();
    for dev in devices {
        // SAFETY: `dev` is a live entry of the list.
        let ctx = unsafe { Context::open(dev) }?;
        seen.push(ctx.name.clone());
        if want_device.as_ref().is_some_and(|w| *w != ctx.name) {
            continue;
        }
        let attr = ctx.query_device()?;
        for port in 1..=attr.phys_port_cnt {
            if want_port.is_some_and(|p| p != port) {
                continue;
            }
            let pattr = ctx.query_port(port)?;
            if pattr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                continue;
            }
            let ethernet = pattr.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8;
            let gid_index = match want_gid {
                Some(g) => g,
                None => {
                    let gids: Vec<(u8, [u8; 16])> = (0..pattr.gid_tbl_len.clamp(0, 256))
                        .filter_map(|i| ctx.query_gid(port, i).ok().map(|g| (i as u8, g)))
                        .filter(|(_, g)| g.iter().any(|&b| b != 0))
                        .collect();
                    // RoCE v2 first (routable), IPv4-mapped first among those.
                    let v2 = |i: u8| {
                        ethernet
                            && gid_type(&ctx.name, port, i)
                                .is_some_and(|t| t.eq_ignore_ascii_case("RoCE v2"))
                    };
                    let pick = gids
                        .iter()
                        .find(|(i, g)| v2(*i) && is_ipv4_mapped(g))
                        .or_else(|| gids.iter().find(|(i, _)| v2(*i)))
                        .or_else(|| gids.iter().find(|(_, g)| ethernet && is_ipv4_mapped(g)))
                        .or(gids.first());
                    match pick {
                        Some((i, _)) => *i,
                        None if !ethernet => 0,
                        None => continue,
                    }
                }
            };
            let gid = ctx.query_gid(port, gid_index as i32)?;
            let choice = DeviceChoice {
                device: ctx.name.clone(),
                port,
                gid_index,
                gid,
                lid: pattr.lid,
                ethernet,
                mtu: pattr.active_mtu,
            };
            return Ok((ctx, choice));
        }
    }
    Err(match want_device {
        Some(w) if !seen.contains(&w) => no_device(format!(
            "RDMA device {w:?} not found (devices: {})",
            seen.join(", ")
        )),
        _ => no_device(format!(
            "no active RDMA port found (devices: {})",
            seen.join(", ")
        )),
    })
}

/// State shared with liveness watchers and queue pairs: completions made up
/// in software (a dead peer, an async error event), the queue pairs alive,
/// and the wake-up file descriptor.
struct Side {
    state: Mutex<SideState>,
    wake_fd: i32,
}

/// Made-up completions are keyed by qp number, which the device reuses once
/// a queue pair is destroyed. Four rules keep a stale one from reaching a
/// queue pair that reused the number:
///
/// - each queue pair gets an incarnation when created; a made-up completion
///   is queued only while its queue pair's incarnation is live, and popped
///   only if it still is;
/// - dropping a queue pair ([`LiveQp`]) retires its incarnation and purges
///   its queued completions, under the same lock, before the device
///   destroys it (so before its number can be reused);
/// - real completions of a queue pair no longer live are dropped when
///   polled. (mlx5 removes a destroyed queue pair's entries from the CQ;
///   rxe leaves them, but allocates numbers cyclically, so an entry would
///   have to stay unpolled through tens of thousands of new queue pairs to
///   meet a reused number);
/// - a completion already handed out by [`Fabric::poll`] may still be in the
///   dispatcher's hands when its queue pair is destroyed. The numbers of the
///   last batch are remembered until the next `poll` (the dispatcher handles
///   a whole batch before polling again), and a queue pair created with one
///   of them is set aside, unused, and another created: the device cannot
///   hand out a number while a parked queue pair holds it. The parked ones
///   are destroyed at the next `poll`.
#[derive(Default)]
struct SideState {
    queue: VecDeque<(u64, Completion)>,
    /// qp_num -> incarnation of every queue pair alive on this context.
    live: HashMap<u32, u64>,
    next_incarnation: u64,
    /// qp numbers of the completions the last `poll` handed out.
    handed_out: Vec<u32>,
    /// Queue pairs created with a number in `handed_out`; see above.
    parked: Vec<Qp>,
    /// Why the context is unusable, after a fatal async event.
    fatal: Option<String>,
}

impl Side {
    /// An empty queue with its wake-up eventfd.
    fn new() -> Result<Arc<Side>, FabricError> {
        // SAFETY: eventfd with valid flags; the fd is owned by `Side`.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(FabricError::io("eventfd", std::io::Error::last_os_error()));
        }
        Ok(Arc::new(Side {
            state: Mutex::new(SideState::default()),
            wake_fd,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, SideState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `c` if its queue pair is alive, and is incarnation `inc` when
    /// one is given. `None` takes whatever incarnation is alive: for async
    /// events, whose queue pair cannot be destroyed (nor its number reused)
    /// before the event is acknowledged.
    fn push_if_live(&self, inc: Option<u64>, c: Completion) -> bool {
        let pushed = {
            let mut st = self.lock();
            match st.live.get(&c.qp_num).copied() {
                Some(live) if inc.is_none_or(|i| i == live) => {
                    st.queue.push_back((live, c));
                    true
                }
                _ => false,
            }
        };
        if pushed {
            self.wake();
        }
        pushed
    }

    /// Marks the context unusable and fails every live queue pair.
    fn fail_all(&self, why: String, event: u32) -> usize {
        let n = {
            let mut st = self.lock();
            if st.fatal.is_none() {
                st.fatal = Some(why);
            }
            let mut live: Vec<(u32, u64)> = st.live.iter().map(|(&q, &i)| (q, i)).collect();
            live.sort_unstable();
            for &(qp_num, inc) in &live {
                st.queue.push_back((
                    inc,
                    Completion {
                        wr_id: 0,
                        qp_num,
                        kind: CompletionKind::Send,
                        status: WcStatus::DeviceError { event },
                    },
                ));
            }
            live.len()
        };
        self.wake();
        n
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid u64 to our own eventfd.
        unsafe { libc::write(self.wake_fd, (&one as *const u64).cast(), 8) };
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // SAFETY: the eventfd is owned by this struct.
        unsafe { libc::close(self.wake_fd) };
    }
}

/// A queue pair registered as live on its context (see [`SideState`]).
struct LiveQp {
    qp: Qp,
    incarnation: u64,
    side: Arc<Side>,
}

impl LiveQp {
    fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// Retires this incarnation and purges its made-up completions. Idempotent.
    fn retire(&self) {
        let n = self.qp_num();
        let mut st = self.side.lock();
        if st.live.get(&n) == Some(&self.incarnation) {
            st.live.remove(&n);
        }
        st.queue.retain(|(_, c)| c.qp_num != n);
    }
}

impl Drop for LiveQp {
    fn drop(&mut self) {
        // Before `qp` is destroyed (fields drop after this), while the
        // number is still ours.
        self.retire();
    }
}

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
}

/// A completion queue of a [`VerbsFabric`]: a receive CQ and a send CQ
/// sharing one completion channel, with the queue of completions made up
/// in software for its queue pairs. One per dispatcher: the queue pairs
/// created on it report here, and nowhere else.
#[derive(Clone)]
pub struct VerbsCq {
    inner: Arc<CqInner>,
}

struct CqInner {
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    channel: Arc<CompChannel>,
    side: Arc<Side>,
    fabric: VerbsFabric,
    /// Calls to `poll` (for [`ASYNC_EVERY`]).
    polls: AtomicU32,
}

impl std::fmt::Debug for VerbsCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsCq").finish_non_exhaustive()
    }
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
        VerbsFabric::open_with(url, SRQ_MAX)
    }

    /// Opens with an SRQ of at most `srq_max` receives.
    fn open_with(url: &FabricUrl, srq_max: u32) -> Result<VerbsFabric, FabricError> {
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
        tracing::debug!(device = %choice.device, port = choice.port, gid_index = choice.gid_index, "opened RDMA device");
        Ok(VerbsFabric {
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
            }),
        })
    }

    /// The device, port and GID in use.
    pub fn choice(&self) -> &DeviceChoice {
        &self.inner.choice
    }

    /// How many zero-length receives the SRQ can hold.
    pub fn srq_depth(&self) -> u32 {
        self.inner.srq_depth
    }

    /// Polls up to `max` entries of `cq`; passes on those of live queue pairs
    /// and returns how many were polled (passed on or not).
    fn poll_cq(
        &self,
        cq: &Cq,
        recv: bool,
        live: &HashMap<u32, u64>,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> usize {
        // SAFETY: ibv_wc is plain old data; zero is valid.
        let mut wcs: [ffi::ibv_wc; WC_BATCH] = unsafe { std::mem::zeroed() };
        let n = match cq.poll(&mut wcs[..max.min(WC_BATCH)]) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %e, "polling a completion queue failed");
                return 0;
            }
        };
        for wc in &wcs[..n] {
            if !live.contains_key(&wc.qp_num) {
                // Left in the CQ by a queue pair since destroyed (mlx5 cleans
                // them out at destroy, rxe does not): nothing wants it.
                continue;
            }
            let status = match wc.error() {
                None => WcStatus::Success,
                Some((s, vendor)) => match s {
                    ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
                    ffi::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
                    ffi::ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
                    ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
                    other => WcStatus::Other {
                        vendor: other << 16 | (vendor & 0xffff),
                    },
                },
            };
            let (kind, status) = if recv {
                // Only RDMA WRITE WITH IMMEDIATE is expected on the SRQ: a
                // receive without an immediate is a peer breaking the protocol.
                let imm = wc.imm_data().map(u32::from_be);
                let status = if status == WcStatus::Success
                    && (imm.is_none()
                        || wc.opcode() != ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM)
                {
                    WcStatus::Other { vendor: u32::MAX }
                } else {
                    status
                };
                (
                    CompletionKind::RecvImm {
                        imm: imm.unwrap_or(0),
                        byte_len: wc.len() as u32,
                    },
                    status,
                )
            } else {
                (CompletionKind::Send, status)
            };
            out.push(Completion {
                wr_id: wc.wr_id(),
                qp_num: wc.qp_num,
                kind,
                status,
            });
        }
        n
    }

    /// Drains asynchronous events: QP errors fail their connection, fatal
    /// errors every connection; a low SRQ is topped up.
    fn drain_async(&self) {
        loop {
            // SAFETY: plain old data; zero is valid.
            let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: the context is open and its async fd non-blocking.
            if unsafe { ffi::ibv_get_async_event(self.inner.ctx.as_ptr(), &mut ev) } != 0 {
                return;
            }
            let device = &self.inner.choice.device;
            match ev.event_type {
                ffi::IBV_EVENT_QP_FATAL
                | ffi::IBV_EVENT_QP_REQ_ERR
                | ffi::IBV_EVENT_QP_ACCESS_ERR => {
                    // SAFETY: for QP events `element.qp` is the QP; it cannot
                    // be destroyed before the event is acked (ibv_destroy_qp
                    // waits for that), so its number is still its own.
                    let qp_num = unsafe { (*ev.element.qp).qp_num };
                    tracing::warn!(qp_num, event = ev.event_type, "queue pair error event");
                    let c = Completion {
                        wr_id: 0,
                        qp_num,
                        kind: CompletionKind::Send,
                        status: WcStatus::DeviceError {
                            event: ev.event_type,
                        },
                    };
                    // To the completion queue the queue pair reports to.
                    for side in self.sides() {
                        if side.push_if_live(None, c) {
                            break;
                        }
                    }
                }
                ffi::IBV_EVENT_SRQ_LIMIT_REACHED => {
                    self.inner.srq_limit_events.fetch_add(1, Ordering::AcqRel);
                    self.top_up_srq();
                }
                ffi::IBV_EVENT_DEVICE_FATAL | ffi::IBV_EVENT_CQ_ERR | ffi::IBV_EVENT_SRQ_ERR => {
                    let what = match ev.event_type {
                        ffi::IBV_EVENT_DEVICE_FATAL => "device fatal error",
                        ffi::IBV_EVENT_CQ_ERR => "completion queue error",
                        _ => "shared receive queue error",
                    };
                    let failed = self.fail_all(format!("RDMA {what} on {device}"), ev.event_type);
                    tracing::error!(%device, event = ev.event_type, failed, "RDMA {what}: failing every connection");
                }
                ffi::IBV_EVENT_PORT_ERR => {
                    tracing::error!(%device, "RDMA port went down")
                }
                other => tracing::debug!(event = other, "RDMA async event"),
            }
            // SAFETY: acknowledging the event we got.
            unsafe { ffi::ibv_ack_async_event(&mut ev) };
        }
    }

    /// The made-up completion queues of the completion queues still alive.
    fn sides(&self) -> Vec<Arc<Side>> {
        let mut sides = self.inner.sides.lock().unwrap_or_else(|e| e.into_inner());
        sides.retain(|s| s.strong_count() > 0);
        sides.iter().filter_map(std::sync::Weak::upgrade).collect()
    }

    /// Marks the context unusable and fails every live queue pair of every
    /// completion queue; returns how many.
    fn fail_all(&self, why: String, event: u32) -> usize {
        {
            let mut fatal = self.inner.fatal.lock().unwrap_or_else(|e| e.into_inner());
            if fatal.is_none() {
                *fatal = Some(why.clone());
            }
        }
        self.sides()
            .iter()
            .map(|side| side.fail_all(why.clone(), event))
            .sum()
    }

    /// After an SRQ limit event: posts receives until the SRQ is full, then
    /// re-arms the limit (the event is one-shot). Arming fails on some
    /// providers when the SRQ is already below the limit again: then fill
    /// and try again.
    fn top_up_srq(&self) {
        let srq = &self.inner.srq;
        for _ in 0..4 {
            match srq.fill() {
                Ok(n) => {
                    self.inner
                        .srq_topped_up
                        .fetch_add(n as u64, Ordering::AcqRel);
                    tracing::debug!(posted = n, "SRQ limit reached: topped up");
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot top up the shared receive queue");
                    return;
                }
            }
            match srq.arm_limit(srq.capacity / SRQ_LIMIT_FRACTION) {
                Ok(()) => return,
                Err(e) => tracing::debug!(error = %e, "re-arming the SRQ limit; filling again"),
            }
        }
        tracing::error!("cannot re-arm the SRQ limit; receives are still reposted per completion");
    }

    fn hello(&self, qp: &Qp, psn: u32, local: &LocalSetup<'_, VerbsRegion>) -> Hello {
        Hello {
            fabric: HelloFabric::Rdma,
            qp_num: qp.qp_num(),
            psn,
            lid: self.inner.choice.lid,
            mtu: self.inner.choice.mtu as u8,
            gid: self.inner.choice.gid,
            ring: PeerRing {
                addr: local.ring.addr(),
                len: local.ring.len() as u64,
                rkey: local.ring.rkey(),
                max_message: local.max_message,
            },
        }
    }

    /// Creates a queue pair in INIT on `cq`, registered as live there (see
    /// [`SideState`]).
    fn new_qp(&self, cq: &VerbsCq) -> Result<LiveQp, FabricError> {
        let i = &self.inner;
        let c = &cq.inner;
        if let Some(why) = &*i.fatal.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(FabricError::unreachable("ibv_create_qp", why.clone()));
        }
        let mut attempts = 0;
        let qp = loop {
            let qp = Qp::new(
                i.pd.clone(),
                c.send_cq.clone(),
                c.recv_cq.clone(),
                i.srq.clone(),
                SQ_DEPTH,
            )?;
            let mut st = c.side.lock();
            if let Some(why) = &st.fatal {
                return Err(FabricError::unreachable("ibv_create_qp", why.clone()));
            }
            let n = qp.qp_num();
            if st.handed_out.contains(&n) {
                // Each parked queue pair holds a distinct number of the last
                // batch, so this ends within a batch's worth of attempts.
                attempts += 1;
                if attempts > st.handed_out.len() {
                    return Err(FabricError::unreachable(
                        "ibv_create_qp",
                        "the device keeps handing out qp numbers still in use",
                    ));
                }
                st.parked.push(qp);
                continue;
            }
            let incarnation = st.next_incarnation;
            st.next_incarnation += 1;
            st.live.insert(n, incarnation);
            break LiveQp {
                qp,
                incarnation,
                side: c.side.clone(),
            };
        };
        // SAFETY: plain old data; zero is valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = i.choice.port;
        a.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        use ffi::ibv_qp_attr_mask as m;
        qp.qp.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS).0,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(qp)
    }

    /// Moves `qp` to RTR then RTS towards `peer`.
    fn connect_qp(&self, qp: &Qp, psn: u32, peer: &Hello) -> Result<(), FabricError> {
        let c = &self.inner.choice;
        use ffi::ibv_qp_attr_mask as m;
        // SAFETY: plain old data; zero is valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        // Both ends must agree on a path MTU the smaller netdev carries.
        a.path_mtu = if peer.mtu == 0 {
            c.mtu
        } else {
            c.mtu.min(peer.mtu as ffi::ibv_mtu)
        };
        a.dest_qp_num = peer.qp_num;
        a.rq_psn = peer.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = c.port;
        a.ah_attr.dlid = peer.lid;
        if c.ethernet || (peer.lid == 0 && peer.gid.iter().any(|&b| b != 0)) {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = peer.gid;
            a.ah_attr.grh.sgid_index = c.gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        qp.modify(&mut a, mask.0, "ibv_modify_qp(RTR)")?;
        // SAFETY: plain old data; zero is valid.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7; // retry forever: the SRQ is refilled, RNR only delays
        a.sq_psn = psn;
        a.max_rd_atomic = 1;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        qp.modify(&mut a, mask.0, "ibv_modify_qp(RTS)")
    }

    fn finish(
        &self,
        stream: TcpStream,
        qp: LiveQp,
        peer: Hello,
        pending: Option<Hello>,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        let side = qp.side.clone();
        stream
            .set_read_timeout(None)
            .map_err(|e| FabricError::io("set_read_timeout", e))?;
        set_keepalive(&stream)?;
        let peer_addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let watched = self
            .inner
            .liveness
            .watch(&stream, side, qp.qp_num(), qp.incarnation)?;
        Ok(Connected {
            qp: VerbsQp {
                qp,
                stream,
                pending,
                _watched: watched,
            },
            peer: peer.ring,
            peer_addr: format!("rdma://{peer_addr}"),
        })
    }
}

fn random_psn() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ (std::process::id() as u64).rotate_left(32);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x as u32) & 0x00ff_ffff
}

/// Memory registered with the device.
#[derive(Clone)]
pub struct VerbsRegion {
    mr: Arc<Mr>,
}

impl std::fmt::Debug for VerbsRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.mr.len)
            .finish()
    }
}

impl Region for VerbsRegion {
    fn addr(&self) -> u64 {
        self.mr.buf.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.mr.len
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// Memory peers may write (receive rings) is copied out with volatile
    /// loads and `f` sees the copy, so a peer writing concurrently (against
    /// the protocol) can change what we copy but never a value after we
    /// checked it. Local-only memory (staging) is lent directly, under the
    /// region's lock.
    fn read<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check_bounds(offset, len);
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above).
        let src = unsafe { self.mr.buf.as_ptr().add(offset) };
        if self.mr.remote_write {
            let mut copy = vec![0u8; len];
            // SAFETY: `src` is valid for `len` bytes; volatile loads tolerate
            // the device writing them concurrently.
            unsafe { volatile_copy_from(src, &mut copy) };
            f(&copy)
        } else {
            // SAFETY: the device never writes local-only memory, and the lock
            // keeps every `&mut` view from `write` away while this one lives.
            f(unsafe { std::slice::from_raw_parts(src, len) })
        }
    }

    /// Memory peers may write is copied with volatile loads, straight into `dst`.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) {
        if !self.mr.remote_write {
            return self.read(offset, dst.len(), |src| dst.copy_from_slice(src));
        }
        self.check_bounds(offset, dst.len());
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above); volatile
        // loads tolerate the device writing these bytes concurrently.
        unsafe { volatile_copy_from(self.mr.buf.as_ptr().add(offset), dst) };
    }

    /// Local-only memory (staging) is lent as `&mut` under the region's lock;
    /// the device only reads it (for writes posted earlier, whose bytes the
    /// protocol no longer reuses until the peer released them). Memory peers
    /// may write is written through a copy with volatile stores.
    fn write<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.check_bounds(offset, len);
        let _guard = self.mr.access.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: in bounds of the owned buffer (checked above).
        let dst = unsafe { self.mr.buf.as_ptr().add(offset) };
        if self.mr.remote_write {
            let mut copy = vec![0u8; len];
            let r = f(&mut copy);
            for (i, b) in copy.iter().enumerate() {
                // SAFETY: `dst` is valid for `len` bytes.
                unsafe { dst.add(i).write_volatile(*b) };
            }
            r
        } else {
            // SAFETY: in bounds; the lock makes this the only view of the
            // buffer from Rust while it lives, and the device does not write
            // local-only memory.
            f(unsafe { std::slice::from_raw_parts_mut(dst, len) })
        }
    }
}

impl VerbsRegion {
    fn check_bounds(&self, offset: usize, len: usize) {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.mr.len),
            "access out of region bounds"
        );
    }
}

/// Copies `dst.len()` bytes from `src` with volatile loads (8 bytes at a time
/// where aligned).
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` bytes.
unsafe fn volatile_copy_from(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    let mut i = 0;
    while i < len && (src as usize + i) % 8 != 0 {
        // SAFETY: `i < len`: within the bytes the caller vouches for.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
    while i + 8 <= len {
        // SAFETY: `i + 8 <= len`, and `src + i` is 8-aligned after the loop above.
        let word = unsafe { src.add(i).cast::<u64>().read_volatile() };
        dst[i..i + 8].copy_from_slice(&word.to_ne_bytes());
        i += 8;
    }
    while i < len {
        // SAFETY: `i < len`: within the bytes the caller vouches for.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
}

/// A connected RC queue pair, with its liveness connection.
pub struct VerbsQp {
    qp: LiveQp,
    stream: TcpStream,
    pending: Option<Hello>,
    /// Watching `stream` for the peer's end; stops when dropped.
    _watched: Watched,
}

impl std::fmt::Debug for VerbsQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsQp")
            .field("qp_num", &self.qp.qp_num())
            .finish()
    }
}

impl QueuePair for VerbsQp {
    type Region = VerbsRegion;

    fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    fn post_write_imm(&mut self, wr: &WriteImm<'_, VerbsRegion>) -> Result<(), FabricError> {
        self.post_write_imm_batch(1, |_| WriteImm { ..*wr })
    }

    /// Chains up to [`MAX_CHAIN`] work requests per `ibv_post_send`: one
    /// doorbell for the lot.
    fn post_write_imm_batch<'a>(
        &mut self,
        count: usize,
        wr: impl Fn(usize) -> WriteImm<'a, VerbsRegion>,
    ) -> Result<(), FabricError> {
        let mut first = 0;
        while first < count {
            let n = (count - first).min(MAX_CHAIN);
            // SAFETY: plain old data; zero is valid.
            let mut sges: [ffi::ibv_sge; MAX_CHAIN] = unsafe { std::mem::zeroed() };
            // SAFETY: plain old data; zero is valid.
            let mut wrs: [ffi::ibv_send_wr; MAX_CHAIN] = unsafe { std::mem::zeroed() };
            for i in 0..n {
                let wr = wr(first + i);
                let w = &mut wrs[i];
                let mut len = 0;
                if let Some((region, off, l)) = wr.local {
                    assert!(
                        off.checked_add(l).is_some_and(|end| end <= region.len()),
                        "write source out of region bounds"
                    );
                    sges[i] = ffi::ibv_sge {
                        addr: region.addr() + off as u64,
                        length: l as u32,
                        lkey: region.mr.lkey(),
                    };
                    w.num_sge = 1;
                    len = l;
                }
                w.wr_id = wr.wr_id;
                w.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                let mut flags = 0;
                if wr.signaled {
                    flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                if len > 0 && len <= self.qp.qp.max_inline as usize {
                    flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
                }
                w.send_flags = flags;
                w.__bindgen_anon_1.imm_data = wr.imm.to_be();
                w.wr.rdma.remote_addr = wr.remote_addr;
                w.wr.rdma.rkey = wr.rkey;
            }
            // Link the chain and the SGEs now that the arrays stay put.
            for i in 0..n {
                if wrs[i].num_sge > 0 {
                    wrs[i].sg_list = &mut sges[i];
                }
                if i + 1 < n {
                    wrs[i].next = &mut wrs[i + 1];
                }
            }
            // SAFETY: the chain's `n` requests and their SGEs live on this
            // stack frame for the call (verbs copies them). Each SGE names a
            // registered region of this context's PD; the dispatcher keeps
            // the region alive longer than the queue pair and reuses its
            // bytes only after the peer released them (which implies the
            // write was executed).
            unsafe { self.qp.qp.post_send(&mut wrs[0]) }?;
            first += n;
        }
        Ok(())
    }

    fn send_queue_depth(&self) -> usize {
        self.qp.qp.sq_depth as usize
    }

    fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending.take() {
            bootstrap::send(&mut self.stream, &hello)?;
        }
        Ok(())
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // Retired first, so our own watcher, woken by the shutdown, queues
        // nothing; the queue pair itself is destroyed after this (field drop).
        self.qp.retire();
        // The peer's watcher sees EOF: its side of the connection fails now.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl CompletionQueue for VerbsCq {
    /// Receive and send completions first, then made-up ones, which only
    /// come once the CQs are drained: a made-up failure (the peer closed
    /// its liveness connection) must not overtake the writes that peer
    /// completed before closing, such as its last replies. The caller must
    /// handle the whole batch before it polls again: until then, the batch's
    /// qp numbers are kept from new queue pairs (see [`SideState`]). The
    /// dispatcher's single poller does exactly that.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let c = &self.inner;
        let fabric = &c.fabric;
        let i = &fabric.inner;
        if c.polls.fetch_add(1, Ordering::Relaxed) % ASYNC_EVERY == ASYNC_EVERY - 1 {
            // A busy poller never blocks on the async fd: look now and then.
            fabric.drain_async();
        }
        let start = out.len();
        let parked;
        {
            // Held while polling the CQs too, so that `new_qp` sees every
            // number this batch hands out.
            let mut st = c.side.lock();
            st.handed_out.clear();
            parked = std::mem::take(&mut st.parked);
            let got = fabric.poll_cq(&c.recv_cq, true, &st.live, out, max);
            // Every receive completion used up one posted receive: replace
            // it, with any a failed post left owing. "Full" means a top-up
            // got there first: nothing is owed then.
            let owed = got as u32 + i.srq_deficit.swap(0, Ordering::AcqRel);
            if owed > 0 {
                if let Err((missing, e)) = i.srq.post_zero_length(owed) {
                    if !is_full(&e) {
                        i.srq_deficit.fetch_add(missing, Ordering::AcqRel);
                        tracing::error!(error = %e, missing, "cannot replenish the shared receive queue; will retry");
                    }
                }
            }
            let mut drained = got < max.min(WC_BATCH);
            let room = max - (out.len() - start);
            if room > 0 {
                let sent = fabric.poll_cq(&c.send_cq, false, &st.live, out, room);
                drained &= sent < room.min(WC_BATCH);
            }
            while drained && out.len() - start < max {
                let Some((inc, c)) = st.queue.pop_front() else {
                    break;
                };
                if st.live.get(&c.qp_num) == Some(&inc) {
                    out.push(c);
                }
            }
            st.handed_out.extend(out[start..].iter().map(|c| c.qp_num));
        }
        // The last batch is handled: the numbers parked for it are free.
        drop(parked);
        out.len() - start
    }

    /// Arms both CQs: the next completion on either raises an event on the
    /// completion channel. If arming fails (a CQ in error), the wait still
    /// sleeps, bounded by its timeout, rather than spin; async events
    /// report the error.
    fn arm(&self) {
        let c = &self.inner;
        if let Err(e) = c.recv_cq.arm().and_then(|()| c.send_cq.arm()) {
            tracing::error!(error = %e, "cannot arm a completion queue");
        }
    }

    fn wait(&self, timeout: Option<Duration>) {
        let c = &self.inner;
        let i = &c.fabric.inner;
        if !c.side.lock().queue.is_empty() {
            return;
        }
        let mut fds = [
            libc::pollfd {
                fd: c.channel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: i.ctx.async_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: c.side.wake_fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.map_or(-1, |t| t.as_millis().clamp(1, i32::MAX as u128) as i32);
        // SAFETY: `fds` is a valid array of 3 pollfd for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 3, ms) };
        if rc <= 0 {
            return;
        }
        if fds[0].revents != 0 {
            loop {
                let mut cq = std::ptr::null_mut();
                let mut ctx = std::ptr::null_mut();
                // SAFETY: the channel is alive and non-blocking; out-pointers are valid.
                if unsafe { ffi::ibv_get_cq_event(c.channel.ptr.as_ptr(), &mut cq, &mut ctx) } != 0
                {
                    break;
                }
                // SAFETY: `cq` is the CQ the event was for; each event is acked once.
                unsafe { ffi::ibv_ack_cq_events(cq, 1) };
            }
        }
        if fds[1].revents != 0 {
            c.fabric.drain_async();
        }
        if fds[2].revents != 0 {
            let mut v: u64 = 0;
            // SAFETY: reading 8 bytes into a valid u64 from our eventfd.
            unsafe { libc::read(c.side.wake_fd, (&mut v as *mut u64).cast(), 8) };
        }
    }

    fn interrupt(&self) {
        self.inner.side.wake();
    }
}

/// Accepts `rdma://` connections (the handshake's TCP port).
#[derive(Debug)]
pub struct VerbsListener {
    acceptor: Acceptor,
}

impl Listener<VerbsFabric> for VerbsListener {
    fn next(&self) -> Result<Option<TcpStream>, FabricError> {
        self.acceptor.next()
    }
    fn local_url(&self) -> String {
        self.acceptor.local_url("rdma")
    }
    fn close(&self) {
        self.acceptor.close();
    }
}

impl Fabric for VerbsFabric {
    type Region = VerbsRegion;
    type Qp = VerbsQp;
    type Cq = VerbsCq;
    type Listener = VerbsListener;
    type Incoming = TcpStream;

    fn register(&self, len: usize, remote_write: bool) -> Result<VerbsRegion, FabricError> {
        Ok(VerbsRegion {
            mr: Arc::new(Mr::new(self.inner.pd.clone(), len, remote_write)?),
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
                polls: 0.into(),
            }),
        })
    }

    fn listen(&self, url: &FabricUrl) -> Result<VerbsListener, FabricError> {
        Ok(VerbsListener {
            acceptor: Acceptor::bind(url)?,
        })
    }

    fn connect(
        &self,
        url: &FabricUrl,
        local: LocalSetup<'_, VerbsRegion>,
        cq: &VerbsCq,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        let mut stream = bootstrap::dial(url, local.timeout)?;
        stream
            .set_nodelay(true)
            .map_err(|e| FabricError::io("set_nodelay", e))?;
        stream
            .set_read_timeout(Some(local.timeout))
            .map_err(|e| FabricError::io("set_read_timeout", e))?;
        let qp = self.new_qp(cq)?;
        let psn = random_psn();
        bootstrap::send(&mut stream, &self.hello(&qp.qp, psn, &local))?;
        let peer = bootstrap::recv(&mut stream, HelloFabric::Rdma)?;
        self.connect_qp(&qp.qp, psn, &peer)?;
        self.finish(stream, qp, peer, None)
    }

    fn accept(
        &self,
        mut stream: TcpStream,
        local: LocalSetup<'_, VerbsRegion>,
        cq: &VerbsCq,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        stream
            .set_nodelay(true)
            .map_err(|e| FabricError::io("set_nodelay", e))?;
        stream
            .set_read_timeout(Some(local.timeout))
            .map_err(|e| FabricError::io("set_read_timeout", e))?;
        let peer = bootstrap::recv(&mut stream, HelloFabric::Rdma)?;
        let qp = self.new_qp(cq)?;
        let psn = random_psn();
        self.connect_qp(&qp.qp, psn, &peer)?;
        let hello = self.hello(&qp.qp, psn, &local);
        self.finish(stream, qp, peer, Some(hello))
    }
}

#[cfg(test)]
mod tests;
