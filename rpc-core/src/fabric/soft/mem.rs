//! `mem://name`: both ends in one process.

use super::{CqInner, Ctx, RegionInner, SoftQp, SoftRegion, Wire, next_qp_num};
use crate::fabric::{
    Completion, CompletionKind, Connected, FabricError, LocalSetup, PeerRing, Region, WcStatus,
    WriteImm,
};
use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

type Registry = Mutex<HashMap<String, Sender<Option<MemIncoming>>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// What the server learns of a connecting client, and where to answer.
pub struct MemIncoming {
    ctx: Arc<Ctx>,
    cq: Arc<CqInner>,
    qp_num: u32,
    ring: PeerRing,
    /// The ring itself: the only one the accepting side may write into.
    binding: Weak<RegionInner>,
    dead: Arc<AtomicBool>,
    reply: Sender<Reply>,
}

struct Reply {
    ctx: Arc<Ctx>,
    cq: Arc<CqInner>,
    qp_num: u32,
    ring: PeerRing,
    /// The ring itself: the only one the connecting side may write into.
    binding: Weak<RegionInner>,
    dead: Arc<AtomicBool>,
}

/// The peer side of an in-process queue pair.
pub(super) struct MemWire {
    peer: Arc<Ctx>,
    /// The completion queue the peer's queue pair reports to.
    peer_cq: Arc<CqInner>,
    peer_qp_num: u32,
    /// The ring the peer's queue pair advertised: the only one this end
    /// may write into.
    peer_ring: Weak<RegionInner>,
    /// Set by whichever end closes first; the other end's next post fails.
    peer_dead: Arc<AtomicBool>,
    pending_reply: Option<(Sender<Reply>, Reply)>,
}

impl MemWire {
    pub(super) fn write(
        &mut self,
        wr: &WriteImm<'_, SoftRegion>,
        data: &[u8],
    ) -> Result<(), WcStatus> {
        if self.peer_dead.load(Ordering::Acquire) {
            return Err(WcStatus::RetryExceeded);
        }
        self.peer.deliver(
            &self.peer_cq,
            self.peer_qp_num,
            &self.peer_ring,
            wr.remote_addr,
            wr.rkey,
            wr.imm,
            data,
        )
    }

    pub(super) fn established(&mut self) -> Result<(), FabricError> {
        if let Some((tx, reply)) = self.pending_reply.take() {
            tx.send(reply).map_err(|_| {
                FabricError::unreachable(
                    "accept",
                    "the client gave up before the handshake finished",
                )
            })?;
        }
        Ok(())
    }

    pub(super) fn close(&mut self) {
        // Tell the peer, as a dead RC peer eventually would: an error completion.
        if !self.peer_dead.swap(true, Ordering::AcqRel) {
            self.peer_cq.push(Completion {
                wr_id: 0,
                qp_num: self.peer_qp_num,
                kind: CompletionKind::Send,
                status: WcStatus::RetryExceeded,
            });
        }
    }
}

/// Listens on `mem://name`.
pub struct MemListener {
    name: String,
    rx: Receiver<Option<MemIncoming>>,
    tx: Sender<Option<MemIncoming>>,
}

impl MemListener {
    pub(super) fn bind(name: &str) -> Result<MemListener, FabricError> {
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        if reg.contains_key(name) {
            return Err(FabricError::invalid(
                "listen",
                format!("mem://{name} is already in use in this process"),
            ));
        }
        let (tx, rx) = unbounded();
        reg.insert(name.to_owned(), tx.clone());
        Ok(MemListener {
            name: name.to_owned(),
            rx,
            tx,
        })
    }

    pub(super) fn next(&self) -> Option<MemIncoming> {
        self.rx.recv().ok().flatten()
    }

    pub(super) fn local_url(&self) -> String {
        format!("mem://{}", self.name)
    }

    pub(super) fn close(&self) {
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        if reg
            .get(&self.name)
            .is_some_and(|tx| tx.same_channel(&self.tx))
        {
            reg.remove(&self.name);
        }
        let _ = self.tx.send(None);
    }
}

impl Drop for MemListener {
    fn drop(&mut self) {
        self.close();
    }
}

fn peer_ring(local: &LocalSetup<'_, SoftRegion>) -> PeerRing {
    PeerRing {
        addr: local.ring.addr(),
        len: local.ring.len() as u64,
        rkey: local.ring.rkey(),
        max_message: local.max_message,
    }
}

pub(super) fn connect(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    name: &str,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    let listener = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned()
        .ok_or_else(|| {
            FabricError::unreachable(
                "connect",
                format!("no server listens on mem://{name} in this process"),
            )
        })?;
    let qp_num = next_qp_num();
    let dead = Arc::new(AtomicBool::new(false));
    let (reply_tx, reply_rx) = bounded(1);
    let incoming = MemIncoming {
        ctx: ctx.clone(),
        cq: cq.clone(),
        qp_num,
        ring: peer_ring(&local),
        binding: local.ring.binding(),
        dead: dead.clone(),
        reply: reply_tx,
    };
    listener.send(Some(incoming)).map_err(|_| {
        FabricError::unreachable("connect", format!("mem://{name} stopped listening"))
    })?;
    let reply = reply_rx.recv_timeout(local.timeout).map_err(|_| {
        FabricError::unreachable(
            "connect",
            format!("mem://{name} did not complete the handshake"),
        )
    })?;
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            cq: cq.clone(),
            dead,
            wire: Wire::Mem(MemWire {
                peer: reply.ctx,
                peer_cq: reply.cq,
                peer_qp_num: reply.qp_num,
                peer_ring: reply.binding,
                peer_dead: reply.dead,
                pending_reply: None,
            }),
        },
        peer: reply.ring,
        peer_addr: format!("mem://{name}#{}", reply.qp_num),
    })
}

pub(super) fn accept(
    ctx: &Arc<Ctx>,
    cq: &Arc<CqInner>,
    incoming: MemIncoming,
    local: LocalSetup<'_, SoftRegion>,
) -> Result<Connected<SoftQp>, FabricError> {
    let qp_num = next_qp_num();
    let dead = Arc::new(AtomicBool::new(false));
    let reply = Reply {
        ctx: ctx.clone(),
        cq: cq.clone(),
        qp_num,
        ring: peer_ring(&local),
        binding: local.ring.binding(),
        dead: dead.clone(),
    };
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            cq: cq.clone(),
            dead,
            wire: Wire::Mem(MemWire {
                peer: incoming.ctx,
                peer_cq: incoming.cq,
                peer_qp_num: incoming.qp_num,
                peer_ring: incoming.binding,
                peer_dead: incoming.dead,
                pending_reply: Some((incoming.reply, reply)),
            }),
        },
        peer: incoming.ring,
        peer_addr: format!("mem-client#{}", incoming.qp_num),
    })
}
