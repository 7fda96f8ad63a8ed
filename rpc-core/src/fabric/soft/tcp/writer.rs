//! What leaves a tcp:// connection: the writes of a post gathered into
//! one vectored write, the `READ`s it asks, and the send queue that holds
//! what the socket cannot take yet (bytes, answered reads sent from the
//! lent buffer itself, a TLS session's records) until it is writable. A
//! post never blocks; a peer that does not read is cut off at a bound.

use super::message::{TAG_READ, WRITE_HEADER, read_head, write_head};
use super::{SCRATCH, TcpConn, TcpWire};
use crate::fabric::soft::{CqInner, SoftBuffer, SoftRegion};
use crate::fabric::tls::Session;
use crate::fabric::{CompletionKind, RemoteBuf, WcStatus, WriteImm};
use crate::pages::Pages;
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, RwLockReadGuard};

/// Bytes of a lent buffer encrypted at a time on a TLS connection: the
/// session holds no more ciphertext than this waiting for the socket.
const LENT_TLS_CHUNK: usize = 256 << 10;
/// What one answered read holds in the send queue besides its bytes, which
/// are not copied: its `READ_RESP` head and its place in the queue.
const LENT_CHUNK_COST: usize = WRITE_HEADER + std::mem::size_of::<LentChunk>();
/// Writes of one post gathered into one vectored write.
const MAX_GATHER: usize = 64;
/// A region read-locked while its bytes are written out.
type RegionGuard<'a> = (&'a SoftRegion, RwLockReadGuard<'a, Pages>);

/// Bytes posted but not yet taken by the socket, in order: `bytes`, then
/// each of `lent`.
#[derive(Default)]
pub(super) struct TxQueue {
    bytes: Vec<u8>,
    /// How much of `bytes` is written.
    sent: usize,
    /// Reads of lent buffers being answered: their bytes go to the socket
    /// from the buffer itself, with no copy.
    lent: VecDeque<LentChunk>,
    /// Shut down once everything queued is written.
    pub(super) closing: bool,
    /// The socket failed: nothing more is written.
    pub(super) failed: bool,
    /// The connection's TLS session, if it uses TLS: then everything
    /// posted is encrypted into it at once and waits there for the socket
    /// (`bytes` stays empty), and the reader decrypts through it too.
    pub(super) tls: Option<Session>,
    /// Something was sent since the heartbeat last looked at the socket
    /// ([`TcpWire::unacknowledged_for`]).
    pub(super) sent_since_look: bool,
    /// At that look everything sent before had been acknowledged, and
    /// nothing waited here or in the socket: until the next send, nothing
    /// can be in flight, and the look needs no `TCP_INFO`.
    pub(super) settled: bool,
    /// The signaled writes sent and not yet acknowledged, oldest first: the
    /// peer acknowledges them in this order, and an `ACK` for anything
    /// else is a lie that closes the connection (a completion for a write
    /// never posted would corrupt the sender's count of writes in flight).
    /// At most a send queue's depth.
    pub(super) acks_due: VecDeque<u64>,
    /// Over TLS: plaintext bytes put into the session since it last wrote
    /// everything it held to the socket (what it may hold, as ciphertext).
    tls_held: usize,
}

/// Bytes of a lent buffer to send (`at..end`), and what was posted after them.
struct LentChunk {
    buf: Arc<SoftBuffer>,
    at: usize,
    end: usize,
    then: Vec<u8>,
}

impl TxQueue {
    /// An empty queue, over TLS if it has a `tls` session.
    pub(super) fn new(tls: Option<Session>) -> TxQueue {
        TxQueue {
            tls,
            ..TxQueue::default()
        }
    }

    fn unsent(&self) -> usize {
        self.bytes.len() - self.sent
    }

    /// What waits here for a socket the peer reads: bytes queued, answered
    /// reads (their heads, not the lent bytes, which are not copied) and
    /// what the TLS session holds.
    fn held(&self) -> usize {
        let lent: usize = self
            .lent
            .iter()
            .map(|c| LENT_CHUNK_COST + c.then.len())
            .sum();
        self.unsent() + lent + self.tls_held
    }

    /// Whether nothing waits for the socket (or the TLS session) here.
    fn idle(&self) -> bool {
        self.unsent() == 0 && self.lent.is_empty()
    }

    /// Whether everything posted has been written to the socket.
    pub(super) fn flushed(&self) -> bool {
        self.idle() && !self.tls.as_ref().is_some_and(Session::wants_write)
    }

