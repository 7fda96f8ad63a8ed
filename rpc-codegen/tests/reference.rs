//! The generated code for `proto/echo.proto`, `proto/kv.proto` and
//! `proto/route_guide.proto` (one rpc of each streaming kind), compared
//! byte for byte with the committed files in `tests/reference/`, so that any
//! change to the output is seen in review; with the descriptor sets the
//! code includes.
//!
//! After an intended change, bless the new output with
//! `RPC_CODEGEN_BLESS=1 cargo test -p rpc-codegen --test reference`.

use std::fs;
use std::path::{Path, PathBuf};

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Line and content of the first line where `expected` and `actual` differ.
fn first_difference(expected: &str, actual: &str) -> (usize, String, String) {
    let mut expected_lines = expected.lines();
    let mut actual_lines = actual.lines();
    let mut line = 1;
    loop {
        match (expected_lines.next(), actual_lines.next()) {
            (Some(e), Some(a)) if e == a => line += 1,
            (e, a) => {
                let show =
                    |l: Option<&str>| l.map_or("<end of file>".to_owned(), |l| format!("{l:?}"));
                return (line, show(e), show(a));
            }
        }
    }
}

fn check(generated_dir: &Path, file: &str) -> Result<(), String> {
    let actual = fs::read_to_string(generated_dir.join(file)).unwrap();
    let reference = manifest_dir().join("tests/reference").join(file);

    if std::env::var_os("RPC_CODEGEN_BLESS").is_some_and(|v| v == "1") {
        fs::write(&reference, &actual).unwrap();
        return Ok(());
    }

    let expected = fs::read_to_string(&reference).unwrap_or_default();
    if expected == actual {
        return Ok(());
    }
    let (line, e, a) = first_difference(&expected, &actual);
    Err(format!(
        "generated {file} differs from {}\n  first difference at line {line}:\n    \
         reference: {e}\n    generated: {a}\n  \
         if the change is intended, bless it with \
         `RPC_CODEGEN_BLESS=1 cargo test -p rpc-codegen --test reference` and commit the result",
        reference.display(),
    ))
}

#[test]
fn echo_kv_and_route_guide_match_reference() {
    let proto = manifest_dir().join("../proto");
    let out = tempfile::tempdir().unwrap();
    rpc_codegen::configure()
        .out_dir(out.path())
        .emit_rerun_if_changed(false)
        .compile(
            &[
                proto.join("echo.proto"),
                proto.join("kv.proto"),
                proto.join("route_guide.proto"),
            ],
            &[&proto],
        )
        .unwrap();

    let mut failures: Vec<String> = ["echo.rs", "kv.rs", "routeguide.rs"]
        .iter()
        .filter_map(|file| check(out.path(), file).err())
        .collect();
    // The descriptor sets the code includes (`FILE_DESCRIPTOR_SET`).
    for file in ["echo.fds.bin", "kv.fds.bin", "routeguide.fds.bin"] {
        let actual = fs::read(out.path().join(file)).unwrap();
        let reference = manifest_dir().join("tests/reference").join(file);
        if std::env::var_os("RPC_CODEGEN_BLESS").is_some_and(|v| v == "1") {
            fs::write(&reference, &actual).unwrap();
        } else if fs::read(&reference).unwrap_or_default() != actual {
            failures.push(format!(
                "generated {file} differs from {}: if intended, bless it (see above)",
                reference.display()
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}
