//! The soft fabric keeps verbs semantics, over `mem://` and `tcp://` alike:
//! the shared conformance checks, plus what is particular to software.

use super::*;
use crate::fabric::Listener;
use crate::fabric::conformance::{self as c, RING, pair};
use std::io::Write;
use std::thread;

fn soft_pair(url: &str, rnr: Duration) -> c::Pair<SoftFabric> {
    pair(
        SoftFabric::with_rnr_timeout(rnr),
        SoftFabric::with_rnr_timeout(rnr),
        url,
    )
}

fn check_empty_srq_is_rnr(url: &str) {
    let mut p = soft_pair(url, Duration::from_millis(100));
    p.staging.write(0, 8, |b| b.fill(1));
    let t = Instant::now();
    p.cqp
        .post_write_imm(&c::write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 1))
        .unwrap();
    assert_eq!(p.next(c::End::Client).status, WcStatus::RnrRetryExceeded);
    assert!(t.elapsed() >= Duration::from_millis(100));
}

fn check_rnr_waits_for_a_receive(url: &str) {
    let mut p = soft_pair(url, Duration::from_secs(5));
    p.staging.write(0, 8, |b| b.fill(1));
    let server = p.server.clone();
    let poster = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        server.post_recv(1).unwrap();
    });
    p.cqp
        .post_write_imm(&c::write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, 1))
        .unwrap();
    assert_eq!(p.next_not_send(c::End::Server).status, WcStatus::Success);
    poster.join().unwrap();
}

fn check_rejected_write_consumes_no_receive_and_kills_the_qp(url: &str) {
    let mut p = soft_pair(url, DEFAULT_RNR_TIMEOUT);
    let (addr, rkey) = c::wrong_rkey(&p.s_peer);
    p.server.post_recv(1).unwrap();
    let wr = WriteImm {
        wr_id: 5,
        local: Some((&p.staging, 0, 64)),
        remote_addr: addr,
        rkey,
        imm: 1,
        signaled: true,
    };
    p.cqp.post_write_imm(&wr).unwrap();
    assert_eq!(p.next(c::End::Client).status, WcStatus::RemoteAccess);
    assert_eq!(p.server.srq_posted(), 1, "no receive consumed");
    assert!(
        p.cqp.post_write_imm(&wr).is_err(),
        "the queue pair is in the error state"
    );
}

