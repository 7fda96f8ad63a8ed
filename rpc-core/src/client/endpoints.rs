//! Where a channel's endpoints come from, and whether they serve: a
//! resolver asked again on a period ([`Resolver`], [`Dns`]), and health
//! checks with the standard health service.
//!
//! Both run on the process's reconnecting thread (see `reconnect`), each
//! lookup or check on a short-lived thread of its own, so that a slow DNS
//! server or a server that does not answer never delays a call.

use super::connection::{Connection, Settings};
use super::targets::Target;
use super::{Channel, Handle, reconnect};
use crate::fabric::{FabricUrl, Scheme};
use crate::health::{CHECK, HealthCheckRequest, HealthCheckResponse, ServingStatus};
use crate::{Code, Request, Status};
use arc_swap::ArcSwap;
use std::net::ToSocketAddrs;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How often a resolver is asked again, by default.
pub(crate) const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// How often the connections of dropped endpoints are looked at, until
/// their calls have finished.
const DRAIN_CHECK: Duration = Duration::from_millis(100);

/// How often an endpoint is health-checked, by default.
pub(crate) const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Names the endpoints of a channel: asked when the channel connects and
/// then every [`ChannelBuilder::resolve_interval`](super::ChannelBuilder::resolve_interval)
/// (see [`Channel::resolve`]). Any `Fn() -> Result<Vec<String>, Status>`
/// is one, for endpoints from a service registry; [`Dns`] looks up a host
/// name.
pub trait Resolver: Send + Sync + 'static {
    /// The URLs of the endpoints now (`tcp://10.0.0.7:7471`, ...). An
    /// error, or no URL at all, leaves the channel's endpoints as they are.
    fn resolve(&self) -> Result<Vec<String>, Status>;

    /// What the channel is called in messages and logs.
    fn name(&self) -> String {
        "resolved endpoints".to_owned()
    }

    /// The name TLS certificates must carry, when the URLs hold addresses
    /// rather than the host name the certificates name.
    fn server_name(&self) -> Option<&str> {
        None
    }
}

impl<F> Resolver for F
where
    F: Fn() -> Result<Vec<String>, Status> + Send + Sync + 'static,
{
    fn resolve(&self) -> Result<Vec<String>, Status> {
        self()
    }
}

/// Every address a host name resolves to (through the system's resolver,
/// `getaddrinfo`), as endpoints of the URL's fabric and port.
#[derive(Debug, Clone)]
pub struct Dns {
    url: FabricUrl,
}

impl Dns {
    /// A resolver for `url`'s host (`tcp://kv.internal:7471`,
    /// `rdma://kv.internal:7471`). Fails on a malformed URL or a `mem://`
    /// one (it names no host).
    pub fn new(url: &str) -> Result<Dns, Status> {
        let url = FabricUrl::parse(url)?;
        if url.scheme == Scheme::Mem {
            return Err(Status::invalid_argument(
                "a mem:// URL names no host to resolve",
            ));
        }
        Ok(Dns { url })
    }
}

impl Resolver for Dns {
    fn resolve(&self) -> Result<Vec<String>, Status> {
        let addrs = (self.url.host.as_str(), self.url.port)
            .to_socket_addrs()
            .map_err(|e| Status::unavailable(format!("cannot resolve {}: {e}", self.url.host)))?;
        let mut urls: Vec<String> = Vec::new();
        for addr in addrs {
            let url = FabricUrl {
                host: addr.ip().to_string(),
                ..self.url.clone()
            }
            .to_string();
            if !urls.contains(&url) {
                urls.push(url);
            }
        }
        Ok(urls)
    }

    fn name(&self) -> String {
        self.url.to_string()
    }

    fn server_name(&self) -> Option<&str> {
        // An address in the URL is what the certificate must name.
        match self.url.host.parse::<std::net::IpAddr>() {
            Ok(_) => None,
            Err(_) => Some(&self.url.host),
        }
    }
}

/// A channel's resolver and what it last said.
pub(crate) struct Resolving {
    resolver: Arc<dyn Resolver>,
    interval: Duration,
    last_error: Mutex<Option<Status>>,
}

impl Resolving {
    pub(crate) fn new(resolver: Arc<dyn Resolver>, interval: Duration) -> Resolving {
        Resolving {
            resolver,
            interval,
            last_error: Mutex::new(None),
        }
    }

    pub(crate) fn name(&self) -> String {
        self.resolver.name()
    }

    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Why the last lookup failed, if it did.
    pub(crate) fn last_error(&self) -> Option<String> {
        let last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref().map(|s| s.message().to_owned())
    }

