//! The route guide example: each of its four rpcs on every fabric, in the
//! async and the blocking forms, against values computed here from the
//! database; and the `route-guide-server` and `route-guide-client` binaries
//! as two processes.

#[macro_use]
mod common;

use common::*;
use examples::kv::kv_server::KvServer;
use examples::route_guide::{
    self, GRID_COLUMNS, GRID_ORIGIN, GRID_ROWS, GRID_STEP, RouteGuideService,
};
use examples::routeguide::route_guide_client::RouteGuideClient;
use examples::routeguide::route_guide_server::RouteGuideServer;
use examples::routeguide::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use examples::services::KvStore;
use futures::StreamExt;
use futures::executor::block_on;
use rpc_core::{Code, Server, ServerHandle};
use std::collections::HashSet;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Serves a fresh route guide (no notes yet) on `url`.
fn start(url: &str) -> (ServerHandle, RouteGuideClient) {
    let server = serve(
        Server::builder().add_service(RouteGuideServer::new(RouteGuideService::new())),
        url,
    );
    let client = RouteGuideClient::new(channel(server.local_url()));
    (server, client)
}

fn point(latitude: i32, longitude: i32) -> Point {
    Point {
        latitude,
        longitude,
    }
}

/// The grid point at `row`, `column`.
fn grid(row: i32, column: i32) -> Point {
    point(
        GRID_ORIGIN.latitude + row * GRID_STEP,
        GRID_ORIGIN.longitude + column * GRID_STEP,
    )
}

fn rectangle(lo: Point, hi: Point) -> Rectangle {
    Rectangle {
        lo: Some(lo),
        hi: Some(hi),
    }
}

/// The features inside the rectangle with corners `a` and `b`, edges
/// included, in database order.
fn features_between(a: Point, b: Point) -> Vec<Feature> {
    let between = |x: i32, a: i32, b: i32| (a <= x && x <= b) || (b <= x && x <= a);
    route_guide::features()
        .into_iter()
        .filter(|f| {
            let p = f.location.unwrap();
            between(p.latitude, a.latitude, b.latitude)
                && between(p.longitude, a.longitude, b.longitude)
        })
        .collect()
}

/// gRPC's route guide distance: haversine, in whole metres.
fn haversine(a: &Point, b: &Point) -> i32 {
    const R: f64 = 6_371_000.0;
    let rad = |e7: i32| e7 as f64 / 1e7 * std::f64::consts::PI / 180.0;
    let (lat1, lat2) = (rad(a.latitude), rad(b.latitude));
    let (dlat, dlng) = (lat2 - lat1, rad(b.longitude) - rad(a.longitude));
    let h = (dlat / 2.0).sin() * (dlat / 2.0).sin()
        + lat1.cos() * lat2.cos() * (dlng / 2.0).sin() * (dlng / 2.0).sin();
    (R * 2.0 * h.sqrt().atan2((1.0 - h).sqrt())) as i32
}

/// What `RecordRoute` should answer for `route` (elapsed time left at 0).
fn summary_of(route: &[Point]) -> RouteSummary {
    let known: HashSet<Point> = route_guide::features()
        .iter()
        .map(|f| f.location.unwrap())
        .collect();
    RouteSummary {
        point_count: route.len() as i32,
        feature_count: route.iter().filter(|p| known.contains(p)).count() as i32,
        distance: route.windows(2).map(|w| haversine(&w[0], &w[1])).sum(),
        elapsed_time: 0,
    }
}

fn note(message: &str, location: Point) -> RouteNote {
    RouteNote {
        location: Some(location),
        message: message.into(),
    }
}

/// What `RouteChat` sends back for `script`, after the notes of `history`
/// (every note the server has kept so far, which this adds `script` to).
fn chat_replies(history: &mut Vec<RouteNote>, script: &[RouteNote]) -> Vec<Vec<RouteNote>> {
    script
        .iter()
        .map(|n| {
            let earlier = history
                .iter()
                .filter(|h| h.location == n.location)
                .cloned()
                .collect();
            history.push(n.clone());
            earlier
        })
        .collect()
}

