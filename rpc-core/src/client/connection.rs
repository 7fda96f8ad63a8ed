//! One connection of a channel ([`Connection`]) and its client on a
//! dispatcher ([`Client`]): connecting, and registering and sending the
//! calls made on it.

use super::reconnect::Backoff;
use super::role::{Call, CallSlot, ClientRole, RawReply, Waiter, decode_reply, send_cancel};
#[cfg(feature = "verbs")]
use super::runtime::verbs_runtime;
use super::runtime::{ClientRuntime, soft_runtime};
use super::stream_limit::{StreamLimit, StreamPermit};
use crate::auth::Credential;
use crate::compression::{CompressionConfig, Outgoing};
use crate::descriptor::{MethodDescriptor, MethodKind};
use crate::dispatch::{Config, Conn, Endpoint, OutFrame, least_loaded};
use crate::fabric::soft::SoftFabric;
use crate::fabric::{Fabric, FabricUrl, LocalSetup, Scheme};
use crate::protocol::header::Header;
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::protocol::{CallId, FrameKind};
use crate::streaming::{Link, StreamCore};
use crate::{Metadata, Response, Status};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How connecting is done, for the first connection and every reconnection.
pub(super) struct Settings {
    pub(super) config: Config,
    pub(super) credential: Option<Arc<dyn Credential>>,
    pub(super) tls: Option<crate::fabric::ClientTls>,
    /// `None`: a failed connection stays failed.
    pub(super) backoff: Option<Backoff>,
}

/// One connection of a channel, shared by the calls made on it.
pub(super) struct Connection {
    /// Where it connected.
    pub(super) url: FabricUrl,
    client: ClientInner,
    /// How long a caller polls for its response before it sleeps, at least.
    spin: Duration,
    /// Calls and streams of this channel outstanding on it.
    pub(super) outstanding: AtomicUsize,
    /// How many streams it may have open at once, as its server said.
    pub(super) streams: Arc<StreamLimit>,
    /// A `grpc://` connection's TLS settings, as the gateway knows them.
    gateway_tls: Option<String>,
}

/// A connection's client, on the fabric its URL names.
enum ClientInner {
    Soft(Client<SoftFabric>),
    #[cfg(feature = "verbs")]
    Verbs(Client<crate::fabric::verbs::VerbsFabric>),
}

/// Runs `$body` with `$c` bound to the fabric-specific client.
macro_rules! with_client {
    ($inner:expr, $c:ident => $body:expr) => {
        match $inner {
            ClientInner::Soft($c) => $body,
            #[cfg(feature = "verbs")]
            ClientInner::Verbs($c) => $body,
        }
    };
}

/// One connection on one dispatcher of the client runtime.
struct Client<F: Fabric> {
    ep: Arc<Endpoint<F, ClientRole>>,
    conn: Arc<Conn<F>>,
}

impl<F: Fabric> Drop for Client<F> {
    fn drop(&mut self) {
        self.ep.role.unwatch(&self.conn);
        self.ep.close(&self.conn, "channel dropped");
    }
}

impl Connection {
    /// Connects to `url` as `settings` say, on the fabric its scheme names.
    pub(super) fn open(url: &FabricUrl, settings: &Settings) -> Result<Connection, Status> {
        let (config, credential, tls) = (
            &settings.config,
            settings.credential.clone(),
            settings.tls.clone(),
        );
        let client = match url.scheme {
            Scheme::Mem | Scheme::Tcp => ClientInner::Soft(Client::connect(
                soft_runtime()?,
                url,
                config,
                credential,
                tls,
            )?),
            #[cfg(feature = "verbs")]
            Scheme::Rdma => ClientInner::Verbs(Client::connect(
                &*verbs_runtime(url)?,
                url,
                config,
                credential,
                tls,
            )?),
            #[cfg(not(feature = "verbs"))]
            Scheme::Rdma => match crate::fabric::open_verbs(url)? {},
            // Through the process's gRPC gateway, an in-process server
            // that passes each call on with tonic (see `gateway_metadata`).
            #[cfg(feature = "grpc")]
            Scheme::Grpc => ClientInner::Soft(Client::connect(
                soft_runtime()?,
                &FabricUrl::parse(crate::grpc::gateway::gateway()?)?,
                config,
                None,
                None,
            )?),
            #[cfg(not(feature = "grpc"))]
            Scheme::Grpc => {
                return Err(Status::invalid_argument(
                    "grpc:// needs rpc-core's `grpc` feature",
                ));
            }
        };
        #[cfg(all(feature = "grpc", feature = "tls"))]
        let gateway_tls = match (url.scheme, &settings.tls) {
            (Scheme::Grpc, Some(tls)) => Some(crate::grpc::gateway::gateway_tls(&tls.source)),
            _ => None,
        };
        #[cfg(not(all(feature = "grpc", feature = "tls")))]
        let gateway_tls = None;
        let streams = StreamLimit::new(with_client!(&client, c => c.conn.peer_max_streams()));
        Ok(Connection {
            url: url.clone(),
            client,
            spin: config.spin,
            outstanding: AtomicUsize::new(0),
            streams,
            gateway_tls,
        })
    }

