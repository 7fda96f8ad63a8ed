//! The sockets of one completion queue ([`TcpIo`]) and the epoll set that
//! watches them: whoever polls the queue reads every ready socket, a
//! budget at a time so that one busy peer does not keep the others
//! waiting, and writes out what waits for a writable one. A closed
//! connection flushes, up to a linger, before its socket is shut down.

use super::reader::ReadOutcome;
use super::{SCRATCH, TcpConn};
use crate::fabric::FabricError;
use crate::fabric::soft::CqInner;
use mio::unix::SourceFd;
use mio::{Interest, Token};
use slab::Slab;
use std::io::ErrorKind;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a closing connection keeps trying to flush to a peer that does
/// not read before it gives up.
const CLOSE_LINGER: Duration = Duration::from_secs(5);
/// The poller's token for its waker.
const WAKER: Token = Token(usize::MAX);

/// The sockets of the tcp:// queue pairs that report to one completion
/// queue, and the epoll set that watches them.
pub(crate) struct TcpIo {
    registry: mio::Registry,
    waker: mio::Waker,
    poll: Mutex<IoPoll>,
    conns: Mutex<Slab<Arc<TcpConn>>>,
    /// Entries in `conns`: a queue without sockets skips `epoll_wait`.
    live: AtomicUsize,
    /// Connections closed with bytes still to flush (see [`TcpIo::close`]).
    closing: Mutex<Vec<(usize, Instant)>>,
    has_closing: AtomicBool,
    /// TLS connections just registered: their session may already hold
    /// bytes the socket will never report again (decrypted during the
    /// handshake, or not yet written), so the next poll services them.
    kicked: Mutex<Vec<usize>>,
    has_kicked: AtomicBool,
}

/// What only the thread reading the sockets touches.
struct IoPoll {
    poll: mio::Poll,
    events: mio::Events,
    scratch: Box<[u8]>,
    /// Connections that stopped reading before their socket ran dry (read
    /// budget spent, or waiting for a receive): read again at the next poll,
    /// since an edge-triggered poller will not report them again.
    again: Vec<usize>,
    again_next: Vec<usize>,
}

