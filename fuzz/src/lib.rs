//! Shared by the fuzz targets: the one-line body of each, so that a crash
//! found by AFL can be replayed as a plain test (`cargo test` here).

use rpc_core::auth::{Authenticator, Credential};
use rpc_core::codegen::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};
use rpc_core::fabric::FabricErrorKind;
use rpc_core::testing::bootstrap::{HELLO_LEN, Hello, HelloFabric, client_exchange};
use rpc_core::testing::protocol::{ALIGN, Doorbell, HEADER_LEN, Header, Receiver, align_up};
use rpc_core::testing::server::FakePeer;
use rpc_core::testing::{gate as gate_side, metadata as md, tcp_wire as wire};
use rpc_core::{
    Request, Response, Server, ServerCall, Service, SharedSecret, Status, Stream, Streaming,
};
use std::cell::RefCell;
use std::io::{Read, Write};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

/// A frame header from the peer: decodes or is refused, never panics.
pub fn frame_header(data: &[u8]) {
    if let Ok(h) = Header::decode(data) {
        // What decodes must re-encode to the same bytes.
        let mut out = [0u8; HEADER_LEN];
        h.encode(&mut out);
        assert_eq!(Header::decode(&out).ok(), Some(h));
    }
}

/// A handshake hello from the peer, as either fabric reads it.
pub fn hello(data: &[u8]) {
    let mut b = [0u8; HELLO_LEN];
    let n = data.len().min(HELLO_LEN);
    b[..n].copy_from_slice(&data[..n]);
    for fabric in [HelloFabric::Tcp, HelloFabric::Rdma] {
        if let Ok(h) = Hello::decode(&b, fabric) {
            assert_eq!(Hello::decode(&h.encode(), fabric).ok(), Some(h));
        }
    }
}

/// A valid tcp:// hello with a 64 KiB ring: what a client sends, and a
/// seed for the hello targets.
pub fn tcp_hello() -> Hello {
    Hello {
        fabric: HelloFabric::Tcp,
        qp_num: 1,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 0,
        ring: rpc_core::fabric::PeerRing {
            addr: 0x1000,
            len: 1 << 16,
            rkey: 7,
            max_message: 1 << 14,
            max_streams: 0,
        },
    }
}

/// The server's side of the handshake as a client reads it: any bytes
/// from a server (hello, challenge, proof, refusal records) end in a hello
/// or an error, never a panic or a hang (the input is finite).
pub fn handshake_client(data: &[u8]) {
    let sent = tcp_hello();
    let _ = client_exchange(
        &mut Peer { from_server: data },
        &sent,
        HelloFabric::Tcp,
        None,
    );
}

/// The receive path of one connection, as a peer drives it: each 12-byte
/// step is an immediate, a write length and a header placed where the
/// doorbell points; the ring's state must refuse what breaks the protocol
/// without a panic, and accept what follows it.
pub fn receiver(data: &[u8]) {
    const CAP: usize = 1 << 16;
    let Ok(mut rx) = Receiver::new(CAP) else {
        return;
    };
    let mut ring = vec![0u8; CAP];
    for step in data.chunks_exact(12 + HEADER_LEN) {
        let imm = u32::from_le_bytes(step[0..4].try_into().unwrap());
        let byte_len = u32::from_le_bytes(step[4..8].try_into().unwrap());
        let header = &step[12..12 + HEADER_LEN];
        let Some(Doorbell::Frame { offset_units }) = Doorbell::decode(imm) else {
            continue; // credits and bad tags touch no ring state
        };
        let at = (offset_units as usize * ALIGN) % CAP;
        let end = (at + HEADER_LEN).min(CAP);
        ring[at..end].copy_from_slice(&header[..end - at]);
        let max_message = u32::from_le_bytes(step[8..12].try_into().unwrap()) as usize;
        let result = rx.on_frame(offset_units, byte_len, max_message, |offset| {
            let mut h = [0u8; HEADER_LEN];
            let n = HEADER_LEN.min(CAP.saturating_sub(offset));
            h[..n].copy_from_slice(&ring[offset..offset + n]);
            h
        });
        if result.is_err() {
            return; // the connection would close here
        }
    }
}

