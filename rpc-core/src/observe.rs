//! Observability of calls: a `tracing` span per call on each side, W3C
//! trace context carried in metadata, and metrics through the `metrics`
//! facade (any exporter, such as Prometheus, installed by the application).
//!
//! **Spans.** `rpc.client` and `rpc.server`, at `DEBUG` (as tower-http's
//! trace layer: an application logging at `INFO` pays nothing for them),
//! with the fields
//! `rpc.method` (`/package.Service/Method`), `peer`, `trace_id` and, when
//! the call ends, `rpc.code` (`OK`, `UNAVAILABLE`, ...). A client whose span
//! is enabled (a subscriber takes `DEBUG` spans of `rpc_core`) sends the
//! W3C `traceparent` header: the trace id of the request's own
//! `traceparent` if it has one (set by the application, an interceptor, or
//! [`Request::child`](crate::Request::child) in a handler, which carries
//! the server call's), or a new one, with a new span id; a server reads it
//! into its span's `trace_id`, so one trace goes on across calls. With no
//! subscriber, nothing is added to the request and no clock is read.
//!
//! **Metrics** (labels `side` = `client` | `server`, `method`, and `code`
//! where it applies):
//!
//! | name | kind | what |
//! |---|---|---|
//! | `rpc_calls_started_total` | counter | calls and streams started |
//! | `rpc_calls_finished_total` | counter | calls and streams ended, by status code |
//! | `rpc_call_duration_seconds` | histogram | from start to end |
//! | `rpc_connections` | gauge | connections open (`side`) |
//! | `rpc_reconnects_total` | counter | connections a channel made again after a failure |
//! | `rpc_backpressure_total` | counter | sends that found the peer's ring full and queued |
//! | `rpc_bytes_sent_total` | counter | bytes of the frames sent (`side`): header, metadata and message, large messages read by the peer included |
//! | `rpc_bytes_received_total` | counter | the same, received |
//!
//! Metrics are off until [`enable_metrics`] is called (after installing a
//! recorder): off, a call pays one flag check for them.

use crate::auth::Peer;
use crate::{Code, Metadata};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// Which end of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Server => "server",
        }
    }
}

/// One call's span and metrics, from its start to its end.
pub(crate) struct CallObs {
    span: tracing::Span,
    method: &'static str,
    side: Side,
    /// When it started, if anyone records durations.
    started: Option<Instant>,
    finished: bool,
}

impl CallObs {
    /// The path of the call's method.
    pub(crate) fn method(&self) -> &'static str {
        self.method
    }

    /// A client call of `method` to `peer`: starts its span, and when the
    /// span is enabled, the `traceparent` the call must send (continuing
    /// the one in `metadata`, if any).
    pub(crate) fn client(
        method: &'static str,
        peer: &str,
        metadata: &Metadata,
    ) -> (CallObs, Option<String>) {
        let span = tracing::debug_span!(
            "rpc.client",
            rpc.method = method,
            peer = peer,
            trace_id = tracing::field::Empty,
            rpc.code = tracing::field::Empty,
        );
        let header = (!span.is_disabled()).then(|| {
            let context = TraceContext::child_of(metadata.get(TRACEPARENT));
            span.record("trace_id", context.trace_id_hex().as_str());
            context.header()
        });
        (CallObs::start(span, method, Side::Client), header)
    }

    /// A server call of `method` from `peer`, its span continuing the
    /// caller's trace.
    pub(crate) fn server(method: &'static str, peer: &Peer, metadata: &Metadata) -> CallObs {
        let span = tracing::debug_span!(
            "rpc.server",
            rpc.method = method,
            peer = peer.addr.as_str(),
            trace_id = tracing::field::Empty,
            rpc.code = tracing::field::Empty,
        );
        if !span.is_disabled() {
            if let Some(context) = metadata.get(TRACEPARENT).and_then(TraceContext::parse) {
                span.record("trace_id", context.trace_id_hex().as_str());
            }
        }
        CallObs::start(span, method, Side::Server)
    }

    fn start(span: tracing::Span, method: &'static str, side: Side) -> CallObs {
        let metrics = metrics_on();
        if metrics {
            metrics::counter!("rpc_calls_started_total", "side" => side.label(), "method" => method)
                .increment(1);
        }
        // The clock only for whoever looks: a span or the metrics.
        let started = (metrics || !span.is_disabled()).then(Instant::now);
        CallObs {
            span,
            method,
            side,
            started,
            finished: false,
        }
    }

    /// The call's span, to enter while working on the call.
    pub(crate) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The call ended with `code` (the first end counts).
    pub(crate) fn finish(&mut self, code: Code) {
        if self.finished {
            return;
        }
        self.finished = true;
        let name = code_name(code);
        self.span.record("rpc.code", name);
        if metrics_on() {
            let labels = [
                ("side", self.side.label()),
                ("method", self.method),
                ("code", name),
            ];
            metrics::counter!("rpc_calls_finished_total", &labels).increment(1);
            if let Some(t) = self.started {
                metrics::histogram!(
                    "rpc_call_duration_seconds",
                    "side" => self.side.label(),
                    "method" => self.method
                )
                .record(t.elapsed().as_secs_f64());
            }
        }
        if !self.span.is_disabled() {
            let _in = self.span.enter();
            tracing::debug!(rpc.code = name, "call finished");
        }
    }
}