#[test]
fn the_database_is_a_few_hundred_named_features_on_the_grid() {
    let features = route_guide::features();
    assert_eq!(features, route_guide::features(), "not deterministic");
    assert!(
        (200..=400).contains(&features.len()),
        "{} features",
        features.len()
    );
    let mut locations = HashSet::new();
    for f in &features {
        assert!(!f.name.is_empty());
        let p = f.location.unwrap();
        let (dlat, dlng) = (
            p.latitude - GRID_ORIGIN.latitude,
            p.longitude - GRID_ORIGIN.longitude,
        );
        assert!(
            dlat % GRID_STEP == 0 && dlng % GRID_STEP == 0,
            "{f:?} is off the grid"
        );
        assert!((0..GRID_ROWS).contains(&(dlat / GRID_STEP)), "{f:?}");
        assert!((0..GRID_COLUMNS).contains(&(dlng / GRID_STEP)), "{f:?}");
        assert!(locations.insert(p), "two features at {p:?}");
    }
    // A seeded route is the same every time, and made of database points.
    let route = route_guide::random_route(&features, 50, 7);
    assert_eq!(route, route_guide::random_route(&features, 50, 7));
    assert_ne!(route, route_guide::random_route(&features, 50, 8));
    assert!(route.iter().all(|p| locations.contains(p)));
    // The library's distance is gRPC's.
    for w in route.windows(2) {
        assert_eq!(route_guide::distance(&w[0], &w[1]), haversine(&w[0], &w[1]));
    }
}

on_every_fabric! {
    fn get_feature_names_features_and_nothing_elsewhere(url: &str) {
        let (_server, client) = start(url);
        let features = route_guide::features();
        // Blocking, every feature.
        for f in &features {
            let got = client.get_feature(f.location.unwrap()).wait().unwrap().into_inner();
            assert_eq!(&got, f, "{url}");
        }
        // Async, a few.
        block_on(async {
            for f in features.iter().step_by(17) {
                let got = client.get_feature(f.location.unwrap()).await.unwrap().into_inner();
                assert_eq!(&got, f, "{url}");
            }
        });
        // Elsewhere: an unnamed feature at the point asked for.
        let known: HashSet<Point> = features.iter().map(|f| f.location.unwrap()).collect();
        let empty_cells = (0..GRID_ROWS)
            .flat_map(|r| (0..GRID_COLUMNS).map(move |c| grid(r, c)))
            .filter(|p| !known.contains(p));
        let mut elsewhere: Vec<Point> = empty_cells.take(20).collect();
        assert_eq!(elsewhere.len(), 20, "the grid has empty cells");
        let first = features[0].location.unwrap();
        elsewhere.extend([
            point(0, 0),
            point(first.latitude + 1, first.longitude),
            point(first.latitude, first.longitude - 1),
            point(-900_000_000, 1_800_000_000),
        ]);
        for p in elsewhere {
            let got = client.get_feature(p).wait().unwrap().into_inner();
            assert_eq!(got, Feature { name: String::new(), location: Some(p) }, "{url}");
            let got = block_on(client.get_feature(p)).unwrap().into_inner();
            assert_eq!(got.name, "", "{url}");
        }
    }
}

