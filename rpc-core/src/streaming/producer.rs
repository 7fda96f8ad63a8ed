//! Driving a `Stream` of messages into an [`Outbox`]: [`Producer`] sends
//! what the stream yields, batched, as the window allows and up to a
//! budget per poll, and tells how it ended ([`StreamEnd`]); [`Pump`] and
//! [`RequestPump`] do that for a client's request stream.

use super::outbox::{Outbound, Outbox};
use crate::Status;
use futures_core::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Messages a producer takes from its stream per poll before it lets
/// others run.
const SEND_BUDGET: usize = 256;

/// How a server's response stream ended.
pub(crate) enum StreamEnd {
    /// It yielded its last message.
    Finished,
    /// It yielded an error, or a message could not be sent.
    Failed(Status),
    /// Polling it panicked, with this message.
    Panicked(String),
    /// The call is over (cancelled, connection lost): nobody reads more.
    Over,
}

/// Drives a stream of messages into an [`Outbox`]: what the stream yields
/// at once is gathered into batches, sent as the window allows, up to a
/// budget per poll.
pub(crate) struct Producer<M> {
    /// A message that waits for the batch before it to go.
    next: Option<M>,
    /// How the stream ended, told once its last batch went.
    end: Option<StreamEnd>,
    /// An error from the stream ends it at once, without sending what was
    /// gathered ([`Producer::failing_fast`]).
    fail_fast: bool,
}

impl<M: Outbound> Producer<M> {
    pub(crate) fn new() -> Producer<M> {
        Producer {
            next: None,
            end: None,
            fail_fast: false,
        }
    }

    /// An error from the stream ends it at once: what was gathered is not
    /// sent first (a request stream whose error fails the call, which
    /// must not wait for the window to say so).
    pub(crate) fn failing_fast(mut self) -> Producer<M> {
        self.fail_fast = true;
        self
    }

    /// Ends the stream with `end` without polling it again (it panicked):
    /// what it yielded before still goes, then `end` is told.
    pub(crate) fn end_with(&mut self, end: StreamEnd) {
        self.end = Some(end);
    }

