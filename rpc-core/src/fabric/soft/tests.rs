//! The soft fabric keeps verbs semantics, over `mem://` and `tcp://` alike.

use super::*;
use crate::fabric::{Listener, PeerRing};
use std::io::Write;
use std::thread;

const RING: usize = 1 << 16;

struct Pair {
    server: SoftFabric,
    client: SoftFabric,
    sqp: SoftQp,
    cqp: SoftQp,
    s_ring: SoftRegion,
    c_ring: SoftRegion,
    /// The client's view of the server's ring.
    s_peer: PeerRing,
    staging: SoftRegion,
}

fn pair(url: &str, rnr: Duration) -> Pair {
    let server = SoftFabric::with_rnr_timeout(rnr);
    let client = SoftFabric::with_rnr_timeout(rnr);
    let url = FabricUrl::parse(url).unwrap();
    let listener = server.listen(&url).unwrap();
    let url = FabricUrl::parse(&listener.local_url()).unwrap();
    let s_ring = server.register(RING, true).unwrap();
    let c_ring = client.register(RING, true).unwrap();
    let staging = client.register(RING, false).unwrap();
    let (sqp, c) = thread::scope(|s| {
        let srv = s.spawn(|| {
            let inc = listener.next().unwrap().unwrap();
            let local = LocalSetup {
                ring: &s_ring,
                max_message: 1024,
                timeout: Duration::from_secs(5),
            };
            let mut c = server.accept(inc, local).unwrap();
            c.qp.established().unwrap();
            c
        });
        let local = LocalSetup {
            ring: &c_ring,
            max_message: 2048,
            timeout: Duration::from_secs(5),
        };
        let c = client.connect(&url, local).unwrap();
        (srv.join().unwrap(), c)
    });
    assert_eq!(
        sqp.peer.max_message, 2048,
        "server learns the client's limit"
    );
    assert_eq!(c.peer.max_message, 1024, "client learns the server's limit");
    Pair {
        server,
        client,
        sqp: sqp.qp,
        cqp: c.qp,
        s_ring,
        c_ring,
        s_peer: c.peer,
        staging,
    }
}

fn wait_one(f: &SoftFabric) -> Completion {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.poll(&mut out, 1) == 0 {
        assert!(Instant::now() < deadline, "no completion");
        f.wait(Some(Duration::from_millis(50)));
    }
    out[0]
}

fn write<'a>(
    staging: &'a SoftRegion,
    peer: &PeerRing,
    off: usize,
    len: usize,
    rkey: u32,
    imm: u32,
) -> WriteImm<'a, SoftRegion> {
    WriteImm {
        wr_id: 42,
        local: Some((staging, 0, len)),
        remote_addr: peer.addr + off as u64,
        rkey,
        imm,
        signaled: true,
    }
}

fn check_write_with_imm_lands(url: &str) {
    let mut p = pair(url, DEFAULT_RNR_TIMEOUT);
    p.server.post_recv(2).unwrap();
    p.staging.write(0, 5, |b| b.copy_from_slice(b"hello"));
    let wr = write(&p.staging, &p.s_peer, 128, 5, p.s_peer.rkey, 0xC0FFEE);
    p.cqp.post_write_imm(&wr).unwrap();
    let send = wait_one(&p.client);
    assert_eq!(
        send,
        Completion {
            wr_id: 42,
            qp_num: p.cqp.qp_num(),
            kind: CompletionKind::Send,
            status: WcStatus::Success
        }
    );
    let recv = wait_one(&p.server);
    assert_eq!(
        recv.kind,
        CompletionKind::RecvImm {
            imm: 0xC0FFEE,
            byte_len: 5
        }
    );
    assert_eq!(recv.qp_num, p.sqp.qp_num());
    assert_eq!(recv.status, WcStatus::Success);
    assert_eq!(p.s_ring.read(128, 5, |b| b.to_vec()), b"hello");
    assert_eq!(p.server.srq_posted(), 1, "one SRQ receive consumed");
    // A zero-length write carries only the immediate.
    let wr = WriteImm {
        wr_id: 7,
        local: None,
        remote_addr: 0,
        rkey: 0,
        imm: 9,
        signaled: false,
    };
    p.cqp.post_write_imm(&wr).unwrap();
    assert_eq!(
        wait_one(&p.server).kind,
        CompletionKind::RecvImm {
            imm: 9,
            byte_len: 0
        }
    );
    // And the other direction works too.
    p.client.post_recv(1).unwrap();
    let local = p.server.register(16, false).unwrap();
    let wr = WriteImm {
        wr_id: 1,
        local: Some((&local, 0, 16)),
        remote_addr: p.c_ring.addr(),
        rkey: p.c_ring.rkey(),
        imm: 3,
        signaled: false,
    };
    p.sqp.post_write_imm(&wr).unwrap();
    assert_eq!(
        wait_one(&p.client).kind,
        CompletionKind::RecvImm {
            imm: 3,
            byte_len: 16
        }
    );
}

