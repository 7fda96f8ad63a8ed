//! Owned verbs objects. Each handle owns its parents through `Arc`, so
//! teardown runs in the order verbs requires: queue pairs, then memory
//! regions, shared receive queue and completion queues, then the protection
//! domain, then the device context.

use super::ffi;
use crate::fabric::FabricError;
use crate::pages::Pages;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

fn os_error(op: &'static str) -> FabricError {
    FabricError::io(op, std::io::Error::last_os_error())
}

fn rc_error(op: &'static str, rc: i32) -> FabricError {
    // Verbs calls return the errno either as the value or through errno.
    let code = if rc > 0 {
        rc
    } else {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .filter(|&e| e != 0);
        errno.unwrap_or(if rc < 0 { -rc } else { libc::EIO })
    };
    FabricError::io(op, std::io::Error::from_raw_os_error(code))
}

/// An open device context.
pub(super) struct Context {
    pub(super) ptr: NonNull<ffi::ibv_context>,
    pub(super) name: String,
}

// SAFETY: libibverbs contexts may be used from any thread; every call on them
// is thread-safe per the libibverbs documentation.
unsafe impl Send for Context {}
// SAFETY: as above: shared use across threads is allowed by libibverbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens `device`.
    ///
    /// # Safety
    /// `device` must come from a device list that is still alive.
    pub(super) unsafe fn open(device: *mut ffi::ibv_device) -> Result<Context, FabricError> {
        // SAFETY: the caller guarantees `device` is a live list entry.
        let name = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(device)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above.
        let ptr = unsafe { ffi::ibv_open_device(device) };
        let ptr = NonNull::new(ptr).ok_or_else(|| os_error("ibv_open_device"))?;
        Ok(Context { ptr, name })
    }

    pub(super) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.ptr.as_ptr()
    }

    pub(super) fn query_device(&self) -> Result<ffi::ibv_device_attr, FabricError> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_device(self.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(rc_error("ibv_query_device", rc));
        }
        Ok(attr)
    }

    pub(super) fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr, FabricError> {
        // SAFETY: plain old data; zeroed as verbs.h's ___ibv_query_port does.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the exported ibv_query_port writes the compat prefix of an
        // ibv_port_attr (every field used here lies in it; the rest stays
        // zeroed), as verbs.h's static inline wrapper calls it; the context is
        // open and `attr` is valid and larger than that prefix.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.as_ptr(),
                port,
                (&mut attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        if rc != 0 {
            return Err(rc_error("ibv_query_port", rc));
        }
        Ok(attr)
    }

    pub(super) fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16], FabricError> {
        // SAFETY: ibv_gid is a union of byte arrays; zero is valid.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.as_ptr(), port, index, &mut gid) };
        if rc != 0 {
            return Err(rc_error("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }

    /// The file descriptor of asynchronous events.
    pub(super) fn async_fd(&self) -> i32 {
        // SAFETY: reading a plain field of the open context.
        unsafe { (*self.as_ptr()).async_fd }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc to this context, so none is alive.
        unsafe { ffi::ibv_close_device(self.as_ptr()) };
    }
}

/// A protection domain.
pub(super) struct Pd {
    pub(super) ptr: NonNull<ffi::ibv_pd>,
    _ctx: Arc<Context>,
}

// SAFETY: protection domains are thread-safe verbs objects.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub(super) fn new(ctx: Arc<Context>) -> Result<Pd, FabricError> {
        // SAFETY: the context is open.
        let ptr = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        Ok(Pd {
            ptr: NonNull::new(ptr).ok_or_else(|| os_error("ibv_alloc_pd"))?,
            _ctx: ctx,
        })
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: regions, SRQs and QPs hold an Arc to this PD, so none is alive.
        unsafe { ffi::ibv_dealloc_pd(self.ptr.as_ptr()) };
    }
}

/// A completion channel: a file descriptor that becomes readable when an
/// armed completion queue gets an entry.
pub(super) struct CompChannel {
    pub(super) ptr: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: completion channels are thread-safe verbs objects.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub(super) fn new(ctx: Arc<Context>) -> Result<CompChannel, FabricError> {
        // SAFETY: the context is open.
        let ptr = unsafe { ffi::ibv_create_comp_channel(ctx.as_ptr()) };
        Ok(CompChannel {
            ptr: NonNull::new(ptr).ok_or_else(|| os_error("ibv_create_comp_channel"))?,
            _ctx: ctx,
        })
    }

    pub(super) fn fd(&self) -> i32 {
        // SAFETY: reading a plain field of a live channel.
        unsafe { (*self.ptr.as_ptr()).fd }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: CQs using this channel hold an Arc to it, so none is alive.
        unsafe { ffi::ibv_destroy_comp_channel(self.ptr.as_ptr()) };
    }
}

/// A completion queue.
pub(super) struct Cq {
    pub(super) ptr: NonNull<ffi::ibv_cq>,
    _channel: Arc<CompChannel>,
}

// SAFETY: polling and arming a CQ are thread-safe in libibverbs; this crate
// polls each CQ from one poller thread anyway.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(super) fn new(
        ctx: &Context,
        entries: i32,
        channel: Arc<CompChannel>,
    ) -> Result<Cq, FabricError> {
        // SAFETY: the context and the channel are alive.
        let ptr = unsafe {
            ffi::ibv_create_cq(
                ctx.as_ptr(),
                entries,
                std::ptr::null_mut(),
                channel.ptr.as_ptr(),
                0,
            )
        };
        Ok(Cq {
            ptr: NonNull::new(ptr).ok_or_else(|| os_error("ibv_create_cq"))?,
            _channel: channel,
        })
    }

    /// Polls up to `wcs.len()` completions into `wcs` (which need not be
    /// initialised: an empty poll, the common case of a spinning poller,
    /// then writes nothing); returns the completions written.
    pub(super) fn poll<'a>(
        &self,
        wcs: &'a mut [MaybeUninit<ffi::ibv_wc>],
    ) -> Result<&'a [ffi::ibv_wc], FabricError> {
        let cq = self.ptr.as_ptr();
        // SAFETY: ibv_poll_cq is static inline in verbs.h: it calls the
        // provider's op from the context's ops table, which is what we do. The
        // CQ is alive and `wcs` has room for the count passed; the provider
        // only writes entries.
        let n = unsafe {
            let poll = (*(*cq).context)
                .ops
                .poll_cq
                .ok_or_else(|| FabricError::invalid("ibv_poll_cq", "provider has no poll_cq"))?;
            poll(cq, wcs.len() as i32, wcs.as_mut_ptr().cast())
        };
        if n < 0 {
            return Err(rc_error("ibv_poll_cq", n));
        }
        let n = (n as usize).min(wcs.len());
        // SAFETY: the provider wrote the first `n` entries, and `ibv_wc` is
        // plain old data.
        Ok(unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<ffi::ibv_wc>(), n) })
    }

    /// Arms the CQ: the next completion makes the channel readable.
    pub(super) fn arm(&self) -> Result<(), FabricError> {
        let cq = self.ptr.as_ptr();
        // SAFETY: ibv_req_notify_cq is static inline: it calls the ops table
        // entry, as here. The CQ is alive.
        let rc = unsafe {
            let notify = (*(*cq).context).ops.req_notify_cq.ok_or_else(|| {
                FabricError::invalid("ibv_req_notify_cq", "provider has no req_notify_cq")
            })?;
            notify(cq, 0)
        };
        if rc != 0 {
            return Err(rc_error("ibv_req_notify_cq", rc));
        }
        Ok(())
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc to it, so none is alive; every
        // event taken from the channel was acknowledged when taken.
        unsafe { ffi::ibv_destroy_cq(self.ptr.as_ptr()) };
    }
}

