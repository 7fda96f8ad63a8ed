//! `Request<T>` and `Response<T>`: a message with its metadata and call options.

use crate::cancel::Signal;
use crate::compression::{CompressionSwitch, Encoding};
use crate::{Metadata, Peer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request: the message, its metadata, and options for this one call.
///
/// On the client, build one with [`Request::new`] (or pass a bare message,
/// which converts through [`IntoRequest`]). On the server, the handler
/// receives one with the caller's metadata and the call's deadline.
#[derive(Debug, Clone)]
pub struct Request<T> {
    message: T,
    metadata: Metadata,
    timeout: Option<Duration>,
    fail_fast: bool,
    wait_for_ready: Option<bool>,
    deadline: Option<Instant>,
    /// On the server: tells the handler its call was cancelled.
    signal: Option<Arc<Signal>>,
    /// On the server: who called.
    peer: Option<Arc<Peer>>,
    /// On the server: the encoding the message arrived compressed in.
    encoding: Option<Encoding>,
}

impl<T> Request<T> {
    /// Wraps a message with empty metadata and the channel's default options.
    pub fn new(message: T) -> Request<T> {
        Request {
            message,
            metadata: Metadata::new(),
            timeout: None,
            fail_fast: false,
            wait_for_ready: None,
            deadline: None,
            signal: None,
            peer: None,
            encoding: None,
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Unwraps the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets how long the caller waits for the response, overriding the
    /// channel's default. A call still running after it fails with
    /// `DeadlineExceeded`; the server sees the remaining budget as
    /// [`Request::deadline`] and drops a request whose deadline has passed
    /// before its handler starts (a running handler learns of it through
    /// [`Request::cancelled`]). `Duration::MAX` means no deadline; one of
    /// 71.6 minutes or more, over what the wire carries, is enforced by
    /// this client alone (the server sees none).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// The timeout set with [`Request::set_timeout`].
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// When `true`, a call that finds the server's receive ring full fails at
    /// once with `ResourceExhausted` instead of waiting for ring space.
    pub fn set_fail_fast(&mut self, fail_fast: bool) {
        self.fail_fast = fail_fast;
    }

    /// Whether this call fails rather than waits on a full ring.
    pub fn fail_fast(&self) -> bool {
        self.fail_fast
    }

    /// When `true`, a call or stream made while its channel has no
    /// connection up waits for one (until its deadline) instead of failing at once
    /// with `Unavailable`: gRPC's wait-for-ready. Unset, the channel's
    /// [`ChannelBuilder::wait_for_ready`](crate::ChannelBuilder::wait_for_ready)
    /// decides.
    pub fn set_wait_for_ready(&mut self, wait: bool) {
        self.wait_for_ready = Some(wait);
    }

    /// Whether this call waits for a connection, if set.
    pub fn wait_for_ready(&self) -> Option<bool> {
        self.wait_for_ready
    }

    /// The instant by which the caller stops waiting: on the server, from
    /// the timeout the caller set; on a client, as set with
    /// [`Request::set_deadline`].
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Makes the call fail with `DeadlineExceeded` at `deadline` (and the
    /// server see what remains of it), or at the timeout if that comes
    /// first. A deadline already past fails the call at once.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
    }

    /// A request for a call this handler makes on behalf of its own: it
    /// carries this call's deadline, so the child call gets only the
    /// budget that remains, and its W3C trace context, so the trace goes on.
    ///
    /// ```ignore
    /// async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetReply>, Status> {
    ///     let blob = self.store.fetch(request.child(FetchRequest { key: .. })).await?;
    ///     ..
    /// }
    /// ```
    pub fn child<U>(&self, message: U) -> Request<U> {
        let mut child = Request::new(message);
        child.deadline = self.deadline;
        // The trace goes on (see `rpc_core::observe`).
        if let Some(trace) = self.metadata.get(crate::observe::TRACEPARENT) {
            let _ = child.metadata.insert(crate::observe::TRACEPARENT, trace);
        }
        child
    }

    /// The time the caller allows: the smaller of the timeout and what
    /// remains until the deadline.
    pub(crate) fn budget(&self, default: Option<Duration>) -> Option<Duration> {
        let timeout = self.timeout.or(default);
        let remaining = self
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()));
        match (timeout, remaining) {
            (Some(t), Some(r)) => Some(t.min(r)),
            (t, r) => t.or(r),
        }
    }

    /// On the server: whether the caller cancelled the call (it dropped it,
    /// or its deadline passed) or went away. A handler that runs long in
    /// synchronous code (on the blocking pool) checks it between steps. An
    /// async handler is dropped at its next `.await` after a cancel unless
    /// it watches for it, so a loop that checks this only between awaits
    /// never sees `true`: race the work against [`Request::cancelled`]
    /// instead. A handler this told of a cancel ends its call itself: the
    /// server no longer drops its future.
    pub fn is_cancelled(&self) -> bool {
        self.signal.as_ref().is_some_and(|s| s.tell())
    }

    /// On the server: completes once the caller cancels the call or goes
    /// away (never, for a call that cannot be cancelled). While a handler
    /// holds this future, and once it has completed, the handler ends its
    /// call itself on a cancel (the server does not drop its future), so it
    /// can clean up, awaiting what it must. Race it against the handler's
    /// work:
    ///
    /// ```ignore
    /// tokio::select! {
    ///     reply = work() => reply,
    ///     () = request.cancelled() => Err(Status::cancelled("caller gave up")),
    /// }
    /// ```
    pub fn cancelled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        Cancelled::new(self.signal.clone())
    }

    /// Replaces the message, keeping metadata and options.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Request<U> {
        Request {
            message: f(self.message),
            metadata: self.metadata,
            timeout: self.timeout,
            fail_fast: self.fail_fast,
            wait_for_ready: self.wait_for_ready,
            deadline: self.deadline,
            signal: self.signal,
            peer: self.peer,
            encoding: self.encoding,
        }
    }

    /// On the server: who called, with the fabric and the identity the
    /// server's authenticator admitted them under (see
    /// `ServerBuilder::authenticator`). `None` on the client.
    pub fn peer(&self) -> Option<&Peer> {
        self.peer.as_deref()
    }

    /// On the server: the encoding the request's message arrived
    /// compressed in; `None` if it came as it is (or the call is a stream,
    /// whose messages say it each: [`crate::Streaming::message_encoding`]).
    pub fn message_encoding(&self) -> Option<Encoding> {
        self.encoding
    }

    pub(crate) fn with_encoding(mut self, encoding: Option<Encoding>) -> Request<T> {
        self.encoding = encoding;
        self
    }

    pub(crate) fn from_wire(
        message: T,
        metadata: Metadata,
        deadline: Option<Instant>,
        signal: Option<Arc<Signal>>,
        peer: Option<Arc<Peer>>,
    ) -> Request<T> {
        Request {
            message,
            metadata,
            timeout: None,
            fail_fast: false,
            wait_for_ready: None,
            deadline,
            signal,
            peer,
            encoding: None,
        }
    }
}

