"""gRPC's interop cases with grpcio (Python, on gRPC's C core): a client
that runs them against a server (ours, through its gRPC face) and a
TestService server that interop-client runs them against (through
grpc://). Run by scripts/grpcio-interop, in a virtual environment that
scripts/test makes; the stubs are generated there from proto/grpc/testing.

    interop.py client --port PORT [--test_case all|NAME,...]
    interop.py server --port PORT     (prints "listening PORT", serves until SIGTERM)

grpcio compresses a call's messages all or none, and does not tell a
handler or a caller whether a message came compressed. So the client's
compression cases check what it can (the probes, sizes), and the
client_compressed_streaming case sends both messages compressed; the
server cannot serve the probes of client_compressed_unary and
client_compressed_streaming (it cannot tell a request came uncompressed),
and interop-client is not asked to run them against it.
"""

import argparse
import queue
import signal
import sys
import threading
import time
from concurrent import futures

import grpc

from grpc_testing_pb import empty_pb2, messages_pb2, test_pb2_grpc  # generated (scripts/grpcio-interop)

ECHO_INITIAL = "x-grpc-test-echo-initial"
ECHO_TRAILING = "x-grpc-test-echo-trailing-bin"
INITIAL_VALUE = "test_initial_metadata_value"
TRAILING_VALUE = b"\x0a\x0b\x0a\x0b\x0a\x0b"
SPECIAL = "\t\ntest with whitespace\r\nand Unicode BMP \u263a and non-BMP \U0001f608\t\n"


class Fail(Exception):
    pass


def ensure(cond, why):
    if not cond:
        raise Fail(why)


def zeros(n):
    return messages_pb2.Payload(body=b"\0" * n)


def check_body(payload, n, what):
    body = payload.body
    ensure(len(body) == n and body.count(0) == n, f"{what}: {len(body)} bytes, not {n} zeros")


def expect_code(fn, code, what):
    try:
        fn()
    except grpc.RpcError as e:
        ensure(e.code() == code, f"{what}: {e.code()} {e.details()!r}, not {code}")
        return e
    raise Fail(f"{what}: succeeded, {code} expected")


def large_request(**kw):
    return messages_pb2.SimpleRequest(response_size=314159, payload=zeros(271828), **kw)


# ---- the client's cases ----

def empty_unary(stub, channel):
    ensure(stub.EmptyCall(empty_pb2.Empty()) == empty_pb2.Empty(), "EmptyCall")


def large_unary(stub, channel):
    check_body(stub.UnaryCall(large_request()).payload, 314159, "the response")


def client_compressed_unary(stub, channel):
    expect = lambda v: messages_pb2.BoolValue(value=v)  # noqa: E731
    expect_code(lambda: stub.UnaryCall(large_request(expect_compressed=expect(True))),
                grpc.StatusCode.INVALID_ARGUMENT, "the probe sent uncompressed")
    reply = stub.UnaryCall(large_request(expect_compressed=expect(True)),
                           compression=grpc.Compression.Gzip)
    check_body(reply.payload, 314159, "the compressed call's response")
    reply = stub.UnaryCall(large_request(expect_compressed=expect(False)))
    check_body(reply.payload, 314159, "the uncompressed call's response")


def server_compressed_unary(stub, channel):
    for compressed in (True, False):
        reply = stub.UnaryCall(large_request(
            response_compressed=messages_pb2.BoolValue(value=compressed)))
        check_body(reply.payload, 314159, f"response_compressed={compressed}")


def client_streaming(stub, channel):
    sizes = [27182, 8, 1828, 45904]
    reply = stub.StreamingInputCall(
        iter([messages_pb2.StreamingInputCallRequest(payload=zeros(n)) for n in sizes]))
    ensure(reply.aggregated_payload_size == 74922,
           f"aggregated_payload_size {reply.aggregated_payload_size}")


def client_compressed_streaming(stub, channel):
    def message(n, expect):
        return messages_pb2.StreamingInputCallRequest(
            payload=zeros(n), expect_compressed=messages_pb2.BoolValue(value=expect))
    expect_code(lambda: stub.StreamingInputCall(iter([message(27182, True)])),
                grpc.StatusCode.INVALID_ARGUMENT, "the probe sent uncompressed")
    reply = stub.StreamingInputCall(iter([message(27182, True), message(45904, True)]),
                                    compression=grpc.Compression.Gzip)
    ensure(reply.aggregated_payload_size == 73086,
           f"aggregated_payload_size {reply.aggregated_payload_size}")