/// A shared receive queue.
pub(super) struct Srq {
    pub(super) ptr: NonNull<ffi::ibv_srq>,
    /// Receives it holds at most, as the device granted (at least what was asked).
    pub(super) capacity: u32,
    _pd: Arc<Pd>,
}

/// Whether `e` is the provider saying a work queue is full (`ENOMEM`).
pub(super) fn is_full(e: &FabricError) -> bool {
    matches!(&e.kind, crate::fabric::FabricErrorKind::Io(io) if io.raw_os_error() == Some(libc::ENOMEM))
}

// SAFETY: posting to an SRQ is thread-safe in libibverbs.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

/// Receives posted per call to the provider.
const RECV_BATCH: usize = 64;

impl Srq {
    pub(super) fn new(pd: Arc<Pd>, max_wr: u32) -> Result<Srq, FabricError> {
        // SAFETY: plain old data; zero is valid.
        let mut init: ffi::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = max_wr;
        init.attr.max_sge = 1;
        // SAFETY: the PD is alive and `init` is valid.
        let ptr = unsafe { ffi::ibv_create_srq(pd.ptr.as_ptr(), &mut init) };
        let mut srq = Srq {
            ptr: NonNull::new(ptr).ok_or_else(|| os_error("ibv_create_srq"))?,
            capacity: max_wr,
            _pd: pd,
        };
        // Providers round the size up (rxe: 256 asked, 511 granted) and do
        // not all write it back into `init`: ask.
        srq.capacity = srq.query()?.0.max(max_wr);
        Ok(srq)
    }

