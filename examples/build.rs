//! Generates the Rust code of `../proto`: the example services (echo, kv and
//! gRPC's route guide), the test packages under `../proto/test`, and
//! `../proto/options` with prost options.

use std::io;
use std::path::PathBuf;

fn main() -> io::Result<()> {
    let proto = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap()).join("../proto");

    let mut protos = vec![
        proto.join("echo.proto"),
        proto.join("kv.proto"),
        proto.join("route_guide.proto"),
    ];
    let mut tests = Vec::new();
    for entry in std::fs::read_dir(proto.join("test"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "proto") {
            tests.push(path);
        }
    }
    tests.sort();
    protos.extend(tests);
    // A new file in proto/test must rerun this script too.
    println!("cargo:rerun-if-changed={}", proto.join("test").display());

    rpc_codegen::compile_protos(&protos, &[&proto])?;

    // Stock gRPC (tonic) clients and servers of the same files, for the
    // tests of the gRPC face: what another team's tonic code would be.
    let tonic_out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("tonic");
    std::fs::create_dir_all(&tonic_out)?;
    let health = proto.join("../rpc-core/proto");
    let fds = protox::compile(
        [
            proto.join("kv.proto"),
            proto.join("route_guide.proto"),
            health.join("grpc/health/v1/health.proto"),
        ],
        [&proto, &health],
    )
    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e:?}")))?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(true)
        .out_dir(&tonic_out)
        .compile_fds(fds)?;

    // The prost options real projects pass, into a directory of their own
    // (`acme.common` is referenced, not generated again).
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("options");
    std::fs::create_dir_all(&out)?;
    rpc_codegen::configure()
        .out_dir(&out)
        .vec_bytes(["."])
        .bytes([".acme.options.Blob.data"])
        .btree_map([".acme.options.Blob.labels"])
        .type_attribute(".acme.options.Key", "#[derive(PartialOrd, Ord)]")
        .field_attribute(
            ".acme.options.Blob.data",
            "#[doc = \"Set by a field attribute.\"]",
        )
        .boxed([".acme.options.Blob.key"])
        .extern_path(".acme.common", "crate::acme::common")
        .compile(&[proto.join("options/options.proto")], &[&proto])
}
