//! `tcp://host:port`: the soft fabric across processes and machines.
//!
//! After the [`bootstrap`](crate::bootstrap) handshake, the TCP connection
//! carries two messages:
//!
//! - `WRITE`: `tag=1` (unsignaled) or `tag=3` (signaled), `wr_id u64,
//!   remote_addr u64, rkey u32, imm u32, len u32`, then `len` bytes;
//! - `ACK`: `tag=4, wr_id u64`: a signaled write was applied; only now does
//!   the sender see its send completion, as with an RC acknowledgement;
//! - `NAK`: `tag=2, wr_id u64, status u8`: the receiver rejected a write
//!   (bad rkey or bounds, or RNR exhaustion); both queue pairs go to error.
//!
//! A reader thread per connection plays the receiving NIC. Posting writes
//! the message to the socket at once when it can, but never blocks for long:
//! when the socket is full (the peer stopped reading), the rest waits in a
//! queue that a writer thread drains, as a verbs post never blocks either.

use super::{Ctx, SoftQp, SoftRegion, Wire, next_qp_num};
use crate::bootstrap::{self, Hello, HelloFabric};
use crate::fabric::{
    Completion, CompletionKind, Connected, FabricError, FabricUrl, LocalSetup, PeerRing, Region,
    WcStatus, WriteImm,
};
use std::collections::VecDeque;
use std::io::{BufReader, ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const TAG_WRITE: u8 = 1;
const TAG_NAK: u8 = 2;
const TAG_WRITE_SIGNALED: u8 = 3;
const TAG_ACK: u8 = 4;
const WRITE_HEADER: usize = 1 + 8 + 8 + 4 + 4 + 4;
/// Largest write accepted off the wire (a ring is at most this big anyway).
const MAX_WRITE: usize = 1 << 31;
/// How long a post may wait for room in the socket before it leaves the rest
/// to the writer thread (the socket's send timeout).
const POST_BLOCK: Duration = Duration::from_millis(5);
/// How long a closing connection keeps trying to flush to a peer that does
/// not read before it gives up.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

fn status_code(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::RemoteAccess => 1,
        WcStatus::RnrRetryExceeded => 2,
        WcStatus::RetryExceeded => 3,
        WcStatus::Flushed => 4,
        WcStatus::Other { .. } | WcStatus::DeviceError { .. } => 5,
    }
}

fn status_from(code: u8) -> WcStatus {
    match code {
        1 => WcStatus::RemoteAccess,
        2 => WcStatus::RnrRetryExceeded,
        3 => WcStatus::RetryExceeded,
        4 => WcStatus::Flushed,
        v => WcStatus::Other { vendor: v as u32 },
    }
}

/// The byte stream to the peer, shared by posters, the reader (ACKs and
/// NAKs) and the writer thread. One of them writes at a time, in order.
struct Tx {
    stream: TcpStream,
    state: Mutex<TxState>,
    cond: Condvar,
}

#[derive(Default)]
struct TxState {
    /// Messages not yet written, in order; the first may be partly written.
    queue: VecDeque<Vec<u8>>,
    /// Bytes of the first queued message already written.
    front_done: usize,
    /// Someone is writing to the socket.
    busy: bool,
    /// Shut down once everything queued is written.
    closing: bool,
    /// The socket failed or was shut down: nothing more is written.
    failed: bool,
}

/// What writing a message got to.
enum Wrote {
    All,
    /// The socket had no room for a while: this many bytes went out.
    Part(usize),
    Failed,
}

