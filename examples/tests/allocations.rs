//! How many heap allocations one call costs, counted by a global allocator.
//!
//! The hot path should allocate nothing per call beyond the messages
//! themselves: this test pins that down, so a change that adds an
//! allocation to every call fails here instead of showing up later as lost
//! throughput.

use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::EchoServer;
use examples::echo::{EchoReply, EchoRequest};
use examples::services::EchoService;
use rpc_core::codegen::prost::Message;
use rpc_core::{Channel, Request, Server};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed through.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn request(payload: &[u8]) -> EchoRequest {
    EchoRequest {
        payload: payload.to_vec().into(),
    }
}

/// Allocations per call, client and server together, over `calls` calls,
/// with default settings: the handler runs to completion on the dispatcher.
fn per_call(url: &str, calls: u64) -> f64 {
    let server = Server::builder()
        .add_service(EchoServer::new(EchoService))
        .serve(url)
        .unwrap();
    let client = EchoClient::new(Channel::connect(server.local_url()).unwrap());
    let payload = [7u8; 64];
    let call = |client: &EchoClient| {
        let reply = client.echo(Request::new(request(&payload))).wait().unwrap();
        assert_eq!(reply.get_ref().payload, payload[..]);
    };
    // Warm up: buffers, slabs and queues reach their working size.
    for _ in 0..calls.min(2000) {
        call(&client);
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..calls {
        call(&client);
    }
    let after = ALLOCATIONS.load(Ordering::Relaxed);
    drop(client);
    server.shutdown();
    (after - before) as f64 / calls as f64
}

/// Allocations of the messages alone: building the request, encoding it,
/// decoding it, encoding the reply that echoes it and decoding that (what
/// any transport must do). Encoding a `Bytes` field made from a `Vec`
/// allocates its reference count the first time (prost encodes a clone).
fn messages_alone(calls: u64) -> f64 {
    let payload = [7u8; 64];
    let mut wire = Vec::with_capacity(256);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..calls {
        let built = request(&payload);
        wire.clear();
        built.encode(&mut wire).unwrap();
        let decoded = EchoRequest::decode(&wire[..]).unwrap();
        let reply = EchoReply {
            payload: decoded.payload,
        };
        wire.clear();
        reply.encode(&mut wire).unwrap();
        let reply = EchoReply::decode(&wire[..]).unwrap();
        assert_eq!(built.payload, reply.payload);
    }
    let after = ALLOCATIONS.load(Ordering::Relaxed);
    (after - before) as f64 / calls as f64
}

/// The framework's own allocations per call must round to zero: whatever
/// a call allocates beyond its messages is a leak into the hot path.
fn check(url: &str, calls: u64) {
    // The count is global: measure one configuration at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let floor = messages_alone(calls);
    let total = per_call(url, calls);
    eprintln!("{url}: {total:.2} allocations per call, {floor:.2} of them the messages'");
    // Rare, amortised allocations (a channel's block of slots) stay below 0.1.
    assert!(
        total < floor + 0.1,
        "{url}: {total:.2} allocations per call, of which only {floor:.2} are the messages'"
    );
}

#[test]
fn mem_allocates_only_messages() {
    check("mem://allocations", 5000);
}

#[test]
fn tcp_allocates_only_messages() {
    check("tcp://127.0.0.1:0", 5000);
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_allocates_only_messages() {
    let url = std::env::var("RPC_TEST_RDMA_URL").unwrap_or_else(|_| "rdma://127.0.0.1:0".into());
    check(&url, 1000);
}
