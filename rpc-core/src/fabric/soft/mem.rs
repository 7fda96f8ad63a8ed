//! `mem://name`: both ends in one process.

use super::{CqInner, Ctx, Lending, RegionInner, SoftQp, SoftRegion, Wire, next_qp_num};
use crate::Code;
use crate::auth::{Challenge, Credential, random_nonce, verify_answer};
use crate::fabric::bootstrap;
use crate::fabric::{
    Admission, Completion, CompletionKind, Connected, FabricError, LocalSetup, PeerRing, Region,
    RemoteBuf, WcStatus, WriteImm,
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

/// Where a server answers a connecting client: its side, or a refusal.
type ReplyTx = Sender<Result<Reply, (Code, String)>>;

/// What the server learns of a connecting client, and where to answer.
pub struct MemIncoming {
    ctx: Arc<Ctx>,
    cq: Arc<CqInner>,
    qp_num: u32,
    ring: PeerRing,
    /// The ring itself: the only one the accepting side may write into.
    binding: Weak<RegionInner>,
    dead: Arc<AtomicBool>,
    /// The buffers the client lends.
    lending: Arc<Lending>,
    /// What the client presents if the server asks.
    credential: Option<Arc<dyn Credential>>,
    /// The identity the server admitted the client under.
    identity: Option<String>,
    reply: ReplyTx,
}

impl MemIncoming {
    /// The client's receive ring.
    pub(super) fn peer_ring(&self) -> PeerRing {
        self.ring
    }

    /// Turns the client away: its connect fails with `code`.
    pub(super) fn refuse(self, code: Code, why: &str) {
        tracing::warn!(client = self.qp_num, %why, "connection refused");
        let _ = self.reply.send(Err((code, why.to_owned())));
    }

    /// What an in-process handshake authenticates: the client's ring.
    fn transcript(&self) -> [u8; 24] {
        let mut t = [0u8; 24];
        t[..8].copy_from_slice(&self.ring.addr.to_le_bytes());
        t[8..16].copy_from_slice(&self.ring.len.to_le_bytes());
        t[16..20].copy_from_slice(&self.ring.rkey.to_le_bytes());
        t[20..].copy_from_slice(&self.qp_num.to_le_bytes());
        t
    }

    /// Runs the challenge-response a tcp:// or rdma:// handshake runs over
    /// the wire, in process: the same checks, both ways.
    fn authenticate(&mut self, admission: &Admission) -> Result<(), (Code, String)> {
        let Some(auth) = &admission.authenticator else {
            return Ok(());
        };
        let refused = |why: String| (Code::Unauthenticated, why);
        let credential = self
            .credential
            .clone()
            .ok_or_else(|| refused(bootstrap::NO_CREDENTIAL.into()))?;
        let nonce = random_nonce().map_err(|why| (Code::Internal, why))?;
        let transcript = self.transcript();
        let challenge = Challenge {
            nonce: &nonce,
            hello: &transcript,
        };
        let answer = credential.answer(&challenge).map_err(refused)?;
        let verified = verify_answer(&**auth, &challenge, &answer).map_err(refused)?;
        credential
            .check(&challenge, &answer, &verified.proof)
            .map_err(refused)?;
        self.identity = Some(verified.identity);
        Ok(())
    }
}

struct Reply {
    /// The server checked the client's credential (and so proved its own).
    authenticated: bool,
    ctx: Arc<Ctx>,
    cq: Arc<CqInner>,
    qp_num: u32,
    ring: PeerRing,
    /// The ring itself: the only one the connecting side may write into.
    binding: Weak<RegionInner>,
    dead: Arc<AtomicBool>,
    /// The buffers the server lends.
    lending: Arc<Lending>,
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
    /// The buffers the peer lends: this end's reads are served from them.
    peer_lending: Arc<Lending>,
    pending_reply: Option<(ReplyTx, Reply)>,
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

    /// An RDMA READ of `src` from the peer's loans into the destination
    /// posted in `own` as `wr_id`: copied at once, reported on `cq`.
    pub(super) fn read(
        &mut self,
        wr_id: u64,
        src: RemoteBuf,
        own: &Lending,
        cq: &CqInner,
        qp_num: u32,
    ) -> Result<(), WcStatus> {
        if self.peer_dead.load(Ordering::Acquire) {
            return Err(WcStatus::RetryExceeded);
        }
        let (buf, start) = self.peer_lending.find(src.addr, src.rkey, src.len)?;
        let mut dst = own
            .receive(wr_id, src.len)
            .ok_or(WcStatus::Other { vendor: 0 })?;
        let len = src.len as usize;
        dst[..len].copy_from_slice(&buf[start..start + len]);
        own.done(wr_id, dst);
        cq.push(Completion {
            wr_id,
            qp_num,
            kind: CompletionKind::Read,
            status: WcStatus::Success,
        });
        Ok(())
    }

    pub(super) fn established(&mut self) -> Result<(), FabricError> {
        if let Some((tx, reply)) = self.pending_reply.take() {
            tx.send(Ok(reply)).map_err(|_| {
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
    admission: Admission,
    rx: Receiver<Option<MemIncoming>>,
    tx: Sender<Option<MemIncoming>>,
}

impl MemListener {
    pub(super) fn bind(name: &str, admission: Admission) -> Result<MemListener, FabricError> {
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
            admission,
            rx,
            tx,
        })
    }

    /// The next client admitted: one the authenticator refuses is told
    /// why and skipped.
    pub(super) fn next(&self) -> Option<MemIncoming> {
        loop {
            let mut incoming = self.rx.recv().ok().flatten()?;
            match incoming.authenticate(&self.admission) {
                Ok(()) => return Some(incoming),
                Err((code, why)) => incoming.refuse(code, &why),
            }
        }
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
        max_streams: local.max_streams,
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
    let lending = Arc::new(Lending::default());
    let (reply_tx, reply_rx) = bounded(1);
    let incoming = MemIncoming {
        ctx: ctx.clone(),
        cq: cq.clone(),
        qp_num,
        ring: peer_ring(&local),
        binding: local.ring.binding(),
        dead: dead.clone(),
        lending: lending.clone(),
        credential: local.credential.clone(),
        identity: None,
        reply: reply_tx,
    };
    listener.send(Some(incoming)).map_err(|_| {
        FabricError::unreachable("connect", format!("mem://{name} stopped listening"))
    })?;
    let reply = reply_rx
        .recv_timeout(local.timeout)
        .map_err(|_| {
            FabricError::unreachable(
                "connect",
                format!("mem://{name} did not complete the handshake"),
            )
        })?
        .map_err(|(code, why)| crate::fabric::record::refused_by_server(code, &why))?;
    if local.credential.is_some() && !reply.authenticated {
        return Err(bootstrap::unauthenticated(bootstrap::UNPROVEN_SERVER));
    }
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            lending,
            cq: cq.clone(),
            dead,
            wire: Wire::Mem(MemWire {
                peer: reply.ctx,
                peer_cq: reply.cq,
                peer_qp_num: reply.qp_num,
                peer_ring: reply.binding,
                peer_dead: reply.dead,
                peer_lending: reply.lending,
                pending_reply: None,
            }),
        },
        peer: reply.ring,
        peer_addr: format!("mem://{name}#{}", reply.qp_num),
        identity: None,
        fabric: "mem",
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
    let lending = Arc::new(Lending::default());
    let reply = Reply {
        authenticated: incoming.identity.is_some(),
        ctx: ctx.clone(),
        cq: cq.clone(),
        qp_num,
        ring: peer_ring(&local),
        binding: local.ring.binding(),
        dead: dead.clone(),
        lending: lending.clone(),
    };
    Ok(Connected {
        qp: SoftQp {
            qp_num,
            lending,
            cq: cq.clone(),
            dead,
            wire: Wire::Mem(MemWire {
                peer: incoming.ctx,
                peer_cq: incoming.cq,
                peer_qp_num: incoming.qp_num,
                peer_ring: incoming.binding,
                peer_dead: incoming.dead,
                peer_lending: incoming.lending,
                pending_reply: Some((incoming.reply, reply)),
            }),
        },
        peer: incoming.ring,
        peer_addr: format!("mem-client#{}", incoming.qp_num),
        identity: incoming.identity,
        fabric: "mem",
    })
}

/// Connects a client's and a server's queue pair of this process directly,
/// as [`connect`] and [`accept`] do through a listener, for a harness that
/// drives both ends on one thread: returns (client, server).
#[cfg(feature = "testing")]
pub(super) fn pair(
    client: (&Arc<Ctx>, &Arc<CqInner>, LocalSetup<'_, SoftRegion>),
    server: (&Arc<Ctx>, &Arc<CqInner>, LocalSetup<'_, SoftRegion>),
) -> (Connected<SoftQp>, Connected<SoftQp>) {
    /// One end: what its queue pair is, and what the other end reaches.
    struct End {
        ctx: Arc<Ctx>,
        cq: Arc<CqInner>,
        qp_num: u32,
        ring: PeerRing,
        binding: Weak<RegionInner>,
        dead: Arc<AtomicBool>,
        lending: Arc<Lending>,
    }
    let end = |(ctx, cq, local): (&Arc<Ctx>, &Arc<CqInner>, LocalSetup<'_, SoftRegion>)| End {
        ctx: ctx.clone(),
        cq: cq.clone(),
        qp_num: next_qp_num(),
        ring: peer_ring(&local),
        binding: local.ring.binding(),
        dead: Arc::new(AtomicBool::new(false)),
        lending: Arc::new(Lending::default()),
    };
    let connected = |me: &End, peer: &End, peer_addr: String| Connected {
        qp: SoftQp {
            qp_num: me.qp_num,
            lending: me.lending.clone(),
            cq: me.cq.clone(),
            dead: me.dead.clone(),
            wire: Wire::Mem(MemWire {
                peer: peer.ctx.clone(),
                peer_cq: peer.cq.clone(),
                peer_qp_num: peer.qp_num,
                peer_ring: peer.binding.clone(),
                peer_dead: peer.dead.clone(),
                peer_lending: peer.lending.clone(),
                pending_reply: None,
            }),
        },
        peer: peer.ring,
        peer_addr,
        identity: None,
        fabric: "mem",
    };
    let (c, s) = (end(client), end(server));
    (
        connected(&c, &s, format!("mem://fuzz#{}", s.qp_num)),
        connected(&s, &c, format!("mem-client#{}", c.qp_num)),
    )
}