def server_streaming(stub, channel):
    sizes = [31415, 9, 2653, 58979]
    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=n) for n in sizes])
    replies = list(stub.StreamingOutputCall(request))
    ensure(len(replies) == 4, f"{len(replies)} responses")
    for reply, n in zip(replies, sizes):
        check_body(reply.payload, n, "a response")


def server_compressed_streaming(stub, channel):
    request = messages_pb2.StreamingOutputCallRequest(response_parameters=[
        messages_pb2.ResponseParameters(size=31415, compressed=messages_pb2.BoolValue(value=True)),
        messages_pb2.ResponseParameters(size=92653, compressed=messages_pb2.BoolValue(value=False)),
    ])
    replies = list(stub.StreamingOutputCall(request))
    ensure(len(replies) == 2, f"{len(replies)} responses")
    check_body(replies[0].payload, 31415, "the first response")
    check_body(replies[1].payload, 92653, "the second response")


class Feed:
    """A request iterator fed message by message (None ends it)."""

    def __init__(self):
        self.q = queue.Queue()

    def __iter__(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item


def ping_pong(stub, channel):
    sizes = [(31415, 27182), (9, 8), (2653, 1828), (58979, 45904)]
    feed = Feed()
    replies = stub.FullDuplexCall(iter(feed))
    for size, payload in sizes:
        feed.q.put(messages_pb2.StreamingOutputCallRequest(
            response_parameters=[messages_pb2.ResponseParameters(size=size)],
            payload=zeros(payload)))
        check_body(next(replies).payload, size, "a response")
    feed.q.put(None)
    ensure(next(replies, None) is None, "more responses than requests")


def empty_stream(stub, channel):
    ensure(list(stub.FullDuplexCall(iter([]))) == [], "responses to no request")


def custom_metadata(stub, channel):
    metadata = ((ECHO_INITIAL, INITIAL_VALUE), (ECHO_TRAILING, TRAILING_VALUE))

    def check(initial, trailing, what):
        ensure((ECHO_INITIAL, INITIAL_VALUE) in list(initial), f"{what}: initial {initial}")
        ensure((ECHO_TRAILING, TRAILING_VALUE) in list(trailing), f"{what}: trailing {trailing}")

    _, call = stub.UnaryCall.with_call(large_request(), metadata=metadata)
    check(call.initial_metadata(), call.trailing_metadata(), "UnaryCall")
    request = messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=314159)],
        payload=zeros(271828))
    replies = stub.FullDuplexCall(iter([request]), metadata=metadata)
    list(replies)
    check(replies.initial_metadata(), replies.trailing_metadata(), "FullDuplexCall")


def echo_status(stub, message):
    status = messages_pb2.EchoStatus(code=2, message=message)
    e = expect_code(lambda: stub.UnaryCall(messages_pb2.SimpleRequest(response_status=status)),
                    grpc.StatusCode.UNKNOWN, "UnaryCall")
    ensure(e.details() == message, f"UnaryCall: {e.details()!r}")
    request = messages_pb2.StreamingOutputCallRequest(response_status=status)
    e = expect_code(lambda: list(stub.FullDuplexCall(iter([request]))),
                    grpc.StatusCode.UNKNOWN, "FullDuplexCall")
    ensure(e.details() == message, f"FullDuplexCall: {e.details()!r}")


def status_code_and_message(stub, channel):
    echo_status(stub, "test status message")


def special_status_message(stub, channel):
    echo_status(stub, SPECIAL)


def unimplemented_method(stub, channel):
    expect_code(lambda: stub.UnimplementedCall(empty_pb2.Empty()),
                grpc.StatusCode.UNIMPLEMENTED, "UnimplementedCall")


def unimplemented_service(stub, channel):
    other = test_pb2_grpc.UnimplementedServiceStub(channel)
    expect_code(lambda: other.UnimplementedCall(empty_pb2.Empty()),
                grpc.StatusCode.UNIMPLEMENTED, "UnimplementedService")


def cancel_after_begin(stub, channel):
    feed = Feed()
    future = stub.StreamingInputCall.future(iter(feed))
    time.sleep(0.1)
    future.cancel()
    ensure(future.cancelled(), "not cancelled")
    feed.q.put(None)


def cancel_after_first_response(stub, channel):
    feed = Feed()
    replies = stub.FullDuplexCall(iter(feed))
    feed.q.put(messages_pb2.StreamingOutputCallRequest(
        response_parameters=[messages_pb2.ResponseParameters(size=31415)],
        payload=zeros(27182)))
    check_body(next(replies).payload, 31415, "the first response")
    replies.cancel()
    e = expect_code(lambda: next(replies), grpc.StatusCode.CANCELLED, "after the cancel")
    feed.q.put(None)
    return e and None


