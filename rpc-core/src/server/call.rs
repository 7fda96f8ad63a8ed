//! One incoming call's life: [`ServerCall`] takes its request (checking the
//! deadline, decoding it), runs the handler of each kind of method, and
//! answers exactly once (a response, a response stream then its status,
//! or an error); a call dropped unanswered is answered by its drop. Also
//! the per-thread pool of unary calls' cancellation signals.

use super::registry::Registry;
use super::task::{poll_handler, run_handler, run_task};
use crate::compression::{CompressionSwitch, Encoding, EncodingSet, Outgoing, SendPolicy};
use crate::conventions::UNKNOWN_METHOD;
use crate::dispatch::OutFrame;
use crate::executor::{self, panic_message};
use crate::observe::CallObs;
use crate::protocol::{CallId, FrameKind, SendError};
use crate::streaming::{Link, Outbox, Producer, Signal, StreamCore, StreamEnd, Streaming};
use crate::{Code, Metadata, Request, Response, Status};
use futures_core::Stream;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

/// One incoming call, to be answered exactly once.
pub struct ServerCall {
    pub(super) method_id: u32,
    pub(super) call_id: CallId,
    pub(super) qp_num: u32,
    pub(super) metadata: Metadata,
    pub(super) payload: crate::payload::Payload,
    pub(super) deadline: Option<Instant>,
    /// Whether the deadline may pass before the handler runs, and so must
    /// be checked then: the call waits for the blocking pool, or its
    /// timeout is too short to outlast the routing.
    pub(super) recheck: bool,
    pub(super) sink: Option<Arc<dyn Link>>,
    pub(super) inflight: Arc<AtomicUsize>,
    /// Where the call is registered for frames after its request.
    pub(super) registry: Arc<Registry>,
    pub(super) registered: bool,
    /// A stream's state (streaming methods).
    pub(super) core: Option<Arc<StreamCore>>,
    /// A unary call's cancellation signal, once it has one.
    pub(super) signal: Option<Arc<Signal>>,
    /// Its span and metrics (calls of a known method).
    pub(super) obs: Option<CallObs>,
    /// The request frame's flags: its message's encoding and those the
    /// caller accepts ([`crate::compression`]).
    pub(super) flags: u16,
    /// What the call sends compressed and accepts: its service's settings.
    pub(super) compression: crate::CompressionConfig,
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
        let recycle = |p| {
            if let Some(sink) = &self.sink {
                sink.recycle(p);
            }
        };
        let inflated = crate::compression::inflate(
            std::mem::take(&mut self.payload),
            self.flags,
            self.compression.accepts(),
            || self.sink.as_ref().map_or(0, |s| s.max_message()),
            recycle,
        );
        let (payload, encoding) = match inflated {
            Ok(inflated) => inflated,
            Err(status) => {
                self.answer_err(&status);
                return None;
            }
        };
        let decoded = payload.decode::<Req>(recycle);
        match decoded {
            Ok(message) => Some(
                Request::from_wire(
                    message,
                    std::mem::take(&mut self.metadata),
                    self.deadline,
                    self.cancel_signal(),
                    self.sink.as_ref().and_then(|s| s.remote()),
                )
                .with_encoding(encoding),
            ),
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
    pub(super) fn span(&self) -> tracing::Span {
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
        let stream = Streaming::new(core, sink, self.call_id, None, None)
            .of_requests()
            .accepting(self.compression.accepts());
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
        let compression = self.send_policy(response.compression_switch());
        let (metadata, stream) = response.into_parts();
        let mut outbox = Outbox::new(core, sink, self.call_id, self.method_id, Some(metadata))
            .compress(compression);
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
        let encoding = self.send_policy(response.compression_switch()).now();
        let (mut metadata, message) = response.into_parts();
        if let Some(t) = trailers {
            if !sink.keep_trailers_apart(&t.get()) {
                t.merge_into(&mut metadata);
            }
        }
        let out = Outgoing::new(&message, encoding);
        let frame = OutFrame {
            kind: FrameKind::Response,
            flags: encoding.map_or(0, Encoding::flags),
            call_id: self.call_id,
            method_id: self.method_id,
            status: 0,
            timeout_us: 0,
            metadata: Some(&metadata),
            payload_len: out.len(),
        };
        let sent = sink.send(&frame, false, &mut |buf| out.write(buf));
        if let Err(e) = sent {
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

    /// How this call's messages leave: in the encoding the response's
    /// switch holds if it has one, else the service's; if the caller
    /// accepts it.
    fn send_policy(&self, switch: Option<&CompressionSwitch>) -> SendPolicy {
        SendPolicy {
            switch: switch.cloned(),
            encoding: self.compression.send(),
            peer_accepts: EncodingSet::from_flags(self.flags),
        }
    }

    /// The encodings the caller takes back (its `Request` named them).
    #[cfg(feature = "grpc")]
    pub(crate) fn caller_accepts(&self) -> EncodingSet {
        EncodingSet::from_flags(self.flags)
    }

    pub(super) fn reply_err(mut self, status: &Status) {
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

pub(super) fn take_signal() -> Arc<Signal> {
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

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Mutex<ServerCall>>();
}
