//! gRPC's interop cases against `interop::server::TestServer`, in process:
//! on mem:// and tcp://, and over the server's gRPC face through
//! `grpc://`. (On rdma://, scripts/rdma-suite runs the binaries in the
//! Soft-RoCE guest, as processes.)

use interop::cases::{self, Case};
use interop::pb::test_service_server::TestServiceServer;
use interop::server::TestServer;
use rpc_core::{Channel, Server, ServerHandle};
use std::time::Duration;

fn serve(url: &str, face: bool) -> ServerHandle {
    let mut builder = Server::builder().add_service(TestServiceServer::new(TestServer));
    if face {
        builder = builder.grpc("127.0.0.1:0");
    }
    builder
        .serve(url)
        .unwrap_or_else(|e| panic!("serve on {url}: {e}"))
}

fn channel(url: &str) -> Channel {
    Channel::builder(url)
        .timeout(Duration::from_secs(60))
        .connect()
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Runs `cases` and fails naming those that failed.
fn run_all(channel: &Channel, cases: &[&Case]) {
    let failed: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            (case.run)(channel)
                .err()
                .map(|why| format!("{}: {why}", case.name))
        })
        .collect();
    assert!(failed.is_empty(), "failed cases:\n{}", failed.join("\n"));
}

fn every_case(url: &str) {
    let server = serve(url, false);
    let all: Vec<&Case> = cases::ALL.iter().collect();
    run_all(&channel(server.local_url()), &all);
}

#[test]
fn every_case_passes_on_mem() {
    every_case("mem://interop-cases");
}

#[test]
fn every_case_passes_on_tcp() {
    every_case("tcp://127.0.0.1:0");
}

#[test]
fn every_case_passes_over_the_grpc_face() {
    let server = serve("mem://interop-face", true);
    let addr = server.grpc_addr().expect("the face is up");
    let all: Vec<&Case> = cases::ALL.iter().collect();
    run_all(&channel(&format!("grpc://{addr}")), &all);
}

#[test]
fn the_client_binary_reports_each_case_and_its_exit_code_says_how_it_went() {
    let server = serve("tcp://127.0.0.1:0", false);
    let bin = env!("CARGO_BIN_EXE_interop-client");
    let run = |cases: &str| {
        std::process::Command::new(bin)
            .args(["--url", server.local_url(), "--test_case", cases])
            .output()
            .expect("interop-client runs")
    };
    let out = run("empty_unary,large_unary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(
        stdout,
        "PASS empty_unary\nPASS large_unary\n2 passed, 0 failed\n"
    );
    let out = run("no_such_case");
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown case is a usage error"
    );
    // A server without the service: every case fails, and the exit code says so.
    let (_health, service) = rpc_core::health::service();
    let other = Server::builder()
        .add_service(service)
        .serve("tcp://127.0.0.1:0")
        .unwrap();
    let out = std::process::Command::new(bin)
        .args(["--url", other.local_url(), "--test_case", "empty_unary"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.starts_with("FAIL empty_unary: "), "{stdout}");
    assert!(stdout.ends_with("0 passed, 1 failed\n"), "{stdout}");
}

/// A `grpc://` request stream whose message cannot be passed on (it
/// inflates past the gateway's limit) ends the call with that status: the
/// gateway resets its HTTP/2 stream to the server rather than leave the
/// server waiting for the rest, and the caller hears why.
#[test]
fn a_request_stream_the_gateway_cannot_pass_on_fails_the_call_with_its_status() {
    use interop::pb::StreamingInputCallRequest;
    use interop::pb::test_service_client::TestServiceClient;
    let server = serve("mem://interop-gateway-limit", true);
    let addr = server.grpc_addr().expect("the face is up");
    let channel = Channel::builder(&format!("grpc://{addr}"))
        .timeout(Duration::from_secs(60))
        .max_message_size(256 << 20)
        .connect()
        .unwrap();
    let client = TestServiceClient::new(channel).send_compressed(rpc_core::Encoding::Zstd);
    let started = std::time::Instant::now();
    let (mut tx, call) = client.streaming_input_call_sender(rpc_core::Request::new(()));
    // 100 MiB of zeros: a few KiB compressed, past the gateway's 64 MiB inflated.
    let _ = tx.send(StreamingInputCallRequest {
        payload: Some(interop::pb::Payload {
            r#type: 0,
            body: vec![0; 100 << 20].into(),
        }),
        expect_compressed: None,
    });
    let err = call.wait().unwrap_err();
    assert_eq!(err.code(), rpc_core::Code::ResourceExhausted, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the call waited {:?} for its end",
        started.elapsed()
    );
    drop(tx);
}
