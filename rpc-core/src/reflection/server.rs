//! The reflection service's server side: the index of what a server's
//! services declare (services, files, symbols), and [`ReflectionServer`],
//! which answers from it.

use super::v1::server_reflection_request::MessageRequest;
use super::v1::server_reflection_response::MessageResponse;
use super::v1::{
    ErrorResponse, ExtensionNumberResponse, FileDescriptorResponse, ListServiceResponse,
    ServerReflectionRequest, ServerReflectionResponse, ServiceResponse,
};
use super::{DESCRIPTOR, FILE_DESCRIPTOR_SET, INFO};
use crate::descriptor::ServiceDescriptor;
use crate::{Code, Request, Response, ServerCall, Service, Status, Streaming};
use futures_core::Stream;
use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};
use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// What the reflection service knows: the services, their files and the
/// symbols those files declare.
#[derive(Default)]
struct Index {
    /// `package.Service`, sorted.
    services: Vec<String>,
    /// File name to the encoded `FileDescriptorProto` and its imports.
    files: HashMap<String, (Vec<u8>, Vec<String>)>,
    /// Fully-qualified symbol (no leading dot) to the file declaring it.
    symbols: HashMap<String, String>,
    /// (extended message, field number) to the file declaring the extension.
    extensions: HashMap<(String, i32), String>,
}

impl Index {
    /// Indexes `services`; those without descriptors are listed only. A
    /// descriptor set that does not decode is logged and skipped.
    fn new(services: &[&dyn Service]) -> Index {
        let mut index = Index::default();
        let mut names = BTreeSet::new();
        for service in services {
            names.insert(service.descriptor().name.to_owned());
            let bytes = service.file_descriptor_set();
            if bytes.is_empty() {
                continue;
            }
            match FileDescriptorSet::decode(bytes) {
                Ok(set) => set.file.into_iter().for_each(|f| index.add_file(f)),
                Err(e) => tracing::warn!(
                    service = service.descriptor().name,
                    error = %e,
                    "the service's file descriptor set does not decode: it cannot be described"
                ),
            }
        }
        index.services = names.into_iter().collect();
        index
    }

    fn add_file(&mut self, file: FileDescriptorProto) {
        let name = file.name().to_owned();
        if self.files.contains_key(&name) {
            return;
        }
        let prefix = match file.package() {
            "" => String::new(),
            package => format!("{package}."),
        };
        let mut symbols = Vec::new();
        for message in &file.message_type {
            self.add_message(&prefix, message, &name, &mut symbols);
        }
        for e in &file.enum_type {
            symbols.push(format!("{prefix}{}", e.name()));
        }
        for service in &file.service {
            let service_name = format!("{prefix}{}", service.name());
            for method in &service.method {
                symbols.push(format!("{service_name}.{}", method.name()));
            }
            symbols.push(service_name);
        }
        for ext in &file.extension {
            symbols.push(format!("{prefix}{}", ext.name()));
            self.add_extension(ext, &name);
        }
        for symbol in symbols {
            self.symbols.entry(symbol).or_insert_with(|| name.clone());
        }
        let deps = file.dependency.clone();
        self.files.insert(name, (file.encode_to_vec(), deps));
    }

    fn add_message(
        &mut self,
        prefix: &str,
        message: &DescriptorProto,
        file: &str,
        symbols: &mut Vec<String>,
    ) {
        let full = format!("{prefix}{}", message.name());
        for field in &message.field {
            symbols.push(format!("{full}.{}", field.name()));
        }
        for e in &message.enum_type {
            symbols.push(format!("{full}.{}", e.name()));
        }
        for ext in &message.extension {
            symbols.push(format!("{full}.{}", ext.name()));
            self.add_extension(ext, file);
        }
        let nested_prefix = format!("{full}.");
        for nested in &message.nested_type {
            self.add_message(&nested_prefix, nested, file, symbols);
        }
        symbols.push(full);
    }

    fn add_extension(&mut self, ext: &prost_types::FieldDescriptorProto, file: &str) {
        let extended = ext.extendee().trim_start_matches('.').to_owned();
        self.extensions
            .entry((extended, ext.number()))
            .or_insert_with(|| file.to_owned());
    }

