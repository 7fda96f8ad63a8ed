//! Checks every fabric must pass: the verbs semantics the protocol relies
//! on. `soft` runs them on `mem://` and `tcp://`; `verbs` on a real device.

use super::*;
use std::thread;
use std::time::{Duration, Instant};

/// Receive ring size used by the checks.
pub(crate) const RING: usize = 1 << 16;

/// A server context, a client context, and one connection between them.
pub(crate) struct Pair<F: Fabric> {
    pub server: F,
    pub client: F,
    /// The completion queue of the server's queue pair.
    pub scq: F::Cq,
    /// The completion queue of the client's queue pair.
    pub ccq: F::Cq,
    pub sqp: F::Qp,
    pub cqp: F::Qp,
    pub s_ring: F::Region,
    pub c_ring: F::Region,
    /// The client's view of the server's ring.
    pub s_peer: PeerRing,
    /// The server's view of the client's ring.
    pub c_peer: PeerRing,
    pub staging: F::Region,
    pub listener: F::Listener,
    /// Completions polled while waiting for the other side's: server's, client's.
    stash: std::sync::Mutex<[std::collections::VecDeque<Completion>; 2]>,
    /// Whether waiting for one end's completion polls the other end's queue
    /// too (the default, which software fabrics need). A device acts by
    /// itself: a check that must leave a queue unpolled turns this off.
    pub poll_both: bool,
}

/// Which end of a [`Pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    Server,
    Client,
}

impl<F: Fabric> Pair<F> {
    /// The next completion of `end`'s queue, waiting up to 20 s. Both queues
    /// are polled meanwhile: a software fabric's receiving side acts (applies
    /// writes, acknowledges them) when its queue is polled, as a dispatcher
    /// always does, where a NIC acts by itself.
    pub(crate) fn next(&self, end: End) -> Completion {
        let deadline = Instant::now() + Duration::from_secs(20);
        let i = end as usize;
        let mut out = Vec::new();
        loop {
            {
                let mut stash = self.stash.lock().unwrap();
                if let Some(c) = stash[i].pop_front() {
                    return c;
                }
                for (j, cq) in [&self.scq, &self.ccq].into_iter().enumerate() {
                    if j != i && !self.poll_both {
                        continue;
                    }
                    out.clear();
                    cq.poll(&mut out, 64);
                    stash[j].extend(out.iter().copied());
                }
                if !stash[i].is_empty() {
                    continue;
                }
            }
            assert!(Instant::now() < deadline, "no completion");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The next completion of `end` that is not a successful send.
    pub(crate) fn next_not_send(&self, end: End) -> Completion {
        loop {
            let c = self.next(end);
            if !is_successful_send(&c) {
                return c;
            }
        }
    }
}

/// Connects `client` to `server` through `listener`, the client bringing
/// `c_ring`; returns the server's queue pair and ring, the client's queue
/// pair, the client's view of the server's ring and the server's view of
/// the client's.
pub(crate) fn connect<F: Fabric>(
    server: &F,
    scq: &F::Cq,
    listener: &F::Listener,
    client: &F,
    ccq: &F::Cq,
    c_ring: &F::Region,
) -> (F::Qp, F::Region, F::Qp, PeerRing, PeerRing) {
    let url = FabricUrl::parse(&listener.local_url()).unwrap();
    let s_ring = server.register(RING, true).unwrap();
    let (s, c) = thread::scope(|s| {
        let srv = s.spawn(|| {
            let inc = listener.next().unwrap().unwrap();
            let local = LocalSetup {
                ring: &s_ring,
                max_message: 1024,
                max_streams: 7,
                timeout: Duration::from_secs(10),
                credential: None,
                tls: None,
            };
            let mut c = server.accept(inc, local, scq).unwrap();
            c.qp.established().unwrap();
            c
        });
        let local = LocalSetup {
            ring: c_ring,
            max_message: 2048,
            max_streams: 0,
            timeout: Duration::from_secs(10),
            credential: None,
            tls: None,
        };
        let c = client.connect(&url, local, ccq).unwrap();
        (srv.join().unwrap(), c)
    });
    assert_eq!(s.peer.max_message, 2048, "server learns the client's limit");
    assert_eq!(c.peer.max_message, 1024, "client learns the server's limit");
    assert_eq!(
        c.peer.max_streams, 7,
        "client learns the server's stream limit"
    );
    assert_eq!(s.peer.max_streams, 0, "a client sets none");
    (s.qp, s_ring, c.qp, c.peer, s.peer)
}

/// A listening server context and one connected client context.
pub(crate) fn pair<F: Fabric>(server: F, client: F, url: &str) -> Pair<F> {
    let listener = server
        .listen(&FabricUrl::parse(url).unwrap(), Default::default())
        .unwrap();
    let c_ring = client.register(RING, true).unwrap();
    let staging = client.register(RING, false).unwrap();
    let scq = server.create_cq().unwrap();
    let ccq = client.create_cq().unwrap();
    let (sqp, s_ring, cqp, s_peer, c_peer) =
        connect(&server, &scq, &listener, &client, &ccq, &c_ring);
    Pair {
        server,
        client,
        scq,
        ccq,
        sqp,
        cqp,
        s_ring,
        c_ring,
        s_peer,
        c_peer,
        staging,
        listener,
        stash: Default::default(),
        poll_both: true,
    }
}

/// The next completion, waiting up to 20 s.
pub(crate) fn wait_one(f: &impl CompletionQueue) -> Completion {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while f.poll(&mut out, 1) == 0 {
        assert!(Instant::now() < deadline, "no completion");
        f.wait(Some(Duration::from_millis(50)));
    }
    out[0]
}

/// The next completion that is not a successful send (signaled writes may interleave).
/// Whether `c` is a send that completed: what the `next_not_send` waits skip.
fn is_successful_send(c: &Completion) -> bool {
    c.kind == CompletionKind::Send && c.status == WcStatus::Success
}

pub(crate) fn next_not_send(f: &impl CompletionQueue) -> Completion {
    loop {
        let c = wait_one(f);
        if !is_successful_send(&c) {
            return c;
        }
    }
}

pub(crate) fn write<'a, R>(
    staging: &'a R,
    peer: &PeerRing,
    off: usize,
    len: usize,
    rkey: u32,
    imm: u32,
) -> WriteImm<'a, R> {
    WriteImm {
        wr_id: 42,
        local: Some((staging, 0, len)),
        remote_addr: peer.addr + off as u64,
        rkey,
        imm,
        signaled: true,
    }
}

