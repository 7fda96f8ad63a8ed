//! The verbs fabric on a real device: the same conformance checks as the
//! soft fabric, plus what only a device can show. These need an RDMA device,
//! so they are ignored by a plain `cargo test`; `scripts/test` runs them
//! (`--ignored rdma_`) inside the Soft-RoCE guest, where they must pass.

use super::*;
use crate::fabric::conformance::{self as c};

/// `rdma://<RXE_IP or 127.0.0.1>:0`, or `RPC_TEST_RDMA_URL`.
fn url() -> String {
    std::env::var("RPC_TEST_RDMA_URL").unwrap_or_else(|_| {
        format!(
            "rdma://{}:0",
            std::env::var("RXE_IP").unwrap_or_else(|_| "127.0.0.1".into())
        )
    })
}

fn open() -> VerbsFabric {
    VerbsFabric::open(&FabricUrl::parse(&url()).unwrap()).expect("an RDMA device")
}

fn verbs_pair() -> c::Pair<VerbsFabric> {
    c::pair(open(), open(), &url())
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_write_with_imm_lands_in_the_registered_ring() {
    c::write_with_imm_lands(verbs_pair());
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_wrong_rkey_is_rejected_by_the_device() {
    c::bad_write_is_rejected(verbs_pair(), c::wrong_rkey);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_out_of_bounds_write_is_rejected_by_the_device() {
    c::bad_write_is_rejected(verbs_pair(), c::past_the_end);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_write_below_the_region_is_rejected_by_the_device() {
    c::bad_write_is_rejected(verbs_pair(), c::below_the_start);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_connections_share_one_srq() {
    c::connections_share_one_srq(verbs_pair(), open());
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_completions_reach_only_their_queue() {
    c::completions_reach_only_their_queue(verbs_pair(), open());
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_closing_a_queue_pair_is_seen_by_the_peer() {
    c::close_is_seen_by_the_peer(verbs_pair());
}

/// Soft-RoCE has type-2 memory windows: a client given another
/// connection's ring address and rkey fails on its own queue pair, and the
/// victim's ring and traffic are untouched.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_a_peer_writes_only_its_own_ring() {
    let p = verbs_pair();
    assert!(
        p.server.isolates_connections() && p.client.isolates_connections(),
        "Soft-RoCE has type-2 memory windows: connections must be isolated"
    );
    c::a_peer_writes_only_its_own_ring(p, open());
}

/// The ring's registration grants no remote access of its own: its
/// region's rkey is refused even from the connection's own queue pair;
/// only the window's works.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_a_ring_is_not_writable_through_its_region_rkey() {
    let mut p = verbs_pair();
    assert_ne!(
        p.s_peer.rkey,
        p.s_ring.rkey(),
        "the peer got the window's rkey"
    );
    p.s_peer.rkey = p.s_ring.rkey();
    c::bad_write_is_rejected(p, |ring| (ring.addr, ring.rkey));
}

/// Where a device has no type-2 windows: the weaker mode, rings registered
/// for remote write, still carries traffic (and says it is not isolated).
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_without_memory_windows_the_weaker_mode_works() {
    let plain = || VerbsFabric::open_with(&FabricUrl::parse(&url()).unwrap(), SRQ_MAX, false);
    let p = c::pair(plain().unwrap(), plain().unwrap(), &url());
    assert!(!p.server.isolates_connections());
    assert_eq!(p.s_peer.rkey, p.s_ring.rkey(), "the region's own rkey");
    c::write_with_imm_lands(p);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_queue_pairs_are_created_on_the_context_srq_and_cqs() {
    let p = verbs_pair();
    let inner = &p.server.inner;
    // SAFETY: reading plain fields of a live QP.
    let (srq, scq, rcq) = unsafe {
        let qp = p.sqp.qp.qp.ptr.as_ptr();
        ((*qp).srq, (*qp).send_cq, (*qp).recv_cq)
    };
    assert_eq!(
        srq,
        inner.srq.ptr.as_ptr(),
        "the QP receives through the context's SRQ"
    );
    assert_eq!(
        scq,
        p.scq.inner.send_cq.ptr.as_ptr(),
        "on its dispatcher's CQs"
    );
    assert_eq!(rcq, p.scq.inner.recv_cq.ptr.as_ptr());
}

/// Posts `count` zero-length writes from the client to the server's ring,
/// immediates `first..`, and waits until the device acknowledged all of them.
fn zero_length_writes(p: &mut c::Pair<VerbsFabric>, first: u32, count: u32) {
    let mut posted = 0;
    while posted < count {
        let chunk = (count - posted).min(SQ_DEPTH / 2);
        for k in posted..posted + chunk {
            let wr = WriteImm {
                wr_id: u64::from(first + k),
                local: None,
                remote_addr: p.s_peer.addr,
                rkey: p.s_peer.rkey,
                imm: first + k,
                signaled: true,
            };
            p.cqp.post_write_imm(&wr).unwrap();
        }
        for _ in 0..chunk {
            let c = p.next(c::End::Client);
            assert_eq!(
                (c.kind, c.status),
                (CompletionKind::Send, WcStatus::Success)
            );
        }
        posted += chunk;
    }
}

/// Handles async events until `done` holds, for up to 20 s.
fn drain_async_until(f: &VerbsFabric, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "no SRQ limit event");
        f.drain_async();
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Receives consumed without their completions ever being polled (as when a
/// queue pair is destroyed with completions pending and mlx5 removes them
/// from the CQ) are not reposted per completion; the SRQ limit event tops
/// the SRQ up to capacity instead, and is re-armed for the next time.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_srq_limit_event_tops_the_srq_up() {
    let server = VerbsFabric::open_with(&FabricUrl::parse(&url()).unwrap(), 256, true).unwrap();
    let mut p = c::pair(server, open(), &url());
    // Waiting for the client's send completions must not poll (and so
    // repost) the server's receive completions.
    p.poll_both = false;
    let s = p.server.inner.clone();
    let cap = s.srq.capacity;
    let (max_wr, armed) = s.srq.query().unwrap();
    assert_eq!(max_wr, cap);
    assert_eq!(armed, cap / SRQ_LIMIT_FRACTION, "the limit is armed");
    assert_eq!(s.srq.fill().unwrap(), 0, "the SRQ was filled to capacity");
    let limit = cap / SRQ_LIMIT_FRACTION;
    // Below the limit, without running dry (no RNR needed).
    let n = cap - limit + 8;
    assert!(
        cap - n < limit && n < cap,
        "capacity {cap}: {n} writes cross the limit"
    );
    let events = || s.srq_limit_events.load(Ordering::Acquire);
    let topped = || s.srq_topped_up.load(Ordering::Acquire);
    assert_eq!((events(), topped()), (0, 0));

    // Nothing polled on the server: only the limit event can repost. The
    // event is handled here or by the liveness watcher's thread, maybe
    // while the last writes still arrive: the top-up replaced the receives
    // consumed by then, at least those that crossed the limit, and a fill
    // now finds exactly the rest missing.
    let crossed = u64::from(cap - limit + 1)..=u64::from(n);
    zero_length_writes(&mut p, 0, n);
    drain_async_until(&p.server, || events() >= 1);
    assert_eq!(events(), 1);
    let first = topped();
    assert!(
        crossed.contains(&first),
        "topped up {first}, not in {crossed:?}"
    );
    assert_eq!(
        first + u64::from(s.srq.fill().unwrap()),
        u64::from(n),
        "topped up the receives consumed, no more"
    );

    // The completions are still there; polling them reposts per completion,
    // which finds the SRQ full: no error, nothing owed.
    for k in 0..n {
        let c = p.next(c::End::Server);
        assert_eq!(
            (c.qp_num, c.kind, c.status),
            (
                p.sqp.qp_num(),
                CompletionKind::RecvImm {
                    imm: k,
                    byte_len: 0
                },
                WcStatus::Success
            )
        );
    }
    assert_eq!(s.srq_deficit.load(Ordering::Acquire), 0);

    // Re-armed: the next drain below the limit raises it again.
    zero_length_writes(&mut p, n, n);
    drain_async_until(&p.server, || events() >= 2);
    assert_eq!(events(), 2);
    let second = topped() - first;
    assert!(
        crossed.contains(&second),
        "topped up {second}, not in {crossed:?}"
    );
    assert_eq!(second + u64::from(s.srq.fill().unwrap()), u64::from(n));
    for k in n..2 * n {
        let c = p.next(c::End::Server);
        assert_eq!(
            c.kind,
            CompletionKind::RecvImm {
                imm: k,
                byte_len: 0
            }
        );
    }
}

/// A fatal async event (device, CQ or SRQ error) fails every connection of
/// the context, and the context makes no new queue pairs.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_fatal_event_fails_every_connection() {
    let p = verbs_pair();
    let client2 = open();
    let ring2 = client2.register(c::RING, true).unwrap();
    let ccq2 = client2.create_cq().unwrap();
    // On another of the server's completion queues: a fatal event reaches all.
    let scq2 = p.server.create_cq().unwrap();
    let (sqp2, _s_ring2, _cqp2, _peer2, _) =
        c::connect(&p.server, &scq2, &p.listener, &client2, &ccq2, &ring2);
    let failed = p
        .server
        .fail_all("test: device fatal".into(), ffi::IBV_EVENT_DEVICE_FATAL);
    assert_eq!(failed, 2);
    let event = ffi::IBV_EVENT_DEVICE_FATAL;
    let mut got: Vec<(u32, WcStatus)> = [&p.scq, &scq2]
        .into_iter()
        .map(|cq| {
            let c = c::next_not_send(cq);
            (c.qp_num, c.status)
        })
        .collect();
    got.sort_unstable_by_key(|g| g.0);
    let mut want = vec![
        (p.sqp.qp_num(), WcStatus::DeviceError { event }),
        (sqp2.qp_num(), WcStatus::DeviceError { event }),
    ];
    want.sort_unstable_by_key(|w| w.0);
    assert_eq!(got, want);
    let err = p
        .server
        .new_qp(&p.scq)
        .err()
        .expect("no queue pair after a fatal error");
    assert!(err.to_string().contains("device fatal"), "{err}");
}

/// End to end: a queue pair's error event fails the pending call of its
/// channel with `Unavailable`, and the channel stays failed. (The event's
/// effect is injected: Soft-RoCE cannot raise it on demand. A fatal event
/// for the whole context is checked on a pair of contexts above: here the
/// context is the process's shared client runtime.)
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_fatal_event_fails_pending_calls_with_unavailable() {
    use crate::codegen::{MethodDescriptor, ServiceDescriptor, method_id};
    use crate::{Channel, Code, Request, Response, Server, ServerCall, Service};
    static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
        name: "t.Slow",
        methods: &[MethodDescriptor {
            name: "Slow",
            path: "/t.Slow/Slow",
            id: method_id("/t.Slow/Slow"),
            kind: crate::codegen::MethodKind::Unary,
        }],
    };
    struct Slow;
    impl Service for Slow {
        fn descriptor(&self) -> &'static ServiceDescriptor {
            &DESCRIPTOR
        }
        fn call(&self, call: ServerCall) {
            call.unary(|_: Request<()>| {
                std::thread::sleep(Duration::from_secs(2));
                Ok(Response::new(()))
            });
        }
    }
    let server = Server::builder().add_service(Slow).serve(&url()).unwrap();
    let ch = Channel::connect(server.local_url()).unwrap();
    let call = ch.unary::<(), ()>(&DESCRIPTOR.methods[0], Request::new(()));
    let (cq, qp_num) = ch.verbs_queue().expect("an rdma:// channel");
    let failed = Completion {
        wr_id: 0,
        qp_num,
        kind: CompletionKind::Send,
        status: WcStatus::DeviceError {
            event: ffi::IBV_EVENT_QP_FATAL,
        },
    };
    assert!(cq.inner.side.push_if_live(None, failed));
    let e = call.wait().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("RDMA device error"), "{e}");
    assert!(!ch.is_connected());
    let e = ch
        .unary::<(), ()>(&DESCRIPTOR.methods[0], Request::new(()))
        .wait()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
}

/// Made-up completions never reach a queue pair other than the one they
/// were made for: dropping a queue pair purges them and stops its watcher,
/// and a new queue pair never gets a number the last poll handed out.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_made_up_completions_never_outlive_their_queue_pair() {
    let p = verbs_pair();
    let side = p.scq.inner.side.clone();
    let n = p.sqp.qp_num();
    let inc = p.sqp.qp.incarnation;
    let made_up = Completion {
        wr_id: 0,
        qp_num: n,
        kind: CompletionKind::Send,
        status: WcStatus::RetryExceeded,
    };
    assert!(side.push_if_live(Some(inc), made_up));
    assert_eq!(side.lock().queue.len(), 1);
    drop(p.sqp);
    {
        let st = side.lock();
        assert!(st.queue.is_empty(), "purged with its queue pair");
        assert!(!st.live.contains_key(&n));
    }
    assert!(
        !side.push_if_live(Some(inc), made_up),
        "nothing queued for a dead one"
    );
    let mut out = Vec::new();
    assert_eq!(p.scq.poll(&mut out, 8), 0, "{out:?}");

    // A batch handed out these numbers (the device allocates them in
    // sequence, so the next queue pairs would get some of them).
    let probe = p.server.new_qp(&p.scq).unwrap();
    let next: Vec<u32> = (1..=8).map(|k| probe.qp_num() + k).collect();
    side.lock().handed_out = next.clone();
    let qp = p.server.new_qp(&p.scq).unwrap();
    assert!(
        !next.contains(&qp.qp_num()),
        "{} was handed out",
        qp.qp_num()
    );
    assert!(
        !side.lock().parked.is_empty(),
        "numbers in use were set aside"
    );
    // The next poll means the batch was handled: the parked ones go.
    p.scq.poll(&mut out, 8);
    let st = side.lock();
    assert!(st.parked.is_empty() && st.handed_out.is_empty());
}

/// A made-up failure does not overtake completions already in the CQ: the
/// writes a peer completed before it closed (its last replies) come first.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_made_up_failure_comes_after_real_completions() {
    let mut p = verbs_pair();
    zero_length_writes(&mut p, 7, 3);
    let gone = Completion {
        wr_id: 0,
        qp_num: p.sqp.qp_num(),
        kind: CompletionKind::Send,
        status: WcStatus::RetryExceeded,
    };
    assert!(
        p.scq
            .inner
            .side
            .push_if_live(Some(p.sqp.qp.incarnation), gone)
    );
    let got: Vec<Completion> = (0..4).map(|_| p.next(c::End::Server)).collect();
    let imms: Vec<u32> = got[..3]
        .iter()
        .map(|c| match c.kind {
            CompletionKind::RecvImm { imm, .. } => imm,
            CompletionKind::Send | CompletionKind::Read => {
                panic!("the made-up failure came first: {got:?}")
            }
        })
        .collect();
    assert_eq!(imms, [7, 8, 9]);
    assert_eq!(got[3], gone);
}

