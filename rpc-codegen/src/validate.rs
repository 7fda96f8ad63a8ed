//! Checks a descriptor set before any code is generated, so that a proto
//! whose names rdma-rpc cannot map to Rust fails the build with a message
//! naming the rpcs rather than with a confusing compile error in generated
//! code.

use crate::names::{
    id_literal, method_path, sender_method_name, service_full_name, stream_type_name,
};
use heck::ToSnakeCase;
use prost_types::{DescriptorProto, FileDescriptorSet};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::io;

/// Whether prost generates a module for the nested types of `message`:
/// nested messages other than map entries, enums, or real (not proto3
/// `optional`) oneofs.
fn has_module(message: &DescriptorProto) -> bool {
    let is_map_entry =
        |m: &DescriptorProto| m.options.as_ref().and_then(|o| o.map_entry) == Some(true);
    !message.enum_type.is_empty()
        || message.nested_type.iter().any(|m| !is_map_entry(m))
        || message
            .field
            .iter()
            .any(|f| f.oneof_index.is_some() && !f.proto3_optional())
}

/// Returns every problem found, one per line, as one `InvalidInput` error.
pub(crate) fn validate(fds: &FileDescriptorSet) -> io::Result<()> {
    let mut problems = Vec::new();
    // Method id -> path of the first rpc seen with it.
    let mut ids: HashMap<u32, String> = HashMap::new();
    // (package, stem of a service's modules: `kv` of `kv_client`) -> service full name.
    let mut modules: HashMap<(String, String), String> = HashMap::new();

    for file in &fds.file {
        let package = file.package();
        for service in &file.service {
            let service_name = service_full_name(package, service.name());

            let module = service.name().to_snake_case();
            match modules.entry((package.to_owned(), module.clone())) {
                Entry::Occupied(first) => problems.push(format!(
                    "services `{}` and `{service_name}` (in {}) would both generate \
                     modules `{module}_client` and `{module}_server`; rename one of them",
                    first.get(),
                    file.name(),
                )),
                Entry::Vacant(slot) => {
                    slot.insert(service_name.clone());
                }
            }

            // Rust method name -> rpc name.
            let mut rust_names: HashMap<String, &str> = HashMap::new();
            // Associated type of the server trait -> rpc name.
            let mut stream_types: HashMap<String, &str> = HashMap::new();
            for method in &service.method {
                let path = method_path(&service_name, method.name());

                let id = rpc_core::codegen::method_id(&path);
                match ids.entry(id) {
                    Entry::Occupied(first) => problems.push(format!(
                        "method id collision: `{}` and `{path}` both hash to {}; \
                         rename one of the rpcs",
                        first.get(),
                        id_literal(id),
                    )),
                    Entry::Vacant(slot) => {
                        slot.insert(path);
                    }
                }

                let rust_name = method.name().to_snake_case();
                match rust_names.entry(rust_name) {
                    Entry::Occupied(first) => problems.push(format!(
                        "rpcs `{service_name}.{}` and `{service_name}.{}` would both \
                         generate the Rust method `{}`; rename one of them",
                        first.get(),
                        method.name(),
                        first.key(),
                    )),
                    Entry::Vacant(slot) => {
                        slot.insert(method.name());
                    }
                }

                if method.server_streaming() {
                    let stream = stream_type_name(method.name());
                    match stream_types.entry(stream) {
                        Entry::Occupied(first) => problems.push(format!(
                            "rpcs `{service_name}.{}` and `{service_name}.{}` would both \
                             generate the associated type `{}` of the server trait; \
                             rename one of them",
                            first.get(),
                            method.name(),
                            first.key(),
                        )),
                        Entry::Vacant(slot) => {
                            slot.insert(method.name());
                        }
                    }
                }
            }

            // The blocking client method of a client-streaming or
            // bidirectional rpc, `record_route_sender`, against the client
            // methods of the other rpcs.
            for method in service.method.iter().filter(|m| m.client_streaming()) {
                let sender = sender_method_name(method.name());
                if let Some(other) = rust_names.get(&sender) {
                    problems.push(format!(
                        "rpcs `{service_name}.{}` and `{service_name}.{other}` would both \
                         generate the client method `{sender}` (the blocking form of `{}`); \
                         rename one of them",
                        method.name(),
                        method.name(),
                    ));
                }
            }
        }
    }

    // prost puts the nested types of a message `KvClient` into a module
    // `kv_client`, which would clash with the client module of a service `Kv`.
    for file in &fds.file {
        let package = file.package();
        for message in file.message_type.iter().filter(|m| has_module(m)) {
            let module = message.name().to_snake_case();
            let service = module
                .strip_suffix("_client")
                .or_else(|| module.strip_suffix("_server"))
                .and_then(|prefix| modules.get(&(package.to_owned(), prefix.to_owned())));
            if let Some(service) = service {
                problems.push(format!(
                    "message `{}` (in {}) and service `{service}` would both generate \
                     the module `{module}`; rename one of them",
                    service_full_name(package, message.name()),
                    file.name(),
                ));
            }
        }
    }

    if problems.is_empty() {
        Ok(())
    } else {
        Err(crate::invalid_input(problems.join("\n")))
    }
}
