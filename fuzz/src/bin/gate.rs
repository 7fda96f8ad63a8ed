//! Fuzz target: see `rpc_fuzz::gate`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::gate(data));
}