    /// `name` and every file it imports, directly or not: `name` first.
    fn file_with_imports(&self, name: &str) -> Result<Vec<Vec<u8>>, ErrorResponse> {
        if !self.files.contains_key(name) {
            return Err(not_found(format!("no file {name:?}")));
        }
        let mut seen = BTreeSet::new();
        let mut todo = vec![name];
        let mut out = Vec::new();
        while let Some(file) = todo.pop() {
            if !seen.insert(file) {
                continue;
            }
            // An import the services' sets did not carry is left out: the
            // client reports what it misses.
            if let Some((bytes, deps)) = self.files.get(file) {
                out.push(bytes.clone());
                todo.extend(deps.iter().rev().map(String::as_str));
            }
        }
        Ok(out)
    }

    fn answer(&self, request: &ServerReflectionRequest) -> MessageResponse {
        let files = |r: Result<Vec<Vec<u8>>, ErrorResponse>| match r {
            Ok(file_descriptor_proto) => {
                MessageResponse::FileDescriptorResponse(FileDescriptorResponse {
                    file_descriptor_proto,
                })
            }
            Err(e) => MessageResponse::ErrorResponse(e),
        };
        match &request.message_request {
            Some(MessageRequest::ListServices(_)) => {
                MessageResponse::ListServicesResponse(ListServiceResponse {
                    service: self
                        .services
                        .iter()
                        .map(|name| ServiceResponse { name: name.clone() })
                        .collect(),
                })
            }
            Some(MessageRequest::FileByFilename(name)) => files(self.file_with_imports(name)),
            Some(MessageRequest::FileContainingSymbol(symbol)) => {
                let symbol = symbol.trim_start_matches('.');
                files(match self.symbols.get(symbol) {
                    Some(file) => self.file_with_imports(file),
                    None if self.services.iter().any(|s| s == symbol) => Err(not_found(format!(
                        "{symbol} is served but its service has no file descriptors \
                         (it was not generated by rpc-codegen)"
                    ))),
                    None => Err(not_found(format!("no symbol {symbol:?}"))),
                })
            }
            Some(MessageRequest::FileContainingExtension(ext)) => {
                let key = (
                    ext.containing_type.trim_start_matches('.').to_owned(),
                    ext.extension_number,
                );
                files(match self.extensions.get(&key) {
                    Some(file) => self.file_with_imports(file),
                    None => Err(not_found(format!(
                        "no extension {} of {}",
                        key.1, ext.containing_type
                    ))),
                })
            }
            Some(MessageRequest::AllExtensionNumbersOfType(ty)) => {
                let ty = ty.trim_start_matches('.');
                let known = self.symbols.contains_key(ty);
                let mut extension_number: Vec<i32> = self
                    .extensions
                    .keys()
                    .filter(|(extended, _)| extended == ty)
                    .map(|(_, n)| *n)
                    .collect();
                extension_number.sort_unstable();
                if known || !extension_number.is_empty() {
                    MessageResponse::AllExtensionNumbersResponse(ExtensionNumberResponse {
                        base_type_name: ty.to_owned(),
                        extension_number,
                    })
                } else {
                    MessageResponse::ErrorResponse(not_found(format!("no type {ty:?}")))
                }
            }
            None => MessageResponse::ErrorResponse(ErrorResponse {
                error_code: Code::InvalidArgument as i32,
                error_message: "the request asks nothing".into(),
            }),
        }
    }
}

fn not_found(message: String) -> ErrorResponse {
    ErrorResponse {
        error_code: Code::NotFound as i32,
        error_message: message,
    }
}

/// The reflection service. [`crate::ServerBuilder::add_reflection`] adds
/// one that knows every service of the server (itself included).
#[derive(Clone)]
pub struct ReflectionServer {
    index: Arc<Index>,
}

impl std::fmt::Debug for ReflectionServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReflectionServer")
            .field("services", &self.index.services)
            .field("files", &self.index.files.len())
            .finish()
    }
}

impl ReflectionServer {
    /// A reflection service answering about `services` and about itself.
    pub(crate) fn new(services: &[&dyn Service]) -> ReflectionServer {
        let this = ReflectionServer {
            index: Arc::new(Index::default()),
        };
        let mut all = services.to_vec();
        all.push(&this);
        ReflectionServer {
            index: Arc::new(Index::new(&all)),
        }
    }
}

