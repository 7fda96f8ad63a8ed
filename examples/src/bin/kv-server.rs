//! Serves the example key-value store, and the standard health service
//! (`grpc.health.v1.Health`) reporting it.
//!
//! ```text
//! kv-server --listen tcp://0.0.0.0:7471
//! ```

use examples::kv::kv_server::KvServer;
use examples::services::KvStore;

fn main() {
    examples::init_logging("info");
    examples::cli::serve_until_killed("kv-server", KvServer::new(KvStore::new()));
}
