//! One connection: its rings, credits, and send path (staging, corking,
//! batching, backlog).

use super::*;
use crate::auth::Peer;
use crate::fabric::{Probe, RemoteBuf};
use crate::observe::Side;
use crate::payload::Payload;
use crate::protocol::header::{FLAG_LENT, LENT_LEN, Lent};
use crate::protocol::staging_size;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Message buffers a connection keeps for reuse, and the largest it keeps.
pub(super) const MAX_POOLED_BUFFERS: usize = 256;
pub(super) const MAX_POOLED_BUFFER: usize = 256 << 10;
/// Largest peer receive ring accepted (unless the local ring is larger):
/// each connection stages its outgoing frames in half as many bytes.
pub(super) const MAX_PEER_RING: usize = 64 << 20;

/// The largest peer ring a side whose own ring is `own_ring` bytes stages
/// for: [`MAX_PEER_RING`], or its own ring if larger.
pub(crate) fn staging_limit(own_ring: usize) -> usize {
    MAX_PEER_RING.max(own_ring)
}

/// The send path's state: the protocol's [`Sender`] and what it needs from
/// the fabric (the queue pair and the staging area).
pub(super) struct SendState<F: Fabric> {
    pub(super) qp: Option<F::Qp>,
    pub(super) staging: F::Region,
    pub(super) proto: Sender,
    /// The heartbeat, if on (see [`Conn::heartbeat_tick`]).
    pub(super) heartbeat: Option<Heartbeat>,
    /// Payloads lent to the peer and not yet released.
    pub(super) loans: Loans,
}

/// Bytes of large messages one connection may have lent to its peer and
/// not had released, at least (twice the largest message this side takes,
/// if more: the peer's claim does not raise it): a peer that does not release what it read (or never reads)
/// holds at most this much of this side's memory. A send past it fails
/// with `ResourceExhausted`; one message is always lent, however large.
/// An honest peer holds less while it keeps up: it reads [`MAX_READING`]
/// at a time and releases each payload once read.
pub(crate) const MIN_MAX_LENT: usize = 4 * MAX_READING;

/// The payloads a connection lent and the peer has not released.
#[derive(Default)]
pub(super) struct Loans {
    /// Each loan's bytes, by its key.
    by_rkey: HashMap<u32, usize>,
    /// Their sum.
    bytes: usize,
}

impl Loans {
    /// Whether `len` more bytes may be lent by a side that takes messages
    /// of up to `max_message` bytes (see [`MIN_MAX_LENT`]).
    fn check(&self, len: usize, max_message: usize) -> Result<(), SendError> {
        let max = MIN_MAX_LENT.max(max_message.saturating_mul(2));
        if self.bytes == 0 || self.bytes.saturating_add(len) <= max {
            return Ok(());
        }
        Err(SendError::NoBuffer(format!(
            "the peer holds {} bytes of large messages it has not released; \
             {len} more would pass the {max} bytes a connection lends",
            self.bytes
        )))
    }

    fn lent(&mut self, rkey: u32, len: usize) {
        self.bytes += len;
        if let Some(old) = self.by_rkey.insert(rkey, len) {
            self.bytes -= old;
        }
    }

    fn released(&mut self, rkey: u32) {
        if let Some(len) = self.by_rkey.remove(&rkey) {
            self.bytes -= len;
        }
    }
}

/// A connection's heartbeat schedule.
#[derive(Debug, Clone, Copy)]
pub(super) struct Heartbeat {
    /// Half the interval: how often it ticks.
    half: Duration,
    /// When the next tick is due.
    next: Instant,
    /// How long the peer's transport may acknowledge nothing while writes
    /// wait (see [`QueuePair::unacknowledged_for`](crate::fabric::QueuePair::unacknowledged_for)).
    unacked_limit: Duration,
    /// Beat only once the peer has written to us (see [`Conn::heard`]).
    after_peer: bool,
    /// How a beat reaches the peer, as the queue pair said.
    probe: Probe,
}

impl From<SendError> for Status {
    fn from(e: SendError) -> Status {
        match e {
            SendError::Closed(why) => Status::unavailable(format!("connection closed: {why}")),
            SendError::TooLarge { len, max } => Status::resource_exhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {max} bytes (a server \
                 raises it with ServerBuilder::max_message_size, a client with \
                 ChannelBuilder::max_message_size)"
            )),
            SendError::Full(why) => Status::resource_exhausted(why),
            SendError::Metadata(len) => Status::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {} bytes",
                crate::metadata::MAX_ENCODED_LEN
            )),
            SendError::NoBuffer(why) => {
                Status::resource_exhausted(format!("no buffer for a large message: {why}"))
            }
        }
    }
}

/// A frame to send: everything but the ack, which is stamped at posting.
pub(crate) struct OutFrame<'a> {
    pub kind: FrameKind,
    /// The header's flags, but [`FLAG_LENT`] (the sender sets that).
    pub flags: u16,
    pub call_id: CallId,
    pub method_id: u32,
    pub status: u16,
    pub timeout_us: u32,
    pub metadata: Option<&'a Metadata>,
    pub payload_len: usize,
}

