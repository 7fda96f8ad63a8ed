//! A misbehaving peer, built from the public software fabric API: it
//! connects a raw queue pair to a real server, registers its own receive
//! ring and staging area, and posts frames and doorbells of its choosing.
//!
//! A protocol violation must close that one connection (the raw side sees an
//! error completion and can post no more) while other clients of the same
//! server carry on. A well-formed request the server cannot serve must be
//! answered with an Error frame instead.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::DESCRIPTOR as ECHO;
use examples::echo::{EchoReply, EchoRequest};
use examples::route_guide::RouteGuideService;
use examples::routeguide::route_guide_server::RouteGuideServer;
use rpc_core::codegen::prost::Message;
use rpc_core::fabric::soft::{SoftCq, SoftFabric, SoftQp, SoftRegion};
use rpc_core::fabric::{
    Completion, CompletionKind, CompletionQueue, Fabric, FabricError, FabricUrl, LocalSetup,
    PeerRing, QueuePair, Region, WcStatus, WriteImm,
};
use rpc_core::testing::protocol::{
    ALIGN, CallId, Doorbell, FrameKind, HEADER_LEN, Header, align_up,
};
use rpc_core::{Code, MethodKind, ServerHandle};
use std::time::{Duration, Instant};

/// Size of the raw peer's receive ring (and of its staging area).
const RAW_RING: usize = 65536;

/// A hand-driven connection to a server.
struct Raw {
    /// Keeps the context, and so its shared receive queue, alive.
    _fabric: SoftFabric,
    cq: SoftCq,
    ring: SoftRegion,
    staging: SoftRegion,
    qp: SoftQp,
    peer: PeerRing,
    /// Cumulative bytes placed in the server's ring: the next frame goes at
    /// `head % peer.len`.
    head: usize,
    next_call: u64,
}

/// A frame read from the raw side's ring.
#[derive(Debug)]
struct Received {
    header: Header,
    payload: Vec<u8>,
}

impl Raw {
    fn connect(url: &str) -> Raw {
        Raw::connect_taking(url, (RAW_RING / 2 - HEADER_LEN) as u32)
    }

    /// A connection that takes messages of up to `max_message` bytes.
    fn connect_taking(url: &str, max_message: u32) -> Raw {
        let fabric = SoftFabric::new();
        fabric.post_recv(256).unwrap();
        let ring = fabric.register(RAW_RING, true).unwrap();
        let staging = fabric.register(RAW_RING, false).unwrap();
        let url = FabricUrl::parse(url).unwrap();
        let local = LocalSetup {
            ring: &ring,
            max_message,
            max_streams: 0,
            timeout: LIMIT,
            credential: None,
            tls: None,
        };
        let cq = fabric.create_cq().unwrap();
        let connected = fabric
            .connect(&url, local, &cq)
            .unwrap_or_else(|e| panic!("raw connect to {url}: {e}"));
        Raw {
            cq,
            peer: connected.peer,
            qp: connected.qp,
            _fabric: fabric,
            ring,
            staging,
            head: 0,
            next_call: 1,
        }
    }

    /// Ring offset where the next frame must go.
    fn next_offset(&self) -> usize {
        self.head % self.peer.len as usize
    }

    /// Writes `bytes` at `offset` of the server's ring with immediate `imm`.
    fn post(&mut self, offset: usize, bytes: &[u8], imm: u32) -> Result<(), FabricError> {
        self.staging
            .write(offset, bytes.len(), |buf| buf.copy_from_slice(bytes));
        let wr = WriteImm {
            wr_id: 1,
            local: (!bytes.is_empty()).then_some((&self.staging, offset, bytes.len())),
            remote_addr: self.peer.addr + offset as u64,
            rkey: self.peer.rkey,
            imm,
            signaled: false,
        };
        self.qp.post_write_imm(&wr)
    }

    /// Places `frame` where the next frame must go, with the doorbell that
    /// says so (`imm` overrides it).
    fn send_at_head(&mut self, frame: &[u8], imm: Option<u32>) {
        let offset = self.next_offset();
        assert!(
            offset + frame.len() <= self.peer.len as usize,
            "keep tests off the wrap"
        );
        let imm = imm.unwrap_or(
            Doorbell::Frame {
                offset_units: (offset / ALIGN) as u32,
            }
            .encode(),
        );
        self.post(offset, frame, imm).expect("post a frame");
        self.head += align_up(frame.len().max(1));
    }