    /// Sends what `stream` yields; `Ready` once it ended and all it
    /// yielded went, or once nothing more can be sent.
    pub(crate) fn poll<S>(
        &mut self,
        cx: &mut Context<'_>,
        mut stream: Pin<&mut S>,
        outbox: &mut Outbox,
    ) -> Poll<StreamEnd>
    where
        S: Stream<Item = Result<M, Status>> + ?Sized,
    {
        let stopped = |status: Status, outbox: &Outbox| {
            if outbox.core.is_over() {
                StreamEnd::Over
            } else {
                StreamEnd::Failed(status)
            }
        };
        let mut budget = SEND_BUDGET;
        while self.end.is_none() && budget > 0 {
            let message = match self.next.take() {
                Some(m) => m,
                // A message that goes alone (above `PIPELINED_MAX`) is
                // encoded ahead and waits for the one before to be read:
                // the next is produced once it went, not now. A third
                // message of hundreds of megabytes would only hold memory
                // and take the CPU from the read under way (smaller ones
                // are produced ahead: two of them travel at once, and
                // producing the next meanwhile keeps that pipeline full).
                // (Waiting for the window, it hears of the call's end: the
                // window's waker is the one a failed call wakes.)
                None if outbox.waits_alone() => match outbox.poll_send_batch(cx) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
                    Poll::Pending => return Poll::Pending,
                },
                None => match stream.as_mut().poll_next(cx) {
                    Poll::Ready(Some(Ok(m))) => m,
                    Poll::Ready(Some(Err(status))) if self.fail_fast => {
                        return Poll::Ready(StreamEnd::Failed(status));
                    }
                    Poll::Ready(Some(Err(status))) => {
                        self.end = Some(StreamEnd::Failed(status));
                        break;
                    }
                    Poll::Ready(None) => {
                        self.end = Some(StreamEnd::Finished);
                        break;
                    }
                    Poll::Pending => {
                        // Nothing more for now: what was gathered goes (or
                        // the initial metadata, if nothing carried it yet),
                        // and a cancel must still wake us.
                        let sent = match outbox.poll_send_batch(cx) {
                            Poll::Ready(Ok(())) => outbox.poll_send_headers(cx),
                            other => other,
                        };
                        return match sent {
                            Poll::Ready(Err(status)) => Poll::Ready(stopped(status, outbox)),
                            _ if outbox.core.watch_over(cx) => Poll::Ready(StreamEnd::Over),
                            _ => Poll::Pending,
                        };
                    }
                },
            };
            match message.poll_push_into(cx, outbox) {
                Poll::Ready(Ok(())) => budget -= 1,
                Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
                Poll::Pending => {
                    self.next = Some(message);
                    return Poll::Pending;
                }
            }
        }
        match outbox.poll_send_batch(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(status)) => return Poll::Ready(stopped(status, outbox)),
            Poll::Pending => return Poll::Pending,
        }
        match self.end.take() {
            Some(end) => Poll::Ready(end),
            None => {
                // Budget spent: let the others run, and come back at once.
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

/// Sends the messages of a `Stream` into a stream direction as the window
/// allows; polled by whoever waits on the call.
pub(crate) trait Pump: Send {
    /// Sends what is ready; `Ready` once the stream ended (and the
    /// direction is closed) or the call is over.
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<()>;
}

/// A stream of messages as a stream of `Ok` messages.
pub(crate) struct Oks<S>(Pin<Box<S>>);

impl<S: Stream> Stream for Oks<S> {
    type Item = Result<S::Item, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.as_mut().poll_next(cx).map(|m| m.map(Ok))
    }
}

/// A client's request stream, sent as it yields: a stream of messages, or
/// of results whose error fails the call ([`RequestPump::fallible`]).
pub(crate) struct RequestPump<S, M> {
    stream: S,
    outbox: Outbox,
    producer: Producer<M>,
    done: bool,
}

impl<T> RequestPump<Oks<T>, T::Item>
where
    T: Stream + Send + 'static,
    T::Item: Outbound,
{
    pub(crate) fn new(stream: T, outbox: Outbox) -> RequestPump<Oks<T>, T::Item> {
        RequestPump::fallible(Oks(Box::pin(stream)), outbox)
    }
}

impl<S, M> RequestPump<S, M>
where
    S: Stream<Item = Result<M, Status>> + Send + Unpin + 'static,
    M: Outbound,
{
    /// A request stream whose error fails the call with it (a gRPC
    /// caller's message that breaks gRPC's framing, on the face).
    pub(crate) fn fallible(stream: S, outbox: Outbox) -> RequestPump<S, M> {
        RequestPump {
            stream,
            outbox,
            producer: Producer::new().failing_fast(),
            done: false,
        }
    }
}

impl<S, M> Pump for RequestPump<S, M>
where
    S: Stream<Item = Result<M, Status>> + Send + Unpin + 'static,
    M: Outbound + Send,
{
    fn poll_pump(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.done {
            return Poll::Ready(());
        }
        let end = self
            .producer
            .poll(cx, Pin::new(&mut self.stream), &mut self.outbox);
        let Poll::Ready(end) = end else {
            self.outbox.flush();
            return Poll::Pending;
        };
        match end {
            StreamEnd::Finished => {
                if let Err(status) = self.outbox.half_close() {
                    tracing::debug!(%status, "could not half-close a request stream");
                }
            }
            // A message that cannot be sent (too large) fails the call; a
            // call that is over tells its own outcome.
            StreamEnd::Failed(status) => {
                tracing::debug!(%status, "request stream stopped");
                if !self.outbox.core.is_over() {
                    self.outbox.core.fail(status);
                }
            }
            StreamEnd::Panicked(_) | StreamEnd::Over => {}
        }
        self.outbox.flush();
        self.done = true;
        Poll::Ready(())
    }
}