fn check_bad_writes_are_rejected(url: &str, bad: fn(&Pair) -> (u64, u32)) {
    let mut p = pair(url, DEFAULT_RNR_TIMEOUT);
    p.server.post_recv(1).unwrap();
    p.s_ring.write(0, RING, |b| b.fill(0xAA));
    p.staging.write(0, 64, |b| b.fill(0x55));
    let (addr, rkey) = bad(&p);
    let wr = WriteImm {
        wr_id: 5,
        local: Some((&p.staging, 0, 64)),
        remote_addr: addr,
        rkey,
        imm: 1,
        signaled: true,
    };
    p.cqp.post_write_imm(&wr).unwrap();
    let c = wait_one(&p.client);
    assert_eq!((c.wr_id, c.status), (5, WcStatus::RemoteAccess));
    assert!(
        p.s_ring.read(0, RING, |b| b.iter().all(|&x| x == 0xAA)),
        "nothing was touched"
    );
    assert_eq!(p.server.srq_posted(), 1, "no receive consumed");
    // The queue pair is now in the error state.
    assert!(p.cqp.post_write_imm(&wr).is_err());
}

fn check_empty_srq_is_rnr(url: &str) {
    let mut p = pair(url, Duration::from_millis(100));
    p.staging.write(0, 8, |b| b.fill(1));
    let wr = write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 1);
    let t = Instant::now();
    p.cqp.post_write_imm(&wr).unwrap();
    let c = wait_one(&p.client);
    assert_eq!(c.status, WcStatus::RnrRetryExceeded);
    assert!(t.elapsed() >= Duration::from_millis(100));
}

fn check_rnr_waits_for_a_receive(url: &str) {
    let mut p = pair(url, Duration::from_secs(5));
    p.staging.write(0, 8, |b| b.fill(1));
    let server = p.server.clone();
    let poster = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        server.post_recv(1).unwrap();
    });
    let wr = write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 1);
    p.cqp.post_write_imm(&wr).unwrap();
    assert_eq!(wait_one(&p.server).status, WcStatus::Success);
    poster.join().unwrap();
}

fn check_closing_is_seen_by_the_peer(url: &str) {
    let p = pair(url, DEFAULT_RNR_TIMEOUT);
    let sqp_num = p.sqp.qp_num();
    drop(p.cqp);
    let c = wait_one(&p.server);
    assert_eq!((c.qp_num, c.status), (sqp_num, WcStatus::RetryExceeded));
    let _ = (&p.client, &p.c_ring);
}

macro_rules! on_both {
    ($($name:ident => $body:expr;)*) => {
        mod mem_fabric { use super::*; $(#[test] fn $name() { let f: fn(&str) = $body; f(&format!("mem://soft-{}", stringify!($name))) })* }
        mod tcp_fabric { use super::*; $(#[test] fn $name() { let f: fn(&str) = $body; f("tcp://127.0.0.1:0") })* }
    };
}

on_both! {
    write_with_imm_lands_with_imm_and_qp_num => check_write_with_imm_lands;
    wrong_rkey_is_rejected_and_touches_nothing => |u| check_bad_writes_are_rejected(u, |p| (p.s_peer.addr, p.s_peer.rkey ^ 0x100));
    out_of_bounds_write_is_rejected_and_touches_nothing => |u| check_bad_writes_are_rejected(u, |p| (p.s_peer.addr + RING as u64 - 32, p.s_peer.rkey));
    write_below_the_region_is_rejected => |u| check_bad_writes_are_rejected(u, |p| (p.s_peer.addr - 64, p.s_peer.rkey));
    empty_srq_behaves_like_rnr => check_empty_srq_is_rnr;
    rnr_waits_for_a_posted_receive => check_rnr_waits_for_a_receive;
    closing_a_queue_pair_is_seen_by_the_peer => check_closing_is_seen_by_the_peer;
}

#[test]
fn a_mem_name_is_exclusive_and_freed_on_close() {
    let f = SoftFabric::new();
    let url = FabricUrl::parse("mem://soft-exclusive").unwrap();
    let l = f.listen(&url).unwrap();
    assert!(f.listen(&url).unwrap_err().to_string().contains("in use"));
    l.close();
    assert!(l.next().unwrap().is_none());
    drop(l);
    f.listen(&url).unwrap();
}

#[test]
fn connecting_to_nothing_fails_clearly() {
    let f = SoftFabric::new();
    let ring = f.register(RING, true).unwrap();
    let local = || LocalSetup {
        ring: &ring,
        max_message: 1024,
        timeout: Duration::from_secs(2),
    };
    let e = f
        .connect(&FabricUrl::parse("mem://nobody-here").unwrap(), local())
        .unwrap_err();
    assert!(e.to_string().contains("no server listens"), "{e}");
    // A port nothing listens on (bind one, drop it).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = f
        .connect(
            &FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap(),
            local(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("127.0.0.1"), "{e}");
}

#[test]
fn a_peer_that_is_not_rdma_rpc_fails_the_handshake() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let junk = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(&[0x42; 64]);
        thread::sleep(Duration::from_millis(200));
    });
    let f = SoftFabric::new();
    let ring = f.register(RING, true).unwrap();
    let local = LocalSetup {
        ring: &ring,
        max_message: 1024,
        timeout: Duration::from_secs(2),
    };
    let e = f
        .connect(
            &FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap(),
            local,
        )
        .unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
    junk.join().unwrap();
}