    /// A new call id.
    fn call_id(&mut self) -> CallId {
        self.next_call += 1;
        CallId(self.next_call)
    }

    /// Waits for the next completion, up to [`LIMIT`].
    fn completion(&self) -> Completion {
        let deadline = Instant::now() + LIMIT;
        let mut out = Vec::new();
        loop {
            if self.cq.poll(&mut out, 1) == 1 {
                return out[0];
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no completion within {LIMIT:?}");
            self.cq.wait(Some(left.min(Duration::from_millis(100))));
        }
    }

    /// Waits for the server's next frame (skipping credits), and decodes it.
    fn receive(&self) -> Received {
        loop {
            let c = self.completion();
            assert_eq!(c.status, WcStatus::Success, "the connection failed: {c:?}");
            let CompletionKind::RecvImm { imm, byte_len } = c.kind else {
                continue;
            };
            match Doorbell::decode(imm).expect("the server sent a valid immediate") {
                Doorbell::Credit { .. } => continue,
                Doorbell::Frame { offset_units } => {
                    let offset = offset_units as usize * ALIGN;
                    let header = self
                        .ring
                        .read(offset, HEADER_LEN, Header::decode)
                        .expect("the server sent a valid header");
                    assert_eq!(byte_len as usize, header.frame_len());
                    let start = offset + HEADER_LEN + header.metadata_len as usize;
                    let payload =
                        self.ring
                            .read(start, header.payload_len as usize, <[u8]>::to_vec);
                    return Received { header, payload };
                }
            }
        }
    }

    /// Waits until the server has closed this connection: an error completion.
    fn expect_closed(&mut self) {
        loop {
            let c = self.completion();
            if c.status != WcStatus::Success {
                assert_eq!(c.qp_num, self.qp.qp_num());
                break;
            }
            // Frames or credits the server sent before it closed.
        }
        // Nothing more can be posted on a dead queue pair.
        let frame = request_frame(ECHO.methods[0].id, CallId(1), &[], &[]);
        let offset = self.next_offset();
        assert!(
            self.post(offset, &frame, 0).is_err(),
            "posted on a connection the server closed"
        );
    }

    /// An echo round trip on the raw connection: it is in good standing.
    fn echo(&mut self, payload: &[u8]) {
        let call_id = self.call_id();
        let request = EchoRequest {
            payload: payload.to_vec().into(),
        }
        .encode_to_vec();
        self.send_at_head(
            &request_frame(ECHO.methods[0].id, call_id, &[], &request),
            None,
        );
        let reply = self.receive();
        assert_eq!(reply.header.kind, FrameKind::Response, "{reply:?}");
        assert_eq!(reply.header.call_id, call_id);
        assert_eq!(
            EchoReply::decode(&reply.payload[..]).unwrap().payload,
            payload
        );
    }
}

/// The bytes of a frame: header, metadata, payload.
fn frame(header: Header, metadata: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0; HEADER_LEN];
    header.encode((&mut bytes[..]).try_into().unwrap());
    bytes.extend_from_slice(metadata);
    bytes.extend_from_slice(payload);
    bytes
}

fn request_header(
    method_id: u32,
    call_id: CallId,
    metadata_len: usize,
    payload_len: usize,
) -> Header {
    Header {
        flags: Header::kind_flags(kind_of(method_id)),
        kind: FrameKind::Request,
        status: 0,
        method_id,
        call_id,
        payload_len: payload_len as u32,
        metadata_len: metadata_len as u16,
        timeout_us: 0,
        ack: 0,
    }
}

/// The kind of the echo, route guide or health `Watch` method
/// `method_id` (unary for any other), which a well-formed request says.
fn kind_of(method_id: u32) -> MethodKind {
    if method_id == WATCH {
        return MethodKind::ServerStreaming;
    }
    [&ECHO, &examples::routeguide::route_guide_server::DESCRIPTOR]
        .iter()
        .flat_map(|service| service.methods.iter())
        .find(|m| m.id == method_id)
        .map_or(MethodKind::Unary, |m| m.kind)
}

/// A well-formed request frame.
fn request_frame(method_id: u32, call_id: CallId, metadata: &[u8], payload: &[u8]) -> Vec<u8> {
    frame(
        request_header(method_id, call_id, metadata.len(), payload.len()),
        metadata,
        payload,
    )
}

/// A request frame for the echo method, to be spoiled by a test.
fn echo_frame(raw: &mut Raw) -> Vec<u8> {
    let payload = EchoRequest {
        payload: rpc_core::Bytes::from_static(b"spoiled"),
    }
    .encode_to_vec();
    request_frame(ECHO.methods[0].id, raw.call_id(), &[], &payload)
}

