//! The standard health service, `grpc.health.v1.Health`: `Check` and the
//! streaming `Watch`, with the package, method and message names of gRPC's
//! `health.proto`, so health checkers that speak it understand ours.
//!
//! ```no_run
//! # fn main() -> Result<(), rpc_core::Status> {
//! use rpc_core::health::{self, ServingStatus};
//! let (reporter, health) = health::service();
//! # struct Kv; impl rpc_core::Service for Kv { fn descriptor(&self) -> &'static rpc_core::server::ServiceDescriptor { unimplemented!() } fn call(&self, _: rpc_core::ServerCall) {} }
//! let server = rpc_core::Server::builder()
//!     .add_service(Kv)
//!     .add_service(health)
//!     .serve("tcp://0.0.0.0:7471")?;
//! reporter.set_status("kv.Kv", ServingStatus::Serving);
//! // ... and to drain traffic some time before a planned shutdown:
//! reporter.set_status("", ServingStatus::NotServing);
//! # Ok(()) }
//! ```
//!
//! The empty service name stands for the server as a whole; it is
//! `Serving` from the start. When the server shuts down
//! ([`ServerHandle::shutdown`](crate::ServerHandle::shutdown)), every
//! status becomes `NotServing` for good (later changes are ignored) and
//! every `Watch` stream ends, after saying `NotServing` if its service has
//! a status: watchers learn at once, and the shutdown does not wait for
//! them. A health service added to several servers does this when the
//! first of them shuts down.

use crate::codegen::{MethodDescriptor, MethodKind, ServiceDescriptor, method_id};
use crate::{Channel, Request, Response, ServerCall, Service, Status, Streaming, UnaryCall};
use futures_core::Stream;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct HealthCheckRequest {
    /// The service asked about (`package.Service`), or empty for the server.
    #[prost(string, tag = "1")]
    pub service: String,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct HealthCheckResponse {
    /// A [`ServingStatus`].
    #[prost(enumeration = "ServingStatus", tag = "1")]
    pub status: i32,
}

/// `grpc.health.v1.HealthCheckResponse.ServingStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ServingStatus {
    /// Not known.
    Unknown = 0,
    /// Serving.
    Serving = 1,
    /// Not serving (starting, draining, or failed).
    NotServing = 2,
    /// `Watch` only: the service is not known to this server.
    ServiceUnknown = 3,
}

static DESCRIPTOR: ServiceDescriptor = ServiceDescriptor {
    name: "grpc.health.v1.Health",
    methods: &[
        MethodDescriptor {
            name: "Check",
            path: "/grpc.health.v1.Health/Check",
            id: method_id("/grpc.health.v1.Health/Check"),
            kind: MethodKind::Unary,
        },
        MethodDescriptor {
            name: "Watch",
            path: "/grpc.health.v1.Health/Watch",
            id: method_id("/grpc.health.v1.Health/Watch"),
            kind: MethodKind::ServerStreaming,
        },
    ],
};
/// `grpc/health/v1/health.proto` (`rpc-core/proto`), encoded as a
/// `FileDescriptorSet`.
const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("health.fds.bin");

const CHECK: &MethodDescriptor = &DESCRIPTOR.methods[0];
const WATCH: &MethodDescriptor = &DESCRIPTOR.methods[1];

/// The statuses, and the watchers to tell when one changes.
#[derive(Default)]
struct Registry {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    statuses: HashMap<String, ServingStatus>,
    /// Bumped on every change: a watcher compares it with what it saw.
    version: u64,
    watchers: Vec<Waker>,
    /// The server is shutting down: every status is `NotServing` for
    /// good, and watches end once they have said so.
    shut_down: bool,
}

impl Registry {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn status(&self, service: &str) -> Option<ServingStatus> {
        self.state().statuses.get(service).copied()
    }

    /// Applies `change` to the state and, if it changed anything, tells
    /// the watchers.
    fn update(&self, change: impl FnOnce(&mut State) -> bool) {
        let watchers = {
            let mut st = self.state();
            if !change(&mut st) {
                return;
            }
            st.version += 1;
            std::mem::take(&mut st.watchers)
        };
        watchers.into_iter().for_each(Waker::wake);
    }

    /// Applies `change` to the statuses, unless the server is shutting
    /// down.
    fn change(&self, change: impl FnOnce(&mut HashMap<String, ServingStatus>) -> bool) {
        self.update(|st| !st.shut_down && change(&mut st.statuses));
    }

    /// The server is shutting down: every known service is `NotServing`
    /// from now on, and watches end after they say so.
    fn shut_down(&self) {
        self.update(|st| {
            if st.shut_down {
                return false;
            }
            st.statuses
                .values_mut()
                .for_each(|s| *s = ServingStatus::NotServing);
            st.shut_down = true;
            true
        });
    }
}

/// Sets the serving status the health service reports; clone it freely.
#[derive(Clone)]
pub struct HealthReporter {
    registry: Arc<Registry>,
}

