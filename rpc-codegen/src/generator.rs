//! The `prost_build::ServiceGenerator` that emits, per service, a client
//! module and a server module.
//!
//! The code is written as plain text; prost-build parses the whole package
//! file with `syn` and prints it with `prettyplease` afterwards, so layout
//! here does not matter, only validity. Everything from the runtime is named
//! by its full path through `::rpc_core::codegen`, and std items by
//! `::core::...` paths, so that no proto name (a service called `Sync` or
//! `Result`) can shadow them.

use crate::names::{
    id_literal, method_path, sender_method_name, service_full_name, stream_type_name,
};
use heck::{ToSnakeCase, ToUpperCamelCase};
use prost_build::{Comments, Method, Service};
use std::fmt::Write;

const RT: &str = "::rpc_core::codegen";

/// Client methods that an rpc method of the same name would clash with.
const CLIENT_OWN_METHODS: [&str; 7] = [
    "new",
    "connect",
    "connect_async",
    "channel",
    "send_compressed",
    "accept_compressed",
    "accept_encodings",
];

pub(crate) struct ServiceGenerator;

impl prost_build::ServiceGenerator for ServiceGenerator {
    fn generate(&mut self, service: Service, buf: &mut String) {
        let names = Names::of(&service);
        generate_client(&service, &names, buf);
        generate_server(&service, &names, buf);
    }