/// A server, a well-behaved client of it, and a raw connection that has
/// already completed one call (so the server's first frame is behind it).
fn setup(url: &str) -> (ServerHandle, EchoClient, Raw) {
    let probe = Probe::new();
    let (_, health) = rpc_core::health::service();
    let route_guide = RouteGuideServer::new(RouteGuideService::new());
    let server = serve(
        test_server(&probe)
            .blocking_threads(2)
            .add_service(health)
            .add_service(route_guide),
        url,
    );
    let good = EchoClient::new(channel(server.local_url()));
    check(&good);
    let mut raw = Raw::connect(server.local_url());
    raw.echo(b"hello");
    (server, good, raw)
}

/// The well-behaved client gets answers, and so does a new one.
fn check(good: &EchoClient) {
    let reply = good
        .echo(echo_request("good", b"fine".to_vec(), &[]))
        .wait();
    assert_eq!(reply.unwrap().into_inner().payload, &b"fine"[..]);
}

/// Sends what `spoil` posts on a fresh raw connection, then checks that the
/// server closed the raw connection and nothing else.
fn assert_closes(url: &str, spoil: impl FnOnce(&mut Raw)) {
    let (server, good, mut raw) = setup(url);
    spoil(&mut raw);
    raw.expect_closed();
    check(&good);
    check(&EchoClient::new(channel(server.local_url())));
    bounded("shutdown", move || server.shutdown());
}

on_soft_fabrics! {
    fn bad_header_version_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let mut frame = echo_frame(raw);
            frame[0] = rpc_core::testing::protocol::VERSION + 1;
            raw.send_at_head(&frame, None);
        });
    }
}

on_soft_fabrics! {
    fn unknown_frame_kind_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let mut frame = echo_frame(raw);
            frame[1] = 9;
            raw.send_at_head(&frame, None);
        });
    }
}

on_soft_fabrics! {
    fn reserved_header_flags_close_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let mut frame = echo_frame(raw);
            frame[22] = 1;
            raw.send_at_head(&frame, None);
        });
    }
}

on_soft_fabrics! {
    fn server_bound_kind_from_a_client_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let mut frame = echo_frame(raw);
            frame[1] = FrameKind::Response as u8;
            raw.send_at_head(&frame, None);
        });
    }
}

on_soft_fabrics! {
    fn huge_payload_length_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let header = request_header(ECHO.methods[0].id, raw.call_id(), 0, u32::MAX as usize);
            raw.send_at_head(&frame(header, &[], b"short"), None);
        });
    }
}

on_soft_fabrics! {
    fn length_beyond_the_message_limit_closes_the_connection(url: &str) {
        // The default server accepts up to 1 MiB - 32: claim one byte more
        // (the bytes are not even there).
        assert_closes(url, |raw| {
            let limit = (1 << 20) - HEADER_LEN;
            let header = request_header(ECHO.methods[0].id, raw.call_id(), 1, limit);
            raw.send_at_head(&frame(header, &[0], b""), None);
        });
    }
}

on_soft_fabrics! {
    fn frame_longer_than_the_write_closes_the_connection(url: &str) {
        // A plausible length, but the write carries fewer bytes than it says.
        assert_closes(url, |raw| {
            let header = request_header(ECHO.methods[0].id, raw.call_id(), 0, 200);
            raw.send_at_head(&frame(header, &[], &[0; 10]), None);
        });
    }
}

on_soft_fabrics! {
    fn doorbell_at_the_wrong_offset_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let frame = echo_frame(raw);
            // Neither where the next frame must be nor a wrap to 0.
            let offset = raw.next_offset() + ALIGN;
            let imm = Doorbell::Frame { offset_units: (offset / ALIGN) as u32 }.encode();
            raw.post(offset, &frame, imm).unwrap();
        });
    }
}

on_soft_fabrics! {
    fn invalid_immediate_tag_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let frame = echo_frame(raw);
            let offset_units = (raw.next_offset() / ALIGN) as u32;
            // Tags 0b10 and 0b11 name no doorbell.
            raw.send_at_head(&frame, Some(0b10 << 30 | offset_units));
        });
    }
}

on_soft_fabrics! {
    fn credit_for_bytes_never_sent_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let offset = raw.next_offset();
            raw.post(offset, &[], Doorbell::Credit { ack: 1000 }.encode()).unwrap();
        });
    }
}