/// A write-with-imm lands in the registered ring; the receive completion
/// carries the immediate, the byte count and the receiving queue pair.
pub(crate) fn write_with_imm_lands<F: Fabric>(mut p: Pair<F>) {
    p.server.post_recv(2).unwrap();
    p.staging.write(0, 5, |b| b.copy_from_slice(b"hello"));
    p.cqp
        .post_write_imm(&write(
            &p.staging,
            &p.s_peer,
            128,
            5,
            p.s_peer.rkey,
            0xC0FFEE,
        ))
        .unwrap();
    let send = p.next(End::Client);
    assert_eq!(
        send,
        Completion {
            wr_id: 42,
            qp_num: p.cqp.qp_num(),
            kind: CompletionKind::Send,
            status: WcStatus::Success
        }
    );
    let recv = p.next(End::Server);
    assert_eq!(
        recv.kind,
        CompletionKind::RecvImm {
            imm: 0xC0FFEE,
            byte_len: 5
        }
    );
    assert_eq!(
        (recv.qp_num, recv.status),
        (p.sqp.qp_num(), WcStatus::Success)
    );
    assert_eq!(p.s_ring.read(128, 5, |b| b.to_vec()), b"hello");
    // A zero-length write carries only the immediate.
    let wr = WriteImm {
        wr_id: 7,
        local: None,
        remote_addr: p.s_peer.addr,
        rkey: p.s_peer.rkey,
        imm: 9,
        signaled: false,
    };
    p.cqp.post_write_imm(&wr).unwrap();
    assert_eq!(
        p.next(End::Server).kind,
        CompletionKind::RecvImm {
            imm: 9,
            byte_len: 0
        }
    );
    // And the other direction, from the server's own staging.
    p.client.post_recv(1).unwrap();
    let local = p.server.register(4096, false).unwrap();
    local.write(0, 16, |b| b.fill(0x5A));
    let wr = WriteImm {
        wr_id: 1,
        local: Some((&local, 0, 16)),
        remote_addr: p.c_peer.addr + 64,
        rkey: p.c_peer.rkey,
        imm: 3,
        signaled: false,
    };
    p.sqp.post_write_imm(&wr).unwrap();
    assert_eq!(
        p.next_not_send(End::Client).kind,
        CompletionKind::RecvImm {
            imm: 3,
            byte_len: 16
        }
    );
    assert_eq!(p.c_ring.read(64, 16, |b| b.to_vec()), vec![0x5A; 16]);
}

