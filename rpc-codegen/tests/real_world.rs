//! Public protos with streaming rpcs, copied under `tests/protos/real_world/`
//! (each file's header says what was trimmed): gRPC's health service and
//! interop test services, Pub/Sub's subscriber and the CSI spec's snapshot
//! metadata service. They must build, and their output must hold the client
//! methods and server trait items of every kind of rpc.
//!
//! Code is compared with whitespace and trailing commas removed, so that the
//! expected items can be written on one line whatever the formatter made of
//! them; `RT::` stands for `::rpc_core::codegen::`.

use std::fs;
use std::path::PathBuf;

fn real_world() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/protos/real_world")
}

/// Generates `protos` and returns the file of `package`, squashed.
fn generate(protos: &[&str], package: &str) -> String {
    let include = real_world();
    let out = tempfile::tempdir().unwrap();
    let protos: Vec<PathBuf> = protos.iter().map(|p| include.join(p)).collect();
    rpc_codegen::configure()
        .out_dir(out.path())
        .emit_rerun_if_changed(false)
        .compile(&protos, &[&include])
        .unwrap_or_else(|err| panic!("{err}"));
    let code = fs::read_to_string(out.path().join(format!("{package}.rs"))).unwrap();
    squash(&code)
}

/// `code` without whitespace and without the trailing commas the formatter
/// adds, with `RT::` expanded.
fn squash(code: &str) -> String {
    let mut squashed: String = code
        .replace("RT::", "::rpc_core::codegen::")
        .split_whitespace()
        .collect();
    for close in [")", ">", "}", "]"] {
        squashed = squashed.replace(&format!(",{close}"), close);
    }
    squashed
}

fn assert_has(code: &str, items: &[&str]) {
    let missing: Vec<&str> = items
        .iter()
        .copied()
        .filter(|item| !code.contains(&squash(item)))
        .collect();
    assert!(
        missing.is_empty(),
        "missing from the generated code:\n  {}",
        missing.join("\n  ")
    );
}

fn assert_lacks(code: &str, items: &[&str]) {
    for item in items {
        assert!(!code.contains(&squash(item)), "unexpected: {item}");
    }
}

/// The descriptor entry of the rpc at `path`, of `kind`.
fn descriptor(path: &str, kind: &str) -> String {
    let id = rpc_core::codegen::method_id(path);
    let name = path.rsplit('/').next().unwrap();
    format!(
        "RT::MethodDescriptor {{ name: \"{name}\", path: \"{path}\", \
         id: 0x{:04x}_{:04x}, kind: RT::MethodKind::{kind} }}",
        id >> 16,
        id & 0xffff,
    )
}

#[test]
fn grpc_health_check_and_watch() {
    let code = generate(&["grpc/health/v1/health.proto"], "grpc.health.v1");
    assert_has(
        &code,
        &[
            // Client.
            "pub fn check(&self, request: impl RT::IntoRequest<super::HealthCheckRequest>)
                -> RT::UnaryCall<super::HealthCheckResponse>",
            "pub fn watch(&self, request: impl RT::IntoRequest<super::HealthCheckRequest>)
                -> RT::Streaming<super::HealthCheckResponse> {
                RT::server_streaming(&self.inner, &super::health_server::DESCRIPTOR.methods[2],
                    request.into_request())
            }",
            // Server trait.
            "/// The stream of responses of `Watch`.
            type WatchStream: RT::Stream<Item = ::core::result::Result<super::HealthCheckResponse, RT::Status>>
                + ::core::marker::Send + 'static;",
            "fn watch(&self, request: RT::Request<super::HealthCheckRequest>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<Self::WatchStream>, RT::Status>> + ::core::marker::Send;",
            "fn check(&self, request: RT::Request<super::HealthCheckRequest>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<super::HealthCheckResponse>, RT::Status>> + ::core::marker::Send;",
            // Dispatch and descriptor.
            "call.server_streaming(move |request| async move { T::watch(&inner, request).await })",
            "call.unary_async(move |request| async move { T::check(&inner, request).await })",
            &descriptor("/grpc.health.v1.Health/Check", "Unary"),
            &descriptor("/grpc.health.v1.Health/List", "Unary"),
            &descriptor("/grpc.health.v1.Health/Watch", "ServerStreaming"),
        ],
    );
    // Only rpcs that stream requests have a sender, only those that stream
    // responses a stream type.
    assert_lacks(&code, &["watch_sender", "check_sender", "CheckStream"]);
}

