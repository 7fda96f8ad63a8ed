//! Where a channel's endpoints come from and whether they get calls: a
//! resolver asked again on a period (any function, and DNS), and health
//! checks with the standard health service.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use rpc_core::client::Dns;
use rpc_core::health::{self, ServingStatus};
use rpc_core::{Balance, Channel, Code, ServerHandle, Status};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One echo call; its payload must come back.
fn echo_once(echo: &EchoClient) -> Result<(), Status> {
    let reply = echo.echo(echo_request("e", vec![7; 8], &[])).wait()?;
    assert_eq!(reply.into_inner().payload, vec![7; 8]);
    Ok(())
}

/// `url`, made unique per server on mem:// (network fabrics pick a port).
fn url_for(url: &str, name: &str) -> String {
    if url.starts_with("mem://") {
        format!("{url}.{name}")
    } else {
        url.to_owned()
    }
}

/// The calls each probe's server has seen.
fn counts(probes: &[Arc<Probe>]) -> Vec<usize> {
    probes.iter().map(|p| p.seen().entered.len()).collect()
}

const CHECK_EVERY: Duration = Duration::from_millis(50);

on_every_fabric! {
    fn health_checks_take_an_endpoint_out_while_it_is_not_serving(url: &str) {
        let probes = [Probe::new(), Probe::new()];
        let (reporter, health_a) = health::service();
        let a = serve(test_server(&probes[0]).add_service(health_a), &url_for(url, "a"));
        // `b` has no health service: it is taken to serve.
        let b = serve(test_server(&probes[1]), &url_for(url, "b"));
        let channel = Channel::balance([a.local_url(), b.local_url()])
            .balance(Balance::RoundRobin)
            .health_check("")
            .health_check_interval(CHECK_EVERY)
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let echo = EchoClient::new(channel);
        for _ in 0..20 {
            echo_once(&echo).unwrap();
        }
        let before = counts(&probes);
        assert!(before[0] > 0 && before[1] > 0, "both serve: {before:?}");

        // `a` says it is not serving: within a few checks it gets no calls,
        // and no call fails meanwhile.
        reporter.set_status("", ServingStatus::NotServing);
        eventually("the endpoint is left out", || {
            let at_a = counts(&probes)[0];
            for _ in 0..20 {
                echo_once(&echo).unwrap();
            }
            counts(&probes)[0] == at_a
        });
        let out = counts(&probes);
        for _ in 0..50 {
            echo_once(&echo).unwrap();
        }
        let after = counts(&probes);
        assert_eq!(after[0], out[0], "a not-serving endpoint got calls: {out:?} -> {after:?}");
        assert_eq!(after[1], out[1] + 50);

        // Serving again: it is back in the rotation.
        reporter.set_status("", ServingStatus::Serving);
        eventually("the endpoint gets calls again", || {
            echo_once(&echo).unwrap();
            counts(&probes)[0] > after[0]
        });
        drop((a, b));
    }
}

on_every_fabric! {
    fn with_its_only_endpoint_not_serving_calls_fail_or_wait(url: &str) {
        let probe = Probe::new();
        let (reporter, health) = health::service();
        let server = serve(test_server(&probe).add_service(health), url);
        reporter.set_status("echo.Echo", ServingStatus::Serving);
        let channel = Channel::builder(server.local_url())
            .health_check("echo.Echo")
            .health_check_interval(CHECK_EVERY)
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let echo = EchoClient::new(channel);
        echo_once(&echo).unwrap();

        reporter.set_status("echo.Echo", ServingStatus::NotServing);
        eventually("calls fail while the service is not serving", || {
            echo_once(&echo).is_err()
        });
        let e = echo_once(&echo).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert!(e.message().contains("NotServing"), "says why: {e}");

        // A wait-for-ready call waits for it to serve again.
        let waiting = {
            let echo = echo.clone();
            std::thread::spawn(move || {
                let mut request = echo_request("w", vec![1; 4], &[]);
                request.set_wait_for_ready(true);
                request.set_timeout(LIMIT);
                echo.echo(request).wait()
            })
        };
        std::thread::sleep(CHECK_EVERY * 3);
        assert!(!waiting.is_finished(), "it waits");
        reporter.set_status("echo.Echo", ServingStatus::Serving);
        let reply = bounded("the waiting call", move || waiting.join().unwrap());
        assert_eq!(reply.unwrap().into_inner().payload, vec![1; 4]);
        echo_once(&echo).unwrap();
    }
}

