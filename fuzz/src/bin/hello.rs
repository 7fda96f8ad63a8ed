//! Fuzz target: see `rpc_fuzz::hello`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::hello(data));
}
