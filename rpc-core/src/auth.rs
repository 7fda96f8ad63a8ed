//! Authentication at the handshake: who may connect, and who they are.
//!
//! A server that has an [`Authenticator`] challenges every client before it
//! registers any memory for it: after the client's hello it sends a fresh
//! random nonce, the client answers with what its [`Credential`] makes of
//! the nonce and the hello it sent, and the server either refuses the
//! connection (the client's call fails with `Unauthenticated`) or admits it
//! under the identity the authenticator names, and proves itself in turn. A
//! client that has a credential requires that proof: it will not talk to a
//! server that cannot authenticate itself.
//!
//! [`SharedSecret`] is the built-in scheme: HMAC-SHA256 challenge-response
//! over a secret both sides hold, which never crosses the wire. Anything
//! else (tokens checked against a service, per-tenant keys) plugs in by
//! implementing the two traits.
//!
//! What this protects: admission. It does not encrypt traffic, and on its
//! own it does not stop an attacker on the path from tampering with a
//! connection after admission; `ARCHITECTURE.md` has the threat model.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

/// Length of the server's challenge nonce.
pub const NONCE_LEN: usize = 32;

/// Largest answer or proof a handshake carries.
pub const MAX_AUTH_LEN: usize = 1024;

/// What an answer is computed over: the server's fresh nonce and the exact
/// bytes of the hello the client sent (so an answer cannot be replayed on
/// another connection, nor moved to another hello).
#[derive(Debug, Clone, Copy)]
pub struct Challenge<'a> {
    /// The server's random nonce, new for every handshake.
    pub nonce: &'a [u8; NONCE_LEN],
    /// The client's hello, as sent.
    pub hello: &'a [u8],
}

/// A client admitted by an [`Authenticator`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Who the client is, as handlers see it ([`crate::Peer::identity`]).
    pub identity: String,
    /// The server's proof of its own identity, checked by the client's
    /// [`Credential::check`].
    pub proof: Vec<u8>,
}

/// Decides, on the server, whether a client may connect.
///
/// Runs on the thread that admits handshakes, so it must be quick: no
/// blocking I/O. Any error refuses the connection; its text goes to the
/// server's log and to the refused client.
pub trait Authenticator: Send + Sync + 'static {
    /// Checks a client's answer to `challenge`.
    fn verify(&self, challenge: &Challenge<'_>, answer: &[u8]) -> Result<Verified, String>;
}

