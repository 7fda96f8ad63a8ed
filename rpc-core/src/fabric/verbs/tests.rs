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
fn rdma_closing_a_queue_pair_is_seen_by_the_peer() {
    c::close_is_seen_by_the_peer(verbs_pair());
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_queue_pairs_are_created_on_the_context_srq_and_cqs() {
    let p = verbs_pair();
    let inner = &p.server.inner;
    // SAFETY: reading plain fields of a live QP.
    let (srq, scq, rcq) = unsafe {
        let qp = p.sqp.qp.ptr.as_ptr();
        ((*qp).srq, (*qp).send_cq, (*qp).recv_cq)
    };
    assert_eq!(
        srq,
        inner.srq.ptr.as_ptr(),
        "the QP receives through the context's SRQ"
    );
    assert_eq!(scq, inner.send_cq.ptr.as_ptr());
    assert_eq!(rcq, inner.recv_cq.ptr.as_ptr());
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
