//! The server side: [`Server`], [`Service`], [`ServerCall`] and [`ServerHandle`].

use crate::auth::Authenticator;
use crate::blocking::BlockingPool;
use crate::dispatch::encode_exact;
use crate::dispatch::{Config, Conn, Endpoint, Frame, OutFrame, Role, least_loaded, staging_limit};
use crate::executor::{self, Executor, panic_message};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{
    Admission, Fabric, FabricUrl, Incoming, Listener, LocalSetup, PeerRing, Scheme,
};
use crate::idmap::IdMap;
use crate::interceptor::{Chain, Interceptor};
use crate::observe::{CallObs, Side};
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, FrameKind, SendError};
use crate::streaming::{Link, Outbox, Producer, Signal, StreamCore, StreamEnd, Streaming};
use crate::{Code, Metadata, Request, Response, Status};
use futures_core::Stream;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use crate::descriptor::{MethodDescriptor, MethodKind, ServiceDescriptor};

#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;

/// A service a [`Server`] can host. Generated `FooServer<T>` wrappers
/// implement it; it can be implemented by hand too.
pub trait Service: Send + Sync + 'static {
    /// The service's name and methods.
    fn descriptor(&self) -> &'static ServiceDescriptor;
    /// Handles one call to one of this service's methods. The call must be
    /// answered (through [`ServerCall::unary`] or [`ServerCall::unimplemented`]);
    /// a call dropped unanswered is answered `Internal`.
    fn call(&self, call: ServerCall);
    /// An encoded `google.protobuf.FileDescriptorSet` holding the `.proto`
    /// file that declares this service and every file it imports, for the
    /// reflection service ([`ServerBuilder::add_reflection`]). Generated
    /// servers return their package's `FILE_DESCRIPTOR_SET`; the default,
    /// empty, means the service is listed but cannot be described.
    fn file_descriptor_set(&self) -> &'static [u8] {
        &[]
    }
    /// Called once when a server serving this service begins to shut down
    /// ([`ServerHandle::shutdown`]), after it stopped taking new calls and
    /// before it waits for those under way. A service whose streams would
    /// run on by themselves (a watch, a subscription) ends them here, so
    /// that shutting down need not wait out its grace period; the built-in
    /// health service sends each watcher `NotServing` and ends its stream.
    /// The default does nothing.
    fn shutting_down(&self) {}
}

/// Calls of one dispatcher that can hear from their client after the
/// request: streams (their messages, half-close, window and cancel) and
/// unary calls whose handlers wait (their cancel).
#[derive(Default)]
pub(crate) struct Registry {
    calls: Mutex<Calls>,
    /// How many calls `calls` holds, kept under its lock: a request looks
    /// for a live call of its id (see `contains`), and with unary handlers
    /// that answer at once there is none, so it need not take the lock.
    len: AtomicUsize,
    /// Most streams one connection may have at once; 0 for no limit (the
    /// gRPC face, whose HTTP/2 server limits each of its connections).
    stream_limit: u32,
}

/// The registered calls, and how many of them are streams per connection.
#[derive(Default)]
struct Calls {
    by_id: HashMap<(u32, CallId), Registered>,
    streams: HashMap<u32, u32>,
}

impl Calls {
    fn remove(&mut self, key: &(u32, CallId)) -> Option<Registered> {
        let removed = self.by_id.remove(key);
        if let Some(Registered::Stream(_)) = removed {
            if let Some(n) = self.streams.get_mut(&key.0) {
                *n -= 1;
                if *n == 0 {
                    self.streams.remove(&key.0);
                }
            }
        }
        removed
    }
}

#[derive(Clone)]
enum Registered {
    Unary(Arc<Signal>),
    Stream(Arc<StreamCore>),
}

impl Registered {
    /// Ends the call for the handler: it sees `status` (streams) and its
    /// cancellation signal fires.
    fn cancel(&self, status: Status) {
        match self {
            Registered::Unary(signal) => signal.cancel(),
            Registered::Stream(core) => core.fail(status),
        }
    }
}

