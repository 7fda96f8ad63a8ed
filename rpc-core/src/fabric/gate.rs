//! The server side of the handshake, up to the client's hello: admission
//! without a thread per connection, before any memory is set aside.
//!
//! One thread accepts on the listening socket and drives every pending
//! handshake at once over nonblocking sockets: it reads the client's hello
//! and validates it, challenges and verifies the client if the server
//! requires a credential, and only then hands the connection on as
//! [`Admitted`], for the fabric to allocate its ring and queue pair. A
//! pending handshake costs a socket and a few hundred bytes. There are at
//! most [`Admission::max_pending`] of them: a new one evicts the oldest
//! (the one most likely to be a peer that connects and says nothing, since
//! a real client sends its hello at once), and each has
//! [`Admission::timeout`] to finish.

#[cfg(feature = "testing")]
pub mod fuzzing;

use super::bootstrap::{self, ANSWER_HEAD, HELLO_LEN, Hello, HelloFabric, Link, Record};
use super::tls::{self, ServerTls, Session};
use crate::Code;
use crate::auth::{Authenticator, Challenge, NONCE_LEN, random_nonce, verify_answer};
use crate::fabric::{FabricError, FabricUrl};
use crossbeam_channel::{Receiver, Sender, TrySendError};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a listener admits connections.
#[derive(Clone)]
pub struct Admission {
    /// How long a handshake may take, from accept to admission.
    pub timeout: Duration,
    /// Handshakes in progress at most; beyond it the oldest is dropped.
    pub max_pending: usize,
    /// Verifies clients; `None` admits anyone who speaks the protocol.
    pub authenticator: Option<Arc<dyn Authenticator>>,
    /// TLS: every client must open with a TLS handshake, and everything
    /// after it travels inside TLS. `None`: plaintext.
    pub tls: Option<ServerTls>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("timeout", &self.timeout)
            .field("max_pending", &self.max_pending)
            .field("authenticated", &self.authenticator.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for Admission {
    fn default() -> Admission {
        Admission {
            timeout: Duration::from_secs(5),
            max_pending: default_max_pending(),
            authenticator: None,
            tls: None,
        }
    }
}

/// 1,024 pending handshakes, or a quarter of the descriptors this process
/// may open if that is fewer (each holds one), but at least 16.
pub fn default_max_pending() -> usize {
    let mut lim = descriptor_limit();
    if lim == 0 {
        lim = 1024;
    }
    (lim / 4).clamp(16, 1024)
}

/// The soft limit on open descriptors (0 if unknown).
fn descriptor_limit() -> usize {
    // Read from /proc rather than through libc, which this build may not link.
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// A connection whose hello was read and validated (and whose client was
/// authenticated, if the server asks): what a fabric sets up.
#[derive(Debug)]
pub struct Admitted {
    /// The handshake connection: blocking, no delay, reads time out after
    /// the admission timeout.
    pub stream: TcpStream,
    /// Its TLS session, on a server with TLS: it may hold decrypted bytes
    /// the client sent after its hello, and encrypted ones not yet written.
    pub tls: Option<Session>,
    /// The client's hello.
    pub hello: Hello,
    /// The identity the authenticator admitted the client under, else the
    /// name in its TLS certificate (mutual TLS).
    pub identity: Option<String>,
    /// The client's address.
    pub peer_addr: SocketAddr,
}

impl crate::fabric::Incoming for Admitted {
    fn peer_ring(&self) -> crate::fabric::PeerRing {
        self.hello.ring
    }
}

impl Admitted {
    /// Tells the client why it is not taken, and closes.
    pub fn refuse(mut self, code: Code, why: &str) {
        match &mut self.tls {
            None => refuse(&self.stream, self.peer_addr, code, why),
            Some(session) => {
                tracing::warn!(peer = %self.peer_addr, %why, "connection refused");
                tls::refuse(session, &self.stream, &Record::Refused(code, why.into()));
            }
        }
    }

    /// The handshake connection, with its TLS session if it has one.
    pub fn into_link(self) -> Link {
        Link {
            stream: self.stream,
            tls: self.tls,
            deadline: None,
        }
    }
}

/// Accepts handshake connections on the URL's TCP port and admits them.
#[derive(Debug)]
pub struct Gate {
    admitted: Receiver<Admitted>,
    waker: Arc<Waker>,
    closed: Arc<AtomicBool>,
    addr: SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
}

const LISTENER: Token = Token(usize::MAX - 1);
const WAKE: Token = Token(usize::MAX);

impl Gate {
    /// Binds the URL's host and port (0 picks a free port) with the largest
    /// listen backlog the system allows, and starts admitting.
    pub fn bind(
        url: &FabricUrl,
        fabric: HelloFabric,
        admission: Admission,
    ) -> Result<Gate, FabricError> {
        let listener = url
            .socket_addr()
            .to_socket_addrs()
            .and_then(|addrs| bootstrap::first_of(addrs, bootstrap::listen))
            .map_err(|e| FabricError::io("bind", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| FabricError::io("bind", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| FabricError::io("set_nonblocking", e))?;
        let poll = Poll::new().map_err(|e| FabricError::io("epoll_create", e))?;
        poll.registry()
            .register(
                &mut SourceFd(&listener.as_raw_fd()),
                LISTENER,
                Interest::READABLE,
            )
            .map_err(|e| FabricError::io("epoll_ctl", e))?;
        let waker =
            Arc::new(Waker::new(poll.registry(), WAKE).map_err(|e| FabricError::io("eventfd", e))?);
        let closed = Arc::new(AtomicBool::new(false));
        let (tx, admitted) = crossbeam_channel::bounded(admission.max_pending.max(1));
        let mut state = State {
            poll,
            listener,
            fabric,
            admission,
            pending: Slab::new(),
            order: VecDeque::new(),
            serial: 0,
            admitted: tx,
            closed: closed.clone(),
            retry_accept: None,
        };
        let thread = std::thread::Builder::new()
            .name("rpc-gate".into())
            .spawn(move || state.run())
            .map_err(|e| FabricError::io("spawn the handshake thread", e))?;
        Ok(Gate {
            admitted,
            waker,
            closed,
            addr,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Blocks for the next admitted connection; `None` once closed.
    pub fn next(&self) -> Result<Option<Admitted>, FabricError> {
        Ok(self.admitted.recv().ok())
    }

    /// The bound address as `scheme://ip:port`.
    pub fn local_url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, drops pending handshakes and unblocks [`Gate::next`].
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = self.waker.wake();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.close();
    }
}

/// Where a pending handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Reading the client's hello.
    Hello,
    /// Challenged after this hello: reading the head of the answer.
    AnswerHead(Hello),
    /// Reading the answer itself.
    Answer(Hello),
}

struct Pending {
    stream: TcpStream,
    /// On a server with TLS: whether the client's first byte is still to
    /// be looked at (it tells TLS from a plaintext hello).
    sniff: bool,
    /// The TLS session, once the client opened one.
    tls: Option<Session>,
    /// A plaintext hello at a server with TLS: read it, then refuse.
    plain_at_tls: bool,
    peer: SocketAddr,
    serial: u64,
    deadline: Instant,
    step: Step,
    buf: Vec<u8>,
    need: usize,
    /// The hello's bytes, as the client sent them (what it authenticates).
    hello: [u8; HELLO_LEN],
    nonce: [u8; NONCE_LEN],
}

impl Pending {
    /// A handshake just accepted: waiting for the client's hello.
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        serial: u64,
        deadline: Instant,
        tls: bool,
    ) -> Pending {
        Pending {
            stream,
            sniff: tls,
            tls: None,
            plain_at_tls: false,
            peer,
            serial,
            deadline,
            step: Step::Hello,
            buf: Vec::with_capacity(HELLO_LEN),
            need: HELLO_LEN,
            hello: [0; HELLO_LEN],
            nonce: [0; NONCE_LEN],
        }
    }
}

/// What reading from a pending handshake came to.
enum Progress {
    /// Waiting for more bytes.
    Waiting,
    /// Done: admit it.
    Admit(Hello, Option<String>),
    /// Drop it, for this reason (refusing with a code if there is one).
    Drop(Option<Code>, String),
    /// Drop it: its TLS handshake failed, for this reason (logged as a
    /// warning; rustls's alert tells the client).
    TlsFailed(String),
}

struct State {
    poll: Poll,
    listener: TcpListener,
    fabric: HelloFabric,
    admission: Admission,
    pending: Slab<Pending>,
    /// Pending handshakes oldest first, as (slab key, serial); entries for
    /// handshakes already gone are skipped.
    order: VecDeque<(usize, u64)>,
    serial: u64,
    admitted: Sender<Admitted>,
    closed: Arc<AtomicBool>,
    /// Accepting ran out of descriptors: try again at this time.
    retry_accept: Option<Instant>,
}

impl State {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        while !self.closed.load(Ordering::Acquire) {
            let now = Instant::now();
            let next = self
                .oldest()
                .map(|key| self.pending[key].deadline)
                .into_iter()
                .chain(self.retry_accept)
                .min();
            let timeout = next.map(|t| t.saturating_duration_since(now));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != ErrorKind::Interrupted {
                    tracing::error!(error = %e, "handshake poll failed; no longer accepting");
                    return;
                }
            }
            for ev in &events {
                match ev.token() {
                    WAKE => {}
                    LISTENER => self.accept(),
                    Token(key) => self.advance(key),
                }
            }
            if self.retry_accept.is_some_and(|t| t <= Instant::now()) {
                self.retry_accept = None;
                self.accept();
            }
            self.expire(Instant::now());
        }
    }

    /// The key of the oldest pending handshake still there.
    fn oldest(&mut self) -> Option<usize> {
        while let Some(&(key, serial)) = self.order.front() {
            if self.pending.get(key).is_some_and(|p| p.serial == serial) {
                return Some(key);
            }
            self.order.pop_front();
        }
        None
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.add(stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e)
                    if e.kind() == ErrorKind::Interrupted
                        || e.kind() == ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // Out of descriptors (EMFILE, ENFILE) or memory: give one
                    // back if a handshake holds it, else wait a little. The
                    // connection waits in the backlog meanwhile.
                    if self.evict_oldest("out of descriptors") {
                        continue;
                    }
                    tracing::warn!(error = %e, "accept failed; retrying in 100 ms");
                    self.retry_accept = Some(Instant::now() + Duration::from_millis(100));
                    return;
                }
            }
        }
    }