on_every_fabric! {
    fn list_features_streams_the_features_inside_a_rectangle(url: &str) {
        let (_server, client) = start(url);
        let (sw, ne) = (grid(2, 3), grid(8, 11));
        let (nw, se) = (grid(8, 3), grid(2, 11));
        let first = route_guide::features()[0].location.unwrap();
        let empty = grid(0, 0);
        let cases = [
            (sw, ne),
            // Corners in any order name the same rectangle.
            (ne, sw),
            (nw, se),
            (se, nw),
            // The whole grid, and more.
            (grid(-1, -1), grid(GRID_ROWS, GRID_COLUMNS)),
            // One feature's point; an empty cell; nowhere near.
            (first, first),
            (empty, empty),
            (point(1, 1), point(2, 2)),
        ];
        for (a, b) in cases {
            let expected = features_between(a, b);
            // Blocking iterator.
            let got: Vec<Feature> = client
                .list_features(rectangle(a, b))
                .into_iter()
                .map(|f| f.unwrap())
                .collect();
            assert_eq!(got, expected, "{url}: {a:?} {b:?}");
            // Async: the same as a Stream, and one message at a time.
            let got: Vec<Feature> = block_on(
                client.list_features(rectangle(a, b)).map(|f| f.unwrap()).collect(),
            );
            assert_eq!(got, expected, "{url}: {a:?} {b:?}");
            let got = block_on(async {
                let mut stream = client.list_features(rectangle(a, b));
                let mut got = Vec::new();
                while let Some(f) = stream.message().await.unwrap() {
                    got.push(f);
                }
                got
            });
            assert_eq!(got, expected, "{url}: {a:?} {b:?}");
        }
        assert_eq!(features_between(sw, ne).len(), features_between(se, nw).len());
        assert_eq!(features_between(first, first).len(), 1);
        assert_eq!(features_between(empty, empty).len(), 0, "(0, 0) is an empty cell");
        assert_eq!(
            features_between(grid(-1, -1), grid(GRID_ROWS, GRID_COLUMNS)),
            route_guide::features()
        );
        // A rectangle needs both corners.
        let half = Rectangle { lo: Some(sw), hi: None };
        let e = client.list_features(half).blocking_message().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{url}: {e}");
    }
}

on_every_fabric! {
    fn record_route_summarises_the_route(url: &str) {
        let (_server, client) = start(url);
        let features = route_guide::features();
        // Async: a Stream of points, awaited.
        for (n, seed) in [(1, 1), (2, 2), (50, 3), (500, 4)] {
            let route = route_guide::random_route(&features, n, seed);
            let expected = summary_of(&route);
            assert_eq!(expected.feature_count, n as i32);
            let call = client.record_route(futures::stream::iter(route));
            let got = block_on(call).unwrap().into_inner();
            assert_eq!(got, expected, "{url}: {n} points");
        }
        // Blocking: through the sender. North along a meridian, 0.05° a
        // leg: 6371 km × 0.05 × π / 180 = 5559.75 m.
        let route: Vec<Point> = (0..GRID_ROWS).map(|row| grid(row, 7)).collect();
        let expected = summary_of(&route);
        assert_eq!(expected.distance, 5559 * (GRID_ROWS - 1));
        let (mut tx, call) = client.record_route_sender(());
        for p in &route {
            tx.send(*p).unwrap();
        }
        tx.close().unwrap();
        assert_eq!(call.wait().unwrap().into_inner(), expected, "{url}");
        // An empty route; points off the grid, from a Stream waited on.
        let (tx, call) = client.record_route_sender(());
        drop(tx);
        assert_eq!(call.wait().unwrap().into_inner(), RouteSummary::default(), "{url}");
        let route = [point(0, 0), point(0, 10_000_000), point(10_000_000, 10_000_000)];
        let call = client.record_route(futures::stream::iter(route));
        let got = call.wait().unwrap().into_inner();
        assert_eq!(got, summary_of(&route), "{url}");
        assert_eq!(got.feature_count, 0);
        // Elapsed time counts from the start of the call.
        let (mut tx, call) = client.record_route_sender(());
        tx.send(grid(0, 0)).unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        tx.send(grid(1, 0)).unwrap();
        tx.close().unwrap();
        let got = call.wait().unwrap().into_inner();
        assert_eq!((got.point_count, got.distance), (2, 5559), "{url}");
        assert!((1..=10).contains(&got.elapsed_time), "{url}: {got:?}");
    }
}

