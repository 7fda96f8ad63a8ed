//! # rpc-codegen
//!
//! The code generator of rdma-rpc: turns `.proto` files into Rust messages, a
//! typed client and a server trait per service. Call it from `build.rs`; it
//! compiles the `.proto` files in pure Rust ([protox]), so no `protoc` is
//! needed on the machine.
//!
//! ## Quick start
//!
//! `Cargo.toml`:
//!
//! ```toml
//! [dependencies]
//! rpc-core = { path = "../rpc-core" }
//!
//! [build-dependencies]
//! rpc-codegen = { path = "../rpc-codegen" }
//! ```
//!
//! `build.rs`:
//!
//! ```no_run
//! fn main() -> std::io::Result<()> {
//!     rpc_codegen::compile_protos(&["proto/kv.proto"], &["proto"])
//! }
//! ```
//!
//! `src/lib.rs`, one module per protobuf package:
//!
//! ```ignore
//! pub mod kv {
//!     rpc_core::include_proto!("kv");
//! }
//! ```
//!
//! The generated code reaches the runtime only through `rpc_core::codegen`,
//! which re-exports `prost` and `prost-types`: the crate needs no `prost`
//! dependency of its own. Hand-written code names them as
//! `rpc_core::prost` (`use rpc_core::prost::Message;` to encode a message
//! itself) and `rpc_core::prost_types` (`Timestamp` and the other
//! well-known types).
//!
//! ## What is generated
//!
//! For a package `kv` with `service Kv { rpc Put(PutRequest) returns (PutReply); }`,
//! the file `$OUT_DIR/kv.rs` holds the prost messages and:
//!
//! - `kv_client::KvClient`: one method per rpc, `put(request) -> UnaryCall<PutReply>`;
//!   the call can be `.await`ed or waited on with `UnaryCall::wait`.
//! - `kv_server::Kv`: the trait a server implements, one method per rpc,
//!   `put(&self, Request<PutRequest>) -> Result<Response<PutReply>, Status>`.
//! - `kv_server::KvServer<T>`: wraps an implementation into an
//!   `rpc_core::Service` for the server.
//! - `kv_server::DESCRIPTOR`: the service's name and its rpcs with their paths
//!   (`/kv.Kv/Put`), stable ids and kinds.
//!
//! Streaming rpcs get the same items with streams where the proto says
//! `stream`, in the shape of tonic's. For gRPC's route guide:
//!
//! | rpc | client method | server trait method |
//! |---|---|---|
//! | `ListFeatures(Rectangle) returns (stream Feature)` | `list_features(request) -> Streaming<Feature>` | `list_features(&self, Request<Rectangle>) -> Result<Response<Self::ListFeaturesStream>, Status>` |
//! | `RecordRoute(stream Point) returns (RouteSummary)` | `record_route(stream) -> ClientStreamingCall<RouteSummary>` | `record_route(&self, Request<Streaming<Point>>) -> Result<Response<RouteSummary>, Status>` |
//! | `RouteChat(stream RouteNote) returns (stream RouteNote)` | `route_chat(stream) -> Streaming<RouteNote>` | `route_chat(&self, Request<Streaming<RouteNote>>) -> Result<Response<Self::RouteChatStream>, Status>` |
//!
//! - `Streaming<T>` holds the messages received: a `Stream` of
//!   `Result<T, Status>`, a blocking iterator of them through
//!   `IntoIterator`, or one at a time with `message().await` or
//!   `blocking_message()`.
//! - A client that streams requests passes any `Stream` of them (or a
//!   `Request` wrapping one). The blocking form of such a call,
//!   `record_route_sender(())` and `route_chat_sender(())`, returns a
//!   `RequestSender` to push requests with `send` and finish with `close`,
//!   beside the `ClientStreamingCall` or `Streaming` of the responses.
//! - A server that streams responses chooses their stream's type with the
//!   trait's associated type, `type ListFeaturesStream: Stream<Item =
//!   Result<Feature, Status>> + Send + 'static`.
//!
//! Messages are prost's, with one difference: a `bytes` field is a
//! `rpc_core::Bytes` (the `bytes` crate's), not a `Vec<u8>`. A large message
//! travels by rendezvous, read straight into a buffer of the receiver's, and
//! its `Bytes` fields are decoded as views of that buffer, without a copy;
//! set one with `payload: vec.into()` or `Bytes::from_static(b"...")`.
//! [`Builder::vec_bytes`] generates `Vec<u8>` instead, as prost and tonic
//! do.
//!
//! Proto comments on services and rpcs become doc comments. Rpc names that
//! are Rust keywords become raw identifiers (`r#type`), or get a trailing
//! underscore where Rust has no raw form (`self_`). On the client, rpcs named
//! like its own methods `new`, `connect`, `connect_async` and `channel` get a trailing
//! underscore too (`connect_`).
//!
//! ## What is rejected
//!
//! Names that cannot be told apart once generated: two rpcs whose method ids
//! collide, or whose Rust items would have the same name (the methods
//! `get_item` of `GetItem` and `get_item`, the blocking `upload_sender` of
//! `Upload` and the method of an rpc `UploadSender`, the associated types
//! `Get1Stream` of `Get_1` and `Get1`), and a message whose module would be
//! named like a service's. Errors are [`std::io::Error`]s of kind
//! [`InvalidInput`](std::io::ErrorKind::InvalidInput) whose message names the
//! offending rpcs.

