//! The client's test cases, each asserting what gRPC's interop document
//! says it asserts: sizes, counts, codes, messages byte for byte, metadata
//! values, and the compressed flag where the document has the client check
//! it. A case returns `Err` with what differed.
//!
//! One difference of API, not of what is checked: a unary response's
//! trailing metadata arrives in [`rpc_core::Response::metadata`] together
//! with its initial metadata (a stream keeps them apart:
//! [`rpc_core::Streaming::trailers`]).

use crate::pb::test_service_client::TestServiceClient;
use crate::pb::unimplemented_service_client::UnimplementedServiceClient;
use crate::pb::{
    BoolValue, EchoStatus, Empty, Payload, ResponseParameters, SimpleRequest,
    StreamingInputCallRequest, StreamingOutputCallRequest,
};
use crate::server::{ECHO_INITIAL, ECHO_TRAILING};
use rpc_core::{Channel, Code, Encoding, Request, Status};
use std::time::Duration;

/// What a case came to: `Err` says what differed.
pub type Outcome = Result<(), String>;

/// A case: its name (as `--test_case` names it) and its body.
pub struct Case {
    /// The case's name in gRPC's document.
    pub name: &'static str,
    /// Runs it on a channel to the server under test.
    pub run: fn(&Channel) -> Outcome,
}

/// Every case, in the document's order.
pub const ALL: &[Case] = &[
    Case {
        name: "empty_unary",
        run: empty_unary,
    },
    Case {
        name: "large_unary",
        run: large_unary,
    },
    Case {
        name: "client_compressed_unary",
        run: client_compressed_unary,
    },
    Case {
        name: "server_compressed_unary",
        run: server_compressed_unary,
    },
    Case {
        name: "client_streaming",
        run: client_streaming,
    },
    Case {
        name: "client_compressed_streaming",
        run: client_compressed_streaming,
    },
    Case {
        name: "server_streaming",
        run: server_streaming,
    },
    Case {
        name: "server_compressed_streaming",
        run: server_compressed_streaming,
    },
    Case {
        name: "ping_pong",
        run: ping_pong,
    },
    Case {
        name: "empty_stream",
        run: empty_stream,
    },
    Case {
        name: "custom_metadata",
        run: custom_metadata,
    },
    Case {
        name: "status_code_and_message",
        run: status_code_and_message,
    },
    Case {
        name: "special_status_message",
        run: special_status_message,
    },
    Case {
        name: "unimplemented_method",
        run: unimplemented_method,
    },
    Case {
        name: "unimplemented_service",
        run: unimplemented_service,
    },
    Case {
        name: "cancel_after_begin",
        run: cancel_after_begin,
    },
    Case {
        name: "cancel_after_first_response",
        run: cancel_after_first_response,
    },
    Case {
        name: "timeout_on_sleeping_server",
        run: timeout_on_sleeping_server,
    },
    Case {
        name: "concurrent_large_unary",
        run: concurrent_large_unary,
    },
];

/// The case named `name`.
pub fn find(name: &str) -> Option<&'static Case> {
    ALL.iter().find(|c| c.name == name)
}

/// `Err(what)` unless `ok`.
fn ensure(ok: bool, what: impl FnOnce() -> String) -> Outcome {
    if ok { Ok(()) } else { Err(what()) }
}

/// A call's error as a case's.
fn failed(what: &str) -> impl FnOnce(Status) -> String + '_ {
    move |status| format!("{what}: {:?} {}", status.code(), status.message())
}

fn zeros(len: usize) -> Option<Payload> {
    Some(Payload {
        r#type: 0,
        body: vec![0; len].into(),
    })
}

fn flag(value: bool) -> Option<BoolValue> {
    Some(BoolValue { value })
}

/// Checks a response payload: `len` bytes, all zero.
fn check_body(payload: Option<&Payload>, len: usize, what: &str) -> Outcome {
    let body = payload.map_or(&[][..], |p| &p.body[..]);
    ensure(body.len() == len, || {
        format!("{what}: {} bytes, not {len}", body.len())
    })?;
    ensure(body.iter().all(|&b| b == 0), || {
        format!("{what}: the payload is not zeros")
    })
}