/// A write the receiver must refuse (wrong rkey, out of bounds) is an error
/// completion on the sender and touches nothing.
pub(crate) fn bad_write_is_rejected<F: Fabric>(mut p: Pair<F>, bad: fn(&PeerRing) -> (u64, u32)) {
    p.server.post_recv(1).unwrap();
    p.s_ring.write(0, RING, |b| b.fill(0xAA));
    p.staging.write(0, 64, |b| b.fill(0x55));
    let (addr, rkey) = bad(&p.s_peer);
    let wr = WriteImm {
        wr_id: 5,
        local: Some((&p.staging, 0, 64)),
        remote_addr: addr,
        rkey,
        imm: 1,
        signaled: true,
    };
    p.cqp.post_write_imm(&wr).unwrap();
    let c = p.next(End::Client);
    assert_eq!((c.wr_id, c.status), (5, WcStatus::RemoteAccess));
    assert!(
        p.s_ring.read(0, RING, |b| b.iter().all(|&x| x == 0xAA)),
        "nothing was touched"
    );
}

pub(crate) fn wrong_rkey(p: &PeerRing) -> (u64, u32) {
    (p.addr, p.rkey ^ 0x100)
}

pub(crate) fn past_the_end(p: &PeerRing) -> (u64, u32) {
    (p.addr + RING as u64 - 32, p.rkey)
}

pub(crate) fn below_the_start(p: &PeerRing) -> (u64, u32) {
    (p.addr - 64, p.rkey)
}

/// A second client's connection to a [`Pair`]'s server, kept alive while
/// its writes complete.
struct Second<F: Fabric> {
    /// The server's queue pair of this connection.
    sqp: F::Qp,
    /// The server's receive ring of this connection.
    _s_ring: F::Region,
    _cqp: F::Qp,
    _ring: F::Region,
    _staging: F::Region,
    _ccq: F::Cq,
}

/// Connects `client` to the pair's server, the server's queue pair on
/// `scq` (default: the pair's); posts two receives, then writes 8 bytes
/// with immediate 11 from the pair's client and with immediate 22 from the
/// new one.
fn second_client_writes<F: Fabric>(p: &mut Pair<F>, client: &F, scq: Option<&F::Cq>) -> Second<F> {
    let scq = scq.unwrap_or(&p.scq);
    let ring = client.register(RING, true).unwrap();
    let staging = client.register(RING, false).unwrap();
    let ccq = client.create_cq().unwrap();
    let (sqp, s_ring, mut cqp, peer, _) = connect(&p.server, scq, &p.listener, client, &ccq, &ring);
    p.server.post_recv(2).unwrap();
    p.staging.write(0, 8, |b| b.fill(1));
    staging.write(0, 8, |b| b.fill(2));
    p.cqp
        .post_write_imm(&write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 11))
        .unwrap();
    cqp.post_write_imm(&write(&staging, &peer, 0, 8, peer.rkey, 22))
        .unwrap();
    Second {
        sqp,
        _s_ring: s_ring,
        _cqp: cqp,
        _ring: ring,
        _staging: staging,
        _ccq: ccq,
    }
}

/// The (qp_num, imm) of a successful receive completion.
fn received(c: Completion) -> (u32, u32) {
    match c {
        Completion {
            qp_num,
            kind: CompletionKind::RecvImm { imm, .. },
            status: WcStatus::Success,
            ..
        } => (qp_num, imm),
        other => panic!("unexpected completion {other:?}"),
    }
}

/// Every queue pair of a context consumes receives from its one shared
/// receive queue: two connections are served by exactly two posted receives.
pub(crate) fn connections_share_one_srq<F: Fabric>(mut p: Pair<F>, second_client: F) {
    let second = second_client_writes(&mut p, &second_client, None);
    let mut got: Vec<(u32, u32)> = (0..2)
        .map(|_| received(p.next_not_send(End::Server)))
        .collect();
    got.sort();
    let mut want = vec![(p.sqp.qp_num(), 11), (second.sqp.qp_num(), 22)];
    want.sort();
    assert_eq!(got, want, "both queue pairs were served from the one SRQ");
}