impl Registry {
    /// A registry whose connections may each have `stream_limit` streams
    /// at once (0: any number).
    fn with_stream_limit(stream_limit: u32) -> Registry {
        Registry {
            stream_limit,
            ..Registry::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a unary call whose handler waits (or runs elsewhere).
    fn insert(&self, qp_num: u32, id: CallId, signal: Arc<Signal>) {
        let mut calls = self.lock();
        calls.by_id.insert((qp_num, id), Registered::Unary(signal));
        self.len.store(calls.by_id.len(), Ordering::Release);
    }

    /// Registers a stream, unless its connection has as many as the limit:
    /// then `Err(limit)`, and nothing is registered.
    fn insert_stream(&self, qp_num: u32, id: CallId, core: Arc<StreamCore>) -> Result<(), u32> {
        let mut calls = self.lock();
        let open = calls.streams.entry(qp_num).or_insert(0);
        if self.stream_limit != 0 && *open >= self.stream_limit {
            return Err(self.stream_limit);
        }
        *open += 1;
        calls.by_id.insert((qp_num, id), Registered::Stream(core));
        self.len.store(calls.by_id.len(), Ordering::Release);
        Ok(())
    }

    fn get(&self, qp_num: u32, id: CallId) -> Option<Registered> {
        self.lock().by_id.get(&(qp_num, id)).cloned()
    }

    /// Whether `id` names a live call of `qp_num`. A call is registered by
    /// the thread that handles its connection's frames, the thread that
    /// asks, so an empty count read here is never stale for this
    /// connection.
    fn contains(&self, qp_num: u32, id: CallId) -> bool {
        self.len.load(Ordering::Acquire) > 0 && self.lock().by_id.contains_key(&(qp_num, id))
    }

    fn remove(&self, qp_num: u32, id: CallId) -> Option<Registered> {
        let mut calls = self.lock();
        let removed = calls.remove(&(qp_num, id));
        self.len.store(calls.by_id.len(), Ordering::Release);
        removed
    }

    /// Applies a frame that names a call after its request (stream
    /// traffic or a cancel) to the call; a frame that breaks the protocol
    /// is refused with what it broke (the connection is then closed).
    pub(crate) fn on_call_frame(&self, qp_num: u32, frame: Frame) -> Result<(), String> {
        let h = frame.header;
        let Some(call) = self.get(qp_num, h.call_id) else {
            // The call ended (its answer crossed this frame), or its
            // handler finished without waiting: nothing to tell.
            tracing::trace!(call_id = h.call_id.0, kind = ?h.kind, "frame for a call that is not live");
            return Ok(());
        };
        let applied = match (&call, h.kind) {
            (_, FrameKind::Cancel) => {
                self.remove(qp_num, h.call_id);
                call.cancel(Status::cancelled("the client cancelled the call"));
                Ok(())
            }
            (Registered::Stream(core), FrameKind::Message) => match frame.metadata {
                Some(md) => core.on_message(&h, frame.payload, md),
                None => return Err("client sent malformed stream metadata".into()),
            },
            (Registered::Stream(core), FrameKind::HalfClose) => {
                core.on_end(Ok(()), None, None, false)
            }
            (Registered::Stream(core), FrameKind::Window) => core.on_grant(h.timeout_us),
            (Registered::Unary(_), kind) => {
                return Err(format!("client sent a {kind:?} frame for a unary call"));
            }
            // Only the kinds above are routed here.
            (Registered::Stream(_), _) => Ok(()),
        };
        applied.map_err(|e| format!("stream protocol violation: {e}"))
    }

    /// Takes every call of connection `qp_num`.
    fn take_connection(&self, qp_num: u32) -> Vec<Registered> {
        let mut calls = self.lock();
        let keys: Vec<_> = calls
            .by_id
            .keys()
            .filter(|k| k.0 == qp_num)
            .copied()
            .collect();
        let taken = keys.iter().filter_map(|k| calls.remove(k)).collect();
        self.len.store(calls.by_id.len(), Ordering::Release);
        taken
    }
}

/// One incoming call, to be answered exactly once.
pub struct ServerCall {
    method_id: u32,
    call_id: CallId,
    qp_num: u32,
    metadata: Metadata,
    payload: crate::payload::Payload,
    deadline: Option<Instant>,
    /// Whether the deadline may pass before the handler runs, and so must
    /// be checked then: the call waits for the blocking pool, or its
    /// timeout is too short to outlast the routing.
    recheck: bool,
    sink: Option<Arc<dyn Link>>,
    inflight: Arc<AtomicUsize>,
    /// Where the call is registered for frames after its request.
    registry: Arc<Registry>,
    registered: bool,
    /// A stream's state (streaming methods).
    core: Option<Arc<StreamCore>>,
    /// A unary call's cancellation signal, once it has one.
    signal: Option<Arc<Signal>>,
    /// Its span and metrics (calls of a known method).
    obs: Option<CallObs>,
}

impl fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerCall")
            .field("method_id", &format_args!("{:#010x}", self.method_id))
            .field("call_id", &self.call_id.0)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

impl ServerCall {
    /// The method id the caller asked for.
    pub fn method_id(&self) -> u32 {
        self.method_id
    }

    /// The caller's metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The signal the handler's request carries: the stream's, or the unary
    /// call's own (made now if the call has none yet).
    fn cancel_signal(&mut self) -> Option<Arc<Signal>> {
        if let Some(core) = &self.core {
            return Some(core.signal.clone());
        }
        Some(self.signal.get_or_insert_with(take_signal).clone())
    }

    /// Registers a unary call whose handler waits, so that a `Cancel`
    /// reaches its signal. Called on the dispatcher thread before it
    /// handles another frame, so no cancel can slip by.
    fn register_unary(&mut self) {
        if self.registered {
            return;
        }
        if let Some(signal) = &self.signal {
            self.registry
                .insert(self.qp_num, self.call_id, signal.clone());
            self.registered = true;
        }
    }

    /// Forgets the call before its final frame leaves: its client may
    /// open another stream as soon as it reads that frame, and by then this
    /// one must no longer count against the connection's limit.
    fn unregister(&mut self) {
        if std::mem::take(&mut self.registered) {
            self.registry.remove(self.qp_num, self.call_id);
        }
    }

    /// The call's cancel signal: the stream's, or the unary call's own
    /// if it has one.
    fn signal(&self) -> Option<&Signal> {
        match (&self.core, &self.signal) {
            (Some(core), _) => Some(&core.signal),
            (None, signal) => signal.as_deref(),
        }
    }

    /// Whether the caller cancelled the call or went away.
    fn is_cancelled(&self) -> bool {
        self.signal().is_some_and(Signal::is_cancelled)
    }

    /// Answers `DeadlineExceeded` if the call's deadline passed before its
    /// handler ran; true if it did.
    fn answer_if_expired(&mut self) -> bool {
        let expired = self.recheck && self.deadline.is_some_and(|d| Instant::now() >= d);
        if expired {
            self.answer_err(&Status::deadline_exceeded(
                "deadline passed before the handler ran",
            ));
        }
        expired
    }

    /// The stream and connection of a streaming call; answers `Internal`
    /// (and returns `None`) if the call is not a stream, which only a
    /// hand-written service whose descriptor disagrees with it can cause.
    fn stream_parts(&mut self) -> Option<(Arc<StreamCore>, Arc<dyn Link>)> {
        match (self.core.clone(), self.sink.clone()) {
            (Some(core), Some(sink)) => Some((core, sink)),
            _ => {
                self.answer_err(&Status::internal(
                    "a streaming handler was given a call that is not a stream: check the \
                     service's descriptor",
                ));
                None
            }
        }
    }

    /// Checks the deadline and decodes the request as `Req`; answers the
    /// call itself (`DeadlineExceeded`, `InvalidArgument`) and returns
    /// `None` when the handler must not run.
    fn take_request<Req: prost::Message + Default>(&mut self) -> Option<Request<Req>> {
        if self.answer_if_expired() {
            return None;
        }
        let payload = std::mem::take(&mut self.payload);
        let decoded = payload.decode::<Req>(|p| {
            if let Some(sink) = &self.sink {
                sink.recycle(p);
            }
        });
        match decoded {
            Ok(message) => Some(Request::from_wire(
                message,
                std::mem::take(&mut self.metadata),
                self.deadline,
                self.cancel_signal(),
                self.sink.as_ref().and_then(|s| s.remote()),
            )),
            Err(e) => {
                let what = std::any::type_name::<Req>();
                self.answer_err(&Status::invalid_argument(format!(
                    "request is not a valid {what}: {e}"
                )));
                None
            }
        }
    }

    /// Sends a handler's result.
    fn reply<Resp: prost::Message>(self, result: Result<Response<Resp>, Status>) {
        match result {
            Ok(response) => self.reply_ok(response),
            Err(status) => self.reply_err(&status),
        }
    }

    /// The call's span: entered again each time its handler's task is
    /// polled (a handler that parked resumes inside it), and on the
    /// blocking pool.
    fn span(&self) -> tracing::Span {
        self.obs
            .as_ref()
            .map_or_else(tracing::Span::none, |o| o.span().clone())
    }

    /// Answers a handler that panicked with `Internal`.
    fn reply_panic(self, panic: &(dyn std::any::Any + Send)) {
        let what = panic_message(panic);
        tracing::error!(method_id = self.method_id, panic = %what, "handler panicked");
        self.reply_err(&Status::internal(format!("handler panicked: {what}")));
    }

    /// Decodes the request as `Req`, runs the synchronous `handler` on this
    /// thread, and sends its result. A payload that is not a valid `Req` is
    /// answered `InvalidArgument` without running the handler; a handler
    /// that panics is answered `Internal`; a call whose deadline passed is
    /// answered `DeadlineExceeded` without running the handler.
    pub fn unary<Req, Resp, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message,
        F: FnOnce(Request<Req>) -> Result<Response<Resp>, Status>,
    {
        let Some(request) = self.take_request::<Req>() else {
            return;
        };
        match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(result) => self.reply(result),
            Err(panic) => self.reply_panic(&*panic),
        }
    }

    /// Like [`ServerCall::unary`], for a handler that returns a future.
    ///
    /// On a dispatcher thread the future runs to completion there: it is
    /// polled at once, and if it has to wait (a timer, another call, I/O)
    /// it parks, the dispatcher goes on with other calls, and it resumes on
    /// the same dispatcher when woken; its reply is sent from there. Off a
    /// dispatcher (the blocking pool) the thread blocks on it. A future that
    /// panics is answered `Internal`.
    pub fn unary_async<Req, Resp, Fut, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message + 'static,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
    {
        let Some(request) = self.take_request::<Req>() else {
            return;
        };
        self.respond_once(request, handler);
    }

    /// Like [`ServerCall::unary_async`], for a server-streaming method:
    /// the handler's response is a stream, whose messages are sent as the
    /// stream's window allows, then the final status. The stream is
    /// dropped early if the client cancels the call or goes away.
    pub fn server_streaming<Req, Resp, S, Fut, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
    {
        let Some(request) = self.take_request::<Req>() else {
            return;
        };
        self.respond_with_stream(request, handler);
    }

    /// Like [`ServerCall::unary_async`], for a client-streaming method:
    /// the handler reads the request messages from a [`Streaming`] and
    /// answers once.
    pub fn client_streaming<Req, Resp, Fut, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message + 'static,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
    {
        let Some(request) = self.take_streaming_request::<Req>() else {
            return;
        };
        self.respond_once(request, handler);
    }

    /// Like [`ServerCall::server_streaming`], for a bidirectional method:
    /// the handler reads the request messages from a [`Streaming`] and
    /// answers with a stream.
    pub fn streaming<Req, Resp, S, Fut, F>(mut self, handler: F)
    where
        Req: prost::Message + Default,
        Resp: prost::Message + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
    {
        let Some(request) = self.take_streaming_request::<Req>() else {
            return;
        };
        self.respond_with_stream(request, handler);
    }

    /// The request of a client-streaming or bidirectional call: its
    /// messages arrive on the call's stream. `None` if the call was
    /// answered instead (deadline passed, not a stream).
    fn take_streaming_request<Req>(&mut self) -> Option<Request<Streaming<Req>>> {
        if self.answer_if_expired() {
            return None;
        }
        let (core, sink) = self.stream_parts()?;
        sink.recycle(std::mem::take(&mut self.payload));
        let signal = core.signal.clone();
        let remote = sink.remote();
        let stream = Streaming::new(core, sink, self.call_id, None, None).of_requests();
        Some(Request::from_wire(
            stream,
            std::mem::take(&mut self.metadata),
            self.deadline,
            Some(signal),
            remote,
        ))
    }

    /// Runs a handler that answers once (unary and client-streaming
    /// methods) and sends its answer.
    fn respond_once<Req, Resp, Fut, F>(self, request: Request<Req>, handler: F)
    where
        Resp: prost::Message + 'static,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
    {
        let future = match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(future) => future,
            Err(panic) => return self.reply_panic(&*panic),
        };
        let span = self.span();
        run_task(
            span,
            Answer {
                future: Some(future),
                call: Some(self),
            },
        );
    }