on_soft_fabrics! {
    fn a_credit_doorbell_that_carries_bytes_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let offset = raw.next_offset();
            // The ack repeats what the server knows (nothing): only the
            // bytes are wrong.
            raw.post(offset, &[7; 64], Doorbell::Credit { ack: 0 }.encode()).unwrap();
        });
    }
}

on_soft_fabrics! {
    fn requests_the_server_cannot_serve_get_error_frames(url: &str) {
        let (server, good, mut raw) = setup(url);
        let expect_error = |raw: &mut Raw, method_id: u32, metadata: &[u8], payload: &[u8], code: Code| {
            let call_id = raw.call_id();
            raw.send_at_head(&request_frame(method_id, call_id, metadata, payload), None);
            let reply = raw.receive();
            assert_eq!(reply.header.kind, FrameKind::Error, "{reply:?}");
            assert_eq!(reply.header.call_id, call_id, "an answer to another call");
            assert_eq!(reply.header.status, code as u16, "{reply:?}");
            String::from_utf8(reply.payload).expect("error messages are text")
        };
        // An unknown method id.
        let message = expect_error(&mut raw, 0xdead_beef, &[], &[], Code::Unimplemented);
        assert!(message.contains("0xdeadbeef"), "{message}");
        // A payload that is not a valid EchoRequest: field 1 claims 5 bytes, 1 follows.
        let message =
            expect_error(&mut raw, ECHO.methods[0].id, &[], &[0x0a, 0x05, 1], Code::InvalidArgument);
        assert!(message.contains("EchoRequest"), "{message}");
        // A message its frame says is gzip-compressed (encoding bits 3-4 of
        // the flags: 1), which does not inflate.
        let call_id = raw.call_id();
        let mut header = request_header(ECHO.methods[0].id, call_id, 0, 7);
        header.flags |= 1 << 3;
        raw.send_at_head(&frame(header, &[], b"not gz!"), None);
        let reply = raw.receive();
        assert_eq!(reply.header.kind, FrameKind::Error, "{reply:?}");
        assert_eq!(reply.header.status, Code::Internal as u16, "{reply:?}");
        let message = String::from_utf8(reply.payload).unwrap();
        assert!(message.contains("gzip"), "{message}");
        // Metadata that does not parse: a key of 5 bytes with 2 present.
        expect_error(&mut raw, ECHO.methods[0].id, &[5, b'a', b'b'], &[], Code::InvalidArgument);
        // A handler that panics.
        let mut metadata = Vec::new();
        for (k, v) in [("tag", "raw"), ("panic", "raw-boom")] {
            metadata.push(k.len() as u8);
            metadata.extend_from_slice(k.as_bytes());
            metadata.extend_from_slice(&(v.len() as u32).to_le_bytes());
            metadata.extend_from_slice(v.as_bytes());
        }
        let message = expect_error(&mut raw, ECHO.methods[0].id, &metadata, &[], Code::Internal);
        assert!(message.contains("raw-boom"), "{message}");
        // None of that harmed the connection or the server.
        raw.echo(b"still here");
        check(&good);
        drop(raw);
        check(&good);
        bounded("shutdown", move || server.shutdown());
    }
}

/// The id of the health service's `Watch`, a server-streaming rpc.
const WATCH: u32 = rpc_core::codegen::method_id("/grpc.health.v1.Health/Watch");

/// A frame of a call after its request: no metadata, `value` in the
/// timeout field (a window grant).
fn call_frame(kind: FrameKind, call_id: CallId, value: u32, payload: &[u8]) -> Vec<u8> {
    let mut header = request_header(0, call_id, 0, payload.len());
    header.kind = kind;
    header.timeout_us = value;
    frame(header, &[], payload)
}

/// Opens a health `Watch` on the raw connection and takes its first message.
fn open_watch(raw: &mut Raw) -> CallId {
    let call_id = raw.call_id();
    let request = rpc_core::health::HealthCheckRequest::default().encode_to_vec();
    raw.send_at_head(&request_frame(WATCH, call_id, &[], &request), None);
    let first = raw.receive();
    assert_eq!(first.header.kind, FrameKind::Message, "{first:?}");
    assert_eq!(first.header.call_id, call_id);
    call_id
}

on_soft_fabrics! {
    fn a_request_message_on_a_server_stream_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let call_id = open_watch(raw);
            raw.send_at_head(&call_frame(FrameKind::Message, call_id, 0, b"no"), None);
        });
    }
}