mod generator;
mod names;
mod validate;

use prost::Message as _;
use prost_types::{FileDescriptorProto, FileDescriptorSet};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};

/// Compiles `protos` into Rust code in `$OUT_DIR`, one `<package>.rs` per
/// protobuf package, for use with `rpc_core::include_proto!`.
///
/// `includes` are the directories imports are resolved against; every file
/// in `protos` must lie under one of them (or be named relative to one).
/// The well-known types (`google/protobuf/*.proto`) are built in.
///
/// Prints `cargo:rerun-if-changed` for every `.proto` file read. Use
/// [`configure`] to change the output directory or turn that off.
///
/// # Errors
///
/// A `.proto` file that cannot be read or parsed, a method id collision, names
/// that would map to the same Rust item, or a failure to write the output.
pub fn compile_protos(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> io::Result<()> {
    configure().compile(protos, includes)
}

/// Returns a [`Builder`] with the defaults of [`compile_protos`].
pub fn configure() -> Builder {
    Builder {
        out_dir: None,
        emit_rerun_if_changed: true,
        bytes: Vec::new(),
        vec_bytes: Vec::new(),
        btree_map: Vec::new(),
        boxed: Vec::new(),
        attributes: Vec::new(),
        extern_paths: Vec::new(),
    }
}

/// Options for code generation; start with [`configure`].
///
/// Besides its own options it passes on the prost options real projects
/// use, with prost-build's meaning and path syntax: a path is a fully
/// qualified protobuf name with a leading dot (`.acme.Blob`,
/// `.acme.Blob.data`), a package prefix (`.acme`), or `.` for everything.
///
/// ```no_run
/// # fn main() -> std::io::Result<()> {
/// rpc_codegen::configure()
///     .vec_bytes([".acme.legacy"])                   // this package's bytes fields as `Vec<u8>`
///     .btree_map([".acme.Blob.labels"])              // this map as a `BTreeMap`
///     .type_attribute(".acme.Key", "#[derive(Eq, Hash)]")
///     .field_attribute(".acme.Blob.data", "#[doc = \"The blob's bytes.\"]")
///     .extern_path(".acme.common", "::acme_common")   // types from another crate
///     .compile(&["proto/acme.proto"], &["proto"])
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Builder {
    out_dir: Option<PathBuf>,
    emit_rerun_if_changed: bool,
    bytes: Vec<String>,
    vec_bytes: Vec<String>,
    btree_map: Vec<String>,
    boxed: Vec<String>,
    /// Attributes by what they go on, its path, and the attribute.
    attributes: Vec<(Target, String, String)>,
    extern_paths: Vec<(String, String)>,
}

/// What a prost attribute option puts its attribute on.
#[derive(Debug, Clone, Copy)]
enum Target {
    Type,
    Message,
    Enum,
    Field,
}

/// `paths` as owned strings.
fn owned<S: AsRef<str>>(paths: impl IntoIterator<Item = S>) -> impl Iterator<Item = String> {
    paths.into_iter().map(|p| p.as_ref().to_owned())
}

impl Builder {
    /// Writes the generated files into `out_dir` instead of `$OUT_DIR`.
    pub fn out_dir(mut self, out_dir: impl Into<PathBuf>) -> Self {
        self.out_dir = Some(out_dir.into());
        self
    }

    /// Whether to print `cargo:rerun-if-changed` for every `.proto` file read
    /// (default `true`; turn it off outside build scripts).
    pub fn emit_rerun_if_changed(mut self, emit: bool) -> Self {
        self.emit_rerun_if_changed = emit;
        self
    }

    /// Generates `bytes` fields matching `paths` as `Vec<u8>` instead of
    /// [`bytes::Bytes`], as prost-build and tonic do by default;
    /// `vec_bytes(["."])` for all of them.
    ///
    /// By default every `bytes` field is a `Bytes`: a large message, which
    /// travels by rendezvous, is then decoded without copying the field out
    /// of the buffer it was read into, and the field shares that buffer
    /// until dropped (on rdma:// registered memory, which goes back to the
    /// registration cache then). A `Vec<u8>` field costs a copy per message
    /// and holds only its own bytes.
    ///
    /// [`bytes::Bytes`]: https://docs.rs/bytes/1/bytes/struct.Bytes.html
    pub fn vec_bytes<S: AsRef<str>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.vec_bytes.extend(owned(paths));
        self
    }

    /// Keeps `bytes` fields matching `paths` as `Bytes` where a
    /// [`vec_bytes`](Self::vec_bytes) path matches them too (prost-build's
    /// `bytes`). Every `bytes` field is a `Bytes` unless `vec_bytes` says
    /// otherwise, so this only narrows `vec_bytes`:
    /// `.vec_bytes(["."]).bytes([".acme.Blob.data"])` makes that one field
    /// a `Bytes` and every other a `Vec<u8>`.
    pub fn bytes<S: AsRef<str>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.bytes.extend(owned(paths));
        self
    }

    /// Generates map fields matching `paths` as `BTreeMap` instead of
    /// `HashMap` (prost-build's `btree_map`).
    ///
    /// The crate must then depend on `prost` itself (the version rpc-core
    /// uses): prost-derive's `Debug` for such a field names `::prost`
    /// directly, whatever the generated code's prost path.
    pub fn btree_map<S: AsRef<str>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.btree_map.extend(owned(paths));
        self
    }

    /// Adds `attribute` to the messages, enums and oneofs matching `path`
    /// (prost-build's `type_attribute`).
    pub fn type_attribute(self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.attribute(Target::Type, path, attribute)
    }

    /// Adds `attribute` to the messages matching `path` (prost-build's
    /// `message_attribute`).
    pub fn message_attribute(self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.attribute(Target::Message, path, attribute)
    }

    /// Adds `attribute` to the enums and oneofs matching `path`
    /// (prost-build's `enum_attribute`).
    pub fn enum_attribute(self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.attribute(Target::Enum, path, attribute)
    }

    /// Adds `attribute` to the fields matching `path` (prost-build's
    /// `field_attribute`).
    pub fn field_attribute(self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.attribute(Target::Field, path, attribute)
    }

    /// Uses the Rust path `rust_path` for the protobuf package or type
    /// `proto_path` instead of generating it, for types another crate
    /// already generated (prost-build's `extern_path`).
    pub fn extern_path(mut self, proto_path: impl AsRef<str>, rust_path: impl AsRef<str>) -> Self {
        self.extern_paths.push((
            proto_path.as_ref().to_owned(),
            rust_path.as_ref().to_owned(),
        ));
        self
    }

    /// Boxes the message fields matching `paths` (prost-build's `boxed`),
    /// for large or recursive messages.
    pub fn boxed<S: AsRef<str>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.boxed.extend(owned(paths));
        self
    }

    /// The paths to pass as prost-build's `bytes`: every field, unless a
    /// `vec_bytes` path matches it and no `bytes` path does.
    fn bytes_paths(&self, fds: &FileDescriptorSet) -> Vec<String> {
        if self.vec_bytes.is_empty() {
            return vec![".".to_owned()];
        }
        let matches = |paths: &[String], field: &str| {
            paths.iter().any(|p| prost_sub_paths(field).any(|s| s == p))
        };
        bytes_fields(fds)
            .into_iter()
            .filter(|f| !matches(&self.vec_bytes, f) || matches(&self.bytes, f))
            .collect()
    }

    fn attribute(
        mut self,
        target: Target,
        path: impl AsRef<str>,
        attribute: impl AsRef<str>,
    ) -> Self {
        self.attributes.push((
            target,
            path.as_ref().to_owned(),
            attribute.as_ref().to_owned(),
        ));
        self
    }

    /// Compiles `protos`, resolving imports against `includes`; see
    /// [`compile_protos`].
    ///
    /// # Errors
    ///
    /// As [`compile_protos`].
    pub fn compile(
        &self,
        protos: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> io::Result<()> {
        let out_dir = match &self.out_dir {
            Some(dir) => dir.clone(),
            None => std::env::var_os("OUT_DIR")
                .map(PathBuf::from)
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        "OUT_DIR is not set: call rpc-codegen from a build script, \
                     or set an output directory with Builder::out_dir",
                    )
                })?,
        };

        for proto in protos {
            let proto = proto.as_ref();
            let found = proto.exists() || includes.iter().any(|i| i.as_ref().join(proto).exists());
            if !found {
                let dirs: Vec<String> = includes
                    .iter()
                    .map(|i| i.as_ref().display().to_string())
                    .collect();
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    Message(format!(
                        "{}: no such file (looked for it as given and under the include \
                         paths: {})",
                        proto.display(),
                        dirs.join(", ")
                    )),
                ));
            }
        }
        let mut compiler = protox::Compiler::new(includes).map_err(protox_error)?;
        compiler
            .include_imports(true)
            .include_source_info(true)
            .open_files(protos)
            .map_err(protox_error)?;

        if self.emit_rerun_if_changed {
            // Files from the include dirs have a path; the built-in
            // well-known types do not.
            for file in compiler.files() {
                if let Some(path) = file.path() {
                    println!("cargo:rerun-if-changed={}", path.display());
                }
            }
        }

        let fds = compiler.file_descriptor_set();
        validate::validate(&fds)?;
        write_descriptor_sets(&fds, &out_dir)?;

        let mut config = prost_build::Config::new();
        config
            .prost_path("::rpc_core::codegen::prost")
            .prost_types_path("::rpc_core::codegen::prost_types")
            .service_generator(Box::new(generator::ServiceGenerator))
            .out_dir(out_dir)
            .bytes(self.bytes_paths(&fds))
            .btree_map(&self.btree_map);
        for path in &self.boxed {
            config.boxed(path);
        }
        for (target, path, attribute) in &self.attributes {
            match target {
                Target::Type => config.type_attribute(path, attribute),
                Target::Message => config.message_attribute(path, attribute),
                Target::Enum => config.enum_attribute(path, attribute),
                Target::Field => config.field_attribute(path, attribute),
            };
        }
        for (proto_path, rust_path) in &self.extern_paths {
            config.extern_path(proto_path, rust_path);
        }
        config.compile_fds(fds)
    }
}

