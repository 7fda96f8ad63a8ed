//! A stream's shared state: [`StreamCore`], which the dispatcher feeds
//! (each frame's messages into the inbox, window grants, the end) and the
//! stream's ends read: messages and the window to grant back, send window,
//! the peer's metadata, and how the call ended.

use crate::cancel::Signal;
use crate::protocol::Header;
use crate::protocol::stream::{Inbound, Records, RecvWindow, SendWindow, StreamError};
use crate::{Code, Metadata, Status};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One stream's state, shared by the dispatcher and the stream's ends.
#[derive(Debug)]
pub(crate) struct StreamCore {
    st: Mutex<CoreState>,
    /// Set when the call is cancelled or its connection lost (servers).
    pub(crate) signal: Arc<Signal>,
    /// Whether the peer may send `Message`s on this stream.
    messages: bool,
    /// The call was cancelled or ran out of time: what arrived and was not
    /// read yet is dropped.
    pub(super) dropped: AtomicBool,
}

#[derive(Debug)]
struct CoreState {
    /// Frames that arrived and were not taken yet.
    inbox: VecDeque<Entry>,
    recv: RecvWindow,
    inbound: Inbound,
    /// How the inbound direction ended, once it did (told after the inbox
    /// drains).
    end: Option<Result<(), Status>>,
    /// The metadata of the peer's first frame (the server's initial metadata).
    headers: Option<Metadata>,
    /// The metadata of the peer's last frame (the server's trailers).
    trailers: Option<Metadata>,
    reader: Option<Waker>,
    send: SendWindow,
    writer: Option<Waker>,
    /// Why nothing more may be sent, once the call is over for this side.
    over: Option<Status>,
}

impl StreamCore {
    /// A stream with windows of `window` bytes each way; the peer may send
    /// `Message`s only if `messages`.
    pub(crate) fn new(window: u32, messages: bool) -> Arc<StreamCore> {
        Arc::new(StreamCore {
            st: Mutex::new(CoreState {
                inbox: VecDeque::new(),
                recv: RecvWindow::new(window),
                inbound: Inbound::default(),
                end: None,
                headers: None,
                trailers: None,
                reader: None,
                send: SendWindow::new(window),
                writer: None,
                over: None,
            }),
            signal: Arc::new(Signal::default()),
            messages,
            dropped: AtomicBool::new(false),
        })
    }

    /// The core of a call that never started: it ends with `status`.
    pub(super) fn failed(status: Status) -> Arc<StreamCore> {
        let core = StreamCore::new(crate::protocol::stream::DEFAULT_WINDOW, false);
        core.fail(status);
        core
    }