impl Drop for CallObs {
    /// A call dropped without an end: the caller let go of it.
    fn drop(&mut self) {
        self.finish(Code::Cancelled);
    }
}

static METRICS: AtomicBool = AtomicBool::new(false);

/// Turns on the metrics of this module for the process: call it once the
/// application has installed its `metrics` recorder (e.g. a Prometheus
/// exporter). Off by default, so that a process without a recorder pays
/// nothing per call (the facade's label sets allocate).
pub fn enable_metrics() {
    METRICS.store(true, Ordering::Relaxed);
}

/// Whether [`enable_metrics`] was called.
fn metrics_on() -> bool {
    METRICS.load(Ordering::Relaxed)
}

/// Counts a connection opened (`+1`) or closed (`-1`) on `side`.
pub(crate) fn connection(side: Side, delta: f64) {
    if !metrics_on() {
        return;
    }
    metrics::gauge!("rpc_connections", "side" => side.label()).increment(delta);
}

/// Counts a reconnection of a channel.
pub(crate) fn reconnected() {
    if !metrics_on() {
        return;
    }
    metrics::counter!("rpc_reconnects_total").increment(1);
}

/// Counts the bytes of a frame sent (`sent`) or received on `side`.
#[inline]
pub(crate) fn bytes(side: Side, sent: bool, n: usize) {
    if !metrics_on() {
        return;
    }
    let name = if sent {
        "rpc_bytes_sent_total"
    } else {
        "rpc_bytes_received_total"
    };
    metrics::counter!(name, "side" => side.label()).increment(n as u64);
}

/// Counts a send that found the peer's ring full.
pub(crate) fn backpressure() {
    if !metrics_on() {
        return;
    }
    metrics::counter!("rpc_backpressure_total").increment(1);
}

/// The gRPC name of a status code, as OpenTelemetry's `rpc.grpc.status_code`
/// names them.
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A W3C trace context (`traceparent`, version 00).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TraceContext {
    trace_id: u128,
    span_id: u64,
    flags: u8,
}

impl TraceContext {
    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`; `None` if malformed, or with
    /// an all-zero id (invalid by the spec).
    pub(crate) fn parse(header: &str) -> Option<TraceContext> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            (s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
            .then_some(())
        };
        hex(version, 2)?;
        hex(trace, 32)?;
        hex(span, 16)?;
        hex(flags, 2)?;
        if version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let context = TraceContext {
            trace_id: u128::from_str_radix(trace, 16).ok()?,
            span_id: u64::from_str_radix(span, 16).ok()?,
            flags: u8::from_str_radix(flags, 16).ok()?,
        };
        (context.trace_id != 0 && context.span_id != 0).then_some(context)
    }

    /// The context of an outgoing call: the trace of `parent` (a
    /// `traceparent` value) if it is valid, else a new sampled trace; a new
    /// span id either way.
    pub(crate) fn child_of(parent: Option<&str>) -> TraceContext {
        let parent = parent.and_then(TraceContext::parse);
        TraceContext {
            trace_id: parent.map_or_else(
                || nonzero_random() as u128 | (nonzero_random() as u128) << 64,
                |p| p.trace_id,
            ),
            span_id: nonzero_random(),
            flags: parent.map_or(1, |p| p.flags),
        }
    }

    /// The `traceparent` header value.
    pub(crate) fn header(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }

    /// The trace id, as 32 lowercase hex digits.
    pub(crate) fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

/// A random non-zero u64.
fn nonzero_random() -> u64 {
    loop {
        let mut b = [0u8; 8];
        if getrandom::fill(&mut b).is_err() {
            // No entropy source: the clock and a counter still tell calls apart.
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            return (t ^ N.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed))
                | 1;
        }
        let v = u64::from_le_bytes(b);
        if v != 0 {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_rejects_malformed_headers() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(h).unwrap();
        assert_eq!(c.header(), h);
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-xbf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_gets_a_new_span() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let child = TraceContext::child_of(Some(parent));
        assert_eq!(child.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(child.span_id, 0x00f067aa0ba902b7);
        assert_eq!(child.flags, 0, "the sampling decision is kept");
        let fresh = TraceContext::child_of(Some("garbage"));
        assert_ne!(fresh.trace_id, 0);
        assert_eq!(fresh.flags, 1);
        assert_ne!(TraceContext::child_of(None).trace_id, fresh.trace_id);
    }
}