/// Converts a message, or a request, into a [`Request`]; generated client
/// methods take `impl IntoRequest<M>` so callers may pass either.
pub trait IntoRequest<T> {
    /// Does the conversion.
    fn into_request(self) -> Request<T>;
}

impl<T> IntoRequest<T> for Request<T> {
    fn into_request(self) -> Request<T> {
        self
    }
}

impl<T: prost::Message> IntoRequest<T> for T {
    fn into_request(self) -> Request<T> {
        Request::new(self)
    }
}

/// A response: the message and its metadata.
///
/// For a streaming response, the metadata go before the first message
/// (its initial metadata), and [`Trailers`] set while the stream runs go
/// with its final status.
#[derive(Debug, Clone)]
pub struct Response<T> {
    message: T,
    metadata: Metadata,
    trailers: Option<Trailers>,
    /// On the server: how this response's messages leave, over the
    /// service's setting.
    compression: Option<CompressionSwitch>,
    /// On the client: the encoding the message arrived compressed in.
    encoding: Option<Encoding>,
}

impl<T> Response<T> {
    /// Wraps a message with empty metadata.
    pub fn new(message: T) -> Response<T> {
        Response {
            message,
            metadata: Metadata::new(),
            trailers: None,
            compression: None,
            encoding: None,
        }
    }

    /// On the server: sends this response's message compressed in
    /// `encoding` (`None`: as it is), whatever the service's setting, if
    /// the caller accepts that encoding (otherwise as it is). For a
    /// stream, every message; [`Response::with_compression_switch`] lets
    /// the stream choose message by message.
    pub fn send_compressed(self, encoding: Option<Encoding>) -> Response<T> {
        self.with_compression_switch(CompressionSwitch::new(encoding))
    }

    /// On the server: the messages of this response leave in the encoding
    /// `switch` holds as each is encoded, so a response stream that sets it
    /// before yielding a message decides how that message travels.
    ///
    /// ```
    /// use rpc_core::{CompressionSwitch, Encoding, Response};
    /// let switch = CompressionSwitch::new(Some(Encoding::Gzip));
    /// let each = switch.clone();
    /// let stream = futures::stream::iter([true, false]).map(move |compress| {
    ///     each.set(compress.then_some(Encoding::Gzip));
    ///     Ok::<_, rpc_core::Status>(vec![0u8; 1000])
    /// });
    /// # use futures::StreamExt;
    /// let response = Response::new(stream).with_compression_switch(switch);
    /// # drop(response);
    /// ```
    pub fn with_compression_switch(mut self, switch: CompressionSwitch) -> Response<T> {
        self.compression = Some(switch);
        self
    }

    /// The switch set with [`Response::send_compressed`] or
    /// [`Response::with_compression_switch`].
    pub(crate) fn compression_switch(&self) -> Option<&CompressionSwitch> {
        self.compression.as_ref()
    }