    fn state(&self) -> MutexGuard<'_, CoreState> {
        lock(&self.st)
    }

    /// A `Message` frame arrived (dispatcher), with its decoded metadata:
    /// its header says how many messages the payload holds, and its body
    /// (metadata and payload) is what the window counts.
    pub(crate) fn on_message(
        &self,
        header: &Header,
        payload: crate::payload::Payload,
        metadata: Metadata,
    ) -> Result<(), StreamError> {
        if !self.messages {
            return Err(StreamError::MessageNotExpected);
        }
        let count = header.timeout_us;
        let body_len = header.metadata_len as usize + header.payload_len as usize;
        Records::check(&payload, count)?;
        let waker = {
            let mut st = self.state();
            st.inbound.on_message(count)?;
            st.recv.on_message(body_len)?;
            if st.headers.is_none() {
                st.headers = Some(metadata);
            }
            st.inbox.push_back(Entry {
                data: payload,
                count,
                cost: Some(body_len),
                flags: header.flags,
            });
            st.reader.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// The peer ended its direction (dispatcher): a `HalfClose` (server),
    /// or the final `Response` or `Error` (client). A final message outside
    /// the window (a client-streaming call's response) and the frame's
    /// metadata come with it. `finished` ends the call for sends too.
    pub(crate) fn on_end(
        &self,
        result: Result<(), Status>,
        last: Option<(crate::payload::Payload, u16)>,
        metadata: Option<Metadata>,
        finished: bool,
    ) -> Result<(), StreamError> {
        let (reader, writer) = {
            let mut st = self.state();
            st.inbound.on_close()?;
            if let Some((message, flags)) = last {
                st.inbox.push_back(Entry {
                    data: message,
                    count: 1,
                    cost: None,
                    flags,
                });
            }
            if let Some(md) = metadata {
                if st.headers.is_none() {
                    st.headers = Some(md.clone());
                }
                st.trailers = Some(md);
            }
            let status = result.as_ref().err().cloned();
            st.end = Some(result);
            let writer = if finished && st.over.is_none() {
                st.over = Some(
                    status.unwrap_or_else(|| Status::cancelled("the server finished the call")),
                );
                st.writer.take()
            } else {
                None
            };
            (st.reader.take(), writer)
        };
        for w in [reader, writer].into_iter().flatten() {
            w.wake();
        }
        Ok(())
    }

    /// How the call ended, once it has: `Ok` for success.
    pub(crate) fn end_code(&self) -> Option<Code> {
        self.state().end.as_ref().map(|e| match e {
            Ok(()) => Code::Ok,
            Err(status) => status.code(),
        })
    }

    /// The peer granted window back (dispatcher).
    pub(crate) fn on_grant(&self, grant: u32) -> Result<(), StreamError> {
        let waker = {
            let mut st = self.state();
            st.send.on_grant(grant)?;
            st.writer.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Ends the call on this side with `status`: cancelled, deadline
    /// passed, connection lost. The reader sees `status` next, and senders
    /// fail with it. A call cancelled or out of time drops what it received
    /// and did not read (nobody wants it any more); after any other failure
    /// what was received stays readable first.
    pub(crate) fn fail(&self, status: Status) {
        let drop_unread = matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded);
        let (reader, writer) = {
            let mut st = self.state();
            if drop_unread {
                st.inbox.clear();
                self.dropped.store(true, Ordering::Release);
            }
            if st.end.is_none() {
                st.end = Some(Err(status.clone()));
            }
            if st.over.is_none() {
                st.over = Some(status);
            }
            (st.reader.take(), st.writer.take())
        };
        for w in [reader, writer].into_iter().flatten() {
            w.wake();
        }
        self.signal.cancel();
    }

    /// Whether the call is over for sends.
    pub(crate) fn is_over(&self) -> bool {
        self.state().over.is_some()
    }

    /// The next frame's messages, once one is in, with the window grant to
    /// send back if one is due; `None` at the clean end.
    pub(super) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<Result<Received, Status>>> {
        let mut st = self.state();
        if let Some(Entry {
            data,
            count,
            cost,
            flags,
        }) = st.inbox.pop_front()
        {
            // A grant is worth sending only while the peer may still send.
            let grant = cost.and_then(|cost| {
                st.recv
                    .on_consumed(cost)
                    .filter(|_| st.over.is_none() && !st.inbound.is_closed())
            });
            return Poll::Ready(Some(Ok(Received {
                data,
                count,
                grant,
                flags,
            })));
        }
        match &st.end {
            Some(Ok(())) => Poll::Ready(None),
            Some(Err(status)) => Poll::Ready(Some(Err(status.clone()))),
            None => {
                st.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Ready once a message of `body_len` bytes may be sent (its window is
    /// then taken), or with the reason nothing may be sent any more.
    pub(super) fn poll_window(
        &self,
        cx: &mut Context<'_>,
        body_len: usize,
    ) -> Poll<Result<(), Status>> {
        let mut st = self.state();
        if let Some(status) = &st.over {
            return Poll::Ready(Err(status.clone()));
        }
        if st.send.try_send(body_len) {
            return Poll::Ready(Ok(()));
        }
        st.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Gives back the window a message of `body_len` bytes took and that
    /// was not sent after all (its send failed): a later one may use it.
    pub(super) fn unsend(&self, body_len: usize) {
        let mut st = self.state();
        st.send.unsend(body_len);
        if let Some(w) = st.writer.take() {
            w.wake();
        }
    }

    /// Wakes the task with `cx` once the call ends for sends, too (a
    /// producer waiting on something else still hears of a cancellation).
    pub(super) fn watch_over(&self, cx: &mut Context<'_>) -> bool {
        let mut st = self.state();
        if st.over.is_some() {
            return true;
        }
        st.writer = Some(cx.waker().clone());
        false
    }

    pub(super) fn metadata(&self) -> (Option<Metadata>, Option<Metadata>) {
        let st = self.state();
        (st.headers.clone(), st.trailers.clone())
    }

    /// The peer's initial metadata once it arrived (with its first frame,
    /// or with the end); the call's status if it failed before any frame
    /// came (a failed call's metadata is its status's). `None` before.
    pub(super) fn headers_now(&self) -> Option<Result<Metadata, Status>> {
        Self::headers_of(&self.state())
    }

    fn headers_of(st: &CoreState) -> Option<Result<Metadata, Status>> {
        match (&st.end, &st.headers) {
            (Some(Err(status)), _) if !st.inbound.is_started() => Some(Err(status.clone())),
            (_, Some(headers)) => Some(Ok(headers.clone())),
            // A clean end that brought no metadata (a trailers-only answer
            // without any, a request stream half-closed at once).
            (Some(_), None) => Some(Ok(Metadata::default())),
            (None, None) => None,
        }
    }

    /// [`StreamCore::headers_now`], or `Pending` (woken as a reader is).
    pub(super) fn poll_headers(&self, cx: &mut Context<'_>) -> Poll<Result<Metadata, Status>> {
        let mut st = self.state();
        match Self::headers_of(&st) {
            Some(headers) => Poll::Ready(headers),
            None => {
                st.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A frame in a stream's inbox: `count` messages ([`Records`]) and what
/// they cost the window.
#[derive(Debug)]
struct Entry {
    data: crate::payload::Payload,
    count: u32,
    /// The body length the window counted; `None` for a final message
    /// outside the window (an empty message inside it is `Some(0)`, which
    /// still costs a header's worth and must be granted back).
    cost: Option<usize>,
    /// The frame header's flags: its messages' encoding.
    flags: u16,
}

/// A frame taken from a stream's inbox.
pub(super) struct Received {
    pub(super) data: crate::payload::Payload,
    pub(super) count: u32,
    pub(super) grant: Option<u32>,
    /// The frame header's flags: its messages' encoding.
    pub(super) flags: u16,
}
