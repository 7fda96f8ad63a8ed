//! Opening a channel's streams: now on a connection, or once one is up
//! and has room under its server's stream limit; and a stream's hold on
//! its connection ([`StreamOwner`]).

use super::connection::Connection;
use super::reconnect;
use super::stream_limit::Waiting;
use super::{Channel, Handle};
use crate::compression::{CompressionConfig, EncodingSet, SendPolicy};
use crate::descriptor::MethodDescriptor;
use crate::observe::{CallObs, TRACEPARENT};
use crate::protocol::CallId;
use crate::streaming::{
    CallOwner, Opening, Outbox, Pump, RequestPump, RequestSender, StreamCore, StreamParts,
    Streaming,
};
use crate::{Code, Metadata, Request, Status};
use futures_core::Stream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// A stream started on a connection: its id, core, connection and
/// observation.
type StreamStarted = (CallId, Arc<StreamCore>, Arc<Connection>, CallObs);

/// Starts a stream once a connection is up (`Pending` meanwhile, its
/// waker registered).
type StreamOpener = Box<dyn FnMut(&mut Context<'_>) -> Poll<Result<StreamStarted, Status>> + Send>;

/// How a stream's start went: now (started or failed), or later, once a
/// connection is up (wait-for-ready), by polling the opener.
pub(super) enum Opened {
    Now(Result<StreamStarted, Status>),
    Later(StreamOpener),
}

/// A stream that waits to start (see [`Channel::opener`]).
struct Deferred {
    method: &'static MethodDescriptor,
    metadata: Metadata,
    deadline: Option<Instant>,
    /// The request message of a server-streaming call, encoded.
    first: Option<Encoded>,
    final_message: bool,
    /// Whether it waits for a connection to come up, or fails
    /// `Unavailable` without one (it always waits for room on one).
    wait_for_ready: bool,
    compression: CompressionConfig,
}

/// What one try to start a waiting stream came to.
enum Attempt {
    Done(Result<StreamStarted, Status>),
    /// No connection is up.
    NoConnection,
    /// The connection has as many streams as its server serves at once.
    Full,
}

/// An encoded message, sent as it is (the first request of a stream that
/// waited for a connection).
#[derive(Debug, Default, Clone, PartialEq)]
struct Encoded(Vec<u8>);

impl prost::Message for Encoded {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl prost::bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Never decoded: only sent.
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

impl Channel {
    /// Opens a stream whose requests come from `request`'s stream, sent as
    /// the returned `Streaming` is polled.
    pub(super) fn pumped<S, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<S>,
        final_message: bool,
    ) -> Streaming<Resp>
    where
        S: Stream + Send + 'static,
        S::Item: prost::Message + Send,
    {
        let timeout = request.budget(self.inner.default_timeout);
        let wait = self.waits_for_ready(&request);
        let metadata = request.metadata().clone();
        let stream = request.into_inner();
        let opened = self.open_stream::<()>(method, &metadata, timeout, None, final_message, wait);
        Self::incoming(opened, self.outbox_compression(), move |outbox| {
            Some(Box::new(RequestPump::new(stream, outbox)) as Box<dyn Pump>)
        })
    }

    /// Opens a stream whose requests go through a [`RequestSender`].
    pub(super) fn with_sender<Req: prost::Message, Resp>(
        &self,
        method: &'static MethodDescriptor,
        request: Request<()>,
        final_message: bool,
    ) -> (RequestSender<Req>, Streaming<Resp>) {
        let timeout = request.budget(self.inner.default_timeout);
        let wait = self.waits_for_ready(&request);
        let opened = self.open_stream::<()>(
            method,
            request.metadata(),
            timeout,
            None,
            final_message,
            wait,
        );
        let compression = self.outbox_compression();
        let mut opener = match opened {
            Opened::Now(Ok(started)) => {
                let (parts, outbox) = Self::parts(started, &compression);
                let stream =
                    Streaming::new(parts.core, parts.link, parts.call_id, parts.owner, None);
                return (RequestSender::new(outbox), stream);
            }
            Opened::Now(Err(status)) => {
                return (
                    RequestSender::new(Outbox::closed()),
                    Streaming::failed(status),
                );
            }
            Opened::Later(opener) => opener,
        };
        let opening = Opening::new(Box::new(move |cx| {
            opener(cx).map(|started| {
                let (mut parts, outbox) = Self::parts(started?, &compression);
                parts.outbox = Some(outbox);
                Ok(parts)
            })
        }));
        (
            RequestSender::waiting(opening.clone()),
            Streaming::waiting(opening),
        )
    }

    /// Starts a stream on a connection now, or, for a call that waits for
    /// ready when none is up, later (see [`Opened::Later`]).
    pub(super) fn open_stream<Req: prost::Message>(
        &self,
        method: &'static MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
        wait: bool,
    ) -> Opened {
        // Copied only if something adds to it (or the stream waits).
        let mut metadata = std::borrow::Cow::Borrowed(metadata);
        if !self.inner.interceptors.is_empty() {
            if let Err(status) = self.intercept(method, metadata.to_mut()) {
                return Opened::Now(Err(status));
            }
        }
        let (mut obs, trace) = CallObs::client(method.path, &self.inner.url, &metadata);
        if let Some(trace) = trace {
            let _ = metadata.to_mut().insert(TRACEPARENT, trace);
        }
        let _in = obs.span().clone().entered();
        let picked = self.inner.pick_for_stream();
        // A connection at its server's stream limit makes the stream wait,
        // as does no connection for a call that waits for ready.
        let later = |metadata: std::borrow::Cow<'_, Metadata>, obs| {
            let deferred = Deferred {
                method,
                metadata: metadata.into_owned(),
                deadline: timeout.and_then(crate::deadline_after),
                first: first.map(|m| Encoded(m.encode_to_vec())),
                final_message,
                wait_for_ready: wait,
                compression: self.compression,
            };
            Opened::Later(Self::opener(self.inner.clone(), deferred, obs))
        };
        let (conn, permit) = match picked {
            Ok(conn) => match conn.streams.try_open() {
                Some(permit) => (conn, permit),
                None => return later(metadata, obs),
            },
            Err(_) if wait => return later(metadata, obs),
            Err(status) => {
                obs.finish(status.code());
                return Opened::Now(Err(status));
            }
        };
        let metadata = conn.gateway_metadata(method, &metadata, self.compression.send());
        let started = conn.start_stream(
            method,
            &metadata,
            timeout,
            first,
            final_message,
            permit,
            &self.compression,
        );
        Opened::Now(match started {
            Ok((id, core)) => Ok((id, core, conn, obs)),
            Err(status) => {
                obs.finish(status.code());
                Err(status)
            }
        })
    }

    /// Starts a stream once a connection is up (if it waits for ready)
    /// and has room for it under its server's stream limit, or fails it
    /// with `DeadlineExceeded` at its deadline.
    fn opener(handle: Arc<Handle>, deferred: Deferred, obs: CallObs) -> StreamOpener {
        let Deferred {
            method,
            metadata,
            deadline,
            first,
            final_message,
            wait_for_ready,
            compression,
        } = deferred;
        let mut obs = Some(obs);
        let ready = handle.clone();
        // Woken through it when a full connection's stream ends, or when a
        // connection comes up.
        let waiting = Arc::new(Waiting::default());
        let on_ready = waiting.clone();
        let mut listed_on_ready = false;
        // The stream limit of the connection it last found full.
        let mut full = None;
        let mut try_start = move |waker: &Waker| -> Attempt {
            let timeout = match deadline {
                Some(at) => match at.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => {
                        let status = Status::deadline_exceeded(match full {
                            Some(limit) => format!(
                                "deadline exceeded waiting for one of the {limit} streams its \
                                 server serves at once on a connection to end \
                                 (ServerBuilder::max_concurrent_streams)"
                            ),
                            None => format!(
                                "deadline exceeded waiting for a connection ({})",
                                handle.unavailable().message()
                            ),
                        });
                        if let Some(mut obs) = obs.take() {
                            obs.finish(status.code());
                        }
                        return Attempt::Done(Err(status));
                    }
                },
                None => None,
            };
            let conn = match handle.pick_for_stream() {
                Ok(conn) => conn,
                Err(_) if wait_for_ready => {
                    full = None;
                    return Attempt::NoConnection;
                }
                // It waited for room, and the connection went.
                Err(status) => {
                    if let Some(mut obs) = obs.take() {
                        obs.finish(status.code());
                    }
                    return Attempt::Done(Err(status));
                }
            };
            // A place a stream's end handed over, or one free now.
            let opened = match handle.handed_place(&conn, waiting.take_handed()) {
                Some(handed) => Some(handed),
                None => match conn.streams.open_or_wake(&waiting, waker) {
                    Some(permit) => Some((conn.clone(), permit)),
                    None => handle.open_elsewhere(&conn, &waiting, waker),
                },
            };
            let Some((conn, permit)) = opened else {
                full = Some(conn.streams.max());
                return Attempt::Full;
            };
            let Some(mut obs) = obs.take() else {
                return Attempt::Done(Err(Status::internal("the stream was started twice")));
            };
            let started = {
                let _in = obs.span().clone().entered();
                let metadata = conn.gateway_metadata(method, &metadata, compression.send());
                conn.start_stream(
                    method,
                    &metadata,
                    timeout,
                    first.as_ref(),
                    final_message,
                    permit,
                    &compression,
                )
            };
            Attempt::Done(match started {
                Ok((id, core)) => Ok((id, core, conn, obs)),
                Err(status) => {
                    obs.finish(status.code());
                    Err(status)
                }
            })
        };
        // Once it started or gave up, the places handed to it go on.
        let finishing = on_ready.clone();
        let mut try_start = move |waker: &Waker| {
            let attempt = try_start(waker);
            if matches!(attempt, Attempt::Done(_)) {
                finishing.finish();
            }
            attempt
        };
        // The waker the deadline wakes while the stream waits for room.
        let mut timer: Option<Waker> = None;
        Box::new(move |cx| match try_start(cx.waker()) {
            Attempt::Done(started) => Poll::Ready(started),
            // Woken when a stream ends on one of the full connections (their
            // limits took the waker), or at the deadline.
            Attempt::Full => {
                if let Some(at) = deadline {
                    if !timer.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        timer = Some(cx.waker().clone());
                        reconnect::wake_at(at, cx.waker().clone());
                    }
                }
                if listed_on_ready {
                    return Poll::Pending;
                }
                // A connection that comes up (another endpoint, a
                // reconnect) may have room: woken then too, once listed;
                // and one that came up before that is looked at now.
                ready.ready.register_stream(&on_ready);
                listed_on_ready = true;
                match try_start(cx.waker()) {
                    Attempt::Done(started) => Poll::Ready(started),
                    Attempt::Full | Attempt::NoConnection => Poll::Pending,
                }
            }
            Attempt::NoConnection => {
                ready.ready.register(cx.waker(), deadline);
                // A connection that came up before the waker was in place.
                match try_start(cx.waker()) {
                    Attempt::Done(started) => Poll::Ready(started),
                    Attempt::Full | Attempt::NoConnection => Poll::Pending,
                }
            }
        })
    }

    /// The consumer's end of an opened stream; `pump` makes the request
    /// side from the stream's outbox.
    pub(super) fn incoming<Resp>(
        opened: Opened,
        compression: SendPolicy,
        pump: impl FnOnce(Outbox) -> Option<Box<dyn Pump>> + Send + 'static,
    ) -> Streaming<Resp> {
        let started = match opened {
            Opened::Now(Ok(started)) => started,
            Opened::Now(Err(status)) => return Streaming::failed(status),
            Opened::Later(mut opener) => {
                let mut pump = Some(pump);
                return Streaming::waiting(Opening::new(Box::new(move |cx| {
                    opener(cx).map(|started| {
                        let (mut parts, outbox) = Self::parts(started?, &compression);
                        parts.pump = pump.take().and_then(|p| p(outbox));
                        Ok(parts)
                    })
                })));
            }
        };
        let (parts, outbox) = Self::parts(started, &compression);
        let pump = pump(outbox);
        Streaming::new(parts.core, parts.link, parts.call_id, parts.owner, pump)
    }

    /// How a stream's requests leave: in the encoding this handle sends
    /// (to a server that answers `Unimplemented` if it does not take it).
    pub(super) fn outbox_compression(&self) -> SendPolicy {
        SendPolicy {
            switch: None,
            encoding: self.compression.send(),
            peer_accepts: EncodingSet::all(),
        }
    }

    /// What a started stream's handles hold, and its request outbox.
    fn parts(started: StreamStarted, compression: &SendPolicy) -> (StreamParts, Outbox) {
        let (id, core, conn, obs) = started;
        let link = conn.link();
        let outbox =
            Outbox::new(core.clone(), link.clone(), id, 0, None).compress(compression.clone());
        conn.outstanding.fetch_add(1, Ordering::Relaxed);
        let owner: Arc<dyn CallOwner> = Arc::new(StreamOwner {
            conn,
            core: core.clone(),
            obs,
            turns_seen: AtomicU64::new(0),
        });
        let parts = StreamParts {
            core,
            link,
            call_id: id,
            owner: Some(owner),
            pump: None,
            outbox: None,
        };
        (parts, outbox)
    }
}

/// A client stream's hold on its connection, and its span and metrics.
struct StreamOwner {
    conn: Arc<Connection>,
    core: Arc<StreamCore>,
    obs: CallObs,
    /// Callers' turns of the queue as of this stream's last look (see
    /// `PollHandoff::try_turn`).
    turns_seen: AtomicU64,
}

impl Drop for StreamOwner {
    fn drop(&mut self) {
        self.conn.ended();
        self.obs
            .finish(self.core.end_code().unwrap_or(Code::Cancelled));
    }
}

impl CallOwner for StreamOwner {
    fn release(&self, call_id: CallId) {
        self.conn.cancel(call_id);
    }

    fn progress(&self) -> bool {
        let mut seen = self.turns_seen.load(Ordering::Relaxed);
        let turned = self.conn.try_progress(&mut seen);
        self.turns_seen.store(seen, Ordering::Relaxed);
        turned
    }

    fn ensure_polled(&self) {
        self.conn.ensure_polled();
    }
}