    /// For a `grpc://` connection (to the process's gRPC gateway),
    /// `metadata` with what the gateway needs to pass the call on: the
    /// server, the method's path and kind, and the encoding a stream's
    /// messages may be compressed in (`send`, the channel's); other
    /// connections' as is.
    pub(super) fn gateway_metadata<'a>(
        &self,
        method: &MethodDescriptor,
        metadata: &'a Metadata,
        send: Option<crate::Encoding>,
    ) -> std::borrow::Cow<'a, Metadata> {
        if self.url.scheme != Scheme::Grpc {
            return std::borrow::Cow::Borrowed(metadata);
        }
        let mut with = metadata.clone();
        let _ = with.insert(crate::conventions::GATEWAY_TARGET, self.url.socket_addr());
        let _ = with.insert(crate::conventions::GATEWAY_PATH, method.path);
        if let Some(tls) = &self.gateway_tls {
            let _ = with.insert(crate::conventions::GATEWAY_TLS, tls.as_str());
        }
        if let Some(encoding) = send {
            let _ = with.insert(crate::conventions::GATEWAY_ENCODING, encoding.as_str());
        }
        let _ = with.insert(
            crate::conventions::FALLBACK_KIND,
            crate::conventions::fallback_kind_name(method.kind),
        );
        std::borrow::Cow::Owned(with)
    }

    pub(super) fn is_alive(&self) -> bool {
        with_client!(&self.client, c => c.conn.is_alive())
    }

    /// Why the connection failed.
    pub(super) fn death(&self) -> String {
        with_client!(&self.client, c => c.conn.death()).unwrap_or_else(|| "closed".to_owned())
    }

    /// Calls `on_lost` once the connection fails (on a dispatcher thread:
    /// it must not block), or at once if it has failed already.
    pub(super) fn watch(&self, on_lost: Box<dyn FnOnce() + Send>) {
        with_client!(&self.client, c => c.ep.role.watch(&c.conn, on_lost));
    }

    /// Sends a unary request of `payload_len` bytes that `fill` encodes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        self: &Arc<Self>,
        method_id: u32,
        metadata: &Metadata,
        fail_fast: bool,
        timeout: Option<Duration>,
        flags: u16,
        payload_len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<Sent, Status> {
        // Requests issued back to back leave together, in writes of up to
        // half the calls in flight: fewer, larger writes (a syscall each on
        // tcp://, a doorbell and packets on rdma://), while two batches in
        // flight keep both ends working at once. A lone call leaves at once.
        let batch = self.outstanding.load(Ordering::Relaxed).div_ceil(2);
        let started = with_client!(&self.client, c => c.start(method_id, metadata, fail_fast, timeout, batch, flags, payload_len, fill))?;
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Ok(started)
    }

    /// A call on this connection ended (see `outstanding`).
    pub(super) fn ended(&self) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    pub(super) fn cancel(&self, id: CallId) {
        with_client!(&self.client, c => c.cancel(id))
    }

    /// Sends the requests staged on this connection.
    pub(super) fn uncork(&self) {
        with_client!(&self.client, c => c.conn.uncork())
    }

    /// Whether requests are staged on this connection.
    pub(super) fn is_corked(&self) -> bool {
        with_client!(&self.client, c => c.conn.is_corked())
    }

    /// Decodes a finished call's outcome and takes back what the call used:
    /// its slot and the buffer its response arrived in.
    pub(super) fn finish_call<T: prost::Message + Default>(
        &self,
        slot: Arc<CallSlot>,
        outcome: Result<RawReply, Status>,
    ) -> Result<Response<T>, Status> {
        self.ended();
        let mut buf = Default::default();
        let reply = decode_reply(outcome, |b| buf = b);
        with_client!(&self.client, c => {
            c.conn.recycle(buf);
            c.ep.role.release_slot(slot);
        });
        reply
    }

    /// Handles completions on this thread while `slot` waits, for a while.
    /// Polls for `slot`'s outcome on this thread for up to the spin
    /// budget, counted from `since` (when the request was sent, if the
    /// clock was read then) or from the first poll that finds nothing.
    pub(super) fn poll_for(&self, slot: &CallSlot, since: Option<Instant>) {
        let spin = self.spin;
        with_client!(&self.client, c => {
            c.ep.poll_until(spin, since, || slot.is_done(), || !c.ep.role.calls().is_empty());
        })
    }

    /// Turns the queue once on this thread if nobody else is; true if it did.
    pub(super) fn try_progress(&self, seen: &mut u64) -> bool {
        with_client!(&self.client, c => c.ep.try_progress(seen))
    }

    /// How long a caller keeps polling for a response before it sleeps.
    pub(super) fn spin_budget(&self) -> Duration {
        let spin = self.spin;
        with_client!(&self.client, c => c.ep.call_waits.budget(spin))
    }

    /// Notes how long a call waited for its response.
    pub(super) fn note_wait(&self, wait: Duration) {
        with_client!(&self.client, c => c.ep.call_waits.record(wait))
    }

    /// Makes sure someone handles completions while a call waits.
    pub(super) fn ensure_polled(&self) {
        with_client!(&self.client, c => c.ep.ensure_polled())
    }

    /// Opens a stream on this connection, in the place `permit` holds
    /// under its server's stream limit (see [`Client::start_stream`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_stream<Req: prost::Message>(
        &self,
        method: &MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
        permit: StreamPermit,
        compression: &CompressionConfig,
    ) -> Result<(CallId, Arc<StreamCore>), Status> {
        with_client!(&self.client, c => {
            c.start_stream(method, metadata, timeout, first, final_message, permit, compression)
        })
    }

    /// What a stream's handles send through.
    pub(super) fn link(&self) -> Arc<dyn Link> {
        with_client!(&self.client, c => c.conn.clone())
    }

    /// Responses dropped because they arrived after their call ended, or
    /// named no call of this connection.
    pub(super) fn stale_responses(&self) -> u64 {
        with_client!(&self.client, c => c.conn.stale_responses())
    }

    /// The completion queue and queue pair number under this connection,
    /// if it is `rdma://`.
    #[cfg(all(test, feature = "verbs"))]
    pub(super) fn verbs_queue(&self) -> Option<(crate::fabric::verbs::VerbsCq, u32)> {
        match &self.client {
            ClientInner::Verbs(c) => Some((c.ep.cq.clone(), c.conn.qp_num)),
            ClientInner::Soft(_) => None,
        }
    }
}