    /// Runs a handler whose response is a stream, then sends the stream.
    fn respond_with_stream<Req, Resp, S, Fut, F>(self, request: Request<Req>, handler: F)
    where
        Resp: prost::Message + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
    {
        let future = match catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(future) => future,
            Err(panic) => return self.reply_panic(&*panic),
        };
        let mut call = self;
        let span = call.span();
        let signal = call.cancel_signal();
        run_task(span, async move {
            // Cancelled: the call is dropped unanswered.
            let Some(outcome) = run_handler(future, signal).await else {
                return;
            };
            match outcome {
                Ok(Ok(response)) => call.send_stream(response).await,
                Ok(Err(status)) => call.reply_err(&status),
                Err(panic) => call.reply_panic(&*panic),
            }
        });
    }

    /// Sends the messages of a handler's response stream as the window
    /// allows, then the final status: `Response` at the stream's end,
    /// `Error` at its first error, each after the initial metadata if no
    /// frame carried it yet. Stops, answering nothing, if the call is over.
    async fn send_stream<Resp, S>(mut self, response: Response<S>)
    where
        Resp: prost::Message + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
    {
        let Some((core, sink)) = self.stream_parts() else {
            return;
        };
        let mut response = response;
        let trailers = response.take_trailers();
        let (metadata, stream) = response.into_parts();
        let mut outbox = Outbox::new(core, sink, self.call_id, self.method_id, Some(metadata));
        let mut stream = std::pin::pin!(stream);
        let mut producer = Producer::<Resp>::new();
        let end = std::future::poll_fn(|cx| {
            let mut poll = |producer: &mut Producer<Resp>| {
                catch_unwind(AssertUnwindSafe(|| {
                    producer.poll(cx, stream.as_mut(), &mut outbox)
                }))
            };
            let polled = match poll(&mut producer) {
                // The messages the stream yielded before it panicked still
                // go, then the panic's status (the stream is not polled
                // again).
                Err(panic) => {
                    producer.end_with(StreamEnd::Panicked(panic_message(&*panic)));
                    poll(&mut producer).map_err(|_| panic)
                }
                polled => polled,
            };
            outbox.flush();
            match polled {
                Ok(poll) => poll,
                Err(panic) => std::task::Poll::Ready(StreamEnd::Panicked(panic_message(&*panic))),
            }
        })
        .await;
        // Initial metadata that no frame carried yet (the stream ended,
        // failed or panicked at its first poll) goes alone before the final
        // frame, empty or not, as it would have had that poll been pending:
        // so headers are never merged into the trailers nor lost with an
        // error, whatever the timing. Nothing was sent on the window, so it
        // goes at once (or the call is over).
        if !matches!(end, StreamEnd::Over) && outbox.first_metadata.is_some() {
            let _ = std::future::poll_fn(|cx| outbox.poll_send_headers(cx)).await;
            outbox.flush();
        }
        // Read only now: the stream may have set them until its end.
        let with_trailers = |mut metadata: Metadata| {
            if let Some(t) = &trailers {
                t.merge_into(&mut metadata);
            }
            metadata
        };
        match end {
            StreamEnd::Finished => {
                let metadata = outbox.first_metadata.take().unwrap_or_default();
                self.reply_ok(Response::from_parts(with_trailers(metadata), ()));
            }
            StreamEnd::Failed(status) if trailers.is_some() => {
                let metadata = with_trailers(status.metadata().cloned().unwrap_or_default());
                self.reply_err(&status.with_metadata(metadata));
            }
            StreamEnd::Failed(status) => self.reply_err(&status),
            StreamEnd::Panicked(what) => {
                tracing::error!(method_id = self.method_id, panic = %what, "response stream panicked");
                self.reply_err(&Status::internal(format!("handler panicked: {what}")));
            }
            // Cancelled, or the connection is gone: nobody to answer.
            StreamEnd::Over => {
                self.sink = None;
            }
        }
    }

    /// Answers `Unimplemented`.
    pub fn unimplemented(self) {
        let status = Status::unimplemented(format!(
            "{UNKNOWN_METHOD}{:#010x} is not implemented by this server",
            self.method_id
        ));
        self.reply_err(&status);
    }

    fn reply_ok<Resp: prost::Message>(mut self, response: Response<Resp>) {
        let Some(sink) = self.sink.take() else { return };
        if self.is_cancelled() {
            return; // the caller is gone: nobody reads the answer
        }
        self.unregister();
        if let Some(obs) = &mut self.obs {
            obs.finish(Code::Ok);
        }
        let mut response = response;
        let trailers = response.take_trailers();
        let (mut metadata, message) = response.into_parts();
        if let Some(t) = trailers {
            t.merge_into(&mut metadata);
        }
        let frame = OutFrame {
            kind: FrameKind::Response,
            flags: 0,
            call_id: self.call_id,
            method_id: self.method_id,
            status: 0,
            timeout_us: 0,
            metadata: Some(&metadata),
            payload_len: message.encoded_len(),
        };
        if let Err(e) = sink.send(&frame, false, &mut |buf| encode_exact(&message, buf)) {
            // Too large for the client, or the connection is gone: say so if we still can.
            let status = match e {
                SendError::TooLarge { len, max } => Status::resource_exhausted(format!(
                    "response of {len} bytes exceeds the client's limit of {max} bytes \
                     (ChannelBuilder::max_message_size raises it; this server accepts \
                     requests up to {} bytes)",
                    sink.max_message()
                )),
                e => Status::from(e),
            };
            tracing::debug!(peer = sink.peer(), %status, "could not send a response");
            self.sink = Some(sink);
            self.reply_err(&status);
        }
    }

    fn reply_err(mut self, status: &Status) {
        self.answer_err(status);
    }

    /// Answers with an error status, once.
    fn answer_err(&mut self, status: &Status) {
        if let Some(sink) = self.sink.take() {
            if let Some(obs) = &mut self.obs {
                obs.finish(status.code());
            }
            if !self.is_cancelled() {
                self.unregister();
                send_error(&*sink, self.call_id, self.method_id, status);
            }
        }
    }
}

fn send_error(sink: &dyn Link, call_id: CallId, method_id: u32, status: &Status) {
    let send = |message: &[u8], metadata| {
        // Keep error messages within any client's limits.
        let message = &message[..message.len().min(4096)];
        let frame = OutFrame {
            kind: FrameKind::Error,
            flags: 0,
            call_id,
            method_id,
            status: status.code() as u16,
            timeout_us: 0,
            metadata,
            payload_len: message.len(),
        };
        sink.send(&frame, false, &mut |buf| buf.copy_from_slice(message))
    };
    let sent = match send(
        status.message().as_bytes(),
        status.wire_metadata().as_deref(),
    ) {
        // Trailing metadata over the limit (or the client's message size):
        // the caller still learns the code and message, and why the
        // metadata is missing, rather than waiting for its deadline.
        Err(e @ (SendError::Metadata(_) | SendError::TooLarge { .. })) => {
            let why = Status::from(e);
            tracing::warn!(peer = sink.peer(), method_id, error = %why, "error status sent without its trailing metadata");
            let message = format!(
                "{} (its trailing metadata and details were left out: {})",
                status.message(),
                why.message()
            );
            send(message.as_bytes(), None)
        }
        sent => sent,
    };
    if let Err(e) = sent {
        tracing::debug!(peer = sink.peer(), error = %Status::from(e), "could not send an error response");
    }
}

/// Cancellation signals kept per thread for reuse: a unary call needs one
/// for its request, and most are let go of unused when the call ends.
const MAX_POOLED_SIGNALS: usize = 256;

thread_local! {
    static SIGNALS: std::cell::RefCell<Vec<Arc<Signal>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn take_signal() -> Arc<Signal> {
    SIGNALS
        .with(|pool| pool.borrow_mut().pop())
        .unwrap_or_default()
}

/// Keeps `signal` for another call if nothing else holds it.
fn give_signal(mut signal: Arc<Signal>) {
    let Some(unique) = Arc::get_mut(&mut signal) else {
        return; // a request outlived its call (moved into a task): let it be
    };
    unique.reset();
    SIGNALS.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < MAX_POOLED_SIGNALS {
            pool.push(signal);
        }
    });
}

#[cfg(feature = "grpc")]
thread_local! {
    /// Set while the gRPC face starts a call on one of tokio's workers:
    /// the call's task is then spawned on that runtime, as tonic runs its
    /// handlers, instead of blocking the worker.
    static ON_TOKIO: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a call's task: on this dispatcher (parking if it waits), or to
/// completion off one. With its `span` enabled, every poll enters it, so
/// a handler that resumes logs inside its call; disabled, the task runs
/// as it is.
fn run_task(span: tracing::Span, task: impl Future<Output = ()> + Send + 'static) {
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

pin_project_lite::pin_project! {
    /// The task of a call answered once (unary and client-streaming): polls
    /// the handler's future in place, catching a panic (so that the call is
    /// still ours to answer with the panic's message), drops it, then answers
    /// the call.
    ///
    /// Written out rather than as an `async` block around [`run_handler`]: that
    /// block laid the handler's future out three times over (its capture, the
    /// awaited future's argument and its pinned copy: 992 bytes for the echo
    /// service's 456), and every move of the task on its way into the
    /// executor's box copied all of them.
    struct Answer<Fut> {
        // The handler's future; None once it finished.
        #[pin]
        future: Option<Fut>,
        // The call it answers; None once answered.
        call: Option<ServerCall>,
    }
}

impl<Fut, Resp> Future for Answer<Fut>
where
    Fut: Future<Output = Result<Response<Resp>, Status>>,
    Resp: prost::Message,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut this = self.project();
        if this.future.is_none() {
            return Poll::Ready(()); // polled again after it finished
        }
        let signal = this.call.as_ref().and_then(ServerCall::signal);
        match poll_handler(this.future.as_mut(), signal, cx) {
            Poll::Pending => {
                // A unary handler that has to wait can hear of a cancel
                // from then on (a stream's call is registered already).
                if let Some(call) = this.call.as_mut() {
                    call.register_unary();
                }
                Poll::Pending
            }
            // Cancelled: nothing is answered.
            Poll::Ready(None) => {
                this.call.take();
                Poll::Ready(())
            }
            Poll::Ready(Some(outcome)) => {
                crate::stages::mark(crate::stages::Stage::HandlerDone);
                if let Some(call) = this.call.take() {
                    match outcome {
                        Ok(result) => call.reply(result),
                        Err(panic) => call.reply_panic(&*panic),
                    }
                }
                Poll::Ready(())
            }
        }
    }
}

