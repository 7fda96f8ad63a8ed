//! One connection: its rings, credits, and send path (staging, corking,
//! batching, backlog).

use super::*;

/// Message buffers a connection keeps for reuse, and the largest it keeps.
pub(super) const MAX_POOLED_BUFFERS: usize = 256;
pub(super) const MAX_POOLED_BUFFER: usize = 256 << 10;
/// Largest peer receive ring accepted (unless the local ring is larger):
/// each connection stages its outgoing frames in a mirror of the peer's ring.
pub(super) const MAX_PEER_RING: usize = 64 << 20;

/// A write staged while the poller handles a batch, posted with the others
/// at the end of it.
pub(super) struct StagedWrite {
    pub(super) local: Option<(usize, usize)>,
    pub(super) imm: u32,
    pub(super) wr_id: u64,
    pub(super) signaled: bool,
}

/// Most writes posted as one batch.
pub(super) const MAX_POST_BATCH: usize = 64;

/// Frames waiting for ring (or send-queue) space, fully encoded.
pub(super) struct Backlog {
    pub(super) frames: VecDeque<Vec<u8>>,
    pub(super) bytes: usize,
}

pub(super) struct SendState<F: Fabric> {
    pub(super) qp: Option<F::Qp>,
    pub(super) staging: F::Region,
    pub(super) ring: SendRing,
    pub(super) credits: CreditReturn,
    pub(super) backlog: Backlog,
    /// Writes posted, and the last one known complete (send-queue accounting).
    pub(super) posted: u64,
    pub(super) completed: u64,
    pub(super) sq_depth: u64,
    pub(super) dead: Option<String>,
    /// While the poller handles a batch of completions for this connection,
    /// writes are staged here and posted together after it.
    pub(super) batching: bool,
    /// A caller's request is staged, to go out with the requests other
    /// callers issue meanwhile (see [`Conn::send_corked`]).
    pub(super) corked: bool,
    pub(super) staged: Vec<StagedWrite>,
}

/// Why a frame could not be sent.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The connection is gone.
    Closed(String),
    /// The frame can never fit (larger than the peer accepts).
    TooLarge { len: usize, max: usize },
    /// Ring full and the caller asked not to wait, or the backlog is full.
    Full(&'static str),
    /// Metadata larger than a frame can carry.
    Metadata(usize),
}

impl From<SendError> for Status {
    fn from(e: SendError) -> Status {
        match e {
            SendError::Closed(why) => Status::unavailable(format!("connection closed: {why}")),
            SendError::TooLarge { len, max } => Status::resource_exhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {max} bytes"
            )),
            SendError::Full(why) => Status::resource_exhausted(why),
            SendError::Metadata(len) => Status::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {} bytes",
                crate::metadata::MAX_ENCODED_LEN
            )),
        }
    }
}

/// A frame to send: everything but the ack, which is stamped at posting.
pub(crate) struct OutFrame<'a> {
    pub kind: FrameKind,
    pub call_id: CallId,
    pub method_id: u32,
    pub status: u16,
    pub timeout_us: u32,
    pub metadata: Option<&'a Metadata>,
    pub payload_len: usize,
}

/// One connection: its queue pair, its receive ring and the peer's.
pub(crate) struct Conn<F: Fabric> {
    pub qp_num: u32,
    pub peer_addr: String,
    pub(super) peer: PeerRing,
    pub(super) recv_region: F::Region,
    pub(super) recv: Mutex<RecvRing>,
    pub(super) send: Mutex<SendState<F>>,
    pub(super) failure: Mutex<Option<String>>,
    pub(super) max_backlog: usize,
    /// Receives posted for this connection (see [`Endpoint::add`]).
    pub(super) recvs: u32,
    /// Largest message (metadata + payload) accepted from the peer.
    pub(super) max_message: usize,
    /// Responses that named no live call of this connection.
    pub(super) stale: AtomicU64,
    /// Buffers incoming messages are copied into, for reuse.
    pub(super) buffers: Mutex<Vec<Vec<u8>>>,
}

