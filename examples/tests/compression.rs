//! Message compression end to end, on every fabric: each encoding both
//! ways (in the ring and, past the rendezvous threshold, lent), what each
//! side sees of how a message travelled, the negotiation (a server sends
//! compressed only what its caller accepts; a request in an encoding the
//! server does not accept fails `Unimplemented`), a decompression bomb
//! bounded by the receive limit, and streams switching compression message
//! by message.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::{Echo, EchoServer};
use examples::echo::{EchoReply, EchoRequest, StreamRequest};
use futures::StreamExt;
use rpc_core::{
    BoxStream, Code, CompressionSwitch, Encoding, EncodingSet, Request, Response, Server, Status,
};

/// Answers with what it received, and says in its metadata how the request
/// arrived (`x-arrived`: an encoding or `identity`). A request's `x-send`
/// metadata (an encoding, or `identity`) sets how the response leaves;
/// without it the service's setting holds. Its stream alternates
/// compressed (even messages) and not (odd ones) when `x-send` names an
/// encoding.
struct Reports;

fn name(encoding: Option<Encoding>) -> &'static str {
    encoding.map_or("identity", Encoding::as_str)
}

fn wanted(request_metadata: &rpc_core::Metadata) -> Option<Option<Encoding>> {
    request_metadata.get("x-send").map(Encoding::from_name)
}

impl Echo for Reports {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let arrived = name(request.message_encoding());
        let send = wanted(request.metadata());
        let mut response = Response::new(EchoReply {
            payload: request.into_inner().payload,
        });
        response
            .metadata_mut()
            .insert("x-arrived", arrived)
            .unwrap();
        Ok(match send {
            Some(encoding) => response.send_compressed(encoding),
            None => response,
        })
    }

    type StreamStream = BoxStream<EchoReply>;

    async fn stream(
        &self,
        request: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let send = wanted(request.metadata()).flatten();
        let StreamRequest { count, size } = request.into_inner();
        let switch = CompressionSwitch::new(send);
        let each = switch.clone();
        let stream = futures::stream::iter(0..count).map(move |i| {
            each.set(send.filter(|_| i % 2 == 0));
            Ok(EchoReply {
                payload: pattern(size as usize, i).into(),
            })
        });
        Ok(Response::new(Box::pin(stream) as BoxStream<EchoReply>).with_compression_switch(switch))
    }
}

/// A compressible payload of `len` bytes: runs of one byte.
fn compressible(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let byte = (out.len() / 1000) as u8;
        out.extend(std::iter::repeat_n(byte, 1000.min(len - out.len())));
    }
    out
}

fn call(
    client: &EchoClient,
    payload: Vec<u8>,
    send: Option<&str>,
) -> Result<Response<EchoReply>, Status> {
    let mut request = Request::new(EchoRequest {
        payload: payload.into(),
    });
    if let Some(send) = send {
        request.metadata_mut().insert("x-send", send).unwrap();
    }
    client.echo(request).wait()
}

on_every_fabric_and_face! {
    fn every_encoding_travels_both_ways_and_each_side_sees_it(url: &str) {
        let builder = Server::builder().add_service(EchoServer::new(Reports));
        let (_server, at) = serve_for_clients(builder, url);
        let plain = EchoClient::new(channel(&at));
        // Small and compressible (in the ring), large and compressible
        // (shrinks into the ring), large and random (still lent).
        let payloads = [compressible(3000), compressible(4 << 20), pattern(1 << 20, 9)];
        for encoding in Encoding::ALL {
            let client = plain.clone().send_compressed(encoding);
            for payload in &payloads {
                let reply = call(&client, payload.clone(), Some(encoding.as_str())).unwrap();
                assert_eq!(reply.metadata().get("x-arrived"), Some(encoding.as_str()));
                assert_eq!(reply.message_encoding(), Some(encoding), "{encoding}");
                assert!(reply.into_inner().payload == payload[..], "{encoding}: damaged");
            }
        }
        // Nothing asked: nothing compressed either way.
        let reply = call(&plain, compressible(5000), None).unwrap();
        assert_eq!(reply.metadata().get("x-arrived"), Some("identity"));
        assert_eq!(reply.message_encoding(), None);
    }
}

