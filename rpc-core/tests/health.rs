//! The built-in `grpc.health.v1.Health` service: `Check` and `Watch`.

use rpc_core::health::{self, HealthClient, ServingStatus};
use rpc_core::{Channel, Code, Server};

fn status(r: rpc_core::health::HealthCheckResponse) -> ServingStatus {
    ServingStatus::try_from(r.status).unwrap()
}

#[test]
fn check_and_watch_report_status_changes() {
    for url in ["mem://health", "tcp://127.0.0.1:0"] {
        let (reporter, service) = health::service();
        let server = Server::builder().add_service(service).serve(url).unwrap();
        let client = HealthClient::new(Channel::connect(server.local_url()).unwrap());

        // The server as a whole serves from the start; others are unknown.
        let r = client.check("").wait().unwrap().into_inner();
        assert_eq!(status(r), ServingStatus::Serving, "{url}");
        let e = client.check("kv.Kv").wait().unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{url}: {e}");

        let mut watch = client.watch("kv.Kv");
        let first = watch.blocking_message().unwrap().unwrap();
        assert_eq!(status(first), ServingStatus::ServiceUnknown, "{url}");
        reporter.set_status("kv.Kv", ServingStatus::Serving);
        let next = watch.blocking_message().unwrap().unwrap();
        assert_eq!(status(next), ServingStatus::Serving, "{url}");
        // Changes to other services, or to the same status, say nothing.
        reporter.set_status("other.Svc", ServingStatus::NotServing);
        reporter.set_status("kv.Kv", ServingStatus::Serving);
        reporter.set_status("kv.Kv", ServingStatus::NotServing);
        let next = watch.blocking_message().unwrap().unwrap();
        assert_eq!(status(next), ServingStatus::NotServing, "{url}");
        let r = client.check("kv.Kv").wait().unwrap().into_inner();
        assert_eq!(status(r), ServingStatus::NotServing, "{url}");
        reporter.clear_status("kv.Kv");
        let next = watch.blocking_message().unwrap().unwrap();
        assert_eq!(status(next), ServingStatus::ServiceUnknown, "{url}");
    }
}

#[test]
fn shutting_down_tells_watchers_and_ends_their_streams() {
    for url in ["mem://health-shutdown", "tcp://127.0.0.1:0"] {
        let (reporter, service) = health::service();
        reporter.set_status("kv.Kv", ServingStatus::Serving);
        let server = Server::builder().add_service(service).serve(url).unwrap();
        let client = HealthClient::new(Channel::connect(server.local_url()).unwrap());
        let mut watches: Vec<_> = ["", "kv.Kv", "unknown.Svc"]
            .into_iter()
            .map(|name| {
                let mut watch = client.watch(name);
                watch.blocking_message().unwrap().unwrap();
                watch
            })
            .collect();
        // The watches would run for ever: shutting down ends them, well
        // within its grace period.
        let grace = std::time::Duration::from_secs(30);
        let started = std::time::Instant::now();
        let stopping = std::thread::spawn(move || server.shutdown_timeout(grace));
        for (i, watch) in watches.iter_mut().enumerate() {
            if i < 2 {
                let last = watch.blocking_message().unwrap().unwrap();
                assert_eq!(status(last), ServingStatus::NotServing, "{url}: watch {i}");
            }
            assert!(
                watch.blocking_message().unwrap().is_none(),
                "{url}: watch {i} ended"
            );
        }
        stopping.join().unwrap();
        assert!(
            started.elapsed() < grace / 2,
            "{url}: shutdown took {:?}",
            started.elapsed()
        );
        // Later changes are ignored: the statuses stay `NotServing`.
        reporter.set_status("kv.Kv", ServingStatus::Serving);
        assert!(
            format!("{reporter:?}").contains("NotServing"),
            "{reporter:?}"
        );
        assert!(
            !format!("{reporter:?}").contains(": Serving"),
            "{reporter:?}"
        );
    }
}
