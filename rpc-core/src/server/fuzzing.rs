//! A server's receive path driven by hand (feature `testing`): a real
//! dispatcher serving a [`ServerBuilder`]'s services on mem://, turned on
//! the calling thread, and one fake client that writes what the caller
//! chooses into the server's ring with the immediates the caller chooses.
//! For the fuzz targets and tests.
//!
//! The client reads what the server sends it with the protocol's own
//! [`Receiver`] and consumes it at once: every frame the server sends must
//! be one a real client accepts, whatever the client sent.

use super::ServerBuilder;
use super::accept::ring_for;
use super::registry::Registry;
use super::role::ServerRole;
use super::start::ServerShared;
use crate::Status;
use crate::blocking::BlockingPool;
use crate::dispatch::Endpoint;
use crate::fabric::soft::{SoftCq, SoftFabric, SoftQp, SoftRegion};
use crate::fabric::{
    Completion, CompletionKind, CompletionQueue, Fabric, LocalSetup, PeerRing, QueuePair, Region,
    WcStatus, WriteImm,
};
use crate::protocol::credits::ack_for;
use crate::protocol::{Doorbell, HEADER_LEN, Receiver};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// The fake client's receive ring, bytes.
pub const CLIENT_RING: usize = 1 << 16;
/// Receives kept posted for the server's writes to the client.
const CLIENT_RECEIVES: u64 = 4096;
/// Turns of the dispatcher at most for a closed connection to be dropped.
const DRAIN_TURNS: usize = 64;

/// A live connection of the fake client.
struct Live {
    qp: SoftQp,
    /// The server's ring, as the client writes into it.
    server: PeerRing,
    /// The client's receiving side of what the server sends.
    rx: Receiver,
    /// The client's credit for the server: what it consumed.
    ack: u32,
    /// Frames the server sent on this connection.
    frames: usize,
    /// The client's queue pair failed (a write it made was refused, or
    /// the server closed the connection).
    dead: bool,
}

/// A server's dispatcher and one fake client, both driven on the calling
/// thread (which runs the dispatcher's handler tasks: keep it to one
/// thread).
pub struct FakePeer {
    ep: Arc<Endpoint<SoftFabric, ServerRole>>,
    shared: Arc<ServerShared>,
    fabric: SoftFabric,
    cq: SoftCq,
    ring: SoftRegion,
    staging: SoftRegion,
    live: Option<Live>,
    batch: Vec<Completion>,
}

impl std::fmt::Debug for FakePeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakePeer")
            .field("server_ring", &self.server_ring())
            .field("frames", &self.frames())
            .finish_non_exhaustive()
    }
}

impl FakePeer {
    /// A dispatcher serving `builder`'s services with its ring size and
    /// message limit, without heartbeats (nothing here depends on the
    /// clock), and a client, not connected yet. The calling thread becomes
    /// the dispatcher's.
    pub fn new(builder: ServerBuilder) -> Result<FakePeer, Status> {
        let mut config = builder.config.clone();
        config.heartbeat = None;
        config.validate()?;
        let routes = builder.routes()?;
        let shared = Arc::new(ServerShared {
            routes,
            fallback: None,
            interceptors: builder.interceptors.clone(),
            pool: BlockingPool::new("rpc-blocking", builder.blocking_threads),
            draining: AtomicBool::new(false),
            inflight: Arc::new(AtomicUsize::new(0)),
            max_message: config.max_message,
            max_streams: builder.max_streams,
            compression: builder.compression,
        });
        let role = ServerRole {
            shared: shared.clone(),
            registry: Arc::new(Registry::with_stream_limit(builder.max_streams)),
        };
        // Neither side waits for a receive: a write that finds none fails.
        let ep = Endpoint::new(
            SoftFabric::with_rnr_timeout(Duration::ZERO),
            config,
            role,
            true,
        )?;
        ep.exec
            .as_ref()
            .expect("a server's dispatcher runs tasks")
            .enter();
        let fabric = SoftFabric::with_rnr_timeout(Duration::ZERO);
        let ring = fabric.register(CLIENT_RING, true)?;
        let staging = fabric.register(ep.config.ring_size::<SoftFabric>(), false)?;
        let cq = fabric.create_cq()?;
        Ok(FakePeer {
            ep,
            shared,
            fabric,
            cq,
            ring,
            staging,
            live: None,
            batch: Vec::new(),
        })
    }