impl OutFrame<'_> {
    /// The frame's header, once its metadata fits a header's length field
    /// and its body (metadata and payload) is at most `max` bytes.
    pub(crate) fn header(&self, max: usize) -> Result<Header, SendError> {
        let md_len = self.metadata.map_or(0, Metadata::encoded_len);
        if md_len > crate::metadata::MAX_ENCODED_LEN {
            return Err(SendError::Metadata(md_len));
        }
        let len = md_len + self.payload_len;
        if len > max {
            return Err(SendError::TooLarge { len, max });
        }
        Ok(Header {
            kind: self.kind,
            status: self.status,
            method_id: self.method_id,
            call_id: self.call_id,
            payload_len: self.payload_len as u32,
            metadata_len: md_len as u16,
            timeout_us: self.timeout_us,
            ack: 0,
            flags: self.flags,
        })
    }
}

/// Rendezvous on one connection: the peer's lent payloads being read, and
/// the frames of their calls that arrived meanwhile, held so that each
/// call's frames are delivered in order.
pub(super) struct Rendezvous {
    next_read: u64,
    reads: HashMap<u64, PendingRead>,
    held: HashMap<CallId, VecDeque<Held>>,
    /// Calls of `held` that were cancelled: their reads' frames, and any
    /// later frame of theirs, go nowhere.
    cancelled: HashSet<CallId>,
    /// Bytes of the reads posted and not yet complete.
    reading: usize,
    /// How many reads are posted and not yet complete.
    posted: usize,
    /// Most reads posted at once: as many as the queue pair runs at once
    /// ([`QueuePair::max_reads`](crate::fabric::QueuePair::max_reads)), so
    /// that no read waits inside it, out of reach of a cancel.
    max_posted: usize,
    /// Reads waiting for those to finish (see [`MAX_READING`] and
    /// `max_posted`), in order.
    deferred: VecDeque<(u64, RemoteBuf)>,
}

/// Bytes of lent payloads one connection reads at once: their buffers are
/// taken (registered, on rdma://) only when their reads are posted, and
/// further descriptors wait in order for earlier reads to finish, so a peer
/// that lends many large messages at once makes this side hold no more than
/// this (or one message, if larger) in buffers being filled.
pub(super) const MAX_READING: usize = 64 << 20;

impl Rendezvous {
    /// Nothing being read, on a queue pair that runs `max_reads` at once.
    fn new(max_reads: usize) -> Rendezvous {
        Rendezvous {
            next_read: 0,
            reads: HashMap::new(),
            held: HashMap::new(),
            cancelled: HashSet::new(),
            reading: 0,
            posted: 0,
            max_posted: max_reads.max(1),
            deferred: VecDeque::new(),
        }
    }

    /// The call `call_id` is cancelled: what it still had coming goes
    /// nowhere. Its reads not yet posted are dropped (their rkeys
    /// returned, for the peer to be told), and so are its frames waiting
    /// behind its reads (returned, to be dropped outside the lock); those
    /// posted complete and are then dropped. Frames of the call that
    /// arrive while one of its reads is under way go nowhere.
    fn cancel(&mut self, call_id: CallId) -> (Vec<u32>, Vec<Frame>) {
        let Some(queue) = self.held.remove(&call_id) else {
            return Default::default();
        };
        let mut posted = VecDeque::new();
        let mut waiting = Vec::new();
        let mut frames = Vec::new();
        for held in queue {
            match held {
                Held::Reading(id) if self.deferred.iter().any(|(d, _)| *d == id) => {
                    waiting.push(id);
                }
                Held::Reading(id) => posted.push_back(Held::Reading(id)),
                Held::Ready(frame) => frames.push(frame),
            }
        }
        let mut released = Vec::new();
        if !waiting.is_empty() {
            self.deferred.retain(|(id, _)| !waiting.contains(id));
            released.extend(
                waiting
                    .iter()
                    .filter_map(|id| self.reads.remove(id))
                    .map(|r| r.rkey),
            );
        }
        if !posted.is_empty() {
            self.held.insert(call_id, posted);
            self.cancelled.insert(call_id);
        }
        (released, frames)
    }

    /// Reads that waited and may be posted now, taken off the queue in
    /// order (and counted).
    fn admit_waiting(&mut self) -> Vec<(u64, RemoteBuf)> {
        let mut next = Vec::new();
        while let Some(&(id, src)) = self.deferred.front() {
            if !self.admit(src.len as usize) {
                break;
            }
            self.deferred.pop_front();
            next.push((id, src));
        }
        next
    }

    /// Whether a read of `len` bytes may be posted now; if so it counts.
    fn admit(&mut self, len: usize) -> bool {
        let fits = self.reading == 0 || self.reading + len <= MAX_READING;
        if fits && self.posted < self.max_posted {
            self.reading += len;
            self.posted += 1;
            true
        } else {
            false
        }
    }

    /// A posted read of `len` bytes completed.
    fn complete(&mut self, len: usize) {
        self.reading -= len;
        self.posted -= 1;
    }
}

/// Reads of lent payloads this process has posted (for tests: see
/// `testing::reads_posted`).
#[cfg(feature = "testing")]
pub(crate) static READS_POSTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A lent payload being read: its frame as it will be delivered, and the
/// key to release.
struct PendingRead {
    header: Header,
    metadata: Option<Metadata>,
    rkey: u32,
}

/// A frame of a call with a read under way: the read, or a frame ready.
enum Held {
    Reading(u64),
    Ready(Frame),
}

