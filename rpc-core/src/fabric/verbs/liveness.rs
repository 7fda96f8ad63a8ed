//! Liveness of rdma:// connections: the handshake's TCP connection stays
//! open for as long as the queue pair lives. When the peer process dies its
//! kernel closes it, and TCP keepalive (see [`KEEPALIVE_BOUND`]) notices a
//! dead host on an idle connection. Either way the connection fails with a
//! completion made up on its completion queue, at once instead of at the
//! next retry timeout.
//!
//! One thread per device context watches every liveness socket of that
//! context through one epoll set ([`Liveness`]), so connections cost no
//! thread each. The same thread watches the context's async event fd
//! ([`Liveness::on_async_events`]): a queue pair's or the device's error
//! and the SRQ's limit reach the dispatchers without their pollers, which
//! spin on the completion queues and would otherwise have to look at that
//! fd with a syscall now and then.

use super::{Side, WcStatus};
use crate::fabric::{Completion, CompletionKind, FabricError};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use slab::Slab;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

pub use crate::fabric::bootstrap::KEEPALIVE_BOUND;
pub(super) use crate::fabric::bootstrap::set_keepalive;

/// The token of the waker that tells the watcher its context is gone.
const WAKE: Token = Token(usize::MAX);
/// The token of the context's async event fd.
const ASYNC: Token = Token(usize::MAX - 1);

/// What the watcher does when the context's async event fd is readable.
type AsyncHandler = Arc<dyn Fn() + Send + Sync>;

/// The liveness watcher of one device context, started with its first
/// connection.
#[derive(Default)]
pub(super) struct Liveness {
    watch: OnceLock<Arc<Watch>>,
    /// The async event fd and its handler, watched from the start.
    async_events: OnceLock<(RawFd, AsyncHandler)>,
}

/// What the watcher thread and the connections share.
struct Watch {
    registry: Registry,
    /// Shared with the watcher thread, which keeps its eventfd open: a wake
    /// queued as the `Watch` drops must still reach the thread.
    waker: Arc<Waker>,
    entries: Mutex<Slab<Entry>>,
    /// Numbers the entries, so that a slot reused by another connection is
    /// not taken for the one that had it.
    next_id: AtomicU64,
    /// Run when the context's async event fd is readable.
    on_async: Option<AsyncHandler>,
}

/// One watched connection.
struct Entry {
    id: u64,
    /// A handle of its own on the liveness socket: the queue pair's handle
    /// may close while the watcher looks at this one.
    stream: TcpStream,
    side: Arc<Side>,
    qp_num: u32,
    incarnation: u64,
}

/// A connection being watched; dropping it stops watching.
pub(super) struct Watched {
    watch: Arc<Watch>,
    key: usize,
    id: u64,
}

impl Liveness {
    /// Has the watcher run `handler` whenever `fd`, the context's async
    /// event fd (non-blocking), is readable, from when the watcher starts
    /// (with the first connection; events queued before then are reported
    /// when the fd is registered, and a dispatcher about to sleep reads
    /// them too). `handler` must read every event there is:
    /// the fd is watched edge-triggered. Set once; later calls are ignored.
    pub(super) fn on_async_events(&self, fd: RawFd, handler: AsyncHandler) {
        let _ = self.async_events.set((fd, handler));
    }

    /// Watches `stream` (a clone is kept): when it reports end of file or
    /// an error, incarnation `incarnation` of queue pair `qp_num` fails on
    /// `side` with a made-up `RetryExceeded` completion.
    pub(super) fn watch(
        &self,
        stream: &TcpStream,
        side: Arc<Side>,
        qp_num: u32,
        incarnation: u64,
    ) -> Result<Watched, FabricError> {
        let watch = match self.watch.get() {
            Some(w) => w.clone(),
            None => {
                let started = Watch::start(self.async_events.get())?;
                // Another connection may have started one meanwhile: keep
                // the first (the other's thread exits when it is dropped).
                self.watch.get_or_init(|| started).clone()
            }
        };
        let stream = stream
            .try_clone()
            .map_err(|e| FabricError::io("clone socket", e))?;
        let fd = stream.as_raw_fd();
        let id = watch.next_id.fetch_add(1, Ordering::Relaxed);
        let mut entries = watch.entries();
        let key = entries.insert(Entry {
            id,
            stream,
            side,
            qp_num,
            incarnation,
        });
        if let Err(e) = watch
            .registry
            .register(&mut SourceFd(&fd), Token(key), Interest::READABLE)
        {
            entries.remove(key);
            return Err(FabricError::io("register the liveness socket", e));
        }
        drop(entries);
        Ok(Watched { watch, key, id })
    }
}