/// A heartbeat on rdma:// is a zero-length RDMA WRITE without an
/// immediate: the peer's device acknowledges it, and its process sees
/// nothing (no receive taken, no completion).
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_a_silent_probe_is_acknowledged_and_unseen() {
    let mut p = verbs_pair();
    assert_eq!(
        p.cqp.probe_every(Duration::from_secs(1)).unwrap(),
        Probe::Silent
    );
    p.server.post_recv(4).unwrap();
    let (addr, rkey) = (p.s_peer.addr, p.s_peer.rkey);
    p.cqp.post_probe(9, addr, rkey, true).unwrap();
    let done = p.next(c::End::Client);
    assert_eq!(
        (done.wr_id, done.kind, done.status),
        (9, CompletionKind::Send, WcStatus::Success)
    );
    p.cqp.post_probe(10, addr, rkey, false).unwrap();
    p.cqp
        .post_write_imm(&c::write(&p.staging, &p.s_peer, 0, 0, rkey, 0x5A))
        .unwrap();
    let got = p.next_not_send(c::End::Server);
    assert_eq!(
        (got.kind, got.status),
        (
            CompletionKind::RecvImm {
                imm: 0x5A,
                byte_len: 0
            },
            WcStatus::Success
        ),
        "the write after the probes is the first thing the peer sees"
    );
    // That an unsignaled probe to a vanished host fails with a completion
    // of its own is for two hosts to show: here the peer's side channel
    // closes with its queue pair and reports the failure first.
    // `examples/tests/vanished_host.rs` kills a host instead.
}

#[test]
fn without_a_device_opening_fails_with_a_clear_error() {
    if VerbsFabric::open(&FabricUrl::parse("rdma://127.0.0.1:0").unwrap()).is_ok() {
        return; // a device is present: nothing to check here
    }
    let status =
        crate::fabric::open_verbs(&FabricUrl::parse("rdma://127.0.0.1:0").unwrap()).unwrap_err();
    assert_eq!(status.code(), crate::Code::Unavailable);
    assert!(
        status.message().contains("no RDMA device")
            || status.message().contains("no active RDMA port"),
        "{status}"
    );
    assert!(status.message().contains("tcp://"), "{status}");
}
