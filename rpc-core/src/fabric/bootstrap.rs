//! The out-of-band handshake that exchanges endpoints.
//!
//! Over a TCP connection on the URL's port, each side sends one fixed-size
//! [`Hello`]: queue pair number, packet sequence number, LID and GID (for
//! verbs), its receive ring (address, length, rkey) and the largest message
//! it accepts. The client speaks first; the server answers once it is ready
//! for traffic. Everything received is validated before use, and reads time
//! out.

use crate::fabric::{FabricError, FabricUrl, PeerRing};
use crate::protocol::{HEADER_LEN, ring};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Size of an encoded [`Hello`].
pub const HELLO_LEN: usize = 64;
const MAGIC: &[u8; 8] = b"RDMARPC\0";
const HELLO_VERSION: u16 = 2;

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
        };
        let len =
            usize::try_from(ring.len).map_err(|_| format!("ring length {} too large", ring.len))?;
        ring::check_capacity(len).map_err(|e| format!("peer ring: {e}"))?;
        let largest = (len / 2).saturating_sub(HEADER_LEN);
        if ring.max_message as usize > largest {
            return Err(format!(
                "peer accepts messages of {} bytes, more than its {len}-byte ring can hold ({largest})",
                ring.max_message
            ));
        }
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

/// Accepts handshake connections on the URL's TCP port.
#[derive(Debug)]
pub struct Acceptor {
    inner: std::net::TcpListener,
    addr: std::net::SocketAddr,
    closed: AtomicBool,
}

impl Acceptor {
    /// Binds the URL's host and port (0 picks a free port), with the
    /// largest listen backlog the system allows (`net.core.somaxconn`; the
    /// standard library's 128 makes a burst of connects wait a second for a
    /// SYN retry).
    pub fn bind(url: &FabricUrl) -> Result<Acceptor, FabricError> {
        let inner = url
            .socket_addr()
            .to_socket_addrs()
            .and_then(|addrs| first_of(addrs, listen))
            .map_err(|e| FabricError::io("bind", e))?;
        let addr = inner.local_addr().map_err(|e| FabricError::io("bind", e))?;
        Ok(Acceptor {
            inner,
            addr,
            closed: AtomicBool::new(false),
        })
    }

    /// Blocks for the next connection; `None` once closed.
    pub fn next(&self) -> Result<Option<TcpStream>, FabricError> {
        loop {
            let accepted = self.inner.accept();
            if self.closed.load(Ordering::Acquire) {
                return Ok(None);
            }
            match accepted {
                Ok((s, _)) => return Ok(Some(s)),
                // Transient (aborted connections, fd pressure): keep serving.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// The bound address as `scheme://ip:port`.
    pub fn local_url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    /// Stops accepting and unblocks [`Acceptor::next`].
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            // Unblock accept(): connect to ourselves (to loopback for a wildcard bind).
            let mut addr = self.addr;
            if addr.ip().is_unspecified() {
                addr.set_ip(if addr.is_ipv4() {
                    [127, 0, 0, 1].into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                });
            }
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
    }
}

/// A listening socket on `addr` with the system's largest backlog.
fn listen(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
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
fn first_of<T>(
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

/// Sends a hello.
pub fn send(stream: &mut impl Write, hello: &Hello) -> Result<(), FabricError> {
    stream
        .write_all(&hello.encode())
        .and_then(|()| stream.flush())
        .map_err(|e| FabricError::io("handshake send", e))
}

/// Receives and validates a hello. The stream's read timeout bounds the wait.
pub fn recv(stream: &mut impl Read, fabric: HelloFabric) -> Result<Hello, FabricError> {
    let mut b = [0u8; HELLO_LEN];
    stream.read_exact(&mut b).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            FabricError::unreachable("handshake", "timed out waiting for the peer's endpoint")
        }
        std::io::ErrorKind::UnexpectedEof => {
            FabricError::unreachable("handshake", "peer closed during the handshake")
        }
        _ => FabricError::io("handshake recv", e),
    })?;
    Hello::decode(&b, fabric).map_err(|why| FabricError::protocol("handshake", why))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst of connects while the acceptor is busy all land in the
    /// backlog at once: none waits a second for a SYN retry (as beyond the
    /// standard library's backlog of 128 they would).
    #[test]
    fn a_burst_of_connects_fits_the_backlog() {
        let acceptor = Acceptor::bind(&FabricUrl::parse("tcp://127.0.0.1:0").unwrap()).unwrap();
        let addr = acceptor.addr;
        let burst: Vec<TcpStream> = (0..600)
            .map(|i| {
                TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                    .unwrap_or_else(|e| panic!("connect {i} waited: {e}"))
            })
            .collect();
        assert_eq!(burst.len(), 600);
        // They are all there to accept.
        assert!(acceptor.next().unwrap().is_some());
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
        assert!(bad(|h| h.ring.max_message = 1 << 20).contains("messages"));
        assert!(bad(|h| h.ring.addr = u64::MAX - 10).contains("overflows"));
        assert!(bad(|h| h.psn = 1 << 24).contains("psn"));
    }

    #[test]
    fn truncated_input_times_out_or_fails_cleanly() {
        let mut short: &[u8] = &[1, 2, 3];
        let e = recv(&mut short, HelloFabric::Tcp).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
    }
}