/// The request of `large_unary` and the compression cases.
fn large_request() -> SimpleRequest {
    SimpleRequest {
        response_size: 314_159,
        payload: zeros(271_828),
        ..SimpleRequest::default()
    }
}

fn client(channel: &Channel) -> TestServiceClient {
    TestServiceClient::new(channel.clone())
}

fn empty_unary(channel: &Channel) -> Outcome {
    let reply = client(channel)
        .empty_call(Empty {})
        .wait()
        .map_err(failed("EmptyCall"))?;
    ensure(reply.get_ref() == &Empty {}, || {
        "a non-empty response".into()
    })
}

fn large_unary(channel: &Channel) -> Outcome {
    let reply = client(channel)
        .unary_call(large_request())
        .wait()
        .map_err(failed("UnaryCall"))?;
    check_body(reply.get_ref().payload.as_ref(), 314_159, "the response")
}

fn client_compressed_unary(channel: &Channel) -> Outcome {
    let plain = client(channel);
    let compressed = plain.clone().send_compressed(Encoding::Gzip);
    // The feature probe: expects compression, sent as it is.
    let probe = SimpleRequest {
        expect_compressed: flag(true),
        ..large_request()
    };
    match plain.unary_call(probe.clone()).wait() {
        Err(status) if status.code() == Code::InvalidArgument => {}
        Err(status) => return Err(failed("the probe")(status)),
        Ok(_) => {
            return Err("the probe sent uncompressed succeeded (INVALID_ARGUMENT expected)".into());
        }
    }
    let reply = compressed
        .unary_call(probe)
        .wait()
        .map_err(failed("the compressed call"))?;
    check_body(
        reply.get_ref().payload.as_ref(),
        314_159,
        "the compressed call's response",
    )?;
    let uncompressed = SimpleRequest {
        expect_compressed: flag(false),
        ..large_request()
    };
    let reply = plain
        .unary_call(uncompressed)
        .wait()
        .map_err(failed("the uncompressed call"))?;
    check_body(
        reply.get_ref().payload.as_ref(),
        314_159,
        "the uncompressed call's response",
    )
}

fn server_compressed_unary(channel: &Channel) -> Outcome {
    let client = client(channel);
    for compressed in [true, false] {
        let request = SimpleRequest {
            response_compressed: flag(compressed),
            ..large_request()
        };
        let what = format!("response_compressed={compressed}");
        let reply = client.unary_call(request).wait().map_err(failed(&what))?;
        ensure(reply.message_encoding().is_some() == compressed, || {
            format!(
                "{what}: the response arrived with encoding {:?}",
                reply.message_encoding()
            )
        })?;
        check_body(reply.get_ref().payload.as_ref(), 314_159, &what)?;
    }
    Ok(())
}

/// The sizes `client_streaming` sends, and their sum.
const INPUT_SIZES: [usize; 4] = [27_182, 8, 1_828, 45_904];

fn client_streaming(channel: &Channel) -> Outcome {
    let (mut tx, call) = client(channel).streaming_input_call_sender(Request::new(()));
    for size in INPUT_SIZES {
        tx.send(StreamingInputCallRequest {
            payload: zeros(size),
            ..Default::default()
        })
        .map_err(failed("a send"))?;
    }
    tx.close().map_err(failed("the half-close"))?;
    let reply = call.wait().map_err(failed("StreamingInputCall"))?;
    let total = reply.get_ref().aggregated_payload_size;
    ensure(total == 74_922, || {
        format!("aggregated_payload_size {total}, not 74922")
    })
}