/// The queue pair goes first, whatever path drops a connection: the device
/// must stop using the rings and staging area before they are deregistered.
impl<F: Fabric> Drop for Conn<F> {
    fn drop(&mut self) {
        let send = self.send.get_mut().unwrap_or_else(|e| e.into_inner());
        send.qp = None;
    }
}

impl<F: Fabric> Conn<F> {
    /// `c` comes last so that, on an error return, the queue pair it holds is
    /// dropped before the regions (parameters drop in reverse order).
    pub(super) fn new(
        recv_region: F::Region,
        staging: F::Region,
        max_backlog: usize,
        c: Connected<F::Qp>,
    ) -> Result<Conn<F>, Status> {
        let cap = recv_region.len();
        let ring_err = |e: crate::protocol::RingError| Status::internal(format!("ring: {e}"));
        let peer_cap =
            usize::try_from(c.peer.len).map_err(|_| Status::internal("peer ring too large"))?;
        if staging.len() < peer_cap {
            return Err(Status::resource_exhausted(format!(
                "peer ring of {peer_cap} bytes is larger than the local staging area of {} bytes",
                staging.len()
            )));
        }
        let sq_depth = c.qp.send_queue_depth() as u64;
        Ok(Conn {
            qp_num: c.qp.qp_num(),
            peer_addr: c.peer_addr,
            peer: c.peer,
            recv: Mutex::new(RecvRing::new(cap).map_err(ring_err)?),
            recv_region,
            send: Mutex::new(SendState {
                qp: Some(c.qp),
                staging,
                ring: SendRing::new(peer_cap).map_err(ring_err)?,
                credits: CreditReturn::new(cap),
                backlog: Backlog {
                    frames: VecDeque::new(),
                    bytes: 0,
                },
                posted: 0,
                completed: 0,
                sq_depth,
                dead: None,
                batching: false,
                corked: false,
                staged: Vec::with_capacity(MAX_POST_BATCH),
            }),
            failure: Mutex::new(None),
            max_backlog,
            recvs: 0,
            max_message: 0,
            stale: AtomicU64::new(0),
            buffers: Mutex::new(Vec::new()),
        })
    }

    pub(super) fn send_state(&self) -> MutexGuard<'_, SendState<F>> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The largest message the peer accepts.
    pub(crate) fn peer_max_message(&self) -> usize {
        self.peer.max_message as usize
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.send_state().dead.is_none()
    }

    /// Why the connection died, if it did.
    pub(crate) fn death(&self) -> Option<String> {
        self.send_state().dead.clone()
    }

    /// Counts a response that named no live call of this connection.
    pub(crate) fn note_stale(&self) {
        self.stale.fetch_add(1, Ordering::Relaxed);
    }

    /// Responses that named no live call of this connection.
    pub(crate) fn stale_responses(&self) -> u64 {
        self.stale.load(Ordering::Relaxed)
    }

    /// Tells the handshake's last message (server side) once registered.
    pub(crate) fn established(&self) -> Result<(), Status> {
        let mut s = self.send_state();
        match s.qp.as_mut() {
            Some(qp) => qp.established().map_err(Status::from),
            None => Err(Status::unavailable("connection closed during set-up")),
        }
    }

    /// Destroys the queue pair (the peer sees it) and drops queued frames.
    pub(crate) fn kill(&self, why: &str) {
        let mut s = self.send_state();
        if s.dead.is_none() {
            s.dead = Some(why.to_owned());
        }
        s.backlog.frames.clear();
        s.backlog.bytes = 0;
        s.staged.clear();
        s.batching = false;
        s.qp = None;
    }