/// Closing a queue pair is seen by the peer as an error completion.
pub(crate) fn close_is_seen_by_the_peer<F: Fabric>(p: Pair<F>) {
    let sqp_num = p.sqp.qp_num();
    drop(p.cqp);
    let c = next_not_send(&p.scq);
    assert_eq!((c.qp_num, c.status), (sqp_num, WcStatus::RetryExceeded));
}

/// Queue pairs of one context on different completion queues (one per
/// dispatcher) still share the context's one receive queue, and each
/// queue's completions reach only that queue.
pub(crate) fn completions_reach_only_their_queue<F: Fabric>(mut p: Pair<F>, second_client: F) {
    let scq2 = p.server.create_cq().unwrap();
    let second = second_client_writes(&mut p, &second_client, Some(&scq2));
    assert_eq!(received(p.next_not_send(End::Server)), (p.sqp.qp_num(), 11));
    assert_eq!(received(next_not_send(&scq2)), (second.sqp.qp_num(), 22));
    let mut out = Vec::new();
    thread::sleep(Duration::from_millis(20));
    p.scq.poll(&mut out, 8);
    scq2.poll(&mut out, 8);
    assert!(
        out.iter().all(|c| c.kind == CompletionKind::Send),
        "nothing else arrived on either queue: {out:?}"
    );
}

/// A connection's peer can write only into that connection's ring: a
/// second client given the first connection's ring address and rkey (as a
/// malicious client might learn or guess them) fails on its own queue pair
/// and touches nothing, and the first connection goes on.
pub(crate) fn a_peer_writes_only_its_own_ring<F: Fabric>(p: Pair<F>, attacker: F) {
    let ring = attacker.register(RING, true).unwrap();
    let staging = attacker.register(RING, false).unwrap();
    let accq = attacker.create_cq().unwrap();
    let (asqp, _s_ring, mut aqp, _own, _) =
        connect(&p.server, &p.scq, &p.listener, &attacker, &accq, &ring);
    p.server.post_recv(2).unwrap();
    p.s_ring.write(0, RING, |b| b.fill(0xAA));
    staging.write(0, 64, |b| b.fill(0x66));
    // The victim's ring, as the victim's client sees it.
    let wr = write(&staging, &p.s_peer, 0, 64, p.s_peer.rkey, 7);
    aqp.post_write_imm(&wr).unwrap();
    let c = if p.poll_both {
        // A software receiver acts when its queue is polled.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut out = Vec::new();
        loop {
            out.clear();
            p.scq.poll(&mut out, 16);
            // The attacker's connection may fail on the server too (its
            // queue pair goes to the error state), never the victim's.
            if let Some(c) = out.iter().find(|c| c.qp_num != asqp.qp_num()) {
                panic!("the victim's connection saw the attacker's write: {c:?}");
            }
            out.clear();
            if accq.poll(&mut out, 1) > 0 {
                break out[0];
            }
            assert!(Instant::now() < deadline, "no completion for the attacker");
            std::thread::sleep(Duration::from_micros(200));
        }
    } else {
        wait_one(&accq)
    };
    assert_eq!(
        (c.wr_id, c.status),
        (42, WcStatus::RemoteAccess),
        "the write into another connection's ring failed on the attacker's own queue pair"
    );
    assert!(
        p.s_ring.read(0, RING, |b| b.iter().all(|&x| x == 0xAA)),
        "the victim's ring is untouched"
    );
    // The victim's own writes still land.
    let mut p = p;
    p.staging.write(0, 8, |b| b.fill(3));
    p.cqp
        .post_write_imm(&write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 33))
        .unwrap();
    // The attacker's queue pair may report its failure on the server first.
    let got = loop {
        let c = p.next_not_send(End::Server);
        if c.qp_num != asqp.qp_num() {
            break received(c);
        }
    };
    assert_eq!(got, (p.sqp.qp_num(), 33));
    assert_eq!(p.s_ring.read(0, 8, |b| b.to_vec()), vec![3; 8]);
}