on_soft_fabrics! {
    fn a_batch_that_does_not_hold_its_count_closes_the_connection(url: &str) {
        // RecordRoute is client-streaming: its requests are Message frames.
        const RECORD_ROUTE: u32 =
            rpc_core::codegen::method_id("/routeguide.RouteGuide/RecordRoute");
        let point = examples::routeguide::Point { latitude: 1, longitude: 2 }.encode_to_vec();
        let mut two = Vec::new();
        for _ in 0..2 {
            two.extend_from_slice(&(point.len() as u32).to_le_bytes());
            two.extend_from_slice(&point);
        }
        // Announced three, holds two; announced none; a length past the end.
        let mut past_the_end = two.clone();
        past_the_end[0] = 200;
        for (count, payload) in [(3, two.clone()), (0, two.clone()), (2, past_the_end)] {
            assert_closes(url, |raw| {
                let call_id = raw.call_id();
                raw.send_at_head(&request_frame(RECORD_ROUTE, call_id, &[], &[]), None);
                raw.send_at_head(&call_frame(FrameKind::Message, call_id, count, &payload), None);
            });
        }
    }
}

on_soft_fabrics! {
    fn a_frame_of_metadata_only_after_a_message_closes_the_connection(url: &str) {
        const RECORD_ROUTE: u32 =
            rpc_core::codegen::method_id("/routeguide.RouteGuide/RecordRoute");
        let point = examples::routeguide::Point { latitude: 1, longitude: 2 }.encode_to_vec();
        assert_closes(url, |raw| {
            let call_id = raw.call_id();
            raw.send_at_head(&request_frame(RECORD_ROUTE, call_id, &[], &[]), None);
            raw.send_at_head(&call_frame(FrameKind::Message, call_id, 1, &point), None);
            raw.send_at_head(&call_frame(FrameKind::Message, call_id, 0, &[]), None);
        });
        // As a stream's first frame it is well-formed: the stream and the
        // connection go on.
        let (server, good, mut raw) = setup(url);
        let call_id = raw.call_id();
        raw.send_at_head(&request_frame(RECORD_ROUTE, call_id, &[], &[]), None);
        raw.send_at_head(&call_frame(FrameKind::Message, call_id, 0, &[]), None);
        raw.send_at_head(&call_frame(FrameKind::Message, call_id, 1, &point), None);
        raw.send_at_head(&call_frame(FrameKind::HalfClose, call_id, 0, &[]), None);
        let summary = raw.receive();
        assert_eq!(summary.header.kind, FrameKind::Response, "{summary:?}");
        assert_eq!(summary.header.call_id, call_id);
        let summary = examples::routeguide::RouteSummary::decode(&summary.payload[..]).unwrap();
        assert_eq!(summary.point_count, 1);
        raw.echo(b"still here");
        check(&good);
        drop(raw);
        bounded("shutdown", move || server.shutdown());
    }
}

on_soft_fabrics! {
    fn a_window_grant_beyond_what_was_sent_closes_the_connection(url: &str) {
        assert_closes(url, |raw| {
            let call_id = open_watch(raw);
            raw.send_at_head(&call_frame(FrameKind::Window, call_id, 1 << 30, &[]), None);
        });
    }
}

on_soft_fabrics! {
    fn stream_frames_of_calls_that_are_not_live_are_ignored(url: &str) {
        let (server, good, mut raw) = setup(url);
        // Frames crossing the end of a call are normal: dropped quietly.
        let gone = raw.call_id();
        for kind in [FrameKind::Message, FrameKind::HalfClose, FrameKind::Window, FrameKind::Cancel] {
            raw.send_at_head(&call_frame(kind, gone, 64, &[]), None);
        }
        raw.echo(b"still here");
        // A cancelled stream ends; its connection goes on.
        let watch = open_watch(&mut raw);
        raw.send_at_head(&call_frame(FrameKind::Cancel, watch, 0, &[]), None);
        raw.echo(b"after a cancel");
        check(&good);
        bounded("shutdown", move || server.shutdown());
    }
}