/// What a handler panicked with.
type Panic = Box<dyn std::any::Any + Send>;

/// Polls a handler's future to its output (see [`poll_handler`]).
async fn run_handler<T, Fut: Future<Output = T>>(
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
fn poll_handler<Fut: Future>(
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

impl Drop for ServerCall {
    fn drop(&mut self) {
        if self.registered {
            self.registry.remove(self.qp_num, self.call_id);
        }
        // Read before the stream is failed below, which fires its signal.
        let cancelled = self.is_cancelled();
        if let Some(core) = &self.core {
            // A request stream still read (by a task the handler spawned)
            // ends: nothing more arrives for a finished call.
            core.fail(Status::cancelled("the call has finished"));
        }
        if let Some(signal) = self.signal.take() {
            give_signal(signal);
        }
        if self.sink.is_some() && cancelled {
            self.sink = None;
        }
        if let Some(sink) = self.sink.take() {
            // A handler's future dropped after it panicked (see the executor).
            let status = match executor::take_panic_message() {
                Some(what) => Status::internal(format!("handler panicked: {what}")),
                None => Status::internal("the handler did not answer the call"),
            };
            send_error(&*sink, self.call_id, self.method_id, &status);
        }
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Entry point: `Server::builder()`.
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder with default settings.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            services: Vec::new(),
            blocking_methods: Vec::new(),
            config: Config::default(),
            dispatchers: crate::dispatch::available_cores(),
            blocking_threads: crate::dispatch::available_cores().max(4),
            admission: Admission::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            interceptors: Chain::default(),
            reflection: false,
            #[cfg(feature = "grpc")]
            grpc: None,
            fallback: None,
            #[cfg(feature = "tokio")]
            tokio: None,
        }
    }
}

/// Configures services and limits, then serves.
pub struct ServerBuilder {
    /// Services, each with whether all its methods block.
    services: Vec<(Arc<dyn Service>, bool)>,
    /// Paths (`/package.Service/Method`) of methods that block.
    blocking_methods: Vec<String>,
    config: Config,
    dispatchers: usize,
    blocking_threads: usize,
    /// How handshakes are admitted; their timeout is `config.connect_timeout`.
    admission: Admission,
    max_connections: usize,
    max_streams: u32,
    interceptors: Chain,
    /// Whether `serve` adds the reflection service.
    reflection: bool,
    /// Where to serve standard gRPC too.
    #[cfg(feature = "grpc")]
    grpc: Option<String>,
    /// Takes the calls of methods no service has, whose kind the caller
    /// names in metadata (the gRPC gateway of `grpc://` clients).
    fallback: Option<Arc<dyn Service>>,
    #[cfg(feature = "tokio")]
    tokio: Option<tokio::runtime::Handle>,
}

/// Streams a server serves at once on one connection, by default: as
/// HTTP/2 servers commonly allow (RFC 9113 asks for at least 100). Each
/// stream may hold a window (256 KiB) of its client's messages unread, so a
/// connection's streams hold at most 25 MiB, within the 64 MiB a connection
/// may queue to send: no stream's send within its window meets a full queue
/// unless unary traffic fills it too.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 100;

/// Connections a server keeps at most, by default. An idle connection
/// costs little (see the README's "Limits and memory"); the process's
/// descriptor limit (`ulimit -n`) usually binds first on tcp://.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

impl fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self
            .services
            .iter()
            .map(|(s, _)| s.descriptor().name)
            .collect();
        f.debug_struct("ServerBuilder")
            .field("services", &names)
            .field("dispatchers", &self.dispatchers)
            .field("blocking_threads", &self.blocking_threads)
            .field("admission", &self.admission)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl ServerBuilder {
    /// Adds a service (a generated `FooServer::new(impl)`, or any [`Service`]).
    ///
    /// Its handlers run to completion on the dispatcher thread that received
    /// the request: no hand-off to another thread, the reply leaves in the
    /// same batch of posts. An `async` handler that waits (a timer, a call
    /// to another service, tokio I/O) parks and lets the dispatcher go on.
    /// A handler must therefore not *block* the thread: blocking or
    /// CPU-heavy work goes to [`ServerBuilder::add_blocking_service`],
    /// [`ServerBuilder::blocking_method`] or [`crate::blocking`].
    pub fn add_service(mut self, service: impl Service) -> Self {
        self.services.push((Arc::new(service), false));
        self
    }

    /// Adds the reflection service, `grpc.reflection.v1.ServerReflection`
    /// ([`crate::reflection`]), which tells clients such as the `rpc`
    /// command line tool what this server serves: every service added,
    /// before or after this call, and the `.proto` files generated services
    /// carry. Off by default, as in gRPC: it shows the whole API to anyone
    /// who may connect.
    pub fn add_reflection(mut self) -> Self {
        self.reflection = true;
        self
    }

    /// Adds a service whose handlers may block or run long: they run on the
    /// server's bounded blocking pool ([`ServerBuilder::blocking_threads`]),
    /// so one of them never delays other calls or connections. Each call
    /// costs a hand-off to a pool thread and back.
    pub fn add_blocking_service(mut self, service: impl Service) -> Self {
        self.services.push((Arc::new(service), true));
        self
    }

    /// Runs one method (`/package.Service/Method`) on the blocking pool, as
    /// [`ServerBuilder::add_blocking_service`] does for whole services.
    /// [`ServerBuilder::serve`] fails if no added service has that method.
    pub fn blocking_method(mut self, path: &str) -> Self {
        self.blocking_methods.push(path.to_owned());
        self
    }

    /// Dispatcher threads (default: one per CPU). Each owns a completion
    /// queue and its share of the connections, and runs their handlers.
    pub fn dispatchers(mut self, n: usize) -> Self {
        self.dispatchers = n.max(1);
        self
    }

    /// Most threads of the blocking pool (default: the number of CPUs, at
    /// least 4). Threads start when first needed.
    pub fn blocking_threads(mut self, n: usize) -> Self {
        self.blocking_threads = n.max(1);
        self
    }

    /// Receive ring per connection in bytes, a power of two (default 256 KiB
    /// on mem:// and tcp://, 128 KiB on rdma://, where it is registered
    /// memory).
    /// Small messages travel through it; payloads larger than the
    /// rendezvous threshold ([`ServerBuilder::rendezvous_above`]) or than
    /// half the ring are lent by the sender and read from its memory.
    pub fn ring_size(mut self, bytes: usize) -> Self {
        self.config.ring_size = Some(bytes);
        self
    }

    /// Largest request (metadata + payload) accepted, in bytes (default
    /// 64 MiB, at most 4 GiB less a byte). A larger request fails at its
    /// sender with `ResourceExhausted`, before anything is allocated here.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.config.max_message = bytes;
        self
    }

    /// Payloads larger than this many bytes (default 32 KiB) travel by
    /// rendezvous: the sender lends its encoded message to the connection,
    /// the receiver reads it straight into its own buffer. Smaller ones
    /// are copied through the ring.
    pub fn rendezvous_above(mut self, bytes: usize) -> Self {
        self.config.lend_above = bytes;
        self
    }

    /// How long a dispatcher spins on an idle queue before it blocks, at
    /// least (default 50 µs; it spins longer while requests keep coming
    /// within a millisecond of each other).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.config.spin = spin;
        self
    }

    /// How often an idle connection sends a heartbeat (default 1 s, at
    /// least 10 ms; what one is on each fabric: [`DEFAULT_HEARTBEAT`](crate::DEFAULT_HEARTBEAT)),
    /// or `None` for none. The client's transport must
    /// acknowledge each, so the connection of a client host that vanished
    /// is dropped, and its memory returned, within 5 s with the default (about
    /// 2.5 s on rdma://; see [`heartbeat_bound`](crate::heartbeat_bound));
    /// without heartbeats, only TCP keepalive notices, after 20 s.
    pub fn heartbeat(mut self, interval: Option<Duration>) -> Self {
        self.config.heartbeat = interval;
        self
    }

    /// Requires every client to authenticate before any memory is set
    /// aside for it: with [`SharedSecret`](crate::SharedSecret) (or
    /// [`SharedSecrets`](crate::SharedSecrets)), HMAC challenge-response,
    /// mutual; or any [`Authenticator`]. A client without the credential
    /// fails to connect with `Unauthenticated`. Handlers see who the client
    /// is in [`Request::peer`](crate::Request::peer).
    pub fn authenticator(mut self, authenticator: impl Authenticator) -> Self {
        self.admission.authenticator = Some(Arc::new(authenticator));
        self
    }

    /// Serves over TLS (`tcp://`: everything; `rdma://`: the handshake over
    /// TCP; `mem://` ignores it): clients must connect with
    /// [`ChannelBuilder::tls_config`](crate::ChannelBuilder::tls_config),
    /// and a plaintext one is told so. With
    /// [`ServerTlsConfig::client_ca_root`](crate::tls::ServerTlsConfig::client_ca_root)
    /// clients need a certificate from that CA, and handlers see the name
    /// in it in [`Request::peer`](crate::Request::peer) (unless an
    /// [`authenticator`](ServerBuilder::authenticator) names the client).
    /// Fails at once if `config` is not usable (no identity, a PEM without
    /// a certificate or key, a key that does not match its certificate).
    #[cfg(feature = "tls")]
    pub fn tls_config(mut self, config: crate::tls::ServerTlsConfig) -> Result<Self, Status> {
        self.admission.tls = Some(config.build()?);
        Ok(self)
    }

    /// Connections kept at most (default 16,384); a client beyond it fails
    /// to connect with `ResourceExhausted`, naming the limit.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Streams served at once on one connection (default
    /// [`DEFAULT_MAX_CONCURRENT_STREAMS`], 100), like HTTP/2's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`; at least 1. Unary calls do not
    /// count. The server tells each client the limit when it connects
    /// (up to 65,535; a larger limit is told as 65,535), and the client's
    /// stream beyond it waits for one of that connection's streams to end
    /// (within its deadline) before it is sent. A stream that arrives
    /// beyond the limit anyway (a client that ignores it) fails at once
    /// with `ResourceExhausted`, naming the limit. The same limit applies
    /// to each HTTP/2 connection of the gRPC face, where (as in HTTP/2)
    /// unary calls count too.
    ///
    /// Each stream may hold a window (256 KiB) of its client's messages
    /// that the handler has not read yet, so the limit bounds that memory
    /// per connection; with more than 256 streams a connection's sends
    /// within their windows can together exceed what it may queue (64 MiB)
    /// and fail `ResourceExhausted`.
    pub fn max_concurrent_streams(mut self, n: u32) -> Self {
        self.max_streams = n.max(1);
        self
    }

    /// Handshakes in progress at most (default 1,024, fewer if the process
    /// may open few descriptors). They need no thread: one thread admits
    /// them all. Beyond the limit the oldest is dropped, so peers that
    /// connect and say nothing cannot keep real clients out.
    pub fn max_pending_handshakes(mut self, n: usize) -> Self {
        self.admission.max_pending = n.max(1);
        self
    }

    /// How long a client's connection set-up may take (default 5 s).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// The tokio runtime whose timers, sockets and channels handlers may
    /// use: the dispatchers enter it. By default, the runtime `serve` is
    /// called from, if any.
    #[cfg(feature = "tokio")]
    pub fn tokio_handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.tokio = Some(handle);
        self
    }

    /// Adds an interceptor: it sees every call (unary and streams) before
    /// its handler runs, with the caller's [`Peer`](crate::auth::Peer), may
    /// change the metadata the handler sees, and may answer the call with
    /// a status instead (see [`crate::interceptor`]). Interceptors run in
    /// the order added, on the dispatcher: they must not block.
    pub fn interceptor(mut self, interceptor: impl Interceptor) -> Self {
        self.interceptors.push(interceptor);
        self
    }

    /// Starts serving on `url` in background threads and returns at once.
    /// `tcp://host:0` picks a free port: see [`ServerHandle::local_url`].
    pub fn serve(mut self, url: &str) -> Result<ServerHandle, Status> {
        self.config.validate()?;
        if std::mem::take(&mut self.reflection) && !self.services.is_empty() {
            let services: Vec<&dyn Service> = self.services.iter().map(|(s, _)| &**s).collect();
            let reflection = crate::reflection::ReflectionServer::new(&services);
            self.services.push((Arc::new(reflection), false));
        }
        #[cfg(feature = "grpc")]
        if let Some(addr) = self.grpc.take() {
            return self.serve_with_grpc(url, &addr);
        }
        self.serve_plain(url)
    }

    /// Serves standard gRPC (HTTP/2) on `addr` too (`host:port`; port 0
    /// picks a free one, see [`ServerHandle::grpc_addr`]): the same
    /// services, interceptors, deadlines, cancellation, metadata, status
    /// codes and streams, for callers that speak gRPC (other languages,
    /// grpcurl, load balancers, Kubernetes probes; add the health service
    /// for those). Served by tonic, on the tokio runtime given to
    /// [`ServerBuilder::tokio_handle`] or on one of its own (two threads,
    /// `rpc-grpc`): a gRPC call's handler runs on the tokio worker that
    /// read it (a blocking service or method on the blocking pool), and
    /// the handler sees the caller as a [`Peer`](crate::Peer) of fabric
    /// `"grpc"`. The `rdma://` and `tcp://` paths are not touched.
    ///
    /// With [`ServerBuilder::tls_config`] the face serves TLS too, with
    /// the same certificate and, for mutual TLS, the same client CA (the
    /// name in a client's certificate is then the peer's identity). The
    /// server's [`authenticator`](ServerBuilder::authenticator) is a
    /// handshake of our fabrics that gRPC does not have: it does not guard
    /// the face. Guard it with mutual TLS or an
    /// [`interceptor`](ServerBuilder::interceptor).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), rpc_core::Status> {
    /// # struct Kv; impl rpc_core::Service for Kv { fn descriptor(&self) -> &'static rpc_core::server::ServiceDescriptor { unimplemented!() } fn call(&self, _: rpc_core::ServerCall) {} }
    /// let server = rpc_core::Server::builder()
    ///     .add_service(Kv)
    ///     .grpc("0.0.0.0:50051")
    ///     .serve("rdma://0.0.0.0:7471")?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "grpc")]
    pub fn grpc(mut self, addr: &str) -> Self {
        self.grpc = Some(addr.to_owned());
        self
    }

    /// A service for the calls of methods no added service has, whose
    /// kind the caller names in metadata ([`FALLBACK_KIND`]): the gateway
    /// of `grpc://` clients passes any method on.
    #[cfg(feature = "grpc")]
    pub(crate) fn fallback(mut self, service: Arc<dyn Service>) -> Self {
        self.fallback = Some(service);
        self
    }

    /// Serves on `url`, and gRPC on `addr` with the same services: the
    /// face starts each call as a dispatcher would, on tokio's workers.
    #[cfg(feature = "grpc")]
    fn serve_with_grpc(self, url: &str, addr: &str) -> Result<ServerHandle, Status> {
        let runtime = self.tokio.clone();
        #[cfg(feature = "tls")]
        let tls = self.admission.tls.as_ref().map(|t| t.source.to_tonic());
        #[cfg(not(feature = "tls"))]
        let tls = None;
        let mut main = self.serve_plain(url)?;
        let shared = main
            .shared
            .clone()
            .ok_or_else(|| Status::internal("gRPC face: the server has no calls to share"))?;
        let face = crate::grpc::GrpcFace::start(addr, shared.clone(), runtime, tls)?;
        main.grpc_addr = Some(face.local_addr());
        let stopper = main.stopper.take();
        main.stopper = Some(Box::new(WithFace {
            face,
            shared,
            main: stopper,
        }));
        Ok(main)
    }

    fn serve_plain(self, url: &str) -> Result<ServerHandle, Status> {
        let routes = self.routes()?;
        let url = FabricUrl::parse(url)?;
        match url.scheme {
            Scheme::Mem | Scheme::Tcp => self.serve_on(SoftFabric::new(), &url, routes),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => self.serve_on(crate::fabric::open_verbs(&url)?, &url, routes),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(&url)? {},
            Scheme::Grpc => Err(Status::invalid_argument(
                "a server does not listen on grpc://: serve gRPC beside its URL with \
                 ServerBuilder::grpc",
            )),
        }
    }

    /// Serves on `url` until `signal` completes, then shuts down as
    /// [`ServerHandle::shutdown`] does (without blocking the executor),
    /// for async applications, as tonic's `serve_with_shutdown`:
    ///
    /// ```no_run
    /// # async fn f(
    /// #     builder: rpc_core::ServerBuilder,
    /// #     ctrl_c: impl std::future::Future<Output = ()>,
    /// # ) -> Result<(), rpc_core::Status> {
    /// // `ctrl_c`: any future, e.g. `async { tokio::signal::ctrl_c().await.ok(); }`
    /// builder.serve_with_shutdown("tcp://0.0.0.0:7471", ctrl_c).await?;
    /// # Ok(()) }
    /// ```
    pub async fn serve_with_shutdown(
        self,
        url: &str,
        signal: impl Future<Output = ()>,
    ) -> Result<(), Status> {
        let server = self.serve(url)?;
        signal.await;
        server.shutdown_async().await;
        Ok(())
    }

    fn routes(&self) -> Result<IdMap<Route>, Status> {
        if self.services.is_empty() && self.fallback.is_none() {
            return Err(Status::invalid_argument(
                "a server needs at least one service",
            ));
        }
        let mut routes: HashMap<u32, (&'static str, Route)> = HashMap::new();
        for (svc, blocking) in &self.services {
            for m in svc.descriptor().methods {
                let expected = crate::descriptor::method_id(m.path);
                if m.id != expected {
                    return Err(Status::invalid_argument(format!(
                        "{} claims id {:#010x} but its id is {expected:#010x}: regenerate the code",
                        m.path, m.id
                    )));
                }
                let route = Route {
                    path: m.path,
                    service: svc.clone(),
                    blocking: *blocking || self.blocking_methods.iter().any(|p| p == m.path),
                    kind: m.kind,
                };
                if let Some((other, _)) = routes.insert(m.id, (m.path, route)) {
                    return Err(Status::invalid_argument(format!(
                        "method id collision: {other} and {} both hash to {:#010x}; rename one",
                        m.path, m.id
                    )));
                }
            }
        }
        for path in &self.blocking_methods {
            if !routes.values().any(|(p, _)| p == path) {
                return Err(Status::invalid_argument(format!(
                    "blocking_method({path:?}): no added service has that method"
                )));
            }
        }
        Ok(routes.into_iter().map(|(id, (_, r))| (id, r)).collect())
    }

    fn serve_on<F: Fabric>(
        self,
        fabric: F,
        url: &FabricUrl,
        routes: IdMap<Route>,
    ) -> Result<ServerHandle, Status> {
        let admission = Admission {
            timeout: self.config.connect_timeout,
            ..self.admission.clone()
        };
        let listener = Arc::new(fabric.listen(url, admission)?);
        let local_url = listener.local_url();
        let shared = Arc::new(ServerShared {
            routes,
            fallback: self.fallback.clone(),
            interceptors: self.interceptors.clone(),
            pool: BlockingPool::new("rpc-blocking", self.blocking_threads),
            draining: AtomicBool::new(false),
            inflight: Arc::new(AtomicUsize::new(0)),
            max_message: self.config.max_message,
            max_streams: self.max_streams,
        });
        let mut endpoints = Vec::with_capacity(self.dispatchers);
        for _ in 0..self.dispatchers {
            let role = ServerRole {
                shared: shared.clone(),
                registry: Arc::new(Registry::with_stream_limit(self.max_streams)),
            };
            endpoints.push(Endpoint::new(
                fabric.clone(),
                self.config.clone(),
                role,
                true,
            )?);
        }
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Status::internal(format!("cannot spawn a thread: {e}")))
        };
        #[cfg(feature = "tokio")]
        let tokio = self
            .tokio
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        let mut dispatchers = Vec::with_capacity(endpoints.len());
        for (i, ep) in endpoints.iter().enumerate() {
            let ep = ep.clone();
            #[cfg(feature = "tokio")]
            let tokio = tokio.clone();
            dispatchers.push(spawn(
                format!("rpc-dispatch-{i}"),
                Box::new(move || {
                    #[cfg(feature = "tokio")]
                    let _entered = tokio.as_ref().map(|h| h.enter());
                    crate::dispatch::mark_server_dispatcher();
                    ep.run()
                }),
            )?);
        }
        let endpoints = Arc::new(endpoints);
        let acceptor = {
            let endpoints = endpoints.clone();
            let listener = listener.clone();
            let shared = shared.clone();
            let max_connections = self.max_connections;
            spawn(
                "rpc-acceptor".into(),
                Box::new(move || accept_loop(&endpoints, &shared, listener, max_connections)),
            )?
        };
        tracing::info!(url = %local_url, dispatchers = endpoints.len(), "serving");
        Ok(ServerHandle {
            local_url,
            grpc_addr: None,
            #[cfg(feature = "grpc")]
            shared: Some(shared.clone()),
            stopper: Some(Box::new(ServerStopper {
                endpoints,
                shared,
                listener,
                acceptor: Some(acceptor),
                dispatchers,
            })),
        })
    }
}