    /// Posts zero-length receives until the device says the SRQ is full
    /// (`ENOMEM`, which is not an error here); returns how many were posted.
    /// Bounded by twice the capacity, so a provider that never says full
    /// cannot make it loop.
    pub(super) fn fill(&self) -> Result<u32, FabricError> {
        let mut posted = 0u32;
        while posted <= self.capacity.saturating_mul(2) {
            match self.post_zero_length(RECV_BATCH as u32) {
                Ok(()) => posted += RECV_BATCH as u32,
                Err((missing, e)) => {
                    posted += RECV_BATCH as u32 - missing;
                    return if is_full(&e) { Ok(posted) } else { Err(e) };
                }
            }
        }
        Ok(posted)
    }

    /// The SRQ's current attributes: (max_wr, srq_limit).
    pub(super) fn query(&self) -> Result<(u32, u32), FabricError> {
        // SAFETY: plain old data; zero is valid.
        let mut attr: ffi::ibv_srq_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the SRQ is alive and `attr` is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_srq(self.ptr.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(rc_error("ibv_query_srq", rc));
        }
        Ok((attr.max_wr, attr.srq_limit))
    }

    /// Arms the limit event: `IBV_EVENT_SRQ_LIMIT_REACHED` is raised once
    /// when fewer than `limit` receives remain posted.
    pub(super) fn arm_limit(&self, limit: u32) -> Result<(), FabricError> {
        // SAFETY: plain old data; zero is valid.
        let mut attr: ffi::ibv_srq_attr = unsafe { std::mem::zeroed() };
        attr.srq_limit = limit;
        // SAFETY: the SRQ is alive and `attr` is valid for IBV_SRQ_LIMIT.
        let rc =
            unsafe { ffi::ibv_modify_srq(self.ptr.as_ptr(), &mut attr, ffi::IBV_SRQ_LIMIT as i32) };
        if rc != 0 {
            return Err(rc_error("ibv_modify_srq(srq_limit)", rc));
        }
        Ok(())
    }

    /// Posts `count` zero-length receives (write-with-imm places no data in
    /// them). On failure, says how many were not posted, with the error.
    pub(super) fn post_zero_length(&self, mut count: u32) -> Result<(), (u32, FabricError)> {
        // SAFETY: plain old data; a zeroed recv WR with no SGE is a valid zero-length receive.
        let mut wrs: [ffi::ibv_recv_wr; RECV_BATCH] = unsafe { std::mem::zeroed() };
        while count > 0 {
            let n = (count as usize).min(RECV_BATCH);
            for i in 0..n {
                wrs[i].num_sge = 0;
                wrs[i].sg_list = std::ptr::null_mut();
                wrs[i].next = if i + 1 < n {
                    &mut wrs[i + 1]
                } else {
                    std::ptr::null_mut()
                };
            }
            let mut bad = std::ptr::null_mut();
            let srq = self.ptr.as_ptr();
            // SAFETY: ibv_post_srq_recv is static inline: it calls the ops
            // table entry, as here. The SRQ is alive and the chain of `n`
            // WRs lives on this stack frame for the call (verbs copies them).
            let rc = unsafe {
                let Some(post) = (*(*srq).context).ops.post_srq_recv else {
                    return Err((
                        count,
                        FabricError::invalid("ibv_post_srq_recv", "provider has no post_srq_recv"),
                    ));
                };
                post(srq, wrs.as_mut_ptr(), &mut bad)
            };
            if rc != 0 {
                // The work requests before `bad` were posted.
                let posted = if bad.is_null() {
                    0
                } else {
                    // SAFETY: on failure `bad` points into the `wrs` array passed above.
                    unsafe { bad.cast_const().offset_from(wrs.as_ptr()) }.clamp(0, n as isize)
                        as u32
                };
                return Err((count - posted, rc_error("ibv_post_srq_recv", rc)));
            }
            count -= n as u32;
        }
        Ok(())
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: QPs attached to this SRQ hold an Arc to it, so none is alive.
        unsafe { ffi::ibv_destroy_srq(self.ptr.as_ptr()) };
    }
}