impl Service for ReflectionServer {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        &DESCRIPTOR
    }

    fn file_descriptor_set(&self) -> &'static [u8] {
        FILE_DESCRIPTOR_SET
    }

    fn call(&self, call: ServerCall) {
        let index = self.index.clone();
        match call.method_id() {
            id if id == INFO.id => call.streaming(
                move |r: Request<Streaming<ServerReflectionRequest>>| async move {
                    Ok(Response::new(Answers {
                        index,
                        requests: r.into_inner(),
                    }))
                },
            ),
            _ => call.unimplemented(),
        }
    }
}

/// A reflection stream's responses: one per request, in order.
struct Answers {
    index: Arc<Index>,
    requests: Streaming<ServerReflectionRequest>,
}

impl Stream for Answers {
    type Item = Result<ServerReflectionResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        Pin::new(&mut this.requests).poll_next(cx).map(|next| {
            next.map(|request| {
                request.map(|request| ServerReflectionResponse {
                    valid_host: String::new(),
                    message_response: Some(this.index.answer(&request)),
                    original_request: Some(request),
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reflection::v1;

    fn index() -> Index {
        let (_, health) = crate::health::service();
        let reflection = ReflectionServer::new(&[&health]);
        Arc::try_unwrap(reflection.index).unwrap_or_else(|_| unreachable!())
    }

    fn ask(index: &Index, request: MessageRequest) -> MessageResponse {
        index.answer(&ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        })
    }

    fn file_names(answer: MessageResponse) -> Vec<String> {
        let MessageResponse::FileDescriptorResponse(files) = answer else {
            panic!("not files: {answer:?}");
        };
        files
            .file_descriptor_proto
            .iter()
            .map(|b| {
                FileDescriptorProto::decode(&b[..])
                    .unwrap()
                    .name()
                    .to_owned()
            })
            .collect()
    }

    #[test]
    fn lists_every_service_and_itself() {
        let MessageResponse::ListServicesResponse(list) =
            ask(&index(), MessageRequest::ListServices(String::new()))
        else {
            panic!("not a list");
        };
        let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection"
            ]
        );
    }

    #[test]
    fn finds_the_file_of_services_methods_messages_and_nested_enums() {
        let index = index();
        for symbol in [
            "grpc.health.v1.Health",
            ".grpc.health.v1.Health.Watch",
            "grpc.health.v1.HealthCheckRequest",
            "grpc.health.v1.HealthCheckResponse.ServingStatus",
            "grpc.health.v1.HealthCheckRequest.service",
        ] {
            let answer = ask(&index, MessageRequest::FileContainingSymbol(symbol.into()));
            assert_eq!(
                file_names(answer),
                ["grpc/health/v1/health.proto"],
                "{symbol}"
            );
        }
        let answer = ask(
            &index,
            MessageRequest::FileByFilename("grpc/reflection/v1/reflection.proto".into()),
        );
        assert_eq!(file_names(answer), ["grpc/reflection/v1/reflection.proto"]);
    }

    #[test]
    fn unknown_names_are_not_found() {
        let index = index();
        for request in [
            MessageRequest::FileContainingSymbol("kv.Kv".into()),
            MessageRequest::FileByFilename("kv.proto".into()),
            MessageRequest::AllExtensionNumbersOfType("no.Such".into()),
            MessageRequest::FileContainingExtension(v1::ExtensionRequest {
                containing_type: "grpc.health.v1.HealthCheckRequest".into(),
                extension_number: 100,
            }),
        ] {
            match ask(&index, request.clone()) {
                MessageResponse::ErrorResponse(e) => {
                    assert_eq!(e.error_code, Code::NotFound as i32, "{request:?}")
                }
                other => panic!("{request:?} answered {other:?}"),
            }
        }
    }

    #[test]
    fn a_known_type_without_extensions_has_none() {
        let answer = ask(
            &index(),
            MessageRequest::AllExtensionNumbersOfType("grpc.health.v1.HealthCheckRequest".into()),
        );
        let MessageResponse::AllExtensionNumbersResponse(numbers) = answer else {
            panic!("{answer:?}");
        };
        assert!(numbers.extension_number.is_empty());
    }
}
