//! Peers that break the tcp:// wire's rules where a well-formed frame
//! cannot show it: acknowledgements of writes never sent, sent bytes never
//! read (in the clear and inside TLS), a handshake dripped a byte at a time (large messages never
//! released: `malformed.rs`), and a server that never answers a
//! `connect_async`. A hand-written peer speaks the soft fabric's wire (see
//! rpc-core/src/fabric/soft/tcp.rs); each misbehaviour costs the peer its
//! own connection, and nobody else anything.

#[macro_use]
mod common;

use common::*;
use examples::echo::EchoRequest;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::DESCRIPTOR as ECHO;
use rpc_core::codegen::prost::Message;
use rpc_core::fabric::{FabricUrl, PeerRing};
use rpc_core::testing::bootstrap::{HELLO_LEN, Hello, HelloFabric};
use rpc_core::testing::protocol::{CallId, Doorbell, FrameKind, HEADER_LEN, Header, align_up};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const TAG_WRITE: u8 = 1;
const TAG_WRITE_SIGNALED: u8 = 3;
const TAG_ACK: u8 = 4;
const WRITE_HEADER: usize = 29;

/// The byte stream a raw peer speaks the wire over: a socket, or TLS on it.
trait Wire: Read + Write {
    fn socket(&self) -> &TcpStream;
}

impl Wire for TcpStream {
    fn socket(&self) -> &TcpStream {
        self
    }
}

type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

impl Wire for TlsStream {
    fn socket(&self) -> &TcpStream {
        &self.sock
    }
}

/// A raw tcp:// peer.
struct RawTcp<S: Wire = TcpStream> {
    s: S,
    peer: PeerRing,
    head: usize,
    next_wr: u64,
}

impl RawTcp {
    fn connect(url: &str, ring_len: u64) -> RawTcp {
        let addr = FabricUrl::parse(url).unwrap().socket_addr();
        RawTcp::hello(TcpStream::connect(addr).unwrap(), ring_len)
    }
}

impl RawTcp<TlsStream> {
    /// A raw peer inside TLS, trusting the CA whose certificate is `ca_pem`.
    fn connect_tls(url: &str, ring_len: u64, ca_pem: &str) -> RawTcp<TlsStream> {
        use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
        let addr = FabricUrl::parse(url).unwrap().socket_addr();
        let stream = rustls::StreamOwned::new(conn, TcpStream::connect(addr).unwrap());
        RawTcp::hello(stream, ring_len)
    }
}

impl<S: Wire> RawTcp<S> {
    /// Exchanges hellos over `s`, advertising a ring of `ring_len` bytes.
    fn hello(mut s: S, ring_len: u64) -> RawTcp<S> {
        s.socket().set_read_timeout(Some(LIMIT)).unwrap();
        s.write_all(&tcp_hello(ring_len, 1 << 15).encode()).unwrap();
        let mut reply = [0; HELLO_LEN];
        s.read_exact(&mut reply).expect("the server's hello");
        let peer = Hello::decode(&reply, HelloFabric::Tcp).unwrap().ring;
        RawTcp {
            s,
            peer,
            head: 0,
            next_wr: 1,
        }
    }

    fn write_msg(&mut self, signaled: bool, offset: usize, imm: u32, payload: &[u8]) -> Vec<u8> {
        let mut w = vec![if signaled {
            TAG_WRITE_SIGNALED
        } else {
            TAG_WRITE
        }];
        w.extend_from_slice(&self.next_wr.to_le_bytes());
        self.next_wr += 1;
        w.extend_from_slice(&(self.peer.addr + offset as u64).to_le_bytes());
        w.extend_from_slice(&self.peer.rkey.to_le_bytes());
        w.extend_from_slice(&imm.to_le_bytes());
        w.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        w.extend_from_slice(payload);
        w
    }

    /// The empty credit doorbell every client sends once connected.
    fn first_credit(&mut self) {
        let m = self.write_msg(false, 0, Doorbell::Credit { ack: 0 }.encode(), &[]);
        self.s.write_all(&m).unwrap();
    }

    /// Sends an echo request frame at the ring's head.
    fn send_echo(&mut self, call: u64, payload: &[u8]) {
        let body = EchoRequest {
            payload: payload.to_vec().into(),
        }
        .encode_to_vec();
        let header = Header {
            flags: 0,
            kind: FrameKind::Request,
            status: 0,
            method_id: ECHO.methods[0].id,
            call_id: CallId(call),
            payload_len: body.len() as u32,
            metadata_len: 0,
            timeout_us: 0,
            ack: 0,
        };
        let mut frame = vec![0; HEADER_LEN];
        header.encode((&mut frame[..]).try_into().unwrap());
        frame.extend_from_slice(&body);
        let offset = self.head % self.peer.len as usize;
        assert!(offset + frame.len() <= self.peer.len as usize);
        let imm = Doorbell::Frame {
            offset_units: (offset / 64) as u32,
        }
        .encode();
        let m = self.write_msg(false, offset, imm, &frame);
        self.s.write_all(&m).unwrap();
        self.head += align_up(frame.len());
    }