fn client_compressed_streaming(channel: &Channel) -> Outcome {
    let plain = client(channel);
    // The feature probe: expects compression, sent as it is.
    let (mut tx, call) = plain.streaming_input_call_sender(Request::new(()));
    let sent = tx.send(StreamingInputCallRequest {
        payload: zeros(27_182),
        expect_compressed: flag(true),
    });
    let _ = tx.close();
    match (sent, call.wait()) {
        (_, Err(status)) if status.code() == Code::InvalidArgument => {}
        (_, Err(status)) => return Err(failed("the probe")(status)),
        (_, Ok(_)) => {
            return Err("the probe sent uncompressed succeeded (INVALID_ARGUMENT expected)".into());
        }
    }
    let compressed = plain.send_compressed(Encoding::Gzip);
    let (mut tx, call) = compressed.streaming_input_call_sender(Request::new(()));
    tx.send(StreamingInputCallRequest {
        payload: zeros(27_182),
        expect_compressed: flag(true),
    })
    .map_err(failed("the compressed message"))?;
    tx.set_compression(None);
    tx.send(StreamingInputCallRequest {
        payload: zeros(45_904),
        expect_compressed: flag(false),
    })
    .map_err(failed("the uncompressed message"))?;
    tx.close().map_err(failed("the half-close"))?;
    let reply = call.wait().map_err(failed("StreamingInputCall"))?;
    let total = reply.get_ref().aggregated_payload_size;
    ensure(total == 73_086, || {
        format!("aggregated_payload_size {total}, not 73086")
    })
}

/// The sizes the streaming cases ask for.
const OUTPUT_SIZES: [usize; 4] = [31_415, 9, 2_653, 58_979];

fn parameters(size: usize) -> ResponseParameters {
    ResponseParameters {
        size: size as i32,
        ..ResponseParameters::default()
    }
}

fn server_streaming(channel: &Channel) -> Outcome {
    let request = StreamingOutputCallRequest {
        response_parameters: OUTPUT_SIZES.map(parameters).to_vec(),
        ..Default::default()
    };
    let mut stream = client(channel).streaming_output_call(request);
    let mut got = Vec::new();
    while let Some(reply) = stream
        .blocking_message()
        .map_err(failed("StreamingOutputCall"))?
    {
        check_body(
            reply.payload.as_ref(),
            OUTPUT_SIZES.get(got.len()).copied().unwrap_or(0),
            "a response",
        )?;
        got.push(reply);
    }
    ensure(got.len() == 4, || format!("{} responses, not 4", got.len()))
}

fn server_compressed_streaming(channel: &Channel) -> Outcome {
    let asked = [(true, 31_415usize), (false, 92_653)];
    let request = StreamingOutputCallRequest {
        response_parameters: asked
            .iter()
            .map(|&(compressed, size)| ResponseParameters {
                compressed: flag(compressed),
                ..parameters(size)
            })
            .collect(),
        ..Default::default()
    };
    let mut stream = client(channel).streaming_output_call(request);
    let mut count = 0;
    while let Some(reply) = stream
        .blocking_message()
        .map_err(failed("StreamingOutputCall"))?
    {
        let Some(&(compressed, size)) = asked.get(count) else {
            return Err("more than two responses".into());
        };
        let what = format!("response {count} (compressed={compressed})");
        ensure(stream.message_encoding().is_some() == compressed, || {
            format!(
                "{what}: arrived with encoding {:?}",
                stream.message_encoding()
            )
        })?;
        check_body(reply.payload.as_ref(), size, &what)?;
        count += 1;
    }
    ensure(count == 2, || format!("{count} responses, not 2"))
}

fn ping_pong(channel: &Channel) -> Outcome {
    let (mut tx, mut rx) = client(channel).full_duplex_call_sender(Request::new(()));
    for (size, payload) in OUTPUT_SIZES.into_iter().zip(INPUT_SIZES) {
        tx.send(StreamingOutputCallRequest {
            response_parameters: vec![parameters(size)],
            payload: zeros(payload),
            ..Default::default()
        })
        .map_err(failed("a send"))?;
        let reply = rx
            .blocking_message()
            .map_err(failed("FullDuplexCall"))?
            .ok_or("the stream ended early")?;
        check_body(reply.payload.as_ref(), size, "a response")?;
    }
    tx.close().map_err(failed("the half-close"))?;
    let end = rx
        .blocking_message()
        .map_err(failed("FullDuplexCall's end"))?;
    ensure(end.is_none(), || "more than four responses".into())
}

