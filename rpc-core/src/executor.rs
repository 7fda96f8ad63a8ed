//! The tasks of one dispatcher: handlers run to completion on the thread
//! that polled their request, and an asynchronous handler that has to wait
//! parks here and resumes on the same thread when woken.
//!
//! A request's task is polled once, inline, as soon as its frame is
//! decoded. Most handlers finish in that first poll, and that path
//! allocates nothing and takes no lock: the task's future is placed in a
//! pinned box taken from a per-thread pool for its type, and the poll is
//! lent a waker on the stack, which gives the task an entry in the task
//! table and a waker from the dispatcher's pool only if the future keeps
//! or uses it. Only a task that returns `Pending` is parked (its box goes
//! into the dispatcher's task table, type-erased); its waker then queues
//! it on the dispatcher and interrupts the dispatcher's wait.
//!
//! Threads that are not dispatchers (the blocking pool) run tasks to
//! completion with [`block_on`].
//!
//! A waker queues its task's key, then sets `any_woken`, then interrupts
//! the dispatcher; the dispatcher takes `any_woken` before the keys, and
//! looks at it (`has_woken`) before it sleeps on its completion queue, whose
//! interrupt is sticky: a task woken while its dispatcher goes to sleep is
//! run. `scripts/loom` model-checks this: `rpc-core/tests/loom_wake.rs`.

use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};
use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Wake, Waker};

/// Pinned future boxes kept per type and thread for reuse.
const MAX_POOLED_PER_TYPE: usize = 64;
/// Wakers a dispatcher keeps for reuse.
const MAX_POOLED_WAKERS: usize = 256;

/// A task's future, type-erased once it is parked.
trait TaskFuture: Send {
    fn poll_task(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()>;
}

impl<F: Future<Output = ()> + Send> TaskFuture for Option<F> {
    fn poll_task(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.as_pin_mut() {
            Some(f) => f.poll(cx),
            None => Poll::Ready(()),
        }
    }
}

struct Parked {
    /// `None` while the task is being polled inline for the first time.
    future: Option<Pin<Box<dyn TaskFuture>>>,
    waker: Arc<TaskWaker>,
}

/// What wakers reach from any thread.
struct Shared {
    woken: Mutex<Vec<usize>>,
    any_woken: AtomicBool,
    /// Interrupts the dispatcher's wait on its completion queue.
    interrupt: Box<dyn Fn() + Send + Sync>,
}

struct TaskWaker {
    shared: Arc<Shared>,
    key: AtomicUsize,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let s = &self.shared;
        s.woken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.key.load(Ordering::Acquire));
        s.any_woken.store(true, Ordering::Release);
        (s.interrupt)();
    }
}

/// One dispatcher's tasks.
pub struct Executor {
    shared: Arc<Shared>,
    tasks: Mutex<slab::Slab<Parked>>,
    wakers: Mutex<Vec<Arc<TaskWaker>>>,
    /// Keys taken off `woken`, reused between turns.
    scratch: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("tasks", &self.tasks().len())
            .finish()
    }
}