    fn add(&mut self, stream: TcpStream, peer: SocketAddr) {
        if self.pending.len() >= self.admission.max_pending {
            self.evict_oldest("too many handshakes in progress");
        }
        if let Err(e) = stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_nodelay(true))
        {
            tracing::debug!(%peer, error = %e, "cannot set up a handshake connection");
            return;
        }
        let entry = self.pending.vacant_entry();
        let key = entry.key();
        // With TLS the server writes handshake messages too: the rare one
        // the socket cannot take at once goes when it is writable.
        let interest = if self.admission.tls.is_some() {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        if let Err(e) =
            self.poll
                .registry()
                .register(&mut SourceFd(&stream.as_raw_fd()), Token(key), interest)
        {
            tracing::warn!(%peer, error = %e, "cannot watch a handshake connection");
            return;
        }
        self.serial += 1;
        entry.insert(Pending::new(
            stream,
            peer,
            self.serial,
            crate::bounded_deadline(self.admission.timeout),
            self.admission.tls.is_some(),
        ));
        self.order.push_back((key, self.serial));
        // Its hello may already be there: edge-triggered readiness reports
        // only what arrives from now on.
        self.advance(key);
    }

    /// Drops the oldest pending handshake; false if there is none.
    fn evict_oldest(&mut self, why: &str) -> bool {
        let Some(key) = self.oldest() else {
            return false;
        };
        let p = self.remove(key);
        tracing::debug!(peer = %p.peer, %why, "handshake dropped");
        true
    }

