//! Reading what the peer lent: a lent payload's descriptor starts a read
//! (if its call is live), a bounded number of reads run at once, and the
//! frames of a call arriving behind its read are held, so that each call's
//! frames are delivered in order; cancels drop what a call still had coming.

use super::Conn;
use super::link::send_control;
use crate::Metadata;
use crate::dispatch::Frame;
use crate::fabric::{Fabric, QueuePair, RemoteBuf};
use crate::payload::Payload;
use crate::protocol::header::{FLAG_LENT, Lent};
use crate::protocol::{CallId, FrameKind, HEADER_LEN, Header};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::MutexGuard;

/// Rendezvous on one connection: the peer's lent payloads being read, and
/// the frames of their calls that arrived meanwhile, held so that each
/// call's frames are delivered in order.
pub(in crate::dispatch) struct Rendezvous {
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
    pub(super) fn new(max_reads: usize) -> Rendezvous {
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

impl<F: Fabric> Conn<F> {
    /// A frame is out of the ring: a release ends a loan of ours; a lent
    /// payload is read, if the role `wants` it (its call is live); a frame
    /// of a call whose lent payload is being read waits for it; the rest
    /// goes to `deliver`.
    pub(super) fn arrive(
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
        if let Err(e) = send_control(self, FrameKind::Release, call_id, rkey) {
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
    pub(in crate::dispatch) fn on_read_completion(
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
}