def timeout_on_sleeping_server(stub, channel):
    feed = Feed()
    feed.q.put(messages_pb2.StreamingOutputCallRequest(payload=zeros(27182)))
    replies = stub.FullDuplexCall(iter(feed), timeout=0.001)
    expect_code(lambda: list(replies), grpc.StatusCode.DEADLINE_EXCEEDED, "FullDuplexCall")
    feed.q.put(None)


def concurrent_large_unary(stub, channel):
    calls = [stub.UnaryCall.future(large_request()) for _ in range(100)]
    for i, call in enumerate(calls):
        check_body(call.result().payload, 314159, f"call {i}")


CASES = [empty_unary, large_unary, client_compressed_unary, server_compressed_unary,
         client_streaming, client_compressed_streaming, server_streaming,
         server_compressed_streaming, ping_pong, empty_stream, custom_metadata,
         status_code_and_message, special_status_message, unimplemented_method,
         unimplemented_service, cancel_after_begin, cancel_after_first_response,
         timeout_on_sleeping_server, concurrent_large_unary]


def client(args):
    by_name = {c.__name__: c for c in CASES}
    names = list(by_name) if args.test_case == "all" else args.test_case.split(",")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown test cases {unknown}", file=sys.stderr)
        return 2
    channel = grpc.insecure_channel(f"{args.server_host}:{args.port}")
    stub = test_pb2_grpc.TestServiceStub(channel)
    failed = 0
    for name in names:
        try:
            by_name[name](stub, channel)
            print(f"PASS {name}", flush=True)
        except (Fail, grpc.RpcError, StopIteration) as e:
            failed += 1
            print(f"FAIL {name}: {e!r}", flush=True)
    print(f"{len(names) - failed} passed, {failed} failed")
    return 1 if failed else 0


# ---- the server ----

class TestService(test_pb2_grpc.TestServiceServicer):
    @staticmethod
    def echo_metadata(context):
        for key, value in context.invocation_metadata():
            if key == ECHO_INITIAL:
                context.send_initial_metadata(((key, value),))
            elif key == ECHO_TRAILING:
                context.set_trailing_metadata(((key, value),))

    @staticmethod
    def echo_status(status, context):
        if status.code != 0:
            context.abort(grpc.StatusCode(next(c.value for c in grpc.StatusCode
                                                if c.value[0] == status.code)), status.message)

    def EmptyCall(self, request, context):
        return empty_pb2.Empty()

    def UnaryCall(self, request, context):
        self.echo_metadata(context)
        self.echo_status(request.response_status, context)
        if request.HasField("response_compressed"):
            context.set_compression(grpc.Compression.Gzip if request.response_compressed.value
                                    else grpc.Compression.NoCompression)
        return messages_pb2.SimpleResponse(payload=zeros(request.response_size))

    CacheableUnaryCall = UnaryCall

    def respond(self, requests, context):
        context.set_compression(grpc.Compression.Gzip)
        for request in requests:
            self.echo_status(request.response_status, context)
            for p in request.response_parameters:
                if p.interval_us:
                    time.sleep(p.interval_us / 1e6)
                if not (p.HasField("compressed") and p.compressed.value):
                    context.disable_next_message_compression()
                yield messages_pb2.StreamingOutputCallResponse(payload=zeros(p.size))

    def StreamingOutputCall(self, request, context):
        self.echo_metadata(context)
        yield from self.respond([request], context)

    def StreamingInputCall(self, request_iterator, context):
        self.echo_metadata(context)
        total = sum(len(r.payload.body) for r in request_iterator)
        return messages_pb2.StreamingInputCallResponse(aggregated_payload_size=total)

    def FullDuplexCall(self, request_iterator, context):
        self.echo_metadata(context)
        yield from self.respond(request_iterator, context)

    def HalfDuplexCall(self, request_iterator, context):
        self.echo_metadata(context)
        yield from self.respond(list(request_iterator), context)


def server(args):
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    test_pb2_grpc.add_TestServiceServicer_to_server(TestService(), srv)
    port = srv.add_insecure_port(f"127.0.0.1:{args.port}")
    srv.start()
    print(f"listening {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    srv.stop(1).wait()
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["client", "server"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server_host", default="127.0.0.1")
    parser.add_argument("--test_case", default="all")
    args = parser.parse_args()
    return client(args) if args.role == "client" else server(args)


if __name__ == "__main__":
    sys.exit(main())
