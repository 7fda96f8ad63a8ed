//! Fuzz target: see `rpc_fuzz::metadata`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::metadata(data));
}
