//! Generates the Rust code of gRPC's interop test service
//! (`../proto/grpc/testing/test.proto` and what it imports): ours, by
//! rpc-codegen, and tonic's (tonic-build), for the tests that run stock
//! tonic clients against our servers.

use std::io;
use std::path::PathBuf;

fn main() -> io::Result<()> {
    let proto = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap()).join("../proto");
    let test_proto = proto.join("grpc/testing/test.proto");
    rpc_codegen::compile_protos(std::slice::from_ref(&test_proto), &[&proto])?;

    let tonic_out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("tonic");
    std::fs::create_dir_all(&tonic_out)?;
    let fds = protox::compile([&test_proto], [&proto])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e:?}")))?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(true)
        .out_dir(&tonic_out)
        .compile_fds(fds)
}