/// What a client presents to a server that asks for a credential.
pub trait Credential: Send + Sync + 'static {
    /// The answer to a server's challenge (at most [`MAX_AUTH_LEN`] bytes).
    fn answer(&self, challenge: &Challenge<'_>) -> Result<Vec<u8>, String>;
    /// Checks the server's proof that it, too, knows the credential.
    fn check(&self, challenge: &Challenge<'_>, answer: &[u8], proof: &[u8]) -> Result<(), String>;
}

/// A named secret shared by a server and its clients: HMAC-SHA256
/// challenge-response, mutual, with the secret never on the wire.
///
/// The same value serves both sides: a client presents it with
/// `ChannelBuilder::credential`, a server requires it with
/// `ServerBuilder::authenticator` (or [`SharedSecrets`] for several).
/// Handlers see the client's identity as the secret's name.
#[derive(Clone)]
pub struct SharedSecret {
    name: String,
    key: Vec<u8>,
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedSecret")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Shortest secret accepted, bytes.
pub const MIN_SECRET_LEN: usize = 16;

const CLIENT_LABEL: &[u8] = b"rdma-rpc auth v1 client";
const SERVER_LABEL: &[u8] = b"rdma-rpc auth v1 server";

impl SharedSecret {
    /// A secret named `name` (1–255 bytes, shown to handlers as the
    /// client's identity); the secret must have at least
    /// [`MIN_SECRET_LEN`] bytes.
    pub fn new(
        name: impl Into<String>,
        secret: impl AsRef<[u8]>,
    ) -> Result<SharedSecret, crate::Status> {
        let name = name.into();
        let secret = secret.as_ref();
        if name.is_empty() || name.len() > 255 {
            return Err(crate::Status::invalid_argument(format!(
                "a shared secret's name must have 1 to 255 bytes, not {}",
                name.len()
            )));
        }
        if secret.len() < MIN_SECRET_LEN {
            return Err(crate::Status::invalid_argument(format!(
                "a shared secret needs at least {MIN_SECRET_LEN} bytes, this one has {}",
                secret.len()
            )));
        }
        Ok(SharedSecret {
            name,
            key: secret.to_vec(),
        })
    }

    /// The secret's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn mac(&self, label: &[u8], challenge: &Challenge<'_>, tail: &[&[u8]]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(challenge.nonce);
        mac.update(&(challenge.hello.len() as u32).to_le_bytes());
        mac.update(challenge.hello);
        for part in tail {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac
    }
}

/// An answer's parts: the client's nonce, the secret's name, the MAC.
struct Answer<'a> {
    client_nonce: &'a [u8],
    name: &'a str,
    tag: &'a [u8],
}

const TAG_LEN: usize = 32;

impl<'a> Answer<'a> {
    fn encode(client_nonce: &[u8; NONCE_LEN], name: &str, tag: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(NONCE_LEN + 1 + name.len() + TAG_LEN);
        out.extend_from_slice(client_nonce);
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(tag);
        out
    }

    fn decode(b: &'a [u8]) -> Result<Answer<'a>, String> {
        let bad = || "malformed shared-secret answer".to_owned();
        let (client_nonce, rest) = b.split_at_checked(NONCE_LEN).ok_or_else(bad)?;
        let (&n, rest) = rest.split_first().ok_or_else(bad)?;
        let (name, tag) = rest.split_at_checked(usize::from(n)).ok_or_else(bad)?;
        if tag.len() != TAG_LEN {
            return Err(bad());
        }
        let name = std::str::from_utf8(name).map_err(|_| bad())?;
        Ok(Answer {
            client_nonce,
            name,
            tag,
        })
    }
}

impl Credential for SharedSecret {
    fn answer(&self, challenge: &Challenge<'_>) -> Result<Vec<u8>, String> {
        let client_nonce: [u8; NONCE_LEN] = random_nonce()?;
        let tag = self
            .mac(
                CLIENT_LABEL,
                challenge,
                &[&client_nonce, self.name.as_bytes()],
            )
            .finalize()
            .into_bytes();
        Ok(Answer::encode(&client_nonce, &self.name, &tag))
    }

    fn check(&self, challenge: &Challenge<'_>, answer: &[u8], proof: &[u8]) -> Result<(), String> {
        self.mac(SERVER_LABEL, challenge, &[answer])
            .verify_slice(proof)
            .map_err(|_| format!("the server does not know the shared secret {:?}", self.name))
    }
}

impl Authenticator for SharedSecret {
    fn verify(&self, challenge: &Challenge<'_>, answer: &[u8]) -> Result<Verified, String> {
        verify_with(challenge, answer, |name| {
            (name == self.name).then_some(self)
        })
    }
}

/// Several named shared secrets, any of which admits a client (one per
/// tenant or per calling service, say); handlers see which one it was.
#[derive(Clone, Default)]
pub struct SharedSecrets {
    secrets: HashMap<String, SharedSecret>,
}

impl fmt::Debug for SharedSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.secrets.keys()).finish()
    }
}

impl SharedSecrets {
    /// No secrets yet (admits nobody).
    pub fn new() -> SharedSecrets {
        SharedSecrets::default()
    }

    /// Adds (or replaces) a secret.
    pub fn with(mut self, secret: SharedSecret) -> SharedSecrets {
        self.secrets.insert(secret.name.clone(), secret);
        self
    }
}

impl Authenticator for SharedSecrets {
    fn verify(&self, challenge: &Challenge<'_>, answer: &[u8]) -> Result<Verified, String> {
        verify_with(challenge, answer, |name| self.secrets.get(name))
    }
}

fn verify_with<'s>(
    challenge: &Challenge<'_>,
    answer: &[u8],
    lookup: impl FnOnce(&str) -> Option<&'s SharedSecret>,
) -> Result<Verified, String> {
    let a = Answer::decode(answer)?;
    // The same refusal for an unknown name and a wrong secret: a stranger
    // learns nothing about which names exist.
    let refused = || "wrong shared secret".to_owned();
    let secret = lookup(a.name).ok_or_else(refused)?;
    secret
        .mac(
            CLIENT_LABEL,
            challenge,
            &[a.client_nonce, a.name.as_bytes()],
        )
        .verify_slice(a.tag)
        .map_err(|_| refused())?;
    let proof = secret
        .mac(SERVER_LABEL, challenge, &[answer])
        .finalize()
        .into_bytes()
        .to_vec();
    Ok(Verified {
        identity: secret.name.clone(),
        proof,
    })
}

