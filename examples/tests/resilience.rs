//! Channels that outlive their connections: reconnection with backoff after
//! a server restarts, wait-for-ready, and channels over several endpoints.

#[macro_use]
mod common;

use common::*;
use examples::echo::StreamRequest;
use examples::echo::echo_client::EchoClient;
use examples::route_guide::RouteGuideService;
use examples::routeguide::route_guide_client::RouteGuideClient;
use examples::routeguide::route_guide_server::RouteGuideServer;
use examples::routeguide::{Point, RouteNote};
use futures::StreamExt;
use rpc_core::{Backoff, Balance, Channel, Code, Request, ServerHandle, Status};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One echo call; its payload must come back.
fn echo_once(echo: &EchoClient, n: u64) -> Result<(), rpc_core::Status> {
    let payload = n.to_le_bytes().to_vec();
    let reply = echo
        .echo(echo_request("r", payload.clone(), &[]))
        .wait()?
        .into_inner();
    assert_eq!(reply.payload, payload, "a response matches its request");
    Ok(())
}

/// Serves the test service again on `url` (the address a stopped server
/// had), retrying while the address is still being released.
fn serve_again(probe: &Arc<Probe>, url: &str) -> ServerHandle {
    let deadline = Instant::now() + LIMIT;
    loop {
        match test_server(probe).serve(url) {
            Ok(server) => return server,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("serve again on {url}: {e}"),
        }
    }
}

on_every_fabric! {
    fn a_channel_recovers_from_a_server_restart_by_itself(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe), url);
        let address = server.local_url().to_owned();
        let channel = channel(&address);
        let echo = EchoClient::new(channel.clone());

        // Load from two threads for the whole test.
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let last_ok = Arc::new(std::sync::Mutex::new(Instant::now()));
        let load: Vec<_> = (0..2)
            .map(|t| {
                let (echo, stop, ok, last_ok) =
                    (echo.clone(), stop.clone(), ok.clone(), last_ok.clone());
                std::thread::spawn(move || {
                    let mut codes = std::collections::BTreeSet::new();
                    let mut n = t << 32;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        match echo_once(&echo, n) {
                            Ok(()) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                                *last_ok.lock().unwrap() = Instant::now();
                            }
                            Err(e) => {
                                codes.insert(format!("{:?}", e.code()));
                                // Fail-fast calls come back at once while
                                // the server is away: do not spin on them.
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                    }
                    codes
                })
            })
            .collect();
        eventually("calls succeed", || ok.load(Ordering::Relaxed) > 100);

        server.shutdown();
        eventually("the channel notices", || !channel.is_connected());
        let down_at = Instant::now();
        std::thread::sleep(Duration::from_millis(300));
        let server = serve_again(&probe, &address);
        let back_at = Instant::now();
        eventually("a call succeeds again", || *last_ok.lock().unwrap() > back_at);
        let recovered = last_ok.lock().unwrap().duration_since(back_at);
        let after = ok.load(Ordering::Relaxed);
        eventually("calls go on", || ok.load(Ordering::Relaxed) > after + 100);
        stop.store(true, Ordering::Relaxed);
        let mut codes = std::collections::BTreeSet::new();
        for t in load {
            codes.extend(t.join().unwrap());
        }
        // What failed while the server was away failed `Unavailable`,
        // nothing else.
        assert!(
            codes.iter().all(|c| c == "Unavailable"),
            "failures while the server was away: {codes:?}"
        );
        assert!(channel.is_connected());
        eprintln!("{url}: calls succeed again {recovered:?} after the server's return");
        // The same channel, not a new one, within 1 s of the server's
        // return (reconnect attempts are at most 1 s apart by default).
        assert!(
            recovered < Duration::from_secs(1),
            "calls succeeded again {recovered:?} after the server came back ({:?} down)",
            back_at - down_at
        );
        drop(server);
    }
}

