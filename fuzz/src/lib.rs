//! Shared by the fuzz targets: the one-line body of each, so that a crash
//! found by AFL can be replayed as a plain test (`cargo test` here).

use rpc_core::testing::bootstrap::{HELLO_LEN, Hello, HelloFabric, client_exchange};
use rpc_core::testing::protocol::{ALIGN, Doorbell, HEADER_LEN, Header, Receiver};
use std::io::{Read, Write};

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
        },
    }
}

/// The server's side of the handshake as a client reads it: any bytes
/// from a server (hello, challenge, proof, refusal records) end in a hello
/// or an error, never a panic or a hang (the input is finite).
pub fn handshake_client(data: &[u8]) {
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

/// A target's body.
pub type Target = fn(&[u8]);

/// Every target by name, as `src/bin/<name>.rs` and `corpus/<name>/` call it.
pub const TARGETS: [(&str, Target); 4] = [
    ("frame_header", frame_header),
    ("hello", hello),
    ("handshake_client", handshake_client),
    ("receiver", receiver),
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