/// A frame's metadata block from the peer: decodes or is refused, never
/// panics; what decodes re-encodes to the same bytes and decodes again to
/// the same value.
pub fn metadata(data: &[u8]) {
    if let Some(decoded) = md::decode(data) {
        let bytes = md::encode(&decoded);
        assert_eq!(bytes, data, "metadata re-encodes differently");
        assert_eq!(md::decode(&bytes).as_ref(), Some(&decoded));
    }
}

/// Pieces the tcp:// stream arrives in, by bits 5..=7 of the control byte
/// (0: all at once).
const PIECES: [usize; 8] = [0, 1, 2, 3, 7, 29, 64, 4096];
/// Longest stream a `tcp_wire` run reads (enough for payloads read
/// straight into the ring).
const MAX_STREAM: usize = 128 << 10;

/// What a peer sends on an established tcp:// connection (writes, acks,
/// naks, anything), read by the real receiving side: byte 0 sets it up
/// (bits 0..=3: receives posted; bit 4: the RNR timeout has passed, so a
/// write without a receive fails instead of waiting; bits 5..=7: the
/// pieces the bytes arrive in, see `PIECES`), the rest is the stream,
/// followed by its end. The writes may land in a 64 KiB ring at
/// `tcp_wire::RING_ADDR` with rkey `tcp_wire::RING_RKEY`. Checks what the
/// reader completes, takes and sends back (see `rpc_core::testing::tcp_wire`).
pub fn tcp_wire(data: &[u8]) {
    thread_local! {
        static HARNESS: RefCell<Option<wire::Harness>> = const { RefCell::new(None) };
    }
    let Some((&ctl, stream)) = data.split_first() else {
        return;
    };
    let options = wire::Options {
        receives: u32::from(ctl & 0x0f),
        rnr_expired: ctl & 0x10 != 0,
        piece: PIECES[usize::from(ctl >> 5)],
    };
    let stream = &stream[..stream.len().min(MAX_STREAM)];
    HARNESS.with(|h| {
        let mut h = h.borrow_mut();
        let h = h.get_or_insert_with(|| wire::Harness::new().expect("a ring"));
        h.run(stream, options).expect("a socket pair");
    });
}

/// The shared secret of the `gate` target's server and honest clients.
fn secret() -> &'static SharedSecret {
    static SECRET: OnceLock<SharedSecret> = OnceLock::new();
    SECRET.get_or_init(|| SharedSecret::new("fuzz", "0123456789abcdef").expect("a valid secret"))
}

/// A client's bytes to the server's side of the handshake (the gate), to
/// the end: admitted, refused or dropped, never a panic or a hang. Byte 0
/// chooses the server and the client (bits 0..=1: 0 or 3, no credential
/// required; 1, a shared secret required and the bytes are all the client
/// says; 2, required, and the client answers the challenge with the secret
/// after its bytes) and how the bytes arrive (bits 2..=7: in pieces of
/// that many bytes, 0 all at once); the rest is what the client sends,
/// from its hello on.
pub fn gate(data: &[u8]) {
    let Some((&ctl, bytes)) = data.split_first() else {
        return;
    };
    let (required, honest) = match ctl & 3 {
        1 => (true, false),
        2 => (true, true),
        _ => (false, false),
    };
    let authenticator = required.then(|| secret() as &dyn Authenticator);
    let client = gate_side::Client {
        bytes,
        piece: usize::from(ctl >> 2),
        credential: honest.then(|| secret() as &dyn Credential),
    };
    let run = gate_side::handshake(client, authenticator).expect("a socket pair");
    let hello = bytes.get(..HELLO_LEN).and_then(|b| {
        Hello::decode(b.try_into().expect("a hello's length"), HelloFabric::Tcp).ok()
    });
    match &run.outcome {
        gate_side::Outcome::Admitted { hello: h, identity } => {
            assert_eq!(Some(*h), hello, "admitted a hello other than the client's");
            assert_eq!(identity.as_deref(), required.then_some("fuzz"));
        }
        gate_side::Outcome::Refused { code, .. } => {
            assert!(required, "refused by a server that asks nothing");
            // The client reads the same refusal.
            let mut peer = Peer {
                from_server: &run.sent,
            };
            let read = client_exchange(&mut peer, &tcp_hello(), HelloFabric::Tcp, Some(secret()));
            match read.map_err(|e| e.kind) {
                Err(FabricErrorKind::Refused(c, _)) => assert_eq!(c, *code),
                other => panic!("a refusal with {code:?} read as {other:?}"),
            }
        }
        gate_side::Outcome::Dropped(_) => {}
    }
    if !required {
        assert!(
            run.sent.is_empty(),
            "a server that asks nothing sent {:?}",
            run.sent
        );
    }
    if honest && hello.is_some() && bytes.len() == HELLO_LEN {
        assert!(
            matches!(run.outcome, gate_side::Outcome::Admitted { .. }),
            "an honest client was not admitted: {run:?}"
        );
    }
}