/// One connection: its queue pair, its receive ring and the peer's. The
/// protocol state is pure ([`Sender`], [`Receiver`]); this drives it with
/// the fabric: copies frames in and out of registered memory and posts.
pub(crate) struct Conn<F: Fabric> {
    pub qp_num: u32,
    /// Who is at the other end.
    pub remote: Arc<Peer>,
    pub(super) peer: PeerRing,
    pub(super) recv_region: F::Region,
    pub(super) recv: Mutex<Receiver>,
    pub(super) send: Mutex<SendState<F>>,
    pub(super) failure: Mutex<Option<String>>,
    /// Receives posted for this connection (see [`Endpoint::add`]).
    pub(super) recvs: u32,
    /// Largest message (metadata + payload) accepted from the peer.
    pub(super) max_message: usize,
    /// The fabric: large messages' buffers come from its cache.
    pub(super) fabric: F,
    /// Payloads larger than this travel by rendezvous (lent, and read by
    /// the peer) instead of in the ring; `usize::MAX` when the queue pair
    /// does not lend.
    pub(super) lend_above: usize,
    /// The peer's lent payloads being read.
    pub(super) rendezvous: Mutex<Rendezvous>,
    /// Responses that named no live call of this connection.
    pub(super) stale: AtomicU64,
    /// Buffers incoming messages are copied into, for reuse.
    pub(super) buffers: Mutex<Vec<Vec<u8>>>,
    /// Whether a doorbell arrived from the peer. A client writes first
    /// (see [`Conn::post_fence`]), and only once its ring can take our
    /// writes (on rdma://, once its memory window is bound): a server sends
    /// nothing of its own accord before that.
    pub(super) heard: AtomicBool,
    /// Which end of its connections this side is, for the byte counters
    /// (set by the endpoint after construction).
    pub(super) side: Side,
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
    /// Of `recv_region`, the first `cap` bytes are the ring (see
    /// [`super::ring_shares`]); of the peer's ring, `c.peer.len`.
    pub(super) fn new(
        fabric: F,
        recv_region: F::Region,
        cap: usize,
        staging: F::Region,
        max_backlog: usize,
        c: Connected<F::Qp>,
    ) -> Result<Conn<F>, Status> {
        debug_assert!(cap <= recv_region.len());
        let ring_err = |e: crate::protocol::RingError| Status::internal(format!("ring: {e}"));
        let peer_cap =
            usize::try_from(c.peer.len).map_err(|_| Status::internal("peer ring too large"))?;
        if staging.len() < staging_size(peer_cap) {
            return Err(Status::resource_exhausted(format!(
                "a peer ring of {peer_cap} bytes needs a staging area of {} bytes, not {}",
                staging_size(peer_cap),
                staging.len()
            )));
        }
        let sq_depth = c.qp.send_queue_depth() as u64;
        let max_reads = c.qp.max_reads();
        Ok(Conn {
            qp_num: c.qp.qp_num(),
            remote: Arc::new(Peer {
                addr: c.peer_addr,
                fabric: c.fabric,
                identity: c.identity,
            }),
            peer: c.peer,
            recv: Mutex::new(Receiver::new(cap).map_err(ring_err)?),
            recv_region,
            send: Mutex::new(SendState {
                qp: Some(c.qp),
                staging,
                proto: Sender::new(peer_cap, cap, sq_depth, max_backlog).map_err(ring_err)?,
                heartbeat: None,
                loans: Loans::default(),
            }),
            failure: Mutex::new(None),
            recvs: 0,
            max_message: 0,
            fabric,
            lend_above: usize::MAX,
            rendezvous: Mutex::new(Rendezvous::new(max_reads)),
            stale: AtomicU64::new(0),
            buffers: Mutex::new(Vec::new()),
            heard: AtomicBool::new(false),
            side: Side::Client,
        })
    }

    pub(super) fn send_state(&self) -> MutexGuard<'_, SendState<F>> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The largest message the peer accepts.
    pub(crate) fn peer_max_message(&self) -> usize {
        self.peer.max_message as usize
    }

    /// Most streams the peer serves at once on this connection; 0 for no
    /// limit.
    pub(crate) fn peer_max_streams(&self) -> u32 {
        self.peer.max_streams
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.send_state().proto.death().is_none()
    }

    /// Why the connection died, if it did.
    pub(crate) fn death(&self) -> Option<String> {
        self.send_state().proto.death().map(str::to_owned)
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
        s.proto.kill(why);
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
        self.send_with(frame, fail_fast, 0, fill).map(drop)
    }

    /// Like [`Conn::send`], but the write may stay staged, until it carries
    /// `batch` frames or [`Conn::uncork`] (or a full send queue): requests
    /// that callers issue back to back then leave in one post, one vectored
    /// write on tcp://. Returns whether this write corked the connection:
    /// then hand it to [`Endpoint::corked`], so that it leaves even if
    /// nobody uncorks it.
    pub(crate) fn send_corked(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        batch: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_with(frame, fail_fast, batch, fill)
    }

    /// Posts the writes [`Conn::send_corked`] left staged.
    pub(crate) fn uncork(&self) {
        let mut s = self.send_state();
        if s.proto.uncork() {
            self.post_if_due(&mut s);
        }
    }

    /// Whether writes wait for [`Conn::uncork`].
    pub(crate) fn is_corked(&self) -> bool {
        self.send_state().proto.is_corked()
    }

    pub(super) fn send_with(
        &self,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        self.send_framed(frame, |header| {
            if self.lends(frame) {
                self.send_lent(header, frame, fail_fast, cork, fill)
            } else {
                self.stage(header, frame, fail_fast, cork, fill)
            }
        })
    }