    /// Reads wire messages until a WRITE carrying a frame (a response) or
    /// the end of the connection or `within` passing. Returns the frame's
    /// header if one came.
    fn next_frame(&mut self, within: Duration) -> Result<Header, String> {
        self.s.socket().set_read_timeout(Some(within)).unwrap();
        let deadline = Instant::now() + within;
        loop {
            if Instant::now() > deadline {
                return Err("timed out".into());
            }
            let mut tag = [0u8; 1];
            match self.s.read_exact(&mut tag) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                    return Err("timed out".into());
                }
                Err(e) => return Err(format!("closed: {e}")),
            }
            match tag[0] {
                1 | 3 => {
                    let mut rest = [0u8; WRITE_HEADER - 1];
                    self.s.read_exact(&mut rest).map_err(|e| e.to_string())?;
                    let len = u32::from_le_bytes(rest[24..28].try_into().unwrap()) as usize;
                    let mut data = vec![0; len];
                    self.s.read_exact(&mut data).map_err(|e| e.to_string())?;
                    if len >= HEADER_LEN {
                        return Header::decode(data[..HEADER_LEN].try_into().unwrap())
                            .map_err(|e| format!("{e:?}"));
                    }
                }
                4 => {
                    let mut rest = [0u8; 8];
                    self.s.read_exact(&mut rest).map_err(|e| e.to_string())?;
                }
                2 => {
                    let mut rest = [0u8; 9];
                    self.s.read_exact(&mut rest).map_err(|e| e.to_string())?;
                    return Err("NAK".into());
                }
                t => return Err(format!("unknown tag {t}")),
            }
        }
    }
}

fn quick_channel(url: &str) -> rpc_core::Channel {
    rpc_core::Channel::builder(url)
        .timeout(Duration::from_secs(3))
        .connect()
        .unwrap()
}