    /// A new connection from the client (the previous one is closed
    /// first, see [`FakePeer::disconnect`]); returns the server's ring as
    /// the client writes into it.
    pub fn connect(&mut self) -> Result<PeerRing, Status> {
        self.disconnect();
        let client_max = (CLIENT_RING / 2 - HEADER_LEN) as u32;
        let client_ring = PeerRing {
            addr: self.ring.addr(),
            len: CLIENT_RING as u64,
            rkey: self.ring.rkey(),
            max_message: client_max,
            max_streams: 0,
        };
        let (ring_len, max_message) = ring_for::<SoftFabric>(&self.ep.config, &client_ring);
        let ring = self.ep.register_ring(ring_len)?;
        let setup = |ring, max_message, max_streams| LocalSetup {
            ring,
            max_message,
            max_streams,
            timeout: Duration::from_secs(1),
            credential: None,
            tls: None,
        };
        let (client, server) = self.fabric.connect_pair(
            (&self.cq, setup(&self.ring, client_max, 0)),
            (
                &self.ep.fabric,
                &self.ep.cq,
                setup(&ring, max_message as u32, self.ep.role.shared.max_streams),
            ),
        );
        let conn = self.ep.add(server, ring, max_message)?;
        conn.established()?;
        let rx = Receiver::new(CLIENT_RING).map_err(|e| Status::internal(e.to_string()))?;
        self.live = Some(Live {
            qp: client.qp,
            server: client.peer,
            rx,
            ack: 0,
            frames: 0,
            dead: false,
        });
        Ok(client.peer)
    }

    /// The server's ring as the client writes into it, while connected.
    pub fn server_ring(&self) -> Option<PeerRing> {
        self.live.as_ref().map(|l| l.server)
    }

    /// The client's credit for the server (the ring units it consumed,
    /// modulo 2^30): what a well-behaved client puts in a header's `ack`
    /// or a credit doorbell.
    pub fn ack(&self) -> u32 {
        self.live.as_ref().map_or(0, |l| l.ack)
    }

    /// Frames the server sent on the current connection.
    pub fn frames(&self) -> usize {
        self.live.as_ref().map_or(0, |l| l.frames)
    }

    /// Whether the client's queue pair still works: false once a write of
    /// its was refused, or the server closed the connection.
    pub fn alive(&self) -> bool {
        self.live.as_ref().is_some_and(|l| !l.dead)
    }

    /// The client writes `bytes` (at most the server's ring size of them)
    /// at `offset` of the server's ring with the immediate `imm`: a
    /// zero-length write if `bytes` is empty. Returns [`FakePeer::alive`].
    pub fn write(&mut self, offset: u64, bytes: &[u8], imm: u32) -> bool {
        let Some(live) = self.live.as_mut().filter(|l| !l.dead) else {
            return false;
        };
        let len = bytes.len().min(self.staging.len());
        self.staging
            .write(0, len, |b| b.copy_from_slice(&bytes[..len]));
        let wr = WriteImm {
            wr_id: 1,
            local: (len > 0).then_some((&self.staging, 0, len)),
            remote_addr: live.server.addr.wrapping_add(offset),
            rkey: live.server.rkey,
            imm,
            signaled: false,
        };
        if live.qp.post_write_imm(&wr).is_err() {
            live.dead = true;
        }
        self.take_in();
        self.alive()
    }

    /// One turn of the server's dispatcher (what arrived, and the tasks it
    /// woke), then the client takes in what the server sent. Returns how
    /// many completions and tasks the server handled.
    pub fn turn(&mut self) -> usize {
        let posted = self.fabric.srq_posted();
        if posted < CLIENT_RECEIVES {
            let _ = self.fabric.post_recv((CLIENT_RECEIVES - posted) as u32);
        }
        let n = self.ep.turn_by_hand();
        self.take_in();
        n
    }