#[test]
fn grpc_interop_test_service_has_every_kind() {
    let code = generate(&["grpc/testing/test.proto"], "grpc.testing");
    assert_has(
        &code,
        &[
            // Unary, on a message of the package named `Empty` (not the
            // well-known type).
            "pub fn empty_call(&self, request: impl RT::IntoRequest<super::Empty>)
                -> RT::UnaryCall<super::Empty>",
            // Server-streaming.
            "pub fn streaming_output_call(&self,
                request: impl RT::IntoRequest<super::StreamingOutputCallRequest>)
                -> RT::Streaming<super::StreamingOutputCallResponse>",
            "type StreamingOutputCallStream: RT::Stream<Item = ::core::result::Result<
                super::StreamingOutputCallResponse, RT::Status>> + ::core::marker::Send + 'static;",
            "fn streaming_output_call(&self, request: RT::Request<super::StreamingOutputCallRequest>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<Self::StreamingOutputCallStream>, RT::Status>> + ::core::marker::Send;",
            // Client-streaming.
            "pub fn streaming_input_call(&self,
                request: impl RT::IntoStreamingRequest<Message = super::StreamingInputCallRequest>)
                -> RT::ClientStreamingCall<super::StreamingInputCallResponse> {
                RT::client_streaming(&self.inner, &super::test_service_server::DESCRIPTOR.methods[4],
                    request.into_streaming_request())
            }",
            "pub fn streaming_input_call_sender(&self, request: impl RT::IntoRequest<()>)
                -> (RT::RequestSender<super::StreamingInputCallRequest>,
                    RT::ClientStreamingCall<super::StreamingInputCallResponse>) {
                RT::client_streaming_sender(&self.inner,
                    &super::test_service_server::DESCRIPTOR.methods[4], request.into_request())
            }",
            "fn streaming_input_call(&self,
                request: RT::Request<RT::Streaming<super::StreamingInputCallRequest>>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<super::StreamingInputCallResponse>, RT::Status>> + ::core::marker::Send;",
            // Bidirectional, twice.
            "pub fn full_duplex_call(&self,
                request: impl RT::IntoStreamingRequest<Message = super::StreamingOutputCallRequest>)
                -> RT::Streaming<super::StreamingOutputCallResponse> {
                RT::streaming(&self.inner, &super::test_service_server::DESCRIPTOR.methods[5],
                    request.into_streaming_request())
            }",
            "pub fn half_duplex_call_sender(&self, request: impl RT::IntoRequest<()>)
                -> (RT::RequestSender<super::StreamingOutputCallRequest>,
                    RT::Streaming<super::StreamingOutputCallResponse>) {
                RT::streaming_sender(&self.inner,
                    &super::test_service_server::DESCRIPTOR.methods[6], request.into_request())
            }",
            "type FullDuplexCallStream:",
            "type HalfDuplexCallStream:",
            "fn half_duplex_call(&self,
                request: RT::Request<RT::Streaming<super::StreamingOutputCallRequest>>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<Self::HalfDuplexCallStream>, RT::Status>> + ::core::marker::Send;",
            // Dispatch of each kind.
            "call.unary_async(move |request| async move { T::unary_call(&inner, request).await })",
            "call.server_streaming(move |request| async move {
                T::streaming_output_call(&inner, request).await })",
            "call.client_streaming(move |request| async move {
                T::streaming_input_call(&inner, request).await })",
            "call.streaming(move |request| async move { T::full_duplex_call(&inner, request).await })",
            "call.streaming(move |request| async move { T::half_duplex_call(&inner, request).await })",
            &descriptor("/grpc.testing.TestService/EmptyCall", "Unary"),
            &descriptor(
                "/grpc.testing.TestService/StreamingOutputCall",
                "ServerStreaming",
            ),
            &descriptor(
                "/grpc.testing.TestService/StreamingInputCall",
                "ClientStreaming",
            ),
            &descriptor("/grpc.testing.TestService/FullDuplexCall", "Streaming"),
            &descriptor("/grpc.testing.TestService/HalfDuplexCall", "Streaming"),
            // The other services of the file.
            "pub mod unimplemented_service_client {",
            "pub mod reconnect_service_server {",
            "pub mod load_balancer_stats_service_client {",
            "pub mod hook_service_server {",
            "pub mod xds_update_health_service_client {",
            "pub mod xds_update_client_configure_service_server {",
        ],
    );
    assert_lacks(
        &code,
        &["empty_call_sender", "streaming_output_call_sender"],
    );
}

