//! Benchmarks of rdma-rpc.
//!
//! `cargo bench -p benches` runs the criterion micro-benchmarks of the pure
//! protocol code (frame headers, doorbells, ring allocation, credits, the
//! call table): no NIC, no threads, so they are stable enough to compare
//! commits. End-to-end latency and throughput binaries that compare against
//! baselines in the same run are to come.
