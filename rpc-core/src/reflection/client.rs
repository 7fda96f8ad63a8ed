//! The reflection service's client side: [`ReflectionClient`], blocking
//! calls that list and describe a server's services.

use super::INFO;
use super::v1::server_reflection_request::MessageRequest;
use super::v1::server_reflection_response::MessageResponse;
use super::v1::{ServerReflectionRequest, ServerReflectionResponse};
use crate::{Channel, Code, Request, Status};
use prost::Message;
use prost_types::{FileDescriptorProto, FileDescriptorSet};

/// A client of a server's reflection service: blocking calls, each on a
/// stream of its own.
#[derive(Debug, Clone)]
pub struct ReflectionClient {
    channel: Channel,
}

impl ReflectionClient {
    /// A client on `channel`.
    pub fn new(channel: Channel) -> ReflectionClient {
        ReflectionClient { channel }
    }

    /// Connects to `url`.
    pub fn connect(url: &str) -> Result<ReflectionClient, Status> {
        Channel::connect(url).map(ReflectionClient::new)
    }

    /// The names (`package.Service`) of the services the server serves.
    pub fn list_services(&self) -> Result<Vec<String>, Status> {
        match self.ask(MessageRequest::ListServices(String::new()))? {
            MessageResponse::ListServicesResponse(list) => {
                Ok(list.service.into_iter().map(|s| s.name).collect())
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The file declaring `symbol` (`package.Service`,
    /// `package.Service.Method`, `package.Message`) and every file it
    /// imports, as a set a `prost-reflect` `DescriptorPool` can load.
    pub fn file_containing_symbol(&self, symbol: &str) -> Result<FileDescriptorSet, Status> {
        self.files(MessageRequest::FileContainingSymbol(symbol.to_owned()))
    }

    /// The file named `name` (`kv.proto`) and every file it imports.
    pub fn file_by_filename(&self, name: &str) -> Result<FileDescriptorSet, Status> {
        self.files(MessageRequest::FileByFilename(name.to_owned()))
    }

    fn files(&self, request: MessageRequest) -> Result<FileDescriptorSet, Status> {
        match self.ask(request)? {
            MessageResponse::FileDescriptorResponse(files) => {
                let mut set = FileDescriptorSet::default();
                for bytes in files.file_descriptor_proto {
                    set.file
                        .push(FileDescriptorProto::decode(&bytes[..]).map_err(|e| {
                            Status::internal(format!("a file descriptor does not decode: {e}"))
                        })?);
                }
                Ok(set)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Sends one request on a stream of its own and reads its answer; an
    /// `ErrorResponse` becomes a `Status` of its code.
    fn ask(&self, request: MessageRequest) -> Result<MessageResponse, Status> {
        let (mut sender, mut responses) = self
            .channel
            .streaming_sender::<ServerReflectionRequest, ServerReflectionResponse>(
                INFO,
                Request::new(()),
            );
        sender.send(ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        })?;
        sender.close()?;
        let response = responses.blocking_message()?.ok_or_else(|| {
            Status::internal("the reflection service ended the stream without an answer")
        })?;
        match response.message_response {
            Some(MessageResponse::ErrorResponse(e)) => Err(Status::new(
                u16::try_from(e.error_code).map_or(Code::Unknown, Code::from_u16),
                e.error_message,
            )),
            Some(answer) => Ok(answer),
            None => Err(Status::internal("the reflection service answered nothing")),
        }
    }
}

fn unexpected(answer: &MessageResponse) -> Status {
    let what = match answer {
        MessageResponse::FileDescriptorResponse(_) => "files",
        MessageResponse::AllExtensionNumbersResponse(_) => "extension numbers",
        MessageResponse::ListServicesResponse(_) => "a list of services",
        MessageResponse::ErrorResponse(_) => "an error",
    };
    Status::internal(format!("the reflection service answered with {what}"))
}