    /// Checks `frame` against the peer's limit, sends it with `send`
    /// given its header, and counts its bytes if it went.
    fn send_framed(
        &self,
        frame: &OutFrame<'_>,
        send: impl FnOnce(Header) -> Result<bool, SendError>,
    ) -> Result<bool, SendError> {
        let header = frame.header(self.peer_max_message())?;
        let body = header.metadata_len as usize + frame.payload_len;
        let sent = send(header);
        if sent.is_ok() {
            crate::observe::bytes(self.side, true, HEADER_LEN + body);
        }
        sent
    }

    /// Whether `frame`'s payload travels by rendezvous.
    fn lends(&self, frame: &OutFrame<'_>) -> bool {
        let kind = matches!(
            frame.kind,
            FrameKind::Request | FrameKind::Response | FrameKind::Message
        );
        kind && frame.payload_len > self.lend_above
    }

    /// Sends a large message by rendezvous: its payload is encoded into a
    /// buffer from the fabric's cache and lent to the peer, and the frame
    /// in the ring carries only its descriptor. The peer reads it, then
    /// releases it ([`FrameKind::Release`]).
    fn send_lent(
        &self,
        header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let mut buf = self.lend_buffer_for(frame)?;
        fill(&mut buf);
        self.lend_filled(header, frame, fail_fast, cork, buf)
    }

    /// A buffer from the fabric's cache for `frame`'s payload, to lend, if
    /// the peer may be lent it now (see [`MIN_MAX_LENT`]).
    fn lend_buffer_for(
        &self,
        frame: &OutFrame<'_>,
    ) -> Result<<F::Region as Region>::Buffer, SendError> {
        // Checked again when it is lent; here so that a payload that will
        // not be lent is not encoded.
        self.send_state()
            .loans
            .check(frame.payload_len, self.max_message)?;
        self.fabric
            .buffer(frame.payload_len)
            .map_err(|e| SendError::NoBuffer(e.to_string()))
    }

    /// Lends `buf`, which holds the frame's payload, and stages the
    /// frame's descriptor of it.
    fn lend_filled(
        &self,
        mut header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        buf: <F::Region as Region>::Buffer,
    ) -> Result<bool, SendError> {
        let remote = {
            let mut s = self.send_state();
            if let Some(why) = s.proto.death() {
                return Err(SendError::Closed(why.to_owned()));
            }
            let len = header.payload_len as usize;
            s.loans.check(len, self.max_message)?;
            let remote = match s.qp.as_mut() {
                Some(qp) => qp.lend(buf).map_err(|e| SendError::Closed(e.to_string()))?,
                None => return Err(SendError::Closed("queue pair destroyed".into())),
            };
            s.loans.lent(remote.rkey, len);
            remote
        };
        let descriptor = Lent {
            addr: remote.addr,
            len: header.payload_len,
            rkey: remote.rkey,
        }
        .encode();
        header.flags |= FLAG_LENT;
        header.payload_len = LENT_LEN as u32;
        let sent = self.stage(
            header,
            &OutFrame {
                payload_len: LENT_LEN,
                ..*frame
            },
            fail_fast,
            cork,
            &mut |b| b.copy_from_slice(&descriptor),
        );
        if sent.is_err() {
            let mut s = self.send_state();
            s.loans.released(remote.rkey);
            if let Some(qp) = s.qp.as_mut() {
                qp.unlend(remote.rkey);
            }
        }
        sent
    }

