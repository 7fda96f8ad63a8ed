//! The handshake's records other than hellos: their tags and wire form,
//! refusals (read and turned into errors), and reads with a deadline.
//! Both the handshake (`bootstrap`) and the TLS under it (`tls`) read
//! them, so they live below both.

use crate::Code;
use crate::auth::NONCE_LEN;
use crate::fabric::FabricError;
use std::io::Read;
use std::net::TcpStream;
use std::time::Instant;

/// A handshake message other than a hello: an 8-byte tag, then (except for
/// the refusal's code byte and a reserved byte) a little-endian `u16`
/// length and that many bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Server to client: authenticate, over this nonce.
    Challenge([u8; NONCE_LEN]),
    /// Client to server: the credential's answer.
    Answer(Vec<u8>),
    /// Server to client: the server's proof that it knows the credential.
    Proof(Vec<u8>),
    /// Server to client: the connection is refused, with a status code and why.
    Refused(Code, String),
}

pub(crate) const TAG_CHALLENGE: &[u8; 8] = b"RPCCHALL";
pub(crate) const TAG_ANSWER: &[u8; 8] = b"RPCANSWR";
pub(crate) const TAG_PROOF: &[u8; 8] = b"RPCPROOF";
pub(crate) const TAG_REFUSED: &[u8; 8] = b"RPCREFUS";
/// Longest refusal reason sent.
const MAX_REASON: usize = 512;

impl Record {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body): (&[u8; 8], &[u8]) = match self {
            Record::Challenge(n) => (TAG_CHALLENGE, n),
            Record::Answer(a) => (TAG_ANSWER, a),
            Record::Proof(p) => (TAG_PROOF, p),
            Record::Refused(code, why) => {
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                let mut b = TAG_REFUSED.to_vec();
                b.push(*code as u8);
                b.push(0);
                b.extend_from_slice(&(end as u16).to_le_bytes());
                b.extend_from_slice(&why.as_bytes()[..end]);
                return b;
            }
        };
        let mut b = tag.to_vec();
        b.extend_from_slice(&(body.len() as u16).to_le_bytes());
        b.extend_from_slice(body);
        b
    }
}

/// A refusal record's code and reason, after its tag, read with
/// `read_exact` (whose errors are the caller's).
pub(crate) fn read_refusal_with<E>(
    mut read_exact: impl FnMut(&mut [u8]) -> Result<(), E>,
) -> Result<(Code, String), E> {
    let mut head = [0u8; 4];
    read_exact(&mut head)?;
    let mut why = vec![0u8; usize::from(u16::from_le_bytes([head[2], head[3]])).min(MAX_REASON)];
    read_exact(&mut why)?;
    Ok((
        Code::from_u16(u16::from(head[0])),
        String::from_utf8_lossy(&why).into_owned(),
    ))
}

/// A refusal record's code and reason, after its tag; `None` if what
/// follows is not one.
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
pub(crate) fn read_refusal(stream: &mut impl Read) -> Option<(Code, String)> {
    read_refusal_with(|b| stream.read_exact(b)).ok()
}

/// A client's handshake refused by the server with `code` and `why`, on
/// any fabric (a refusal never means `Ok`).
pub(crate) fn refused_by_server(code: Code, why: &str) -> FabricError {
    let code = if code == Code::Ok {
        Code::Unknown
    } else {
        code
    };
    FabricError::refused(
        code,
        "handshake",
        format!("the server refused the connection: {why}"),
    )
}

/// Before a blocking read of `stream`: its read timeout becomes what is
/// left until `deadline`, or `TimedOut` if nothing is.
pub(crate) fn read_within(stream: &TcpStream, deadline: Option<Instant>) -> std::io::Result<()> {
    let Some(deadline) = deadline else {
        return Ok(());
    };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))
}