/// A unary request sent: the call's id and slot, and when it was sent if
/// the clock was read for its deadline.
pub(super) struct Sent {
    pub(super) id: CallId,
    pub(super) slot: Arc<CallSlot>,
    pub(super) at: Option<Instant>,
}

impl<F: Fabric> Client<F> {
    fn connect(
        rt: &ClientRuntime<F>,
        url: &FabricUrl,
        config: &Config,
        credential: Option<Arc<dyn Credential>>,
        tls: Option<crate::fabric::ClientTls>,
    ) -> Result<Client<F>, Status> {
        let ep = least_loaded(&rt.endpoints).clone();
        let ring = ep.fabric.register(config.ring_size::<F>(), true)?;
        let local = LocalSetup {
            ring: &ring,
            max_message: config.max_message as u32,
            max_streams: 0,
            timeout: config.connect_timeout,
            credential,
            tls,
        };
        let connected = ep.fabric.connect(url, local, &ep.cq)?;
        let conn = ep.add(connected, ring, config.max_message)?;
        // The client writes first: an empty credit doorbell tells the server
        // that our ring takes its writes (on rdma://, that our memory window
        // is bound), so that it may send of its own accord (heartbeats).
        if conn.post_fence().is_none() {
            let why = conn.death().unwrap_or_else(|| "send queue full".into());
            ep.close(&conn, &why);
            return Err(Status::unavailable(format!(
                "connection failed at once: {why}"
            )));
        }
        if let Some(every) = config.heartbeat {
            ep.start_heartbeat(&conn, every, false);
        }
        tracing::debug!(%url, qp_num = conn.qp_num, "connected");
        crate::observe::connection(crate::observe::Side::Client, 1.0);
        Ok(Client { ep, conn })
    }