    fn finalize_package(&mut self, package: &str, buf: &mut String) {
        // Beside the package's `.rs` file, written by `Builder::compile`;
        // `include_bytes!` resolves the name against the including file.
        let _ = writeln!(
            buf,
            "/// The `.proto` files of this package and every file they import, as an
            /// encoded `google.protobuf.FileDescriptorSet`: what the reflection service
            /// (`Server::builder().add_reflection()`) serves about its services.
            pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(\"{}\");",
            descriptor_file_name(package)
        );
    }
}

/// The file, beside the package's generated code, holding its
/// `FILE_DESCRIPTOR_SET`.
pub(crate) fn descriptor_file_name(package: &str) -> String {
    // prost-build names the code of the package-less file `_.rs`.
    let module = if package.is_empty() { "_" } else { package };
    format!("{module}.fds.bin")
}

/// The Rust names of one service's generated items.
struct Names {
    /// `kv.Kv`.
    full: String,
    /// `kv_client`.
    client_mod: String,
    /// `kv_server`.
    server_mod: String,
    /// `KvClient`.
    client: String,
    /// `KvServer`.
    server: String,
    /// `Kv`: prost's name for the service, a valid identifier.
    service_trait: String,
    /// The type parameter of `KvServer<T>`: `T`, unless the trait is itself named `T`.
    param: &'static str,
}

impl Names {
    fn of(service: &Service) -> Names {
        let snake = service.proto_name.to_snake_case();
        let camel = service.proto_name.to_upper_camel_case();
        Names {
            full: service_full_name(&service.package, &service.proto_name),
            client_mod: format!("{snake}_client"),
            server_mod: format!("{snake}_server"),
            client: format!("{camel}Client"),
            server: format!("{camel}Server"),
            param: if service.name == "T" { "S" } else { "T" },
            service_trait: service.name.clone(),
        }
    }
}

fn generate_client(service: &Service, names: &Names, buf: &mut String) {
    let Names {
        full,
        client_mod,
        server_mod,
        client,
        ..
    } = names;

    let _ = writeln!(buf, "/// Generated client for `{full}`.");
    if has_docs(&service.comments) {
        buf.push_str("///\n");
        push_docs(&service.comments, buf);
    }
    let _ = writeln!(buf, "pub mod {client_mod} {{");
    if has_docs(&service.comments) {
        push_docs(&service.comments, buf);
    } else {
        let _ = writeln!(buf, "/// Client for the `{full}` service.");
    }
    let _ = writeln!(
        buf,
        "#[derive(Debug, Clone)]
        pub struct {client} {{
            inner: {RT}::Channel,
        }}
        impl {client} {{
            /// Wraps a connected channel.
            pub fn new(channel: {RT}::Channel) -> Self {{
                Self {{ inner: channel }}
            }}
            /// Connects to `url` (`rdma://`, `tcp://` or `mem://`).
            pub fn connect(url: &str) -> ::core::result::Result<Self, {RT}::Status> {{
                {RT}::Channel::connect(url).map(Self::new)
            }}
            /// Connects to `url` from async code: the handshakes run off the
            /// executor's threads (see `Channel::connect_async`).
            pub async fn connect_async(url: &str) -> ::core::result::Result<Self, {RT}::Status> {{
                {RT}::Channel::connect_async(url).await.map(Self::new)
            }}
            /// The underlying channel.
            pub fn channel(&self) -> &{RT}::Channel {{
                &self.inner
            }}
            /// Sends requests compressed in `encoding` (see `Channel::send_compressed`).
            #[must_use]
            pub fn send_compressed(mut self, encoding: {RT}::Encoding) -> Self {{
                self.inner = self.inner.send_compressed(encoding);
                self
            }}
            /// Accepts responses compressed in `encoding`; once one is named,
            /// only those named (see `Channel::accept_compressed`).
            #[must_use]
            pub fn accept_compressed(mut self, encoding: {RT}::Encoding) -> Self {{
                self.inner = self.inner.accept_compressed(encoding);
                self
            }}
            /// Accepts responses compressed in exactly the encodings of `set`.
            #[must_use]
            pub fn accept_encodings(mut self, set: {RT}::EncodingSet) -> Self {{
                self.inner = self.inner.accept_encodings(set);
                self
            }}"
    );
    for (index, method) in service.methods.iter().enumerate() {
        let kind = Kind::of(method);
        let name = client_method_name(&method.name);
        let input = nested_type(&method.input_type);
        let output = nested_type(&method.output_type);
        let descriptor = format!("&super::{server_mod}::DESCRIPTOR.methods[{index}]");
        push_client_docs(method, names, buf);
        if name != method.name {
            let _ = writeln!(
                buf,
                "///\n/// Named `{name}` because [`{client}::{}`] is taken.",
                method.name
            );
        }
        let sender = sender_method_name(&method.proto_name);
        if kind.client_streams() {
            let _ = writeln!(
                buf,
                "///\n/// Sends the requests of a stream. The blocking form is\n/// [`Self::{sender}`]."
            );
        }
        push_allow(&clippy_allows(&name, false), buf);
        let _ = match kind {
            Kind::Unary => writeln!(
                buf,
                "pub fn {name}(&self, request: impl {RT}::IntoRequest<{input}>) -> {RT}::UnaryCall<{output}> {{
                    {RT}::unary(&self.inner, {descriptor}, request.into_request())
                }}"
            ),
            Kind::ServerStreaming => writeln!(
                buf,
                "pub fn {name}(&self, request: impl {RT}::IntoRequest<{input}>) -> {RT}::Streaming<{output}> {{
                    {RT}::server_streaming(&self.inner, {descriptor}, request.into_request())
                }}"
            ),
            Kind::ClientStreaming => writeln!(
                buf,
                "pub fn {name}(&self, request: impl {RT}::IntoStreamingRequest<Message = {input}>) -> {RT}::ClientStreamingCall<{output}> {{
                    {RT}::client_streaming(&self.inner, {descriptor}, request.into_streaming_request())
                }}"
            ),
            Kind::Streaming => writeln!(
                buf,
                "pub fn {name}(&self, request: impl {RT}::IntoStreamingRequest<Message = {input}>) -> {RT}::Streaming<{output}> {{
                    {RT}::streaming(&self.inner, {descriptor}, request.into_streaming_request())
                }}"
            ),
        };

        // The blocking form of a call that streams requests.
        if kind.client_streams() {
            push_client_docs(method, names, buf);
            let link = method_link(&name);
            let (returned, function, then) = match kind {
                Kind::ClientStreaming => (
                    format!("{RT}::ClientStreamingCall<{output}>"),
                    "client_streaming_sender",
                    "Then wait for the response with\n/// `ClientStreamingCall::wait`.",
                ),
                _ => (
                    format!("{RT}::Streaming<{output}>"),
                    "streaming_sender",
                    "The responses arrive meanwhile on the\n/// returned `Streaming`: iterate over it, or read one at a time with\n/// `Streaming::blocking_message`.",
                ),
            };
            let _ = writeln!(
                buf,
                "///
                /// The blocking form of {link}: send each request with
                /// `RequestSender::send`, and finish with `RequestSender::close` or by
                /// dropping the sender. {then}
                ///
                /// `request` carries only the call's metadata and options: pass `()`
                /// for the defaults."
            );
            push_allow(&clippy_allows(&sender, false), buf);
            let _ = writeln!(
                buf,
                "pub fn {sender}(&self, request: impl {RT}::IntoRequest<()>) -> ({RT}::RequestSender<{input}>, {returned}) {{
                    {RT}::{function}(&self.inner, {descriptor}, request.into_request())
                }}"
            );
        }
    }
    buf.push_str("}\n}\n");
}

