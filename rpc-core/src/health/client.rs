//! The health service's client side: [`HealthClient`], checks and
//! watches of any server's health service.

use super::{CHECK, HealthCheckRequest, HealthCheckResponse, WATCH};
use crate::{Channel, Request, Streaming, UnaryCall};

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