on_soft_fabrics! {
    /// A stream message lent for a call that is not live (it crossed the
    /// call's end) is not read: its buffer is released at once, and the
    /// connection goes on. Reading it would be wasted, and here, with a
    /// descriptor that grants nothing, would fail the connection.
    fn a_lent_message_of_a_call_that_is_not_live_is_released_unread(url: &str) {
        use rpc_core::testing::protocol::header::{FLAG_LENT, Lent};
        let (server, good, mut raw) = setup(url);
        let gone = raw.call_id();
        let descriptor = Lent { addr: 0, len: 1 << 20, rkey: 0x5eed }.encode();
        let mut frame = call_frame(FrameKind::Message, gone, 1, &descriptor);
        frame[22] = FLAG_LENT as u8;
        raw.send_at_head(&frame, None);
        let released = raw.receive();
        assert_eq!(released.header.kind, FrameKind::Release, "{released:?}");
        assert_eq!((released.header.call_id, released.header.timeout_us), (gone, 0x5eed));
        raw.echo(b"still here");
        check(&good);
        bounded("shutdown", move || server.shutdown());
    }
}

on_soft_fabrics! {
    fn streams_beyond_the_limit_are_refused_and_the_connection_goes_on(url: &str) {
        let (_, health) = rpc_core::health::service();
        let server = serve(
            test_server(&Probe::new()).max_concurrent_streams(2).add_service(health),
            url,
        );
        let mut raw = Raw::connect(server.local_url());
        assert_eq!(raw.peer.max_streams, 2, "the server said its limit");
        raw.echo(b"hello");
        let first = open_watch(&mut raw);
        open_watch(&mut raw);
        // A peer that ignores the limit: its third stream fails, alone.
        let third = raw.call_id();
        let request = rpc_core::health::HealthCheckRequest::default().encode_to_vec();
        raw.send_at_head(&request_frame(WATCH, third, &[], &request), None);
        let refused = raw.receive();
        assert_eq!(refused.header.kind, FrameKind::Error, "{refused:?}");
        assert_eq!(refused.header.call_id, third);
        assert_eq!(Code::from_u16(refused.header.status), Code::ResourceExhausted);
        let why = String::from_utf8_lossy(&refused.payload);
        assert!(why.contains("2 streams") && why.contains("max_concurrent_streams"), "{why}");
        raw.echo(b"unary calls do not count");
        // A cancelled stream frees its place at once.
        raw.send_at_head(&call_frame(FrameKind::Cancel, first, 0, &[]), None);
        open_watch(&mut raw);
        raw.echo(b"still here");
        drop(raw);
        bounded("shutdown", move || server.shutdown());
    }
}

/// A TCP connection to a `tcp://` server that speaks the soft fabric's wire
/// protocol by hand (see `rpc_core::fabric::soft`): the handshake, then
/// `WRITE` messages.
mod tcp_wire {
    use super::*;
    use rpc_core::testing::bootstrap::{HELLO_LEN, Hello, HelloFabric};
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream;

