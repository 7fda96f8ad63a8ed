//! Benchmarks of rdma-rpc, in two tiers.
//!
//! - `cargo bench -p benches` runs the criterion micro-benchmarks of the pure
//!   protocol code (frame headers, doorbells, ring allocation, credits, the
//!   call table): no NIC, no threads, so they are stable enough to compare
//!   commits.
//! - `rpc-bench` measures unary echo calls end to end against an embedded
//!   server, and a baseline in the same invocation: gRPC over tonic
//!   ([`tonic_baseline`]), perftest's raw verbs figures ([`perftest`]), or a
//!   crossbeam-channel ping-pong ([`channel_baseline`]). With `--stream` it
//!   measures server streaming instead: messages per second and CPU time
//!   per message of echo's `Stream` calls ([`stream`]), against tonic's
//!   server streaming or `ib_write_bw`. The in-process
//!   baselines alternate with our run in rounds
//!   ([`measure::interleave`]), so that the load of a shared machine
//!   weighs on both alike. `scripts/bench`
//!   sweeps sizes, concurrency and fabrics, and `bench-report` turns the
//!   results into `benches/REPORT.md` ([`report`]).
//!
//! ```text
//! cargo run --release -p benches --bin rpc-bench -- \
//!     --url tcp://127.0.0.1:0 --size 64 --calls 20000 --concurrency 8 --baseline tonic
//! ```

pub mod channel_baseline;
pub mod cli;
pub mod measure;
pub mod payload;
pub mod perftest;
pub mod report;
pub mod rpc;
pub mod stream;
pub mod svg;
pub mod tls;
pub mod tonic_baseline;

pub use cli::{Baseline, Options};
pub use measure::{Kind, Measurement, Mode};