impl TcpIo {
    pub(crate) fn new() -> Result<TcpIo, FabricError> {
        let poll = mio::Poll::new().map_err(|e| FabricError::io("epoll_create", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| FabricError::io("epoll registry", e))?;
        let waker = mio::Waker::new(&registry, WAKER).map_err(|e| FabricError::io("eventfd", e))?;
        Ok(TcpIo {
            registry,
            waker,
            poll: Mutex::new(IoPoll {
                poll,
                events: mio::Events::with_capacity(256),
                scratch: vec![0u8; SCRATCH].into_boxed_slice(),
                again: Vec::new(),
                again_next: Vec::new(),
            }),
            conns: Mutex::new(Slab::new()),
            live: AtomicUsize::new(0),
            closing: Mutex::new(Vec::new()),
            has_closing: AtomicBool::new(false),
            kicked: Mutex::new(Vec::new()),
            has_kicked: AtomicBool::new(false),
        })
    }

    fn conns(&self) -> MutexGuard<'_, Slab<Arc<TcpConn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes a thread sleeping in [`TcpIo::wait`].
    pub(crate) fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake a completion queue's poller");
        }
    }

    /// Starts watching `conn`'s socket; returns its key.
    pub(super) fn register(&self, conn: Arc<TcpConn>) -> Result<usize, FabricError> {
        let mut conns = self.conns();
        let entry = conns.vacant_entry();
        let key = entry.key();
        self.registry
            .register(
                &mut SourceFd(&conn.stream.as_raw_fd()),
                Token(key),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| FabricError::io("epoll_ctl(ADD)", e))?;
        let tls = conn.tls;
        entry.insert(conn);
        self.live.fetch_add(1, Ordering::Release);
        drop(conns);
        if tls {
            self.kicked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(key);
            self.has_kicked.store(true, Ordering::Release);
            self.wake();
        }
        Ok(key)
    }

    /// Stops watching the connection at `key` (if it is still `conn`) and
    /// shuts its socket down.
    fn remove(&self, key: usize, conn: &Arc<TcpConn>) {
        let removed = {
            let mut conns = self.conns();
            match conns.get(key) {
                Some(c) if Arc::ptr_eq(c, conn) => Some(conns.remove(key)),
                _ => None,
            }
        };
        if let Some(c) = removed {
            self.live.fetch_sub(1, Ordering::Release);
            let _ = self
                .registry
                .deregister(&mut SourceFd(&c.stream.as_raw_fd()));
            let _ = c.stream.shutdown(Shutdown::Both);
        }
    }

    /// Closes `conn` once what was posted is written, like an orderly close;
    /// a peer that does not read gets [`CLOSE_LINGER`].
    pub(super) fn close(&self, key: usize, conn: &Arc<TcpConn>) {
        let flushed = {
            let mut tx = conn.tx();
            tx.closing = true;
            tx.sent_since_look = true;
            if !tx.failed {
                if let Some(session) = &mut tx.tls {
                    // The peer learns that the end is ours, not a cut.
                    session.close_notify();
                    let _ = session.flush(&conn.stream);
                }
            }
            tx.flushed() || tx.failed
        };
        if flushed {
            self.remove(key, conn);
        } else {
            self.closing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((key, Instant::now() + CLOSE_LINGER));
            self.has_closing.store(true, Ordering::Release);
            self.wake();
        }
    }

    /// Reads what the sockets have, without blocking: called by every poll
    /// of the queue. Skipped while another thread reads them.
    pub(crate) fn poll_now(&self, cq: &CqInner) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let Ok(mut io) = self.poll.try_lock() else {
            return;
        };
        self.turn(&mut io, cq, Some(Duration::ZERO));
    }

    /// Sleeps until a socket is ready, the waker fires or `timeout` passes,
    /// then reads what is ready.
    pub(crate) fn wait(&self, cq: &CqInner, timeout: Option<Duration>) {
        let mut io = self.poll.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = if io.again.is_empty() {
            timeout
        } else {
            Some(Duration::ZERO)
        };
        self.turn(&mut io, cq, timeout);
    }

    fn turn(&self, io: &mut IoPoll, cq: &CqInner, timeout: Option<Duration>) {
        let IoPoll {
            poll,
            events,
            scratch,
            again,
            again_next,
        } = io;
        if let Err(e) = poll.poll(events, timeout) {
            if e.kind() != ErrorKind::Interrupted {
                tracing::error!(error = %e, "epoll_wait failed");
            }
            return;
        }
        again_next.clear();
        for key in again.drain(..) {
            self.service(key, true, false, scratch, cq, again_next);
        }
        for ev in events.iter() {
            if ev.token() == WAKER {
                continue;
            }
            let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
            let writable = ev.is_writable() || ev.is_write_closed();
            self.service(ev.token().0, readable, writable, scratch, cq, again_next);
        }
        if self.has_kicked.load(Ordering::Acquire) {
            let kicked =
                std::mem::take(&mut *self.kicked.lock().unwrap_or_else(|e| e.into_inner()));
            self.has_kicked.store(false, Ordering::Release);
            for key in kicked {
                self.service(key, true, true, scratch, cq, again_next);
            }
        }
        std::mem::swap(again, again_next);
        again.sort_unstable();
        again.dedup();
        if self.has_closing.load(Ordering::Acquire) {
            self.linger();
        }
    }

    /// Handles a ready socket.
    fn service(
        &self,
        key: usize,
        readable: bool,
        writable: bool,
        scratch: &mut [u8],
        cq: &CqInner,
        again: &mut Vec<usize>,
    ) {
        let Some(conn) = self.conns().get(key).cloned() else {
            return; // closed meanwhile
        };
        if writable {
            conn.flush(cq);
        }
        if readable {
            match conn.read_ready(scratch, cq) {
                ReadOutcome::Drained => {}
                ReadOutcome::More => again.push(key),
                ReadOutcome::Closed => self.remove(key, &conn),
            }
        }
        if conn.tx().closing {
            let flushed = {
                let tx = conn.tx();
                tx.flushed() || tx.failed
            };
            if flushed {
                self.remove(key, &conn);
            }
        }
    }

    /// Gives up on closing connections whose peer did not read in time, and
    /// forgets those already gone.
    fn linger(&self) {
        let mut closing = self.closing.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        closing.retain(|&(key, deadline)| {
            let Some(conn) = self.conns().get(key).cloned() else {
                return false;
            };
            if !conn.tx().closing {
                return false; // the key belongs to a newer connection
            }
            if now < deadline {
                return true;
            }
            tracing::debug!("giving up flushing to a peer that does not read");
            self.remove(key, &conn);
            false
        });
        self.has_closing
            .store(!closing.is_empty(), Ordering::Release);
    }
}
