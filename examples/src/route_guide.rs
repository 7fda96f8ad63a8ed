//! gRPC's route guide on rdma-rpc: one rpc of each kind over a feature
//! database made up here.
//!
//! - `GetFeature` (unary): the feature at a point, or an unnamed feature.
//! - `ListFeatures` (server streaming): every feature inside a rectangle.
//! - `RecordRoute` (client streaming): the summary of a route of points.
//! - `RouteChat` (bidirectional): notes left at points, shared by all calls.
//!
//! The database is a grid of [`GRID_ROWS`] × [`GRID_COLUMNS`] points,
//! [`GRID_STEP`] apart from [`GRID_ORIGIN`]; about three cells in five hold
//! a named feature. It is the same in every process ([`features`]).
//!
//! ```no_run
//! use examples::route_guide::RouteGuideService;
//! use examples::routeguide::route_guide_server::RouteGuideServer;
//!
//! let server = rpc_core::Server::builder()
//!     .add_service(RouteGuideServer::new(RouteGuideService::new()))
//!     .serve("tcp://0.0.0.0:10000")?;
//! # Ok::<(), rpc_core::Status>(())
//! ```

use crate::routeguide::route_guide_server::RouteGuide;
use crate::routeguide::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use rpc_core::{Request, Response, Status, Stream, Streaming};
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Instant;

/// The south-west corner of the database's grid: 40° N, 75° W.
pub const GRID_ORIGIN: Point = Point {
    latitude: 400_000_000,
    longitude: -750_000_000,
};
/// Distance between neighbouring grid points, in E7 degrees (0.05°).
pub const GRID_STEP: i32 = 500_000;
/// Rows of the grid (latitudes).
pub const GRID_ROWS: i32 = 20;
/// Columns of the grid (longitudes).
pub const GRID_COLUMNS: i32 = 25;

/// The mean radius of the Earth the distances use, in metres.
pub const EARTH_RADIUS_M: f64 = 6_371_000.0;

const ADJECTIVES: [&str; 10] = [
    "Old", "North", "South", "Upper", "Lower", "Cedar", "Maple", "Stone", "Green", "Red",
];
const NOUNS: [&str; 10] = [
    "Mill", "Bridge", "Farm", "Lake", "Trail", "Church", "School", "Park", "Station", "Quarry",
];

/// The feature database: named features on grid points, in row-major
/// order (south to north, then west to east). Deterministic.
pub fn features() -> Vec<Feature> {
    let mut rng = SplitMix64(0x726f_7574_6567_7569);
    let mut features = Vec::new();
    for row in 0..GRID_ROWS {
        for column in 0..GRID_COLUMNS {
            let pick = rng.next();
            if pick % 5 >= 3 {
                continue;
            }
            let adjective = ADJECTIVES[(pick >> 8) as usize % ADJECTIVES.len()];
            let noun = NOUNS[(pick >> 16) as usize % NOUNS.len()];
            features.push(Feature {
                name: format!("{adjective} {noun} {}", features.len() + 1),
                location: Some(Point {
                    latitude: GRID_ORIGIN.latitude + row * GRID_STEP,
                    longitude: GRID_ORIGIN.longitude + column * GRID_STEP,
                }),
            });
        }
    }
    features
}

/// `count` points picked at random, with `seed`, among the locations of
/// `features` (repeats allowed): a route to record.
pub fn random_route(features: &[Feature], count: usize, seed: u64) -> Vec<Point> {
    let mut rng = SplitMix64(seed);
    let locations: Vec<Point> = features.iter().filter_map(|f| f.location).collect();
    if locations.is_empty() {
        return Vec::new();
    }
    (0..count)
        .map(|_| locations[(rng.next() % locations.len() as u64) as usize])
        .collect()
}

/// The great-circle distance between two points in metres, rounded down,
/// by the haversine formula (as gRPC's route guide computes it).
pub fn distance(from: &Point, to: &Point) -> i32 {
    let radians = |e7: i32| (f64::from(e7) / 1e7).to_radians();
    let (lat1, lat2) = (radians(from.latitude), radians(to.latitude));
    let dlat = lat2 - lat1;
    let dlng = radians(to.longitude) - radians(from.longitude);
    let a = (dlat / 2.0).sin().powi(2) + lat1.cos() * lat2.cos() * (dlng / 2.0).sin().powi(2);
    let c = 2.0 * a.sqrt().atan2((1.0 - a).sqrt());
    (EARTH_RADIUS_M * c) as i32
}

/// A small deterministic generator (SplitMix64), so the database and
/// routes are the same everywhere without a dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The notes left so far, by location.
type Notes = Arc<Mutex<HashMap<Point, Vec<RouteNote>>>>;

/// The `RouteGuide` service: a read-only feature database and the route
/// notes every `RouteChat` call shares.
#[derive(Debug)]
pub struct RouteGuideService {
    features: Arc<[Feature]>,
    /// Where each location's feature is in `features`.
    by_location: HashMap<Point, usize>,
    notes: Notes,
}

impl Default for RouteGuideService {
    fn default() -> Self {
        RouteGuideService::new()
    }
}

impl RouteGuideService {
    /// A service over the example database ([`features`]), with no notes.
    pub fn new() -> RouteGuideService {
        RouteGuideService::with_features(features())
    }

