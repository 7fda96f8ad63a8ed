//! The receiving NIC of a tcp:// connection: the state machine that turns
//! the bytes read from its socket (or decrypted from its TLS session) into
//! placed writes, acknowledgements, answered and completed reads, and
//! completions. Every length read is checked against its target before a
//! byte of payload is accepted.

use super::TcpConn;
use super::message::{
    ACK_LEN, NAK_LEN, TAG_ACK, TAG_NAK, TAG_READ, TAG_READ_RESP, TAG_WRITE, TAG_WRITE_SIGNALED,
    WRITE_HEADER, ack_message, nak_message, read_head, status_from,
};
use crate::fabric::soft::{CqInner, RegionInner, SoftBuffer};
use crate::fabric::{Completion, CompletionKind, WcStatus};
use std::io::{ErrorKind, IoSlice, Read};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// A payload with at least this much still to come is read straight into
/// its region, not through the scratch buffer.
const DIRECT_READ: usize = 16 << 10;
/// Bytes read from one socket per poll before the others get their turn.
const READ_BUDGET: usize = 1 << 20;

/// What reading a ready socket came to.
pub(super) enum ReadOutcome {
    /// Read until it would block.
    Drained,
    /// Stopped early: read again at the next poll.
    More,
    /// The connection is over: stop watching it.
    Closed,
}

/// The bytes of a read this side posted, arriving.
struct InRead {
    wr_id: u64,
    buf: SoftBuffer,
    len: usize,
    have: usize,
}

/// An incoming write whose header was read.
struct InWrite {
    wr_id: u64,
    imm: u32,
    len: usize,
    signaled: bool,
    /// Where the payload goes (none for a zero-length write).
    target: Option<(Arc<RegionInner>, usize)>,
    /// Payload bytes placed so far.
    have: usize,
}

enum RxState {
    /// Reading a message's tag and fixed fields into `head`.
    Head {
        head: [u8; WRITE_HEADER],
        have: usize,
    },
    /// Reading a write's payload into its region.
    Payload(InWrite),
    /// Reading the bytes of a read this side posted into its buffer.
    ReadData(InRead),
    /// A write is in, but the shared receive queue is empty: waiting for a
    /// receive, as RNR retries do, until `since` + the RNR timeout.
    Stalled { write: InWrite, since: Instant },
    /// The connection failed; what else arrives is ignored.
    Done,
}

pub(super) struct Rx {
    state: RxState,
    /// Bytes read but not yet parsed (only after a stall).
    carry: Vec<u8>,
}

impl Rx {
    /// A reader waiting for a message's tag.
    pub(super) fn new() -> Rx {
        Rx {
            state: RxState::Head {
                head: [0; WRITE_HEADER],
                have: 0,
            },
            carry: Vec::new(),
        }
    }

    /// With at least [`DIRECT_READ`] bytes of a payload (or read data) to
    /// come, runs `read` on where they go and counts what it placed; `None`
    /// otherwise (read into the scratch buffer).
    fn direct(
        &mut self,
        read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> Option<std::io::Result<usize>> {
        let (r, have) = match &mut self.state {
            RxState::Payload(w) if w.len - w.have >= DIRECT_READ => {
                let (region, start) = w.target.as_ref()?;
                let mut bytes = region.data.write().unwrap_or_else(|e| e.into_inner());
                (read(&mut bytes[start + w.have..start + w.len]), &mut w.have)
            }
            RxState::ReadData(r) if r.len - r.have >= DIRECT_READ => {
                (read(&mut r.buf[r.have..r.len]), &mut r.have)
            }
            _ => return None,
        };
        if let Ok(n) = r {
            *have += n;
        }
        Some(r)
    }
}

impl TcpConn {
    /// Rejects a write: the NAK goes out, then the connection closes.
    fn nak(&self, wr_id: u64, imm: u32, status: WcStatus, cq: &CqInner) {
        let _ = self.send(&[IoSlice::new(&nak_message(wr_id, status))], &[]);
        self.tx().closing = true;
        if !self.dead.swap(true, Ordering::AcqRel) {
            cq.push(Completion {
                wr_id: 0,
                qp_num: self.qp_num,
                kind: CompletionKind::RecvImm { imm, byte_len: 0 },
                status,
            });
        }
    }