fn generate_server(service: &Service, names: &Names, buf: &mut String) {
    let Names {
        full,
        server_mod,
        server,
        service_trait,
        param,
        ..
    } = names;

    let _ = writeln!(buf, "/// Generated server for `{full}`.");
    let _ = writeln!(buf, "pub mod {server_mod} {{");

    // The trait.
    if has_docs(&service.comments) {
        push_docs(&service.comments, buf);
    } else {
        let _ = writeln!(
            buf,
            "/// The `{full}` service: implement it, and serve it with [`{server}`]."
        );
    }
    let _ = writeln!(
        buf,
        "///
        /// Implement the methods as `async fn`. Each call runs to completion on
        /// the server's dispatcher thread that received it: awaiting (a timer,
        /// another call, I/O) parks the handler and lets the dispatcher go on,
        /// but blocking the thread holds up every connection of that dispatcher.
        /// Run blocking or CPU-heavy work with `rpc_core::blocking`, or serve the
        /// service with `ServerBuilder::add_blocking_service`.
        pub trait {service_trait}: ::core::marker::Send + ::core::marker::Sync + 'static {{"
    );
    for method in &service.methods {
        let kind = Kind::of(method);
        let input = nested_type(&method.input_type);
        let output = nested_type(&method.output_type);
        // A stream of responses has a type of the implementation's choice.
        let response = if kind.server_streams() {
            let stream = stream_type_name(&method.proto_name);
            let _ = writeln!(
                buf,
                "/// The stream of responses of `{}`.
                type {stream}: {RT}::Stream<Item = ::core::result::Result<{output}, {RT}::Status>>
                    + ::core::marker::Send + 'static;",
                method.proto_name,
            );
            format!("Self::{stream}")
        } else {
            output
        };
        if has_docs(&method.comments) {
            push_docs(&method.comments, buf);
        } else {
            let _ = writeln!(
                buf,
                "/// Handles the `{}` rpc of `{full}`.",
                method.proto_name
            );
        }
        push_allow(&clippy_allows(&method.name, true), buf);
        let request = if kind.client_streams() {
            format!("{RT}::Streaming<{input}>")
        } else {
            input
        };
        let _ = writeln!(
            buf,
            "fn {name}(&self, request: {RT}::Request<{request}>)
                -> impl ::core::future::Future<Output = ::core::result::Result<{RT}::Response<{response}>, {RT}::Status>> + ::core::marker::Send;",
            name = method.name,
        );
    }
    buf.push_str("}\n");

    // The descriptor.
    let _ = writeln!(
        buf,
        "/// Descriptor of `{full}`: name, rpcs and their stable ids.
        pub static DESCRIPTOR: {RT}::ServiceDescriptor = {RT}::ServiceDescriptor {{
            name: \"{full}\",
            methods: &["
    );
    for method in &service.methods {
        let path = method_path(full, &method.proto_name);
        let id = rpc_core::codegen::method_id(&path);
        let _ = writeln!(
            buf,
            "{RT}::MethodDescriptor {{ name: \"{}\", path: \"{path}\", id: {}, kind: {RT}::MethodKind::{} }},",
            method.proto_name,
            id_literal(id),
            Kind::of(method).variant(),
        );
    }
    buf.push_str("],\n};\n");

    // The wrapper and its impls.
    let _ = writeln!(
        buf,
        "/// Serves an implementation of [`{service_trait}`]; pass it to `Server::builder().add_service(..)`.
        pub struct {server}<{param}: {service_trait}> {{
            inner: ::std::sync::Arc<{param}>,
            compression: ::core::option::Option<{RT}::CompressionConfig>,
        }}
        impl<{param}: {service_trait}> {server}<{param}> {{
            /// Wraps `inner`.
            pub fn new(inner: {param}) -> Self {{
                Self::from_arc(::std::sync::Arc::new(inner))
            }}
            /// Wraps an `inner` that is already shared.
            pub fn from_arc(inner: ::std::sync::Arc<{param}>) -> Self {{
                Self {{ inner, compression: ::core::option::Option::None }}
            }}
            /// The wrapped implementation.
            pub fn get_ref(&self) -> &{param} {{
                &self.inner
            }}
            /// Sends responses compressed in `encoding` to callers that accept
            /// it. The service's settings replace the server's.
            #[must_use]
            pub fn send_compressed(mut self, encoding: {RT}::Encoding) -> Self {{
                self.compression = ::core::option::Option::Some(self.compression.unwrap_or_default().send_compressed(encoding));
                self
            }}
            /// Accepts requests compressed in `encoding`; once one is named,
            /// only those named (a request in another fails `Unimplemented`).
            #[must_use]
            pub fn accept_compressed(mut self, encoding: {RT}::Encoding) -> Self {{
                self.compression = ::core::option::Option::Some(self.compression.unwrap_or_default().accept_compressed(encoding));
                self
            }}
            /// Accepts requests compressed in exactly the encodings of `set`.
            #[must_use]
            pub fn accept_encodings(mut self, set: {RT}::EncodingSet) -> Self {{
                self.compression = ::core::option::Option::Some(self.compression.unwrap_or_default().accept_encodings(set));
                self
            }}
        }}
        impl<{param}: {service_trait}> ::core::clone::Clone for {server}<{param}> {{
            fn clone(&self) -> Self {{
                Self {{ inner: ::std::sync::Arc::clone(&self.inner), compression: self.compression }}
            }}
        }}
        impl<{param}: {service_trait}> ::core::fmt::Debug for {server}<{param}> {{
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {{
                f.debug_struct(\"{server}\").field(\"service\", &DESCRIPTOR.name).finish_non_exhaustive()
            }}
        }}
        impl<{param}: {service_trait}> {RT}::Service for {server}<{param}> {{
            fn descriptor(&self) -> &'static {RT}::ServiceDescriptor {{
                &DESCRIPTOR
            }}
            fn file_descriptor_set(&self) -> &'static [u8] {{
                super::FILE_DESCRIPTOR_SET
            }}
            fn compression(&self) -> ::core::option::Option<{RT}::CompressionConfig> {{
                self.compression
            }}
            fn call(&self, call: {RT}::ServerCall) {{"
    );
    if service.methods.is_empty() {
        buf.push_str("call.unimplemented()\n");
    } else {
        buf.push_str("match call.method_id() {\n");
        for method in &service.methods {
            let id = rpc_core::codegen::method_id(&method_path(full, &method.proto_name));
            // Called through the trait, not as a method of the `Arc`, so an
            // rpc named like an `Arc` method (`Clone`) still resolves.
            let _ = writeln!(
                buf,
                "{} => {{
                    let inner = ::std::sync::Arc::clone(&self.inner);
                    call.{}(move |request| async move {{ {param}::{}(&inner, request).await }})
                }}",
                id_literal(id),
                Kind::of(method).server_call(),
                method.name,
            );
        }
        buf.push_str("_ => call.unimplemented(),\n}\n");
    }
    buf.push_str("}\n}\n}\n");
}

/// The four kinds of rpc, by which side sends a stream of messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unary,
    ServerStreaming,
    ClientStreaming,
    /// Bidirectional.
    Streaming,
}

impl Kind {
    fn of(method: &Method) -> Kind {
        match (method.client_streaming, method.server_streaming) {
            (false, false) => Kind::Unary,
            (false, true) => Kind::ServerStreaming,
            (true, false) => Kind::ClientStreaming,
            (true, true) => Kind::Streaming,
        }
    }

    fn client_streams(self) -> bool {
        matches!(self, Kind::ClientStreaming | Kind::Streaming)
    }

    fn server_streams(self) -> bool {
        matches!(self, Kind::ServerStreaming | Kind::Streaming)
    }

    /// The variant of `MethodKind` in the runtime.
    fn variant(self) -> &'static str {
        match self {
            Kind::Unary => "Unary",
            Kind::ServerStreaming => "ServerStreaming",
            Kind::ClientStreaming => "ClientStreaming",
            Kind::Streaming => "Streaming",
        }
    }

    /// The method of `ServerCall` that runs a handler of this kind.
    fn server_call(self) -> &'static str {
        match self {
            Kind::Unary => "unary_async",
            Kind::ServerStreaming => "server_streaming",
            Kind::ClientStreaming => "client_streaming",
            Kind::Streaming => "streaming",
        }
    }
}