/// Sets up the connections the listener admitted (their hellos read and
/// validated, their clients authenticated) one after the other: allocating
/// a ring and a queue pair and sending the server's hello does not wait
/// for the peer, so no connection needs a thread of its own.
fn accept_loop<F: Fabric>(
    endpoints: &Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    shared: &ServerShared,
    listener: Arc<F::Listener>,
    max_connections: usize,
) {
    loop {
        let incoming = match listener.next() {
            Ok(Some(i)) => i,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "listener failed; no longer accepting");
                return;
            }
        };
        if shared.draining.load(Ordering::Acquire) {
            listener.refuse(incoming, Code::Unavailable, "the server is shutting down");
            continue;
        }
        let connections: usize = endpoints.iter().map(|ep| ep.load()).sum();
        if connections >= max_connections {
            listener.refuse(
                incoming,
                Code::ResourceExhausted,
                &format!("the server is at its limit of {max_connections} connections"),
            );
            continue;
        }
        let ep = least_loaded(endpoints);
        if let Err(status) = establish(ep, incoming) {
            tracing::warn!(%status, "connection attempt failed");
        }
    }
}

/// The receive ring (bytes) and largest request for a connection from a
/// client whose ring is `client`: each direction is its own agreement. The
/// client stages what it sends for this ring, and stages for at most
/// [`staging_limit`] of its own ring size: a server with a larger ring
/// offers that client only as much (and requests up to half of it), so
/// that a client with default settings can use any server.
fn ring_for<F: Fabric>(config: &Config, client: &PeerRing) -> (usize, usize) {
    let client_ring = usize::try_from(client.len).unwrap_or(usize::MAX);
    let ring = config.ring_size::<F>().min(staging_limit(client_ring));
    (ring, config.max_message)
}