    fn expire(&mut self, now: Instant) {
        while let Some(key) = self.oldest() {
            if self.pending[key].deadline > now {
                return;
            }
            let p = self.remove(key);
            tracing::debug!(peer = %p.peer, "handshake timed out");
        }
    }

    fn remove(&mut self, key: usize) -> Pending {
        let p = self.pending.remove(key);
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&p.stream.as_raw_fd()));
        p
    }

    fn advance(&mut self, key: usize) {
        let Some(p) = self.pending.get_mut(key) else {
            return;
        };
        if let Some(session) = &mut p.tls {
            // What the socket could not take before.
            if session.wants_write() && session.flush(&p.stream).is_err() {
                let p = self.remove(key);
                tracing::debug!(peer = %p.peer, "handshake failed: cannot write");
                return;
            }
        }
        let progress = read_more(
            p,
            self.fabric,
            self.admission.authenticator.as_deref(),
            self.admission.tls.as_ref(),
        );
        match progress {
            Progress::Waiting => {}
            Progress::Drop(code, why) => {
                let mut p = self.remove(key);
                match (code, &mut p.tls) {
                    (Some(code), None) => {
                        // Unread bytes would turn the close into a reset
                        // that can overtake the refusal.
                        drain(&p.stream);
                        refuse(&p.stream, p.peer, code, &why);
                    }
                    (Some(code), Some(session)) => {
                        tracing::warn!(peer = %p.peer, %why, "connection refused");
                        let record = Record::Refused(code, why).encode();
                        tls::send_nonblocking(session, &p.stream, &record);
                        session.close_notify();
                        let _ = session.flush(&p.stream);
                    }
                    (None, _) => tracing::debug!(peer = %p.peer, %why, "handshake failed"),
                }
            }
            Progress::TlsFailed(why) => {
                let mut p = self.remove(key);
                tracing::warn!(peer = %p.peer, %why, "connection refused");
                // The alert rustls raised tells the client why (and what
                // the client sent meanwhile is read, so that the close is
                // not a reset that could overtake the alert).
                if let Some(session) = &mut p.tls {
                    let _ = session.flush(&p.stream);
                }
                drain(&p.stream);
            }
            Progress::Admit(hello, identity) => {
                let mut p = self.remove(key);
                if let Some(session) = &mut p.tls {
                    // What the socket takes now; the rest goes with the
                    // next write through the session.
                    let _ = session.flush(&p.stream);
                }
                let identity = identity.or_else(|| p.tls.as_ref().and_then(Session::peer_identity));
                let set_up = p
                    .stream
                    .set_nonblocking(false)
                    .and_then(|()| p.stream.set_read_timeout(Some(self.admission.timeout)));
                if let Err(e) = set_up {
                    tracing::debug!(peer = %p.peer, error = %e, "handshake failed");
                    return;
                }
                let admitted = Admitted {
                    stream: p.stream,
                    tls: p.tls,
                    hello,
                    identity,
                    peer_addr: p.peer,
                };
                match self.admitted.try_send(admitted) {
                    Ok(()) => {}
                    Err(TrySendError::Full(a)) => a.refuse(
                        Code::Unavailable,
                        "the server is busy setting up connections; try again",
                    ),
                    Err(TrySendError::Disconnected(_)) => {}
                }
            }
        }
    }
}

