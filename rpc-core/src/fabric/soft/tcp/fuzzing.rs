//! The tcp:// reader driven by hand (feature `testing`): the bytes a peer
//! sends on an established connection (writes, acks, naks, anything else)
//! go through the real receiving side of a `TcpConn`, its state machine,
//! bounds checks and completions, over a local socket pair, one connection
//! per run. For the fuzz targets and tests.

use super::message::{self, ACK_LEN, NAK_LEN, TAG_ACK, TAG_NAK};
use super::reader::ReadOutcome;
use super::{SCRATCH, TcpConn};
use crate::fabric::soft::{CqInner, Ctx, RegionInner, SoftCq, SoftRegion};
use crate::fabric::{Completion, CompletionKind, WcStatus, WriteImm};
use crate::pages::Pages;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

/// The address of the ring the peer may write into.
pub const RING_ADDR: u64 = 0x1_0000;
/// Its length: room for payloads long enough to be read straight into it.
pub const RING_LEN: usize = 1 << 16;
/// Its rkey.
pub const RING_RKEY: u32 = 0x5eed;
/// The queue pair number the completions carry.
pub const QP_NUM: u32 = 1;

/// A `WRITE` message as the tcp:// wire sends it: `imm` and
/// `payload` to `offset` of the ring ([`RING_ADDR`] + `offset`, with
/// [`RING_RKEY`]), acknowledged if `signaled`.
pub fn write_message(signaled: bool, wr_id: u64, offset: u64, imm: u32, payload: &[u8]) -> Vec<u8> {
    let w = WriteImm::<SoftRegion> {
        wr_id,
        local: None,
        remote_addr: RING_ADDR.wrapping_add(offset),
        rkey: RING_RKEY,
        imm,
        signaled,
    };
    let mut m = message::write_head(&w, payload.len() as u32).to_vec();
    m.extend_from_slice(payload);
    m
}

/// An `ACK` message, as the receiving side sends it for a signaled write.
pub fn ack_message(wr_id: u64) -> Vec<u8> {
    message::ack_message(wr_id).to_vec()
}

/// A `NAK` message, as the receiving side sends it for a rejected write.
pub fn nak_message(wr_id: u64, status: WcStatus) -> Vec<u8> {
    message::nak_message(wr_id, status).to_vec()
}

/// How the receiving side is set up for one run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Receives posted before the first byte arrives. When a write finds
    /// none, the reader stalls and the harness posts one more, as a
    /// dispatcher replenishing its shared receive queue would...
    pub receives: u32,
    /// ...unless this is set: then a write that finds no receive fails at
    /// once, as when the RNR timeout has passed.
    pub rnr_expired: bool,
    /// The peer's bytes arrive in pieces of this many bytes, each read
    /// separately (0: all at once).
    pub piece: usize,
}

/// What the receiving side made of the peer's bytes.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The completions it reported, in order.
    pub completions: Vec<Completion>,
    /// What it sent back to the peer (acks and naks).
    pub sent_back: Vec<u8>,
}

/// A receive ring and the contexts a connection reads for, kept across runs.
pub struct Harness {
    ring: Arc<RegionInner>,
    /// Long RNR timeout: a write without a receive stalls.
    waiting: Arc<Ctx>,
    /// No RNR timeout: a write without a receive fails.
    expired: Arc<Ctx>,
    cq: SoftCq,
    scratch: Box<[u8]>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness").finish_non_exhaustive()
    }
}

fn ctx(rnr_timeout: Duration) -> Arc<Ctx> {
    Arc::new(Ctx {
        buffers: Default::default(),
        srq: AtomicU64::new(0),
        srq_waiters: Mutex::new(0),
        srq_cond: Condvar::new(),
        rnr_timeout,
    })
}