on_every_fabric! {
    fn route_chat_sends_back_earlier_notes_at_the_same_place(url: &str) {
        let (_server, client) = start(url);
        let (a, b, c) = (point(0, 1), point(0, 2), point(0, 3));
        let mut history = Vec::new();

        // Async: a scripted conversation from a Stream.
        let script = [
            note("1", a), note("2", b), note("3", a), note("4", a),
            note("5", c), note("6", b), note("7", a),
        ];
        let expected: Vec<RouteNote> = chat_replies(&mut history, &script).concat();
        assert_eq!(expected.len(), 1 + 2 + 1 + 3);
        let got: Vec<RouteNote> = block_on(
            client.route_chat(futures::stream::iter(script.clone())).map(|n| n.unwrap()).collect(),
        );
        assert_eq!(got, expected, "{url}");

        // Blocking, in lockstep: the notes of the first conversation are
        // there for the second.
        let script = [note("8", c), note("9", point(5, 5)), note("10", b), note("11", point(5, 5))];
        let replies = chat_replies(&mut history, &script);
        let (mut tx, mut rx) = client.route_chat_sender(());
        for (n, expected) in script.iter().zip(&replies) {
            tx.send(n.clone()).unwrap();
            for e in expected {
                assert_eq!(&rx.blocking_message().unwrap().unwrap(), e, "{url}");
            }
        }
        tx.close().unwrap();
        assert_eq!(rx.blocking_message().unwrap(), None, "{url}");

        // Two calls at once share their notes as they go.
        let p = point(-7, -7);
        let (mut tx1, mut rx1) = client.route_chat_sender(());
        let (mut tx2, mut rx2) = client.route_chat_sender(());
        tx1.send(note("first from 1", p)).unwrap();
        tx2.send(note("first from 2", p)).unwrap();
        assert_eq!(rx2.blocking_message().unwrap().unwrap().message, "first from 1");
        tx1.send(note("second from 1", p)).unwrap();
        assert_eq!(rx1.blocking_message().unwrap().unwrap().message, "first from 1");
        assert_eq!(rx1.blocking_message().unwrap().unwrap().message, "first from 2");
        drop(tx1);
        drop(tx2);
        assert_eq!(rx1.blocking_message().unwrap(), None, "{url}");
        assert_eq!(rx2.blocking_message().unwrap(), None, "{url}");
        // The same conversation again, as an iterator.
        let (mut tx, rx) = client.route_chat_sender(());
        tx.send(note("third", p)).unwrap();
        tx.close().unwrap();
        let got: Vec<String> = rx.into_iter().map(|n| n.unwrap().message).collect();
        assert_eq!(got, ["first from 1", "first from 2", "second from 1"], "{url}");

        // A note needs a location.
        let (mut tx, mut rx) = client.route_chat_sender(());
        tx.send(RouteNote { location: None, message: "where?".into() }).unwrap();
        let e = rx.blocking_message().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{url}: {e}");
    }
}

/// A child process, killed when dropped so a failing test leaves none behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `route-guide-server --listen listen`; returns it and its URL.
fn start_server_process(listen: &str) -> (Proc, String) {
    let mut proc = Proc(
        Command::new(env!("CARGO_BIN_EXE_route-guide-server"))
            .args(["--listen", listen])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn route-guide-server"),
    );
    let mut stdout = proc.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // The first line, byte by byte (what follows is not read).
        let mut line = Vec::new();
        let mut byte = [0];
        while let Ok(1) = stdout.read(&mut byte) {
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
        let _ = tx.send(String::from_utf8_lossy(&line).into_owned());
        // Keep the pipe open while the server runs.
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    });
    let line = rx
        .recv_timeout(LIMIT)
        .expect("route-guide-server printed no address");
    let url = line
        .strip_prefix("route-guide-server listening on ")
        .unwrap_or_else(|| panic!("unexpected first line from route-guide-server: {line:?}"))
        .to_owned();
    assert!(!url.ends_with(":0"), "no real port: {url}");
    (proc, url)
}

/// What a finished process printed.
#[derive(Debug)]
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `bin args...` to completion, killing it after [`LIMIT`].
fn run_process(bin: &str, args: &[&str]) -> Run {
    let mut proc = Proc(
        Command::new(bin)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {bin}: {e}")),
    );
    let read_all = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut out = String::new();
            let _ = pipe.read_to_string(&mut out);
            out
        })
    };
    let stdout = read_all(Box::new(proc.0.stdout.take().unwrap()));
    let stderr = read_all(Box::new(proc.0.stderr.take().unwrap()));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = proc.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "{bin} {args:?} did not exit within {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    Run {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

