//! Serves gRPC's route guide over the example feature database, and the
//! standard health service (`grpc.health.v1.Health`) reporting it.
//!
//! ```text
//! route-guide-server --listen tcp://0.0.0.0:10000
//! ```

use examples::route_guide::RouteGuideService;
use examples::routeguide::route_guide_server::RouteGuideServer;

fn main() {
    examples::init_logging("info");
    examples::cli::serve_until_killed(
        "route-guide-server",
        RouteGuideServer::new(RouteGuideService::new()),
    );
}
