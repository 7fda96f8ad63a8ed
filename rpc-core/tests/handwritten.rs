//! The runtime with a hand-written service (no code generation): the
//! contract generated code relies on, checked end to end on mem:// and tcp://.

use rpc_core::codegen::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id, unary};
use rpc_core::{Channel, Code, Request, Response, Server, ServerCall, Service, Status};
use std::time::Duration;

#[derive(Clone, PartialEq, prost::Message)]
struct Blob {
    #[prost(bytes = "vec", tag = "1")]
    data: Vec<u8>,
}

static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
    name: "hand.Echo",
    methods: &[
        MethodDescriptor {
            name: "Echo",
            path: "/hand.Echo/Echo",
            id: method_id("/hand.Echo/Echo"),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Sleep",
            path: "/hand.Echo/Sleep",
            id: method_id("/hand.Echo/Sleep"),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Panic",
            path: "/hand.Echo/Panic",
            id: method_id("/hand.Echo/Panic"),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Forget",
            path: "/hand.Echo/Forget",
            id: method_id("/hand.Echo/Forget"),
            kind: MethodKind::Unary,
        },
    ],
};
const ECHO: &MethodDescriptor = &DESCRIPTOR.methods[0];
const SLEEP: &MethodDescriptor = &DESCRIPTOR.methods[1];
const PANIC: &MethodDescriptor = &DESCRIPTOR.methods[2];
const FORGET: &MethodDescriptor = &DESCRIPTOR.methods[3];
static UNKNOWN: MethodDescriptor = MethodDescriptor {
    name: "Nope",
    path: "/hand.Echo/Nope",
    id: 0xdead_beef,
    kind: MethodKind::Unary,
};

struct Echo;

impl Service for Echo {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &DESCRIPTOR
    }
    fn call(&self, call: ServerCall) {
        match call.method_id() {
            id if id == ECHO.id => call.unary(|r: Request<Blob>| {
                let tag = r.metadata().get("tag").map(str::to_owned);
                let mut resp = Response::new(r.into_inner());
                if let Some(tag) = tag {
                    resp.metadata_mut().insert("tag", tag).unwrap();
                }
                Ok(resp)
            }),
            id if id == SLEEP.id => call.unary(|r: Request<Blob>| {
                std::thread::sleep(Duration::from_millis(r.get_ref().data.len() as u64));
                Ok(Response::new(Blob::default()))
            }),
            id if id == PANIC.id => {
                call.unary(|_: Request<Blob>| -> Result<Response<Blob>, Status> { panic!("boom") })
            }
            id if id == FORGET.id => drop(call),
            _ => call.unimplemented(),
        }
    }
}

fn check(url: &str) {
    let server = Server::builder().add_service(Echo).serve(url).unwrap();
    let ch = Channel::connect(server.local_url()).unwrap();
    // A response matches its request, metadata included.
    let mut req = Request::new(Blob {
        data: b"hello".to_vec(),
    });
    req.metadata_mut().insert("tag", "t1").unwrap();
    let resp = unary::<_, Blob>(&ch, ECHO, req).wait().unwrap();
    assert_eq!(resp.metadata().get("tag"), Some("t1"));
    assert_eq!(resp.into_inner().data, b"hello");
    // Async under an executor that is not tokio.
    let r = futures::executor::block_on(unary::<_, Blob>(
        &ch,
        ECHO,
        Request::new(Blob {
            data: vec![7; 1000],
        }),
    ))
    .unwrap();
    assert_eq!(r.into_inner().data, vec![7; 1000]);
    // Unknown method, panicking handler, forgotten call.
    let e = unary::<_, Blob>(&ch, &UNKNOWN, Request::new(Blob::default()))
        .wait()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e}");
    let e = unary::<_, Blob>(&ch, PANIC, Request::new(Blob::default()))
        .wait()
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal);
    assert!(e.message().contains("boom"), "{e}");
    let e = unary::<_, Blob>(&ch, FORGET, Request::new(Blob::default()))
        .wait()
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal);
    // Deadline.
    let mut req = Request::new(Blob { data: vec![0; 300] });
    req.set_timeout(Duration::from_millis(50));
    let e = unary::<_, Blob>(&ch, SLEEP, req).wait().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    // The connection still serves after all that.
    let r = unary::<_, Blob>(
        &ch,
        ECHO,
        Request::new(Blob {
            data: b"again".to_vec(),
        }),
    )
    .wait()
    .unwrap();
    assert_eq!(r.into_inner().data, b"again");
    // Many concurrent calls from several threads, each checked.
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let ch = ch.clone();
            s.spawn(move || {
                for i in 0..500u32 {
                    let data: Vec<u8> = (0..(i % 300)).map(|j| (j as u8) ^ t).collect();
                    let r = unary::<_, Blob>(&ch, ECHO, Request::new(Blob { data: data.clone() }))
                        .wait()
                        .unwrap();
                    assert_eq!(r.into_inner().data, data);
                }
            });
        }
    });
    server.shutdown();
    let e = unary::<_, Blob>(&ch, ECHO, Request::new(Blob::default()))
        .wait()
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
}

#[test]
fn mem() {
    check("mem://handwritten");
}

#[test]
fn tcp() {
    check("tcp://127.0.0.1:0");
}

/// Over real verbs; `scripts/test` runs it inside the Soft-RoCE guest.
#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_() {
    let host = std::env::var("RXE_IP").unwrap_or_else(|_| "127.0.0.1".into());
    check(&format!("rdma://{host}:0"));
}

/// A dispatcher asleep before its first tcp:// connection sleeps on a
/// condition variable, blind to sockets: registering the first socket must
/// wake it, or the first request waits out the sleep (a second).
#[test]
fn the_first_tcp_call_is_not_held_up_by_a_sleeping_dispatcher() {
    let server = Server::builder()
        .add_service(Echo)
        .serve("tcp://127.0.0.1:0")
        .unwrap();
    // Let every dispatcher fall asleep.
    std::thread::sleep(Duration::from_millis(50));
    let ch = Channel::connect(server.local_url()).unwrap();
    let started = std::time::Instant::now();
    unary::<_, Blob>(&ch, ECHO, Request::new(Blob::default()))
        .wait()
        .unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "first call took {took:?}"
    );
}
