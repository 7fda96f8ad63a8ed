//! A client stream that waits for a connection before it starts
//! (wait-for-ready): [`Opening`], the parts it hands its handles once
//! started ([`StreamParts`]), and [`CallOwner`], what a client stream's
//! handles hold of their call.

use super::outbox::Outbox;
use super::producer::Pump;
use super::state::{StreamCore, lock};
use crate::Status;
use crate::dispatch::Link;
use crate::protocol::CallId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

/// What a stream opened later needs: its parts, as a call that starts at
/// once has them.
pub(crate) struct StreamParts {
    pub(crate) core: Arc<StreamCore>,
    pub(crate) link: Arc<dyn Link>,
    pub(crate) call_id: CallId,
    pub(crate) owner: Option<Arc<dyn CallOwner>>,
    pub(crate) pump: Option<Box<dyn Pump>>,
    /// The request sender's outbox, for a stream with a [`RequestSender`].
    pub(crate) outbox: Option<Outbox>,
}

/// Starts a stream once it can: polled by whichever of its handles is
/// used first; `Pending` while it waits (its waker registered).
pub(crate) type Opener =
    Box<dyn FnMut(&mut Context<'_>) -> Poll<Result<StreamParts, Status>> + Send>;

/// A client stream that waits for a connection before it starts
/// (wait-for-ready): shared by its [`Streaming`] and its
/// [`RequestSender`], each of which drives it and takes its own parts
/// once it has started.
pub(crate) struct Opening {
    state: Mutex<OpeningState>,
    /// The request sender was closed or dropped before the stream started:
    /// it half-closes as it starts.
    sender_done: AtomicBool,
}

enum OpeningState {
    Waiting(Opener),
    Open {
        /// Core, link, id, owner and pump, until the `Streaming` takes them.
        stream: Option<StreamParts>,
    },
    Failed(Status),
}

impl Opening {
    pub(crate) fn new(opener: Opener) -> Arc<Opening> {
        Arc::new(Opening {
            state: Mutex::new(OpeningState::Waiting(opener)),
            sender_done: AtomicBool::new(false),
        })
    }

    fn state(&self) -> MutexGuard<'_, OpeningState> {
        lock(&self.state)
    }

    /// Drives the opener: `Ready(Ok)` once the stream has started.
    pub(super) fn poll_open(&self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let mut st = self.state();
        let OpeningState::Waiting(opener) = &mut *st else {
            return Poll::Ready(match &*st {
                OpeningState::Failed(status) => Err(status.clone()),
                _ => Ok(()),
            });
        };
        match opener(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(mut parts)) => {
                if self.sender_done.load(Ordering::Acquire) {
                    if let Some(outbox) = parts.outbox.take() {
                        let _ = outbox.half_close();
                    }
                }
                *st = OpeningState::Open {
                    stream: Some(parts),
                };
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(status)) => {
                *st = OpeningState::Failed(status.clone());
                Poll::Ready(Err(status))
            }
        }
    }

    /// The started stream's parts but the outbox (once).
    pub(super) fn take_stream(&self) -> Option<StreamParts> {
        match &mut *self.state() {
            OpeningState::Open { stream } => stream.as_mut().map(|p| StreamParts {
                core: p.core.clone(),
                link: p.link.clone(),
                call_id: p.call_id,
                owner: p.owner.take(),
                pump: p.pump.take(),
                outbox: None,
            }),
            _ => None,
        }
    }

    /// The request sender is done before it had the outbox: the stream
    /// half-closes as it starts (or now, if it has).
    pub(super) fn sender_done(&self) {
        self.sender_done.store(true, Ordering::Release);
        if let Some(outbox) = self.take_outbox() {
            let _ = outbox.half_close();
        }
    }

    /// The started stream's request outbox (once).
    pub(super) fn take_outbox(&self) -> Option<Outbox> {
        match &mut *self.state() {
            OpeningState::Open { stream: Some(p) } => p.outbox.take(),
            _ => None,
        }
    }
}

impl Drop for Opening {
    /// A stream that started but whose `Streaming` was gone first: its
    /// call is let go of (cancelled if live), as the `Streaming` would.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let OpeningState::Open { stream: Some(p) } = st {
            if let Some(owner) = p.owner.take() {
                owner.release(p.call_id);
            }
        }
    }
}

/// What a client stream's handle does on drop, and how it turns the
/// completion queue itself (see `Channel`).
pub(crate) trait CallOwner: Send + Sync {
    /// The handle let go of the call: cancel it if it is still live.
    fn release(&self, call_id: CallId);
    /// Handles completions on this thread if nobody else is; true if it did.
    fn progress(&self) -> bool;
    /// The caller stops handling completions and waits to be woken: the
    /// dispatcher thread must take over (it naps while callers poll).
    fn ensure_polled(&self);
}