    /// Queues `bufs` behind everything queued, skipping their first `skip` bytes.
    fn queue(&mut self, bufs: &[IoSlice<'_>], mut skip: usize) {
        let to = match self.lent.back_mut() {
            Some(chunk) => &mut chunk.then,
            None => &mut self.bytes,
        };
        for b in bufs.iter() {
            let take = skip.min(b.len());
            skip -= take;
            to.extend_from_slice(&b[take..]);
        }
    }

    /// Writes what is queued, as far as the socket (or, over TLS, the
    /// session, a chunk of a lent buffer at a time) takes it. `Err` if the
    /// socket failed.
    fn pump(&mut self, stream: &TcpStream) -> Result<(), ()> {
        if let Some(session) = &mut self.tls {
            if self.bytes.len() > self.sent {
                let rest = IoSlice::new(&self.bytes[self.sent..]);
                session.queue(&[rest]).map_err(drop)?;
                self.tls_held += rest.len();
                self.bytes.clear();
                self.sent = 0;
            }
            loop {
                if session.flush(stream).map_err(drop)? {
                    self.tls_held = 0;
                } else {
                    return Ok(());
                }
                let Some(front) = self.lent.front_mut() else {
                    return Ok(());
                };
                if front.at < front.end {
                    let n = (front.end - front.at).min(LENT_TLS_CHUNK);
                    let piece = IoSlice::new(&front.buf[front.at..front.at + n]);
                    session.queue(&[piece]).map_err(drop)?;
                    self.tls_held += n;
                    front.at += n;
                } else {
                    let chunk = self.lent.pop_front().expect("front exists");
                    if !chunk.then.is_empty() {
                        session.queue(&[IoSlice::new(&chunk.then)]).map_err(drop)?;
                        self.tls_held += chunk.then.len();
                    }
                }
            }
        }
        loop {
            if self.unsent() > 0 {
                let left = self.unsent();
                let n = write_nonblocking(stream, &[IoSlice::new(&self.bytes[self.sent..])])?;
                self.sent += n;
                if n < left {
                    return Ok(());
                }
                self.bytes.clear();
                self.sent = 0;
                if self.bytes.capacity() > SCRATCH {
                    self.bytes.shrink_to(SCRATCH);
                }
            } else if let Some(front) = self.lent.front_mut() {
                if front.at < front.end {
                    let left = front.end - front.at;
                    let piece = IoSlice::new(&front.buf[front.at..front.end]);
                    let n = write_nonblocking(stream, &[piece])?;
                    front.at += n;
                    if n < left {
                        return Ok(());
                    }
                } else {
                    let chunk = self.lent.pop_front().expect("front exists");
                    self.bytes = chunk.then;
                    self.sent = 0;
                }
            } else {
                return Ok(());
            }
        }
    }
}

/// Writes `bufs` to a non-blocking socket until done or it would block;
/// returns the bytes written, or `Err` if the socket failed. `bufs` is left
/// as it was: the caller queues what was not written by counting from the
/// start (advancing the slices in place would shorten the one a partial
/// write stopped in, and those bytes would be skipped twice).
fn write_nonblocking(stream: &TcpStream, bufs: &[IoSlice<'_>]) -> Result<usize, ()> {
    let mut copy = [IoSlice::new(&[]); 2 * MAX_GATHER];
    let copy = &mut copy[..bufs.len()];
    copy.copy_from_slice(bufs);
    let mut bufs = copy;
    let mut written = 0;
    while !bufs.is_empty() {
        match (&*stream).write_vectored(bufs) {
            Ok(0) => return Err(()),
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(_) => return Err(()),
        }
    }
    Ok(written)
}

impl TcpConn {
    /// Sends `bufs` after everything sent before: straight to the socket
    /// when nothing waits ahead of them, and what it cannot take now is
    /// queued for when it is writable. Never blocks. `acks_due` are the
    /// signaled writes among them, in order. `Err` once the socket failed
    /// or the connection is closing.
    pub(super) fn send(&self, bufs: &[IoSlice<'_>], acks_due: &[u64]) -> Result<(), ()> {
        let mut tx = self.tx();
        if tx.failed || tx.closing {
            return Err(());
        }
        tx.sent_since_look = true;
        tx.acks_due.extend(acks_due);
        if !tx.idle() {
            // Behind what waits, in order.
            tx.queue(bufs, 0);
            return self.within_bound(&mut tx);
        }
        if let Some(session) = &mut tx.tls {
            match session
                .queue(bufs)
                .and_then(|()| session.flush(&self.stream))
            {
                Ok(true) => tx.tls_held = 0,
                Ok(false) => {
                    tx.tls_held += bufs.iter().map(|b| b.len()).sum::<usize>();
                    return self.within_bound(&mut tx);
                }
                Err(_) => {
                    tx.failed = true;
                    return Err(());
                }
            }
            return Ok(());
        }
        let written = match write_nonblocking(&self.stream, bufs) {
            Ok(n) => n,
            Err(()) => {
                tx.failed = true;
                return Err(());
            }
        };
        tx.bytes.clear();
        tx.sent = 0;
        tx.queue(bufs, written);
        self.within_bound(&mut tx)
    }

    /// `Err` (and the socket failed) if the send queue holds more than
    /// [`TcpConn::max_held`] for a peer that is not reading it.
    fn within_bound(&self, tx: &mut TxQueue) -> Result<(), ()> {
        let held = tx.held();
        if held <= self.max_held {
            return Ok(());
        }
        tracing::warn!(
            qp_num = self.qp_num,
            held,
            max = self.max_held,
            "closing connection: the peer is not reading what is sent to it"
        );
        tx.failed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        Err(())
    }

    /// Sends `head`, then `buf[start..end]` from the buffer itself, after
    /// everything sent before. Never blocks; `Err` as [`TcpConn::send`].
    pub(super) fn send_lent(
        &self,
        head: &[u8],
        buf: Arc<SoftBuffer>,
        start: usize,
        end: usize,
    ) -> Result<(), ()> {
        let mut tx = self.tx();
        if tx.failed || tx.closing {
            return Err(());
        }
        tx.sent_since_look = true;
        tx.queue(&[IoSlice::new(head)], 0);
        tx.lent.push_back(LentChunk {
            buf,
            at: start,
            end,
            then: Vec::new(),
        });
        if tx.pump(&self.stream).is_err() {
            tx.failed = true;
            return Err(());
        }
        self.within_bound(&mut tx)
    }

    /// Writes what is queued, as far as the socket takes it; a socket that
    /// failed fails the queue pair, told on `cq` (the polling thread's).
    pub(super) fn flush(&self, cq: &CqInner) {
        let mut tx = self.tx();
        // Whatever it writes (a TLS session's own records too) is looked
        // at by the next heartbeat.
        tx.sent_since_look = true;
        if tx.failed {
            return;
        }
        if tx.pump(&self.stream).is_err() {
            tx.failed = true;
            drop(tx);
            // Told now: the read that finds the socket closed next would
            // find the queue pair dead already and tell nobody, leaving
            // its calls (and a cancel the peer sent before it went) unheard.
            self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
        }
    }
}

impl TcpWire {
    /// Sends `count` writes with one vectored write. `Err` names the work
    /// request that failed and why.
    pub(crate) fn write_batch<'a>(
        &mut self,
        count: usize,
        wr: &impl Fn(usize) -> WriteImm<'a, SoftRegion>,
    ) -> Result<(), (u64, WcStatus)> {
        let mut first = 0;
        while first < count {
            let n = (count - first).min(MAX_GATHER);
            let mut heads = [[0u8; WRITE_HEADER]; MAX_GATHER];
            let mut locals: [Option<(&SoftRegion, usize, usize)>; MAX_GATHER] = [None; MAX_GATHER];
            let mut signaled = [0u64; MAX_GATHER];
            let mut acks_due = 0;
            let mut last_wr = 0;
            for i in 0..n {
                let w = wr(first + i);
                let len = w.local.map_or(0, |(_, _, len)| len);
                heads[i] = write_head(&w, len as u32);
                locals[i] = w.local;
                last_wr = w.wr_id;
                if w.signaled {
                    signaled[acks_due] = w.wr_id;
                    acks_due += 1;
                }
            }
            // One read guard per distinct region (a batch comes from one
            // staging area): a second read lock on one RwLock could wait
            // behind a writer.
            let mut guards: [Option<RegionGuard<'_>>; MAX_GATHER] = [const { None }; MAX_GATHER];
            for (i, local) in locals[..n].iter().enumerate() {
                if let Some((region, _, _)) = local {
                    let known = guards[..i]
                        .iter()
                        .flatten()
                        .any(|(r, _)| Arc::ptr_eq(&r.inner, &region.inner));
                    if !known {
                        guards[i] = Some((
                            region,
                            region.inner.data.read().unwrap_or_else(|e| e.into_inner()),
                        ));
                    }
                }
            }
            let mut slices: [IoSlice<'_>; 2 * MAX_GATHER] = [IoSlice::new(&[]); 2 * MAX_GATHER];
            let mut used = 0;
            for i in 0..n {
                slices[used] = IoSlice::new(&heads[i]);
                used += 1;
                if let Some((region, off, len)) = locals[i] {
                    if len > 0 {
                        let (_, bytes) = guards
                            .iter()
                            .flatten()
                            .find(|(r, _)| Arc::ptr_eq(&r.inner, &region.inner))
                            .expect("a guard for every region");
                        slices[used] = IoSlice::new(&bytes[off..off + len]);
                        used += 1;
                    }
                }
            }
            self.conn
                .send(&slices[..used], &signaled[..acks_due])
                .map_err(|()| (last_wr, WcStatus::RetryExceeded))?;
            first += n;
        }
        Ok(())
    }

    /// Asks the peer for the bytes of `src` (a `READ`); its `READ_RESP`
    /// completes the read posted as `wr_id`.
    pub(crate) fn read(&mut self, wr_id: u64, src: RemoteBuf) -> Result<(), WcStatus> {
        let len = u32::try_from(src.len).map_err(|_| WcStatus::Other { vendor: 0 })?;
        let head = read_head(TAG_READ, wr_id, src.addr, src.rkey, len);
        self.conn
            .send(&[IoSlice::new(&head)], &[])
            .map_err(|()| WcStatus::RetryExceeded)
    }
}