macro_rules! on_both {
    ($($name:ident => $body:expr;)*) => {
        mod mem_fabric { use super::*; $(#[test] fn $name() { let f: fn(&str) = $body; f(&format!("mem://soft-{}", stringify!($name))) })* }
        mod tcp_fabric { use super::*; $(#[test] fn $name() { let f: fn(&str) = $body; f("tcp://127.0.0.1:0") })* }
    };
}

on_both! {
    write_with_imm_lands_with_imm_and_qp_num => |u| c::write_with_imm_lands(soft_pair(u, DEFAULT_RNR_TIMEOUT));
    wrong_rkey_is_rejected_and_touches_nothing => |u| c::bad_write_is_rejected(soft_pair(u, DEFAULT_RNR_TIMEOUT), c::wrong_rkey);
    out_of_bounds_write_is_rejected_and_touches_nothing => |u| c::bad_write_is_rejected(soft_pair(u, DEFAULT_RNR_TIMEOUT), c::past_the_end);
    write_below_the_region_is_rejected => |u| c::bad_write_is_rejected(soft_pair(u, DEFAULT_RNR_TIMEOUT), c::below_the_start);
    connections_share_one_srq => |u| c::connections_share_one_srq(soft_pair(u, DEFAULT_RNR_TIMEOUT), SoftFabric::new());
    completions_reach_only_their_queue => |u| c::completions_reach_only_their_queue(soft_pair(u, DEFAULT_RNR_TIMEOUT), SoftFabric::new());
    closing_a_queue_pair_is_seen_by_the_peer => |u| c::close_is_seen_by_the_peer(soft_pair(u, DEFAULT_RNR_TIMEOUT));
    a_peer_writes_only_its_own_ring => |u| c::a_peer_writes_only_its_own_ring(soft_pair(u, DEFAULT_RNR_TIMEOUT), SoftFabric::new());
    rejected_write_consumes_no_receive_and_kills_the_qp => check_rejected_write_consumes_no_receive_and_kills_the_qp;
    empty_srq_behaves_like_rnr => check_empty_srq_is_rnr;
    rnr_waits_for_a_posted_receive => check_rnr_waits_for_a_receive;
}

#[test]
fn a_mem_name_is_exclusive_and_freed_on_close() {
    let f = SoftFabric::new();
    let url = FabricUrl::parse("mem://soft-exclusive").unwrap();
    let l = f.listen(&url, Default::default()).unwrap();
    assert!(
        f.listen(&url, Default::default())
            .unwrap_err()
            .to_string()
            .contains("in use")
    );
    l.close();
    assert!(l.next().unwrap().is_none());
    drop(l);
    f.listen(&url, Default::default()).unwrap();
}

#[test]
fn connecting_to_nothing_fails_clearly() {
    let f = SoftFabric::new();
    let ring = f.register(RING, true).unwrap();
    let local = || LocalSetup {
        ring: &ring,
        max_message: 1024,
        max_streams: 0,
        timeout: Duration::from_secs(2),
        credential: None,
        tls: None,
    };
    let cq = f.create_cq().unwrap();
    let e = f
        .connect(
            &FabricUrl::parse("mem://nobody-here").unwrap(),
            local(),
            &cq,
        )
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
            &cq,
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
        max_streams: 0,
        timeout: Duration::from_secs(2),
        credential: None,
        tls: None,
    };
    let cq = f.create_cq().unwrap();
    let e = f
        .connect(
            &FabricUrl::parse(&format!("tcp://127.0.0.1:{port}")).unwrap(),
            local,
            &cq,
        )
        .unwrap_err();
    assert!(e.to_string().contains("not an rdma-rpc endpoint"), "{e}");
    junk.join().unwrap();
}

#[test]
fn a_peer_that_stops_reading_is_not_silent() {
    // Its kernel acknowledges what fits in its buffers, then advertises a
    // zero window and acknowledges the probes: nothing stays in flight
    // unacknowledged, however long it does not read.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (_peer, _) = l.accept().unwrap();
    assert_eq!(tcp::unacknowledged_for(&ours), None, "nothing sent yet");
    ours.set_nonblocking(true).unwrap();
    let chunk = vec![7u8; 1 << 16];
    let mut sent = 0usize;
    while let Ok(n) = ours.write(&chunk) {
        sent += n;
    }
    assert!(sent > 0);
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(1500) {
        thread::sleep(Duration::from_millis(100));
        if let Some(silent) = tcp::unacknowledged_for(&ours) {
            // Segments just sent may wait for their ack for a moment.
            assert!(
                silent < Duration::from_millis(500),
                "a live peer taken for silent for {silent:?}"
            );
        }
    }
}

/// The tcp:// wire of a soft queue pair.
fn tcp_wire(qp: &SoftQp) -> &tcp::TcpWire {
    match &qp.wire {
        Wire::Tcp(w) => w,
        Wire::Mem(_) => panic!("a tcp:// queue pair"),
    }
}

#[test]
fn heartbeats_of_a_second_or_more_are_tcp_keepalive() {
    let mut m = soft_pair("mem://soft-probe", DEFAULT_RNR_TIMEOUT);
    assert_eq!(
        m.cqp.probe_every(Duration::from_secs(1)).unwrap(),
        Probe::Doorbell,
        "mem:// peers share a process: doorbells"
    );
    let mut p = soft_pair("tcp://127.0.0.1:0", DEFAULT_RNR_TIMEOUT);
    assert_eq!(
        p.cqp.probe_every(Duration::from_millis(500)).unwrap(),
        Probe::Doorbell,
        "below a second: doorbells (keepalive counts whole seconds)"
    );
    assert_eq!(
        p.cqp.probe_every(Duration::from_millis(2500)).unwrap(),
        Probe::Transport
    );
    let sock = socket2::SockRef::from(tcp_wire(&p.cqp).stream());
    assert!(sock.keepalive().unwrap());
    assert_eq!(sock.tcp_keepalive_time().unwrap(), Duration::from_secs(2));
    assert_eq!(
        sock.tcp_keepalive_interval().unwrap(),
        Duration::from_secs(2)
    );
    assert_eq!(
        sock.tcp_keepalive_retries().unwrap(),
        tcp::KEEPALIVE_PROBES_FOR_HEARTBEAT
    );
    assert_eq!(sock.tcp_user_timeout().unwrap(), None);
}

#[test]
fn a_quiet_tcp_connection_is_looked_at_again_only_after_a_send() {
    let mut p = soft_pair("tcp://127.0.0.1:0", DEFAULT_RNR_TIMEOUT);
    let settles = |p: &c::Pair<SoftFabric>| {
        let w = tcp_wire(&p.cqp);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            assert_eq!(w.unacknowledged_for(), None, "a live peer");
            if w.settled() {
                return true;
            }
            thread::sleep(Duration::from_millis(10));
        }
        false
    };
    let sent = |p: &mut c::Pair<SoftFabric>, wr_id| {
        p.server.post_recv(1).unwrap();
        p.staging.write(0, 8, |b| b.fill(1));
        p.cqp
            .post_write_imm(&c::write(&p.staging, &p.s_peer, 0, 8, p.s_peer.rkey, wr_id))
            .unwrap();
        assert_eq!(p.next_not_send(c::End::Server).status, WcStatus::Success);
    };
    sent(&mut p, 1);
    assert!(settles(&p), "acknowledged, and nothing sent since");
    // A send makes the next look ask the kernel again.
    tcp_wire(&p.cqp).unacknowledged_for();
    assert!(tcp_wire(&p.cqp).settled());
    sent(&mut p, 2);
    assert!(tcp_wire(&p.cqp).settled(), "not looked at yet");
    tcp_wire(&p.cqp).unacknowledged_for();
    assert!(settles(&p));
}

/// A poller that sleeps whenever its queue looks empty is woken by every
/// push: no entry is left behind while it sleeps (a lost wake-up would
/// hang this test, so it fails after a generous deadline instead). As on
/// a dispatcher, a second poller (a caller) takes entries meanwhile,
/// under the lock that keeps pollers in turn, while the first sleeps
/// without it.
#[test]
fn a_sleeping_poller_misses_no_push() {
    const PRODUCERS: u64 = 3;
    const EACH: u64 = 20_000;
    const ALL: u64 = PRODUCERS * EACH;
    let cq = SoftCq::new();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|t| {
            let inner = cq.inner.clone();
            thread::spawn(move || {
                for i in 0..EACH {
                    inner.push(Completion {
                        wr_id: i,
                        qp_num: t as u32,
                        kind: CompletionKind::Send,
                        status: WcStatus::Success,
                    });
                    // Pauses of varying length, so that the poller often
                    // goes to sleep just before or just after a push.
                    if i % 7 == 0 {
                        thread::yield_now();
                    }
                    if i % 1000 == 999 {
                        thread::sleep(Duration::from_micros(50));
                    }
                }
            })
        })
        .collect();
    // What the pollers have taken: the next entry due from each producer.
    let taken = Arc::new(Mutex::new((0u64, [0u64; PRODUCERS as usize])));
    let turn = |cq: &SoftCq, taken: &Mutex<(u64, [u64; PRODUCERS as usize])>, max| {
        let mut out = Vec::new();
        let mut taken = taken.lock().unwrap();
        let n = cq.poll(&mut out, max);
        for c in &out {
            assert_eq!(c.wr_id, taken.1[c.qp_num as usize], "out of order");
            taken.1[c.qp_num as usize] += 1;
        }
        taken.0 += n as u64;
        (n, taken.0)
    };
    // The caller: takes one entry at a time for the first half, then stops.
    let caller = {
        let (cq, taken) = (cq.clone(), taken.clone());
        thread::spawn(move || {
            while turn(&cq, &taken, 1).1 < ALL / 2 {
                thread::yield_now();
            }
        })
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let poller = cq.clone();
    let taken2 = taken.clone();
    thread::spawn(move || {
        loop {
            let (n, total) = turn(&poller, &taken2, 32);
            if total == ALL {
                break;
            }
            if n == 0 {
                poller.wait(None);
            }
        }
        done_tx.send(()).unwrap();
    });
    for p in producers {
        p.join().unwrap();
    }
    caller.join().unwrap();
    assert!(
        done_rx.recv_timeout(Duration::from_secs(60)).is_ok(),
        "the poller slept through a push: {} of {ALL} taken",
        taken.lock().unwrap().0
    );
}