fn establish<F: Fabric>(ep: &Endpoint<F, ServerRole>, incoming: F::Incoming) -> Result<(), Status> {
    let (ring_len, max_message) = ring_for::<F>(&ep.config, &incoming.peer_ring());
    let ring = ep.register_ring(ring_len)?;
    let local = LocalSetup {
        ring: &ring,
        max_message: max_message as u32,
        max_streams: ep.role.shared.max_streams,
        timeout: ep.config.connect_timeout,
        credential: None,
        tls: None,
    };
    let connected = ep.fabric.accept(incoming, local, &ep.cq)?;
    let conn = ep.add(connected, ring, max_message)?;
    crate::observe::connection(Side::Server, 1.0);
    if let Err(status) = conn.established() {
        ep.close(&conn, "handshake failed");
        return Err(status);
    }
    // Only now: on tcp:// nothing may reach the client before the hello;
    // and heartbeats wait for the client's first write (on rdma://, its
    // ring's memory window is bound only then).
    if let Some(every) = ep.config.heartbeat {
        ep.start_heartbeat(&conn, every, true);
    }
    tracing::info!(
        peer = %conn.remote.addr,
        identity = conn.remote.identity.as_deref().unwrap_or("-"),
        qp_num = conn.qp_num,
        "client connected"
    );
    Ok(())
}

/// Where a method's calls go.
struct Route {
    /// `/package.Service/Method`.
    path: &'static str,
    service: Arc<dyn Service>,
    /// On the blocking pool, not the dispatcher.
    blocking: bool,
    kind: MethodKind,
}

/// The metadata key in which a call to a server's fallback names its kind.
pub(crate) const FALLBACK_KIND: &str = "rpc-gateway-kind";

/// The kind of rpc a call for the fallback says it is.
fn fallback_kind(metadata: &Metadata) -> Option<MethodKind> {
    Some(match metadata.get(FALLBACK_KIND)? {
        "unary" => MethodKind::Unary,
        "server" => MethodKind::ServerStreaming,
        "client" => MethodKind::ClientStreaming,
        "bidi" => MethodKind::Streaming,
        _ => return None,
    })
}

/// How a status names a method's `kind`.
fn kind_name(kind: MethodKind) -> &'static str {
    match kind {
        MethodKind::Unary => "unary",
        MethodKind::ServerStreaming => "server-streaming",
        MethodKind::ClientStreaming => "client-streaming",
        MethodKind::Streaming => "bidirectional-streaming",
    }
}

/// The [`FALLBACK_KIND`] value of `kind`.
pub(crate) fn fallback_kind_name(kind: MethodKind) -> &'static str {
    match kind {
        MethodKind::Unary => "unary",
        MethodKind::ServerStreaming => "server",
        MethodKind::ClientStreaming => "client",
        MethodKind::Streaming => "bidi",
    }
}

/// Calls a service, answering a call the service dropped after a panic.
fn call_service(service: &dyn Service, call: ServerCall) {
    let method_id = call.method_id;
    // A hand-written Service may panic outside ServerCall::unary; the call's
    // drop then answers it.
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| service.call(call))) {
        tracing::error!(method_id, panic = %panic_message(&*panic), "service panicked");
    }
}