/// A server as a client's handshake reads it: the bytes it sent, and a
/// sink for what the client writes.
struct Peer<'a> {
    from_server: &'a [u8],
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.from_server.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The paths of the `server` target's methods: one of each kind.
pub const PATHS: [&str; 4] = [
    "/fuzz.Echo/Unary",
    "/fuzz.Echo/ServerStream",
    "/fuzz.Echo/ClientStream",
    "/fuzz.Echo/Bidi",
];

static METHODS: [MethodDescriptor; 4] = [
    MethodDescriptor {
        name: "Unary",
        path: PATHS[0],
        id: method_id(PATHS[0]),
        kind: MethodKind::Unary,
    },
    MethodDescriptor {
        name: "ServerStream",
        path: PATHS[1],
        id: method_id(PATHS[1]),
        kind: MethodKind::ServerStreaming,
    },
    MethodDescriptor {
        name: "ClientStream",
        path: PATHS[2],
        id: method_id(PATHS[2]),
        kind: MethodKind::ClientStreaming,
    },
    MethodDescriptor {
        name: "Bidi",
        path: PATHS[3],
        id: method_id(PATHS[3]),
        kind: MethodKind::Streaming,
    },
];

static ECHO: ServiceDescriptor = ServiceDescriptor {
    name: "fuzz.Echo",
    methods: &METHODS,
};

/// The `server` target's service: each method echoes what it gets (bytes
/// messages), with the request's metadata.
struct Echo;

/// A server stream: the request `left` times.
struct Repeat {
    message: Vec<u8>,
    left: usize,
}

impl Stream for Repeat {
    type Item = Result<Vec<u8>, Status>;
    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(self.message.clone())))
    }
}

impl Service for Echo {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &ECHO
    }

    fn call(&self, call: ServerCall) {
        let id = call.method_id();
        if id == METHODS[0].id {
            call.unary(|r: Request<Vec<u8>>| {
                let md = r.metadata().clone();
                Ok(Response::from_parts(md, r.into_inner()))
            });
        } else if id == METHODS[1].id {
            call.server_streaming(|r: Request<Vec<u8>>| async move {
                let left = r.get_ref().first().map_or(2, |&b| usize::from(b % 4));
                Ok(Response::new(Repeat {
                    message: r.into_inner(),
                    left,
                }))
            });
        } else if id == METHODS[2].id {
            call.client_streaming(|r: Request<Streaming<Vec<u8>>>| async move {
                let mut messages = r.into_inner();
                let mut all = Vec::new();
                while let Some(m) = messages.message().await? {
                    all.extend_from_slice(&m[..m.len().min(64)]);
                }
                Ok(Response::new(all))
            });
        } else if id == METHODS[3].id {
            call.streaming(|r: Request<Streaming<Vec<u8>>>| async move {
                Ok(Response::new(r.into_inner()))
            });
        } else {
            call.unimplemented();
        }
    }
}

/// The size of the `server` target's rings.
const SERVER_RING: usize = 1 << 16;
/// One step of a `server` input: its head, then its bytes.
const STEP: usize = 9;
/// The server's dispatcher turns at most this often to settle after the
/// last step.
const SETTLE: usize = 64;

