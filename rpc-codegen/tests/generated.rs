//! The committed reference outputs compile against the runtime, and the
//! route guide's generated client and server, one rpc of each kind, talk to
//! each other over `mem://`. A blessed reference is thus built, not only
//! diffed.

// Compiled for their types; not every item is used here.
#[allow(dead_code)]
mod echo {
    include!("reference/echo.rs");
}

#[allow(dead_code)]
mod kv {
    include!("reference/kv.rs");
}

#[allow(dead_code)]
mod routeguide {
    include!("reference/routeguide.rs");
}

use routeguide::route_guide_client::RouteGuideClient;
use routeguide::route_guide_server::{RouteGuide, RouteGuideServer};
use routeguide::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use rpc_core::codegen::Stream;
use rpc_core::{Request, Response, Server, Status, Streaming};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A `Stream` of the items of an iterator, all ready at once.
struct Iter<I>(I);

impl<I: Iterator + Unpin> Stream for Iter<I> {
    type Item = I::Item;
    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<I::Item>> {
        Poll::Ready(self.0.next())
    }
}

fn point(latitude: i32, longitude: i32) -> Point {
    Point {
        latitude,
        longitude,
    }
}

/// Features at the points of the diagonal `(i, i)`, named after `i`.
struct Guide;

impl RouteGuide for Guide {
    async fn get_feature(&self, request: Request<Point>) -> Result<Response<Feature>, Status> {
        let at = request.into_inner();
        Ok(Response::new(Feature {
            name: format!("feature {}", at.latitude),
            location: Some(at),
        }))
    }

    type ListFeaturesStream = Iter<std::vec::IntoIter<Result<Feature, Status>>>;

    async fn list_features(
        &self,
        request: Request<Rectangle>,
    ) -> Result<Response<Self::ListFeaturesStream>, Status> {
        let rectangle = request.into_inner();
        let (lo, hi) = (
            rectangle.lo.unwrap_or_default(),
            rectangle.hi.unwrap_or_default(),
        );
        let features: Vec<_> = (lo.latitude..=hi.latitude)
            .map(|i| {
                Ok(Feature {
                    name: format!("feature {i}"),
                    location: Some(point(i, i)),
                })
            })
            .collect();
        Ok(Response::new(Iter(features.into_iter())))
    }

    async fn record_route(
        &self,
        request: Request<Streaming<Point>>,
    ) -> Result<Response<RouteSummary>, Status> {
        let mut points = request.into_inner();
        let mut summary = RouteSummary::default();
        while let Some(point) = points.message().await? {
            summary.point_count += 1;
            if point.latitude == point.longitude {
                summary.feature_count += 1;
            }
        }
        Ok(Response::new(summary))
    }

    // Echoes the notes: the incoming stream is itself a stream of responses.
    type RouteChatStream = Streaming<RouteNote>;

    async fn route_chat(
        &self,
        request: Request<Streaming<RouteNote>>,
    ) -> Result<Response<Self::RouteChatStream>, Status> {
        Ok(Response::new(request.into_inner()))
    }
}

fn note(message: &str) -> RouteNote {
    RouteNote {
        location: Some(point(1, 2)),
        message: message.to_owned(),
    }
}

#[test]
fn route_guide_over_mem() {
    let server = Server::builder()
        .add_service(RouteGuideServer::new(Guide))
        .serve("mem://rpc-codegen.route-guide")
        .unwrap();
    let client = RouteGuideClient::connect(server.local_url()).unwrap();

    // Unary.
    let feature = client.get_feature(point(3, 3)).wait().unwrap().into_inner();
    assert_eq!(feature.name, "feature 3");

    // Server-streaming: the responses as an iterator.
    let features: Vec<String> = client
        .list_features(Rectangle {
            lo: Some(point(1, 1)),
            hi: Some(point(4, 4)),
        })
        .into_iter()
        .map(|feature| feature.unwrap().name)
        .collect();
    assert_eq!(
        features,
        ["feature 1", "feature 2", "feature 3", "feature 4"]
    );

    // Client-streaming, from a stream and through the blocking sender.
    let route = vec![point(1, 1), point(1, 2), point(2, 2)];
    let summary = client
        .record_route(Iter(route.into_iter()))
        .wait()
        .unwrap()
        .into_inner();
    assert_eq!((summary.point_count, summary.feature_count), (3, 2));

    let (mut sender, call) = client.record_route_sender(());
    for i in 0..5 {
        sender.send(point(i, 0)).unwrap();
    }
    sender.close().unwrap();
    let summary = call.wait().unwrap().into_inner();
    assert_eq!((summary.point_count, summary.feature_count), (5, 1));

    // Bidirectional, from a stream and through the blocking sender.
    let notes = vec![note("a"), note("b")];
    let echoed: Vec<String> = client
        .route_chat(Iter(notes.into_iter()))
        .into_iter()
        .map(|note| note.unwrap().message)
        .collect();
    assert_eq!(echoed, ["a", "b"]);

    let (mut sender, mut responses) = client.route_chat_sender(());
    for message in ["x", "y", "z"] {
        sender.send(note(message)).unwrap();
        let echoed = responses.blocking_message().unwrap().unwrap();
        assert_eq!(echoed.message, message);
    }
    drop(sender);
    assert_eq!(responses.blocking_message().unwrap(), None);
}
