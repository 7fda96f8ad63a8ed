//! The queue pair's life cycle: creation on a completion queue, the
//! handshake's INIT -> RTR -> RTS transitions, posting writes, teardown.

use super::*;

/// The QP's local ack timeout exponent: 4.096 µs × 2^15 = 134 ms, room
/// for a peer's NIC (or its kernel, on Soft-RoCE) that is slow to ack.
pub(super) const RC_ACK_TIMEOUT: u8 = 15;
/// Retransmissions of an unacknowledged write before it fails (see
/// [`VerbsFabric::connect_qp`]): 7 sends in all, about 0.94 s on Soft-RoCE.
pub(super) const RC_RETRIES: u8 = 6;
/// The work request id of a memory window's bind: never a write's (those
/// count up from zero), and kept from the dispatcher (see `await_bind`).
pub(super) const BIND_WR_ID: u64 = u64::MAX;
/// The work request id of a loan's bind (unsignaled: reported only if it
/// fails, and then the queue pair is dead anyway).
pub(super) const LEND_BIND_WR_ID: u64 = u64::MAX - 1;

impl VerbsFabric {
    /// Our half of the handshake; the ring's rkey is `window`'s (after its
    /// bind) when connections are isolated.
    pub(super) fn hello(
        &self,
        qp: &Qp,
        psn: u32,
        local: &LocalSetup<'_, VerbsRegion>,
        window: Option<&Mw>,
    ) -> Hello {
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
                rkey: window.map_or_else(|| local.ring.rkey(), Mw::rkey),
                max_message: local.max_message,
                max_streams: local.max_streams,
            },
        }
    }

    /// A memory window for `ring`, when connections are isolated.
    pub(super) fn window(&self, ring: &VerbsRegion) -> Result<Option<Mw>, FabricError> {
        if !self.inner.windows {
            return Ok(None);
        }
        Mw::alloc(self.inner.pd.clone(), ring.mr.clone()).map(Some)
    }

    /// Binds `window` (if any) to `qp`, which must be in RTS, and waits for
    /// the bind to complete: only then is its rkey valid, from `qp` alone.
    pub(super) fn bind(
        &self,
        qp: &mut LiveQp,
        window: Option<Mw>,
        cq: &VerbsCq,
        deadline: std::time::Instant,
    ) -> Result<Option<Mw>, FabricError> {
        let Some(mut window) = window else {
            return Ok(None);
        };
        let started = std::time::Instant::now();
        qp.qp.post_bind(&mut window, BIND_WR_ID)?;
        cq.await_bind(qp.qp_num(), deadline)?;
        tracing::debug!(
            qp_num = qp.qp_num(),
            took_us = started.elapsed().as_micros() as u64,
            "memory window bound"
        );
        Ok(Some(window))
    }

    /// Creates a queue pair in INIT on `cq`, registered as live there (see
    /// [`SideState`]).
    pub(super) fn new_qp(&self, cq: &VerbsCq) -> Result<LiveQp, FabricError> {
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
        // Remote read: the peer reads what this side lends (through
        // windows bound per loan where the device has them).
        a.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        use ffi::ibv_qp_attr_mask as m;
        qp.qp.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS).0,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(qp)
    }

    /// Moves `qp` to RTR then RTS towards `peer`.
    ///
    /// `retry_cnt` is 6, not the field's maximum of 7: Soft-RoCE takes 7 to
    /// mean "retry forever" (as `rnr_retry` does by the spec), and then a
    /// peer host that vanishes is never noticed at this level.
    pub(super) fn connect_qp(&self, qp: &Qp, psn: u32, peer: &Hello) -> Result<(), FabricError> {
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
        a.max_dest_rd_atomic = self.inner.rd_atomic;
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
        // An unacknowledged write is sent again after 4.096 µs × 2^15 =
        // 134 ms, up to RC_RETRIES times, then fails with RetryExceeded: the
        // budget within which a vanished peer host is noticed once
        // something (a heartbeat at least) is in flight.
        a.timeout = RC_ACK_TIMEOUT;
        a.retry_cnt = RC_RETRIES;
        a.rnr_retry = 7; // retry forever: the SRQ is refilled, RNR only delays
        a.sq_psn = psn;
        a.max_rd_atomic = self.inner.rd_atomic;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        qp.modify(&mut a, mask.0, "ibv_modify_qp(RTS)")
    }

    pub(super) fn finish(
        &self,
        link: Link,
        qp: LiveQp,
        window: Option<Mw>,
        peer: Hello,
        pending: Option<Hello>,
        identity: Option<String>,
    ) -> Result<Connected<VerbsQp>, FabricError> {
        let side = qp.side.clone();
        let stream = &link.stream;
        stream
            .set_read_timeout(None)
            .map_err(|e| FabricError::io("set_read_timeout", e))?;
        // The side channel stays idle: keepalive notices a vanished host
        // there; heartbeats on the queue pair itself notice it sooner.
        set_keepalive(stream)?;
        let peer_addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let watched = self
            .inner
            .liveness
            .watch(stream, side, qp.qp_num(), qp.incarnation)?;
        Ok(Connected {
            qp: VerbsQp {
                loans: HashMap::new(),
                _window: window,
                qp,
                reads: HashMap::new(),
                queued_reads: VecDeque::new(),
                reads_in_flight: 0,
                max_reads: usize::from(self.inner.rd_atomic),
                windows: self.inner.windows,
                link,
                pending,
                _watched: watched,
            },
            peer: peer.ring,
            peer_addr: format!("rdma://{peer_addr}"),
            identity,
            fabric: "rdma",
        })
    }
}