fn empty_stream(channel: &Channel) -> Outcome {
    let (tx, mut rx) = client(channel).full_duplex_call_sender(Request::new(()));
    tx.close().map_err(failed("the half-close"))?;
    let first = rx.blocking_message().map_err(failed("FullDuplexCall"))?;
    ensure(first.is_none(), || "a response to no request".into())
}

/// The metadata `custom_metadata` sends and expects back.
const INITIAL_VALUE: &str = "test_initial_metadata_value";
const TRAILING_VALUE: [u8; 3] = [0xab, 0xab, 0xab];

fn with_echo_metadata<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    let md = request.metadata_mut();
    md.insert(ECHO_INITIAL, INITIAL_VALUE).expect("a valid key");
    md.insert_bin(ECHO_TRAILING, TRAILING_VALUE.to_vec())
        .expect("a valid key");
    request
}

fn check_echoed(
    initial: &rpc_core::Metadata,
    trailing: &rpc_core::Metadata,
    what: &str,
) -> Outcome {
    ensure(initial.get(ECHO_INITIAL) == Some(INITIAL_VALUE), || {
        format!(
            "{what}: initial metadata {ECHO_INITIAL} is {:?}",
            initial.get(ECHO_INITIAL)
        )
    })?;
    ensure(
        trailing.get_bin(ECHO_TRAILING) == Some(&TRAILING_VALUE[..]),
        || {
            format!(
                "{what}: trailing metadata {ECHO_TRAILING} is {:?}",
                trailing.get_bin(ECHO_TRAILING)
            )
        },
    )
}

fn custom_metadata(channel: &Channel) -> Outcome {
    let client = client(channel);
    let reply = client
        .unary_call(with_echo_metadata(large_request()))
        .wait()
        .map_err(failed("UnaryCall"))?;
    check_echoed(reply.metadata(), reply.metadata(), "UnaryCall")?;
    let (mut tx, mut rx) = client.full_duplex_call_sender(with_echo_metadata(()));
    tx.send(StreamingOutputCallRequest {
        response_parameters: vec![parameters(314_159)],
        payload: zeros(271_828),
        ..Default::default()
    })
    .map_err(failed("a send"))?;
    tx.close().map_err(failed("the half-close"))?;
    while rx
        .blocking_message()
        .map_err(failed("FullDuplexCall"))?
        .is_some()
    {}
    let initial = rx.metadata().unwrap_or_default();
    let trailing = rx.trailers().unwrap_or_default();
    check_echoed(&initial, &trailing, "FullDuplexCall")
}

/// Asks for status `code` and `message` by unary call and by stream, and
/// checks both come back exactly.
fn echo_status(channel: &Channel, code: i32, message: &str) -> Outcome {
    let client = client(channel);
    let response_status = Some(EchoStatus {
        code,
        message: message.to_owned(),
    });
    let check = |status: Status, what: &str| {
        ensure(
            status.code() as i32 == code && status.message() == message,
            || {
                format!(
                    "{what}: {:?} {:?}, not {code} {message:?}",
                    status.code(),
                    status.message()
                )
            },
        )
    };
    let request = SimpleRequest {
        response_status: response_status.clone(),
        ..SimpleRequest::default()
    };
    match client.unary_call(request).wait() {
        Ok(_) => return Err("UnaryCall succeeded".into()),
        Err(status) => check(status, "UnaryCall")?,
    }
    let (mut tx, mut rx) = client.full_duplex_call_sender(Request::new(()));
    tx.send(StreamingOutputCallRequest {
        response_status,
        ..Default::default()
    })
    .map_err(failed("a send"))?;
    tx.close().map_err(failed("the half-close"))?;
    loop {
        match rx.blocking_message() {
            Ok(Some(_)) => {}
            Ok(None) => return Err("FullDuplexCall succeeded".into()),
            Err(status) => return check(status, "FullDuplexCall"),
        }
    }
}

fn status_code_and_message(channel: &Channel) -> Outcome {
    echo_status(channel, 2, "test status message")
}