impl std::fmt::Debug for HealthReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthReporter")
            .field("statuses", &self.registry.state().statuses)
            .finish()
    }
}

impl HealthReporter {
    /// Sets `service`'s status (`package.Service`, or `""` for the whole
    /// server); watchers hear of a change at once.
    pub fn set_status(&self, service: &str, status: ServingStatus) {
        self.registry
            .change(|statuses| statuses.insert(service.to_owned(), status) != Some(status));
    }

    /// Forgets `service`: checks fail with `NotFound`, watchers see
    /// `ServiceUnknown`.
    pub fn clear_status(&self, service: &str) {
        self.registry
            .change(|statuses| statuses.remove(service).is_some());
    }
}

/// The health service, to add to a server with `add_service`.
#[derive(Clone)]
pub struct HealthServer {
    registry: Arc<Registry>,
}

impl std::fmt::Debug for HealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthServer").finish_non_exhaustive()
    }
}

/// A health service and the reporter that sets what it says. The server
/// as a whole (`""`) starts `Serving`.
pub fn service() -> (HealthReporter, HealthServer) {
    let registry = Arc::new(Registry::default());
    let reporter = HealthReporter {
        registry: registry.clone(),
    };
    reporter.set_status("", ServingStatus::Serving);
    (reporter, HealthServer { registry })
}

impl Service for HealthServer {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &DESCRIPTOR
    }

    fn file_descriptor_set(&self) -> &'static [u8] {
        FILE_DESCRIPTOR_SET
    }

    fn shutting_down(&self) {
        self.registry.shut_down();
    }

    fn call(&self, call: ServerCall) {
        let registry = self.registry.clone();
        match call.method_id() {
            id if id == CHECK.id => call.unary(move |r: Request<HealthCheckRequest>| {
                let service = &r.get_ref().service;
                match registry.status(service) {
                    Some(status) => Ok(Response::new(HealthCheckResponse {
                        status: status as i32,
                    })),
                    None => Err(Status::not_found(format!("unknown service {service:?}"))),
                }
            }),
            id if id == WATCH.id => {
                call.server_streaming(move |r: Request<HealthCheckRequest>| async move {
                    Ok(Response::new(Watch {
                        registry,
                        service: r.into_inner().service,
                        seen: None,
                    }))
                })
            }
            _ => call.unimplemented(),
        }
    }
}

/// A `Watch` call's responses: the status now, then each change.
struct Watch {
    registry: Arc<Registry>,
    service: String,
    /// The version and status last sent.
    seen: Option<(u64, ServingStatus)>,
}

impl Stream for Watch {
    type Item = Result<HealthCheckResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let mut st = this.registry.state();
        let version = st.version;
        let shut_down = st.shut_down;
        if this.seen.is_some_and(|(v, _)| v == version) {
            if shut_down {
                return Poll::Ready(None);
            }
            if !st.watchers.iter().any(|w| w.will_wake(cx.waker())) {
                st.watchers.push(cx.waker().clone());
            }
            return Poll::Pending;
        }
        let status = st
            .statuses
            .get(&this.service)
            .copied()
            .unwrap_or(ServingStatus::ServiceUnknown);
        drop(st);
        let changed = this.seen.is_none_or(|(_, s)| s != status);
        this.seen = Some((version, status));
        if changed {
            Poll::Ready(Some(Ok(HealthCheckResponse {
                status: status as i32,
            })))
        } else if shut_down {
            Poll::Ready(None)
        } else {
            // Another service changed: look again (registers the waker).
            Pin::new(this).poll_next(cx)
        }
    }
}

/// A client of any server's health service.
#[derive(Debug, Clone)]
pub struct HealthClient {
    channel: Channel,
}

impl HealthClient {
    /// A client on `channel`.
    pub fn new(channel: Channel) -> HealthClient {
        HealthClient { channel }
    }

    /// Asks for `service`'s status now (`""`: the server's).
    pub fn check(&self, service: &str) -> UnaryCall<HealthCheckResponse> {
        self.channel.unary(
            CHECK,
            Request::new(HealthCheckRequest {
                service: service.to_owned(),
            }),
        )
    }

    /// Like [`HealthClient::check`], with the request's metadata and
    /// timeout.
    pub fn check_request(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> UnaryCall<HealthCheckResponse> {
        self.channel.unary(CHECK, request)
    }

    /// Streams `service`'s status: now, then each change.
    pub fn watch(&self, service: &str) -> Streaming<HealthCheckResponse> {
        self.channel.server_streaming(
            WATCH,
            Request::new(HealthCheckRequest {
                service: service.to_owned(),
            }),
        )
    }

    /// Like [`HealthClient::watch`], with the request's metadata and
    /// timeout.
    pub fn watch_request(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Streaming<HealthCheckResponse> {
        self.channel.server_streaming(WATCH, request)
    }
}