    /// `Unavailable` once the connection has failed.
    fn ensure_alive(&self) -> Result<(), Status> {
        if self.conn.is_alive() {
            return Ok(());
        }
        Err(Status::unavailable(format!(
            "connection closed: {}",
            self.conn.death().unwrap_or_default()
        )))
    }

    /// Enters a call into the dispatcher's table, with its deadline if it
    /// has a timeout (and makes the dispatcher wake for it). Returns its id
    /// and, if the clock was read for the deadline, when that was.
    fn register(&self, waiter: Waiter, timeout: Option<Duration>) -> (CallId, Option<Instant>) {
        let now = timeout.map(|_| Instant::now());
        // A timeout too long for the clock is no deadline at all.
        let deadline = now.zip(timeout).and_then(|(now, t)| now.checked_add(t));
        let call = Call {
            waiter,
            qp_num: self.conn.qp_num,
        };
        let id = self.ep.role.calls().insert(call, deadline);
        if let Some(at) = deadline {
            self.ep.wake_by(at);
        }
        (id, now)
    }

    /// Sends a unary request of `payload_len` bytes that `fill` encodes;
    /// its write may wait for requests that follow until it carries `batch`
    /// of them (see `Conn::send_corked`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        method_id: u32,
        metadata: &Metadata,
        fail_fast: bool,
        timeout: Option<Duration>,
        batch: usize,
        flags: u16,
        payload_len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<Sent, Status> {
        self.ensure_alive()?;
        let slot = self.ep.role.take_slot();
        let (id, at) = self.register(Waiter::Unary(slot.clone()), timeout);
        let frame = OutFrame {
            kind: FrameKind::Request,
            flags,
            call_id: id,
            method_id,
            status: 0,
            timeout_us: crate::protocol::timeout_field(timeout),
            metadata: Some(metadata),
            payload_len,
        };
        let sent = self.conn.send_corked(&frame, fail_fast, batch, fill);
        match sent {
            Ok(true) => self.ep.corked(&self.conn),
            Ok(false) => {}
            Err(e) => {
                self.ep.role.calls().remove(id);
                return Err(e.into());
            }
        }
        Ok(Sent { id, slot, at })
    }

    /// Opens a stream: registers the call and sends its `Request` frame,
    /// with `first` as the request message of a server-streaming call.
    #[allow(clippy::too_many_arguments)]
    fn start_stream<Req: prost::Message>(
        &self,
        method: &MethodDescriptor,
        metadata: &Metadata,
        timeout: Option<Duration>,
        first: Option<&Req>,
        final_message: bool,
        permit: StreamPermit,
        compression: &CompressionConfig,
    ) -> Result<(CallId, Arc<StreamCore>), Status> {
        self.ensure_alive()?;
        // Only a client-streaming call's responses are not a stream.
        let core = StreamCore::new(DEFAULT_WINDOW, !final_message);
        let waiter = Waiter::Stream {
            core: core.clone(),
            final_message,
            _permit: permit,
        };
        let (id, _) = self.register(waiter, timeout);
        let out = first.map(|m| Outgoing::new(m, compression.send()));
        let frame = OutFrame {
            kind: FrameKind::Request,
            // The call's kind as this call is made (its descriptor could
            // say otherwise, if hand-built): requests streamed unless the
            // one request comes now, responses unless one answer ends it.
            flags: Header::kind_flags(MethodKind::of(first.is_none(), !final_message))
                | compression.request_flags(first.is_some()),
            call_id: id,
            method_id: method.id,
            status: 0,
            timeout_us: crate::protocol::timeout_field(timeout),
            metadata: Some(metadata),
            payload_len: out.as_ref().map_or(0, Outgoing::len),
        };
        let sent = self.conn.send(&frame, false, &mut |buf| {
            if let Some(out) = &out {
                out.write(buf)
            }
        });
        if let Err(e) = sent {
            // Its place on the connection goes outside the table's lock.
            let call = self.ep.role.calls().remove(id);
            drop(call);
            return Err(e.into());
        }
        Ok((id, core))
    }

    fn cancel(&self, id: CallId) {
        let call = self.ep.role.calls().remove(id);
        if let Some(call) = call {
            if let Waiter::Stream { core, .. } = &call.waiter {
                core.fail(Status::cancelled("the call was cancelled"));
            }
            send_cancel(&self.conn, id);
            // Only now may another stream take its place: the server
            // counts this one until the cancel arrives.
            drop(call);
        }
    }
}