fn special_status_message(channel: &Channel) -> Outcome {
    echo_status(
        channel,
        2,
        "\t\ntest with whitespace\r\nand Unicode BMP \u{263a} and non-BMP \u{1f608}\t\n",
    )
}

fn expect_unimplemented(result: Result<impl Sized, Status>, what: &str) -> Outcome {
    match result {
        Ok(_) => Err(format!("{what} succeeded")),
        Err(status) => ensure(status.code() == Code::Unimplemented, || {
            failed(what)(status)
        }),
    }
}

fn unimplemented_method(channel: &Channel) -> Outcome {
    let result = client(channel).unimplemented_call(Empty {}).wait();
    expect_unimplemented(result, "TestService/UnimplementedCall")
}

fn unimplemented_service(channel: &Channel) -> Outcome {
    let result = UnimplementedServiceClient::new(channel.clone())
        .unimplemented_call(Empty {})
        .wait();
    expect_unimplemented(result, "UnimplementedService/UnimplementedCall")
}

fn expect_cancelled(result: Result<impl Sized, Status>, what: &str) -> Outcome {
    match result {
        Ok(_) => Err(format!("{what} succeeded after its cancel")),
        Err(status) => ensure(status.code() == Code::Cancelled, || failed(what)(status)),
    }
}

fn cancel_after_begin(channel: &Channel) -> Outcome {
    let (_tx, mut call) = client(channel).streaming_input_call_sender(Request::new(()));
    call.cancel();
    expect_cancelled(call.wait(), "StreamingInputCall")
}

fn cancel_after_first_response(channel: &Channel) -> Outcome {
    let (mut tx, mut rx) = client(channel).full_duplex_call_sender(Request::new(()));
    tx.send(StreamingOutputCallRequest {
        response_parameters: vec![parameters(31_415)],
        payload: zeros(27_182),
        ..Default::default()
    })
    .map_err(failed("a send"))?;
    let first = rx.blocking_message().map_err(failed("FullDuplexCall"))?;
    check_body(
        first.ok_or("no first response")?.payload.as_ref(),
        31_415,
        "the response",
    )?;
    rx.cancel();
    expect_cancelled(rx.blocking_message(), "FullDuplexCall")
}

fn timeout_on_sleeping_server(channel: &Channel) -> Outcome {
    let mut request = Request::new(());
    request.set_timeout(Duration::from_millis(1));
    let (mut tx, mut rx) = client(channel).full_duplex_call_sender(request);
    // The send may fail already if the deadline passed.
    let _ = tx.send(StreamingOutputCallRequest {
        payload: zeros(27_182),
        ..Default::default()
    });
    loop {
        match rx.blocking_message() {
            Ok(Some(_)) => {}
            Ok(None) => return Err("FullDuplexCall ended without its deadline".into()),
            Err(status) => {
                return ensure(status.code() == Code::DeadlineExceeded, || {
                    failed("FullDuplexCall")(status)
                });
            }
        }
    }
}

fn concurrent_large_unary(channel: &Channel) -> Outcome {
    let client = client(channel);
    let calls: Vec<_> = (0..1000)
        .map(|_| client.unary_call(large_request()))
        .collect();
    let replies = futures::executor::block_on(futures::future::join_all(calls));
    for (i, reply) in replies.into_iter().enumerate() {
        let reply = reply.map_err(failed(&format!("call {i}")))?;
        check_body(
            reply.get_ref().payload.as_ref(),
            314_159,
            &format!("call {i}"),
        )?;
    }
    Ok(())
}

/// Runs `cases` on `channel`, printing `PASS name` or `FAIL name: why` for
/// each and a closing `N passed, M failed`; returns how many failed.
pub fn run(channel: &Channel, cases: &[&Case]) -> usize {
    let mut failed = 0;
    for case in cases {
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (case.run)(channel)))
                .unwrap_or_else(|_| Err("the case panicked".into()));
        match outcome {
            Ok(()) => println!("PASS {}", case.name),
            Err(why) => {
                failed += 1;
                println!("FAIL {}: {why}", case.name);
            }
        }
    }
    println!("{} passed, {failed} failed", cases.len() - failed);
    failed
}
