//! Fuzz target: see `rpc_fuzz::server`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::server(data));
}