impl Watch {
    /// The epoll set and the thread that waits on it; with `async_events`,
    /// that fd is watched too.
    fn start(async_events: Option<&(RawFd, AsyncHandler)>) -> Result<Arc<Watch>, FabricError> {
        let poll = Poll::new().map_err(|e| FabricError::io("epoll_create", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| FabricError::io("epoll registry", e))?;
        let waker =
            Arc::new(Waker::new(poll.registry(), WAKE).map_err(|e| FabricError::io("eventfd", e))?);
        let async_events = async_events.filter(|(fd, _)| {
            let registered = registry.register(&mut SourceFd(fd), ASYNC, Interest::READABLE);
            if let Err(e) = &registered {
                tracing::warn!(error = %e, "cannot watch the RDMA async event fd; dispatchers read it when they sleep");
            }
            registered.is_ok()
        });
        let watch = Arc::new(Watch {
            registry,
            waker: waker.clone(),
            entries: Mutex::new(Slab::new()),
            next_id: AtomicU64::new(0),
            on_async: async_events.map(|(_, handler)| handler.clone()),
        });
        let weak = Arc::downgrade(&watch);
        std::thread::Builder::new()
            .name("rpc-rdma-live".into())
            .spawn(move || run(poll, weak, waker))
            .map_err(|e| FabricError::io("spawn the liveness watcher", e))?;
        Ok(watch)
    }

    fn entries(&self) -> MutexGuard<'_, Slab<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // The thread holds only a weak reference: tell it to look.
        let _ = self.waker.wake();
    }
}

/// The watcher thread: until its context is gone, fails the connections
/// whose liveness socket ends and hands async events to their handler.
/// It holds `waker`'s eventfd open so that the wake of a dropped `Watch`
/// is not lost with the fd.
fn run(mut poll: Poll, watch: Weak<Watch>, _waker: Arc<Waker>) {
    let mut events = Events::with_capacity(64);
    loop {
        if let Err(e) = poll.poll(&mut events, None) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "liveness watcher cannot wait; dead peers go unnoticed");
            return;
        }
        let Some(live) = watch.upgrade() else {
            return;
        };
        handle(&live, &events);
        drop(live);
        // The last `Watch` may have gone with this thread's handle (the
        // async handler dropped the context): nothing would wake it again.
        if watch.strong_count() == 0 {
            return;
        }
    }
}

/// One wake of the watcher: async events to their handler, ended liveness
/// sockets to their queue pairs' failure.
fn handle(watch: &Watch, events: &Events) {
    if let Some(on_async) = &watch.on_async {
        if events.iter().any(|e| e.token() == ASYNC) {
            on_async();
        }
    }
    let mut entries = watch.entries();
    for event in events {
        let key = event.token().0;
        if event.token() == WAKE || event.token() == ASYNC || !entries.contains(key) {
            continue;
        }
        if !ended(&entries[key].stream) {
            continue;
        }
        let entry = entries.remove(key);
        let _ = watch
            .registry
            .deregister(&mut SourceFd(&entry.stream.as_raw_fd()));
        // Not for a queue pair already dropped (this side closed it):
        // its number may belong to another one by now.
        let c = Completion {
            wr_id: 0,
            qp_num: entry.qp_num,
            kind: CompletionKind::Send,
            status: WcStatus::RetryExceeded,
        };
        if entry.side.push_if_live(Some(entry.incarnation), c) {
            tracing::debug!(qp_num = entry.qp_num, "peer closed its liveness connection");
        }
    }
}

