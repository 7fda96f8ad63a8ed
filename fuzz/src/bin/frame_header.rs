//! Fuzz target: see `rpc_fuzz::frame_header`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::frame_header(data));
}