    /// On the client: the encoding the response's message arrived
    /// compressed in; `None` if it came as it is.
    pub fn message_encoding(&self) -> Option<Encoding> {
        self.encoding
    }

    pub(crate) fn with_encoding(mut self, encoding: Option<Encoding>) -> Response<T> {
        self.encoding = encoding;
        self
    }

    /// Sends what `trailers` holds when the call ends, with its final
    /// status (success or error): trailing metadata a streaming handler
    /// sets while its stream runs, such as a count or a checksum of what
    /// it sent. The client reads them with
    /// [`Streaming::trailers`](crate::Streaming::trailers) (or, on error,
    /// from the `Status`). On a unary response they go with the message.
    ///
    /// ```
    /// use rpc_core::{Response, Trailers};
    /// let trailers = Trailers::new();
    /// let handle = trailers.clone();
    /// let stream = futures::stream::iter((0..3).map(move |i| {
    ///     handle.insert("x-sent", (i + 1).to_string()).unwrap();
    ///     Ok::<_, rpc_core::Status>(i)
    /// }));
    /// let response = Response::new(stream).with_trailers(trailers);
    /// # drop(response);
    /// ```
    pub fn with_trailers(mut self, trailers: Trailers) -> Response<T> {
        self.trailers = Some(trailers);
        self
    }

    /// The trailers set with [`Response::with_trailers`], taken out (the
    /// server sends them at the call's end).
    pub(crate) fn take_trailers(&mut self) -> Option<Trailers> {
        self.trailers.take()
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Unwraps the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Splits into metadata and message.
    pub fn into_parts(self) -> (Metadata, T) {
        (self.metadata, self.message)
    }

    /// Builds from metadata and message.
    pub fn from_parts(metadata: Metadata, message: T) -> Response<T> {
        Response {
            message,
            metadata,
            trailers: None,
            compression: None,
            encoding: None,
        }
    }

    /// Maps the message, keeping the metadata and the trailers: wraps a
    /// response stream, say.
    ///
    /// ```
    /// use rpc_core::{BoxStream, Response};
    /// let response = Response::new(futures::stream::iter([Ok(1), Ok(2)]));
    /// let boxed: Response<BoxStream<i32>> = response.map(|s| Box::pin(s) as BoxStream<i32>);
    /// # drop(boxed);
    /// ```
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Response<U> {
        Response {
            message: f(self.message),
            metadata: self.metadata,
            trailers: self.trailers,
            compression: self.compression,
            encoding: self.encoding,
        }
    }
}

/// Trailing metadata of a response, set by a handler while its call runs
/// and sent with the call's final status (see [`Response::with_trailers`]).
/// A handle: clones share the same metadata, so a response stream can fill
/// them in as it goes.
#[derive(Debug, Clone, Default)]
pub struct Trailers {
    inner: std::sync::Arc<std::sync::Mutex<Metadata>>,
}

impl Trailers {
    /// Empty trailers.
    pub fn new() -> Trailers {
        Trailers::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Metadata> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets a text value, replacing any earlier value of the key (text as
    /// [`Metadata::insert`] takes it).
    pub fn insert(
        &self,
        key: &str,
        value: impl Into<String>,
    ) -> Result<(), crate::InvalidMetadata> {
        self.lock().insert(key, value)
    }

    /// Sets a binary value, replacing any earlier value of the key.
    pub fn insert_bin(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), crate::InvalidMetadata> {
        self.lock().insert_bin(key, value)
    }

    /// What the trailers hold now.
    pub fn get(&self) -> Metadata {
        self.lock().clone()
    }

    /// Sets every entry of `metadata`, replacing earlier values of its keys.
    #[cfg(feature = "grpc")]
    pub(crate) fn insert_all(&self, metadata: &Metadata) {
        let mut ours = self.lock();
        for (key, value) in metadata.iter() {
            // Keys were checked when `metadata` took them.
            let _ = ours.insert_bin(key, value);
        }
    }

    /// Adds what the trailers hold to `metadata`; keys already in
    /// `metadata` keep their value there.
    pub(crate) fn merge_into(&self, metadata: &mut Metadata) {
        for (key, value) in self.lock().iter() {
            if metadata.get_bin(key).is_none() {
                // Keys were checked when inserted.
                let _ = metadata.insert_bin(key, value);
            }
        }
    }
}

/// [`Request::cancelled`]: counted among the signal's watchers while it
/// lives.
struct Cancelled(Option<Arc<Signal>>);

impl Cancelled {
    fn new(signal: Option<Arc<Signal>>) -> Cancelled {
        if let Some(s) = &signal {
            s.watch();
        }
        Cancelled(signal)
    }
}

impl std::future::Future for Cancelled {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        match &self.0 {
            Some(s) => {
                let polled = s.poll_cancelled(cx);
                if polled.is_ready() {
                    s.tell();
                }
                polled
            }
            None => std::task::Poll::Pending,
        }
    }
}

impl Drop for Cancelled {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            s.unwatch();
        }
    }
}
