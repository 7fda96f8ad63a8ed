//! Generates the tonic (gRPC) code of `../proto/echo.proto` for the tonic
//! baseline of `rpc-bench`. No `protoc`: protox compiles the file in pure
//! Rust and tonic-prost-build generates from its descriptor set.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("no CARGO_MANIFEST_DIR")?);
    let proto = manifest.join("../proto");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("no OUT_DIR")?).join("tonic");
    std::fs::create_dir_all(&out)?;
    let fds = protox::compile([proto.join("echo.proto")], [&proto])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(true)
        .out_dir(&out)
        .compile_fds(fds)?;
    println!(
        "cargo:rerun-if-changed={}",
        proto.join("echo.proto").display()
    );
    Ok(())
}