impl Tx {
    fn new(stream: TcpStream) -> std::io::Result<Arc<Tx>> {
        stream.set_write_timeout(Some(POST_BLOCK))?;
        Ok(Arc::new(Tx {
            stream,
            state: Mutex::new(TxState::default()),
            cond: Condvar::new(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, TxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes `head` then `data`, from byte `done` of the two, until all is
    /// written, the socket stays full for [`POST_BLOCK`], or it fails.
    fn write_from(&self, head: &[u8], data: &[u8], mut done: usize) -> Wrote {
        let total = head.len() + data.len();
        while done < total {
            let wrote = if done < head.len() {
                (&self.stream).write_vectored(&[IoSlice::new(&head[done..]), IoSlice::new(data)])
            } else {
                (&self.stream).write(&data[done - head.len()..])
            };
            match wrote {
                Ok(0) => return Wrote::Failed,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Wrote::Part(done);
                }
                Err(_) => return Wrote::Failed,
            }
        }
        Wrote::All
    }

    /// Sends `head` and `data` after everything sent before: writes them now
    /// (with no copy) if the socket is free and has room, else queues a copy
    /// for the writer thread. Blocks at most about [`POST_BLOCK`]. `Err` once
    /// the socket failed.
    fn send(&self, head: &[u8], data: &[u8]) -> Result<(), ()> {
        let copy = || [head, data].concat();
        let mut st = self.lock();
        if st.failed || st.closing {
            return Err(());
        }
        if st.busy || !st.queue.is_empty() {
            st.queue.push_back(copy());
            self.cond.notify_all();
            return Ok(());
        }
        st.busy = true;
        drop(st);
        let wrote = self.write_from(head, data, 0);
        let mut st = self.lock();
        st.busy = false;
        let result = match wrote {
            Wrote::All => Ok(()),
            Wrote::Part(done) => {
                // Ahead of whatever was queued meanwhile.
                st.queue.push_front(copy());
                st.front_done = done;
                Ok(())
            }
            Wrote::Failed => {
                st.failed = true;
                Err(())
            }
        };
        if !st.queue.is_empty() || st.failed {
            self.cond.notify_all();
        }
        result
    }

    /// Shuts down once everything sent so far is written.
    fn close(&self) {
        self.lock().closing = true;
        self.cond.notify_all();
    }

    /// Shuts down now, dropping whatever is queued.
    fn abort(&self) {
        self.lock().failed = true;
        self.cond.notify_all();
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// The writer thread: writes what posters could not, until closed or
    /// failed. `on_error` reports a failed write.
    fn run(&self, on_error: impl FnOnce()) {
        let mut st = self.lock();
        let mut stalled_since: Option<Instant> = None;
        let mut write_failed = false;
        loop {
            if st.failed {
                break;
            }
            if st.busy || st.queue.is_empty() {
                if st.closing && !st.busy {
                    break;
                }
                st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            if st.closing && stalled_since.is_some_and(|t| t.elapsed() > CLOSE_LINGER) {
                tracing::debug!("giving up flushing to a peer that does not read");
                break;
            }
            let bytes = st.queue.pop_front().expect("queue not empty");
            let done = std::mem::take(&mut st.front_done);
            st.busy = true;
            drop(st);
            let wrote = self.write_from(&bytes, &[], done);
            st = self.lock();
            st.busy = false;
            match wrote {
                Wrote::All => stalled_since = None,
                Wrote::Part(now_done) => {
                    if now_done > done {
                        stalled_since = None;
                    }
                    stalled_since.get_or_insert_with(Instant::now);
                    st.queue.push_front(bytes);
                    st.front_done = now_done;
                }
                Wrote::Failed => {
                    if !st.failed {
                        write_failed = true;
                    }
                    break;
                }
            }
        }
        st.failed = true;
        st.queue.clear();
        drop(st);
        let _ = self.stream.shutdown(Shutdown::Both);
        if write_failed {
            on_error();
        }
    }
}

/// The sending half of a TCP queue pair.
pub(super) struct TcpWire {
    tx: Arc<Tx>,
    pending_hello: Option<Hello>,
}

impl TcpWire {
    pub(super) fn write(
        &mut self,
        wr: &WriteImm<'_, SoftRegion>,
        data: &[u8],
    ) -> Result<(), WcStatus> {
        let mut head = [0u8; WRITE_HEADER];
        head[0] = if wr.signaled {
            TAG_WRITE_SIGNALED
        } else {
            TAG_WRITE
        };
        head[1..9].copy_from_slice(&wr.wr_id.to_le_bytes());
        head[9..17].copy_from_slice(&wr.remote_addr.to_le_bytes());
        head[17..21].copy_from_slice(&wr.rkey.to_le_bytes());
        head[21..25].copy_from_slice(&wr.imm.to_le_bytes());
        head[25..29].copy_from_slice(&(data.len() as u32).to_le_bytes());
        self.tx
            .send(&head, data)
            .map_err(|()| WcStatus::RetryExceeded)
    }

    pub(super) fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending_hello.take() {
            self.tx.send(&hello.encode(), &[]).map_err(|()| {
                FabricError::unreachable("accept", "the connection failed during the handshake")
            })?;
        }
        Ok(())
    }

    /// Closes once what was posted is written, like an orderly close.
    pub(super) fn close(&mut self) {
        self.tx.close();
    }
}

/// Listens on `tcp://host:port`.
pub type TcpListener = crate::bootstrap::Acceptor;

fn local_hello(qp_num: u32, local: &LocalSetup<'_, SoftRegion>) -> Hello {
    Hello {
        fabric: HelloFabric::Tcp,
        qp_num,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 0,
        ring: PeerRing {
            addr: local.ring.addr(),
            len: local.ring.len() as u64,
            rkey: local.ring.rkey(),
            max_message: local.max_message,
        },
    }
}

pub(super) fn connect(
    ctx: &Arc<Ctx>,
    url: &FabricUrl,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    let mut stream = bootstrap::dial(url, local.timeout)?;
    let qp_num = next_qp_num();
    setup(&stream, local.timeout)?;
    bootstrap::send(&mut stream, &local_hello(qp_num, &local))?;
    let peer = bootstrap::recv(&mut stream, HelloFabric::Tcp)?;
    finish(ctx, stream, qp_num, peer, None)
}

pub(super) fn accept(
    ctx: &Arc<Ctx>,
    mut stream: TcpStream,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    setup(&stream, local.timeout)?;
    let peer = bootstrap::recv(&mut stream, HelloFabric::Tcp)?;
    let qp_num = next_qp_num();
    let hello = local_hello(qp_num, &local);
    finish(ctx, stream, qp_num, peer, Some(hello))
}

fn setup(stream: &TcpStream, timeout: std::time::Duration) -> Result<(), FabricError> {
    stream
        .set_nodelay(true)
        .map_err(|e| FabricError::io("set_nodelay", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| FabricError::io("set_read_timeout", e))
}

fn finish(
    ctx: &Arc<Ctx>,
    stream: TcpStream,
    qp_num: u32,
    peer: Hello,
    pending_hello: Option<Hello>,
) -> Result<Connected<SoftQp>, FabricError> {
    stream
        .set_read_timeout(None)
        .map_err(|e| FabricError::io("set_read_timeout", e))?;
    let peer_addr = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let reader = stream
        .try_clone()
        .map_err(|e| FabricError::io("clone socket", e))?;
    let tx = Tx::new(stream).map_err(|e| FabricError::io("set_write_timeout", e))?;
    let dead = Arc::new(AtomicBool::new(false));
    let writer = {
        let (tx, ctx, dead) = (tx.clone(), ctx.clone(), dead.clone());
        move || {
            tx.run(|| {
                if !dead.swap(true, Ordering::AcqRel) {
                    ctx.push(Completion {
                        wr_id: 0,
                        qp_num,
                        kind: CompletionKind::Send,
                        status: WcStatus::RetryExceeded,
                    });
                }
            })
        }
    };
    std::thread::Builder::new()
        .name(format!("rpc-tcp-tx-{qp_num}"))
        .spawn(writer)
        .map_err(|e| FabricError::io("spawn writer", e))?;
    let nic = ReaderNic {
        ctx: ctx.clone(),
        qp_num,
        dead: dead.clone(),
        tx: tx.clone(),
    };
    if let Err(e) = std::thread::Builder::new()
        .name(format!("rpc-tcp-rx-{qp_num}"))
        .spawn(move || nic.run(reader))
    {
        tx.abort(); // ends the writer thread
        return Err(FabricError::io("spawn reader", e));
    }
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            ctx: ctx.clone(),
            dead,
            wire: Wire::Tcp(TcpWire { tx, pending_hello }),
        },
        peer: peer.ring,
        peer_addr,
    })
}

/// The receiving side of a TCP queue pair: reads writes and applies them.
struct ReaderNic {
    ctx: Arc<Ctx>,
    qp_num: u32,
    dead: Arc<AtomicBool>,
    tx: Arc<Tx>,
}

impl ReaderNic {
    fn fail(&self, wr_id: u64, kind: CompletionKind, status: WcStatus) {
        self.mark_dead(wr_id, kind, status);
        self.tx.abort();
    }

    fn mark_dead(&self, wr_id: u64, kind: CompletionKind, status: WcStatus) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            self.ctx.push(Completion {
                wr_id,
                qp_num: self.qp_num,
                kind,
                status,
            });
        }
    }

    fn run(self, stream: TcpStream) {
        let mut r = BufReader::with_capacity(256 * 1024, stream);
        let mut data = Vec::new();
        loop {
            let mut tag = [0u8; 1];
            if r.read_exact(&mut tag).is_err() {
                // Peer gone (or we closed: then `dead` is already set and nothing is pushed).
                return self.fail(0, CompletionKind::Send, WcStatus::RetryExceeded);
            }
            match tag[0] {
                tag @ (TAG_WRITE | TAG_WRITE_SIGNALED) => {
                    let mut h = [0u8; WRITE_HEADER - 1];
                    if r.read_exact(&mut h).is_err() {
                        return self.fail(0, CompletionKind::Send, WcStatus::RetryExceeded);
                    }
                    let wr_id = u64::from_le_bytes(h[0..8].try_into().expect("8"));
                    let addr = u64::from_le_bytes(h[8..16].try_into().expect("8"));
                    let rkey = u32::from_le_bytes(h[16..20].try_into().expect("4"));
                    let imm = u32::from_le_bytes(h[20..24].try_into().expect("4"));
                    let len = u32::from_le_bytes(h[24..28].try_into().expect("4")) as usize;
                    if len > MAX_WRITE {
                        tracing::warn!(
                            qp_num = self.qp_num,
                            len,
                            "peer sent an impossible write length"
                        );
                        return self.fail(0, CompletionKind::Send, WcStatus::Other { vendor: 0 });
                    }
                    data.resize(len, 0);
                    if r.read_exact(&mut data).is_err() {
                        return self.fail(0, CompletionKind::Send, WcStatus::RetryExceeded);
                    }
                    if let Err(status) = self.ctx.deliver(self.qp_num, addr, rkey, imm, &data) {
                        let mut nak = [0u8; 10];
                        nak[0] = TAG_NAK;
                        nak[1..9].copy_from_slice(&wr_id.to_le_bytes());
                        nak[9] = status_code(status);
                        // The NAK goes out, then the connection closes.
                        let _ = self.tx.send(&nak, &[]);
                        self.tx.close();
                        return self.mark_dead(
                            0,
                            CompletionKind::RecvImm { imm, byte_len: 0 },
                            status,
                        );
                    }
                    if tag == TAG_WRITE_SIGNALED {
                        let mut ack = [0u8; 9];
                        ack[0] = TAG_ACK;
                        ack[1..9].copy_from_slice(&wr_id.to_le_bytes());
                        let _ = self.tx.send(&ack, &[]);
                    }
                }
                TAG_ACK => {
                    let mut h = [0u8; 8];
                    if r.read_exact(&mut h).is_err() {
                        return self.fail(0, CompletionKind::Send, WcStatus::RetryExceeded);
                    }
                    self.ctx.push(Completion {
                        wr_id: u64::from_le_bytes(h),
                        qp_num: self.qp_num,
                        kind: CompletionKind::Send,
                        status: WcStatus::Success,
                    });
                }
                TAG_NAK => {
                    let mut h = [0u8; 9];
                    let _ = r.read_exact(&mut h);
                    let wr_id = u64::from_le_bytes(h[0..8].try_into().expect("8"));
                    return self.fail(wr_id, CompletionKind::Send, status_from(h[8]));
                }
                other => {
                    tracing::warn!(
                        qp_num = self.qp_num,
                        tag = other,
                        "peer sent an unknown message"
                    );
                    return self.fail(
                        0,
                        CompletionKind::Send,
                        WcStatus::Other {
                            vendor: other as u32,
                        },
                    );
                }
            }
        }
    }
}
