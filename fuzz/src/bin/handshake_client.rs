//! Fuzz target: see `rpc_fuzz::handshake_client`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::handshake_client(data));
}
