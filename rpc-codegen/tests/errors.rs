//! Protos that rpc-codegen must reject, with messages that name the problem,
//! and properties of the generated code that the reference files do not spell
//! out.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles `protos` into a fresh temporary directory.
fn compile(protos: &[&Path], includes: &[&Path]) -> io::Result<tempfile::TempDir> {
    compile_with(rpc_codegen::configure(), protos, includes)
}

/// Compiles `protos` with `config` into a fresh temporary directory.
fn compile_with(
    config: rpc_codegen::Builder,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> io::Result<tempfile::TempDir> {
    let out = tempfile::tempdir()?;
    config
        .out_dir(out.path())
        .emit_rerun_if_changed(false)
        .compile(protos, includes)?;
    Ok(out)
}

/// Writes `files` (name, content) into a fresh temporary directory.
fn proto_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, content) in files {
        fs::write(dir.path().join(name), content).unwrap();
    }
    dir
}

/// Two rpc names of `collide.Svc` whose paths have the same method id, found
/// by the birthday paradox: about 2^16 names for a 32-bit hash.
fn colliding_method_names() -> (String, String) {
    let mut seen: HashMap<u32, String> = HashMap::new();
    for i in 0u32.. {
        let name = format!("M{i}");
        let id = rpc_core::codegen::method_id(&format!("/collide.Svc/{name}"));
        if let Some(first) = seen.insert(id, name.clone()) {
            return (first, name);
        }
    }
    unreachable!("a 32-bit hash collides long before 2^32 names")
}

