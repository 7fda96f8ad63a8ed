//! Criterion benches of the hot protocol paths: everything a call does in
//! the protocol layer on the way out and back in.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use rpc_core::testing::protocol::credits::apply_ack;
use rpc_core::testing::protocol::{
    CallId, CallTable, CreditReturn, Doorbell, FrameKind, HEADER_LEN, Header, RecvRing, SendRing,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn header() -> Header {
    Header {
        flags: 0,
        kind: FrameKind::Request,
        status: 0,
        method_id: 0x83c0_5b70,
        call_id: CallId::new(17, 4242),
        payload_len: 64,
        metadata_len: 0,
        timeout_us: 1_000_000,
        ack: 12345,
    }
}

fn frames(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame");
    let h = header();
    let mut buf = [0u8; HEADER_LEN];
    g.bench_function("header_encode", |b| {
        b.iter(|| black_box(&h).encode(black_box(&mut buf)))
    });
    h.encode(&mut buf);
    g.bench_function("header_decode", |b| {
        b.iter(|| Header::decode(black_box(&buf)))
    });
    let garbage = [0xA5u8; HEADER_LEN];
    g.bench_function("header_decode_reject", |b| {
        b.iter(|| Header::decode(black_box(&garbage)))
    });
    let imm = Doorbell::Frame { offset_units: 1234 }.encode();
    g.bench_function("doorbell_decode", |b| {
        b.iter(|| Doorbell::decode(black_box(imm)))
    });
    g.finish();
}

fn rings(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring");
    const CAP: usize = 1 << 21;
    // One frame's whole life: reserve at the sender, locate and consume at
    // the receiver, ack back, release at the sender.
    g.bench_function("reserve_consume_ack_128B", |b| {
        let mut send = SendRing::new(CAP).unwrap();
        let mut recv = RecvRing::new(CAP).unwrap();
        let mut credits = CreditReturn::new(CAP);
        b.iter(|| {
            let slot = send.reserve(black_box(96)).unwrap().unwrap();
            let units = (slot.offset / rpc_core::testing::protocol::ALIGN) as u32;
            let at = recv.locate(units).unwrap();
            recv.consume(at, 96).unwrap();
            credits.on_consumed(recv.consumed());
            apply_ack(&mut send, credits.take_ack()).unwrap();
        })
    });
    g.bench_function("reserve_full_ring_refused", |b| {
        let mut send = SendRing::new(1 << 12).unwrap();
        while send.reserve(64).unwrap().is_some() {}
        b.iter(|| send.reserve(black_box(64)))
    });
    g.finish();
}

fn calls(c: &mut Criterion) {
    let mut g = c.benchmark_group("calls");
    g.bench_function("insert_complete_64_in_flight", |b| {
        let mut table = CallTable::new();
        let mut ids: Vec<CallId> = (0..64).map(|i| table.insert(i, None)).collect();
        let mut i = 0;
        b.iter(|| {
            let slot = i % ids.len();
            black_box(table.complete(ids[slot]));
            ids[slot] = table.insert(slot, None);
            i += 1;
        })
    });
    g.bench_function("insert_complete_with_deadline", |b| {
        let now = Instant::now();
        b.iter_batched_ref(
            CallTable::<u32>::new,
            |table| {
                for i in 0..64 {
                    let id = table.insert(i, Some(now + Duration::from_millis(i as u64)));
                    black_box(table.complete(id));
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, frames, rings, calls);
criterion_main!(benches);