fn echo_ok(client: &EchoClient, what: &str) -> Result<(), String> {
    client
        .echo(echo_request(what, b"x".to_vec(), &[]))
        .wait()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// An `ACK` for a write the server never posted (wr_id far beyond the
/// ones it has used) closes that connection, and nothing else: clients on
/// the same dispatcher and new ones are served, and shutdown is orderly.
#[test]
fn an_ack_for_a_write_never_sent_closes_only_its_connection() {
    watchdog(|| {
        let probe = Probe::new();
        let server = serve(test_server(&probe).dispatchers(1), TCP_ANY);
        let url = server.local_url().to_owned();
        let good = EchoClient::new(quick_channel(&url));
        echo_ok(&good, "before").unwrap();

        let mut raw = RawTcp::connect(&url, 65536);
        raw.first_credit();
        raw.send_echo(1, b"first");
        let h = raw
            .next_frame(Duration::from_secs(3))
            .expect("first answer");
        assert_eq!(h.kind, FrameKind::Response);

        // ACK for wr_id u64::MAX: never posted.
        let mut ack = vec![TAG_ACK];
        ack.extend_from_slice(&u64::MAX.to_le_bytes());
        raw.s.write_all(&ack).unwrap();
        std::thread::sleep(Duration::from_millis(200));

        let after_good = echo_ok(&good, "after");
        let fresh = std::panic::catch_unwind(|| {
            let c = EchoClient::new(quick_channel(&url));
            echo_ok(&c, "fresh")
        });
        raw.send_echo(2, b"second");
        let raw_after = raw.next_frame(Duration::from_secs(3));
        eprintln!("good client after the forged ACK: {after_good:?}");
        eprintln!("new client after the forged ACK: {fresh:?}");
        eprintln!("raw connection after the forged ACK: {raw_after:?}");
        let shutdown =
            std::thread::spawn(move || server.shutdown_timeout(Duration::from_secs(1))).join();
        eprintln!(
            "server shutdown after the forged ACK: {}",
            match &shutdown {
                Ok(()) => "returned".to_owned(),
                Err(p) => format!(
                    "panicked: {:?}",
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or(p.downcast_ref::<&str>().copied())
                ),
            }
        );
        assert!(
            after_good.is_ok(),
            "a client on the same dispatcher: {after_good:?}"
        );
        assert!(matches!(fresh, Ok(Ok(()))), "a new client: {fresh:?}");
        assert!(
            raw_after.is_err(),
            "the lying peer was still served: {raw_after:?}"
        );
        assert!(shutdown.is_ok(), "shutdown panicked");
    });
}

mod unread {
    use super::*;

    /// A peer that sends signaled writes and never reads the
    /// acknowledgements it is owed: once the socket's buffers are full,
    /// what waits for it is bounded, and the connection is closed.
    #[test]
    fn a_peer_that_never_reads_is_closed_at_the_bound() {
        watchdog(|| {
            let probe = Probe::new();
            let server = serve(test_server(&probe), TCP_ANY);
            let url = server.local_url().to_owned();
            let good = EchoClient::new(quick_channel(&url));
            never_reads(RawTcp::connect(&url, 65536), &good);
        });
    }

    /// The same inside TLS, where what waits also includes the records
    /// the session has sealed and the socket has not taken.
    #[test]
    fn a_tls_peer_that_never_reads_is_closed_at_the_bound() {
        watchdog(|| {
            let ca = certs::Ca::new("unread CA");
            let probe = Probe::new();
            let server = serve(
                test_server(&probe)
                    .tls_config(ca.server_config(TCP_ANY))
                    .unwrap(),
                TCP_ANY,
            );
            let url = server.local_url().to_owned();
            let good = rpc_core::Channel::builder(&url)
                .tls_config(ca.client_config())
                .unwrap()
                .timeout(Duration::from_secs(3))
                .connect()
                .unwrap();
            let good = EchoClient::new(good);
            never_reads(RawTcp::connect_tls(&url, 65536, &ca.pem), &good);
        });
    }

    /// Sends signaled writes on `raw` without reading until the server
    /// closes it; checks what that cost the server, and that `good`, on
    /// another connection, is still served.
    fn never_reads<S: Wire>(mut raw: RawTcp<S>, good: &EchoClient) {
        echo_ok(good, "warm").unwrap();
        raw.first_credit();
        let before = rss();
        let mut batch = Vec::new();
        for _ in 0..4096 {
            batch.extend(raw.write_msg(true, 0, Doorbell::Credit { ack: 0 }.encode(), &[]));
        }
        let started = Instant::now();
        let mut sent = 0u64;
        let closed = loop {
            if let Err(e) = raw.s.write_all(&batch) {
                break Some(e);
            }
            sent += 4096;
            if started.elapsed() > Duration::from_secs(15) {
                break None;
            }
        };
        let grown = rss().saturating_sub(before);
        eprintln!(
            "{sent} signaled writes, none of their acks read: {closed:?} after {:?}, grew {} MiB",
            started.elapsed(),
            grown >> 20
        );
        assert!(closed.is_some(), "the peer was never closed");
        assert!(grown < 64 << 20, "grew {} MiB", grown >> 20);
        echo_ok(good, "still").unwrap();
    }
}

mod evil_server {
    use super::*;

    /// A fake tcp:// server: handshakes, waits for the client's first
    /// write, then sends an `ACK` for a write the client never posted. The
    /// process's shared client dispatchers go on serving every channel to
    /// a good server, and new ones connect.
    #[test]
    fn a_lying_server_does_not_break_the_shared_client_dispatchers() {
        watchdog(|| {
            let (evil_url, evil) = fake_tcp_server(1 << 16, 1 << 15, |mut s| {
                // The client's first write (its empty credit doorbell).
                let mut first = [0u8; WRITE_HEADER];
                s.read_exact(&mut first).unwrap();
                let mut ack = vec![TAG_ACK];
                ack.extend_from_slice(&u64::MAX.to_le_bytes());
                s.write_all(&ack).unwrap();
                std::thread::sleep(Duration::from_secs(15));
                drop(s);
            });
            // A good server and several channels to it, on the process's
            // shared client dispatchers.
            let probe = Probe::new();
            let server = serve(test_server(&probe), TCP_ANY);
            let url = server.local_url().to_owned();
            let goods: Vec<_> = (0..4)
                .map(|_| EchoClient::new(quick_channel(&url)))
                .collect();
            for g in &goods {
                echo_ok(g, "before").unwrap();
            }
            let evil_channel = rpc_core::Channel::builder(&evil_url)
                .timeout(Duration::from_secs(2))
                .connect();
            eprintln!("evil channel: {:?}", evil_channel.as_ref().map(|_| ()));
            std::thread::sleep(Duration::from_millis(300));
            let goods = std::sync::Arc::new(goods);
            let results: Vec<_> = (0..4)
                .map(|i| {
                    let goods = goods.clone();
                    let (tx, rx) = std::sync::mpsc::channel();
                    std::thread::spawn(move || {
                        let _ = tx.send(echo_ok(&goods[i], "after"));
                    });
                    rx.recv_timeout(Duration::from_secs(8))
                        .unwrap_or_else(|_| Err("no outcome within 8 s (call deadline 3 s)".into()))
                })
                .collect();
            eprintln!("good channels after the forged ACK: {results:?}");
            let fresh: Vec<_> = (0..4)
                .map(|_| {
                    let url = url.clone();
                    let (tx, rx) = std::sync::mpsc::channel();
                    std::thread::spawn(move || {
                        let r = rpc_core::Channel::builder(&url)
                            .timeout(Duration::from_secs(2))
                            .connect()
                            .map_err(|e| e.to_string())
                            .and_then(|c| echo_ok(&EchoClient::new(c), "fresh"));
                        let _ = tx.send(r);
                    });
                    rx.recv_timeout(Duration::from_secs(8))
                        .unwrap_or_else(|_| Err("no outcome within 8 s".into()))
                })
                .collect();
            eprintln!("new channels to the good server: {fresh:?}");
            assert!(results.iter().all(Result::is_ok), "{results:?}");
            assert!(fresh.iter().all(Result::is_ok), "{fresh:?}");
            std::mem::forget(evil_channel);
            std::mem::forget(goods);
            std::mem::forget(server);
            let _ = evil;
        });
    }
}

mod slow_server_handshake {
    use super::*;

    /// A server that sends its hello one byte at a time, each just inside
    /// the client's connect timeout: `connect` gives up after the connect
    /// timeout, not after one timeout per byte.
    #[test]
    fn connect_timeout_bounds_a_dripping_server() {
        watchdog(|| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let url = format!("tcp://{}", listener.local_addr().unwrap());
            std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut hello = [0; HELLO_LEN];
                s.read_exact(&mut hello).unwrap();
                let reply = tcp_hello(1 << 16, 1 << 15).encode();
                // The first 20 bytes, 800 ms apart; then silence.
                for b in &reply[..20] {
                    if s.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(800));
                }
                std::thread::sleep(Duration::from_secs(30));
            });
            let t = Instant::now();
            let r = rpc_core::Channel::builder(&url)
                .connect_timeout(Duration::from_secs(1))
                .connect();
            let took = t.elapsed();
            eprintln!(
                "connect with a 1 s connect timeout took {took:?}: {:?}",
                r.as_ref().map(|_| ())
            );
            assert!(
                r.is_err(),
                "connected to a server that never finished its hello"
            );
            assert!(took < Duration::from_secs(3), "took {took:?}");
        });
    }
}

