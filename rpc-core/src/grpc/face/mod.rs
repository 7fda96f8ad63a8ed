//! The gRPC face of a server ([`ServerBuilder::grpc`](crate::ServerBuilder::grpc)):
//! standard gRPC over HTTP/2 on a TCP address, beside the server's own
//! URL, over tonic's HTTP/2 server, for callers that speak gRPC (other languages,
//! grpcurl, load balancers, Kubernetes probes).
//!
//! Every gRPC call is started on the server's own routes as a dispatcher
//! starts a request, and its handler runs on the tokio worker that read
//! it, as tonic runs its handlers (see [`Local`]): the same handlers,
//! interceptors, blocking pool, deadlines (`grpc-timeout`), cancellation
//! (a reset HTTP/2 stream cancels the call), metadata and trailers,
//! status codes and streams of all four kinds, and the caller's address.
//! Messages pass as their encoded bytes: nothing is decoded twice. The
//! rdma:// and tcp:// paths do not change.
//!
//! Here: the face's listener, started and stopped with the server. The
//! gRPC side of its calls is in `service` (with `relay` for a caller's
//! request stream), their way into the server in `local`.

mod local;
mod relay;
mod service;

use super::runtime;
use crate::Status;
use crate::server::ServerShared;
use local::Local;
use service::Proxy;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The face's TLS settings: the server's own, for tonic.
#[cfg(feature = "tls")]
pub(crate) type FaceTls = tonic::transport::ServerTlsConfig;
/// Without TLS there are none.
#[cfg(not(feature = "tls"))]
pub(crate) type FaceTls = std::convert::Infallible;

/// The gRPC face of a running server: its listener's task, stopped with
/// the server.
pub(crate) struct GrpcFace {
    local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::sync::mpsc::Receiver<()>>,
    /// The runtime made for the face when the server was given none.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for GrpcFace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcFace")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl GrpcFace {
    /// Listens on `addr` (`host:port`; port 0 picks one) and serves gRPC,
    /// starting each call on `shared` (the server's routes, interceptors
    /// and calls in flight), on `handle`'s runtime or one of its own.
    pub(crate) fn start(
        addr: &str,
        shared: Arc<ServerShared>,
        handle: Option<tokio::runtime::Handle>,
        tls: Option<FaceTls>,
    ) -> Result<GrpcFace, Status> {
        let mut server =
            tonic::transport::Server::builder().max_concurrent_streams(shared.max_streams());
        #[cfg(feature = "tls")]
        if let Some(tls) = tls {
            server = server
                .tls_config(tls)
                .map_err(|e| Status::invalid_argument(format!("gRPC face: TLS: {e}")))?;
        }
        #[cfg(not(feature = "tls"))]
        let _: Option<FaceTls> = tls;
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| Status::unavailable(format!("gRPC face: cannot listen on {addr}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Status::internal(format!("gRPC face: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Status::internal(format!("gRPC face: {e}")))?;
        let (runtime, handle) = match handle {
            Some(h) => (None, h),
            None => {
                let rt = runtime("gRPC face")?;
                let h = rt.handle().clone();
                (Some(rt), h)
            }
        };
        let proxy = Proxy {
            local: Arc::new(Local {
                shared,
                registry: Arc::default(),
                next_id: AtomicU64::new(1),
            }),
        };
        let mut routes = tonic::service::Routes::default();
        let router = std::mem::take(routes.axum_router_mut()).fallback_service(proxy);
        let routes = tonic::service::Routes::from(router);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let listener = {
            let _in = handle.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|e| Status::internal(format!("gRPC face: {e}")))?
        };
        handle.spawn(async move {
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            let served = server
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "gRPC face stopped");
            }
            let _ = done_tx.send(());
        });
        tracing::info!(%local_addr, "serving gRPC");
        Ok(GrpcFace {
            local_addr,
            stop: Some(stop),
            done: Some(done),
            runtime,
        })
    }

    /// Where it listens.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets the calls under way end (up to `grace`), and
    /// stops.
    pub(crate) fn stop(&mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = done.recv_timeout(grace);
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for GrpcFace {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}