thread_local! {
    /// The executor of the dispatcher running on this thread, if any.
    static CURRENT: RefCell<Option<Arc<Executor>>> = const { RefCell::new(None) };
    /// Pinned future boxes for reuse, by the future's type.
    static POOLS: RefCell<Vec<(TypeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
    /// The message of a handler panic, for the answer its call gets.
    static PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Takes the message of the panic that ended the task being dropped, if any.
pub(crate) fn take_panic_message() -> Option<String> {
    PANIC.with(|p| p.borrow_mut().take())
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn take_box<F: Future<Output = ()> + Send + 'static>() -> Pin<Box<Option<F>>> {
    POOLS
        .with(|pools| {
            let mut pools = pools.borrow_mut();
            let (_, pool) = pools.iter_mut().find(|(t, _)| *t == TypeId::of::<F>())?;
            pool.downcast_mut::<Vec<Pin<Box<Option<F>>>>>()?.pop()
        })
        .unwrap_or_else(|| Box::pin(None))
}

fn give_box<F: Future<Output = ()> + Send + 'static>(b: Pin<Box<Option<F>>>) {
    POOLS.with(|pools| {
        let mut pools = pools.borrow_mut();
        let id = TypeId::of::<F>();
        let i = match pools.iter().position(|(t, _)| *t == id) {
            Some(i) => i,
            None => {
                pools.push((id, Box::new(Vec::<Pin<Box<Option<F>>>>::new())));
                pools.len() - 1
            }
        };
        if let Some(pool) = pools[i].1.downcast_mut::<Vec<Pin<Box<Option<F>>>>>() {
            if pool.len() < MAX_POOLED_PER_TYPE {
                pool.push(b);
            }
        }
    });
}

/// Polls `f` once, catching a panic: its message is kept for the call's
/// answer and the future is dropped. True when the future is finished.
fn poll_catching(f: Pin<&mut dyn TaskFuture>, cx: &mut Context<'_>) -> bool {
    match catch_unwind(AssertUnwindSafe(|| f.poll_task(cx))) {
        Ok(poll) => poll.is_ready(),
        Err(panic) => {
            let what = panic_message(&*panic);
            tracing::error!(panic = %what, "handler panicked");
            PANIC.with(|p| *p.borrow_mut() = Some(what));
            true
        }
    }
}

impl Executor {
    /// An executor whose wakers call `interrupt` to wake its dispatcher.
    pub fn new(interrupt: impl Fn() + Send + Sync + 'static) -> Arc<Executor> {
        Arc::new(Executor {
            shared: Arc::new(Shared {
                woken: Mutex::new(Vec::new()),
                any_woken: AtomicBool::new(false),
                interrupt: Box::new(interrupt),
            }),
            tasks: Mutex::new(slab::Slab::new()),
            wakers: Mutex::new(Vec::new()),
            scratch: Mutex::new(Vec::new()),
        })
    }

    fn tasks(&self) -> MutexGuard<'_, slab::Slab<Parked>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes this the executor of the calling (dispatcher) thread.
    pub(crate) fn enter(self: &Arc<Self>) {
        CURRENT.with(|c| *c.borrow_mut() = Some(self.clone()));
    }

    /// The executor of the calling thread's dispatcher, if it is one.
    pub(crate) fn current() -> Option<Arc<Executor>> {
        CURRENT.with(|c| c.borrow().clone())
    }

    /// Tasks parked, waiting to be woken.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn parked(&self) -> usize {
        self.tasks().len()
    }

    fn take_waker(&self, key: usize) -> Arc<TaskWaker> {
        let pooled = self.wakers.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let waker = pooled.unwrap_or_else(|| {
            Arc::new(TaskWaker {
                shared: self.shared.clone(),
                key: AtomicUsize::new(0),
            })
        });
        waker.key.store(key, Ordering::Release);
        waker
    }

    /// Keeps `waker` for another task if nobody else holds it any more.
    fn give_waker(&self, waker: Arc<TaskWaker>) {
        if Arc::strong_count(&waker) == 1 {
            let mut pool = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < MAX_POOLED_WAKERS {
                pool.push(waker);
            }
        }
    }

    /// Runs `future` on this dispatcher: polls it now, on the calling
    /// thread, and parks it if it has to wait.
    ///
    /// The first poll lends the future a waker that stands for a task not
    /// yet in the task table: most handlers answer in that poll without
    /// keeping a waker, and then cost no entry, no pooled waker and none of
    /// the locks around them. A future that clones the waker, or wakes
    /// itself, gets the task its entry and real waker at that moment.
    pub fn spawn<F: Future<Output = ()> + Send + 'static>(&self, future: F) {
        let mut boxed = take_box::<F>();
        boxed.set(Some(future));
        let first = FirstPoll {
            exec: self,
            task: OnceLock::new(),
        };
        let done = first.with_waker(|w| poll_catching(boxed.as_mut(), &mut Context::from_waker(w)));
        let task = first.task.into_inner();
        if done {
            boxed.set(None);
            give_box(boxed);
            if let Some((key, waker)) = task {
                drop(waker);
                let parked = self.tasks().remove(key);
                self.give_waker(parked.waker);
            }
        } else {
            let key = match task {
                Some((key, _)) => key,
                None => self.add_task().0,
            };
            self.tasks()[key].future = Some(boxed);
        }
    }

    /// A new entry in the task table, its future still out (being polled
    /// for the first time; the task may spawn others meanwhile), and its
    /// waker.
    fn add_task(&self) -> (usize, Arc<TaskWaker>) {
        let mut tasks = self.tasks();
        let entry = tasks.vacant_entry();
        let key = entry.key();
        let waker = self.take_waker(key);
        entry.insert(Parked {
            future: None,
            waker: waker.clone(),
        });
        (key, waker)
    }

    /// Whether tasks were woken since the last [`Executor::run_woken`].
    pub fn has_woken(&self) -> bool {
        self.shared.any_woken.load(Ordering::Acquire)
    }

    /// Polls the tasks woken since the last call; returns how many.
    pub fn run_woken(&self) -> usize {
        if !self.shared.any_woken.swap(false, Ordering::AcqRel) {
            return 0;
        }
        let mut keys = std::mem::take(&mut *self.scratch.lock().unwrap_or_else(|e| e.into_inner()));
        std::mem::swap(
            &mut keys,
            &mut *self.shared.woken.lock().unwrap_or_else(|e| e.into_inner()),
        );
        keys.sort_unstable();
        keys.dedup();
        let mut ran = 0;
        for &key in &keys {
            // Taken out while polled: the task may spawn others meanwhile.
            let (mut future, waker) = {
                let mut tasks = self.tasks();
                let Some(parked) = tasks.get_mut(key) else {
                    continue; // finished already: a late wake
                };
                let Some(future) = parked.future.take() else {
                    continue; // being polled further up this thread's stack
                };
                (future, parked.waker.clone())
            };
            ran += 1;
            let done = poll_catching(
                future.as_mut(),
                &mut Context::from_waker(&Waker::from(waker)),
            );
            if done {
                drop(future);
                let parked = self.tasks().remove(key);
                self.give_waker(parked.waker);
            } else {
                self.tasks()[key].future = Some(future);
            }
        }
        keys.clear();
        *self.scratch.lock().unwrap_or_else(|e| e.into_inner()) = keys;
        ran
    }

    /// Drops every parked task (at shutdown): their calls are answered as
    /// their drop handlers decide.
    pub(crate) fn clear(&self) {
        let tasks = std::mem::take(&mut *self.tasks());
        drop(tasks);
    }
}