    /// Stages a frame with `header` in the peer's ring (or queues it).
    fn stage(
        &self,
        header: Header,
        frame: &OutFrame<'_>,
        fail_fast: bool,
        cork: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, SendError> {
        let md_len = header.metadata_len as usize;
        let len = HEADER_LEN + md_len + header.payload_len as usize;
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
        let reserved = s.proto.reserve(len, fail_fast);
        match reserved {
            Ok(Reserved::Ring {
                offset,
                staged,
                ack,
            }) => {
                s.staging.write(staged, len, |buf| write(buf, ack));
                let corked = s.proto.sent(offset, staged, len, cork);
                let held = IN_TURN.get() && !LastFrame::take_post_first(self.qp_num);
                self.post_unless_held(&mut s, held);
                Ok(corked && s.proto.is_corked())
            }
            Err(e) => {
                // A full staging area may have asked for a signaled write.
                self.post_if_due(&mut s);
                drop(s);
                if crate::protocol::connection::is_bodiless(len) && matches!(e, SendError::Full(_))
                {
                    // Not even a grant or a cancel fits in the slack: the
                    // peer returns no credits, and losing the frame would
                    // stall or leak a stream. The connection fails.
                    self.set_failure(format!(
                        "the peer returned no ring credits while {} bytes of control frames \
                         waited for room",
                        crate::protocol::connection::CONTROL_SLACK
                    ));
                }
                Err(e)
            }
            Ok(Reserved::Queue) => {
                crate::observe::backpressure();
                let mut bytes = vec![0u8; len];
                write(&mut bytes, 0);
                // A request's timeout counts down while it waits here (one
                // too long for the wire stays none).
                let expires = (frame.kind == FrameKind::Request)
                    .then(|| crate::protocol::field_timeout(frame.timeout_us))
                    .flatten()
                    .map(|t| clock_us() + t.as_micros() as u64);
                s.proto.queue_until(bytes, expires);
                self.post_if_due(&mut s);
                Ok(false)
            }
        }
    }

    /// Posts what the sender handed out, unless it is held (corked, or
    /// batched by the dispatcher turn running on this thread).
    fn post_if_due(&self, s: &mut SendState<F>) {
        self.post_unless_held(s, IN_TURN.get());
    }

    /// [`Conn::post_if_due`], with `in_batch_turn` saying whether the
    /// dispatcher's turn holds writes now.
    fn post_unless_held(&self, s: &mut SendState<F>, in_batch_turn: bool) {
        if s.proto.should_post(in_batch_turn) {
            self.post_transmits(s);
        }
    }

    /// Posts the writes the sender handed out, in order, as one batch.
    /// Marks the connection failed on error.
    pub(super) fn post_transmits(&self, s: &mut SendState<F>) {
        let SendState {
            qp, staging, proto, ..
        } = s;
        let transmits = proto.transmits();
        if transmits.is_empty() {
            proto.on_posted(Ok(()));
            return;
        }
        let peer = self.peer;
        // A silent heartbeat is another kind of work request. It is only
        // ever handed out last, and posted at once (`heartbeat_tick`): it
        // goes alone, after the batch of the writes before it.
        let (batch, probe) = match transmits.split_last() {
            Some((last, before)) if last.silent => (before, Some(last)),
            _ => (transmits, None),
        };
        debug_assert!(batch.iter().all(|t| !t.silent), "a silent write is last");
        let client = self.side == crate::observe::Side::Client;
        crate::stages::mark(if client {
            crate::stages::Stage::RequestPost
        } else {
            crate::stages::Stage::ResponsePost
        });
        let result = match qp.as_mut() {
            // An empty batch (a heartbeat alone) posts nothing.
            Some(qp) => qp
                .post_write_imm_batch(batch.len(), |i| {
                    let t = &batch[i];
                    WriteImm {
                        wr_id: t.wr_id,
                        local: t.local.map(|(off, len)| (&*staging, off, len)),
                        remote_addr: peer.addr + t.remote as u64,
                        rkey: peer.rkey,
                        imm: t.imm,
                        signaled: t.signaled,
                    }
                })
                .and_then(|()| {
                    probe.map_or(Ok(()), |t| {
                        qp.post_probe(t.wr_id, peer.addr, peer.rkey, t.signaled)
                    })
                })
                .map_err(|e| e.to_string()),
            None => Err("queue pair destroyed".to_owned()),
        };
        crate::stages::mark(if client {
            crate::stages::Stage::RequestPosted
        } else {
            crate::stages::Stage::ResponsePosted
        });
        if let Err(why) = &result {
            self.set_failure(why.clone());
        }
        proto.on_posted(result);
    }

    /// Moves queued frames into the peer's ring while there is room, and
    /// posts them unless writes are held.
    fn flush(&self, s: &mut SendState<F>) {
        tell_time(&mut s.proto);
        s.proto.flush(copy_into(&s.staging));
        self.post_if_due(s);
    }

    /// The poller starts handling a batch of completions for this connection:
    /// writes are staged until [`Conn::after_batch`].
    pub(super) fn begin_batch(&self) {
        self.send_state().proto.begin_batch();
    }

    /// A signaled write completed. `Err` is a protocol violation: no such
    /// write was posted.
    pub(super) fn on_send_completion(&self, wr_id: u64) -> Result<(), String> {
        let mut s = self.send_state();
        s.proto.on_completion(wr_id)?;
        self.flush(&mut s);
        Ok(())
    }

    /// Handles a doorbell: each frame its write carries goes to `deliver`,
    /// in order. `Err` is a protocol violation.
    pub(super) fn on_doorbell(
        &self,
        imm: u32,
        byte_len: u32,
        max_message: usize,
        deliver: &mut dyn FnMut(Frame),
        wants: &dyn Fn(&Header) -> bool,
    ) -> Result<(), String> {
        if !self.heard.load(Ordering::Relaxed) {
            self.heard.store(true, Ordering::Release);
        }
        match Doorbell::decode(imm) {
            None => Err(format!("invalid immediate {imm:#010x}")),
            Some(Doorbell::Credit { ack }) => {
                if byte_len != 0 {
                    return Err(format!(
                        "credit doorbell carries {byte_len} bytes (it must carry none)"
                    ));
                }
                let mut s = self.send_state();
                s.proto
                    .on_ack(ack)
                    .map_err(|e| format!("bad credit: {e}"))?;
                self.flush(&mut s);
                Ok(())
            }
            Some(Doorbell::Frame { offset_units }) => {
                let mut at = Some((offset_units, byte_len));
                while let Some((offset_units, left)) = at {
                    let mut recv = self.recv.lock().unwrap_or_else(|e| e.into_inner());
                    let arrived = recv.on_frame(offset_units, left, max_message, |offset| {
                        let mut raw = [0u8; HEADER_LEN];
                        self.recv_region.copy_to(offset, &mut raw);
                        raw
                    })?;
                    at = arrived.next;
                    let header = arrived.header;
                    let md_len = header.metadata_len as usize;
                    let start = arrived.offset + HEADER_LEN;
                    let metadata = if md_len == 0 {
                        Some(Metadata::new())
                    } else {
                        self.recv_region.read(start, md_len, Metadata::decode)
                    };
                    let mut payload = self.take_buffer();
                    payload.resize(header.payload_len as usize, 0);
                    self.recv_region.copy_to(start + md_len, &mut payload);
                    drop(recv);
                    // Copied out: only now may the credit go back.
                    let mut s = self.send_state();
                    s.proto.on_consumed(arrived.consumed);
                    s.proto
                        .on_ack(header.ack)
                        .map_err(|e| format!("bad credit: {e}"))?;
                    // Closed by an earlier frame of this write (a stream
                    // rule it broke): the rest goes nowhere.
                    if s.proto.death().is_some() {
                        return Ok(());
                    }
                    drop(s);
                    let _last = LastFrame::mark(self.qp_num, at.is_none());
                    self.arrive(
                        Frame {
                            header,
                            metadata,
                            payload: payload.into(),
                        },
                        deliver,
                        wants,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// A frame is out of the ring: a release ends a loan of ours; a lent
    /// payload is read, if the role `wants` it (its call is live); a frame
    /// of a call whose lent payload is being read waits for it; the rest
    /// goes to `deliver`.
    fn arrive(
        &self,
        frame: Frame,
        deliver: &mut dyn FnMut(Frame),
        wants: &dyn Fn(&Header) -> bool,
    ) -> Result<(), String> {
        let header = frame.header;
        if header.kind == FrameKind::Release {
            let mut s = self.send_state();
            let released = s.qp.as_mut().is_some_and(|qp| qp.unlend(header.timeout_us));
            s.loans.released(header.timeout_us);
            // After a failure the queue pair is gone, and its loans with it.
            if !released && s.qp.is_some() {
                return Err(format!(
                    "peer released a buffer that was not lent (rkey {:#x})",
                    header.timeout_us
                ));
            }
            return Ok(());
        }
        if header.is_lent() {
            return self.start_read(frame, wants);
        }
        let len = HEADER_LEN + header.metadata_len as usize + frame.payload.len();
        crate::observe::bytes(self.side, false, len);
        let (released, dropped, admitted) = {
            let mut guard = self.rendezvous();
            let rdv = &mut *guard;
            let Some(queue) = rdv.held.get_mut(&header.call_id) else {
                drop(guard);
                deliver(frame);
                return Ok(());
            };
            if rdv.cancelled.contains(&header.call_id) {
                return Ok(()); // after its cancel: nothing more of it
            }
            if header.kind != FrameKind::Cancel {
                queue.push_back(Held::Ready(frame));
                return Ok(());
            }
            // A cancel does not wait for the call's reads: the peer may
            // start another call as soon as it sent it (a stream in the
            // place this one leaves under the server's limit). What the
            // call still had coming is dropped, a request that was being
            // read included: the call never starts.
            let (released, dropped) = rdv.cancel(header.call_id);
            // Reads behind the dropped ones that fit now.
            (released, dropped, rdv.admit_waiting())
        };
        drop(dropped);
        self.release_all(header.call_id, released);
        for (id, src) in admitted {
            self.issue_read(id, src)?;
        }
        deliver(frame);
        Ok(())
    }

    /// This side cancelled the call `call_id`: the lent payloads of it that
    /// are still to be read are not read (see [`Rendezvous::cancel`]).
    /// Reads waiting behind them are posted at the next completion (one is
    /// under way while any waits).
    pub(crate) fn cancel_reads(&self, call_id: CallId) {
        let (released, dropped) = self.rendezvous().cancel(call_id);
        drop(dropped);
        self.release_all(call_id, released);
    }

    /// Tells the peer it may reuse the buffers `rkeys` it lent for
    /// `call_id`.
    fn release_all(&self, call_id: CallId, rkeys: Vec<u32>) {
        for rkey in rkeys {
            self.release(call_id, rkey);
        }
    }

    /// Tells the peer it may reuse the buffer `rkey` it lent for `call_id`.
    fn release(&self, call_id: CallId, rkey: u32) {
        if let Err(e) = crate::streaming::send_control(self, FrameKind::Release, call_id, rkey) {
            tracing::debug!(qp_num = self.qp_num, error = %e, "cannot release a read buffer");
        }
    }

    fn rendezvous(&self) -> MutexGuard<'_, Rendezvous> {
        self.rendezvous.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the payload the peer lent with `frame`, after checking its
    /// length against the message limit, before anything is allocated.
    /// A payload for a call that is over (cancelled, or past its
    /// deadline) is not read: its buffer is released at once.
    fn start_read(&self, frame: Frame, wants: &dyn Fn(&Header) -> bool) -> Result<(), String> {
        let Frame {
            mut header,
            metadata,
            payload,
        } = frame;
        if self.lend_above == usize::MAX {
            return Err("peer lent a payload on a connection without rendezvous".into());
        }
        let lent = Lent::decode(&payload)
            .ok_or_else(|| format!("lent payload descriptor of {} bytes", payload.len()))?;
        self.recycle(payload);
        let body = header.metadata_len as usize + lent.len as usize;
        if body > self.max_message {
            return Err(format!(
                "lent message of {body} bytes exceeds the limit of {}",
                self.max_message
            ));
        }
        // Frames behind a read of the same call wait for it (the call
        // may start only when it completes, as a lent request's does),
        // unless the call was cancelled meanwhile.
        let (behind_a_read, cancelled) = {
            let rdv = self.rendezvous();
            (
                rdv.held.contains_key(&header.call_id),
                rdv.cancelled.contains(&header.call_id),
            )
        };
        if cancelled || (!behind_a_read && !wants(&header)) {
            tracing::trace!(call_id = header.call_id.0, kind = ?header.kind, "lent payload of a call that is over: not read");
            self.release(header.call_id, lent.rkey);
            return Ok(());
        }
        crate::observe::bytes(self.side, false, HEADER_LEN + body);
        header.flags &= !FLAG_LENT;
        header.payload_len = lent.len;
        let (wr_id, src) = {
            let mut rdv = self.rendezvous();
            rdv.next_read += 1;
            let wr_id = rdv.next_read;
            rdv.reads.insert(
                wr_id,
                PendingRead {
                    header,
                    metadata,
                    rkey: lent.rkey,
                },
            );
            rdv.held
                .entry(header.call_id)
                .or_default()
                .push_back(Held::Reading(wr_id));
            let src = RemoteBuf {
                addr: lent.addr,
                len: u64::from(lent.len),
                rkey: lent.rkey,
            };
            if !rdv.deferred.is_empty() || !rdv.admit(lent.len as usize) {
                rdv.deferred.push_back((wr_id, src));
                return Ok(());
            }
            (wr_id, src)
        };
        self.issue_read(wr_id, src)
    }

    /// Takes a buffer for the read `wr_id` of `src` and posts it.
    fn issue_read(&self, wr_id: u64, src: RemoteBuf) -> Result<(), String> {
        #[cfg(feature = "testing")]
        READS_POSTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let len = src.len as usize;
        let dst = self
            .fabric
            .buffer(len)
            .map_err(|e| format!("no buffer for a lent message of {len} bytes: {e}"))?;
        let mut s = self.send_state();
        let Some(qp) = s.qp.as_mut() else {
            return Ok(()); // closed: the read's frame goes with the connection
        };
        qp.post_read(wr_id, dst, src)
            .map_err(|e| format!("cannot read a lent payload: {e}"))
    }

    /// The read `wr_id` of a lent payload completed: its frame, and those
    /// of its call held behind it, go to `deliver`, and the peer learns it
    /// may reuse its buffer.
    pub(super) fn on_read_completion(
        &self,
        wr_id: u64,
        deliver: &mut dyn FnMut(Frame),
    ) -> Result<(), String> {
        let taken = self
            .send_state()
            .qp
            .as_mut()
            .and_then(|qp| qp.take_read(wr_id));
        let Some(buf) = taken else {
            return Err(format!("read {wr_id} completed without its buffer"));
        };
        let mut ready = Vec::new();
        let next;
        // A frame of a cancelled call, dropped outside the lock.
        let mut discarded = None;
        let (call_id, rkey) = {
            let mut rdv = self.rendezvous();
            let p = rdv
                .reads
                .remove(&wr_id)
                .ok_or_else(|| format!("completion of read {wr_id}, never posted"))?;
            rdv.complete(p.header.payload_len as usize);
            next = rdv.admit_waiting();
            let call_id = p.header.call_id;
            let frame = Frame {
                header: p.header,
                metadata: p.metadata,
                payload: Payload::Lent(Box::new(buf)),
            };
            if rdv.cancelled.contains(&call_id) {
                // Read for a call cancelled meanwhile: dropped.
                if let Some(queue) = rdv.held.get_mut(&call_id) {
                    queue.retain(|h| !matches!(h, Held::Reading(id) if *id == wr_id));
                    if queue.is_empty() {
                        rdv.held.remove(&call_id);
                        rdv.cancelled.remove(&call_id);
                    }
                }
                discarded = Some(frame);
            } else if let Some(queue) = rdv.held.get_mut(&call_id) {
                if let Some(slot) = queue
                    .iter_mut()
                    .find(|h| matches!(h, Held::Reading(id) if *id == wr_id))
                {
                    *slot = Held::Ready(frame);
                }
                while let Some(Held::Ready(_)) = queue.front() {
                    if let Some(Held::Ready(f)) = queue.pop_front() {
                        ready.push(f);
                    }
                }
                if queue.is_empty() {
                    rdv.held.remove(&call_id);
                }
            }
            (call_id, p.rkey)
        };
        drop(discarded);
        self.release(call_id, rkey);
        for (id, src) in next {
            self.issue_read(id, src)?;
        }
        for frame in ready {
            deliver(frame);
        }
        Ok(())
    }

    /// After a batch of frames: return credits if needed, flush the backlog,
    /// and post everything staged meanwhile.
    pub(super) fn after_batch(&self) {
        let mut s = self.send_state();
        let SendState { staging, proto, .. } = &mut *s;
        tell_time(proto);
        proto.end_batch(copy_into(staging));
        self.post_if_due(&mut s);
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
    pub(crate) fn recycle(&self, buf: crate::payload::Payload) {
        let Some(buf) = buf.into_heap() else {
            return; // a lent buffer goes back to the fabric's cache
        };
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
        let wr_id = s.proto.fence()?;
        // Held by a batch under way on this thread? Post it now anyway.
        self.post_transmits(&mut s);
        Some(wr_id)
    }

    /// Beats every `interval` when idle (see [`Sender::heartbeat_tick`]),
    /// once the peer has written to us if `after_peer` (the server's side);
    /// returns when its first tick is due.
    pub(super) fn start_heartbeat(
        &self,
        interval: Duration,
        after_peer: bool,
        now: Instant,
    ) -> Instant {
        let mut s = self.send_state();
        let probe = match s.qp.as_mut().map(|qp| qp.probe_every(interval)) {
            Some(Ok(probe)) => probe,
            Some(Err(e)) => {
                tracing::warn!(qp_num = self.qp_num, error = %e, "heartbeats fall back to credit doorbells");
                Probe::Doorbell
            }
            None => Probe::Doorbell,
        };
        let beat = Heartbeat {
            half: interval / 2,
            next: now + interval / 2,
            unacked_limit: super::config::unacked_limit(interval),
            after_peer,
            probe,
        };
        s.heartbeat = Some(beat);
        beat.next
    }

    /// A heartbeat tick, if one is due by `now`: posts a heartbeat if the
    /// connection sent nothing for a while. Returns when the next is due,
    /// or why the peer is taken for dead: its transport acknowledged
    /// nothing for too long while writes waited.
    pub(super) fn heartbeat_tick(&self, now: Instant) -> Result<Option<Instant>, String> {
        let mut s = self.send_state();
        let Some(beat) = s.heartbeat.as_mut() else {
            return Ok(None);
        };
        // Due within a quarter of its period counts as due: the pass that
        // runs for one connection's beat takes every other one due about
        // then, so passes over a dispatcher's connections come at most four
        // times per period, however many connections there are, instead
        // of once per connection. A beat or check a little early changes
        // no bound: none is ever late.
        if now + beat.half / 4 < beat.next {
            return Ok(Some(beat.next));
        }
        beat.next = now + beat.half;
        let (next, limit, probe) = (beat.next, beat.unacked_limit, beat.probe);
        let waits_for_peer = beat.after_peer && !self.heard.load(Ordering::Acquire);
        // Looked at before the peer has written too: a server's hello that
        // its client's host never acknowledged is noticed the same way.
        if let Some(silent) = s.qp.as_ref().and_then(|qp| qp.unacknowledged_for()) {
            if silent >= limit {
                return Err(format!(
                    "peer unreachable: nothing acknowledged for {:.1} s",
                    silent.as_secs_f64()
                ));
            }
        }
        if waits_for_peer {
            return Ok(Some(next));
        }
        let silent = match probe {
            // The transport probes the quiet connection itself.
            Probe::Transport => return Ok(Some(next)),
            Probe::Doorbell => false,
            Probe::Silent => true,
        };
        if let Some(wr_id) = s.proto.heartbeat_tick(silent) {
            tracing::trace!(qp_num = self.qp_num, wr_id, silent, "heartbeat");
            self.post_transmits(&mut s);
        }
        Ok(Some(next))
    }

    /// Whether the write `wr_id` (and so every one before it) completed, or
    /// the connection died: either way nothing is left to wait for.
    pub(crate) fn completed_through(&self, wr_id: u64) -> bool {
        self.send_state().proto.completed_through(wr_id)
    }

    /// Whether frames wait to be posted: queued for the peer's ring, or
    /// staged until the batch being handled ends.
    pub(crate) fn has_unsent(&self) -> bool {
        self.send_state().proto.has_unsent()
    }
}

/// Microseconds on the clock queued frames' deadlines are kept on.
fn clock_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Gives the sender the time, if a queued frame's timeout needs it.
fn tell_time(proto: &mut Sender) {
    if proto.has_timed_backlog() {
        proto.set_clock(clock_us());
    }
}

/// Copies a queued frame the sender places at `offset` of the staging area there.
fn copy_into<R: Region>(staging: &R) -> impl FnMut(usize, &[u8]) + '_ {
    move |offset, frame| staging.write(offset, frame.len(), |buf| buf.copy_from_slice(frame))
}

impl<F: Fabric> crate::streaming::Link for Conn<F> {
    fn send(
        &self,
        frame: &OutFrame<'_>,
        cork: bool,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), SendError> {
        // A stream's producer uncorks after each of its turns.
        let cork = if cork { usize::MAX } else { 0 };
        self.send_with(frame, false, cork, fill).map(drop)
    }
    fn lend_buffer(
        &self,
        frame: &OutFrame<'_>,
    ) -> Result<Option<crate::streaming::LendBuf>, SendError> {
        if !self.lends(frame) {
            return Ok(None);
        }
        // The checks of the send, before anything is allocated.
        frame.header(self.peer_max_message())?;
        Ok(Some(crate::streaming::LendBuf::new(
            self.lend_buffer_for(frame)?,
        )))
    }
    fn send_lent(
        &self,
        frame: &OutFrame<'_>,
        buf: crate::streaming::LendBuf,
    ) -> Result<(), SendError> {
        let Some(buf) = buf.into_inner::<<F::Region as Region>::Buffer>() else {
            return Err(SendError::NoBuffer(
                "a buffer of another fabric was lent".into(),
            ));
        };
        self.send_framed(frame, |header| {
            self.lend_filled(header, frame, false, 0, buf)
        })
        .map(drop)
    }
    fn uncork(&self) {
        Conn::uncork(self)
    }
    fn peer(&self) -> &str {
        &self.remote.addr
    }
    fn max_message(&self) -> usize {
        self.max_message
    }
    fn remote(&self) -> Option<Arc<Peer>> {
        Some(self.remote.clone())
    }
    fn recycle(&self, buf: crate::payload::Payload) {
        Conn::recycle(self, buf)
    }
}
