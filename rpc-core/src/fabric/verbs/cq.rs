//! A dispatcher's completion queue: a receive CQ and a send CQ on a
//! completion channel of their own, and the made-up completions of its
//! queue pairs.

use super::*;

/// A completion queue of a [`VerbsFabric`]: a receive CQ and a send CQ
/// sharing one completion channel, with the queue of completions made up
/// in software for its queue pairs. One per dispatcher: the queue pairs
/// created on it report here, and nowhere else.
#[derive(Clone)]
pub struct VerbsCq {
    pub(super) inner: Arc<CqInner>,
}

pub(super) struct CqInner {
    pub(super) send_cq: Arc<Cq>,
    pub(super) recv_cq: Arc<Cq>,
    pub(super) channel: Arc<CompChannel>,
    pub(super) side: Arc<Side>,
    pub(super) fabric: VerbsFabric,
}

impl std::fmt::Debug for VerbsCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsCq").finish_non_exhaustive()
    }
}

impl VerbsFabric {
    /// Polls up to `max` entries of `cq`; passes on those of live queue pairs
    /// and returns how many were polled (passed on or not). The completions
    /// of memory-window binds are kept in `st.binds` for `await_bind`
    /// instead: they are the handshake's, not the dispatcher's.
    pub(super) fn poll_cq(
        &self,
        cq: &Cq,
        recv: bool,
        st: &mut SideState,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> usize {
        let live = &st.live;
        let mut wcs = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; WC_BATCH];
        let polled = match cq.poll(&mut wcs[..max.min(WC_BATCH)]) {
            Ok(polled) => polled,
            Err(e) => {
                tracing::error!(error = %e, "polling a completion queue failed");
                return 0;
            }
        };
        let n = polled.len();
        for wc in polled {
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
            if !recv && wc.wr_id() == BIND_WR_ID {
                st.binds.insert(wc.qp_num, status);
                continue;
            }
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
            } else if status == WcStatus::Success
                && wc.opcode() == ffi::ibv_wc_opcode::IBV_WC_RDMA_READ
            {
                (CompletionKind::Read, status)
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
}

impl VerbsCq {
    /// Waits until the bind posted on `qp_num` completes: `Ok` once the
    /// window is bound, the bind's error otherwise, or a timeout at
    /// `deadline`. Whoever polls the send CQ sets the bind's completion
    /// aside: the dispatcher's poller if it runs, else this wait itself
    /// (a connection being set up may have no poller yet), which queues any
    /// other completion it polls for the dispatcher and wakes it.
    pub(super) fn await_bind(
        &self,
        qp_num: u32,
        deadline: std::time::Instant,
    ) -> Result<(), FabricError> {
        let c = &self.inner;
        let mut nap = Duration::from_micros(5);
        loop {
            let mut others = Vec::new();
            let done = {
                let mut st = c.side.lock();
                if !st.binds.contains_key(&qp_num) {
                    c.fabric
                        .poll_cq(&c.send_cq, false, &mut st, &mut others, WC_BATCH);
                    for o in &others {
                        let inc = st.live.get(&o.qp_num).copied();
                        if let Some(inc) = inc {
                            st.queue.push_back((inc, *o));
                        }
                    }
                }
                st.binds.remove(&qp_num)
            };
            if !others.is_empty() {
                c.side.wake();
            }
            match done {
                Some(WcStatus::Success) => return Ok(()),
                Some(status) => {
                    return Err(FabricError::unreachable(
                        "ibv_post_send(bind memory window)",
                        format!("the bind failed: {status:?}"),
                    ));
                }
                None if std::time::Instant::now() >= deadline => {
                    return Err(FabricError::unreachable(
                        "ibv_post_send(bind memory window)",
                        "the bind did not complete in time",
                    ));
                }
                None => {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(Duration::from_millis(1));
                }
            }
        }
    }
}

impl CompletionQueue for VerbsCq {
    /// Receive and send completions first, then made-up ones, which only
    /// come once the CQs are drained: a made-up failure (the peer closed
    /// its liveness connection) must not overtake the writes that peer
    /// completed before closing, such as its last replies. The caller must
    /// handle the whole batch before it polls again: until then, the batch's
    /// qp numbers are kept from new queue pairs (see `SideState` in events.rs). The
    /// dispatcher's single poller does exactly that.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let c = &self.inner;
        let fabric = &c.fabric;
        let i = &fabric.inner;
        // Async events: the liveness watcher's thread reads them (see
        // `Liveness::on_async_events`), and `wait` before sleeping.
        let start = out.len();
        let parked;
        {
            // Held while polling the CQs too, so that `new_qp` sees every
            // number this batch hands out.
            let mut st = c.side.lock();
            st.handed_out.clear();
            parked = std::mem::take(&mut st.parked);
            let got = fabric.poll_cq(&c.recv_cq, true, &mut st, out, max);
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
                let sent = fabric.poll_cq(&c.send_cq, false, &mut st, out, room);
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
