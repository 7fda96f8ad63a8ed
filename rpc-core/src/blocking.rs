//! Threads for work that blocks: blocking services and methods of a server
//! ([`crate::ServerBuilder::add_blocking_service`]) and [`blocking`].
//!
//! Dispatchers run handlers to completion on their own thread, so a handler
//! that blocks would hold up every connection of its dispatcher. Such work
//! goes to a bounded pool instead: threads start when a job finds none idle,
//! up to the pool's limit; beyond it, jobs queue.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

type Job = Box<dyn FnOnce() + Send>;

/// Jobs waiting for a thread, one queue per key (a server uses one per
/// connection), taken round-robin across keys: a connection with a
/// hundred slow calls queued delays another's call by at most one job per
/// busy thread, not by its whole queue.
#[derive(Default)]
struct Queues {
    /// Each key's jobs, oldest first.
    jobs: HashMap<u64, VecDeque<Job>>,
    /// Keys that have jobs, in the order they are served next.
    turn: VecDeque<u64>,
    queued: usize,
    /// Threads waiting for a job.
    idle: usize,
    threads: usize,
}

impl Queues {
    fn push(&mut self, key: u64, job: Job) {
        let q = self.jobs.entry(key).or_default();
        if q.is_empty() {
            self.turn.push_back(key);
        }
        q.push_back(job);
        self.queued += 1;
    }

    fn pop(&mut self) -> Option<Job> {
        let key = self.turn.pop_front()?;
        let q = self.jobs.get_mut(&key).expect("a key in turn has jobs");
        let job = q.pop_front().expect("a key in turn has jobs");
        if q.is_empty() {
            self.jobs.remove(&key);
        } else {
            self.turn.push_back(key);
        }
        self.queued -= 1;
        Some(job)
    }
}

struct PoolState {
    name: &'static str,
    max_threads: usize,
    queues: Mutex<Queues>,
    ready: Condvar,
}

/// A bounded pool of threads for blocking work, fair across keys.
pub(crate) struct BlockingPool {
    state: Arc<PoolState>,
}

impl BlockingPool {
    /// A pool of at most `max_threads` threads named `name-N`, none started yet.
    pub(crate) fn new(name: &'static str, max_threads: usize) -> BlockingPool {
        BlockingPool {
            state: Arc::new(PoolState {
                name,
                max_threads: max_threads.max(1),
                queues: Mutex::default(),
                ready: Condvar::new(),
            }),
        }
    }

    /// Runs `job` on a pool thread, under key 0.
    pub(crate) fn execute(&self, job: Job) {
        self.execute_for(0, job);
    }

    /// Runs `job` on a pool thread: an idle one, or a new one if the limit
    /// allows; otherwise it waits its key's turn (see [`Queues`]).
    pub(crate) fn execute_for(&self, key: u64, job: Job) {
        // The job runs in the tokio runtime its submitter is in (a server's
        // dispatchers are in the server's), so blocking handlers can use
        // tokio's timers and sockets as the others can.
        #[cfg(feature = "tokio")]
        let job: Job = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => Box::new(move || {
                let _entered = runtime.enter();
                job()
            }),
            Err(_) => job,
        };
        let st = &self.state;
        let mut q = st.queues.lock().unwrap_or_else(|e| e.into_inner());
        q.push(key, job);
        if q.idle >= q.queued {
            drop(q);
            st.ready.notify_one();
            return;
        }
        if q.threads >= st.max_threads {
            return;
        }
        let n = q.threads;
        q.threads += 1;
        drop(q);
        let state = st.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{}-{n}", st.name))
            .spawn(move || state.work());
        if let Err(e) = spawned {
            st.queues.lock().unwrap_or_else(|e| e.into_inner()).threads -= 1;
            tracing::error!(error = %e, pool = st.name, "cannot start a blocking-pool thread");
        }
    }

    /// Threads started so far.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.state.queues.lock().unwrap().threads
    }
}

impl PoolState {
    /// A pool thread: takes jobs for as long as the process lives.
    fn work(&self) {
        let mut q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(job) = q.pop() {
                drop(q);
                job();
                q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            q.idle += 1;
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            q.idle -= 1;
        }
    }
}

/// The pool [`blocking`] uses: at most this many threads per process.
const GLOBAL_BLOCKING_THREADS: usize = 64;

fn global() -> &'static BlockingPool {
    static POOL: OnceLock<BlockingPool> = OnceLock::new();
    POOL.get_or_init(|| BlockingPool::new("rpc-blocking", GLOBAL_BLOCKING_THREADS))
}

struct Shared<T> {
    result: Option<std::thread::Result<T>>,
    waker: Option<Waker>,
}

