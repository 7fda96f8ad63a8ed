//! Fuzz target: see `rpc_fuzz::tcp_wire`.
fn main() {
    afl::fuzz!(|data: &[u8]| rpc_fuzz::tcp_wire(data));
}