/// Reads what a pending handshake has for us and moves it on.
fn read_more(
    p: &mut Pending,
    fabric: HelloFabric,
    auth: Option<&dyn Authenticator>,
    tls: Option<&ServerTls>,
) -> Progress {
    if p.sniff {
        // The first byte tells a TLS handshake (0x16) from our plaintext
        // hello: a plaintext client is read and then told, in plaintext,
        // that TLS is required.
        let mut first = [0u8; 1];
        loop {
            match p.stream.peek(&mut first) {
                Ok(0) => return Progress::Drop(None, "peer closed during the handshake".into()),
                Ok(_) => break,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Progress::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Progress::Drop(None, format!("handshake read failed: {e}")),
            }
        }
        p.sniff = false;
        if first[0] == bootstrap::MAGIC[0] {
            p.plain_at_tls = true;
        } else if let Some(tls) = tls {
            match Session::server(tls) {
                Ok(session) => p.tls = Some(session),
                Err(why) => return Progress::Drop(None, why),
            }
        }
    }
    loop {
        while p.buf.len() < p.need {
            let have = p.buf.len();
            p.buf.resize(p.need, 0);
            let read = match &mut p.tls {
                None => (&p.stream).read(&mut p.buf[have..]),
                Some(session) => session.read_nonblocking(&p.stream, &mut p.buf[have..]),
            };
            match read {
                Ok(0) => return Progress::Drop(None, "peer closed during the handshake".into()),
                Ok(n) => p.buf.truncate(have + n),
                Err(e) => {
                    p.buf.truncate(have);
                    match e.kind() {
                        ErrorKind::WouldBlock => return Progress::Waiting,
                        ErrorKind::Interrupted => {}
                        ErrorKind::UnexpectedEof => {
                            return Progress::Drop(None, "peer closed during the handshake".into());
                        }
                        _ if p.tls.is_some() => {
                            return Progress::TlsFailed(tls::server_failure(&e));
                        }
                        _ => return Progress::Drop(None, format!("handshake read failed: {e}")),
                    }
                }
            }
        }
        match p.step {
            Step::Hello => {
                p.hello.copy_from_slice(&p.buf);
                if p.plain_at_tls {
                    return Progress::Drop(Some(Code::Unavailable), tls::REQUIRES_TLS.into());
                }
                if tls.is_none() && tls::looks_like_tls(&p.hello) {
                    return Progress::Drop(Some(Code::Unavailable), tls::NO_TLS.into());
                }
                let hello = match Hello::decode(&p.hello, fabric) {
                    Ok(h) => h,
                    Err(why) => return Progress::Drop(None, why),
                };
                let Some(_) = auth else {
                    return Progress::Admit(hello, None);
                };
                p.nonce = match random_nonce() {
                    Ok(n) => n,
                    Err(why) => return Progress::Drop(Some(Code::Internal), why),
                };
                if !send(p, &Record::Challenge(p.nonce).encode()) {
                    return Progress::Drop(None, "cannot send the challenge".into());
                }
                p.step = Step::AnswerHead(hello);
                p.need = ANSWER_HEAD;
            }
            Step::AnswerHead(hello) => {
                let head: &[u8; ANSWER_HEAD] = p.buf[..].try_into().expect("head length");
                match bootstrap::answer_len(head) {
                    Ok(len) => {
                        p.step = Step::Answer(hello);
                        p.need = len;
                    }
                    Err(why) => return Progress::Drop(Some(Code::Unauthenticated), why),
                }
            }
            Step::Answer(hello) => {
                let auth = auth.expect("answers are read only when authenticating");
                let challenge = Challenge {
                    nonce: &p.nonce,
                    hello: &p.hello,
                };
                let verified = match verify_answer(auth, &challenge, &p.buf) {
                    Ok(v) => v,
                    Err(why) => return Progress::Drop(Some(Code::Unauthenticated), why),
                };
                if !send(p, &Record::Proof(verified.proof).encode()) {
                    return Progress::Drop(None, "cannot send the proof".into());
                }
                return Progress::Admit(hello, Some(verified.identity));
            }
        }
        p.buf.clear();
    }
}

