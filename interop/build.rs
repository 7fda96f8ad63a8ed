//! Generates the Rust code of gRPC's interop test service
//! (`../proto/grpc/testing/test.proto` and what it imports).

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let proto = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap()).join("../proto");
    rpc_codegen::compile_protos(&[proto.join("grpc/testing/test.proto")], &[&proto])
}