    /// A served echo server, a good client of it, and a raw socket to it.
    fn setup() -> (ServerHandle, EchoClient, TcpStream) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let good = EchoClient::new(channel(server.local_url()));
        check(&good);
        let url = FabricUrl::parse(server.local_url()).unwrap();
        let stream = TcpStream::connect(url.socket_addr()).unwrap();
        stream.set_read_timeout(Some(LIMIT)).unwrap();
        (server, good, stream)
    }

    fn hello(ring_len: u64) -> [u8; HELLO_LEN] {
        tcp_hello(ring_len, 1024).encode()
    }

    /// Reads until the server closes the socket; returns what it sent.
    fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        match stream.read_to_end(&mut got) {
            Ok(_) => got,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => got,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }

    /// Completes the handshake with a valid hello.
    fn handshake(stream: &mut TcpStream) {
        stream.write_all(&hello(RAW_RING as u64)).unwrap();
        let mut reply = [0; HELLO_LEN];
        stream.read_exact(&mut reply).expect("the server's hello");
        Hello::decode(&reply, HelloFabric::Tcp).expect("a valid hello");
    }

    fn finish(server: ServerHandle, good: EchoClient) {
        check(&good);
        check(&EchoClient::new(channel(server.local_url())));
        bounded("shutdown", move || server.shutdown());
    }

    #[test]
    fn silent_peer_does_not_block_other_connections() {
        watchdog(|| {
            let (server, good, stream) = setup();
            // Connected, saying nothing: others still connect and are served.
            finish(server, good);
            drop(stream);
        });
    }

    #[test]
    fn garbage_hello_is_refused() {
        watchdog(|| {
            let (server, good, mut stream) = setup();
            stream.write_all(&[0x5a; HELLO_LEN]).unwrap();
            assert!(read_until_closed(&mut stream).is_empty());
            finish(server, good);
        });
    }

    #[test]
    fn hello_with_a_huge_ring_gets_a_bounded_share_of_it() {
        watchdog(|| {
            // A valid 16 GiB ring: the server uses (and stages for) only the
            // 64 MiB it stages for at most, instead of allocating that much for
            // a stranger, and tells the client so in its hello.
            let (server, good, mut stream) = setup();
            stream.write_all(&hello(1 << 34)).unwrap();
            let mut reply = [0; HELLO_LEN];
            stream.read_exact(&mut reply).expect("the server's hello");
            let theirs = Hello::decode(&reply, HelloFabric::Tcp).expect("a valid hello");
            assert_eq!(theirs.ring.len, 256 << 10, "the server's own ring");
            // Its message limit is its own setting: larger messages than
            // the ring holds travel by rendezvous.
            assert_eq!(theirs.ring.max_message, 64 << 20, "{theirs:?}");
            assert_eq!(
                theirs.ring.max_streams,
                rpc_core::server::DEFAULT_MAX_CONCURRENT_STREAMS,
                "{theirs:?}"
            );
            drop(stream);
            finish(server, good);
        });
    }

    #[test]
    fn unknown_wire_message_closes_the_connection() {
        watchdog(|| {
            let (server, good, mut stream) = setup();
            handshake(&mut stream);
            stream.write_all(&[0x99; 32]).unwrap();
            read_until_closed(&mut stream);
            finish(server, good);
        });
    }

    #[test]
    fn write_with_a_bad_rkey_is_refused() {
        watchdog(|| {
            let (server, good, mut stream) = setup();
            handshake(&mut stream);
            // WRITE: tag, wr_id, remote_addr, rkey, imm, len, data.
            let mut write = vec![1u8];
            write.extend_from_slice(&7u64.to_le_bytes());
            write.extend_from_slice(&0x1000u64.to_le_bytes());
            write.extend_from_slice(&0xdead_beefu32.to_le_bytes());
            write.extend_from_slice(&0u32.to_le_bytes());
            write.extend_from_slice(&4u32.to_le_bytes());
            write.extend_from_slice(&[1, 2, 3, 4]);
            stream.write_all(&write).unwrap();
            // NAK: tag 2, the write's wr_id, status 1 (remote access).
            let got = read_until_closed(&mut stream);
            let mut nak = vec![2u8];
            nak.extend_from_slice(&7u64.to_le_bytes());
            nak.push(1);
            assert_eq!(got, nak);
            finish(server, good);
        });
    }
}

/// A peer that completes the handshake and then stops reading.
mod stalled_peer {
    use super::*;

    #[test]
    fn peer_that_stops_reading_does_not_hang_callers() {
        watchdog(|| {
            // A hand-made tcp:// server with a 64 MiB ring that completes the
            // handshake and then never reads: TCP buffers fill up long before
            // the ring does.
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let ring = 64 << 20;
            let (url, peer) =
                fake_tcp_server(ring, (ring / 2) as u32 - HEADER_LEN as u32, move |s| {
                    let _ = done_rx.recv_timeout(LIMIT);
                    drop(s);
                });
            let echo = EchoClient::new(channel(&url));
            let started = Instant::now();
            // 40 MiB of requests, each with a short deadline: starting them
            // must not block, and each must time out.
            let (_echo, calls) = bounded("starting calls to a stalled peer", move || {
                let calls: Vec<_> = (0..40)
                    .map(|i| {
                        let mut request = echo_request(&format!("c{i}"), vec![1; 1 << 20], &[]);
                        request.set_timeout(Duration::from_millis(300));
                        echo.echo(request)
                    })
                    .collect();
                (echo, calls)
            });
            for call in calls {
                expect_code(call.wait(), Code::DeadlineExceeded);
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "took {:?}",
                started.elapsed()
            );
            done_tx.send(()).unwrap();
            peer.join().unwrap();
        });
    }
}

/// Zero-length credit doorbells the raw side receives within `window`,
/// and whether anything else (a frame, an error) came.
fn heartbeats_within(raw: &Raw, window: Duration) -> usize {
    let end = Instant::now() + window;
    let mut beats = 0;
    let mut out = Vec::new();
    while Instant::now() < end {
        out.clear();
        if raw.cq.poll(&mut out, 16) == 0 {
            raw.cq.wait(Some(Duration::from_millis(10)));
            continue;
        }
        for c in &out {
            assert_eq!(c.status, WcStatus::Success, "the connection failed: {c:?}");
            let CompletionKind::RecvImm { imm, byte_len } = c.kind else {
                continue;
            };
            assert!(
                matches!(Doorbell::decode(imm), Some(Doorbell::Credit { .. })),
                "an idle server sends only credit doorbells, got {imm:#x}"
            );
            assert_eq!(byte_len, 0, "a heartbeat carries no bytes");
            beats += 1;
        }
    }
    beats
}

