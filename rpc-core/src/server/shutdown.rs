//! How a server stops: [`ServerHandle`], the running server's handle, and
//! its graceful shutdown: stop accepting, refuse new calls and tell the
//! services, let the calls under way finish and their replies reach the
//! peer, then close the connections and stop the threads.

use super::role::ServerRole;
use super::start::ServerShared;
use crate::dispatch::{Conn, Endpoint};
use crate::fabric::{Fabric, Listener};
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

pub(super) trait Stop: Send {
    fn stop(&mut self, grace: Duration);
}

pub(super) struct ServerStopper<F: Fabric> {
    pub(super) endpoints: Arc<Vec<Arc<Endpoint<F, ServerRole>>>>,
    pub(super) shared: Arc<ServerShared>,
    pub(super) listener: Arc<F::Listener>,
    pub(super) acceptor: Option<JoinHandle<()>>,
    pub(super) dispatchers: Vec<JoinHandle<()>>,
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

/// A running server. [`ServerHandle::shutdown`] stops it gracefully; dropping
/// the handle does the same.
#[must_use = "dropping the ServerHandle stops the server (gracefully, blocking the thread up to 10 s): keep it for as long as it serves"]
pub struct ServerHandle {
    pub(super) local_url: String,
    /// Where the gRPC face listens, if the server has one.
    pub(super) grpc_addr: Option<std::net::SocketAddr>,
    /// What the gRPC face starts its calls on.
    #[cfg(feature = "grpc")]
    pub(super) shared: Option<Arc<ServerShared>>,
    pub(super) stopper: Option<Box<dyn Stop>>,
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

impl ServerShared {
    /// Refuses new calls from now on and tells each service, once, that
    /// the server is shutting down
    /// ([`Service::shutting_down`](super::Service::shutting_down)).
    pub(super) fn begin_shutdown(&self) {
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
