//! The code and descriptors generated from `rpc-core/proto` are committed
//! (rpc-core has no build script); this checks them against what the
//! `.proto` files make today. `RPC_REGENERATE=1 cargo test -p rpc-core
//! --test generated_protos` writes them anew.

use prost::Message;
use std::path::{Path, PathBuf};

/// The committed files and what they should hold.
fn expected() -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let proto = root.join("proto");
    let files = [
        ("grpc/health/v1/health.proto", "src/health/health.fds.bin"),
        (
            "grpc/reflection/v1/reflection.proto",
            "src/reflection/reflection.fds.bin",
        ),
    ];
    let mut compiler = protox::Compiler::new([&proto]).unwrap();
    compiler
        .include_imports(true)
        .include_source_info(true)
        .open_files(files.iter().map(|(p, _)| *p))
        .unwrap();
    let fds = compiler.file_descriptor_set();

    let mut out = Vec::new();
    for (name, path) in files {
        // Each file on its own (neither imports anything).
        let file = fds.file.iter().find(|f| f.name() == name).unwrap().clone();
        assert!(file.dependency.is_empty(), "{name} imports: list them too");
        let set = prost_types::FileDescriptorSet { file: vec![file] };
        out.push((root.join(path), set.encode_to_vec()));
    }

    // The reflection messages, as prost-build writes them.
    let dir = tempfile::tempdir().unwrap();
    let only_reflection = prost_types::FileDescriptorSet {
        file: fds
            .file
            .iter()
            .filter(|f| f.package() == "grpc.reflection.v1")
            .cloned()
            .collect(),
    };
    prost_build::Config::new()
        .out_dir(dir.path())
        .compile_fds(only_reflection)
        .unwrap();
    let code = std::fs::read(dir.path().join("grpc.reflection.v1.rs")).unwrap();
    out.push((root.join("src/reflection/grpc.reflection.v1.rs"), code));
    out
}

#[test]
fn committed_code_and_descriptors_match_the_protos() {
    let regenerate = std::env::var_os("RPC_REGENERATE").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (path, want) in expected() {
        let have = std::fs::read(&path).unwrap_or_default();
        if have != want {
            if regenerate {
                std::fs::write(&path, &want).unwrap();
            } else {
                stale.push(rel(&path));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "out of date with rpc-core/proto: {stale:?}; run \
         `RPC_REGENERATE=1 cargo test -p rpc-core --test generated_protos`"
    );
}

fn rel(path: &Path) -> String {
    path.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(path)
        .display()
        .to_string()
}