/// The docs of an rpc's client method: its proto comments, or a default.
fn push_client_docs(method: &Method, names: &Names, buf: &mut String) {
    if has_docs(&method.comments) {
        push_docs(&method.comments, buf);
    } else {
        let _ = writeln!(
            buf,
            "/// Calls the `{}` rpc of `{}`.",
            method.proto_name, names.full
        );
    }
}

/// The client method for an rpc whose prost name is `name`.
fn client_method_name(name: &str) -> String {
    if CLIENT_OWN_METHODS.contains(&name) {
        format!("{name}_")
    } else {
        name.to_owned()
    }
}

/// A doc link to the client's method `name`, or only its name where rustdoc
/// cannot resolve it: intra-doc links do not take raw identifiers.
fn method_link(name: &str) -> String {
    if name.starts_with("r#") {
        format!("`{name}`")
    } else {
        format!("[`Self::{name}`]")
    }
}

/// Clippy lints that an rpc's name alone would trip on its method, which
/// always takes `&self` and a request: naming conventions (`new`, `from_*`,
/// `into_*`, `to_*_mut`) and, on the client's inherent methods, `cmp`, which
/// looks like `Ord::cmp`. The name comes from the proto, so the user cannot
/// follow the lint's advice without breaking the wire name.
fn clippy_allows(name: &str, in_trait: bool) -> Vec<&'static str> {
    let mut allows = Vec::new();
    if name == "new"
        || name.starts_with("from_")
        || name.starts_with("into_")
        || (name.starts_with("to_") && name.ends_with("_mut"))
    {
        allows.push("clippy::wrong_self_convention");
    }
    if name == "new" && in_trait {
        allows.push("clippy::new_ret_no_self");
    }
    if name == "cmp" && !in_trait {
        allows.push("clippy::should_implement_trait");
    }
    allows
}

