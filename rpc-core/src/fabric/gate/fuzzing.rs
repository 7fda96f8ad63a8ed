//! The server's side of the handshake driven by hand (feature `testing`):
//! a client's bytes go through the gate's real reading and checking of a
//! pending handshake (the hello; the challenge, answer and proof when the
//! server requires a credential; the refusal) over a local socket pair,
//! until the handshake is admitted or dropped. For the fuzz targets and
//! tests.

use super::{Pending, Progress, read_more, refuse};
use crate::Code;
use crate::auth::{Authenticator, Challenge, Credential, NONCE_LEN};
use crate::fabric::bootstrap::{HELLO_LEN, Hello, HelloFabric, Record};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// How a handshake ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted: handed on to the fabric with the client's hello and the
    /// identity the authenticator admitted it under.
    Admitted {
        /// The client's hello.
        hello: Hello,
        /// Who the client is, if the server authenticates.
        identity: Option<String>,
    },
    /// Refused: the client was sent a refusal record with this code and
    /// reason before the connection closed.
    Refused {
        /// The refusal's status code.
        code: Code,
        /// Why, as logged and sent.
        why: String,
    },
    /// Dropped without a word (not a client of ours, or one that left).
    Dropped(String),
}

/// What a client does.
#[derive(Clone, Copy)]
pub struct Client<'a> {
    /// What it sends, from its hello on.
    pub bytes: &'a [u8],
    /// Its bytes arrive in pieces of this many, each read separately (0:
    /// all at once).
    pub piece: usize,
    /// Once its bytes are sent, it answers the server's challenge with this
    /// credential, for the hello its first [`HELLO_LEN`] bytes are.
    pub credential: Option<&'a dyn Credential>,
}

impl std::fmt::Debug for Client<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("bytes", &self.bytes)
            .field("piece", &self.piece)
            .field("credential", &self.credential.is_some())
            .finish()
    }
}

/// A finished handshake.
#[derive(Debug)]
pub struct Run {
    /// How it ended.
    pub outcome: Outcome,
    /// Everything the server sent the client.
    pub sent: Vec<u8>,
}

/// The address the pending handshake is logged with.
const PEER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 1);

fn read_all(stream: &UnixStream, out: &mut Vec<u8>) {
    let mut buf = [0u8; 1024];
    loop {
        match (&*stream).read(&mut buf) {
            Ok(0) => return,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// The nonce of the challenge record at the start of `sent`, if it is all there.
fn challenge(sent: &[u8]) -> Option<[u8; NONCE_LEN]> {
    let head = Record::Challenge([0; NONCE_LEN]).encode();
    let at = head.len() - NONCE_LEN;
    if sent.len() < head.len() || sent[..at] != head[..at] {
        return None;
    }
    sent[at..head.len()].try_into().ok()
}

/// Runs one handshake from accept to its end: a gate for the tcp:// fabric
/// that requires `authenticator` (if any) reads what `client` sends, then
/// the client's end of stream. Panics if the gate stops making progress.
pub fn handshake(
    client: Client<'_>,
    authenticator: Option<&dyn Authenticator>,
) -> std::io::Result<Run> {
    let (gate_side, client_side) = UnixStream::pair()?;
    gate_side.set_nonblocking(true)?;
    client_side.set_nonblocking(true)?;
    // The gate needs only a connected stream socket's reads and writes.
    let stream = TcpStream::from(OwnedFd::from(gate_side));
    let mut p = Pending::new(
        stream,
        PEER,
        1,
        Instant::now() + Duration::from_secs(5),
        false,
    );
    let piece = if client.piece == 0 {
        usize::MAX
    } else {
        client.piece
    };
    let mut sent = Vec::new();
    let mut rest = client.bytes;
    let mut answered = client.credential.is_none();
    let mut ended = false;
    // Every turn moves a byte in, answers or ends the stream.
    let limit = client.bytes.len() + 8;
    let mut turns = 0;
    let outcome = loop {
        turns += 1;
        assert!(turns <= limit, "the gate stopped making progress");
        if !rest.is_empty() {
            match (&client_side).write(&rest[..piece.min(rest.len())]) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => rest = &[],
            }
        } else if !answered {
            answered = true;
            let hello = &client.bytes[..HELLO_LEN.min(client.bytes.len())];
            if let (Some(nonce), Some(credential)) = (challenge(&sent), client.credential) {
                let c = Challenge {
                    nonce: &nonce,
                    hello,
                };
                if let Ok(answer) = credential.answer(&c) {
                    let _ = (&client_side).write_all(&Record::Answer(answer).encode());
                }
            }
        } else if !ended {
            ended = true;
            let _ = client_side.shutdown(Shutdown::Write);
        }
        let progress = read_more(&mut p, HelloFabric::Tcp, authenticator, None);
        read_all(&client_side, &mut sent);
        match progress {
            Progress::Waiting => {}
            Progress::Admit(hello, identity) => break Outcome::Admitted { hello, identity },
            Progress::Drop(Some(code), why) => {
                refuse(&p.stream, p.peer, code, &why);
                break Outcome::Refused { code, why };
            }
            Progress::Drop(None, why) | Progress::TlsFailed(why) => break Outcome::Dropped(why),
        }
    };
    drop(p);
    read_all(&client_side, &mut sent);
    Ok(Run { outcome, sent })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharedSecret;
    use crate::fabric::PeerRing;

    fn hello() -> Hello {
        Hello {
            fabric: HelloFabric::Tcp,
            qp_num: 7,
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 0,
            ring: PeerRing {
                addr: 1 << 40,
                len: 1 << 16,
                rkey: 99,
                max_message: 1024,
                max_streams: 0,
            },
        }
    }

    #[test]
    fn hellos_are_admitted_or_refused_as_the_gate_does() {
        let key = SharedSecret::new("svc", "0123456789abcdef").unwrap();
        let bytes = hello().encode();
        for piece in [0, 1, 5] {
            let client = Client {
                bytes: &bytes,
                piece,
                credential: None,
            };
            let run = handshake(client, None).unwrap();
            assert_eq!(
                run.outcome,
                Outcome::Admitted {
                    hello: hello(),
                    identity: None
                }
            );
            assert!(run.sent.is_empty());
            // A credential is asked for: a client without one leaves...
            let run = handshake(client, Some(&key)).unwrap();
            assert!(matches!(run.outcome, Outcome::Dropped(_)), "{run:?}");
            assert!(challenge(&run.sent).is_some());
            // ...and a wrong answer is refused.
            let mut wrong = bytes.to_vec();
            wrong.extend_from_slice(&Record::Answer(vec![1; 70]).encode());
            let run = handshake(
                Client {
                    bytes: &wrong,
                    ..client
                },
                Some(&key),
            )
            .unwrap();
            assert!(
                matches!(
                    run.outcome,
                    Outcome::Refused {
                        code: Code::Unauthenticated,
                        ..
                    }
                ),
                "{run:?}"
            );
            // With it, admitted under its name.
            let honest = Client {
                credential: Some(&key),
                ..client
            };
            let run = handshake(honest, Some(&key)).unwrap();
            assert_eq!(
                run.outcome,
                Outcome::Admitted {
                    hello: hello(),
                    identity: Some("svc".into())
                }
            );
        }
        let garbage = Client {
            bytes: &[0x5a; 100],
            piece: 0,
            credential: None,
        };
        assert!(matches!(
            handshake(garbage, None).unwrap().outcome,
            Outcome::Dropped(_)
        ));
    }
}