/// `auth`'s verdict on a client's answer, as the server logs it and the
/// refused client reads it.
pub(crate) fn verify_answer(
    auth: &dyn Authenticator,
    challenge: &Challenge<'_>,
    answer: &[u8],
) -> Result<Verified, String> {
    auth.verify(challenge, answer)
        .map_err(|why| format!("authentication failed: {why}"))
}

/// A fresh random nonce from the operating system.
pub(crate) fn random_nonce() -> Result<[u8; NONCE_LEN], String> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| format!("no randomness from the system: {e}"))?;
    Ok(n)
}

/// Who is at the other end of a connection, as a handler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The peer's address (`ip:port` on tcp:// and rdma://, a name on mem://).
    pub addr: String,
    /// The fabric: `"mem"`, `"tcp"` or `"rdma"`; `"grpc"` for a call
    /// through the server's gRPC face.
    pub fabric: &'static str,
    /// The identity the server's [`Authenticator`] admitted it under; `None`
    /// when the server requires no credential.
    pub identity: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str, key: &str) -> SharedSecret {
        SharedSecret::new(name, key).unwrap()
    }

    const HELLO: &[u8] = b"the client's hello, as sent on the wire";

    #[test]
    fn the_right_secret_is_admitted_and_the_server_proves_itself() {
        let s = secret("billing", "0123456789abcdef-xyz");
        let nonce = random_nonce().unwrap();
        let c = Challenge {
            nonce: &nonce,
            hello: HELLO,
        };
        let answer = s.answer(&c).unwrap();
        let v = s.verify(&c, &answer).unwrap();
        assert_eq!(v.identity, "billing");
        s.check(&c, &answer, &v.proof).unwrap();
        // Several secrets: the one that matches names the client.
        let many = SharedSecrets::new()
            .with(secret("orders", "another secret, long enough"))
            .with(s.clone());
        assert_eq!(many.verify(&c, &answer).unwrap().identity, "billing");
    }

    #[test]
    fn anything_else_is_refused() {
        let s = secret("billing", "0123456789abcdef-xyz");
        let nonce = random_nonce().unwrap();
        let c = Challenge {
            nonce: &nonce,
            hello: HELLO,
        };
        let answer = s.answer(&c).unwrap();
        // Wrong secret under the right name, or an unknown name: the same refusal.
        let wrong = secret("billing", "0123456789abcdef-xyZ");
        assert_eq!(
            wrong.verify(&c, &answer).unwrap_err(),
            "wrong shared secret"
        );
        let other = secret("orders", "0123456789abcdef-xyz");
        assert_eq!(
            other.verify(&c, &answer).unwrap_err(),
            "wrong shared secret"
        );
        // Replayed on another connection (another nonce) or for another hello.
        let nonce2 = random_nonce().unwrap();
        let c2 = Challenge {
            nonce: &nonce2,
            hello: HELLO,
        };
        assert!(s.verify(&c2, &answer).is_err());
        let c3 = Challenge {
            nonce: &nonce,
            hello: b"another hello",
        };
        assert!(s.verify(&c3, &answer).is_err());
        // Any flipped bit.
        for i in 0..answer.len() {
            let mut a = answer.clone();
            a[i] ^= 1;
            assert!(s.verify(&c, &a).is_err(), "bit flipped at {i} accepted");
        }
        // Truncated or garbage answers fail cleanly.
        for n in 0..answer.len() {
            assert!(s.verify(&c, &answer[..n]).is_err());
        }
        // A server that does not know the secret cannot fake its proof.
        let v = s.verify(&c, &answer).unwrap();
        assert!(wrong.check(&c, &answer, &v.proof).is_err());
        assert!(s.check(&c, &answer, &v.proof[..31]).is_err());
    }

    #[test]
    fn weak_or_unnamed_secrets_are_rejected() {
        assert!(SharedSecret::new("a", "short").is_err());
        assert!(SharedSecret::new("", "0123456789abcdef").is_err());
        assert!(SharedSecret::new("x".repeat(256), "0123456789abcdef").is_err());
        // The secret does not show in debug output.
        let s = secret("billing", "0123456789abcdef-xyz");
        assert!(!format!("{s:?}").contains("0123"));
    }
}