on_every_fabric! {
    fn wait_for_ready_calls_wait_for_the_server_and_fail_fast_ones_do_not(url: &str) {
        let probe = Probe::new();
        // Learn an address, then free it: the channel starts with nothing
        // to connect to.
        let server = serve(test_server(&probe), url);
        let address = server.local_url().to_owned();
        server.shutdown();
        let channel = Channel::builder(&address)
            .timeout(LIMIT)
            .connect_lazy()
            .unwrap();
        let echo = EchoClient::new(channel.clone());

        // Fail fast (the default): `Unavailable` at once, naming why.
        let started = Instant::now();
        let e = expect_code(echo_once(&echo, 1), Code::Unavailable);
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        assert!(e.message().contains("reconnecting"), "{e}");

        // Wait-for-ready with a short deadline and no server: the deadline.
        let mut request = echo_request("w", vec![1], &[]);
        request.set_wait_for_ready(true);
        request.set_timeout(Duration::from_millis(200));
        let started = Instant::now();
        expect_code(echo.echo(request).wait(), Code::DeadlineExceeded);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(190) && took < Duration::from_secs(3), "{took:?}");

        // Wait-for-ready, blocking and awaited, while the server comes up.
        let waiting = {
            let echo = echo.clone();
            std::thread::spawn(move || {
                let mut request = echo_request("w", vec![2], &[]);
                request.set_wait_for_ready(true);
                echo.echo(request).wait().map(|r| r.into_inner().payload)
            })
        };
        let awaited = {
            let echo = echo.clone();
            std::thread::spawn(move || {
                let mut request = echo_request("w", vec![3], &[]);
                request.set_wait_for_ready(true);
                futures::executor::block_on(echo.echo(request)).map(|r| r.into_inner().payload)
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        let server = serve_again(&probe, &address);
        assert_eq!(waiting.join().unwrap().unwrap(), vec![2]);
        assert_eq!(awaited.join().unwrap().unwrap(), vec![3]);
        assert!(channel.is_connected());
        drop(server);
    }
}

/// The test service and the route guide (streams of every kind).
fn stream_server(probe: &Arc<Probe>) -> rpc_core::ServerBuilder {
    test_server(probe).add_service(RouteGuideServer::new(RouteGuideService::new()))
}

fn point(latitude: i32) -> Point {
    Point {
        latitude,
        longitude: 1,
    }
}

on_every_fabric! {
    fn wait_for_ready_streams_start_when_the_server_comes(url: &str) {
        let probe = Probe::new();
        let server = serve(stream_server(&probe), url);
        let address = server.local_url().to_owned();
        server.shutdown();
        let channel = Channel::builder(&address)
            .wait_for_ready(true)
            .timeout(LIMIT)
            .connect_lazy()
            .unwrap();
        let echo = EchoClient::new(channel.clone());
        let guide = RouteGuideClient::new(channel.clone());

        // A stream that does not wait fails at once; one that waits ends
        // at its deadline.
        let mut request = Request::new(StreamRequest { count: 1, size: 8 });
        request.set_wait_for_ready(false);
        let e = echo.stream(request).blocking_message().unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        let mut request = Request::new(StreamRequest { count: 1, size: 8 });
        request.set_timeout(Duration::from_millis(200));
        let started = Instant::now();
        let e = echo.stream(request).blocking_message().unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
        assert!(started.elapsed() >= Duration::from_millis(190), "{:?}", started.elapsed());

        // Every kind of stream waits for the server, blocking or awaited.
        let served = {
            let echo = echo.clone();
            std::thread::spawn(move || {
                echo.stream(StreamRequest { count: 5, size: 8 })
                    .into_iter()
                    .map(|m| m.map(|m| m.payload[0]))
                    .collect::<Result<Vec<u8>, Status>>()
            })
        };
        let recorded = {
            let guide = guide.clone();
            std::thread::spawn(move || {
                let (mut tx, call) = guide.record_route_sender(());
                for latitude in 0..3 {
                    tx.send(point(latitude))?;
                }
                tx.close()?;
                call.wait().map(|s| s.into_inner().point_count)
            })
        };
        let empty = {
            let guide = guide.clone();
            std::thread::spawn(move || {
                // Closed before the stream could start: it starts closed.
                let (tx, call) = guide.record_route_sender(());
                tx.close()?;
                call.wait().map(|s| s.into_inner().point_count)
            })
        };
        let chatted = {
            let guide = guide.clone();
            std::thread::spawn(move || {
                let notes = (0..3).map(|i| RouteNote {
                    location: Some(point(7)),
                    message: format!("n{i}"),
                });
                futures::executor::block_on(
                    guide
                        .route_chat(futures::stream::iter(notes))
                        .collect::<Vec<_>>(),
                )
                .into_iter()
                .collect::<Result<Vec<_>, Status>>()
                .map(|notes| notes.len())
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        for t in [&served.is_finished(), &recorded.is_finished(), &empty.is_finished(), &chatted.is_finished()] {
            assert!(!t, "a stream finished without a server");
        }
        let server = {
            let deadline = Instant::now() + LIMIT;
            loop {
                match stream_server(&probe).serve(&address) {
                    Ok(server) => break server,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(e) => panic!("serve again on {address}: {e}"),
                }
            }
        };
        assert_eq!(served.join().unwrap().unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(recorded.join().unwrap().unwrap(), 3);
        assert_eq!(empty.join().unwrap().unwrap(), 0);
        // Each note brings back the earlier ones at its place: 0 + 1 + 2.
        assert_eq!(chatted.join().unwrap().unwrap(), 3);
        drop(server);
    }
}

on_every_fabric! {
    fn a_channel_over_two_servers_spreads_calls_and_survives_losing_one(url: &str) {
        for balance in [Balance::RoundRobin, Balance::LeastOutstanding] {
            let probes = [Probe::new(), Probe::new()];
            let url_b = if url.starts_with("mem://") {
                format!("{url}.b.{balance:?}")
            } else {
                url.to_owned()
            };
            let url_a = if url.starts_with("mem://") {
                format!("{url}.a.{balance:?}")
            } else {
                url.to_owned()
            };
            let a = serve(test_server(&probes[0]), &url_a);
            let b = serve(test_server(&probes[1]), &url_b);
            let channel = Channel::balance([a.local_url(), b.local_url()])
                .balance(balance)
                .timeout(LIMIT)
                .connect()
                .unwrap();
            let echo = EchoClient::new(channel.clone());
            for n in 0..200 {
                echo_once(&echo, n).unwrap();
            }
            let (ca, cb) = (probes[0].seen().entered.len(), probes[1].seen().entered.len());
            assert!(ca > 0 && cb > 0, "{balance:?}: calls spread over both: {ca} and {cb}");

            // One goes away: calls go on against the other. Only calls in
            // flight on the lost connection could fail, and none are here.
            a.shutdown();
            eventually("the channel leaves the lost server out", || {
                echo_once(&echo, 0).is_ok()
            });
            for n in 0..200 {
                echo_once(&echo, n).unwrap_or_else(|e| panic!("{balance:?}: call {n}: {e}"));
            }
            assert!(channel.is_connected());
            drop(b);
        }
    }
}

#[test]
fn without_reconnection_a_failed_channel_stays_failed() {
    watchdog(|| {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let address = server.local_url().to_owned();
        let channel = Channel::builder(&address)
            .timeout(LIMIT)
            .reconnect(false)
            .connect()
            .unwrap();
        let echo = EchoClient::new(channel.clone());
        echo_once(&echo, 1).unwrap();
        server.shutdown();
        eventually("the channel notices", || !channel.is_connected());
        let server = serve_again(&probe, &address);
        std::thread::sleep(Duration::from_millis(300));
        let e = expect_code(echo_once(&echo, 2), Code::Unavailable);
        assert!(e.message().contains("open a new channel"), "{e}");
        // Wait-for-ready cannot wait for what will not come.
        let mut request = echo_request("w", vec![1], &[]);
        request.set_wait_for_ready(true);
        expect_code(echo.echo(request).wait(), Code::Unavailable);
        drop(server);
    });
}

#[test]
fn reconnection_attempts_back_off() {
    watchdog(|| {
        // A port nobody listens on: every attempt is refused at once.
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let address = server.local_url().to_owned();
        server.shutdown();
        let backoff = Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            multiplier: 2.0,
        };
        let channel = Channel::builder(&address)
            .reconnect_backoff(backoff)
            .connect_lazy()
            .unwrap();
        // Attempts after 20, 40, 80, 160, 200, 200... ms (less jitter):
        // about 8 in 1.3 s, never one per call.
        let echo = EchoClient::new(channel.clone());
        let started = Instant::now();
        let mut failures = 0;
        while started.elapsed() < Duration::from_millis(1300) {
            expect_code(echo_once(&echo, 0), Code::Unavailable);
            failures += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(failures > 100);
        // The channel comes up on the next attempt after the server does.
        let server = serve_again(&probe, &address);
        let back = Instant::now();
        assert!(channel.wait_connected(Duration::from_secs(5)));
        assert!(
            back.elapsed() < Duration::from_millis(400),
            "{:?}",
            back.elapsed()
        );
        echo_once(&echo, 1).unwrap();
        drop(server);
    });
}

#[test]
fn an_rdma_channel_falls_back_to_tcp_where_rdma_cannot_connect() {
    watchdog(|| {
        let probe = Probe::new();
        let server = serve(test_server(&probe), TCP_ANY);
        let tcp = server.local_url().to_owned();
        // Where this test runs on a host without an RDMA device, rdma://
        // fails at once; in the Soft-RoCE guest there is a device, and the
        // peer at this address speaks tcp://, so the rdma:// handshake
        // fails instead. Either way the channel ends up on tcp://.
        let port = tcp.rsplit(':').next().unwrap();
        let rdma = format!("rdma://127.0.0.1:{port}");
        let rdma = std::env::var("RXE_IP")
            .map(|ip| format!("rdma://{ip}:{port}"))
            .unwrap_or(rdma);
        let channel = Channel::builder(&rdma)
            .fallback(&tcp)
            .timeout(LIMIT)
            .connect()
            .unwrap_or_else(|e| panic!("{rdma} with fallback {tcp}: {e}"));
        assert_eq!(channel.connected_urls(), vec![tcp.clone()]);
        let echo = EchoClient::new(channel);
        for n in 0..10 {
            echo_once(&echo, n).unwrap();
        }
        // Without a fallback the same URL fails, naming tcp:// as the way out
        // where there is no device.
        let e = Channel::connect(&rdma).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        // Both failing: the URL's error, and the fallback's after it.
        server.shutdown();
        let e = Channel::builder(&rdma)
            .fallback(&tcp)
            .connect()
            .unwrap_err();
        assert!(e.message().contains("fallback"), "{e}");
        // One endpoint only.
        let e = Channel::balance([&rdma, &tcp])
            .fallback(&tcp)
            .connect()
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    });
}

on_soft_fabrics! {
    fn serve_with_shutdown_stops_gracefully_when_its_future_completes(url: &str) {
        let probe = Probe::new();
        // A known address: serve_with_shutdown does not hand back the port.
        let url = if url.starts_with("tcp://") {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("tcp://{}", free.local_addr().unwrap())
        } else {
            format!("{url}.graceful")
        };
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let serving = {
            let (builder, url) = (test_server(&probe), url.clone());
            std::thread::spawn(move || {
                futures::executor::block_on(builder.serve_with_shutdown(&url, async {
                    stopped.await.ok();
                }))
            })
        };
        let channel = Channel::builder(&url)
            .wait_for_ready(true)
            .timeout(LIMIT)
            .connect_lazy()
            .unwrap();
        let echo = EchoClient::new(channel.clone());
        echo_once(&echo, 1).unwrap();
        // A call in flight when the signal comes finishes.
        let slow = echo.echo(echo_request("slow", vec![7], &[("sleep-ms", "300")]));
        probe.wait_entered("slow");
        stop.send(()).unwrap();
        assert_eq!(slow.wait().unwrap().into_inner().payload, vec![7]);
        serving.join().unwrap().unwrap();
        // Then the server is gone.
        eventually("the channel notices", || !channel.is_connected());
        let mut request = echo_request("late", vec![1], &[]);
        request.set_wait_for_ready(false);
        expect_code(echo.echo(request).wait(), Code::Unavailable);
    }
}