/// What a server's dispatchers share: routes and shutdown state.
pub(crate) struct ServerShared {
    routes: IdMap<Route>,
    /// See `ServerBuilder::fallback`.
    fallback: Option<Arc<dyn Service>>,
    interceptors: Chain,
    pool: BlockingPool,
    draining: AtomicBool,
    inflight: Arc<AtomicUsize>,
    /// The largest message the server accepts (the gRPC face's limit).
    #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
    max_message: usize,
    /// Streams served at once per connection (see
    /// [`ServerBuilder::max_concurrent_streams`]).
    max_streams: u32,
}

impl ServerShared {
    /// Refuses new calls from now on and tells each service, once, that
    /// the server is shutting down ([`Service::shutting_down`]).
    fn begin_shutdown(&self) {
        if self.draining.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut told: Vec<*const ()> = Vec::new();
        let services = self.routes.values().map(|r| &r.service);
        for service in services.chain(self.fallback.as_ref()) {
            let at = Arc::as_ptr(service).cast::<()>();
            if !told.contains(&at) {
                told.push(at);
                service.shutting_down();
            }
        }
    }
}

/// A request as it arrived: on a connection of a fabric, or through the
/// gRPC face.
pub(crate) struct NewCall<'a> {
    /// The connection's queue pair number (calls' ids are per connection).
    pub(crate) qp_num: u32,
    pub(crate) call_id: CallId,
    pub(crate) method_id: u32,
    /// The caller's timeout in microseconds; 0 for none.
    pub(crate) timeout_us: u32,
    /// The request's metadata; `None` if it did not decode.
    pub(crate) metadata: Option<Metadata>,
    pub(crate) payload: crate::payload::Payload,
    /// Where the call's answer and stream frames go.
    pub(crate) sink: Arc<dyn Link>,
    pub(crate) remote: &'a Arc<crate::Peer>,
    /// The kind of call the client opened, where its protocol says (our
    /// `Request` frames do; gRPC's do not): a call of another kind than
    /// the method's is refused.
    pub(crate) kind: Option<MethodKind>,
}

impl ServerShared {
    /// Starts a call: routes it, runs the interceptors, registers it in
    /// `registry` if later frames may name it, and runs its handler (here,
    /// or on the blocking pool). Every failure is answered on the call's
    /// sink.
    pub(crate) fn start_call(&self, registry: &Arc<Registry>, incoming: NewCall<'_>) {
        // A handler run in place starts microseconds after the deadline is
        // set: only a shorter timeout can pass meanwhile (saving a clock
        // read per call).
        const RECHECK_BELOW_US: u32 = 1_000;
        let NewCall {
            qp_num,
            call_id,
            method_id,
            timeout_us,
            metadata,
            payload,
            sink,
            remote,
            kind,
        } = incoming;
        self.inflight.fetch_add(1, Ordering::AcqRel);
        let deadline =
            crate::protocol::field_timeout(timeout_us).map(|t| crate::dispatch::turn_now() + t);
        let mut call = ServerCall {
            method_id,
            call_id,
            qp_num,
            metadata: Metadata::new(),
            payload,
            deadline,
            recheck: true,
            sink: Some(sink),
            inflight: self.inflight.clone(),
            registry: registry.clone(),
            registered: false,
            core: None,
            signal: None,
            obs: None,
        };
        let Some(metadata) = metadata else {
            return call.reply_err(&Status::invalid_argument("request metadata is malformed"));
        };
        call.metadata = metadata;
        if self.draining.load(Ordering::Acquire) {
            return call.reply_err(&Status::unavailable("server is shutting down"));
        }
        let fallback;
        let route = match self.routes.get(&method_id) {
            Some(route) => route,
            None => match (&self.fallback, fallback_kind(&call.metadata)) {
                (Some(service), Some(kind)) => {
                    fallback = Route {
                        path: "/*",
                        service: service.clone(),
                        blocking: false,
                        kind,
                    };
                    &fallback
                }
                _ => return call.unimplemented(),
            },
        };
        let obs = CallObs::server(route.path, remote, &call.metadata);
        let span = obs.span().clone();
        let _in = span.enter();
        call.obs = Some(obs);
        if !self.interceptors.is_empty() {
            let peer = Some(&**remote);
            if let Err(status) = self.interceptors.run(route.path, &mut call.metadata, peer) {
                return call.reply_err(&status);
            }
        }
        // A client built from another version of the .proto: its frames
        // would be read by the wrong rules (its request stream taken for
        // a protocol violation, or a single answer for its stream's end).
        if let Some(asked) = kind.filter(|&k| k != route.kind) {
            return call.reply_err(&Status::internal(format!(
                "{} is a {} method on this server, called as {}: build the client from the \
                 server's .proto",
                route.path,
                kind_name(route.kind),
                kind_name(asked),
            )));
        }
        // A stream, or a call handed to another thread, is registered now:
        // its next frames may arrive before its handler runs.
        if route.kind != MethodKind::Unary {
            let core = StreamCore::new(DEFAULT_WINDOW, route.kind.client_streams());
            if let Err(limit) = registry.insert_stream(qp_num, call_id, core.clone()) {
                return call.reply_err(&Status::resource_exhausted(format!(
                    "the connection already has {limit} streams open, the most this server \
                     serves at once on one connection (ServerBuilder::max_concurrent_streams)"
                )));
            }
            call.core = Some(core);
            call.registered = true;
        } else if route.blocking {
            let signal = take_signal();
            registry.insert(qp_num, call_id, signal.clone());
            call.signal = Some(signal);
            call.registered = true;
        }
        call.recheck = route.blocking || timeout_us < RECHECK_BELOW_US;
        if route.blocking {
            let service = route.service.clone();
            let span = call.span();
            self.pool.execute_for(
                u64::from(qp_num),
                Box::new(move || {
                    let _in = span.enter();
                    call_service(&*service, call)
                }),
            );
        } else {
            call_service(&*route.service, call);
        }
    }
}

#[cfg(feature = "grpc")]
impl ServerShared {
    /// The id and kind of the method at `path`, if the server has it.
    pub(crate) fn method(&self, path: &str) -> Option<(u32, MethodKind)> {
        let id = crate::descriptor::method_id(path);
        let route = self.routes.get(&id).filter(|r| r.path == path)?;
        Some((id, route.kind))
    }

    /// The largest message the server accepts.
    pub(crate) fn max_message(&self) -> usize {
        self.max_message
    }

    /// Streams served at once per connection.
    pub(crate) fn max_streams(&self) -> u32 {
        self.max_streams
    }

    /// [`ServerShared::start_call`] on a tokio worker (the gRPC face): a
    /// handler that waits becomes a task of that runtime.
    pub(crate) fn start_call_on_tokio(&self, registry: &Arc<Registry>, call: NewCall<'_>) {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                ON_TOKIO.set(false);
            }
        }
        ON_TOKIO.set(true);
        let _reset = Reset;
        self.start_call(registry, call);
    }
}

/// The server's side of one dispatcher: routes requests to handlers.
struct ServerRole {
    shared: Arc<ServerShared>,
    registry: Arc<Registry>,
}

impl<F: Fabric> Role<F> for ServerRole {
    const SIDE: Side = Side::Server;

    fn on_frame(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        crate::stages::mark_once(crate::stages::Stage::ServerFrame);
        let h = frame.header;
        #[cfg(feature = "testing")]
        fault::check(h.method_id);
        match h.kind {
            FrameKind::Request => {}
            FrameKind::Message | FrameKind::HalfClose | FrameKind::Window | FrameKind::Cancel => {
                return self.on_call_frame(ep, conn, frame);
            }
            FrameKind::Credit => return,
            kind => {
                ep.close_for_violation(conn, &format!("client sent a {kind:?} frame"));
                return;
            }
        }
        // An id names one live call of the connection. Every call that
        // outlives its request frame is registered by now (streams and
        // blocking calls here, waiting handlers at their first wait): a
        // request reusing the id of one would take its place, and the
        // earlier call could then never be cancelled, nor its task ended
        // when the connection goes.
        if self.registry.contains(conn.qp_num, h.call_id) {
            ep.close_for_violation(
                conn,
                &format!("client reused the id {:#x} of a live call", h.call_id.0),
            );
            return;
        }
        let sink: Arc<dyn Link> = conn.clone();
        self.shared.start_call(
            &self.registry,
            NewCall {
                qp_num: conn.qp_num,
                call_id: h.call_id,
                method_id: h.method_id,
                timeout_us: h.timeout_us,
                metadata: frame.metadata,
                payload: frame.payload,
                sink,
                remote: &conn.remote,
                kind: Some(h.call_kind()),
            },
        );
    }

    fn on_lost(&self, conn: &Arc<Conn<F>>, why: &str) {
        tracing::info!(peer = %conn.remote.addr, qp_num = conn.qp_num, %why, "client disconnected");
        crate::observe::connection(Side::Server, -1.0);
        for call in self.registry.take_connection(conn.qp_num) {
            call.cancel(Status::unavailable(format!("connection lost: {why}")));
        }
    }