fn push_allow(lints: &[&str], buf: &mut String) {
    if !lints.is_empty() {
        let _ = writeln!(buf, "#[allow({})]", lints.join(", "));
    }
}

/// prost resolves message types relative to the package module; the
/// generated modules sit one level below it. Absolute paths (extern types
/// such as `::rpc_core::codegen::prost_types::Timestamp`, or `crate::...`
/// given as an extern path) and the types
/// prost maps wrapper messages to (`()`, `bool`, ...) stay as they are.
fn nested_type(rust_type: &str) -> String {
    const AS_IS: [&str; 8] = ["()", "bool", "f32", "f64", "i32", "i64", "u32", "u64"];
    if rust_type.starts_with("::") || rust_type.starts_with("crate::") || AS_IS.contains(&rust_type)
    {
        rust_type.to_owned()
    } else {
        format!("super::{rust_type}")
    }
}

fn has_docs(comments: &Comments) -> bool {
    !comments.leading.is_empty() || !comments.trailing.is_empty()
}

/// Leading and trailing comments as `///` lines, escaped for rustdoc as
/// prost does for messages. Detached comments are not docs.
fn push_docs(comments: &Comments, buf: &mut String) {
    let comments = Comments {
        leading_detached: Vec::new(),
        leading: comments.leading.clone(),
        trailing: comments.trailing.clone(),
    };
    comments.append_with_indent(0, buf);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_type_adds_one_super_to_relative_paths() {
        assert_eq!(nested_type("PutRequest"), "super::PutRequest");
        assert_eq!(nested_type("crate::common::Ack"), "crate::common::Ack");
        assert_eq!(nested_type("outer::Inner"), "super::outer::Inner");
        assert_eq!(
            nested_type("super::super::common::Ack"),
            "super::super::super::common::Ack"
        );
        assert_eq!(
            nested_type("::rpc_core::codegen::prost_types::Timestamp"),
            "::rpc_core::codegen::prost_types::Timestamp"
        );
        assert_eq!(nested_type("()"), "()");
        assert_eq!(nested_type("bool"), "bool");
    }

    #[test]
    fn client_method_names_avoid_own_methods() {
        assert_eq!(client_method_name("put"), "put");
        assert_eq!(client_method_name("connect"), "connect_");
        assert_eq!(client_method_name("connect_async"), "connect_async_");
        assert_eq!(client_method_name("new"), "new_");
        assert_eq!(client_method_name("channel"), "channel_");
        assert_eq!(client_method_name("r#type"), "r#type");
    }
}
