//! The health service's server side: the statuses a server reports
//! ([`HealthReporter`]), and [`HealthServer`], which answers checks and
//! streams each change to watchers.

use super::{
    CHECK, DESCRIPTOR, FILE_DESCRIPTOR_SET, HealthCheckRequest, HealthCheckResponse, ServingStatus,
    WATCH,
};
use crate::descriptor::ServiceDescriptor;
use crate::{Request, Response, ServerCall, Service, Status};
use futures_core::Stream;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

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