#[test]
fn pubsub_subscriber_streaming_pull() {
    let code = generate(&["google/pubsub/v1/pubsub.proto"], "google.pubsub.v1");
    assert_has(
        &code,
        &[
            "pub fn streaming_pull(&self,
                request: impl RT::IntoStreamingRequest<Message = super::StreamingPullRequest>)
                -> RT::Streaming<super::StreamingPullResponse>",
            "pub fn streaming_pull_sender(&self, request: impl RT::IntoRequest<()>)
                -> (RT::RequestSender<super::StreamingPullRequest>,
                    RT::Streaming<super::StreamingPullResponse>)",
            "/// The stream of responses of `StreamingPull`.
            type StreamingPullStream: RT::Stream<Item = ::core::result::Result<
                super::StreamingPullResponse, RT::Status>> + ::core::marker::Send + 'static;",
            "fn streaming_pull(&self, request: RT::Request<RT::Streaming<super::StreamingPullRequest>>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<Self::StreamingPullStream>, RT::Status>> + ::core::marker::Send;",
            "call.streaming(move |request| async move { T::streaming_pull(&inner, request).await })",
            &descriptor("/google.pubsub.v1.Subscriber/StreamingPull", "Streaming"),
            // `google.protobuf.Empty` is `()`.
            "pub fn acknowledge(&self, request: impl RT::IntoRequest<super::AcknowledgeRequest>)
                -> RT::UnaryCall<()>",
            "fn delete_subscription(&self, request: RT::Request<super::DeleteSubscriptionRequest>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<()>, RT::Status>> + ::core::marker::Send;",
            &descriptor("/google.pubsub.v1.Subscriber/Pull", "Unary"),
        ],
    );
}

#[test]
fn csi_snapshot_metadata_server_streaming() {
    let code = generate(&["csi.proto"], "csi.v1");
    assert_has(
        &code,
        &[
            "pub fn get_metadata_allocated(&self,
                request: impl RT::IntoRequest<super::GetMetadataAllocatedRequest>)
                -> RT::Streaming<super::GetMetadataAllocatedResponse>",
            "pub fn get_metadata_delta(&self,
                request: impl RT::IntoRequest<super::GetMetadataDeltaRequest>)
                -> RT::Streaming<super::GetMetadataDeltaResponse>",
            "type GetMetadataAllocatedStream: RT::Stream<Item = ::core::result::Result<
                super::GetMetadataAllocatedResponse, RT::Status>> + ::core::marker::Send + 'static;",
            "type GetMetadataDeltaStream: RT::Stream<Item = ::core::result::Result<
                super::GetMetadataDeltaResponse, RT::Status>> + ::core::marker::Send + 'static;",
            "fn get_metadata_delta(&self, request: RT::Request<super::GetMetadataDeltaRequest>)
                -> impl ::core::future::Future<Output = ::core::result::Result<
                    RT::Response<Self::GetMetadataDeltaStream>, RT::Status>> + ::core::marker::Send;",
            "call.server_streaming(move |request| async move {
                T::get_metadata_allocated(&inner, request).await })",
            &descriptor(
                "/csi.v1.SnapshotMetadata/GetMetadataAllocated",
                "ServerStreaming",
            ),
            &descriptor("/csi.v1.SnapshotMetadata/GetMetadataDelta", "ServerStreaming"),
        ],
    );
}

#[test]
fn all_together_in_one_build() {
    // One `compile` call with every file, as a build script would make it.
    let include = real_world();
    let out = tempfile::tempdir().unwrap();
    let protos = [
        "grpc/health/v1/health.proto",
        "grpc/testing/test.proto",
        "google/pubsub/v1/pubsub.proto",
        "csi.proto",
    ]
    .map(|p| include.join(p));
    rpc_codegen::configure()
        .out_dir(out.path())
        .emit_rerun_if_changed(false)
        .compile(&protos, &[&include])
        .unwrap_or_else(|err| panic!("{err}"));
    for file in [
        "grpc.health.v1.rs",
        "grpc.testing.rs",
        "google.pubsub.v1.rs",
        "csi.v1.rs",
    ] {
        assert!(out.path().join(file).exists(), "{file} not generated");
    }
}