/// The waker of a task's first poll ([`Executor::spawn`]), on the spawning
/// thread's stack: until the future clones it or wakes itself through it,
/// the task has no entry in the task table.
struct FirstPoll<'a> {
    exec: &'a Executor,
    /// The task's key and waker, once it has them.
    task: OnceLock<(usize, Arc<TaskWaker>)>,
}

impl FirstPoll<'_> {
    /// The task's real waker, made at the first need.
    fn real(&self) -> &Arc<TaskWaker> {
        &self.task.get_or_init(|| self.exec.add_task()).1
    }

    /// Runs `f` with a waker standing for `self`, which cannot outlive
    /// the call (its clones are real wakers, which do not point here).
    #[allow(unsafe_code)]
    fn with_waker<R>(&self, f: impl FnOnce(&Waker) -> R) -> R {
        let data: *const FirstPoll<'_> = self;
        // SAFETY: the vtable's functions take `data` as a `&FirstPoll`,
        // which it is, borrowed for this call: the waker is only lent to
        // `f` and dropped here (its drop does nothing), and every clone is
        // a real waker that owns what it points to. `FirstPoll` is `Sync`
        // (checked below), so calls from other threads during `f` (a
        // scoped thread given the `&Waker`) are sound.
        let waker = unsafe { Waker::from_raw(RawWaker::new(data.cast(), &FIRST_POLL)) };
        f(&waker)
    }
}

/// [`FirstPoll::with_waker`]'s waker may be used from any thread.
const _: () = {
    const fn is_sync<T: Sync>() {}
    is_sync::<FirstPoll<'static>>()
};

/// The vtable of [`FirstPoll::with_waker`]'s waker.
static FIRST_POLL: RawWakerVTable =
    RawWakerVTable::new(first_clone, first_wake, first_wake, first_drop);

