//! The out-of-band handshake that exchanges endpoints.
//!
//! Over a TCP connection on the URL's port, each side sends one fixed-size
//! [`Hello`]: queue pair number, packet sequence number, LID and GID (for
//! verbs), its receive ring (address, length, rkey), the largest message
//! it accepts and, from a server, the most streams it serves at once on the
//! connection (0: no limit said; a peer of an earlier build sends 0). The client speaks first. A server that requires a credential
//! then sends a challenge [record](Record), the client answers, and the
//! server proves itself; a server that will not take the connection says
//! why in a refusal record. The server answers with its own hello once it is
//! ready for traffic. Everything received is validated before use, and reads
//! time out. The server side of all this, up to the hello it reads, is the
//! gate (`fabric/gate.rs`).

use crate::Code;
use crate::auth::{Challenge, Credential, MAX_AUTH_LEN, NONCE_LEN};
use crate::fabric::tls::{self, ClientTls, Session};
use crate::fabric::{FabricError, FabricUrl, PeerRing};
use crate::protocol::ring;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Size of an encoded [`Hello`].
pub const HELLO_LEN: usize = 64;
pub(crate) const MAGIC: &[u8; 8] = b"RDMARPC\0";
/// 9: a `Request` says its call's kind (flags), and a server refuses a
/// call of another kind than its method's (a peer of version 8 closes the
/// connection on the flags).
/// 8: a `Message` frame may carry no messages, only a stream's initial
/// metadata (a peer of version 7 closes the connection on one).
/// 7: a stream message costs at most half the window (up to 64 MiB), and
/// one above that at most 2 GiB; a peer counting the old way would see its
/// window overrun or never granted back.
const HELLO_VERSION: u16 = 9;

/// Which fabric a handshake sets up (both sides must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HelloFabric {
    /// The soft fabric over TCP: the same connection then carries the writes.
    Tcp = 1,
    /// Real RDMA: the connection stays open as a liveness channel.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Rdma = 2,
}

/// One side's endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The fabric.
    pub fabric: HelloFabric,
    /// Queue pair number.
    pub qp_num: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID.
    pub gid: [u8; 16],
    /// Active path MTU as an `ibv_mtu` value (1 = 256 .. 5 = 4096); 0 when
    /// not applicable. Both sides use the smaller.
    pub mtu: u8,
    /// The receive ring the peer writes into.
    pub ring: PeerRing,
}