on_every_fabric_and_face! {
    fn a_server_compresses_only_what_its_caller_accepts(url: &str) {
        let service = EchoServer::new(Reports).send_compressed(Encoding::Zstd);
        let (_server, at) = serve_for_clients(Server::builder().add_service(service), url);
        let all = EchoClient::new(channel(&at));
        let reply = call(&all, compressible(5000), None).unwrap();
        assert_eq!(reply.message_encoding(), Some(Encoding::Zstd), "the service's setting");
        let gzip_only = all.clone().accept_compressed(Encoding::Gzip);
        let reply = call(&gzip_only, compressible(5000), None).unwrap();
        assert_eq!(reply.message_encoding(), None, "zstd is not accepted");
        let reply = call(&gzip_only, compressible(5000), Some("gzip")).unwrap();
        assert_eq!(reply.message_encoding(), Some(Encoding::Gzip), "a handler's choice");
        let none = all.clone().accept_encodings(EncodingSet::none());
        let reply = call(&none, compressible(5000), Some("gzip")).unwrap();
        assert_eq!(reply.message_encoding(), None);
        assert!(reply.into_inner().payload == compressible(5000)[..]);
        // A handler may send one response as it is.
        let reply = call(&all, compressible(5000), Some("identity")).unwrap();
        assert_eq!(reply.message_encoding(), None);
    }
}

on_every_fabric_and_face! {
    fn an_encoding_the_server_does_not_accept_fails_unimplemented(url: &str) {
        let service = EchoServer::new(Reports).accept_compressed(Encoding::Gzip);
        let (_server, at) = serve_for_clients(Server::builder().add_service(service), url);
        let plain = EchoClient::new(channel(&at));
        let err = call(&plain.clone().send_compressed(Encoding::Zstd), compressible(100), None)
            .unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err}");
        assert!(err.message().contains("zstd") && err.message().contains("gzip"), "{err}");
        let reply = call(&plain.clone().send_compressed(Encoding::Gzip), compressible(100), None)
            .unwrap();
        assert_eq!(reply.metadata().get("x-arrived"), Some("gzip"));
        // The server's own setting, for a service without one.
        let (_server, at) = serve_for_clients(
            Server::builder()
                .accept_encodings(EncodingSet::none())
                .add_service(EchoServer::new(Reports)),
            &second_url(url),
        );
        let plain = EchoClient::new(channel(&at));
        let err = call(&plain.clone().send_compressed(Encoding::Deflate), vec![1; 10], None)
            .unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err}");
        call(&plain, vec![1; 10], None).unwrap();
    }
}

on_every_fabric_and_face! {
    fn a_message_that_inflates_past_the_limit_fails_resource_exhausted(url: &str) {
        // 4 MiB of zeros compress to a few KiB: the sender's check of the
        // compressed size passes, the receiver's limit stops the inflating.
        let (_server, at) = serve_for_clients(
            Server::builder()
                .max_message_size(1 << 20)
                .add_service(EchoServer::new(Reports)),
            url,
        );
        let plain = EchoClient::new(channel(&at));
        for encoding in Encoding::ALL {
            let err = call(&plain.clone().send_compressed(encoding), vec![0; 4 << 20], None)
                .unwrap_err();
            assert_eq!(err.code(), Code::ResourceExhausted, "{encoding}: {err}");
        }
        // Within the limit, the same passes; and the server still serves.
        let reply = call(&plain.clone().send_compressed(Encoding::Gzip), vec![0; 512 << 10], None)
            .unwrap();
        assert_eq!(reply.into_inner().payload.len(), 512 << 10);
        // A response that inflates past the client's limit fails too.
        let small = EchoClient::new(
            rpc_core::Channel::builder(&at)
                .max_message_size(64 << 10)
                .timeout(LIMIT)
                .connect()
                .unwrap(),
        );
        let err = call(&small.clone().send_compressed(Encoding::Zstd), vec![0; 512 << 10], Some("zstd"))
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    }
}

on_every_fabric_and_face! {
    fn a_stream_switches_compression_message_by_message(url: &str) {
        let builder = Server::builder().add_service(EchoServer::new(Reports));
        let (_server, at) = serve_for_clients(builder, url);
        let client = EchoClient::new(channel(&at));
        for size in [100usize, 40_000, 300_000] {
            let mut request = Request::new(StreamRequest { count: 6, size: size as u32 });
            request.metadata_mut().insert("x-send", "gzip").unwrap();
            let mut stream = client.stream(request);
            let mut seen = Vec::new();
            while let Some(reply) = stream.blocking_message().unwrap() {
                let i = seen.len() as u64;
                assert!(reply.payload == pattern(size, i)[..], "{size}: message {i} damaged");
                seen.push(stream.message_encoding());
            }
            let even = Some(Encoding::Gzip);
            assert_eq!(seen, [even, None, even, None, even, None], "{size}");
        }
    }
}

/// Another server's URL on the fabric of `url`.
fn second_url(url: &str) -> String {
    if url.contains("mem://") {
        format!("{url}-second")
    } else {
        url.to_owned()
    }
}