mod async_connect {
    use super::*;

    /// `connect_async` runs the handshakes off the executor: a
    /// single-threaded runtime goes on running its other tasks while a
    /// server takes its time, and the connect still ends at its timeout.
    #[test]
    fn connect_async_holds_up_no_executor_thread() {
        watchdog(|| {
            let (silent_url, _silent) = {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let url = format!("tcp://{}", listener.local_addr().unwrap());
                let keep = std::thread::spawn(move || {
                    // Accepts, reads nothing, answers nothing.
                    let (s, _) = listener.accept().unwrap();
                    std::thread::sleep(Duration::from_secs(5));
                    drop(s);
                });
                (url, keep)
            };
            let probe = Probe::new();
            let server = serve(test_server(&probe), TCP_ANY);
            let good_url = server.local_url().to_owned();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
                let counter = ticks.clone();
                let ticker = tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                let t = Instant::now();
                let silent = rpc_core::Channel::builder(&silent_url)
                    .connect_timeout(Duration::from_millis(600))
                    .connect_async()
                    .await;
                let took = t.elapsed();
                let ticked = ticks.load(std::sync::atomic::Ordering::Relaxed);
                assert!(silent.is_err(), "connected to a server that never answered");
                assert!(took < Duration::from_secs(3), "took {took:?}");
                // The runtime's one thread ran the ticker meanwhile.
                assert!(ticked >= 20, "{ticked} ticks in {took:?}");
                let client = EchoClient::connect_async(&good_url).await.unwrap();
                let reply = client
                    .echo(EchoRequest {
                        payload: b"async".to_vec().into(),
                    })
                    .await
                    .unwrap();
                assert_eq!(reply.get_ref().payload, &b"async"[..]);
                ticker.abort();
            });
            server.shutdown();
        });
    }
}