impl Hello {
    /// The wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..10].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        b[10] = self.fabric as u8;
        b[11] = self.mtu;
        b[12..16].copy_from_slice(&self.qp_num.to_le_bytes());
        b[16..20].copy_from_slice(&self.psn.to_le_bytes());
        b[20..22].copy_from_slice(&self.lid.to_le_bytes());
        let max_streams = u16::try_from(self.ring.max_streams).unwrap_or(u16::MAX);
        b[22..24].copy_from_slice(&max_streams.to_le_bytes());
        b[24..40].copy_from_slice(&self.gid);
        b[40..48].copy_from_slice(&self.ring.addr.to_le_bytes());
        b[48..56].copy_from_slice(&self.ring.len.to_le_bytes());
        b[56..60].copy_from_slice(&self.ring.rkey.to_le_bytes());
        b[60..64].copy_from_slice(&self.ring.max_message.to_le_bytes());
        b
    }

    /// Parses and validates untrusted bytes from a peer that should speak `fabric`.
    pub fn decode(b: &[u8; HELLO_LEN], fabric: HelloFabric) -> Result<Hello, String> {
        if &b[0..8] != MAGIC {
            return Err("peer is not an rdma-rpc endpoint (bad magic)".into());
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != HELLO_VERSION {
            return Err(format!(
                "peer speaks handshake version {version}, this build speaks {HELLO_VERSION}"
            ));
        }
        if b[11] > 5 {
            return Err(format!("peer announced an invalid path MTU code {}", b[11]));
        }
        if b[10] != fabric as u8 {
            return Err(format!(
                "peer set up fabric {} but this side expects {:?}",
                b[10], fabric
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let ring = PeerRing {
            addr: u64_at(40),
            len: u64_at(48),
            rkey: u32_at(56),
            max_message: u32_at(60),
            max_streams: u32::from(u16::from_le_bytes([b[22], b[23]])),
        };
        let len =
            usize::try_from(ring.len).map_err(|_| format!("ring length {} too large", ring.len))?;
        ring::check_capacity(len).map_err(|e| format!("peer ring: {e}"))?;
        if ring.addr.checked_add(ring.len).is_none() {
            return Err("peer ring address range overflows".into());
        }
        let psn = u32_at(16);
        if psn >= 1 << 24 {
            return Err(format!("peer psn {psn:#x} exceeds 24 bits"));
        }
        Ok(Hello {
            fabric,
            qp_num: u32_at(12),
            psn,
            lid: u16::from_le_bytes([b[20], b[21]]),
            gid: b[24..40].try_into().expect("16 bytes"),
            mtu: b[11],
            ring,
        })
    }
}

/// A listening socket on `addr` with the system's largest backlog.
pub(crate) fn listen(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // As the standard library does: a restarted server rebinds at once.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    // The kernel caps the backlog at net.core.somaxconn.
    socket.listen(i32::from(u16::MAX))?;
    Ok(socket.into())
}

/// Connects to the URL's host and port, trying each address it resolves to.
pub fn dial(url: &FabricUrl, timeout: Duration) -> Result<TcpStream, FabricError> {
    let target = url.socket_addr();
    let addrs = target.to_socket_addrs().map_err(|e| {
        FabricError::unreachable("connect", format!("cannot resolve {target}: {e}"))
    })?;
    first_of(addrs, |a| TcpStream::connect_timeout(&a, timeout))
        .map_err(|e| FabricError::unreachable("connect", format!("{url}: {e}")))
}

/// What `f` makes of the first address it succeeds with, or the last
/// address's error.
pub(crate) fn first_of<T>(
    addrs: impl Iterator<Item = std::net::SocketAddr>,
    mut f: impl FnMut(std::net::SocketAddr) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let mut last = None;
    for a in addrs {
        match f(a) {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the address resolves to nothing")))
}

/// TCP keepalive on every handshake connection that stays open (the
/// tcp:// data connection; the rdma:// liveness channel): first probe after
/// this much silence (seconds)...
pub const KEEPALIVE_IDLE_S: u32 = 10;
/// ...then one probe every this many seconds...
pub const KEEPALIVE_INTERVAL_S: u32 = 2;
/// ...and the connection is declared dead after this many unanswered.
pub const KEEPALIVE_PROBES: u32 = 5;
/// The longest a dead host on an idle connection goes unnoticed:
/// 10 s + 5 × 2 s = 20 s. Unacknowledged data is bounded the same way by
/// `TCP_USER_TIMEOUT`.
pub const KEEPALIVE_BOUND: Duration =
    Duration::from_secs((KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES) as u64);

/// Turns on TCP keepalive (see [`KEEPALIVE_BOUND`]) and bounds how long
/// sent data may stay unacknowledged, so a host that vanished without
/// closing the connection is noticed on an idle connection too.
pub fn set_keepalive(stream: &TcpStream) -> Result<(), FabricError> {
    keep_alive(
        stream,
        Duration::from_secs(u64::from(KEEPALIVE_IDLE_S)),
        Duration::from_secs(u64::from(KEEPALIVE_INTERVAL_S)),
        KEEPALIVE_PROBES,
        Some(KEEPALIVE_BOUND),
    )
}

/// Turns on TCP keepalive on `stream`: a first probe after `idle` of
/// silence, then one every `interval`, the connection failed after
/// `probes` unanswered; and bounds how long sent data may stay
/// unacknowledged by `user_timeout` (`None`: no bound of its own).
pub(crate) fn keep_alive(
    stream: &TcpStream,
    idle: Duration,
    interval: Duration,
    probes: u32,
    user_timeout: Option<Duration>,
) -> Result<(), FabricError> {
    let sock = socket2::SockRef::from(stream);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(probes);
    sock.set_tcp_keepalive(&keepalive)
        .map_err(|e| FabricError::io("setsockopt(SO_KEEPALIVE)", e))?;
    sock.set_tcp_user_timeout(user_timeout)
        .map_err(|e| FabricError::io("setsockopt(TCP_USER_TIMEOUT)", e))
}

/// Sends a hello.
pub fn send(stream: &mut impl Write, hello: &Hello) -> Result<(), FabricError> {
    stream
        .write_all(&hello.encode())
        .and_then(|()| stream.flush())
        .map_err(|e| {
            tls::client_failure(&e).unwrap_or_else(|| FabricError::io("handshake send", e))
        })
}

pub use crate::fabric::record::Record;
use crate::fabric::record::{
    TAG_ANSWER, TAG_CHALLENGE, TAG_PROOF, TAG_REFUSED, read_refusal_with, read_within,
    refused_by_server,
};

/// The answer record a gate reads: its tag and length, validated.
pub(crate) const ANSWER_HEAD: usize = 10;

/// The body length an answer record's head announces, validated.
pub(crate) fn answer_len(head: &[u8; ANSWER_HEAD]) -> Result<usize, String> {
    if &head[..8] != TAG_ANSWER {
        return Err("the peer did not answer the authentication challenge".into());
    }
    let len = usize::from(u16::from_le_bytes([head[8], head[9]]));
    if len > MAX_AUTH_LEN {
        return Err(format!(
            "authentication answer of {len} bytes, more than {MAX_AUTH_LEN}"
        ));
    }
    Ok(len)
}

/// Runs the client side after its hello was sent: answers a challenge with
/// `credential`, checks the server's proof, and returns the server's hello.
/// A refusal becomes an error with the server's status code and reason.
pub fn client_exchange(
    stream: &mut (impl Read + Write),
    sent: &Hello,
    fabric: HelloFabric,
    credential: Option<&dyn Credential>,
) -> Result<Hello, FabricError> {
    let sent = sent.encode();
    let mut answered: Option<([u8; NONCE_LEN], Vec<u8>)> = None;
    let mut proven = false;
    loop {
        let mut tag = [0u8; 8];
        read_exact(stream, &mut tag)?;
        match &tag {
            t if t == MAGIC => {
                let mut b = [0u8; HELLO_LEN];
                b[..8].copy_from_slice(&tag);
                read_exact(stream, &mut b[8..])?;
                if credential.is_some() && !proven {
                    return Err(unauthenticated(UNPROVEN_SERVER));
                }
                return Hello::decode(&b, fabric)
                    .map_err(|why| FabricError::protocol("handshake", why));
            }
            TAG_REFUSED => {
                let (code, why) = refusal_body(stream)?;
                return Err(refused_by_server(code, &why));
            }
            TAG_CHALLENGE if answered.is_none() => {
                let body = read_body(stream, NONCE_LEN)?;
                let nonce: [u8; NONCE_LEN] = body.try_into().map_err(|_| {
                    FabricError::protocol("handshake", "malformed authentication challenge")
                })?;
                let credential = credential.ok_or_else(|| unauthenticated(NO_CREDENTIAL))?;
                let answer = credential
                    .answer(&Challenge {
                        nonce: &nonce,
                        hello: &sent,
                    })
                    .map_err(unauthenticated)?;
                if answer.len() > MAX_AUTH_LEN {
                    return Err(FabricError::invalid(
                        "handshake",
                        format!(
                            "credential answer of {} bytes, more than {MAX_AUTH_LEN}",
                            answer.len()
                        ),
                    ));
                }
                stream
                    .write_all(&Record::Answer(answer.clone()).encode())
                    .and_then(|()| stream.flush())
                    .map_err(|e| FabricError::io("handshake send", e))?;
                answered = Some((nonce, answer));
            }
            TAG_PROOF if !proven => {
                let proof = read_body(stream, MAX_AUTH_LEN)?;
                let (Some((nonce, answer)), Some(credential)) = (&answered, credential) else {
                    return Err(FabricError::protocol(
                        "handshake",
                        "a proof before any challenge",
                    ));
                };
                credential
                    .check(
                        &Challenge {
                            nonce,
                            hello: &sent,
                        },
                        answer,
                        &proof,
                    )
                    .map_err(|why| FabricError::refused(Code::Unauthenticated, "handshake", why))?;
                proven = true;
            }
            t if tls::is_tls_record(t) => {
                return Err(FabricError::refused(
                    Code::Unavailable,
                    "handshake",
                    "the server speaks TLS and this channel does not \
                     (see ChannelBuilder::tls_config)",
                ));
            }
            _ => {
                return Err(FabricError::protocol(
                    "handshake",
                    "peer is not an rdma-rpc endpoint (unexpected handshake message)",
                ));
            }
        }
    }
}

/// A refusal record's code and reason, after its tag.
fn refusal_body(stream: &mut impl Read) -> Result<(Code, String), FabricError> {
    read_refusal_with(|b| read_exact(stream, b))
}

/// A handshake connection: the socket, and its TLS session if it has one.
/// Reads and writes block (within the socket's timeouts) and go through
/// TLS when there is a session.
#[derive(Debug)]
pub struct Link {
    /// The TCP connection.
    pub stream: TcpStream,
    /// Its TLS state, when the connection uses TLS.
    pub tls: Option<Session>,
    /// When the handshake must be over: every read waits only until then
    /// (a peer that sends a byte now and then cannot stretch it).
    pub deadline: Option<Instant>,
}

impl Link {
    /// A connection to the server at `url`, after the TLS handshake if
    /// `tls` is given; the handshakes must be over by `deadline`.
    pub(crate) fn client(
        mut stream: TcpStream,
        tls: Option<&ClientTls>,
        url: &FabricUrl,
        deadline: Instant,
    ) -> Result<Link, FabricError> {
        let tls = match tls {
            Some(tls) => Some(tls::client_handshake(&mut stream, tls, url, deadline)?),
            None => None,
        };
        Ok(Link {
            stream,
            tls,
            deadline: Some(deadline),
        })
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.tls {
            None => {
                read_within(&self.stream, self.deadline)?;
                self.stream.read(buf)
            }
            Some(s) => s.read_blocking(&self.stream, buf, self.deadline),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.tls {
            None => self.stream.write(buf),
            Some(s) => s.write_blocking(&self.stream, buf).map(|()| buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.tls {
            None => self.stream.flush(),
            Some(s) => s.flush_blocking(&self.stream),
        }
    }
}

/// Why a server that asks for a credential refuses a client without one.
pub(crate) const NO_CREDENTIAL: &str = "the server requires a credential and this channel has none \
     (see ChannelBuilder::credential)";

/// Why a client with a credential refuses a server that did not prove it
/// knows it.
pub(crate) const UNPROVEN_SERVER: &str = "the server did not authenticate itself (it asks no credential); \
     this channel has one and will not talk to it";

/// A client's handshake failing authentication, on any fabric.
pub(crate) fn unauthenticated(why: impl Into<String>) -> FabricError {
    FabricError::refused(Code::Unauthenticated, "handshake", why)
}

/// Reads a `u16` length and at most `max` bytes.
fn read_body(stream: &mut impl Read, max: usize) -> Result<Vec<u8>, FabricError> {
    let mut len = [0u8; 2];
    read_exact(stream, &mut len)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > max {
        return Err(FabricError::protocol(
            "handshake",
            format!("handshake record of {len} bytes, more than {max}"),
        ));
    }
    let mut b = vec![0u8; len];
    read_exact(stream, &mut b)?;
    Ok(b)
}

fn read_exact(stream: &mut impl Read, b: &mut [u8]) -> Result<(), FabricError> {
    stream.read_exact(b).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            FabricError::unreachable("handshake", "timed out waiting for the peer's endpoint")
        }
        std::io::ErrorKind::UnexpectedEof => {
            FabricError::unreachable("handshake", "peer closed during the handshake")
        }
        _ => tls::client_failure(&e).unwrap_or_else(|| FabricError::io("handshake recv", e)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections that stay open (tcp:// data, rdma:// liveness) have
    /// keepalive on, with the documented bound.
    #[test]
    fn keepalive_is_set_with_the_documented_bound() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        set_keepalive(&stream).unwrap();
        let sock = socket2::SockRef::from(&stream);
        assert!(sock.keepalive().unwrap());
        let idle = sock.tcp_keepalive_time().unwrap();
        let interval = sock.tcp_keepalive_interval().unwrap();
        let probes = sock.tcp_keepalive_retries().unwrap();
        assert_eq!(idle, Duration::from_secs(u64::from(KEEPALIVE_IDLE_S)));
        assert_eq!(
            interval,
            Duration::from_secs(u64::from(KEEPALIVE_INTERVAL_S))
        );
        assert_eq!(probes, KEEPALIVE_PROBES);
        assert_eq!(idle + interval * probes, KEEPALIVE_BOUND);
        assert_eq!(sock.tcp_user_timeout().unwrap(), Some(KEEPALIVE_BOUND));
    }

    fn hello() -> Hello {
        Hello {
            fabric: HelloFabric::Rdma,
            qp_num: 17,
            psn: 0x12_3456,
            lid: 3,
            gid: [7; 16],
            mtu: 3,
            ring: PeerRing {
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: 0xabcd,
                max_message: 4096,
                max_streams: 100,
            },
        }
    }

    #[test]
    fn round_trips() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode(), HelloFabric::Rdma), Ok(h));
    }

    #[test]
    fn rejects_what_it_cannot_use() {
        let h = hello();
        assert!(
            Hello::decode(&h.encode(), HelloFabric::Tcp)
                .unwrap_err()
                .contains("fabric")
        );
        let mut b = h.encode();
        b[0] = b'X';
        assert!(
            Hello::decode(&b, HelloFabric::Rdma)
                .unwrap_err()
                .contains("magic")
        );
        let bad = |f: fn(&mut Hello)| {
            let mut h = hello();
            f(&mut h);
            Hello::decode(&h.encode(), HelloFabric::Rdma).unwrap_err()
        };
        assert!(bad(|h| h.ring.len = 3000).contains("ring"));
        assert!(bad(|h| h.ring.addr = u64::MAX - 10).contains("overflows"));
        assert!(bad(|h| h.psn = 1 << 24).contains("psn"));
    }

    /// A stream that replays `input` and swallows what is written.
    struct Replay<'a>(&'a [u8]);

    impl Read for Replay<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl Write for Replay<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn exchange(input: &[u8], credential: Option<&dyn Credential>) -> Result<Hello, FabricError> {
        client_exchange(&mut Replay(input), &hello(), HelloFabric::Rdma, credential)
    }

    #[test]
    fn truncated_input_times_out_or_fails_cleanly() {
        let e = exchange(&[1, 2, 3], None).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        let full = hello().encode();
        for n in 0..full.len() {
            assert!(exchange(&full[..n], None).is_err());
        }
        assert_eq!(exchange(&full, None).unwrap(), hello());
    }

    #[test]
    fn a_refusal_carries_the_servers_code_and_reason() {
        let refusal = Record::Refused(
            Code::ResourceExhausted,
            "at its limit of 3 connections".into(),
        );
        let e = exchange(&refusal.encode(), None).unwrap_err();
        let status = crate::Status::from(e);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status.message().contains("at its limit of 3 connections"),
            "{status}"
        );
        // A long reason is cut to its limit at a character boundary.
        let long = Record::Refused(Code::Unavailable, "é".repeat(400)).encode();
        let status = crate::Status::from(exchange(&long, None).unwrap_err());
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().ends_with('é'));
    }

    #[test]
    fn a_challenge_needs_a_credential_and_a_credential_needs_a_proof() {
        let challenge = Record::Challenge([9; NONCE_LEN]).encode();
        let e = crate::Status::from(exchange(&challenge, None).unwrap_err());
        assert_eq!(e.code(), Code::Unauthenticated);
        assert!(e.message().contains("requires a credential"), "{e}");
        let secret = crate::SharedSecret::new("me", "0123456789abcdef").unwrap();
        // A server that skips authentication is not trusted by a client that has a credential.
        let e = crate::Status::from(exchange(&hello().encode(), Some(&secret)).unwrap_err());
        assert_eq!(e.code(), Code::Unauthenticated);
        assert!(e.message().contains("did not authenticate itself"), "{e}");
        // A proof that is not the server's.
        let mut forged = challenge.clone();
        forged.extend_from_slice(&Record::Proof(vec![0; 32]).encode());
        let e = crate::Status::from(exchange(&forged, Some(&secret)).unwrap_err());
        assert_eq!(e.code(), Code::Unauthenticated);
        // Garbage where a record should be.
        let e = exchange(b"NOTARECORDATALL", Some(&secret)).unwrap_err();
        assert!(e.to_string().contains("not an rdma-rpc endpoint"), "{e}");
    }
}