/// The whole receive path of a server behind a fake client (a real
/// dispatcher serving one method of each kind on mem://, driven on this
/// thread): the input is steps, each a 9-byte head (op: u8, len: u16,
/// imm: u32, offset: u16, little-endian) and `len` bytes. Bits 0..=1 of op:
/// 0 places the bytes where a well-behaved client puts its next write (at
/// its head, or at 0 if they would run past the end) with the doorbell
/// that says so (bit 3: its first header's ack becomes the client's
/// credit); 1 writes them at `offset` of the ring with `imm`; 2 sends a
/// zero-length doorbell, the client's credit (bit 3: `imm`); 3 writes
/// nothing (and the dispatcher turns). The dispatcher turns after a step
/// whose op has bit 2 set, and at the end until it settles; then the
/// client goes away, and the server must drop every trace of it. Nothing
/// may panic, and every frame the server sends must pass the client's
/// receiver (see `rpc_core::testing::server`).
pub fn server(data: &[u8]) {
    thread_local! {
        static PEER: RefCell<Option<FakePeer>> = const { RefCell::new(None) };
    }
    PEER.with(|p| {
        let mut p = p.borrow_mut();
        let peer = p.get_or_insert_with(|| {
            let builder = Server::builder().ring_size(SERVER_RING).add_service(Echo);
            FakePeer::new(builder).expect("a dispatcher")
        });
        drive(peer, data);
    });
}

/// Runs `data`'s steps on a new connection of `peer`; returns the frames
/// the server sent.
fn drive(peer: &mut FakePeer, data: &[u8]) -> usize {
    let ring = peer.connect().expect("a connection");
    let cap = ring.len as usize;
    let mut head = 0usize;
    let mut rest = data;
    while rest.len() >= STEP && peer.alive() {
        let (step, tail) = rest.split_at(STEP);
        let op = step[0];
        let len = usize::from(u16::from_le_bytes([step[1], step[2]]));
        let imm = u32::from_le_bytes(step[3..7].try_into().expect("4 bytes"));
        let offset = u64::from(u16::from_le_bytes([step[7], step[8]]));
        let (bytes, tail) = tail.split_at(len.min(tail.len()));
        rest = tail;
        match op & 3 {
            0 => {
                let mut bytes = bytes.to_vec();
                if op & 8 != 0 && bytes.len() >= HEADER_LEN {
                    bytes[28..32].copy_from_slice(&peer.ack().to_le_bytes());
                }
                let need = align_up(bytes.len().max(1));
                let mut at = head % cap;
                if at + need > cap {
                    head += cap - at;
                    at = 0;
                }
                let doorbell = Doorbell::Frame {
                    offset_units: (at / ALIGN) as u32,
                };
                peer.write(at as u64, &bytes, doorbell.encode());
                head += need;
            }
            1 => {
                peer.write(offset, bytes, imm);
            }
            2 => {
                let imm = if op & 8 != 0 {
                    imm
                } else {
                    Doorbell::Credit { ack: peer.ack() }.encode()
                };
                peer.write(0, &[], imm);
            }
            _ => {}
        }
        if op & 4 != 0 || op & 3 == 3 {
            peer.turn();
        }
    }
    peer.settle(SETTLE);
    let frames = peer.frames();
    peer.disconnect();
    frames
}

/// A target's body.
pub type Target = fn(&[u8]);

