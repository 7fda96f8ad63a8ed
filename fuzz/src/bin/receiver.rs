//! Fuzz target: see `rpc_fuzz::receiver`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::receiver(data));
}