    /// A service over `features`. Of features at the same location, the
    /// first is the one `GetFeature` returns.
    pub fn with_features(features: Vec<Feature>) -> RouteGuideService {
        let mut by_location = HashMap::new();
        for (i, feature) in features.iter().enumerate() {
            if let Some(location) = feature.location {
                by_location.entry(location).or_insert(i);
            }
        }
        RouteGuideService {
            features: features.into(),
            by_location,
            notes: Notes::default(),
        }
    }

    /// The feature database served.
    pub fn features(&self) -> &[Feature] {
        &self.features
    }

    fn feature_at(&self, point: &Point) -> Option<&Feature> {
        self.by_location.get(point).map(|&i| &self.features[i])
    }
}

impl RouteGuide for RouteGuideService {
    async fn get_feature(&self, request: Request<Point>) -> Result<Response<Feature>, Status> {
        let point = request.into_inner();
        let feature = self.feature_at(&point).cloned().unwrap_or(Feature {
            name: String::new(),
            location: Some(point),
        });
        Ok(Response::new(feature))
    }

    type ListFeaturesStream = FeaturesIn;

    async fn list_features(
        &self,
        request: Request<Rectangle>,
    ) -> Result<Response<FeaturesIn>, Status> {
        let bounds = Bounds::of(request.get_ref())?;
        Ok(Response::new(FeaturesIn {
            features: self.features.clone(),
            next: 0,
            bounds,
        }))
    }

    async fn record_route(
        &self,
        request: Request<Streaming<Point>>,
    ) -> Result<Response<RouteSummary>, Status> {
        let started = Instant::now();
        let mut points = request.into_inner();
        let mut summary = RouteSummary::default();
        let mut last = None;
        while let Some(point) = points.message().await? {
            summary.point_count = summary.point_count.saturating_add(1);
            if self.feature_at(&point).is_some() {
                summary.feature_count = summary.feature_count.saturating_add(1);
            }
            if let Some(last) = &last {
                summary.distance = summary.distance.saturating_add(distance(last, &point));
            }
            last = Some(point);
        }
        summary.elapsed_time = i32::try_from(started.elapsed().as_secs()).unwrap_or(i32::MAX);
        Ok(Response::new(summary))
    }

    type RouteChatStream = Chat;

    async fn route_chat(
        &self,
        request: Request<Streaming<RouteNote>>,
    ) -> Result<Response<Chat>, Status> {
        Ok(Response::new(Chat {
            incoming: request.into_inner(),
            notes: self.notes.clone(),
            replies: VecDeque::new(),
            done: false,
        }))
    }
}

/// A rectangle with its corners sorted: whichever two opposite corners the
/// request names, as gRPC's route guide reads them.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    south: i32,
    north: i32,
    west: i32,
    east: i32,
}

impl Bounds {
    fn of(rectangle: &Rectangle) -> Result<Bounds, Status> {
        let (Some(lo), Some(hi)) = (rectangle.lo, rectangle.hi) else {
            return Err(Status::invalid_argument("a rectangle needs both corners"));
        };
        Ok(Bounds {
            south: lo.latitude.min(hi.latitude),
            north: lo.latitude.max(hi.latitude),
            west: lo.longitude.min(hi.longitude),
            east: lo.longitude.max(hi.longitude),
        })
    }

    /// Whether `point` is inside, edges included.
    fn contains(&self, point: &Point) -> bool {
        (self.south..=self.north).contains(&point.latitude)
            && (self.west..=self.east).contains(&point.longitude)
    }
}

/// What `ListFeatures` streams: the features inside a rectangle, in
/// database order, found as the stream is read.
#[derive(Debug)]
pub struct FeaturesIn {
    features: Arc<[Feature]>,
    next: usize,
    bounds: Bounds,
}

impl Stream for FeaturesIn {
    type Item = Result<Feature, Status>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        while let Some(feature) = this.features.get(this.next) {
            this.next += 1;
            if feature
                .location
                .is_some_and(|point| this.bounds.contains(&point))
            {
                return Poll::Ready(Some(Ok(feature.clone())));
            }
        }
        Poll::Ready(None)
    }
}

/// What `RouteChat` streams: for each note the client sends, the notes left
/// earlier at the same location (by any call), then the note is kept.
#[derive(Debug)]
pub struct Chat {
    incoming: Streaming<RouteNote>,
    notes: Notes,
    /// Earlier notes not sent yet.
    replies: VecDeque<RouteNote>,
    /// The stream ended (its last item was an error).
    done: bool,
}

fn lock(notes: &Notes) -> MutexGuard<'_, HashMap<Point, Vec<RouteNote>>> {
    notes.lock().unwrap_or_else(|e| e.into_inner())
}

impl Stream for Chat {
    type Item = Result<RouteNote, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(note) = this.replies.pop_front() {
                return Poll::Ready(Some(Ok(note)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let note = match Pin::new(&mut this.incoming).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Ok(note))) => note,
                // The client gave up or went away.
                Poll::Ready(Some(Err(status))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(status)));
                }
            };
            let Some(location) = note.location else {
                this.done = true;
                return Poll::Ready(Some(Err(Status::invalid_argument(
                    "a route note needs a location",
                ))));
            };
            let mut notes = lock(&this.notes);
            let here = notes.entry(location).or_default();
            this.replies.extend(here.iter().cloned());
            here.push(note);
        }
    }
}
