//! How a call starts, on a dispatcher or on the gRPC face: [`ServerShared`]
//! (what they share: the method table, interceptors, blocking pool and
//! shutdown state) routes a request, runs the interceptors, checks the
//! call's kind, registers a call that later frames may name, and runs its
//! handler in place or hands it to the blocking pool.

use super::Service;
use super::call::{ServerCall, take_signal};
use super::registry::Registry;
use super::route::{Route, kind_name};
#[cfg(feature = "grpc")]
use super::task::ON_TOKIO;
use crate::blocking::BlockingPool;
use crate::conventions::fallback_kind;
use crate::descriptor::MethodKind;
use crate::executor::panic_message;
use crate::idmap::IdMap;
use crate::interceptor::Chain;
use crate::observe::CallObs;
use crate::protocol::CallId;
use crate::protocol::stream::DEFAULT_WINDOW;
use crate::streaming::{Link, StreamCore};
use crate::{Metadata, Status};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// What a server's dispatchers share: routes and shutdown state.
pub(crate) struct ServerShared {
    pub(super) routes: IdMap<Route>,
    /// See `ServerBuilder::fallback`.
    pub(super) fallback: Option<Arc<dyn Service>>,
    pub(super) interceptors: Chain,
    pub(super) pool: BlockingPool,
    pub(super) draining: AtomicBool,
    pub(super) inflight: Arc<AtomicUsize>,
    /// The largest message the server accepts (the gRPC face's limit).
    #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
    pub(super) max_message: usize,
    /// What the server's calls send compressed and accept (services may
    /// have their own: [`Route::compression`]).
    pub(super) compression: crate::CompressionConfig,
    /// Streams served at once per connection (see
    /// [`ServerBuilder::max_concurrent_streams`](super::ServerBuilder::max_concurrent_streams)).
    pub(super) max_streams: u32,
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
    /// The request frame's flags: the encoding its message is compressed
    /// in and those the caller accepts ([`crate::compression`]).
    pub(crate) flags: u16,
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
            flags,
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
            flags,
            compression: self.compression,
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
                        compression: self.compression,
                    };
                    &fallback
                }
                _ => return call.unimplemented(),
            },
        };
        call.compression = route.compression;
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

/// Calls a service, answering a call the service dropped after a panic.
fn call_service(service: &dyn Service, call: ServerCall) {
    let method_id = call.method_id;
    // A hand-written Service may panic outside ServerCall::unary; the call's
    // drop then answers it.
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| service.call(call))) {
        tracing::error!(method_id, panic = %panic_message(&*panic), "service panicked");
    }
}

#[cfg(feature = "grpc")]
impl ServerShared {
    /// The id, kind and compression settings of the method at `path`, if
    /// the server has it.
    pub(crate) fn method(&self, path: &str) -> Option<(u32, MethodKind, crate::CompressionConfig)> {
        let id = crate::descriptor::method_id(path);
        let route = self.routes.get(&id).filter(|r| r.path == path)?;
        Some((id, route.kind, route.compression))
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