pub(super) fn random_psn() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ (std::process::id() as u64).rotate_left(32);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x as u32) & 0x00ff_ffff
}

/// A buffer lent to the peer: through its own window when connections
/// are isolated (freed first: deallocating the window ends the peer's
/// access before the buffer goes back to the cache).
pub(super) struct Loan {
    window: Option<Mw>,
    _buf: VerbsBuffer,
}

/// A read of a lent payload: waiting for one of those in flight (at most
/// [`MAX_READS`]) to complete, or in flight (the device writes the buffer).
enum Read {
    Queued(VerbsBuffer, RemoteBuf),
    InFlight(VerbsBuffer),
}

/// A connected RC queue pair, with its liveness connection.
pub struct VerbsQp {
    /// Buffers lent to the peer, by rkey. Their windows go before the
    /// queue pair (see `_window`).
    pub(super) loans: HashMap<u32, Loan>,
    /// The window the peer writes our ring through, if connections are
    /// isolated. Freed before the queue pair (fields drop in order): a
    /// bound window holds its queue pair, and Soft-RoCE's destroy waits
    /// for it forever.
    pub(super) _window: Option<Mw>,
    pub(super) qp: LiveQp,
    /// Reads of the peer's loans, by work request id. Freed after the
    /// queue pair, which stops the device writing into them.
    reads: HashMap<u64, Read>,
    queued_reads: VecDeque<u64>,
    reads_in_flight: usize,
    /// Reads the device runs at once: [`MAX_READS`], or fewer if it allows
    /// fewer (the queue pair's `max_rd_atomic`).
    max_reads: usize,
    /// Whether loans go through windows.
    windows: bool,
    /// The handshake connection (with its TLS session, if it uses TLS):
    /// it carries the server's hello, then only the end of the connection.
    pub(super) link: Link,
    pub(super) pending: Option<Hello>,
    /// Watching `stream` for the peer's end; stops when dropped.
    pub(super) _watched: Watched,
}

impl VerbsQp {
    fn issue_read(
        &mut self,
        wr_id: u64,
        dst: &VerbsBuffer,
        src: RemoteBuf,
    ) -> Result<(), FabricError> {
        let len = u32::try_from(src.len)
            .map_err(|_| FabricError::invalid("post_read", "a read of 4 GiB or more"))?;
        // SAFETY: `dst` goes into `self.reads` now, and leaves it only once
        // the read completed (`take_read`) or after the queue pair is
        // destroyed (field order): the device writes it alone meanwhile.
        unsafe {
            self.qp
                .qp
                .post_read(wr_id, dst.mr(), len, src.addr, src.rkey)
        }?;
        self.reads_in_flight += 1;
        Ok(())
    }
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