/// The heartbeats a raw client on `url` sees within `window` of a server
/// beating every `interval`, between two echoes that show the connection
/// in good standing before and after.
fn idle_beats(url: &str, interval: Option<Duration>, window: Duration) -> usize {
    let probe = Probe::new();
    let server = serve(test_server(&probe).heartbeat(interval), url);
    let mut raw = Raw::connect(server.local_url());
    raw.echo(b"hello");
    let beats = heartbeats_within(&raw, window);
    raw.echo(b"after");
    drop(raw);
    bounded("shutdown", move || server.shutdown());
    beats
}

on_soft_fabrics! {
    fn an_idle_connection_beats_at_the_configured_interval(url: &str) {
        // Every 100 ms: a beat after 100-150 ms of silence, so 8-10 in a
        // second (fewer if this machine is slow; never none).
        let beats = idle_beats(url, Some(Duration::from_millis(100)), Duration::from_secs(1));
        assert!((3..=11).contains(&beats), "{beats} heartbeats in 1 s");
        // Turned off: none.
        assert_eq!(idle_beats(url, None, Duration::from_millis(1500)), 0);
    }
}

/// From a second up, a tcp:// server leaves a quiet connection's probing
/// to the kernel's keepalive: its client's process sees no heartbeat at
/// all, and the connection stays in good standing.
#[test]
fn a_tcp_heartbeat_of_a_second_is_the_kernels_keepalive() {
    watchdog(|| {
        let beats = idle_beats(
            TCP_ANY,
            Some(Duration::from_secs(1)),
            Duration::from_millis(3500),
        );
        assert_eq!(beats, 0);
    });
}

#[test]
fn a_heartbeat_interval_below_the_minimum_is_refused() {
    let short = rpc_core::MIN_HEARTBEAT / 2;
    let err = rpc_core::Server::builder()
        .heartbeat(Some(short))
        .serve(TCP_ANY)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = rpc_core::Channel::builder("tcp://127.0.0.1:1")
        .heartbeat(Some(short))
        .connect()
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
}

/// A client that asks for large responses (which the server lends) and
/// never releases them: the server lends a connection at most 256 MiB at a
/// time; past that its responses fail with `ResourceExhausted`, and the
/// peer holds no more of the server's memory. Other clients are served.
#[test]
fn loans_never_released_are_bounded() {
    watchdog(|| {
        const N: usize = 256;
        const REPLY: usize = 4 << 20;
        let (server, good, _) = setup(TCP_ANY);
        let mut raw = Raw::connect_taking(server.local_url(), 64 << 20);
        let mut md = rpc_core::Metadata::new();
        md.insert("reply-len", REPLY.to_string()).unwrap();
        let md = rpc_core::testing::metadata::encode(&md);
        let before = rss();
        let (mut lent, mut refused) = (0, 0);
        for _ in 0..N {
            let id = raw.call_id();
            raw.send_at_head(&request_frame(ECHO.methods[0].id, id, &md, &[]), None);
            let h = raw.receive().header;
            assert_eq!(h.call_id, id, "{h:?}");
            if h.kind == FrameKind::Response && h.is_lent() {
                assert_eq!(refused, 0, "a loan after a refusal: {h:?}");
                lent += 1;
            } else {
                assert_eq!(h.kind, FrameKind::Error, "{h:?}");
                assert_eq!(h.status, Code::ResourceExhausted as u16, "{h:?}");
                refused += 1;
            }
        }
        let grown = rss().saturating_sub(before);
        eprintln!(
            "{lent} responses lent and never released, {refused} refused; grew {} MiB",
            grown >> 20
        );
        // 256 MiB of 4 MiB payloads and their few bytes of encoding.
        assert_eq!(lent, 63);
        // What was lent, and the handler's replies the allocator keeps for
        // reuse: about 390 MiB, however many calls are refused, and other
        // tests run meanwhile. Without the bound, 256 loans would hold
        // 1 GiB alone.
        assert!(grown < 800 << 20, "grew {} MiB", grown >> 20);
        check(&good);
        drop(raw);
        server.shutdown();
    });
}