/// Every target by name, as `src/bin/<name>.rs` and `corpus/<name>/` call it.
pub const TARGETS: [(&str, Target); 8] = [
    ("frame_header", frame_header),
    ("hello", hello),
    ("handshake_client", handshake_client),
    ("receiver", receiver),
    ("metadata", metadata),
    ("tcp_wire", tcp_wire),
    ("gate", gate),
    ("server", server),
];

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::testing::protocol::{CallId, FrameKind};

    /// Writes the seed corpus (valid inputs for each target), once:
    /// `cargo test -- --ignored write_seeds`.
    #[test]
    #[ignore = "writes corpus/: run by hand"]
    fn write_seeds() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let put = |target: &str, name: &str, bytes: &[u8]| {
            let dir = root.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), bytes).unwrap();
        };
        let header = |kind, payload_len: u32| {
            let h = Header {
                flags: 0,
                kind,
                status: 0,
                method_id: 0x1234_5678,
                call_id: CallId(7),
                payload_len,
                metadata_len: 0,
                timeout_us: 0,
                ack: 0,
            };
            let mut out = [0u8; HEADER_LEN];
            h.encode(&mut out);
            out
        };
        put("frame_header", "request", &header(FrameKind::Request, 100));
        put("frame_header", "response", &header(FrameKind::Response, 0));
        let hello = tcp_hello();
        put("hello", "tcp", &hello.encode());
        put("handshake_client", "hello", &hello.encode());
        // Two frames one after the other, then a credit.
        let mut steps = Vec::new();
        for (imm, len) in [(0u32, 192u32), (3, 64), (0x4000_0010, 0)] {
            steps.extend_from_slice(&imm.to_le_bytes());
            steps.extend_from_slice(&len.to_le_bytes());
            steps.extend_from_slice(&(1u32 << 14).to_le_bytes());
            steps.extend_from_slice(&header(FrameKind::Request, len.saturating_sub(32)));
        }
        put("receiver", "frames", &steps);

        let mut one = rpc_core::Metadata::new();
        one.insert("tenant", "blue").unwrap();
        put("metadata", "text", &md::encode(&one));
        one.insert_bin("trace-bin", [0u8, 1, 2, 255]).unwrap();
        put("metadata", "two", &md::encode(&one));

        // tcp://: a signaled write, a zero-length one and an ack with two
        // receives posted; the same arriving byte by byte with one receive
        // (the second write stalls); a payload long enough to be read
        // straight into the ring; a nak; a write outside the ring.
        let mut stream = vec![0x02];
        stream.extend(wire::write_message(true, 1, 64, 0x40, &[7u8; 40]));
        stream.extend(wire::write_message(false, 2, 0, 0x4000_0001, &[]));
        stream.extend(wire::ack_message(5));
        put("tcp_wire", "writes", &stream);
        stream[0] = 0x21;
        put("tcp_wire", "bytewise", &stream);
        let mut long = vec![0x01];
        long.extend(wire::write_message(true, 3, 0, 0, &[9u8; 17 << 10]));
        put("tcp_wire", "long", &long);
        let mut nak = vec![0x00];
        nak.extend(wire::nak_message(
            4,
            rpc_core::fabric::WcStatus::RemoteAccess,
        ));
        put("tcp_wire", "nak", &nak);
        let mut outside = vec![0x11];
        outside.extend(wire::write_message(false, 6, 1 << 16, 0, &[1; 8]));
        put("tcp_wire", "outside", &outside);

        // The gate: a hello with no credential asked (at once, and in
        // 1-byte pieces); a credential asked and answered honestly; a
        // credential asked and a well-formed wrong answer given.
        let hello = tcp_hello().encode();
        let with = |ctl: u8, tail: &[u8]| [&[ctl][..], &hello[..], tail].concat();
        put("gate", "open", &with(0, &[]));
        put("gate", "bytewise", &with(1 << 2, &[]));
        put("gate", "honest", &with(2, &[]));
        let answer = secret()
            .answer(&rpc_core::auth::Challenge {
                nonce: &[0; rpc_core::auth::NONCE_LEN],
                hello: &hello,
            })
            .unwrap();
        let record = rpc_core::testing::bootstrap::Record::Answer(answer).encode();
        put("gate", "wrong_answer", &with(1, &record));

        // The server: a call of each kind, a cancel, a frame where none is
        // expected, two frames in one write, an unknown method, credits.
        use rpc_core::codegen::prost::Message;
        let frame = |kind, method: usize, timeout_us, md: &[u8], payload: &[u8]| {
            let h = Header {
                flags: match kind {
                    FrameKind::Request if method < 4 => Header::kind_flags(METHODS[method].kind),
                    _ => 0,
                },
                kind,
                status: 0,
                method_id: if method < 4 { METHODS[method].id } else { 0 },
                call_id: CallId(1),
                payload_len: payload.len() as u32,
                metadata_len: md.len() as u16,
                timeout_us,
                ack: 0,
            };
            let mut out = vec![0u8; HEADER_LEN];
            h.encode((&mut out[..]).try_into().unwrap());
            out.extend_from_slice(md);
            out.extend_from_slice(payload);
            out
        };
        let step = |op: u8, imm: u32, offset: u16, bytes: &[u8]| {
            let mut out = vec![op];
            out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
            out.extend_from_slice(&imm.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(bytes);
            out
        };
        let message = |m: &[u8]| m.to_vec().encode_to_vec();
        let tenant = md::encode(&one);
        let none = 0;
        let request = |method| frame(FrameKind::Request, method, 0, &[], &message(b"\x02hi"));
        let msg = frame(FrameKind::Message, 4, 1, &[], &message(b"m"));
        let half_close = frame(FrameKind::HalfClose, 4, 0, &[], &[]);
        let window = frame(FrameKind::Window, 4, 1 << 16, &[], &[]);
        let credit = step(2 | 4, none, 0, &[]);
        let unary = [
            step(
                4,
                none,
                0,
                &frame(FrameKind::Request, 0, 0, &tenant, &message(b"hello")),
            ),
            credit.clone(),
        ];
        put("server", "unary", &unary.concat());
        put(
            "server",
            "server_stream",
            &[
                step(4, none, 0, &request(1)),
                step(4 | 8, none, 0, &window),
                credit.clone(),
            ]
            .concat(),
        );
        put(
            "server",
            "client_stream",
            &[
                step(0, none, 0, &request(2)),
                step(0, none, 0, &msg),
                step(4, none, 0, &msg),
                step(4, none, 0, &half_close),
            ]
            .concat(),
        );
        put(
            "server",
            "bidi",
            &[
                step(4, none, 0, &request(3)),
                step(4, none, 0, &msg),
                step(4 | 8, none, 0, &window),
                step(4, none, 0, &half_close),
                credit.clone(),
            ]
            .concat(),
        );
        // A stream's first frame may be metadata alone (no messages).
        let headers = frame(FrameKind::Message, 4, 0, &tenant, &[]);
        put(
            "server",
            "headers_first",
            &[
                step(0, none, 0, &request(2)),
                step(0, none, 0, &headers),
                step(4, none, 0, &msg),
                step(4, none, 0, &half_close),
            ]
            .concat(),
        );
        let cancel = frame(FrameKind::Cancel, 4, 0, &[], &[]);
        put(
            "server",
            "cancel",
            &[step(4, none, 0, &request(2)), step(4, none, 0, &cancel)].concat(),
        );
        let first = request(0);
        let mut two = first.clone();
        two.resize(align_up(first.len()), 0);
        two.extend(frame(FrameKind::Request, 0, 0, &[], &message(b"second")));
        put("server", "two_in_one", &step(4, none, 0, &two));
        let doorbell = Doorbell::Frame { offset_units: 2 }.encode();
        put(
            "server",
            "misplaced",
            &step(1 | 4, doorbell, (2 * ALIGN) as u16, &request(0)),
        );
        put("server", "unknown", &step(4, none, 0, &request(4)));
    }

    /// The server's seeds each get an answer (all but the cancelled call).
    #[test]
    fn server_seeds_are_answered() {
        let builder = Server::builder().ring_size(SERVER_RING).add_service(Echo);
        let mut peer = FakePeer::new(builder).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/server");
        for name in [
            "unary",
            "server_stream",
            "client_stream",
            "bidi",
            "headers_first",
            "two_in_one",
            "unknown",
        ] {
            let frames = drive(&mut peer, &std::fs::read(dir.join(name)).unwrap());
            println!("{name}: {frames} frames");
            assert!(frames > 0, "{name}: no answer");
        }
    }

    /// Replays every file under `corpus/` through its target.
    #[test]
    fn corpus_replays_cleanly() {
        for (target, run) in super::TARGETS {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("corpus")
                .join(target);
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                run(&std::fs::read(entry.path()).unwrap());
            }
        }
    }
}
