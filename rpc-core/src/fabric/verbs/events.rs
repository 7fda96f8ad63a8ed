//! Completions made up in software (a dead peer, an async error event) and
//! the incarnations that keep them from reaching the wrong queue pair; the
//! device's asynchronous events.

use super::*;

/// State shared with liveness watchers and queue pairs: completions made up
/// in software (a dead peer, an async error event), the queue pairs alive,
/// and the wake-up file descriptor.
pub(super) struct Side {
    pub(super) state: Mutex<SideState>,
    pub(super) wake_fd: i32,
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
pub(super) struct SideState {
    pub(super) queue: VecDeque<(u64, Completion)>,
    /// qp_num -> incarnation of every queue pair alive on this context.
    pub(super) live: HashMap<u32, u64>,
    pub(super) next_incarnation: u64,
    /// qp numbers of the completions the last `poll` handed out.
    pub(super) handed_out: Vec<u32>,
    /// Queue pairs created with a number in `handed_out`; see above.
    pub(super) parked: Vec<Qp>,
    /// Why the context is unusable, after a fatal async event.
    pub(super) fatal: Option<String>,
    /// The status of each memory-window bind completed and not yet
    /// awaited, by qp number (see `VerbsCq::await_bind`).
    pub(super) binds: HashMap<u32, WcStatus>,
}

impl Side {
    /// An empty queue with its wake-up eventfd.
    pub(super) fn new() -> Result<Arc<Side>, FabricError> {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, SideState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `c` if its queue pair is alive, and is incarnation `inc` when
    /// one is given. `None` takes whatever incarnation is alive: for async
    /// events, whose queue pair cannot be destroyed (nor its number reused)
    /// before the event is acknowledged.
    pub(super) fn push_if_live(&self, inc: Option<u64>, c: Completion) -> bool {
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
    pub(super) fn fail_all(&self, why: String, event: u32) -> usize {
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

    pub(super) fn wake(&self) {
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
pub(super) struct LiveQp {
    pub(super) qp: Qp,
    pub(super) incarnation: u64,
    pub(super) side: Arc<Side>,
}

impl LiveQp {
    pub(super) fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// Retires this incarnation and purges its made-up completions. Idempotent.
    pub(super) fn retire(&self) {
        let n = self.qp_num();
        let mut st = self.side.lock();
        if st.live.get(&n) == Some(&self.incarnation) {
            st.live.remove(&n);
        }
        st.queue.retain(|(_, c)| c.qp_num != n);
        st.binds.remove(&n);
    }
}

impl Drop for LiveQp {
    fn drop(&mut self) {
        // Before `qp` is destroyed (fields drop after this), while the
        // number is still ours.
        self.retire();
    }
}

impl VerbsFabric {
    /// Drains asynchronous events: QP errors fail their connection, fatal
    /// errors every connection; a low SRQ is topped up.
    pub(super) fn drain_async(&self) {
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
                    self.top_up_srq();
                    // Counted once handled: whoever sees the count sees the
                    // receives the top-up posted.
                    self.inner.srq_limit_events.fetch_add(1, Ordering::AcqRel);
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
    pub(super) fn sides(&self) -> Vec<Arc<Side>> {
        let mut sides = self.inner.sides.lock().unwrap_or_else(|e| e.into_inner());
        sides.retain(|s| s.strong_count() > 0);
        sides.iter().filter_map(std::sync::Weak::upgrade).collect()
    }

    /// Marks the context unusable and fails every live queue pair of every
    /// completion queue; returns how many.
    pub(super) fn fail_all(&self, why: String, event: u32) -> usize {
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
    pub(super) fn top_up_srq(&self) {
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
}