    /// Chains up to `MAX_CHAIN` (16) work requests per `ibv_post_send`: one
    /// doorbell for the lot.
    fn post_write_imm_batch<'a>(
        &mut self,
        count: usize,
        wr: impl Fn(usize) -> WriteImm<'a, VerbsRegion>,
    ) -> Result<(), FabricError> {
        let mut first = 0;
        while first < count {
            let n = (count - first).min(MAX_CHAIN);
            // Only the `n` requests posted are written (a lone call's post
            // zeroed 2.3 KiB of requests and SGEs it did not use).
            let mut sges = [const { std::mem::MaybeUninit::<ffi::ibv_sge>::uninit() }; MAX_CHAIN];
            let mut wrs =
                [const { std::mem::MaybeUninit::<ffi::ibv_send_wr>::uninit() }; MAX_CHAIN];
            for i in 0..n {
                let wr = wr(first + i);
                // SAFETY: plain old data; zero is valid.
                let w = wrs[i].write(unsafe { std::mem::zeroed() });
                let mut len = 0;
                if let Some((region, off, l)) = wr.local {
                    assert!(
                        off.checked_add(l).is_some_and(|end| end <= region.len()),
                        "write source out of region bounds"
                    );
                    sges[i].write(ffi::ibv_sge {
                        addr: region.addr() + off as u64,
                        length: l as u32,
                        lkey: region.mr.lkey(),
                    });
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
            let wrs_at = wrs.as_mut_ptr().cast::<ffi::ibv_send_wr>();
            let sges_at = sges.as_mut_ptr().cast::<ffi::ibv_sge>();
            for i in 0..n {
                // SAFETY: requests 0..n were written above (and SGE i where
                // request i has one); the pointers stay within the arrays.
                unsafe {
                    let w = &mut *wrs_at.add(i);
                    if w.num_sge > 0 {
                        w.sg_list = sges_at.add(i);
                    }
                    if i + 1 < n {
                        w.next = wrs_at.add(i + 1);
                    }
                }
            }
            // SAFETY: the chain's `n` requests (written above) and their
            // SGEs live on this stack frame for the call (verbs copies
            // them). Each SGE names a registered region of this context's
            // PD; the dispatcher keeps the region alive longer than the
            // queue pair and reuses its bytes only after the peer released
            // them (which implies the write was executed).
            unsafe { self.qp.qp.post_send(&mut *wrs_at) }?;
            first += n;
        }
        Ok(())
    }

    /// Heartbeats are silent writes: the peer's NIC acknowledges them
    /// (the reliable connection fails them after its retries if it cannot),
    /// and the peer's dispatcher never sees them.
    fn probe_every(&mut self, _every: Duration) -> Result<Probe, FabricError> {
        Ok(Probe::Silent)
    }

    fn post_probe(
        &mut self,
        wr_id: u64,
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<(), FabricError> {
        // SAFETY: plain old data; zero is valid (no SGE: zero length).
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        if signaled {
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        // SAFETY: one request without SGEs, on this stack frame for the
        // call (verbs copies it); a zero-length write touches no memory on
        // either side.
        unsafe { self.qp.qp.post_send(&mut wr) }
    }

    /// What the protocol may have in flight of its own writes: half of
    /// what the send queue holds after the reads in flight, since each
    /// loan's bind takes an entry beside its descriptor's write.
    fn send_queue_depth(&self) -> usize {
        (self.qp.qp.sq_depth as usize).saturating_sub(MAX_READS) / 2
    }

    fn lend(&mut self, buf: VerbsBuffer) -> Result<RemoteBuf, FabricError> {
        let mr = buf.mr().clone();
        let addr = mr.buf.as_ptr() as u64;
        let len = buf.len;
        if !self.windows {
            // The weaker mode (see `isolates_connections`): the region's
            // own rkey grants reading it.
            let rkey = mr.rkey();
            self.loans.insert(
                rkey,
                Loan {
                    window: None,
                    _buf: buf,
                },
            );
            return Ok(RemoteBuf {
                addr,
                len: len as u64,
                rkey,
            });
        }
        let mut window = Mw::alloc(self.qp.qp.pd().clone(), mr)?;
        let access = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        // Ordered before the descriptor's write on this send queue: the
        // peer learns the rkey only once the window is bound.
        self.qp
            .qp
            .post_bind_range(&mut window, len, access, LEND_BIND_WR_ID, false)?;
        let rkey = window.rkey();
        self.loans.insert(
            rkey,
            Loan {
                window: Some(window),
                _buf: buf,
            },
        );
        Ok(RemoteBuf {
            addr,
            len: len as u64,
            rkey,
        })
    }

    /// Deallocating the loan's window invalidates it at once: the peer can
    /// read the buffer no more, and it goes back to the cache.
    fn unlend(&mut self, rkey: u32) -> bool {
        match self.loans.remove(&rkey) {
            Some(mut loan) => {
                drop(loan.window.take());
                true
            }
            None => false,
        }
    }

    fn post_read(
        &mut self,
        wr_id: u64,
        dst: VerbsBuffer,
        src: RemoteBuf,
    ) -> Result<(), FabricError> {
        if src.len > dst.len as u64 {
            return Err(FabricError::invalid(
                "post_read",
                format!("reading {} bytes into a buffer of {}", src.len, dst.len),
            ));
        }
        if self.reads_in_flight >= self.max_reads {
            self.reads.insert(wr_id, Read::Queued(dst, src));
            self.queued_reads.push_back(wr_id);
            return Ok(());
        }
        self.issue_read(wr_id, &dst, src)?;
        self.reads.insert(wr_id, Read::InFlight(dst));
        Ok(())
    }

    fn max_reads(&self) -> usize {
        self.max_reads
    }

    fn take_read(&mut self, wr_id: u64) -> Option<VerbsBuffer> {
        let Some(Read::InFlight(buf)) = self.reads.remove(&wr_id) else {
            return None;
        };
        self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
        while self.reads_in_flight < self.max_reads {
            let Some(next) = self.queued_reads.pop_front() else {
                break;
            };
            let Some(Read::Queued(dst, src)) = self.reads.remove(&next) else {
                continue;
            };
            // A failed post means the queue pair is dead: its error
            // completion closes the connection.
            if let Err(e) = self.issue_read(next, &dst, src) {
                tracing::debug!(error = %e, "cannot post a queued read");
            }
            self.reads.insert(next, Read::InFlight(dst));
        }
        Some(buf)
    }

    fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending.take() {
            bootstrap::send(&mut self.link, &hello)?;
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
        let _ = self.link.stream.shutdown(Shutdown::Both);
    }
}