    fn set_error(&self, error: Option<Status>) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = error;
    }
}

/// Health checks of a channel's endpoints.
#[derive(Debug, Clone)]
pub(crate) struct HealthCheck {
    /// The service asked about (`""`: the server).
    pub(crate) service: String,
    pub(crate) interval: Duration,
}

impl Handle {
    /// Asks the resolver now and makes its answer the channel's
    /// endpoints, connecting new ones unless `connect_new` is false (the
    /// caller connects them); returns the lookup's error, keeping the
    /// endpoints.
    pub(super) fn resolve_now(self: &Arc<Self>, connect_new: bool) -> Result<(), Status> {
        let Some(resolving) = &self.resolver else {
            return Ok(());
        };
        let answer = resolving.resolver.resolve().and_then(|urls| {
            if urls.is_empty() {
                return Err(Status::unavailable(format!(
                    "{} names no endpoint",
                    resolving.name()
                )));
            }
            urls.iter()
                .map(|u| FabricUrl::parse(u).map_err(Status::from))
                .collect::<Result<Vec<_>, _>>()
        });
        let urls = match answer {
            Ok(urls) => urls,
            Err(status) => {
                tracing::warn!(resolver = %resolving.name(), %status, "resolving failed; keeping the endpoints");
                resolving.set_error(Some(status.clone()));
                return Err(status);
            }
        };
        resolving.set_error(None);
        self.set_endpoints(urls, connect_new);
        Ok(())
    }

    /// Makes `urls` the channel's endpoints: keeps those it has, connects
    /// the new ones (here, or not at all when `connect_new` is false: the
    /// caller will) and closes the ones gone once their calls finish.
    fn set_endpoints(self: &Arc<Self>, urls: Vec<FabricUrl>, connect_new: bool) {
        let old = self.targets.load_full();
        let mut added = Vec::new();
        let targets: Vec<Arc<Target>> = urls
            .into_iter()
            .map(|url| match old.iter().find(|t| t.url == url) {
                Some(kept) => kept.clone(),
                None => {
                    let target = Target::new(url, None);
                    added.push(target.clone());
                    target
                }
            })
            .collect();
        let removed: Vec<_> = old
            .iter()
            .filter(|t| !targets.iter().any(|n| Arc::ptr_eq(n, t)))
            .cloned()
            .collect();
        if added.is_empty() && removed.is_empty() {
            return;
        }
        tracing::info!(
            resolver = %self.url,
            added = ?added.iter().map(|t| t.url.to_string()).collect::<Vec<_>>(),
            removed = ?removed.iter().map(|t| t.url.to_string()).collect::<Vec<_>>(),
            "endpoints changed"
        );
        if connect_new {
            // Make before break: new endpoints are connected (on this
            // thread, the resolver's own) before those gone stop taking
            // calls. One that fails is retried as any other.
            for target in &added {
                match target.open(&self.settings) {
                    Ok(conn) => self.install(target, conn),
                    Err(status) => self.failed(target, status),
                }
            }
        }
        self.targets.store(Arc::new(targets));
        let mut draining = Vec::new();
        for target in &removed {
            target.removed.store(true, Ordering::Relaxed);
            // Its calls in flight finish before it closes.
            if let Some(conn) = target.current.swap(None) {
                draining.push(conn);
            }
        }
        if !draining.is_empty() {
            self.draining
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(draining);
            Handle::schedule_drain(self, Instant::now());
        }
    }

    /// Asks the resolver at `at`, and again every interval after.
    pub(super) fn schedule_resolve(this: &Arc<Self>, at: Instant) {
        let weak = Arc::downgrade(this);
        reconnect::schedule(at, move || {
            let Some(handle) = weak.upgrade() else {
                return;
            };
            let _ = handle.resolve_now(true);
            let interval = handle
                .resolver
                .as_ref()
                .map_or(DEFAULT_RESOLVE_INTERVAL, Resolving::interval);
            Handle::schedule_resolve(&handle, Instant::now() + interval);
        });
    }

    /// Closes the draining connections whose calls have finished, at `at`
    /// and then every [`DRAIN_CHECK`] until none is left.
    fn schedule_drain(this: &Arc<Self>, at: Instant) {
        let weak = Arc::downgrade(this);
        reconnect::schedule(at, move || {
            let Some(handle) = weak.upgrade() else {
                return;
            };
            let left = {
                let mut draining = handle.draining.lock().unwrap_or_else(|e| e.into_inner());
                draining.retain(|c| c.is_alive() && c.outstanding.load(Ordering::Relaxed) > 0);
                draining.len()
            };
            if left > 0 {
                Handle::schedule_drain(&handle, Instant::now() + DRAIN_CHECK);
            }
        });
    }