on_every_fabric! {
    fn a_resolved_channel_follows_its_resolver(url: &str) {
        let probes = [Probe::new(), Probe::new()];
        let a = serve(test_server(&probes[0]), &url_for(url, "a"));
        let b = serve(test_server(&probes[1]), &url_for(url, "b"));
        let (url_a, url_b) = (a.local_url().to_owned(), b.local_url().to_owned());
        let names = Arc::new(Mutex::new(vec![url_a.clone()]));
        let resolver = {
            let names = names.clone();
            move || -> Result<Vec<String>, Status> { Ok(names.lock().unwrap().clone()) }
        };
        let channel = Channel::resolve(resolver)
            .resolve_interval(Duration::from_millis(100))
            .timeout(LIMIT)
            .connect()
            .unwrap();
        let echo = EchoClient::new(channel.clone());
        for _ in 0..10 {
            echo_once(&echo).unwrap();
        }
        assert_eq!(counts(&probes), [10, 0]);
        assert_eq!(channel.connected_urls(), std::slice::from_ref(&url_a));

        // A call in flight on `a` when the resolver drops it finishes.
        let held = {
            let echo = echo.clone();
            std::thread::spawn(move || {
                echo.echo(echo_request("held", vec![3; 4], &[("block", "held")])).wait()
            })
        };
        probes[0].wait_entered("held");

        // The resolver names only `b`: the channel follows, without a
        // failed call.
        *names.lock().unwrap() = vec![url_b.clone()];
        eventually("the channel moves to the new endpoint", || {
            echo_once(&echo).unwrap();
            channel.connected_urls() == [url_b.clone()]
        });
        let at_a = counts(&probes)[0];
        for _ in 0..20 {
            echo_once(&echo).unwrap();
        }
        assert_eq!(counts(&probes)[0], at_a, "no calls to an endpoint the resolver dropped");
        assert!(!held.is_finished());
        probes[0].open_gate("held");
        let reply = bounded("the held call", move || held.join().unwrap());
        assert_eq!(reply.unwrap().into_inner().payload, vec![3; 4]);

        // Both again: `a` is connected anew and gets calls.
        *names.lock().unwrap() = vec![url_a.clone(), url_b.clone()];
        let before = counts(&probes)[0];
        eventually("calls reach the endpoint named again", || {
            echo_once(&echo).unwrap();
            counts(&probes)[0] > before
        });

        // A failing resolver leaves the endpoints as they are.
        *names.lock().unwrap() = Vec::new();
        std::thread::sleep(Duration::from_millis(300));
        echo_once(&echo).unwrap();
        drop((a, b));
    }
}

#[test]
fn a_dns_channel_connects_to_the_addresses_of_a_name() {
    watchdog(|| {
        let probe = Probe::new();
        let server: ServerHandle = serve(test_server(&probe), TCP_ANY);
        let port = server.local_url().rsplit(':').next().unwrap().to_owned();
        // `localhost` may also name ::1, where nothing listens: that
        // endpoint keeps failing in the background while 127.0.0.1 serves.
        let channel = Channel::resolve(Dns::new(&format!("tcp://localhost:{port}")).unwrap())
            .timeout(LIMIT)
            .connect()
            .unwrap();
        assert_eq!(channel.url(), format!("tcp://localhost:{port}"));
        assert!(
            channel
                .connected_urls()
                .contains(&format!("tcp://127.0.0.1:{port}"))
        );
        let echo = EchoClient::new(channel);
        for _ in 0..20 {
            echo_once(&echo).unwrap();
        }

        let unknown = Channel::resolve(Dns::new("tcp://no-such-host.invalid:1").unwrap()).connect();
        let e = unknown.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert!(e.message().contains("no-such-host.invalid"), "{e}");
        assert_eq!(
            Dns::new("mem://x").unwrap_err().code(),
            Code::InvalidArgument
        );
    });
}
