//! Where a handler's future runs and how it is polled: on the dispatcher's
//! executor (parking while it waits), as a task of tokio's for the gRPC
//! face, or blocked on off a dispatcher; each poll catching a panic, and
//! the future dropped unfinished once its call is cancelled.

use crate::executor::{self, Executor, panic_message};
use crate::streaming::Signal;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

#[cfg(feature = "grpc")]
thread_local! {
    /// Set while the gRPC face starts a call on one of tokio's workers:
    /// the call's task is then spawned on that runtime, as tonic runs its
    /// handlers, instead of blocking the worker.
    pub(super) static ON_TOKIO: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a call's task: on this dispatcher (parking if it waits), or to
/// completion off one. With its `span` enabled, every poll enters it, so
/// a handler that resumes logs inside its call; disabled, the task runs
/// as it is.
pub(super) fn run_task(span: tracing::Span, task: impl Future<Output = ()> + Send + 'static) {
    fn run(task: impl Future<Output = ()> + Send + 'static) {
        match Executor::current() {
            Some(exec) => exec.spawn(task),
            #[cfg(feature = "grpc")]
            None if ON_TOKIO.get() => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    // Polled here first, as a dispatcher runs a handler: a
                    // handler that answers at once needs no task, and a
                    // task of its own could wake the other worker. One that
                    // waits becomes a task, polled again there (which
                    // registers its real waker in place of the no-op one).
                    let mut task = Box::pin(task);
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    if task.as_mut().poll(&mut cx).is_pending() {
                        drop(runtime.spawn(task));
                    }
                }
                Err(_) => executor::block_on(task),
            },
            None => executor::block_on(task),
        }
    }
    if span.is_disabled() {
        run(task)
    } else {
        run(tracing::Instrument::instrument(task, span))
    }
}

/// What a handler panicked with.
type Panic = Box<dyn std::any::Any + Send>;

/// Polls a handler's future to its output (see [`poll_handler`]).
pub(super) async fn run_handler<T, Fut: Future<Output = T>>(
    future: Fut,
    signal: Option<Arc<Signal>>,
) -> Option<Result<T, Panic>> {
    let mut future = std::pin::pin!(Some(future));
    std::future::poll_fn(|cx| poll_handler(future.as_mut(), signal.as_deref(), cx)).await
}

/// Polls the handler's future in `slot` once, catching a panic (so that
/// the call is still ours to answer with the panic's message): its output
/// once it finished; `None` once its call is cancelled (`signal`), unless
/// the handler watches for that itself: the future is then dropped
/// unfinished, as tonic drops it. While it waits, a cancel wakes the task
/// to drop it. The slot is empty after `Ready`.
pub(super) fn poll_handler<Fut: Future>(
    mut slot: Pin<&mut Option<Fut>>,
    signal: Option<&Signal>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Fut::Output, Panic>>> {
    let dropped = |mut slot: Pin<&mut Option<Fut>>| {
        drop_caught(|| slot.set(None));
        Poll::Ready(None)
    };
    if signal.is_some_and(Signal::drops_handler) {
        return dropped(slot);
    }
    let Some(running) = slot.as_mut().as_pin_mut() else {
        return Poll::Ready(None);
    };
    match poll_caught(running, cx) {
        Poll::Ready(outcome) => {
            slot.set(None);
            Poll::Ready(Some(outcome))
        }
        // A cancel that came while it ran: drop it now.
        Poll::Pending if signal.is_some_and(|s| s.poll_drops_handler(cx)) => dropped(slot),
        Poll::Pending => Poll::Pending,
    }
}

/// Drops a handler's future (in `drop`), logging a panic in its drop
/// rather than letting it unwind into the dispatcher.
fn drop_caught(drop: impl FnOnce()) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(drop)) {
        tracing::error!(panic = %panic_message(&*panic), "a cancelled handler's future panicked as it was dropped");
    }
}

/// Polls a handler's future once, catching a panic: `Ready(Err(panic))`
/// if it panicked.
fn poll_caught<Fut: Future>(
    future: Pin<&mut Fut>,
    cx: &mut Context<'_>,
) -> Poll<Result<Fut::Output, Panic>> {
    match catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
        Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(panic) => Poll::Ready(Err(panic)),
    }
}