/// The fully qualified paths by which prost-build looks up whether a field
/// is a `Bytes`: each `bytes` field's (`.pkg.Message.field`), and for a
/// map with `bytes` values, `.pkg.Message.value` (prost-build looks up a
/// map's value type by the name of the map entry's value field).
fn bytes_fields(fds: &FileDescriptorSet) -> Vec<String> {
    use prost_types::DescriptorProto;
    use prost_types::field_descriptor_proto::Type;
    fn walk(scope: &str, message: &DescriptorProto, out: &mut Vec<String>) {
        let name = format!("{scope}.{}", message.name());
        for field in &message.field {
            if field.r#type() == Type::Bytes {
                out.push(format!("{name}.{}", field.name()));
            }
        }
        for nested in &message.nested_type {
            let map_value = nested
                .options
                .as_ref()
                .is_some_and(|o| o.map_entry())
                .then(|| nested.field.iter().find(|f| f.number() == 2))
                .flatten();
            match map_value {
                Some(value) if value.r#type() == Type::Bytes => {
                    out.push(format!("{name}.{}", value.name()));
                }
                Some(_) => {}
                None => walk(&name, nested, out),
            }
        }
    }
    let mut out = Vec::new();
    for file in &fds.file {
        let scope = match file.package() {
            "" => String::new(),
            package => format!(".{package}"),
        };
        for message in &file.message_type {
            walk(&scope, message, &mut out);
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The paths that select `full` in prost-build's path syntax: itself, its
/// suffixes without the leading dot (`b.c`, `c` of `.a.b.c`), its
/// prefixes (`.a.b`, `.a`) and `.`.
fn prost_sub_paths(full: &str) -> impl Iterator<Item = &str> {
    let suffixes = std::iter::successors(Some(full), |p| {
        p.split_once('.').map(|x| x.1).filter(|p| !p.is_empty())
    })
    .skip(1);
    let prefixes = std::iter::successors(Some(full), |p| {
        p.rsplit_once('.').map(|x| x.0).filter(|p| !p.is_empty())
    })
    .skip(1);
    std::iter::once(full)
        .chain(suffixes)
        .chain(prefixes)
        .chain(std::iter::once("."))
}

/// Writes, for each package that declares a service, the
/// `FileDescriptorSet` of its files and everything they import (in the
/// order of `fds`, which lists a file after its imports), for the
/// package's generated `FILE_DESCRIPTOR_SET`.
fn write_descriptor_sets(fds: &FileDescriptorSet, out_dir: &Path) -> io::Result<()> {
    let by_name: HashMap<&str, &FileDescriptorProto> =
        fds.file.iter().map(|f| (f.name(), f)).collect();
    let mut packages: Vec<&str> = fds
        .file
        .iter()
        .filter(|f| !f.service.is_empty())
        .map(|f| f.package())
        .collect();
    packages.sort_unstable();
    packages.dedup();
    for package in packages {
        let mut needed = HashSet::new();
        let mut todo: Vec<&str> = fds
            .file
            .iter()
            .filter(|f| f.package() == package)
            .map(|f| f.name())
            .collect();
        while let Some(name) = todo.pop() {
            if needed.insert(name) {
                if let Some(file) = by_name.get(name) {
                    todo.extend(file.dependency.iter().map(String::as_str));
                }
            }
        }
        let set = FileDescriptorSet {
            file: fds
                .file
                .iter()
                .filter(|f| needed.contains(f.name()))
                .cloned()
                .collect(),
        };
        let path = out_dir.join(generator::descriptor_file_name(package));
        write_if_changed(&path, &set.encode_to_vec())?;
    }
    Ok(())
}

/// Writes `bytes` to `path` unless it holds them already (an unchanged
/// file keeps its time, so cargo does not rebuild what includes it).
fn write_if_changed(path: &Path, bytes: &[u8]) -> io::Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    std::fs::write(path, bytes)
}

/// protox's `Debug` form carries `file:line:column:` where it knows them.
fn protox_error(err: protox::Error) -> io::Error {
    invalid_input(format!("{err:?}"))
}

/// An `InvalidInput` error carrying `message`.
pub(crate) fn invalid_input(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, Message(message))
}

/// An error message whose `Debug` is its text, so that a build script's
/// `fn main() -> io::Result<()>`, which prints errors with `Debug`, shows a
/// multi-line message as lines rather than as one escaped string.
struct Message(String);

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Message {}
