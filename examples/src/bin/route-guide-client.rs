//! A client of the route guide: runs its four rpcs as gRPC's example client
//! does, and prints what it gets.
//!
//! ```text
//! route-guide-client --connect tcp://127.0.0.1:10000 [--points N] [--seed S]
//! ```
//!
//! GetFeature on a point of the database and on one outside it;
//! ListFeatures over a corner of the grid; RecordRoute over `N` (default
//! 10) points of the database picked with seed `S` (default 1); RouteChat
//! with six notes at three places.

use examples::cli::{CLIENT_TLS_USAGE, client_tls, fail, parse, take_opt};
use examples::route_guide::{self, GRID_ORIGIN, GRID_STEP};
use examples::routeguide::route_guide_client::RouteGuideClient;
use examples::routeguide::{Point, Rectangle, RouteNote};
use rpc_core::{Channel, Status, Stream};
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

const USAGE: &str =
    "usage: route-guide-client --connect URL [--points N] [--seed S] [--timeout-ms MS]";

fn main() {
    examples::init_logging("warn");
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}\n{CLIENT_TLS_USAGE}");
        return;
    }
    let connect = take_opt(&mut args, "--connect").unwrap_or_else(|| fail(USAGE));
    let points = take_opt(&mut args, "--points").map_or(10, |v| parse(&v, "--points"));
    let seed = take_opt(&mut args, "--seed").map_or(1, |v| parse(&v, "--seed"));
    let timeout_ms =
        take_opt(&mut args, "--timeout-ms").map_or(10_000, |v| parse(&v, "--timeout-ms"));
    let builder = client_tls(
        &mut args,
        Channel::builder(&connect).timeout(Duration::from_millis(timeout_ms)),
    );
    if !args.is_empty() {
        fail(&format!("unexpected arguments {args:?}\n{USAGE}"));
    }
    let channel = builder.connect().unwrap_or_else(|status| {
        fail(&format!(
            "route-guide-client: cannot connect to {connect}: {}",
            status.message()
        ))
    });
    let client = RouteGuideClient::new(channel);

    let features = route_guide::features();
    let known = features[0].location.expect("features have locations");
    check("GetFeature", get_feature(&client, known));
    check("GetFeature", get_feature(&client, Point::default()));
    check("ListFeatures", list_features(&client));
    let route = route_guide::random_route(&features, points as usize, seed);
    check("RecordRoute", record_route(&client, route));
    check("RouteChat", route_chat(&client));
}

/// Exits with status 1 and says why if `rpc` failed.
fn check(rpc: &str, result: Result<(), Status>) {
    if let Err(status) = result {
        eprintln!("route-guide-client: {rpc} failed: {status}");
        std::process::exit(1);
    }
}

/// Unary: the feature at `point`, blocking on the call.
fn get_feature(client: &RouteGuideClient, point: Point) -> Result<(), Status> {
    let feature = client.get_feature(point).wait()?.into_inner();
    if feature.name.is_empty() {
        println!("GetFeature {}: no feature", At(point));
    } else {
        println!("GetFeature {}: {:?}", At(point), feature.name);
    }
    Ok(())
}

/// Server streaming: the features of a 5 × 5 corner of the grid, through
/// the blocking iterator.
fn list_features(client: &RouteGuideClient) -> Result<(), Status> {
    let lo = GRID_ORIGIN;
    let hi = Point {
        latitude: lo.latitude + 4 * GRID_STEP,
        longitude: lo.longitude + 4 * GRID_STEP,
    };
    println!("ListFeatures from {} to {}:", At(lo), At(hi));
    let mut count = 0;
    for feature in client.list_features(Rectangle {
        lo: Some(lo),
        hi: Some(hi),
    }) {
        let feature = feature?;
        println!(
            "  {:?} at {}",
            feature.name,
            At(feature.location.unwrap_or_default())
        );
        count += 1;
    }
    println!("ListFeatures: {count} features");
    Ok(())
}

/// Client streaming: sends `route` as a `Stream`, then blocks on the
/// summary (`ClientStreamingCall::wait` drives the stream meanwhile).
fn record_route(client: &RouteGuideClient, route: Vec<Point>) -> Result<(), Status> {
    println!("RecordRoute: traversing {} points", route.len());
    let summary = client
        .record_route(IterStream(route.into_iter()))
        .wait()?
        .into_inner();
    println!(
        "RecordRoute: point_count={} feature_count={} distance={} elapsed_time={}",
        summary.point_count, summary.feature_count, summary.distance, summary.elapsed_time
    );
    Ok(())
}

/// Bidirectional: sends notes through the blocking sender while another
/// thread prints the notes the server sends back.
fn route_chat(client: &RouteGuideClient) -> Result<(), Status> {
    let at = |latitude, longitude| {
        Some(Point {
            latitude,
            longitude,
        })
    };
    let notes = [
        ("First message", at(0, 1)),
        ("Second message", at(0, 2)),
        ("Third message", at(0, 3)),
        ("Fourth message", at(0, 1)),
        ("Fifth message", at(0, 2)),
        ("Sixth message", at(0, 3)),
    ];
    println!("RouteChat: sending {} notes", notes.len());
    let (mut sender, replies) = client.route_chat_sender(());
    let (sent, received) = std::thread::scope(|s| {
        // Reading on its own thread, so that however many notes come back,
        // the server never waits for this client to read.
        let reader = s.spawn(move || {
            let mut count = 0;
            for note in replies {
                let note = note?;
                println!(
                    "RouteChat: got {:?} at {}",
                    note.message,
                    At(note.location.unwrap_or_default())
                );
                count += 1;
            }
            Ok::<_, Status>(count)
        });
        let sent = notes
            .into_iter()
            .try_for_each(|(message, location)| {
                sender.send(RouteNote {
                    location,
                    message: message.into(),
                })
            })
            .and_then(|()| sender.close());
        (sent, reader.join().expect("the reader does not panic"))
    });
    // The server's status (in `received`) says more than a failed send.
    let received = received?;
    sent?;
    println!("RouteChat: {received} notes back");
    Ok(())
}

/// An iterator as a `Stream` that is always ready: what `futures::stream::iter`
/// does, without the dependency.
struct IterStream<I>(I);

impl<I: Iterator + Unpin> Stream for IterStream<I> {
    type Item = I::Item;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<I::Item>> {
        Poll::Ready(self.0.next())
    }
}

/// A point in degrees: `(40.0500000, -74.9500000)`.
struct At(Point);

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let degrees = |e7: i32| {
            let sign = if e7 < 0 { "-" } else { "" };
            let abs = e7.unsigned_abs();
            format!("{sign}{}.{:07}", abs / 10_000_000, abs % 10_000_000)
        };
        write!(
            f,
            "({}, {})",
            degrees(self.0.latitude),
            degrees(self.0.longitude)
        )
    }
}
