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
//! A reader thread per connection plays the receiving NIC.

use super::{Ctx, SoftQp, SoftRegion, Wire, next_qp_num};
use crate::bootstrap::{self, Hello, HelloFabric};
use crate::fabric::{
    Completion, CompletionKind, Connected, FabricError, FabricUrl, LocalSetup, PeerRing, Region,
    WcStatus, WriteImm,
};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const TAG_WRITE: u8 = 1;
const TAG_NAK: u8 = 2;
const TAG_WRITE_SIGNALED: u8 = 3;
const TAG_ACK: u8 = 4;
const WRITE_HEADER: usize = 1 + 8 + 8 + 4 + 4 + 4;
/// Largest write accepted off the wire (a ring is at most this big anyway).
const MAX_WRITE: usize = 1 << 31;

fn status_code(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::RemoteAccess => 1,
        WcStatus::RnrRetryExceeded => 2,
        WcStatus::RetryExceeded => 3,
        WcStatus::Flushed => 4,
        WcStatus::Other { .. } => 5,
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

/// The sending half of a TCP queue pair.
pub(super) struct TcpWire {
    writer: Arc<Mutex<TcpStream>>,
    buf: Vec<u8>,
    pending_hello: Option<Hello>,
}

impl TcpWire {
    pub(super) fn write(
        &mut self,
        wr: &WriteImm<'_, SoftRegion>,
        data: &[u8],
    ) -> Result<(), WcStatus> {
        self.buf.clear();
        self.buf.push(if wr.signaled {
            TAG_WRITE_SIGNALED
        } else {
            TAG_WRITE
        });
        self.buf.extend_from_slice(&wr.wr_id.to_le_bytes());
        self.buf.extend_from_slice(&wr.remote_addr.to_le_bytes());
        self.buf.extend_from_slice(&wr.rkey.to_le_bytes());
        self.buf.extend_from_slice(&wr.imm.to_le_bytes());
        self.buf
            .extend_from_slice(&(data.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(data);
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&self.buf).map_err(|_| WcStatus::RetryExceeded)
    }

    pub(super) fn established(&mut self) -> Result<(), FabricError> {
        if let Some(hello) = self.pending_hello.take() {
            let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            bootstrap::send(&mut *w, &hello)?;
        }
        Ok(())
    }

    pub(super) fn close(&mut self) {
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let _ = w.shutdown(Shutdown::Both);
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
    let writer = Arc::new(Mutex::new(stream));
    let dead = Arc::new(AtomicBool::new(false));
    let nic = ReaderNic {
        ctx: ctx.clone(),
        qp_num,
        dead: dead.clone(),
        writer: writer.clone(),
    };
    std::thread::Builder::new()
        .name(format!("rpc-tcp-rx-{qp_num}"))
        .spawn(move || nic.run(reader))
        .map_err(|e| FabricError::io("spawn reader", e))?;
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            ctx: ctx.clone(),
            dead,
            wire: Wire::Tcp(TcpWire {
                writer,
                buf: Vec::with_capacity(4096),
                pending_hello,
            }),
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
    writer: Arc<Mutex<TcpStream>>,
}

impl ReaderNic {
    fn fail(&self, wr_id: u64, kind: CompletionKind, status: WcStatus) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            self.ctx.push(Completion {
                wr_id,
                qp_num: self.qp_num,
                kind,
                status,
            });
        }
        let _ = self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shutdown(Shutdown::Both);
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
                        let _ = self
                            .writer
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .write_all(&nak);
                        return self.fail(0, CompletionKind::RecvImm { imm, byte_len: 0 }, status);
                    }
                    if tag == TAG_WRITE_SIGNALED {
                        let mut ack = [0u8; 9];
                        ack[0] = TAG_ACK;
                        ack[1..9].copy_from_slice(&wr_id.to_le_bytes());
                        let _ = self
                            .writer
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .write_all(&ack);
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