    /// Checks `conn`, `target`'s new connection, at `at` and then every
    /// interval, for as long as it is the target's connection.
    pub(super) fn schedule_health_check(
        this: &Arc<Self>,
        target: &Arc<Target>,
        conn: &Arc<Connection>,
        at: Instant,
    ) {
        let (handle, target, conn) = (
            Arc::downgrade(this),
            Arc::downgrade(target),
            Arc::downgrade(conn),
        );
        reconnect::schedule(at, move || Handle::check_health(handle, target, conn));
    }

    fn check_health(handle: Weak<Handle>, target: Weak<Target>, conn: Weak<Connection>) {
        let (Some(h), Some(target), Some(conn)) =
            (handle.upgrade(), target.upgrade(), conn.upgrade())
        else {
            return;
        };
        let Some(check) = h.health.clone() else {
            return;
        };
        let current = target.current.load();
        if target.removed.load(Ordering::Relaxed)
            || !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn))
        {
            // Replaced or gone: a new connection has checks of its own.
            return;
        }
        drop(current);
        let mut request = Request::new(HealthCheckRequest {
            service: check.service.clone(),
        });
        request.set_timeout(check.interval);
        let pinned = h.pinned(conn.clone());
        let answer = pinned
            .unary::<_, HealthCheckResponse>(CHECK, request)
            .wait();
        let serving = match &answer {
            Ok(r) => r.get_ref().status == ServingStatus::Serving as i32,
            // A server without the health service serves whatever it has.
            Err(s) if s.code() == Code::Unimplemented => true,
            // The connection failed: reconnecting deals with it.
            Err(s) if s.code() == Code::Unavailable && !conn.is_alive() => return,
            Err(_) => false,
        };
        let was = target.serving.swap(serving, Ordering::Relaxed);
        {
            let mut st = target.lock();
            st.health = match &answer {
                Ok(r) => Some(format!(
                    "health check of {:?}: {:?}",
                    check.service,
                    ServingStatus::try_from(r.get_ref().status).unwrap_or(ServingStatus::Unknown)
                )),
                Err(s) => Some(format!(
                    "health check of {:?}: {:?}: {}",
                    check.service,
                    s.code(),
                    s.message()
                )),
            };
        }
        if was != serving {
            let url = &target.url;
            if serving {
                tracing::info!(%url, "endpoint serving again");
                h.ready.notify();
            } else {
                let why = h.not_serving_reason(&target);
                tracing::warn!(%url, %why, "endpoint not serving: no calls until it is");
            }
        }
        if matches!(&answer, Err(s) if s.code() == Code::Unimplemented) {
            tracing::debug!(url = %target.url, "no health service: not checking it");
            return;
        }
        let next = Instant::now() + check.interval;
        Handle::schedule_health_check(&h, &target, &conn, next);
    }

    /// Why `target` gets no calls, as its last health check said.
    pub(super) fn not_serving_reason(&self, target: &Target) -> String {
        let health = target.lock().health.clone();
        format!(
            "{} is not serving ({})",
            target.url,
            health.unwrap_or_else(|| "health check failed".to_owned())
        )
    }

    /// A channel over `conn` alone, with this channel's settings and
    /// interceptors, that never reconnects: for calls to that endpoint.
    fn pinned(&self, conn: Arc<Connection>) -> Channel {
        let target = Target::new(conn.url.clone(), None);
        target.current.store(Some(conn));
        Channel {
            inner: Arc::new(Handle {
                url: target.url.to_string(),
                single: Some(target.clone()),
                targets: ArcSwap::from_pointee(vec![target]),
                settings: Arc::new(Settings {
                    config: self.settings.config.clone(),
                    credential: self.settings.credential.clone(),
                    tls: self.settings.tls.clone(),
                    backoff: None,
                }),
                resolver: None,
                health: None,
                default_timeout: None,
                wait_for_ready: false,
                balance: self.balance,
                interceptors: self.interceptors.clone(),
                next: AtomicUsize::new(0),
                ready: Default::default(),
                draining: Mutex::default(),
            }),
            compression: crate::CompressionConfig::default(),
        }
    }
}