    pub(super) fn set_failure(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(why);
        }
    }

    pub(super) fn take_failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Encodes and posts a frame, or queues it if the peer's ring is full;
    /// frames [`Conn::send_corked`] left staged go with it. `fill` writes
    /// exactly `frame.payload_len` payload bytes.
    pub(crate) fn send(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        self.send_with(frame, fail_fast, false, fill).map(drop)
    }

    /// Like [`Conn::send`], but the write may stay staged until
    /// [`Conn::uncork`] (or a full batch, or a turn of the dispatcher that
    /// touches this connection): requests that callers issue back to back
    /// then leave in one post, one vectored write on tcp://. Returns whether
    /// this write corked the connection: then hand it to
    /// [`Endpoint::corked`], so that it leaves even if nobody uncorks it.
    pub(crate) fn send_corked(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_with(frame, fail_fast, true, fill)
    }

    /// Posts the writes [`Conn::send_corked`] left staged.
    pub(crate) fn uncork(&self) {
        let mut s = self.send_state();
        if s.corked {
            s.corked = false;
            if !(s.batching && IN_TURN.get()) {
                self.post_staged(&mut s);
            }
        }
    }

    /// Whether writes wait for [`Conn::uncork`].
    pub(crate) fn is_corked(&self) -> bool {
        self.send_state().corked
    }

    pub(super) fn send_with(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let md_len = frame.metadata.map_or(0, Metadata::encoded_len);
        if md_len > crate::metadata::MAX_ENCODED_LEN {
            return Err(SendError::Metadata(md_len));
        }
        let body = md_len + frame.payload_len;
        if body > self.peer_max_message() {
            return Err(SendError::TooLarge {
                len: body,
                max: self.peer_max_message(),
            });
        }
        let len = HEADER_LEN + body;
        let header = Header {
            kind: frame.kind,
            status: frame.status,
            method_id: frame.method_id,
            call_id: frame.call_id,
            payload_len: frame.payload_len as u32,
            metadata_len: md_len as u16,
            timeout_us: frame.timeout_us,
            ack: 0,
        };
        let mut write = |buf: &mut [u8], ack: u32| {
            let mut h = header;
            h.ack = ack;
            h.encode((&mut buf[..HEADER_LEN]).try_into().expect("header slice"));
            if let Some(md) = frame.metadata {
                md.encode(&mut buf[HEADER_LEN..HEADER_LEN + md_len]);
            }
            fill(&mut buf[HEADER_LEN + md_len..]);
        };
        let mut s = self.send_state();
        if let Some(why) = &s.dead {
            return Err(SendError::Closed(why.clone()));
        }
        if s.backlog.frames.is_empty() && s.sq_room() {
            match s.ring.reserve(len) {
                Ok(Some(slot)) => {
                    let ack = s.credits.take_ack();
                    s.staging.write(slot.offset, len, |buf| write(buf, ack));
                    let was_corked = s.corked;
                    // A frame that is not corked takes the corked ones with it.
                    s.corked = cork;
                    self.post(&mut s, slot.offset, len);
                    return Ok(s.corked && !was_corked);
                }
                Ok(None) => {}
                Err(_) => {
                    return Err(SendError::TooLarge {
                        len: body,
                        max: s.ring.max_frame() - HEADER_LEN,
                    });
                }
            }
        }
        if fail_fast {
            return Err(SendError::Full(
                "the peer's receive ring is full (fail-fast call)",
            ));
        }
        if s.backlog.bytes + len > self.max_backlog {
            return Err(SendError::Full(
                "too many bytes queued for the peer's full receive ring",
            ));
        }
        let mut bytes = vec![0u8; len];
        write(&mut bytes, 0);
        s.backlog.bytes += len;
        s.backlog.frames.push_back(bytes);
        Ok(false)
    }

    /// Posts the frame staged at `offset`. Marks the connection failed on error.
    pub(super) fn post(&self, s: &mut SendState<F>, offset: usize, len: usize) {
        let imm = Doorbell::Frame {
            offset_units: (offset / ALIGN) as u32,
        }
        .encode();
        self.post_write(s, Some((offset, len)), imm, false);
    }

    /// Posts a write, or stages it while the poller handles a batch; returns
    /// its work request id. It is signaled if `signal`, and anyway one in
    /// [`SIGNAL_EVERY`].
    pub(super) fn post_write(
        &self,
        s: &mut SendState<F>,
        local: Option<(usize, usize)>,
        imm: u32,
        signal: bool,
    ) -> u64 {
        s.posted += 1;
        let wr_id = s.posted;
        s.staged.push(StagedWrite {
            local,
            imm,
            wr_id,
            signaled: signal || wr_id % SIGNAL_EVERY as u64 == 0,
        });
        let held = s.corked || (s.batching && IN_TURN.get());
        if !held || s.staged.len() >= MAX_POST_BATCH {
            self.post_staged(s);
        }
        wr_id
    }

    /// Posts a credit doorbell carrying the current ack; returns its id.
    pub(super) fn post_credit(&self, s: &mut SendState<F>, signal: bool) -> u64 {
        let ack = s.credits.take_ack();
        self.post_write(s, None, Doorbell::Credit { ack }.encode(), signal)
    }

    /// Posts the staged writes, in order, as one batch.
    pub(super) fn post_staged(&self, s: &mut SendState<F>) {
        s.corked = false;
        if s.staged.is_empty() {
            return;
        }
        let SendState {
            qp,
            staging,
            staged,
            ..
        } = s;
        let peer = self.peer;
        let result = match qp.as_mut() {
            Some(qp) => qp
                .post_write_imm_batch(staged.len(), |i| {
                    let w = &staged[i];
                    WriteImm {
                        wr_id: w.wr_id,
                        local: w.local.map(|(off, len)| (&*staging, off, len)),
                        remote_addr: peer.addr + w.local.map_or(0, |(off, _)| off as u64),
                        rkey: peer.rkey,
                        imm: w.imm,
                        signaled: w.signaled,
                    }
                })
                .map_err(|e| e.to_string()),
            None => Err("queue pair destroyed".to_owned()),
        };
        staged.clear();
        if let Err(why) = result {
            s.dead.get_or_insert_with(|| why.clone());
            self.set_failure(why);
        }
    }

    /// The poller starts handling a batch of completions for this connection:
    /// writes are staged until [`Conn::after_batch`].
    pub(super) fn begin_batch(&self) {
        self.send_state().batching = true;
    }

    pub(super) fn on_send_completion(&self, wr_id: u64) {
        let mut s = self.send_state();
        s.completed = s.completed.max(wr_id);
        self.flush(&mut s);
    }

    /// Handles a doorbell. `Ok(Some)` is a frame for the role; `Err` a protocol violation.
    pub(super) fn on_doorbell(
        &self,
        imm: u32,
        byte_len: u32,
        max_message: usize,
    ) -> Result<Option<Frame>, String> {
        match Doorbell::decode(imm) {
            None => Err(format!("invalid immediate {imm:#010x}")),
            Some(Doorbell::Credit { ack }) => {
                let mut s = self.send_state();
                apply_ack(&mut s.ring, ack).map_err(|e| format!("bad credit: {e}"))?;
                self.flush(&mut s);
                Ok(None)
            }
            Some(Doorbell::Frame { offset_units }) => {
                let mut recv = self.recv.lock().unwrap_or_else(|e| e.into_inner());
                let slot = recv.locate(offset_units).map_err(|e| e.to_string())?;
                let room = recv.room_at(slot);
                if room < HEADER_LEN {
                    return Err(format!(
                        "frame at offset {} has no room for a header",
                        slot.offset
                    ));
                }
                let mut raw = [0u8; HEADER_LEN];
                self.recv_region.copy_to(slot.offset, &mut raw);
                let header = Header::decode(&raw).map_err(|e| format!("bad frame header: {e}"))?;
                let len = header.frame_len();
                let body = len - HEADER_LEN;
                if body > max_message {
                    return Err(format!(
                        "frame body of {body} bytes exceeds the limit of {max_message}"
                    ));
                }
                if len > room {
                    return Err(format!(
                        "frame of {len} bytes at offset {} runs past the ring",
                        slot.offset
                    ));
                }
                if byte_len != 0 && byte_len as usize != len {
                    return Err(format!(
                        "write of {byte_len} bytes carries a frame of {len}"
                    ));
                }
                let md_len = header.metadata_len as usize;
                let metadata = if md_len == 0 {
                    Some(Metadata::new())
                } else {
                    self.recv_region
                        .read(slot.offset + HEADER_LEN, md_len, Metadata::decode)
                };
                let mut payload = self.take_buffer();
                payload.resize(body - md_len, 0);
                self.recv_region
                    .copy_to(slot.offset + HEADER_LEN + md_len, &mut payload);
                recv.consume(slot, len).map_err(|e| e.to_string())?;
                let consumed = recv.consumed();
                drop(recv);
                let mut s = self.send_state();
                s.credits.on_consumed(consumed);
                apply_ack(&mut s.ring, header.ack).map_err(|e| format!("bad credit: {e}"))?;
                drop(s);
                Ok(Some(Frame {
                    header,
                    metadata,
                    payload,
                }))
            }
        }
    }

    /// After a batch of frames: return credits if needed, flush the backlog,
    /// and post everything staged meanwhile.
    pub(super) fn after_batch(&self) {
        let mut s = self.send_state();
        self.flush(&mut s);
        // A quarter of the ring unreported, or few bytes that still block a
        // sender whose next frame must wrap: either way, nothing may be
        // flowing back to carry the ack, so send it alone.
        if (s.credits.needs_explicit() || s.credits.may_stall_sender()) && s.dead.is_none() {
            self.post_credit(&mut s, false);
        }
        s.batching = false;
        if s.dead.is_none() {
            self.post_staged(&mut s);
        } else {
            s.staged.clear();
        }
    }

    /// Posts queued frames while the peer's ring and the send queue have room.
    pub(super) fn flush(&self, s: &mut SendState<F>) {
        while s.dead.is_none() && s.sq_room() {
            let Some(len) = s.backlog.frames.front().map(Vec::len) else {
                break;
            };
            let Ok(Some(slot)) = s.ring.reserve(len) else {
                break;
            };
            let bytes = s.backlog.frames.pop_front().expect("front exists");
            s.backlog.bytes -= len;
            let ack = s.credits.take_ack();
            s.staging.write(slot.offset, len, |buf| {
                buf.copy_from_slice(&bytes);
                buf[28..32].copy_from_slice(&ack.to_le_bytes());
            });
            self.post(s, slot.offset, len);
        }
    }

    /// A buffer for an incoming message, reused if one was given back.
    pub(super) fn take_buffer(&self) -> Vec<u8> {
        let mut buf = self
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.clear();
        buf
    }

    /// Gives back a buffer that held an incoming message, once decoded.
    pub(crate) fn recycle(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > MAX_POOLED_BUFFER {
            return;
        }
        let mut pool = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < MAX_POOLED_BUFFERS {
            pool.push(buf);
        }
    }

    /// Posts a signaled credit doorbell and returns its work request id, or
    /// `None` if it cannot be posted now (send queue full) or the connection
    /// is dead. Once that write completes, every write posted before it has
    /// executed: a reliable connection completes writes in order.
    pub(crate) fn post_fence(&self) -> Option<u64> {
        let mut s = self.send_state();
        if s.dead.is_some() || !s.sq_room() {
            return None;
        }
        let wr_id = self.post_credit(&mut s, true);
        // Staged by a batch under way on this thread? Post it now anyway.
        self.post_staged(&mut s);
        Some(wr_id)
    }

    /// Whether the write `wr_id` (and so every one before it) completed, or
    /// the connection died: either way nothing is left to wait for.
    pub(crate) fn completed_through(&self, wr_id: u64) -> bool {
        let s = self.send_state();
        s.dead.is_some() || s.completed >= wr_id
    }

    /// Whether frames wait to be posted: queued for the peer's ring, or
    /// staged until the batch being handled ends.
    pub(crate) fn has_unsent(&self) -> bool {
        let s = self.send_state();
        s.backlog.bytes > 0 || !s.staged.is_empty()
    }
}

impl<F: Fabric> SendState<F> {
    /// Room in the send queue for one more write (keeps one for a credit).
    pub(super) fn sq_room(&self) -> bool {
        self.posted - self.completed + 2 < self.sq_depth
    }
}