fn read_all(stream: &UnixStream, out: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    loop {
        match (&*stream).read(&mut buf) {
            Ok(0) => return,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

impl Harness {
    /// The ring ([`RING_ADDR`], [`RING_LEN`], [`RING_RKEY`]) and the contexts.
    pub fn new() -> std::io::Result<Harness> {
        Ok(Harness {
            ring: Arc::new(RegionInner {
                addr: RING_ADDR,
                len: RING_LEN,
                rkey: RING_RKEY,
                data: RwLock::new(Pages::new(RING_LEN)?),
            }),
            waiting: ctx(Duration::from_secs(3600)),
            expired: ctx(Duration::ZERO),
            cq: SoftCq::new(),
            scratch: vec![0u8; SCRATCH].into_boxed_slice(),
        })
    }

    /// A new connection's receiving side reads `stream`, then the peer's
    /// end of stream. Panics if the reader stops making progress.
    pub fn run(&mut self, stream: &[u8], options: Options) -> std::io::Result<Outcome> {
        let (ours, theirs) = UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        theirs.set_nonblocking(true)?;
        let ctx = if options.rnr_expired {
            &self.expired
        } else {
            &self.waiting
        };
        ctx.srq
            .store(u64::from(options.receives), Ordering::Release);
        // The reader needs only a connected stream socket's reads, writes
        // and shutdown.
        let conn = TcpConn::new(
            QP_NUM,
            Arc::downgrade(&self.ring),
            ctx.clone(),
            TcpStream::from(OwnedFd::from(ours)),
            Arc::new(AtomicBool::new(false)),
            Default::default(),
            None,
            1 << 16,
        );
        let cq: &CqInner = &self.cq.inner;
        let piece = if options.piece == 0 {
            usize::MAX
        } else {
            options.piece
        };
        let mut out = Outcome::default();
        let mut rest = stream;
        let mut ended = false;
        let mut posted = u64::from(options.receives);
        // Every turn moves a byte in, or posts a receive a stalled write
        // takes: more turns than that is a reader that stopped.
        let limit = 2 * stream.len() + 64;
        let mut turns = 0;
        loop {
            turns += 1;
            assert!(turns <= limit, "the tcp:// reader stopped making progress");
            if !rest.is_empty() {
                match (&theirs).write(&rest[..piece.min(rest.len())]) {
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    // The reader shut the connection down.
                    Err(_) => rest = &[],
                }
            }
            if rest.is_empty() && !ended {
                let _ = theirs.shutdown(Shutdown::Write);
                ended = true;
            }
            let outcome = conn.read_ready(&mut self.scratch, cq);
            // What it sent back, as the poller flushes on a writable socket.
            conn.flush(cq);
            read_all(&theirs, &mut out.sent_back);
            match outcome {
                ReadOutcome::Drained => {}
                ReadOutcome::More => {
                    // Stalled for a receive: the dispatcher posts more.
                    ctx.srq.fetch_add(1, Ordering::AcqRel);
                    posted += 1;
                }
                ReadOutcome::Closed => break,
            }
        }
        // What is still queued for the peer goes out before the close.
        loop {
            conn.flush(cq);
            read_all(&theirs, &mut out.sent_back);
            let tx = conn.tx();
            if tx.flushed() || tx.failed {
                break;
            }
        }
        drop(conn);
        read_all(&theirs, &mut out.sent_back);
        while cq.entries.pop_into(&mut out.completions, usize::MAX) > 0 {}
        check(&out, posted, ctx.srq.load(Ordering::Acquire));
        Ok(out)
    }
}

/// What any run must come to, whatever the peer sent: `posted` receives
/// were posted, `left` are still there.
fn check(out: &Outcome, posted: u64, left: u64) {
    // Each write delivered took one receive, and nothing else took any.
    let delivered = out
        .completions
        .iter()
        .filter(|c| {
            c.status == WcStatus::Success && matches!(c.kind, CompletionKind::RecvImm { .. })
        })
        .count() as u64;
    assert_eq!(
        delivered + left,
        posted,
        "receives taken without a delivery: {out:?}"
    );
    for c in &out.completions {
        assert_eq!(c.qp_num, QP_NUM);
        // This side sent no signaled write: no acknowledgement completes one.
        assert!(
            !(c.kind == CompletionKind::Send && c.status == WcStatus::Success),
            "an acknowledgement of a write never sent completed it: {out:?}"
        );
        if let CompletionKind::RecvImm { byte_len, .. } = c.kind {
            assert!(
                byte_len as usize <= RING_LEN,
                "a write longer than the ring: {c:?}"
            );
        }
    }
    // At most one error completion, and nothing after it.
    if let Some(i) = out
        .completions
        .iter()
        .position(|c| c.status != WcStatus::Success)
    {
        assert_eq!(
            i + 1,
            out.completions.len(),
            "completions after an error: {out:?}"
        );
    }
    // The peer gets acks, then at most one nak, and nothing else.
    let mut back = &out.sent_back[..];
    while let Some(&tag) = back.first() {
        match tag {
            TAG_ACK if back.len() >= ACK_LEN => back = &back[ACK_LEN..],
            TAG_NAK if back.len() == NAK_LEN => back = &[],
            _ => panic!("the reader sent back malformed bytes: {:?}", out.sent_back),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use write_message as write;

    #[test]
    fn writes_are_delivered_and_acknowledged_in_any_pieces() {
        let mut h = Harness::new().unwrap();
        let mut stream = write(true, 9, 64, 0xabc, &[7u8; 20_000]);
        stream.extend(write(false, 10, 0, 0xdef, &[]));
        stream.extend(ack_message(1));
        for piece in [0, 1, 7, 4096] {
            for (receives, rnr_expired) in [(2, false), (0, false), (2, true)] {
                let out = h
                    .run(
                        &stream,
                        Options {
                            receives,
                            rnr_expired,
                            piece,
                        },
                    )
                    .unwrap();
                assert_eq!(&out.sent_back[..], &[TAG_ACK, 9, 0, 0, 0, 0, 0, 0, 0][..]);
                let kinds: Vec<_> = out.completions.iter().map(|c| c.kind).collect();
                assert_eq!(
                    kinds[..3],
                    [
                        CompletionKind::RecvImm {
                            imm: 0xabc,
                            byte_len: 20_000
                        },
                        CompletionKind::RecvImm {
                            imm: 0xdef,
                            byte_len: 0
                        },
                        CompletionKind::Send,
                    ]
                );
                // This side sent no write 1: the ack is a lie, and it fails
                // the connection.
                assert_eq!(out.completions.len(), 3, "{out:?}");
                assert_eq!(out.completions[2].status, WcStatus::Other { vendor: 0 });
            }
        }
        let ring = h.ring.data.read().unwrap();
        assert!(ring[64..64 + 20_000].iter().all(|&b| b == 7));
    }

    #[test]
    fn a_write_outside_the_ring_or_without_a_receive_is_refused() {
        let mut h = Harness::new().unwrap();
        let out = h
            .run(
                &write(false, 3, RING_LEN as u64 - 4, 1, &[0; 8]),
                Options::default(),
            )
            .unwrap();
        assert_eq!(out.sent_back, [TAG_NAK, 3, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(out.completions[0].status, WcStatus::RemoteAccess);
        let expired = Options {
            rnr_expired: true,
            ..Options::default()
        };
        let out = h.run(&write(false, 4, 0, 1, &[0; 8]), expired).unwrap();
        assert_eq!(out.sent_back, [TAG_NAK, 4, 0, 0, 0, 0, 0, 0, 0, 2]);
        assert_eq!(out.completions[0].status, WcStatus::RnrRetryExceeded);
        let out = h.run(&[0x77; 40], Options::default()).unwrap();
        assert_eq!(out.completions.len(), 1);
        assert_eq!(out.completions[0].status, WcStatus::Other { vendor: 0x77 });
        assert!(out.sent_back.is_empty());
    }
}