/// Tells a client why it is not taken (logged), before its connection
/// closes.
fn refuse(stream: &TcpStream, peer: SocketAddr, code: Code, why: &str) {
    tracing::warn!(%peer, %why, "connection refused");
    send_all(stream, &Record::Refused(code, why.into()).encode());
}

/// Writes a small record to a fresh connection without blocking: its send
/// buffer always has room for it, so a short write means a broken peer.
fn send_all(stream: &TcpStream, bytes: &[u8]) -> bool {
    matches!((&*stream).write(bytes), Ok(n) if n == bytes.len())
}

/// Writes a handshake record to a pending connection, through its TLS
/// session if it has one.
fn send(p: &mut Pending, bytes: &[u8]) -> bool {
    match &mut p.tls {
        None => send_all(&p.stream, bytes),
        Some(session) => tls::send_nonblocking(session, &p.stream, bytes),
    }
}

/// Reads and drops what a nonblocking connection has already received.
fn drain(stream: &TcpStream) {
    let mut sink = [0u8; 4096];
    for _ in 0..4 {
        match (&*stream).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Credential, SharedSecret};
    use crate::fabric::PeerRing;

    fn gate(admission: Admission) -> Gate {
        let url = FabricUrl::parse("tcp://127.0.0.1:0").unwrap();
        Gate::bind(&url, HelloFabric::Tcp, admission).unwrap()
    }

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

    fn connect(g: &Gate) -> TcpStream {
        let s = TcpStream::connect(g.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }

    /// What the gate hands on within `wait`.
    fn admitted(g: &Gate, wait: Duration) -> Option<Admitted> {
        g.admitted.recv_timeout(wait).ok()
    }

    #[test]
    fn a_hello_that_arrives_byte_by_byte_is_admitted() {
        let g = gate(Admission::default());
        let mut s = connect(&g);
        for b in hello().encode() {
            s.write_all(&[b]).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        let a = admitted(&g, Duration::from_secs(5)).expect("admitted");
        assert_eq!(a.hello, hello());
        assert_eq!(a.identity, None);
    }

    #[test]
    fn idle_peers_are_evicted_oldest_first_and_time_out() {
        let g = gate(Admission {
            timeout: Duration::from_millis(300),
            max_pending: 4,
            authenticator: None,
            tls: None,
        });
        let mut idle: Vec<TcpStream> = (0..10).map(|_| connect(&g)).collect();
        let mut s = connect(&g);
        s.write_all(&hello().encode()).unwrap();
        assert!(admitted(&g, Duration::from_secs(5)).is_some());
        // The oldest idle peers were dropped to make room: they read EOF.
        let mut b = [0u8; 1];
        assert_eq!(idle[0].read(&mut b).unwrap(), 0);
        // The rest time out.
        let last = idle.last_mut().unwrap();
        let started = Instant::now();
        assert_eq!(last.read(&mut b).unwrap(), 0);
        assert!(started.elapsed() < Duration::from_secs(3));
        // And nothing of theirs was admitted.
        assert!(admitted(&g, Duration::from_millis(100)).is_none());
    }

    #[test]
    fn garbage_is_dropped_without_being_admitted() {
        let g = gate(Admission::default());
        let mut s = connect(&g);
        s.write_all(&[0x5a; HELLO_LEN]).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).unwrap(), 0);
        assert!(admitted(&g, Duration::from_millis(100)).is_none());
    }

    /// Runs a client handshake against the gate; returns the first record
    /// the server sends after the challenge.
    fn authenticate(g: &Gate, credential: &dyn Credential) -> Vec<u8> {
        let mut s = connect(g);
        let h = hello();
        s.write_all(&h.encode()).unwrap();
        let mut head = [0u8; 10];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head[..8], b"RPCCHALL");
        let mut nonce = [0u8; NONCE_LEN];
        s.read_exact(&mut nonce).unwrap();
        let answer = credential
            .answer(&Challenge {
                nonce: &nonce,
                hello: &h.encode(),
            })
            .unwrap();
        s.write_all(&Record::Answer(answer).encode()).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    }

    #[test]
    fn a_client_that_fails_authentication_is_refused_before_anything_is_set_up() {
        let key = SharedSecret::new("svc", "0123456789abcdef").unwrap();
        let g = gate(Admission {
            timeout: Duration::from_secs(2),
            authenticator: Some(Arc::new(key.clone())),
            ..Admission::default()
        });
        let wrong = SharedSecret::new("svc", "0123456789abcdeF").unwrap();
        let refusal = authenticate(&g, &wrong);
        assert!(refusal.starts_with(b"RPCREFUS"), "{refusal:?}");
        assert_eq!(refusal[8], Code::Unauthenticated as u8);
        assert!(String::from_utf8_lossy(&refusal).contains("wrong shared secret"));
        // Nothing reached the fabric: no ring, no queue pair.
        assert!(admitted(&g, Duration::from_millis(200)).is_none());
        // A client that answers without being asked, or not at all, neither.
        let mut s = connect(&g);
        s.write_all(&hello().encode()).unwrap();
        s.write_all(b"RPCANSWR\xff\xff").unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(
            String::from_utf8_lossy(&rest).contains("more than"),
            "{rest:?}"
        );
        assert!(admitted(&g, Duration::from_millis(200)).is_none());
    }

    #[test]
    fn no_thread_per_handshake() {
        fn threads() -> usize {
            std::fs::read_dir("/proc/self/task").unwrap().count()
        }
        let g = gate(Admission::default());
        let before = threads();
        let idle: Vec<TcpStream> = (0..200).map(|_| connect(&g)).collect();
        std::thread::sleep(Duration::from_millis(100));
        // Other tests in this process may start or stop threads meanwhile;
        // a thread per handshake would be 200 more.
        assert!(
            threads() < before + 50,
            "{} threads for 200 handshakes",
            threads() - before
        );
        drop(idle);
    }
}