    fn on_tick(&self, _ep: &Endpoint<F, Self>, _now: Instant) -> Option<Instant> {
        None
    }

    /// A request is read (it starts a call); a stream message only for a
    /// call still registered: one cancelled or finished would be dropped
    /// once read.
    fn wants_lent(&self, conn: &Arc<Conn<F>>, header: &crate::protocol::Header) -> bool {
        header.kind != FrameKind::Message || self.registry.contains(conn.qp_num, header.call_id)
    }
}

impl ServerRole {
    /// A frame for a call after its request: stream traffic or a cancel.
    fn on_call_frame<F: Fabric>(&self, ep: &Endpoint<F, Self>, conn: &Arc<Conn<F>>, frame: Frame) {
        if let Err(violation) = self.registry.on_call_frame(conn.qp_num, frame) {
            ep.close_for_violation(conn, &violation);
        }
    }
}

/// Checks `done` every millisecond until it holds (true) or `deadline`
/// passes (false).
fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

trait Stop: Send {
    fn stop(&mut self, grace: Duration);
}

/// A server with a gRPC face: the face stops accepting first (its calls
/// under way end within the grace period), then the server itself.
#[cfg(feature = "grpc")]
struct WithFace {
    face: crate::grpc::GrpcFace,
    shared: Arc<ServerShared>,
    main: Option<Box<dyn Stop>>,
}

#[cfg(feature = "grpc")]
impl Stop for WithFace {
    fn stop(&mut self, grace: Duration) {
        // Calls on the face end as they would on the server.
        self.shared.begin_shutdown();
        self.face.stop(grace);
        if let Some(mut main) = self.main.take() {
            main.stop(grace);
        }
    }
}

struct ServerStopper<F: Fabric> {
    endpoints: Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    shared: Arc<ServerShared>,
    listener: Arc<F::Listener>,
    acceptor: Option<JoinHandle<()>>,
    dispatchers: Vec<JoinHandle<()>>,
}

/// A connection and the dispatcher that serves it.
type ServerConn<F> = (Arc<Endpoint<F, ServerRole>>, Arc<Conn<F>>);

impl<F: Fabric> ServerStopper<F> {
    fn connections(&self) -> Vec<ServerConn<F>> {
        self.endpoints
            .iter()
            .flat_map(|ep| ep.connections().into_iter().map(move |c| (ep.clone(), c)))
            .collect()
    }
}

impl<F: Fabric> Stop for ServerStopper<F> {
    fn stop(&mut self, grace: Duration) {
        // 1. Stop accepting.
        self.listener.close();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        // 2. Refuse new calls, let in-flight ones finish and their replies drain.
        self.shared.begin_shutdown();
        let deadline = crate::bounded_deadline(grace);
        let drained = wait_until(deadline, || {
            self.shared.inflight.load(Ordering::Acquire) == 0
                && !self
                    .connections()
                    .iter()
                    .any(|(_, c)| c.is_alive() && c.has_unsent())
        });
        if !drained {
            tracing::warn!(
                inflight = self.shared.inflight.load(Ordering::Acquire),
                "shutdown grace period over; closing with calls in flight"
            );
        }
        // 3. Wait until the device has executed what was posted: destroying
        // a queue pair discards writes still queued on it, the last replies
        // among them. A signaled write completes after every write before it.
        let mut fences: Vec<_> = self
            .connections()
            .into_iter()
            .filter(|(_, c)| c.is_alive())
            .map(|(_, c)| (c, None))
            .collect();
        let confirmed = wait_until(deadline, || {
            for (conn, fence) in fences.iter_mut() {
                if fence.is_none() {
                    *fence = conn.post_fence();
                }
            }
            // Done: confirmed, or the connection died (nothing left to wait for).
            fences.retain(|(conn, fence)| {
                conn.is_alive() && !fence.is_some_and(|f| conn.completed_through(f))
            });
            fences.is_empty()
        });
        if !confirmed {
            tracing::warn!(
                connections = fences.len(),
                "shutdown grace period over; closing with writes unconfirmed"
            );
        }
        // 4. Close every connection (peers see it), then stop the threads.
        for (ep, conn) in self.connections() {
            ep.close(&conn, "server shut down");
        }
        for ep in self.endpoints.iter() {
            ep.stop();
        }
        for t in self.dispatchers.drain(..) {
            let _ = t.join();
        }
        // Blocking-pool threads exit once their queue closes, with the last
        // reference to the server's shared state; don't wait on them.
        tracing::info!("server stopped");
    }
}

/// How the status of a call to a method the server lacks begins (the
/// method's id follows): the client, which knows its path, names it.
pub(crate) const UNKNOWN_METHOD: &str = "method id ";

/// A running server. [`ServerHandle::shutdown`] stops it gracefully; dropping
/// the handle does the same.
#[must_use = "dropping the ServerHandle stops the server (gracefully, blocking the thread up to 10 s): keep it for as long as it serves"]
pub struct ServerHandle {
    local_url: String,
    /// Where the gRPC face listens, if the server has one.
    grpc_addr: Option<std::net::SocketAddr>,
    /// What the gRPC face starts its calls on.
    #[cfg(feature = "grpc")]
    shared: Option<Arc<ServerShared>>,
    stopper: Option<Box<dyn Stop>>,
}

impl fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerHandle")
            .field("local_url", &self.local_url)
            .finish()
    }
}

/// How long [`ServerHandle::shutdown`] lets in-flight calls finish.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

impl ServerHandle {
    /// Where clients connect (with the real port when 0 was asked).
    pub fn local_url(&self) -> &str {
        &self.local_url
    }

    /// Where the gRPC face listens (`ServerBuilder::grpc`, feature `grpc`),
    /// with the real port when 0 was asked; `None` without one.
    pub fn grpc_addr(&self) -> Option<std::net::SocketAddr> {
        self.grpc_addr
    }

    /// Stops accepting connections, answers new calls `Unavailable`, waits for
    /// in-flight calls to finish and their responses to be sent (up to
    /// [`DEFAULT_SHUTDOWN_GRACE`]), closes every connection, and returns.
    pub fn shutdown(mut self) {
        self.stop(DEFAULT_SHUTDOWN_GRACE);
    }

    /// [`ServerHandle::shutdown`] with a chosen grace period.
    pub fn shutdown_timeout(mut self, grace: Duration) {
        self.stop(grace);
    }

    /// [`ServerHandle::shutdown`] for async code: the waiting for calls in
    /// flight happens on a thread of its own, and the returned future
    /// completes when the server has stopped.
    pub fn shutdown_async(mut self) -> impl Future<Output = ()> + Send + 'static {
        let done = Arc::new(Stopped::default());
        let stopper = self.stopper.take();
        let signal = done.clone();
        let spawned = std::thread::Builder::new()
            .name("rpc-shutdown".into())
            .spawn(move || {
                if let Some(mut s) = stopper {
                    s.stop(DEFAULT_SHUTDOWN_GRACE);
                }
                signal.finish();
            });
        if let Err(e) = spawned {
            // Cannot happen but for a process out of threads: the stop has
            // been dropped with the closure, which did nothing; say so.
            tracing::error!(error = %e, "cannot spawn a thread to shut the server down");
            done.finish();
        }
        StoppedFuture(done)
    }

    fn stop(&mut self, grace: Duration) {
        if let Some(mut s) = self.stopper.take() {
            s.stop(grace);
        }
    }
}

/// Whether an asynchronous shutdown has finished, and who waits for it.
#[derive(Default)]
struct Stopped {
    state: Mutex<(bool, Option<std::task::Waker>)>,
}

impl Stopped {
    fn finish(&self) {
        let waker = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.0 = true;
            st.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Completes when its [`Stopped`] has finished.
struct StoppedFuture(Arc<Stopped>);

impl Future for StoppedFuture {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.0 {
            return std::task::Poll::Ready(());
        }
        st.1 = Some(cx.waker().clone());
        std::task::Poll::Pending
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop(DEFAULT_SHUTDOWN_GRACE);
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Mutex<ServerCall>>();
}

/// A fault to inject for tests (feature `testing`).
#[cfg(feature = "testing")]
pub(crate) mod fault {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Set once any fault is armed: the common case reads this alone.
    static ARMED: AtomicBool = AtomicBool::new(false);
    /// The method ids whose frames make a dispatcher panic.
    static PANIC_ON: Mutex<Vec<u32>> = Mutex::new(Vec::new());

    /// Makes every server dispatcher of the process panic, as a bug of
    /// ours would, while it handles a frame for `method_id`, in the middle
    /// of the completion that brought it. For good: pick an id no other
    /// test calls.
    pub fn panic_on_method(method_id: u32) {
        PANIC_ON
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(method_id);
        ARMED.store(true, Ordering::Release);
    }

    pub(super) fn check(method_id: u32) {
        if ARMED.load(Ordering::Acquire)
            && PANIC_ON
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&method_id)
        {
            panic!("fault injected for method id {method_id:#x}");
        }
    }
}