/// Whether a liveness socket reported readable has ended: end of file, an
/// error (a keepalive timeout, a reset) or bytes, which the peer never
/// sends after the handshake. Only "nothing yet" keeps it watched.
fn ended(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: `buf` is valid for writes of its length; the socket is open
        // (the entry owns it). MSG_DONTWAIT leaves the socket's blocking mode
        // alone for the queue pair's own handle.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return true;
        }
        match std::io::Error::last_os_error().kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return false,
            _ => return true,
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut entries = self.watch.entries();
        if entries.get(self.key).is_some_and(|e| e.id == self.id) {
            let entry = entries.remove(self.key);
            let _ = self
                .watch
                .registry
                .deregister(&mut SourceFd(&entry.stream.as_raw_fd()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Shutdown, TcpListener};
    use std::time::{Duration, Instant};

    /// A connected pair of loopback sockets: (ours, the peer's).
    fn socket_pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, _) = listener.accept().unwrap();
        (ours, peer)
    }

    /// A side on which queue pair `qp_num` is live as incarnation 1.
    fn side_with(qp_nums: impl IntoIterator<Item = u32>) -> Arc<Side> {
        let side = Side::new().unwrap();
        side.lock().live.extend(qp_nums.into_iter().map(|q| (q, 1)));
        side
    }

    /// The qp numbers of the made-up completions queued on `side`.
    fn failed(side: &Side) -> Vec<u32> {
        let st = side.lock();
        assert!(
            st.queue
                .iter()
                .all(|(_, c)| c.status == WcStatus::RetryExceeded)
        );
        st.queue.iter().map(|(_, c)| c.qp_num).collect()
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name)
            })
            .count()
    }

    #[test]
    fn one_thread_watches_every_connection_and_fails_only_the_ended_ones() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let liveness = Liveness::default();
        let side = side_with(0..100);
        let mut peers = Vec::new();
        let mut watched = Vec::new();
        for qp_num in 0..100 {
            let (ours, peer) = socket_pair(&listener);
            watched.push((
                liveness.watch(&ours, side.clone(), qp_num, 1).unwrap(),
                ours,
            ));
            peers.push(peer);
        }
        // (Other tests may run their own watcher meanwhile.)
        assert!(threads_named("rpc-rdma-live") >= 1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(failed(&side), Vec::<u32>::new(), "nobody ended yet");

        // Peers 3 and 50 go away (their process died: the kernel closes).
        drop(peers.remove(50));
        drop(peers.remove(3));
        wait_until("the two ended connections fail", || {
            failed(&side).len() == 2
        });
        let mut got = failed(&side);
        got.sort_unstable();
        assert_eq!(got, [3, 50]);

        // A peer that sends after the handshake breaks the protocol: failed too.
        use std::io::Write;
        peers[10].write_all(b"junk").unwrap();
        wait_until("the talkative peer's connection fails", || {
            failed(&side).len() == 3
        });
        assert_eq!(failed(&side)[2], 11);
    }

    #[test]
    fn a_connection_no_longer_watched_is_not_failed() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let liveness = Liveness::default();
        let side = side_with([1, 2]);
        let (ours1, peer1) = socket_pair(&listener);
        let (ours2, peer2) = socket_pair(&listener);
        let one = liveness.watch(&ours1, side.clone(), 1, 1).unwrap();
        let _two = liveness.watch(&ours2, side.clone(), 2, 1).unwrap();
        // This side closes connection 1 first, as dropping a queue pair does.
        drop(one);
        ours1.shutdown(Shutdown::Both).unwrap();
        drop(peer1);
        drop(peer2);
        wait_until("connection 2 fails", || failed(&side) == [2]);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(failed(&side), [2], "connection 1 was not watched any more");
    }

    #[test]
    fn a_stale_incarnation_is_not_failed() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let liveness = Liveness::default();
        // Queue pair 7 is live as incarnation 1; a watcher of incarnation 0
        // (a queue pair that had the number before) must not touch it.
        let side = side_with([7, 8]);
        let (old, old_peer) = socket_pair(&listener);
        let (new, new_peer) = socket_pair(&listener);
        let _old = liveness.watch(&old, side.clone(), 7, 0).unwrap();
        let _new = liveness.watch(&new, side.clone(), 8, 1).unwrap();
        drop(old_peer);
        drop(new_peer);
        wait_until("connection 8 fails", || failed(&side) == [8]);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(failed(&side), [8]);
    }

    #[test]
    fn the_watcher_thread_ends_with_its_context() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let liveness = Liveness::default();
        let side = side_with([1]);
        let (ours, _peer) = socket_pair(&listener);
        let watched = liveness.watch(&ours, side, 1, 1).unwrap();
        let weak = Arc::downgrade(liveness.watch.get().unwrap());
        let thread = Arc::downgrade(&liveness.watch.get().unwrap().waker);
        drop(watched);
        drop(liveness);
        assert!(
            weak.upgrade().is_none(),
            "the thread holds no strong reference"
        );
        assert_thread_ends(&thread);
    }

    /// The thread drops its waker as it returns.
    fn assert_thread_ends(thread: &std::sync::Weak<Waker>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while thread.strong_count() > 0 {
            assert!(Instant::now() < deadline, "the watcher thread did not end");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The async event fd's handler runs when the fd is readable; and when
    /// the handler drops the last handle on the context (so the watcher's
    /// own handle is the last one on it), the thread still ends.
    #[test]
    fn async_events_reach_their_handler_and_the_thread_ends_with_them() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let (reader, mut writer) = std::io::pipe().unwrap();
        let slot: Arc<Mutex<Option<Liveness>>> = Arc::default();
        let calls = Arc::new(AtomicU64::new(0));
        let liveness = Liveness::default();
        let (s, c) = (Arc::downgrade(&slot), calls.clone());
        liveness.on_async_events(
            reader.as_raw_fd(),
            Arc::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
                // As a context dropped by the handler's own handle.
                if let Some(slot) = s.upgrade() {
                    drop(slot.lock().unwrap().take());
                }
            }),
        );
        let (ours, _peer) = socket_pair(&listener);
        let watched = liveness.watch(&ours, side_with([1]), 1, 1).unwrap();
        let thread = Arc::downgrade(&liveness.watch.get().unwrap().waker);
        drop(watched);
        *slot.lock().unwrap() = Some(liveness);
        std::io::Write::write_all(&mut writer, b"!").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while calls.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the handler never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(slot.lock().unwrap().is_none(), "the handler dropped it");
        assert_thread_ends(&thread);
        drop(reader);
    }
}