/// A clone of a lent waker is the task's real waker.
#[allow(unsafe_code)]
unsafe fn first_clone(data: *const ()) -> RawWaker {
    // SAFETY: `data` is the `&FirstPoll` the waker was lent with, alive for
    // the poll this is called in (see `FirstPoll::with_waker`).
    let first = unsafe { &*data.cast::<FirstPoll<'_>>() };
    let real = ManuallyDrop::new(Waker::from(first.real().clone()));
    RawWaker::new(real.data(), real.vtable())
}

/// A task that wakes itself in its first poll gets its entry, and is woken.
#[allow(unsafe_code)]
unsafe fn first_wake(data: *const ()) {
    // SAFETY: as in `first_clone`.
    let first = unsafe { &*data.cast::<FirstPoll<'_>>() };
    first.real().wake_by_ref();
}

/// The lent waker owns nothing.
#[allow(unsafe_code)]
unsafe fn first_drop(_: *const ()) {}

/// Runs `future` to completion on the calling thread, parking it while it
/// waits. A panic inside is caught: its message is kept for the call's
/// answer (see [`take_panic_message`]) and the future dropped.
pub(crate) fn block_on<F: Future<Output = ()> + Send>(future: F) {
    Unpark::with(|unpark, waker| {
        let mut cx = Context::from_waker(waker);
        let mut boxed: Pin<Box<Option<F>>> = Box::pin(Some(future));
        loop {
            if poll_catching(boxed.as_mut(), &mut cx) {
                boxed.set(None);
                return;
            }
            unpark.park();
        }
    })
}

/// Wakes a thread parked in [`Unpark::park`] (`std`'s primitives even
/// under loom: the blocking forms are not model-checked).
struct Unpark(std::thread::Thread, std::sync::atomic::AtomicBool);

thread_local! {
    /// This thread's parker and its waker, kept between blocking waits (a
    /// blocking iterator waits once per message); taken while in use, so a
    /// wait nested in another makes its own.
    static PARKER: std::cell::Cell<Option<(Arc<Unpark>, Waker)>> =
        const { std::cell::Cell::new(None) };
}

impl Unpark {
    /// A waker for the calling thread.
    fn current() -> Arc<Unpark> {
        Arc::new(Unpark(
            std::thread::current(),
            std::sync::atomic::AtomicBool::new(false),
        ))
    }

    /// Runs `f` with this thread's parker and its waker.
    fn with<T>(f: impl FnOnce(&Unpark, &Waker) -> T) -> T {
        let (unpark, waker) = PARKER.take().unwrap_or_else(|| {
            let unpark = Unpark::current();
            let waker = Waker::from(unpark.clone());
            (unpark, waker)
        });
        /// Puts the parker back, even if `f` panics.
        struct Back(Option<(Arc<Unpark>, Waker)>);
        impl Drop for Back {
            fn drop(&mut self) {
                PARKER.set(self.0.take());
            }
        }
        let back = Back(Some((unpark, waker)));
        let (unpark, waker) = back.0.as_ref().expect("just set");
        f(unpark, waker)
    }

    /// Parks the calling thread until woken (at once if it was already).
    fn park(&self) {
        while !self.1.swap(false, Ordering::AcqRel) {
            std::thread::park();
        }
    }
}

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.1.store(true, Ordering::Release);
        self.0.unpark();
    }
}

