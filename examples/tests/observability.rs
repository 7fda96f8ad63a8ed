//! Spans and metrics: a trace id set by a client appears in the server's
//! span, one the client makes up goes across too, a handler's child call
//! continues the trace, a handler that parks resumes in its span, and the
//! metrics count the calls and the bytes.
//!
//! One test: the tracing subscriber and the metrics recorder are global to
//! the process.

mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use rpc_core::{Channel, Code};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// Where the subscriber writes: a buffer the test reads.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The `trace_id` of the closed spans named `name` in `log`, in order.
fn trace_ids(log: &str, name: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(&format!("{name}{{")) && l.contains("close"))
        .filter_map(|l| {
            let at = l.find("trace_id=")? + "trace_id=".len();
            let id = l[at..].trim_start_matches('"');
            Some(id.get(..32)?.to_owned())
        })
        .collect()
}

/// What the recorder holds (taking a snapshot resets its counters).
type Metrics = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// The value of counter `name` with these labels (and maybe more).
fn counter(metrics: &Metrics, name: &str, labels: &[(&str, &str)]) -> u64 {
    metrics
        .iter()
        .filter(|(key, _, _, _)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

#[test]
fn traces_continue_across_calls_and_metrics_count_them() {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("rpc_core=debug,observability=info")
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).unwrap();
    rpc_core::observe::enable_metrics();

    watchdog(move || {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let echo = EchoClient::new(
            Channel::builder(server.local_url())
                .timeout(LIMIT)
                .connect()
                .unwrap(),
        );

        // A trace the application started (an OpenTelemetry propagator
        // would set this header): the server's span carries its id.
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let mut request = echo_request("traced", vec![1], &[]);
        request
            .metadata_mut()
            .insert("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
            .unwrap();
        let reply = echo.echo(request).wait().unwrap();
        // The header that went out kept the trace, with the client span's
        // own id as the parent.
        let sent = reply.metadata().get("traceparent").unwrap().to_owned();
        assert!(sent.starts_with(&format!("00-{trace}-")), "{sent}");
        assert!(!sent.contains("00f067aa0ba902b7"), "{sent}");

        // No trace yet: the client starts one, and the server continues it.
        echo.echo(echo_request("fresh", vec![2], &[]))
            .wait()
            .unwrap();

        // A handler that parks and resumes logs inside the call's span.
        echo.echo(echo_request(
            "parks",
            vec![3],
            &[("yield-log", "resumed in the handler")],
        ))
        .wait()
        .unwrap();

        // A rejected call is counted with its code.
        let unknown = expect_code(
            echo.echo(echo_request("boom", vec![], &[("panic", "on purpose")]))
                .wait(),
            Code::Internal,
        );
        drop(unknown);
        drop(echo);
        server.shutdown();

        let text = log.text();
        let servers = trace_ids(&text, "rpc.server");
        let clients = trace_ids(&text, "rpc.client");
        assert_eq!(servers.len(), 4, "{text}");
        assert_eq!(clients.len(), 4, "{text}");
        let resumed = text
            .lines()
            .find(|l| l.contains("resumed in the handler"))
            .unwrap_or_else(|| panic!("no event from the resumed handler: {text}"));
        assert!(
            resumed.contains("rpc.server{"),
            "not in the call's span: {resumed}"
        );
        assert_eq!(servers[0], trace, "{text}");
        assert_eq!(clients[0], trace, "{text}");
        assert_ne!(servers[1], trace, "a new trace");
        assert_eq!(
            servers[1], clients[1],
            "the server continues the client's trace"
        );
        assert!(
            text.contains("rpc.code=\"INTERNAL\"") || text.contains("rpc.code=INTERNAL"),
            "{text}"
        );
        assert!(text.contains("rpc.method=\"/echo.Echo/Echo\""), "{text}");

        let metrics: Metrics = snapshotter.snapshot().into_vec();
        let method = ("method", "/echo.Echo/Echo");
        for side in ["client", "server"] {
            assert_eq!(
                counter(
                    &metrics,
                    "rpc_calls_started_total",
                    &[("side", side), method]
                ),
                4,
                "{side}"
            );
            assert_eq!(
                counter(
                    &metrics,
                    "rpc_calls_finished_total",
                    &[("side", side), method, ("code", "OK")]
                ),
                3,
                "{side}"
            );
            assert_eq!(
                counter(
                    &metrics,
                    "rpc_calls_finished_total",
                    &[("side", side), method, ("code", "INTERNAL")]
                ),
                1,
                "{side}"
            );
        }
        // Every frame one side sent, the other received (all small: no
        // rendezvous, whose release frames count on their sender only).
        let bytes = |name: &str, side: &str| counter(&metrics, name, &[("side", side)]);
        let requests = bytes("rpc_bytes_sent_total", "client");
        let replies = bytes("rpc_bytes_sent_total", "server");
        assert!(
            requests > 4 * 24 && replies > 4 * 24,
            "{requests} {replies}"
        );
        assert_eq!(bytes("rpc_bytes_received_total", "server"), requests);
        assert_eq!(bytes("rpc_bytes_received_total", "client"), replies);
        let durations = metrics
            .iter()
            .filter(|(k, _, _, _)| k.key().name() == "rpc_call_duration_seconds")
            .map(|(_, _, _, v)| match v {
                DebugValue::Histogram(samples) => samples.len(),
                _ => 0,
            })
            .sum::<usize>();
        assert_eq!(durations, 8, "a duration per call and side");
    });
}