    /// Where a read picks up: `Some` if the connection is over or still
    /// stalled, after bytes left over from a stall.
    fn resume(&self, rx: &mut Rx, cq: &CqInner) -> Option<ReadOutcome> {
        if matches!(rx.state, RxState::Done) {
            return Some(ReadOutcome::Closed);
        }
        // Bytes left over from a stall come first.
        if let RxState::Stalled { .. } = rx.state {
            match self.retry_stalled(rx, cq) {
                Step::Go => {}
                Step::Wait => return Some(ReadOutcome::More),
                Step::Stop => return Some(ReadOutcome::Closed),
            }
        }
        if !rx.carry.is_empty() {
            let carry = std::mem::take(&mut rx.carry);
            match self.parse(rx, &carry, cq) {
                Parsed::All => {}
                Parsed::Stalled(rest) => {
                    rx.carry = carry[carry.len() - rest..].to_vec();
                    return Some(ReadOutcome::More);
                }
                Parsed::Stop => return Some(ReadOutcome::Closed),
            }
        }
        None
    }

    /// Reads what the socket has, up to the read budget.
    pub(super) fn read_ready(&self, scratch: &mut [u8], cq: &CqInner) -> ReadOutcome {
        if self.tls {
            return self.read_ready_tls(scratch, cq);
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(outcome) = self.resume(&mut rx, cq) {
            return outcome;
        }
        let mut budget = READ_BUDGET;
        loop {
            let read = match rx.direct(|dst| (&self.stream).read(dst)) {
                Some(r) => r.map(|n| (n, true)),
                None => (&self.stream).read(scratch).map(|n| (n, false)),
            };
            match read {
                // Peer gone (or we closed: then `dead` is set and nothing is pushed).
                Ok((0, _)) => return self.end_read(&mut rx, cq),
                Ok((n, direct)) => {
                    budget = budget.saturating_sub(n);
                    if let Some(outcome) = self.take_read(&mut rx, n, direct, scratch, cq) {
                        return outcome;
                    }
                    if budget == 0 {
                        return ReadOutcome::More;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(_) => return self.end_read(&mut rx, cq),
            }
        }
    }

    /// Takes the `n` bytes a read placed in the ring (`direct`: into the
    /// payload under way, which completes once whole) or in `scratch`
    /// (parsed as the stream's continuation); `Some` when reading must
    /// stop for now.
    fn take_read(
        &self,
        rx: &mut Rx,
        n: usize,
        direct: bool,
        scratch: &[u8],
        cq: &CqInner,
    ) -> Option<ReadOutcome> {
        if direct {
            if matches!(&rx.state, RxState::ReadData(r) if r.have == r.len) {
                self.read_done(rx, cq);
                return None;
            }
            if !matches!(&rx.state, RxState::Payload(w) if w.have == w.len) {
                return None;
            }
            let RxState::Payload(w) = std::mem::replace(&mut rx.state, RxState::Done) else {
                unreachable!("checked above")
            };
            return match self.complete(rx, w, cq, None) {
                Step::Go => None,
                Step::Wait => Some(ReadOutcome::More),
                Step::Stop => Some(ReadOutcome::Closed),
            };
        }
        match self.parse(rx, &scratch[..n], cq) {
            Parsed::All => None,
            Parsed::Stalled(rest) => {
                rx.carry = scratch[n - rest..n].to_vec();
                Some(ReadOutcome::More)
            }
            Parsed::Stop => Some(ReadOutcome::Closed),
        }
    }

    /// The peer is gone or the socket failed: the reader stops and the
    /// connection fails.
    fn end_read(&self, rx: &mut Rx, cq: &CqInner) -> ReadOutcome {
        rx.state = RxState::Done;
        self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
        ReadOutcome::Closed
    }

    /// [`TcpConn::read_ready`] over TLS: rustls reads and decrypts the
    /// socket's bytes, and the plaintext goes through the same state
    /// machine and bounds checks; a payload with at least [`DIRECT_READ`]
    /// bytes to come is copied from rustls straight into its ring. The
    /// budget counts the bytes read from the socket.
    fn read_ready_tls(&self, scratch: &mut [u8], cq: &CqInner) -> ReadOutcome {
        /// What one look at the session found.
        enum Got {
            /// Plaintext, placed in the ring (`true`) or in `scratch`.
            Bytes(usize, bool),
            /// Ciphertext read from the socket: look again.
            Again,
            /// The socket is empty.
            Drained,
            /// The budget is spent: read again at the next poll.
            Budget,
            /// The connection is over (why, if it failed).
            Ended(Option<String>),
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(outcome) = self.resume(&mut rx, cq) {
            return outcome;
        }
        let mut budget = READ_BUDGET;
        loop {
            let got = {
                let mut guard = self.tx();
                let tx = &mut *guard;
                let Some(session) = &mut tx.tls else {
                    unreachable!("a TLS connection has a session")
                };
                let read = match rx.direct(|dst| session.read_plaintext(dst)) {
                    Some(r) => r.map(|n| (n, true)),
                    None => session.read_plaintext(scratch).map(|n| (n, false)),
                };
                match read {
                    Ok((0, _)) => Got::Ended(None), // the peer's close_notify
                    Ok((n, direct)) => Got::Bytes(n, direct),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        // Nothing decrypted is left: read the socket.
                        let r = session.read_tls(&self.stream);
                        // Alerts and key updates rustls answers with,
                        // looked at by the next heartbeat as any write.
                        if session.wants_write() {
                            tx.sent_since_look = true;
                            let _ = session.flush(&self.stream);
                        }
                        match r {
                            Ok(0) => Got::Ended(None),
                            Ok(n) => {
                                budget = budget.saturating_sub(n);
                                if budget == 0 { Got::Budget } else { Got::Again }
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => Got::Drained,
                            Err(e) if e.kind() == ErrorKind::Interrupted => Got::Again,
                            Err(e) if e.kind() == ErrorKind::InvalidData => {
                                Got::Ended(Some(e.to_string()))
                            }
                            Err(_) => Got::Ended(None),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => Got::Ended(None),
                    Err(e) => Got::Ended(Some(e.to_string())),
                }
            };
            match got {
                Got::Again => {}
                Got::Drained => return ReadOutcome::Drained,
                Got::Budget => return ReadOutcome::More,
                Got::Ended(why) => {
                    if let Some(why) = why {
                        tracing::warn!(qp_num = self.qp_num, %why, "closing connection: TLS failed");
                    }
                    // Peer gone (or we closed: then `dead` is set and nothing is pushed).
                    return self.end_read(&mut rx, cq);
                }
                Got::Bytes(n, direct) => {
                    if let Some(outcome) = self.take_read(&mut rx, n, direct, scratch, cq) {
                        return outcome;
                    }
                }
            }
        }
    }

    /// Parses `data` as the continuation of the byte stream.
    fn parse(&self, rx: &mut Rx, mut data: &[u8], cq: &CqInner) -> Parsed {
        while !data.is_empty() {
            match &mut rx.state {
                RxState::Head { head, have } => {
                    let need = match head[0] {
                        _ if *have == 0 => 1,
                        TAG_WRITE | TAG_WRITE_SIGNALED | TAG_READ | TAG_READ_RESP => WRITE_HEADER,
                        TAG_ACK => ACK_LEN,
                        TAG_NAK => NAK_LEN,
                        other => {
                            tracing::warn!(
                                qp_num = self.qp_num,
                                tag = other,
                                "peer sent an unknown message"
                            );
                            rx.state = RxState::Done;
                            let status = WcStatus::Other {
                                vendor: other as u32,
                            };
                            self.fail_local(0, CompletionKind::Send, status, cq);
                            return Parsed::Stop;
                        }
                    };
                    let take = (need - *have).min(data.len());
                    head[*have..*have + take].copy_from_slice(&data[..take]);
                    *have += take;
                    data = &data[take..];
                    if *have == 1 {
                        continue; // the tag says how much more to read
                    }
                    if *have < need {
                        continue;
                    }
                    let head = *head;
                    match self.on_head(rx, &head, cq) {
                        Step::Go => {}
                        Step::Wait => return Parsed::Stalled(data.len()),
                        Step::Stop => return Parsed::Stop,
                    }
                }
                RxState::Payload(w) => {
                    let take = (w.len - w.have).min(data.len());
                    if let Some((region, start)) = &w.target {
                        let mut bytes = region.data.write().unwrap_or_else(|e| e.into_inner());
                        let at = start + w.have;
                        bytes[at..at + take].copy_from_slice(&data[..take]);
                    }
                    w.have += take;
                    data = &data[take..];
                    if w.have == w.len {
                        let RxState::Payload(w) = std::mem::replace(&mut rx.state, RxState::Done)
                        else {
                            unreachable!("matched above")
                        };
                        match self.complete(rx, w, cq, None) {
                            Step::Go => {}
                            Step::Wait => return Parsed::Stalled(data.len()),
                            Step::Stop => return Parsed::Stop,
                        }
                    }
                }
                RxState::ReadData(r) => {
                    let take = (r.len - r.have).min(data.len());
                    r.buf[r.have..r.have + take].copy_from_slice(&data[..take]);
                    r.have += take;
                    data = &data[take..];
                    if r.have == r.len {
                        self.read_done(rx, cq);
                    }
                }
                RxState::Stalled { .. } => return Parsed::Stalled(data.len()),
                RxState::Done => return Parsed::Stop,
            }
        }
        Parsed::All
    }

    /// The peer claimed what this side never did (`why`): the connection
    /// fails, reported as the work request `wr_id` of `kind`.
    fn refuse(
        &self,
        rx: &mut Rx,
        wr_id: u64,
        kind: CompletionKind,
        why: &str,
        cq: &CqInner,
    ) -> Step {
        tracing::warn!(qp_num = self.qp_num, wr_id, "closing connection: {why}");
        rx.state = RxState::Done;
        self.fail_local(wr_id, kind, WcStatus::Other { vendor: 0 }, cq);
        Step::Stop
    }

    /// A message's fixed part is in `head`.
    fn on_head(&self, rx: &mut Rx, head: &[u8; WRITE_HEADER], cq: &CqInner) -> Step {
        let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8"));
        let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4"));
        rx.state = RxState::Head {
            head: [0; WRITE_HEADER],
            have: 0,
        };
        match head[0] {
            TAG_ACK => {
                let wr_id = u64_at(1);
                let due = self.tx().acks_due.pop_front();
                if due != Some(wr_id) {
                    let why =
                        "the peer acknowledged a write that was not the next one sent signaled";
                    return self.refuse(rx, wr_id, CompletionKind::Send, why, cq);
                }
                cq.push(Completion {
                    wr_id,
                    qp_num: self.qp_num,
                    kind: CompletionKind::Send,
                    status: WcStatus::Success,
                });
                Step::Go
            }
            TAG_READ => self.serve_read(rx, u64_at(1), u64_at(9), u32_at(17), u32_at(25), cq),
            TAG_READ_RESP => {
                let (wr_id, len) = (u64_at(1), u32_at(25) as usize);
                // Only a read this side posted, of exactly its length:
                // nothing is allocated on the peer's say-so.
                let Some(buf) = self.lending.receive(wr_id, len as u64) else {
                    let why = "the peer answered a read that was not posted (or not of its length)";
                    return self.refuse(rx, wr_id, CompletionKind::Read, why, cq);
                };
                rx.state = RxState::ReadData(InRead {
                    wr_id,
                    buf,
                    len,
                    have: 0,
                });
                if len == 0 {
                    self.read_done(rx, cq);
                }
                Step::Go
            }
            TAG_NAK => {
                rx.state = RxState::Done;
                self.fail_local(u64_at(1), CompletionKind::Send, status_from(head[9]), cq);
                Step::Stop
            }
            tag => {
                let (wr_id, addr, rkey, imm) = (u64_at(1), u64_at(9), u32_at(17), u32_at(21));
                let len = u32_at(25) as usize;
                // Checked against the target region before any payload is
                // accepted: the length cannot make this side allocate.
                let target = if len == 0 {
                    None
                } else {
                    match crate::fabric::soft::target(&self.ring, addr, rkey, len) {
                        Ok(t) => Some(t),
                        Err(status) => {
                            tracing::warn!(
                                qp_num = self.qp_num,
                                len,
                                "closing connection: the peer wrote outside its ring"
                            );
                            rx.state = RxState::Done;
                            self.nak(wr_id, imm, status, cq);
                            return Step::Stop;
                        }
                    }
                };
                let w = InWrite {
                    wr_id,
                    imm,
                    len,
                    signaled: tag == TAG_WRITE_SIGNALED,
                    target,
                    have: 0,
                };
                if len == 0 {
                    self.complete(rx, w, cq, None)
                } else {
                    rx.state = RxState::Payload(w);
                    Step::Go
                }
            }
        }
    }

    /// A write's payload is placed: consume a receive, report it, and
    /// acknowledge it if it was signaled. With no receive posted, stall
    /// (stop reading) until one is, or fail after the RNR timeout counted
    /// from `stalled_since`.
    fn complete(
        &self,
        rx: &mut Rx,
        w: InWrite,
        cq: &CqInner,
        stalled_since: Option<Instant>,
    ) -> Step {
        if self.dead.load(Ordering::Acquire) {
            // Closed locally: nothing is delivered any more.
            rx.state = RxState::Done;
            return Step::Stop;
        }
        if !self.ctx.try_take_recv() {
            let since = stalled_since.unwrap_or_else(Instant::now);
            if since.elapsed() >= self.ctx.rnr_timeout {
                rx.state = RxState::Done;
                self.nak(w.wr_id, w.imm, WcStatus::RnrRetryExceeded, cq);
                return Step::Stop;
            }
            rx.state = RxState::Stalled { write: w, since };
            return Step::Wait;
        }
        rx.state = RxState::Head {
            head: [0; WRITE_HEADER],
            have: 0,
        };
        cq.push(Completion {
            wr_id: 0,
            qp_num: self.qp_num,
            kind: CompletionKind::RecvImm {
                imm: w.imm,
                byte_len: w.len as u32,
            },
            status: WcStatus::Success,
        });
        if w.signaled
            && self
                .send(&[IoSlice::new(&ack_message(w.wr_id))], &[])
                .is_err()
        {
            // Told now: nobody else learns that the socket failed.
            rx.state = RxState::Done;
            self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
            return Step::Stop;
        }
        Step::Go
    }

    /// The peer reads `len` bytes at `addr` of what this side lent under
    /// `rkey`: the bytes go out from the buffer itself. A read of anything
    /// not lent is rejected, and the connection closes.
    fn serve_read(
        &self,
        rx: &mut Rx,
        wr_id: u64,
        addr: u64,
        rkey: u32,
        len: u32,
        cq: &CqInner,
    ) -> Step {
        match self.lending.find(addr, rkey, u64::from(len)) {
            Ok((buf, start)) => {
                let head = read_head(TAG_READ_RESP, wr_id, 0, 0, len);
                if self
                    .send_lent(&head, buf, start, start + len as usize)
                    .is_err()
                {
                    rx.state = RxState::Done;
                    self.fail_local(0, CompletionKind::Send, WcStatus::RetryExceeded, cq);
                    return Step::Stop;
                }
                Step::Go
            }
            Err(status) => {
                tracing::warn!(
                    qp_num = self.qp_num,
                    len,
                    "closing connection: the peer read memory that was not lent to it"
                );
                rx.state = RxState::Done;
                self.nak(wr_id, 0, status, cq);
                Step::Stop
            }
        }
    }

    /// The bytes of the read under way are all in: it is complete.
    fn read_done(&self, rx: &mut Rx, cq: &CqInner) {
        let state = std::mem::replace(
            &mut rx.state,
            RxState::Head {
                head: [0; WRITE_HEADER],
                have: 0,
            },
        );
        let RxState::ReadData(r) = state else {
            unreachable!("called with a read under way")
        };
        self.lending.done(r.wr_id, r.buf);
        cq.push(Completion {
            wr_id: r.wr_id,
            qp_num: self.qp_num,
            kind: CompletionKind::Read,
            status: WcStatus::Success,
        });
    }

    fn retry_stalled(&self, rx: &mut Rx, cq: &CqInner) -> Step {
        match std::mem::replace(&mut rx.state, RxState::Done) {
            RxState::Stalled { write, since } => self.complete(rx, write, cq, Some(since)),
            other => {
                rx.state = other;
                Step::Go
            }
        }
    }
}

enum Step {
    Go,
    /// Stalled for a receive: stop reading for now.
    Wait,
    /// The connection failed.
    Stop,
}

enum Parsed {
    All,
    /// Stalled with this many bytes of the input still unparsed.
    Stalled(usize),
    Stop,
}