/// Runs `future` to completion on the calling thread and returns its
/// output, parking the thread while it waits (the blocking forms of
/// streams and streaming calls). A panic propagates to the caller.
pub(crate) fn wait_on<F: Future>(future: F) -> F::Output {
    Unpark::with(|unpark, waker| {
        let mut cx = Context::from_waker(waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
                return v;
            }
            unpark.park();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// A future that is pending until its flag is set, then finishes.
    struct Gate(Arc<(AtomicBool, Mutex<Option<Waker>>)>);
    impl Future for Gate {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.0.0.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            *self.0.1.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[test]
    fn ready_tasks_finish_inline_and_parked_ones_resume_when_woken() {
        let interrupts = Arc::new(AtomicU32::new(0));
        let i2 = interrupts.clone();
        let exec = Executor::new(move || {
            i2.fetch_add(1, Ordering::Relaxed);
        });
        let done = Arc::new(AtomicU32::new(0));
        let d = done.clone();
        exec.spawn(async move {
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(
            done.load(Ordering::Relaxed),
            1,
            "finished in the first poll"
        );
        assert_eq!(exec.parked(), 0);

        let gate = Arc::new((AtomicBool::new(false), Mutex::new(None::<Waker>)));
        let (g, d) = (gate.clone(), done.clone());
        exec.spawn(async move {
            Gate(g).await;
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(exec.parked(), 1, "waiting: parked");
        assert_eq!(exec.run_woken(), 0, "not woken yet");
        gate.0.store(true, Ordering::Release);
        let w = gate.1.lock().unwrap().take().unwrap();
        std::thread::spawn(move || w.wake()).join().unwrap();
        assert_eq!(
            interrupts.load(Ordering::Relaxed),
            1,
            "the wake interrupted the dispatcher"
        );
        assert!(exec.has_woken());
        assert_eq!(exec.run_woken(), 1);
        assert_eq!(done.load(Ordering::Relaxed), 2);
        assert_eq!(exec.parked(), 0);
    }

    /// Polls once, waking itself through its first waker, then finishes.
    struct YieldOnce(bool);
    impl Future for YieldOnce {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[test]
    fn a_task_that_wakes_itself_in_its_first_poll_runs_again() {
        let exec = Executor::new(|| {});
        let done = Arc::new(AtomicU32::new(0));
        let d = done.clone();
        exec.spawn(async move {
            YieldOnce(false).await;
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(exec.parked(), 1, "pending: parked");
        assert!(exec.has_woken(), "its own wake queued it");
        assert_eq!(exec.run_woken(), 1);
        assert_eq!(done.load(Ordering::Relaxed), 1);
        assert_eq!(exec.parked(), 0);
    }

    #[test]
    fn a_waker_kept_from_the_first_poll_wakes_its_task() {
        let exec = Executor::new(|| {});
        // Cloned on another thread while the first poll runs.
        let gate = Arc::new((AtomicBool::new(false), Mutex::new(None::<Waker>)));
        let g = gate.clone();
        let done = Arc::new(AtomicU32::new(0));
        let d = done.clone();
        exec.spawn(async move {
            std::future::poll_fn(|cx| {
                if g.0.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                let waker = cx.waker();
                let w = std::thread::scope(|s| s.spawn(|| waker.clone()).join().unwrap());
                *g.1.lock().unwrap() = Some(w);
                Poll::Pending
            })
            .await;
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(exec.parked(), 1);
        assert_eq!(exec.run_woken(), 0, "not woken yet");
        gate.0.store(true, Ordering::Release);
        let w = gate.1.lock().unwrap().take().unwrap();
        assert!(w.will_wake(&w.clone()));
        w.wake();
        assert_eq!(exec.run_woken(), 1);
        assert_eq!(done.load(Ordering::Relaxed), 1);
        assert_eq!(exec.parked(), 0);
    }

    #[test]
    fn a_task_that_finishes_holding_a_clone_of_its_waker_leaves_nothing() {
        let exec = Executor::new(|| {});
        let kept = Arc::new(Mutex::new(None::<Waker>));
        let k = kept.clone();
        exec.spawn(std::future::poll_fn(move |cx| {
            *k.lock().unwrap() = Some(cx.waker().clone());
            Poll::Ready(())
        }));
        assert_eq!(exec.parked(), 0, "finished: its entry is gone");
        // A late wake finds no task; a new task still runs normally.
        kept.lock().unwrap().take().unwrap().wake();
        assert_eq!(exec.run_woken(), 0);
        let done = Arc::new(AtomicU32::new(0));
        let d = done.clone();
        exec.spawn(async move {
            d.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(done.load(Ordering::Relaxed), 1);
        assert_eq!(exec.parked(), 0);
    }

    #[test]
    fn a_panicking_task_is_dropped_and_its_message_kept() {
        let exec = Executor::new(|| {});
        exec.spawn(async { panic!("boom") });
        assert_eq!(exec.parked(), 0);
        assert_eq!(take_panic_message().as_deref(), Some("boom"));
    }

    #[test]
    fn block_on_waits_for_a_wake_from_another_thread() {
        let gate = Arc::new((AtomicBool::new(false), Mutex::new(None::<Waker>)));
        let g = gate.clone();
        let t = std::thread::spawn(move || {
            loop {
                if let Some(w) = g.1.lock().unwrap().take() {
                    g.0.store(true, Ordering::Release);
                    w.wake();
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        });
        block_on(Gate(gate));
        t.join().unwrap();
    }
}