/// The result of [`blocking`]: a future that resolves once `f` has run.
#[must_use = "the result arrives only if this future is awaited"]
pub struct Blocking<T> {
    shared: Arc<Mutex<Shared<T>>>,
}

impl<T> std::fmt::Debug for Blocking<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocking").finish_non_exhaustive()
    }
}

/// Runs `f` on a thread of the process's blocking pool (at most 64 threads,
/// started on demand) and returns a future of its result: how an `async`
/// handler does blocking or CPU-heavy work without holding up its
/// dispatcher. A panic in `f` resumes in the task that awaits the result.
///
/// ```ignore
/// async fn scan(&self, request: Request<ScanRequest>) -> Result<Response<ScanReply>, Status> {
///     let db = self.db.clone();
///     let rows = rpc_core::blocking(move || db.scan_from_disk(&request.into_inner().prefix)).await;
///     Ok(Response::new(ScanReply { rows, ..Default::default() }))
/// }
/// ```
pub fn blocking<T, F>(f: F) -> Blocking<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let shared = Arc::new(Mutex::new(Shared {
        result: None,
        waker: None,
    }));
    let s = shared.clone();
    global().execute(Box::new(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let waker = {
            let mut st = s.lock().unwrap_or_else(|e| e.into_inner());
            st.result = Some(result);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }));
    Blocking { shared }
}

impl<T> Future for Blocking<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut st = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        match st.result.take() {
            Some(Ok(v)) => Poll::Ready(v),
            Some(Err(panic)) => {
                drop(st);
                std::panic::resume_unwind(panic)
            }
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_pool_is_bounded_and_runs_every_job() {
        let pool = BlockingPool::new("test-pool", 2);
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..10 {
            let tx = tx.clone();
            pool.execute(Box::new(move || {
                std::thread::sleep(Duration::from_millis(5));
                tx.send(i).unwrap();
            }));
        }
        let mut got: Vec<i32> = (0..10)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        got.sort_unstable();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert!(pool.threads() <= 2, "{} threads", pool.threads());
    }

    #[test]
    fn jobs_submitted_back_to_back_each_get_a_thread_up_to_the_limit() {
        // Three jobs that can only finish together (a barrier of three)
        // need three threads at once: submitted before the first thread has
        // taken its job, each must still start its own.
        for _ in 0..50 {
            let pool = BlockingPool::new("test-pool", 3);
            let barrier = Arc::new(std::sync::Barrier::new(3));
            let (tx, rx) = crossbeam_channel::unbounded();
            for _ in 0..3 {
                let (barrier, tx) = (barrier.clone(), tx.clone());
                pool.execute(Box::new(move || {
                    barrier.wait();
                    tx.send(()).unwrap();
                }));
            }
            for _ in 0..3 {
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("all three jobs ran at once");
            }
            assert_eq!(pool.threads(), 3);
            // An idle thread takes the next job: no fourth is started.
            let (tx2, rx2) = crossbeam_channel::bounded(1);
            std::thread::sleep(Duration::from_millis(2));
            pool.execute(Box::new(move || tx2.send(()).unwrap()));
            rx2.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(pool.threads(), 3);
        }
    }

    #[test]
    fn a_key_with_many_jobs_does_not_hold_up_another() {
        let pool = BlockingPool::new("test-pool", 1);
        let (tx, rx) = crossbeam_channel::unbounded();
        // Key 1 queues ten jobs behind a first one that holds the only
        // thread until key 2's job is in.
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
        pool.execute_for(1, Box::new(move || go_rx.recv().unwrap()));
        for i in 0..10 {
            let tx = tx.clone();
            pool.execute_for(1, Box::new(move || tx.send((1, i)).unwrap()));
        }
        let tx2 = tx.clone();
        pool.execute_for(2, Box::new(move || tx2.send((2, 0)).unwrap()));
        go_tx.send(()).unwrap();
        let order: Vec<(u64, i32)> = (0..11)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        // Key 2 went first or second (after at most one of key 1's queued
        // jobs, depending on whether the thread took the first job before
        // the others were queued), not eleventh; each key in its own order.
        let two = order.iter().position(|&(k, _)| k == 2).unwrap();
        assert!(two <= 1, "key 2 ran {two}th: {order:?}");
        let ones: Vec<i32> = order
            .iter()
            .filter(|(k, _)| *k == 1)
            .map(|(_, i)| *i)
            .collect();
        assert_eq!(ones, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn blocking_resolves_to_the_result() {
        let v = futures::executor::block_on(blocking(|| {
            std::thread::sleep(Duration::from_millis(5));
            41 + 1
        }));
        assert_eq!(v, 42);
    }
}
