//! Threads for work that blocks: blocking services and methods of a server
//! ([`crate::ServerBuilder::add_blocking_service`]) and [`blocking`].
//!
//! Dispatchers run handlers to completion on their own thread, so a handler
//! that blocks would hold up every connection of its dispatcher. Such work
//! goes to a bounded pool instead: threads start when a job finds none idle,
//! up to the pool's limit; beyond it, jobs queue.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

type Job = Box<dyn FnOnce() + Send>;

struct PoolState {
    name: &'static str,
    max_threads: usize,
    threads: AtomicUsize,
    /// Threads waiting for a job.
    idle: AtomicUsize,
    /// Jobs sent and not taken yet.
    queued: AtomicUsize,
}

/// A bounded pool of threads for blocking work.
pub(crate) struct BlockingPool {
    tx: crossbeam_channel::Sender<Job>,
    rx: crossbeam_channel::Receiver<Job>,
    state: Arc<PoolState>,
}

impl BlockingPool {
    /// A pool of at most `max_threads` threads named `name-N`, none started yet.
    pub(crate) fn new(name: &'static str, max_threads: usize) -> BlockingPool {
        let (tx, rx) = crossbeam_channel::unbounded();
        BlockingPool {
            tx,
            rx,
            state: Arc::new(PoolState {
                name,
                max_threads: max_threads.max(1),
                threads: AtomicUsize::new(0),
                idle: AtomicUsize::new(0),
                queued: AtomicUsize::new(0),
            }),
        }
    }

    /// Runs `job` on a pool thread, starting one if fewer are idle than
    /// jobs wait and the limit allows; otherwise it waits for a thread to
    /// be free.
    pub(crate) fn execute(&self, job: Job) {
        let st = &self.state;
        let queued = st.queued.fetch_add(1, Ordering::AcqRel) + 1;
        if let Err(e) = self.tx.send(job) {
            // Only if every receiver is gone, which this pool's own prevents.
            st.queued.fetch_sub(1, Ordering::AcqRel);
            (e.into_inner())();
            return;
        }
        // Counted before the job is taken and after, an idle thread may be
        // missed and one started too many: never one too few.
        if st.idle.load(Ordering::Acquire) >= queued {
            return;
        }
        let n = st.threads.load(Ordering::Acquire);
        if n >= st.max_threads
            || st
                .threads
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        let rx = self.rx.clone();
        let state = st.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{}-{n}", st.name))
            .spawn(move || {
                loop {
                    state.idle.fetch_add(1, Ordering::AcqRel);
                    let Ok(job) = rx.recv() else { return };
                    state.queued.fetch_sub(1, Ordering::AcqRel);
                    state.idle.fetch_sub(1, Ordering::AcqRel);
                    job();
                }
            });
        if let Err(e) = spawned {
            st.threads.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(error = %e, pool = st.name, "cannot start a blocking-pool thread");
        }
    }

    /// Threads started so far.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.state.threads.load(Ordering::Acquire)
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
    fn blocking_resolves_to_the_result() {
        let v = futures::executor::block_on(blocking(|| {
            std::thread::sleep(Duration::from_millis(5));
            41 + 1
        }));
        assert_eq!(v, 42);
    }
}