    /// Turns until the server has nothing more to do (at most `max`
    /// turns); returns the turns taken.
    pub fn settle(&mut self, max: usize) -> usize {
        for i in 0..max {
            if self.turn() == 0 {
                return i;
            }
        }
        max
    }

    /// The client reads what reached it: the server's frames go through
    /// the protocol's receiver (and must pass), its credits are noted.
    fn take_in(&mut self) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        loop {
            self.batch.clear();
            if self.cq.poll(&mut self.batch, 64) == 0 {
                return;
            }
            for c in &self.batch {
                if c.status != WcStatus::Success {
                    live.dead = true;
                    continue;
                }
                let CompletionKind::RecvImm { imm, byte_len } = c.kind else {
                    continue;
                };
                let Some(Doorbell::Frame { offset_units }) = Doorbell::decode(imm) else {
                    assert!(
                        byte_len == 0 && Doorbell::decode(imm).is_some(),
                        "the server sent a bad doorbell {imm:#x} with {byte_len} bytes"
                    );
                    continue;
                };
                let mut at = Some((offset_units, byte_len));
                while let Some((units, left)) = at {
                    let arrived = live
                        .rx
                        .on_frame(units, left, CLIENT_RING / 2 - HEADER_LEN, |offset| {
                            let mut h = [0u8; HEADER_LEN];
                            self.ring.copy_to(offset, &mut h);
                            h
                        })
                        .unwrap_or_else(|why| panic!("the server sent a bad frame: {why}"));
                    live.ack = ack_for(arrived.consumed);
                    live.frames += 1;
                    at = arrived.next;
                }
            }
        }
    }

    /// The client goes away: its queue pair is destroyed, the server sees
    /// it fail and drops the connection, and every call of it ends.
    /// Panics if the server keeps the connection, a call or a task of it.
    pub fn disconnect(&mut self) {
        let Some(live) = self.live.take() else {
            return;
        };
        drop(live.qp);
        self.settle(DRAIN_TURNS);
        assert_eq!(
            self.ep.load(),
            0,
            "the server kept a connection whose client went away"
        );
        assert_eq!(
            self.shared.inflight.load(Ordering::Acquire),
            0,
            "calls of a closed connection are still live"
        );
        let parked = self.ep.exec.as_ref().map_or(0, |e| e.parked());
        assert_eq!(
            parked, 0,
            "handler tasks of a closed connection are still parked"
        );
        // What the server sent before it noticed goes nowhere.
        loop {
            self.batch.clear();
            if self.cq.poll(&mut self.batch, 64) == 0 {
                break;
            }
        }
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        self.disconnect();
        if let Some(exec) = &self.ep.exec {
            exec.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::prost::Message;
    use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};
    use crate::protocol::{ALIGN, CallId, FrameKind, Header};
    use crate::{Request, Response, Server, ServerCall, Service};

    const PATH: &str = "/t.Echo/Unary";
    const BIDI: &str = "/t.Echo/Bidi";
    static METHODS: [MethodDescriptor; 2] = [
        MethodDescriptor {
            name: "Unary",
            path: PATH,
            id: method_id(PATH),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Bidi",
            path: BIDI,
            id: method_id(BIDI),
            kind: MethodKind::Streaming,
        },
    ];
    static ECHO: ServiceDescriptor = ServiceDescriptor {
        name: "t.Echo",
        methods: &METHODS,
    };

    struct Echo;
    impl Service for Echo {
        fn descriptor(&self) -> &'static ServiceDescriptor {
            &ECHO
        }
        fn call(&self, call: ServerCall) {
            if call.method_id() == METHODS[0].id {
                call.unary(|r: Request<Vec<u8>>| Ok(Response::new(r.into_inner())));
            } else {
                // Echoes the request stream.
                call.streaming(|r: Request<crate::Streaming<Vec<u8>>>| async move {
                    Ok(Response::new(r.into_inner()))
                });
            }
        }
    }

    fn request(call: u64, payload: &[u8]) -> Vec<u8> {
        call_of(0, call, payload)
    }

    /// A request frame for method `method` of [`METHODS`].
    fn call_of(method: usize, call: u64, payload: &[u8]) -> Vec<u8> {
        let payload = payload.to_vec().encode_to_vec();
        let header = Header {
            flags: Header::kind_flags(METHODS[method].kind),
            kind: FrameKind::Request,
            status: 0,
            method_id: METHODS[method].id,
            call_id: CallId(call),
            payload_len: payload.len() as u32,
            metadata_len: 0,
            timeout_us: 0,
            ack: 0,
        };
        let mut frame = vec![0u8; HEADER_LEN];
        header.encode((&mut frame[..]).try_into().unwrap());
        frame.extend_from_slice(&payload);
        frame
    }

    fn peer() -> FakePeer {
        FakePeer::new(Server::builder().ring_size(1 << 16).add_service(Echo)).unwrap()
    }

    #[test]
    fn a_request_is_answered_and_a_closed_client_leaves_nothing_behind() {
        let mut p = peer();
        for _ in 0..3 {
            let ring = p.connect().unwrap();
            assert_eq!(ring.len, 1 << 16);
            let frame = request(1, b"hello");
            let at = 0;
            assert!(p.write(at, &frame, Doorbell::Frame { offset_units: 0 }.encode()));
            p.settle(8);
            assert_eq!(p.frames(), 1);
            let next = crate::protocol::align_up(frame.len()) / ALIGN;
            let credit = Doorbell::Credit { ack: p.ack() }.encode();
            assert!(p.write(0, &[], credit));
            assert!(
                p.write(
                    (next * ALIGN) as u64,
                    &request(2, b"again"),
                    Doorbell::Frame {
                        offset_units: next as u32
                    }
                    .encode()
                )
            );
            p.settle(8);
            assert_eq!(p.frames(), 2);
            assert!(p.alive());
            p.disconnect();
        }
    }

    #[test]
    fn a_protocol_violation_closes_the_connection() {
        let mut p = peer();
        p.connect().unwrap();
        // A frame where the server does not expect one.
        p.write(
            64,
            &request(1, b"x"),
            Doorbell::Frame { offset_units: 1 }.encode(),
        );
        p.settle(8);
        assert!(!p.alive());
        assert_eq!(p.frames(), 0);
        p.disconnect();
        // A write outside the ring fails the client's queue pair.
        let ring = p.connect().unwrap();
        assert!(!p.write(ring.len, &[1], 0));
        p.disconnect();
    }

    /// A request that reuses the id of a live call closes the connection:
    /// it used to take the earlier call's place, whose handler task then
    /// stayed parked (and its call counted live) after the client left.
    #[test]
    fn a_request_reusing_a_live_calls_id_closes_the_connection() {
        let mut p = peer();
        p.connect().unwrap();
        let first = call_of(1, 7, b"");
        assert!(p.write(0, &first, Doorbell::Frame { offset_units: 0 }.encode()));
        p.settle(8);
        assert!(p.alive());
        let next = crate::protocol::align_up(first.len());
        let units = (next / ALIGN) as u32;
        p.write(
            next as u64,
            &call_of(1, 7, b""),
            Doorbell::Frame {
                offset_units: units,
            }
            .encode(),
        );
        p.settle(8);
        let alive = p.alive();
        // Nothing of either call is left once the client goes (checked by
        // disconnect).
        p.disconnect();
        assert!(!alive, "the server kept a connection that reused a live id");
        // A finished call's id may be used again.
        p.connect().unwrap();
        let unary = request(9, b"a");
        p.write(0, &unary, Doorbell::Frame { offset_units: 0 }.encode());
        let next = crate::protocol::align_up(unary.len());
        let units = (next / ALIGN) as u32;
        p.write(
            next as u64,
            &request(9, b"b"),
            Doorbell::Frame {
                offset_units: units,
            }
            .encode(),
        );
        p.settle(8);
        assert!(p.alive());
        assert_eq!(p.frames(), 2);
    }
}