fn client_process(url: &str, args: &[&str]) -> Run {
    let mut all = vec!["--connect", url];
    all.extend(args);
    run_process(env!("CARGO_BIN_EXE_route-guide-client"), &all)
}

/// The lines a process printed that start with `prefix`.
fn lines<'a>(out: &'a Run, prefix: &str) -> Vec<&'a str> {
    out.stdout
        .lines()
        .filter(|l| l.starts_with(prefix))
        .collect()
}

on_network_fabrics! {
    fn route_guide_client_and_server_processes(url: &str) {
        let (_server, u) = start_server_process(url);
        let out = client_process(&u, &["--points", "25", "--seed", "7"]);
        assert!(out.status.success(), "{out:?}");
        let features = route_guide::features();

        let get = lines(&out, "GetFeature ");
        assert_eq!(get.len(), 2, "{out:?}");
        assert!(get[0].ends_with(&format!(": {:?}", features[0].name)), "{out:?}");
        assert_eq!(get[1], "GetFeature (0.0000000, 0.0000000): no feature");

        let listed = features_between(GRID_ORIGIN, grid(4, 4));
        assert_eq!(lines(&out, "  \"").len(), listed.len(), "{out:?}");
        let count = format!("ListFeatures: {} features", listed.len());
        assert_eq!(lines(&out, "ListFeatures: "), [count], "{out:?}");

        let route = route_guide::random_route(&features, 25, 7);
        let s = summary_of(&route);
        let summary = format!(
            "RecordRoute: point_count=25 feature_count=25 distance={} elapsed_time=0",
            s.distance
        );
        assert_eq!(lines(&out, "RecordRoute: point_count="), [summary], "{out:?}");

        // The last three notes each find one at their place.
        let got = lines(&out, "RouteChat: got ");
        assert_eq!(
            got,
            [
                "RouteChat: got \"First message\" at (0.0000000, 0.0000001)",
                "RouteChat: got \"Second message\" at (0.0000000, 0.0000002)",
                "RouteChat: got \"Third message\" at (0.0000000, 0.0000003)",
            ],
            "{out:?}"
        );
        assert_eq!(lines(&out, "RouteChat: 3 notes back").len(), 1, "{out:?}");
        assert_eq!(out.stderr, "", "{out:?}");

        // The server keeps the notes for the next client: 2 + 2 + 2 + 3 + 3 + 3.
        let again = client_process(&u, &[]);
        assert!(again.status.success(), "{again:?}");
        assert_eq!(lines(&again, "RouteChat: 15 notes back").len(), 1, "{again:?}");

        // It reports itself healthy.
        let health = run_process(
            env!("CARGO_BIN_EXE_kv-client"),
            &["--connect", &u, "health", "routeguide.RouteGuide"],
        );
        assert!(health.status.success(), "{health:?}");
        assert_eq!(health.stdout, "Serving\n");
    }
}

#[test]
fn route_guide_client_fails_clearly() {
    // Nobody listens: exit status 2, and why.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("tcp://127.0.0.1:{port}");
    let out = client_process(&url, &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(out.stdout, "");
    assert!(
        out.stderr
            .starts_with(&format!("route-guide-client: cannot connect to {url}: ")),
        "{out:?}"
    );
    // A server without the route guide: the first rpc fails, status 1.
    let server = serve(
        Server::builder().add_service(KvServer::new(KvStore::new())),
        TCP_ANY,
    );
    let out = client_process(server.local_url(), &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(out.stdout, "");
    assert!(
        out.stderr
            .starts_with("route-guide-client: GetFeature failed: "),
        "{out:?}"
    );
    assert!(out.stderr.contains("unimplemented"), "{out:?}");
    // Bad arguments: status 2 and the usage.
    let out = client_process(server.local_url(), &["--points", "many"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(out.stderr.contains("--points"), "{out:?}");
    let out = run_process(env!("CARGO_BIN_EXE_route-guide-client"), &["--connect"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
