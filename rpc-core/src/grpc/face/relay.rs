//! A gRPC caller's request stream passed on to our call on the face
//! ([`UntilFailed`]). A stream that fails is not passed on as an end.

use crate::{Code, Status};
use futures_core::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

/// A gRPC caller's request stream passed on to our call on the face,
/// until the stream ends, which half-closes the call on the other side.
/// One whose body fails (its caller cancelled, reset its HTTP/2 stream or
/// lost its connection: a `Cancelled` error) does not end: an end would
/// let the handler take the messages so far for the whole stream. It stays
/// pending until the call is dropped, which cancels it on the other side
/// too. A message that breaks gRPC's framing (any other error) is passed
/// on, and fails the call with its status.
///
/// On the face, hyper reports a reset with `NO_ERROR` as the body's end,
/// as it does a half-close (`CANCEL`, what a gRPC client sends when it
/// drops a call, is an error). So the face holds an end back for one
/// poll (`hold_end`), waking itself, and so does the call's response body
/// (the face's `Outgoing`, which tonic may poll many times in one poll of
/// its own).
/// hyper looks for a reset each time the call's future is pending and
/// before each poll of its response body, and drops them on one: a reset
/// is not passed on as an end.
pub(super) struct UntilFailed<S> {
    stream: S,
    failed: bool,
    /// Whether an end is held back for a poll, and who is told.
    hold_end: HoldEnd,
    /// The inner stream ended (and is not polled again).
    ended: bool,
}

/// Whether an [`UntilFailed`] holds its end back for a poll.
pub(super) enum HoldEnd {
    /// Held back; nobody else is told (a client-streaming call on the
    /// face: its answer comes in its last frame, once its handler is
    /// done, so the answer's own poll is all it takes).
    Alone,
    /// Held back, and the call's response body is told, to give up its
    /// poll as well (a bidirectional call on the face).
    Told(HeldEnd),
}

/// That a face call's request stream held its end back, for its response
/// body to give up its poll as well (see [`UntilFailed`]).
#[derive(Clone, Default)]
pub(super) struct HeldEnd(Arc<std::sync::atomic::AtomicBool>);

impl HeldEnd {
    fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether an end was held back since the last look.
    pub(super) fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

impl<S> UntilFailed<S> {
    pub(super) fn new(stream: S, hold_end: HoldEnd) -> UntilFailed<S> {
        UntilFailed {
            stream,
            failed: false,
            hold_end,
            ended: false,
        }
    }
}

impl<S, T> Stream for UntilFailed<S>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.failed {
            return Poll::Pending;
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match std::task::ready!(Pin::new(&mut self.stream).poll_next(cx)) {
            Some(Ok(m)) => Poll::Ready(Some(Ok(m))),
            // The body failed (reset, connection lost): not an end.
            Some(Err(status)) if status.code() == Code::Cancelled => {
                tracing::debug!(%status, "request stream failed");
                self.failed = true;
                Poll::Pending
            }
            // A message that breaks gRPC's framing: the call fails with it.
            Some(Err(status)) => {
                self.failed = true;
                Poll::Ready(Some(Err(status)))
            }
            None => {
                self.ended = true;
                match &self.hold_end {
                    HoldEnd::Alone => {}
                    HoldEnd::Told(held) => held.set(),
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}
