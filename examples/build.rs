//! Generates the Rust code of `../proto`: the example services and the test
//! packages under `../proto/test`.

use std::io;
use std::path::PathBuf;

fn main() -> io::Result<()> {
    let proto = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap()).join("../proto");

    let mut protos = vec![proto.join("echo.proto"), proto.join("kv.proto")];
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

    rpc_codegen::compile_protos(&protos, &[proto])
}