#[test]
fn method_id_collision_is_rejected_naming_both_paths() {
    let (a, b) = colliding_method_names();
    let proto = format!(
        "syntax = \"proto3\";
         package collide;
         message M {{}}
         service Svc {{
           rpc {a}(M) returns (M);
           rpc Other(M) returns (M);
           rpc {b}(M) returns (M);
         }}"
    );
    let dir = proto_dir(&[("collide.proto", &proto)]);
    let err = compile(&[&dir.path().join("collide.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);

    let message = err.to_string();
    let id = rpc_core::codegen::method_id(&format!("/collide.Svc/{a}"));
    assert!(
        message.contains(&format!(
            "method id collision: `/collide.Svc/{a}` and `/collide.Svc/{b}` both hash to 0x{:04x}_{:04x}",
            id >> 16,
            id & 0xffff
        )),
        "{message}"
    );
}

#[test]
fn rpcs_mapping_to_one_rust_name_are_rejected() {
    let dir = proto_dir(&[(
        "dup.proto",
        "syntax = \"proto3\";
         package dup;
         message M {}
         service Svc {
           rpc GetItem(M) returns (M);
           rpc get_item(M) returns (M);
         }",
    )]);
    let err = compile(&[&dir.path().join("dup.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let message = err.to_string();
    assert!(
        message.contains(
            "rpcs `dup.Svc.GetItem` and `dup.Svc.get_item` would both generate the Rust method `get_item`"
        ),
        "{message}"
    );
}

#[test]
fn blocking_sender_clashing_with_another_rpc_is_rejected() {
    let dir = proto_dir(&[(
        "sender.proto",
        "syntax = \"proto3\";
         package sender;
         message M {}
         service Svc {
           rpc UploadSender(M) returns (M);
           rpc Upload(stream M) returns (M);
           rpc Chat(stream M) returns (stream M);
           rpc chat_sender(M) returns (stream M);
           // Only client-streaming and bidirectional rpcs have a sender.
           rpc Watch(M) returns (stream M);
           rpc WatchSender(M) returns (M);
         }",
    )]);
    let err = compile(&[&dir.path().join("sender.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(
        err.to_string(),
        "rpcs `sender.Svc.Upload` and `sender.Svc.UploadSender` would both generate \
         the client method `upload_sender` (the blocking form of `Upload`); rename one of them\n\
         rpcs `sender.Svc.Chat` and `sender.Svc.chat_sender` would both generate \
         the client method `chat_sender` (the blocking form of `Chat`); rename one of them"
    );
}

#[test]
fn response_stream_types_clashing_are_rejected() {
    // Distinct Rust methods `get_1` and `get1`, but one associated type
    // `Get1Stream` in the server trait.
    let dir = proto_dir(&[(
        "streams.proto",
        "syntax = \"proto3\";
         package streams;
         message M {}
         service Svc {
           rpc Get_1(M) returns (stream M);
           rpc Get1(stream M) returns (stream M);
         }",
    )]);
    let err = compile(&[&dir.path().join("streams.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(
        err.to_string(),
        "rpcs `streams.Svc.Get_1` and `streams.Svc.Get1` would both generate the \
         associated type `Get1Stream` of the server trait; rename one of them"
    );
}

#[test]
fn message_module_clashing_with_service_module_is_rejected() {
    let dir = proto_dir(&[(
        "clash.proto",
        "syntax = \"proto3\";
         package clash;
         message M {}
         // Its nested enum puts it in a module `kv_server`.
         message KvServer { enum State { STATE_UNSPECIFIED = 0; } }
         // Only a map: no module, no clash.
         message KvClient { map<string, string> labels = 1; optional int32 x = 2; }
         service Kv { rpc Get(M) returns (M); }",
    )]);
    let err = compile(&[&dir.path().join("clash.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "message `clash.KvServer` (in clash.proto) and service `clash.Kv` would both \
         generate the module `kv_server`; rename one of them"
    );
}

#[test]
fn missing_import_names_the_file() {
    let dir = proto_dir(&[(
        "main.proto",
        "syntax = \"proto3\";
         package main;
         import \"does/not/exist.proto\";
         message M {}",
    )]);
    let err = compile(&[&dir.path().join("main.proto")], &[dir.path()]).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("does/not/exist.proto"), "{message}");
    assert!(message.contains("main.proto"), "{message}");
}

#[test]
fn a_missing_proto_is_named_as_missing() {
    let dir = proto_dir(&[]);
    let err = compile(&[Path::new("proto/nosuch.proto")], &[dir.path()]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound);
    let message = err.to_string();
    assert!(
        message.contains("proto/nosuch.proto: no such file"),
        "{message}"
    );
    assert!(
        message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    // Its Debug form, which a build script's `main` prints, says the same.
    assert!(format!("{err:?}").contains("no such file"), "{err:?}");
}

#[test]
fn parse_error_names_file_and_line() {
    let dir = proto_dir(&[(
        "broken.proto",
        "syntax = \"proto3\";\npackage broken;\nmessage M { int32 x = ; }\n",
    )]);
    let err = compile(&[&dir.path().join("broken.proto")], &[dir.path()]).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("broken.proto:3:"), "{message}");
}

#[test]
fn proto_comments_become_docs_and_uncommented_items_get_defaults() {
    let dir = proto_dir(&[(
        "docs.proto",
        "syntax = \"proto3\";
         package docs;
         // A message.
         message M {}
         // The service's comment,
         // on two lines.
         service Documented {
           // The rpc's comment.
           rpc Commented(M) returns (M);
           rpc Bare(M) returns (M);
         }
         service Bare {
           rpc Call(M) returns (M);
           rpc Upload(stream M) returns (M);
           rpc Watch(M) returns (stream M);
         }",
    )]);
    let out = compile(&[&dir.path().join("docs.proto")], &[dir.path()]).unwrap();
    let code = fs::read_to_string(out.path().join("docs.rs")).unwrap();

    for expected in [
        // From the proto, on the client module, client struct and server trait.
        "/// Generated client for `docs.Documented`.\n///\n/// The service's comment,\n/// on two lines.\npub mod documented_client {",
        "    /// The service's comment,\n    /// on two lines.\n    #[derive(Debug, Clone)]\n    pub struct DocumentedClient {",
        "    /// The service's comment,\n    /// on two lines.\n    ///\n    /// Implement the methods as `async fn`.",
        "    pub trait Documented:",
        "        /// The rpc's comment.\n        pub fn commented(",
        "        /// The rpc's comment.\n        fn commented(",
        // Defaults where the proto has no comment.
        "        /// Calls the `Bare` rpc of `docs.Documented`.\n        pub fn bare(",
        "        /// Handles the `Bare` rpc of `docs.Documented`.\n        fn bare(",
        "/// Generated client for `docs.Bare`.\npub mod bare_client {",
        "    /// Client for the `docs.Bare` service.\n",
        "    /// The `docs.Bare` service: implement it, and serve it with [`BareServer`].\n",
        // Streaming rpcs: the blocking form and the response stream type.
        "        /// Calls the `Upload` rpc of `docs.Bare`.\n        ///\n        /// Sends the requests of a stream. The blocking form is\n        /// [`Self::upload_sender`].\n        pub fn upload(",
        "        /// Calls the `Upload` rpc of `docs.Bare`.\n        ///\n        /// The blocking form of [`Self::upload`]: send each request with\n",
        "        /// for the defaults.\n        pub fn upload_sender(",
        "        /// The stream of responses of `Watch`.\n        type WatchStream:",
        "        /// Handles the `Watch` rpc of `docs.Bare`.\n        fn watch(",
    ] {
        assert!(code.contains(expected), "{expected:?} not in:\n{code}");
    }
}

#[test]
fn streaming_rpcs_named_like_keywords_or_client_methods() {
    let dir = proto_dir(&[(
        "names.proto",
        "syntax = \"proto3\";
         package names;
         message M {}
         service Svc {
           rpc Type(stream M) returns (stream M);
           rpc Connect(stream M) returns (M);
           rpc Self(M) returns (stream M);
         }",
    )]);
    let out = compile(&[&dir.path().join("names.proto")], &[dir.path()]).unwrap();
    let code = fs::read_to_string(out.path().join("names.rs")).unwrap();
    for expected in [
        "        /// [`Self::type_sender`].\n        pub fn r#type(",
        // Intra-doc links cannot name a raw identifier.
        "        /// The blocking form of `r#type`: send each request with\n",
        "        pub fn type_sender(",
        "        type TypeStream:",
        "        fn r#type(",
        "        /// [`Self::connect_sender`].\n        pub fn connect_(",
        "        /// The blocking form of [`Self::connect_`]: send each request with\n",
        "        pub fn connect_sender(",
        "        type SelfStream:",
        "        ) -> ::rpc_core::codegen::Streaming<super::M> {\n            ::rpc_core::codegen::server_streaming(",
        "        fn self_(",
    ] {
        assert!(code.contains(expected), "{expected:?} not in:\n{code}");
    }
}

#[test]
fn rpcs_of_an_imported_file_are_checked_too() {
    let dir = proto_dir(&[
        (
            "lib.proto",
            "syntax = \"proto3\";
             package lib;
             message M {}
             service Watch {
               rpc Follow(M) returns (stream M);
               rpc follow(M) returns (stream M);
             }",
        ),
        (
            "app.proto",
            "syntax = \"proto3\";
             package app;
             import \"lib.proto\";
             message N { lib.M m = 1; }",
        ),
    ]);
    let err = compile(&[&dir.path().join("app.proto")], &[dir.path()]).unwrap_err();
    assert!(
        err.to_string()
            .contains("rpcs `lib.Watch.Follow` and `lib.Watch.follow` would both"),
        "{err}"
    );
}

#[test]
fn a_file_without_package_generates_underscore_rs() {
    let dir = proto_dir(&[(
        "bare.proto",
        "syntax = \"proto3\";
         // A message.
         message M {}
         // A service.
         service Top { rpc Call(M) returns (M); }",
    )]);
    let out = compile(&[&dir.path().join("bare.proto")], &[dir.path()]).unwrap();
    let code = fs::read_to_string(out.path().join("_.rs")).unwrap();
    assert!(code.contains("name: \"Top\","), "{code}");
    assert!(code.contains("path: \"/Top/Call\","), "{code}");
}

#[test]
fn missing_out_dir_is_reported() {
    if std::env::var_os("OUT_DIR").is_some() {
        return;
    }
    let protos = manifest_dir().join("../proto");
    let err = rpc_codegen::configure()
        .emit_rerun_if_changed(false)
        .compile(&[protos.join("kv.proto")], &[&protos])
        .unwrap_err();
    assert!(err.to_string().contains("OUT_DIR is not set"), "{err}");
}

/// Each `bytes` field of `blobs.proto` compiled with `config`, by name, and
/// whether it came out as `Bytes` (else `Vec<u8>`).
fn bytes_fields(config: rpc_codegen::Builder) -> Vec<(&'static str, bool)> {
    let dir = proto_dir(&[(
        "blobs.proto",
        r#"syntax = "proto3";
package t;
message Outer {
  bytes blob = 1;
  message Inner { bytes raw = 1; }
  Inner inner = 2;
  oneof choice { bytes chosen = 3; string other = 4; }
  map<string, bytes> parts = 5;
}
"#,
    )]);
    let out = compile_with(config, &[dir.path().join("blobs.proto")], &[dir.path()]).unwrap();
    let code = fs::read_to_string(out.path().join("t.rs")).unwrap();
    // The declaration that begins with `start`, up to the next attribute
    // or the end of its item (rustfmt may break a type over lines).
    let line = |start: &str| -> &str {
        let at = code
            .find(start)
            .unwrap_or_else(|| panic!("no `{start}` in\n{code}"));
        let rest = &code[at..];
        &rest[..rest.find(['#', '}']).unwrap_or(rest.len())]
    };
    let bytes = "::rpc_core::codegen::prost::bytes::Bytes";
    vec![
        ("blob", line("pub blob:").contains(bytes)),
        ("raw", line("pub raw:").contains(bytes)),
        ("chosen", line("Chosen(").contains(bytes)),
        ("parts", line("pub parts:").contains(bytes)),
    ]
}

#[test]
fn bytes_fields_are_bytes_unless_vec_bytes_says() {
    let all = |b| vec![("blob", b), ("raw", b), ("chosen", b), ("parts", b)];
    assert_eq!(bytes_fields(rpc_codegen::configure()), all(true));
    assert_eq!(
        bytes_fields(rpc_codegen::configure().vec_bytes(["."])),
        all(false)
    );
    // `bytes` narrows `vec_bytes`, by any of prost's path forms.
    assert_eq!(
        bytes_fields(
            rpc_codegen::configure()
                .vec_bytes([".t"])
                .bytes([".t.Outer.Inner", "Outer.chosen"])
        ),
        [
            ("blob", false),
            ("raw", true),
            ("chosen", true),
            ("parts", false)
        ]
    );
    // A map's values go by the map's message (prost's lookup names the
    // entry's `value` field).
    assert_eq!(
        bytes_fields(rpc_codegen::configure().vec_bytes([".t.Outer.blob", ".t.Outer.Inner"])),
        [
            ("blob", false),
            ("raw", false),
            ("chosen", true),
            ("parts", true)
        ]
    );
}