/// Page-aligned memory registered with a PD.
pub(super) struct Mr {
    pub(super) ptr: NonNull<ffi::ibv_mr>,
    pub(super) buf: NonNull<u8>,
    pub(super) len: usize,
    /// Whether peers may write here (then only volatile copies touch it).
    pub(super) remote_write: bool,
    /// Serializes local access, so a `&mut` view never aliases another view.
    pub(super) access: std::sync::Mutex<()>,
    /// The memory `buf` points into: its own mapping, given back to the
    /// system when the region goes (`None` only while dropping).
    pages: Option<Pages>,
    _pd: Arc<Pd>,
}

// SAFETY: the buffer is owned by this handle; access to it is mediated by
// `&self` methods whose callers uphold the protocol's ownership of ring bytes
// (see `VerbsRegion`).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes. Memory peers write (`remote_write`) is opened
    /// to them either here, for the whole protection domain, or, with
    /// `through_window`, only through memory windows bound later (see
    /// [`Mw`]): the region itself then grants no remote access at all.
    pub(super) fn new(
        pd: Arc<Pd>,
        len: usize,
        remote_write: bool,
        through_window: bool,
    ) -> Result<Mr, FabricError> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if remote_write && through_window {
            access |= ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        } else if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        let pages = Pages::new(len.max(1)).map_err(|e| FabricError::io("mmap", e))?;
        Mr::register(pd, pages, len, access, remote_write)
    }

    /// Registers `len` bytes for large messages: reads land here, and
    /// peers read loans from here, through a window bound per loan
    /// (`through_window`) or, without windows, through the region's own
    /// rkey. Peers never write it.
    pub(super) fn for_buffer(
        pd: Arc<Pd>,
        len: usize,
        through_window: bool,
    ) -> Result<Mr, FabricError> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        access |= if through_window {
            ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0
        } else {
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
        };
        let pages = Pages::large(len.max(1)).map_err(|e| FabricError::io("mmap", e))?;
        Mr::register(pd, pages, len, access, false)
    }

    fn register(
        pd: Arc<Pd>,
        mut pages: Pages,
        len: usize,
        access: u32,
        remote_write: bool,
    ) -> Result<Mr, FabricError> {
        let buf = NonNull::new(pages.as_mut_ptr())
            .ok_or_else(|| FabricError::invalid("ibv_reg_mr", format!("cannot map {len} bytes")))?;
        // SAFETY: `buf` points to `len` owned bytes that outlive the MR (they
        // are unmapped only after deregistration, in Drop); the PD is alive.
        let mr =
            unsafe { ffi::ibv_reg_mr(pd.ptr.as_ptr(), buf.as_ptr().cast(), len, access as i32) };
        match NonNull::new(mr) {
            Some(ptr) => Ok(Mr {
                ptr,
                buf,
                len,
                remote_write,
                access: std::sync::Mutex::new(()),
                pages: Some(pages),
                _pd: pd,
            }),
            // Not registered: the mapping goes with `pages`.
            None => Err(os_error("ibv_reg_mr")),
        }
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: reading a plain field of a live MR.
        unsafe { (*self.ptr.as_ptr()).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: reading a plain field of a live MR.
        unsafe { (*self.ptr.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: deregister first so the device stops using the memory. Queue
        // pairs that could still post from it are destroyed before their
        // connection's regions (see dispatch::Conn).
        let rc = unsafe { ffi::ibv_dereg_mr(self.ptr.as_ptr()) };
        if rc != 0 {
            // The device may still reach the buffer: leak it rather than free it.
            let e = rc_error("ibv_dereg_mr", rc);
            tracing::error!(error = %e, "leaking a buffer the device may still use");
            std::mem::forget(self.pages.take());
        }
        // Otherwise the mapping is unmapped with `pages`: the device no
        // longer uses it.
    }
}

/// A type-2 memory window: remote write access to one registered region,
/// valid only from the one queue pair it is bound to (see
/// [`Qp::post_bind`]). Allocated unbound; bound once, for the life of a
/// connection, and deallocated before that connection's queue pair is
/// destroyed (a bound window holds a reference to its queue pair on
/// Soft-RoCE, whose destroy then waits for it forever; deallocating
/// invalidates the window on every device).
pub(super) struct Mw {
    ptr: NonNull<ffi::ibv_mw>,
    /// See [`Mw::rkey`].
    rkey: u32,
    /// The region the window opens: stays registered while the window lives
    /// (a region with windows bound to it cannot be deregistered).
    pub(super) mr: Arc<Mr>,
    _pd: Arc<Pd>,
}

// SAFETY: memory windows are thread-safe verbs objects; this handle only
// reads its fields and frees it.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

impl Mw {
    /// Allocates a type-2 window on `mr`'s protection domain, for `mr`.
    pub(super) fn alloc(pd: Arc<Pd>, mr: Arc<Mr>) -> Result<Mw, FabricError> {
        let p = pd.ptr.as_ptr();
        // SAFETY: ibv_alloc_mw is static inline in verbs.h: it calls the ops
        // table entry, as here (EOPNOTSUPP when the provider has none). The
        // PD is alive.
        let ptr = unsafe {
            let Some(alloc) = (*(*p).context).ops.alloc_mw else {
                return Err(FabricError::invalid(
                    "ibv_alloc_mw",
                    "the provider has no memory windows",
                ));
            };
            alloc(p, ffi::IBV_MW_TYPE_2)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| os_error("ibv_alloc_mw"))?;
        // SAFETY: reading a plain field of the window just allocated.
        let allocated = unsafe { (*ptr.as_ptr()).rkey };
        Ok(Mw {
            ptr,
            rkey: (allocated & !0xff) | (allocated.wrapping_add(1) & 0xff),
            mr,
            _pd: pd,
        })
    }

    /// The rkey the window has once bound: the same index as allocated, the
    /// next key byte (`ibv_inc_rkey`). Peers may learn it before the bind
    /// is posted; it is valid only once the bind completes.
    pub(super) fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        let mw = self.ptr.as_ptr();
        // SAFETY: ibv_dealloc_mw is static inline: it calls the ops table
        // entry, as here. The window is alive and freed once, before the
        // queue pair it is bound to (see above) and before its region
        // (`self.mr`).
        let rc = unsafe { (*(*mw).context).ops.dealloc_mw.map_or(-1, |free| free(mw)) };
        if rc != 0 {
            let e = rc_error("ibv_dealloc_mw", rc);
            tracing::error!(error = %e, "cannot free a memory window; its region stays registered");
            // A window still bound keeps its region busy: leak the region
            // rather than free memory the device may reach.
            std::mem::forget(self.mr.clone());
        }
    }
}

/// A reliable-connected queue pair on the context's CQs and SRQ.
pub(super) struct Qp {
    pub(super) ptr: NonNull<ffi::ibv_qp>,
    pub(super) max_inline: u32,
    pub(super) sq_depth: u32,
    _pd: Arc<Pd>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    _srq: Arc<Srq>,
}

// SAFETY: a QP may be used from any thread; posting needs `&mut VerbsQp`.
unsafe impl Send for Qp {}

impl Qp {
    pub(super) fn new(
        pd: Arc<Pd>,
        send_cq: Arc<Cq>,
        recv_cq: Arc<Cq>,
        srq: Arc<Srq>,
        sq_depth: u32,
    ) -> Result<Qp, FabricError> {
        let mut last = None;
        // Ask for inline data; fall back to none if the device refuses.
        for inline in [256u32, 64, 0] {
            // SAFETY: plain old data; zero is valid.
            let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            init.send_cq = send_cq.ptr.as_ptr();
            init.recv_cq = recv_cq.ptr.as_ptr();
            init.srq = srq.ptr.as_ptr();
            init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            init.cap.max_send_wr = sq_depth;
            init.cap.max_send_sge = 1;
            init.cap.max_inline_data = inline;
            // SAFETY: every pointer in `init` is to a live object owned by an Arc we keep.
            let ptr = unsafe { ffi::ibv_create_qp(pd.ptr.as_ptr(), &mut init) };
            match NonNull::new(ptr) {
                Some(ptr) => {
                    return Ok(Qp {
                        ptr,
                        max_inline: init.cap.max_inline_data,
                        sq_depth: init.cap.max_send_wr,
                        _pd: pd,
                        _cqs: (send_cq, recv_cq),
                        _srq: srq,
                    });
                }
                None => last = Some(os_error("ibv_create_qp")),
            }
        }
        Err(last.expect("tried at least once"))
    }

    pub(super) fn qp_num(&self) -> u32 {
        // SAFETY: reading a plain field of a live QP.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    pub(super) fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: u32,
        op: &'static str,
    ) -> Result<(), FabricError> {
        // SAFETY: the QP is alive and `attr` is valid for the mask given.
        let rc = unsafe { ffi::ibv_modify_qp(self.ptr.as_ptr(), attr, mask as i32) };
        if rc != 0 {
            return Err(rc_error(op, rc));
        }
        Ok(())
    }

    /// Posts one work request chain.
    ///
    /// # Safety
    /// Every SGE must name memory registered under this QP's PD that stays
    /// registered until the work request completes (or the QP is destroyed).
    pub(super) unsafe fn post_send(
        &mut self,
        wr: &mut ffi::ibv_send_wr,
    ) -> Result<(), FabricError> {
        let qp = self.ptr.as_ptr();
        let mut bad = std::ptr::null_mut();
        // SAFETY: ibv_post_send is static inline: it calls the ops table
        // entry, as here. The QP is alive; `wr` is valid for the call (verbs
        // copies it); the caller upholds the SGE lifetime rule.
        let rc = unsafe {
            let post = (*(*qp).context).ops.post_send.ok_or_else(|| {
                FabricError::invalid("ibv_post_send", "provider has no post_send")
            })?;
            post(qp, wr, &mut bad)
        };
        if rc != 0 {
            return Err(rc_error("ibv_post_send", rc));
        }
        Ok(())
    }
}

impl Qp {
    /// Posts a signaled bind of `mw` over the whole of its region, for
    /// remote write from this queue pair only, as `mw.rkey()`; the
    /// completion carries `wr_id`. The queue pair must be in RTS.
    pub(super) fn post_bind(&mut self, mw: &mut Mw, wr_id: u64) -> Result<(), FabricError> {
        let len = mw.mr.len;
        let access = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        self.post_bind_range(mw, len, access, wr_id, true)
    }

    /// Posts a bind of `mw` over the first `len` bytes of its region, with
    /// `access` (remote write or read) from this queue pair only, as
    /// `mw.rkey()`; a signaled one's completion carries `wr_id` (an
    /// unsignaled one reports only a failure). The queue pair must be in RTS.
    pub(super) fn post_bind_range(
        &mut self,
        mw: &mut Mw,
        len: usize,
        access: u32,
        wr_id: u64,
        signaled: bool,
    ) -> Result<(), FabricError> {
        assert!(len <= mw.mr.len, "window beyond its region");
        let rkey = mw.rkey();
        // SAFETY: plain old data; zero is valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_BIND_MW;
        if signaled {
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: mw.ptr.as_ptr(),
            rkey,
            bind_info: ffi::ibv_mw_bind_info {
                mr: mw.mr.ptr.as_ptr(),
                addr: mw.mr.buf.as_ptr() as u64,
                length: len as u64,
                mw_access_flags: access,
            },
        };
        // SAFETY: a bind carries no SGE; the window and its region are
        // alive, and the window outlives this queue pair (see `Mw`'s drop).
        unsafe { self.post_send(&mut wr) }?;
        // As `ibv_bind_mw` does for type 1: the window is known by its rkey
        // from now on (providers name it by `ibv_mw.rkey` in later work
        // requests).
        // SAFETY: writing a plain field of a live window we own.
        unsafe { (*mw.ptr.as_ptr()).rkey = rkey };
        Ok(())
    }
}

impl Qp {
    /// Posts a signaled RDMA READ of `len` bytes at `remote_addr` (under
    /// `rkey`) into the start of `dst`.
    ///
    /// # Safety
    /// `dst` must stay registered and otherwise untouched until the read
    /// completes or this queue pair is destroyed.
    pub(super) unsafe fn post_read(
        &mut self,
        wr_id: u64,
        dst: &Mr,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), FabricError> {
        assert!(len as usize <= dst.len, "read beyond its destination");
        let mut sge = ffi::ibv_sge {
            addr: dst.buf.as_ptr() as u64,
            length: len,
            lkey: dst.lkey(),
        };
        // SAFETY: plain old data; zero is valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        // SAFETY: `sge` lives on this frame for the call (verbs copies it);
        // the caller keeps `dst` registered until the read is done.
        unsafe { self.post_send(&mut wr) }
    }

    /// This queue pair's protection domain.
    pub(super) fn pd(&self) -> &Arc<Pd> {
        &self._pd
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP is alive; destroying it stops all its DMA.
        unsafe { ffi::ibv_destroy_qp(self.ptr.as_ptr()) };
    }
}
