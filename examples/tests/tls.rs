//! TLS on tcp:// and on the handshake of rdma://: round trips, clear and
//! fast failures when the two sides do not agree, mutual TLS and the
//! identity handlers see, and heavy traffic through TLS. Certificates are
//! made when the tests run (`common::certs`).

#[macro_use]
mod common;

use common::certs::{Ca, host_of};
use common::*;
use examples::echo::StreamRequest;
use examples::echo::echo_client::EchoClient;
use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use rpc_core::{Channel, Code, ServerHandle, SharedSecret, Status};
use std::time::{Duration, Instant};

/// How long a connect that must fail may take: well under the 5 s
/// handshake timeout, so a failure is an answer, not a timeout.
const FAST: Duration = Duration::from_secs(2);

/// A test server on `url` with TLS from `config`.
fn tls_server(config: ServerTlsConfig, url: &str) -> ServerHandle {
    let probe = Probe::new();
    serve(
        test_server(&probe)
            .tls_config(config)
            .expect("a usable server TLS config"),
        url,
    )
}

/// Connects to `url` with `config`, timing it.
fn connect(url: &str, config: Option<ClientTlsConfig>) -> (Result<Channel, Status>, Duration) {
    let mut builder = Channel::builder(url).timeout(LIMIT);
    if let Some(config) = config {
        builder = builder
            .tls_config(config)
            .expect("a usable client TLS config");
    }
    let started = Instant::now();
    let result = builder.connect();
    (result, started.elapsed())
}

/// Connects, expecting a failure with `code` and `words` in its message,
/// within [`FAST`].
#[track_caller]
fn refused(url: &str, config: Option<ClientTlsConfig>, code: Code, words: &str) -> Status {
    let (result, took) = connect(url, config);
    let status = expect_code(result, code);
    assert!(
        status.message().contains(words),
        "expected {words:?} in: {status}"
    );
    assert!(took < FAST, "the failure took {took:?}: {status}");
    eprintln!("refused in {took:?}: {status}");
    status
}

/// Who the server says called: (fabric, identity).
fn who(channel: Channel) -> (String, Option<String>) {
    let reply = EchoClient::new(channel)
        .echo(echo_request("who", Vec::new(), &[("who", "1")]))
        .wait()
        .expect("a call on an admitted connection");
    let md = reply.metadata();
    (
        md.get("peer-fabric").expect("peer-fabric").to_owned(),
        md.get("peer-identity").map(str::to_owned),
    )
}

/// One unary echo and one server stream, checked.
fn round_trip(channel: &Channel) {
    let client = EchoClient::new(channel.clone());
    let payload = pattern(3000, 11);
    let reply = client
        .echo(echo_request("tls", payload.clone(), &[("k", "v")]))
        .wait()
        .expect("echo over TLS");
    assert_eq!(reply.metadata().get("k"), Some("v"));
    assert_eq!(reply.into_inner().payload, payload);
    let mut n = 0u64;
    for reply in client.stream(StreamRequest {
        count: 500,
        size: 200,
    }) {
        let payload = reply.expect("a streamed reply").payload;
        assert_eq!(payload.len(), 200);
        assert_eq!(u64::from_le_bytes(payload[..8].try_into().unwrap()), n);
        n += 1;
    }
    assert_eq!(n, 500);
}

on_network_fabrics! {
    fn tls_round_trip(url: &str) {
        let ca = Ca::new("test CA");
        let server = tls_server(ca.server_config(url), url);
        let u = server.local_url();
        let (channel, _) = connect(u, Some(ca.client_config()));
        let channel = channel.expect("a TLS connect");
        round_trip(&channel);
        // Without a client certificate there is no identity.
        let (fabric, identity) = who(channel.clone());
        assert_eq!(fabric, u.split("://").next().unwrap());
        assert_eq!(identity, None);
        // The name checked can be set apart from the URL's host.
        let (named, _) = connect(u, Some(ca.client_config().domain_name("server.test")));
        round_trip(&named.expect("a TLS connect under another name"));
        drop(server);
    }
}

on_network_fabrics! {
    fn tls_mismatches_fail_fast_and_the_server_serves_on(url: &str) {
        let ca = Ca::new("test CA");
        let server = tls_server(ca.server_config(url), url);
        let u = server.local_url();
        // A plaintext client at a TLS server is told so.
        let s = refused(u, None, Code::Unavailable, "requires TLS");
        assert!(s.message().contains("tls_config"), "{s}");
        // A certificate from a CA the client does not trust.
        let stranger = Ca::new("another CA");
        refused(u, Some(stranger.client_config()), Code::Unavailable, "not trusted");
        // A name the certificate does not carry.
        refused(
            u,
            Some(ca.client_config().domain_name("elsewhere.test")),
            Code::Unavailable,
            "not valid for that name",
        );
        // The server went on serving through all of it.
        let (channel, _) = connect(u, Some(ca.client_config()));
        round_trip(&channel.expect("a TLS connect after the failures"));

        // A TLS client at a plaintext server is told so too.
        let probe = Probe::new();
        let plain = serve(test_server(&probe), url);
        let p = plain.local_url();
        refused(p, Some(ca.client_config()), Code::Unavailable, "does not use TLS");
        round_trip(&channel_to(p));
    }
}

/// A plaintext channel to `url`.
fn channel_to(url: &str) -> Channel {
    channel(url)
}

on_network_fabrics! {
    fn mutual_tls_shows_the_client_identity(url: &str) {
        let server_ca = Ca::new("server CA");
        let client_ca = Ca::new("client CA");
        let server = tls_server(
            server_ca
                .server_config(url)
                .client_ca_root(client_ca.certificate()),
            url,
        );
        let u = server.local_url();
        let scheme = u.split("://").next().unwrap().to_owned();
        let with = |identity: Identity| {
            let config = server_ca.client_config().identity(identity);
            connect(u, Some(config)).0.expect("a mutual TLS connect")
        };
        // The first DNS name of the client's certificate...
        let channel = with(client_ca.identity(&["billing.svc.test", "other.test"], "cn"));
        round_trip(&channel);
        assert_eq!(who(channel), (scheme.clone(), Some("billing.svc.test".into())));
        // ...else its URI...
        let (cert, key) = client_ca.leaf_with_uri("spiffe://example.test/orders");
        let channel = with(Identity::from_pem(cert, key));
        assert_eq!(who(channel).1.as_deref(), Some("spiffe://example.test/orders"));
        // ...else its common name.
        let channel = with(client_ca.identity(&[], "reporting"));
        assert_eq!(who(channel).1.as_deref(), Some("reporting"));
        // No certificate, or one from another CA: refused, clearly.
        refused(
            u,
            Some(server_ca.client_config()),
            Code::Unauthenticated,
            "requires a client certificate",
        );
        let stranger = Ca::new("another client CA");
        refused(
            u,
            Some(server_ca.client_config().identity(stranger.identity(&["x.test"], "x"))),
            Code::Unauthenticated,
            "rejected this channel's client certificate",
        );
    }
}

fabric_tests! {
    [tcp]
    fn tls_carries_many_concurrent_calls_and_a_large_message(url: &str) {
        let ca = Ca::new("test CA");
        let probe = Probe::new();
        let server = serve(
            test_server_with(&probe, true)
                .ring_size(4 << 20)
                .tls_config(ca.server_config(url))
                .unwrap(),
            url,
        );
        let u = server.local_url().to_owned();
        let channel = Channel::builder(&u)
            .timeout(LIMIT)
            .ring_size(4 << 20)
            .tls_config(ca.client_config())
            .unwrap()
            .connect()
            .expect("a TLS connect");
        let client = EchoClient::new(channel.clone());
        // 1 MiB each way, intact.
        let big = pattern(1 << 20, 3);
        let reply = client
            .echo(echo_request("big", big.clone(), &[]))
            .wait()
            .expect("a 1 MiB echo over TLS");
        assert!(reply.into_inner().payload == big, "the 1 MiB echo came back changed");
        // Many calls in flight at once, from several threads, each checked.
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let client = client.clone();
                std::thread::spawn(move || {
                    for round in 0..10u64 {
                        let calls: Vec<_> = (0..64u64)
                            .map(|i| {
                                let len = ((i * 997 + round * 31 + t) % 20_000) as usize;
                                let payload = pattern(len, t * 10_000 + round * 100 + i);
                                let call = client.echo(echo_request("many", payload.clone(), &[]));
                                (call, payload)
                            })
                            .collect();
                        for (call, payload) in calls {
                            let reply = call.wait().expect("a concurrent call over TLS");
                            assert!(reply.into_inner().payload == payload, "a reply came back changed");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a caller thread");
        }
        // And big ones concurrently, crossing each other in both directions.
        let calls: Vec<_> = (0..6u64)
            .map(|i| {
                let payload = pattern(300_000 + i as usize * 1000, 50 + i);
                (client.echo(echo_request("big", payload.clone(), &[])), payload)
            })
            .collect();
        for (call, payload) in calls {
            assert!(call.wait().expect("a big call").into_inner().payload == payload);
        }
    }
}

fabric_tests! {
    [tcp]
    fn tls_and_a_shared_secret_together(url: &str) {
        let ca = Ca::new("test CA");
        let client_ca = Ca::new("client CA");
        let secret = SharedSecret::new("billing", "correct horse battery staple").unwrap();
        let probe = Probe::new();
        let server = serve(
            test_server(&probe)
                .authenticator(secret.clone())
                .tls_config(ca.server_config(url).client_ca_root(client_ca.certificate()))
                .unwrap(),
            url,
        );
        let config = ca
            .client_config()
            .identity(client_ca.identity(&["cert-name.test"], "cn"));
        let channel = Channel::builder(server.local_url())
            .timeout(LIMIT)
            .credential(secret)
            .tls_config(config.clone())
            .unwrap()
            .connect()
            .expect("TLS and a credential");
        // The authenticator's name wins over the certificate's.
        assert_eq!(who(channel).1.as_deref(), Some("billing"));
        // TLS alone does not get past the authenticator.
        refused(server.local_url(), Some(config), Code::Unauthenticated, "requires a credential");
    }
}

#[test]
fn bad_pem_files_are_named_and_bad_configs_refused() {
    let dir = std::env::temp_dir().join(format!("rpc-tls-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.pem");
    let e = Identity::from_pem_files(&missing, &missing).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("missing.pem"), "{e}");
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let e = Certificate::from_pem_file(&garbage).unwrap_err();
    assert!(e.message().contains("garbage.pem"), "{e}");
    assert!(e.message().contains("no certificate"), "{e}");
    // A certificate file where the key should be.
    let ca = Ca::new("test CA");
    let (cert, _key) = ca.leaf(&["localhost"], "x");
    let cert_file = dir.join("cert.pem");
    std::fs::write(&cert_file, &cert).unwrap();
    let e = Identity::from_pem_files(&cert_file, &cert_file).unwrap_err();
    assert!(e.message().contains("cert.pem"), "{e}");
    assert!(e.message().contains("private key"), "{e}");
    // A key that is not the certificate's.
    let (_, other_key) = ca.leaf(&["localhost"], "y");
    let key_file = dir.join("other.key");
    std::fs::write(&key_file, &other_key).unwrap();
    let identity = Identity::from_pem_files(&cert_file, &key_file).unwrap();
    let e = rpc_core::Server::builder()
        .tls_config(ServerTlsConfig::new().identity(identity))
        .unwrap_err();
    assert!(e.message().contains("other.key"), "{e}");
    // Settings missing their essential part.
    let e = rpc_core::Server::builder()
        .tls_config(ServerTlsConfig::new())
        .unwrap_err();
    assert!(e.message().contains("identity"), "{e}");
    let e = Channel::builder("tcp://127.0.0.1:1")
        .tls_config(ClientTlsConfig::new())
        .unwrap_err();
    assert!(e.message().contains("ca_certificate"), "{e}");
    let e = Channel::builder("tcp://127.0.0.1:1")
        .tls_config(ca.client_config().domain_name("not a name!"))
        .unwrap_err();
    assert!(e.message().contains("not a valid TLS server name"), "{e}");
    // The PEM text of a certificate and key read from files works.
    let (cert, key) = ca.leaf(&["localhost"], "z");
    std::fs::write(&cert_file, &cert).unwrap();
    std::fs::write(&key_file, &key).unwrap();
    let identity = Identity::from_pem_files(&cert_file, &key_file).unwrap();
    assert!(
        rpc_core::Server::builder()
            .tls_config(ServerTlsConfig::new().identity(identity))
            .is_ok()
    );
    assert_eq!(host_of("tcp://127.0.0.1:5"), "127.0.0.1");
    let _ = std::fs::remove_dir_all(&dir);
}

on_network_fabrics! {
    fn tls_handshakes_that_stall_or_send_garbage_are_dropped(url: &str) {
        use std::io::{Read, Write};
        let ca = Ca::new("test CA");
        let probe = Probe::new();
        let server = serve(
            test_server(&probe)
                .handshake_timeout(Duration::from_millis(300))
                .tls_config(ca.server_config(url))
                .unwrap(),
            url,
        );
        let u = server.local_url().to_owned();
        let addr = rpc_core::fabric::FabricUrl::parse(&u).unwrap().socket_addr();
        let open = |first: &[u8]| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            s.set_read_timeout(Some(LIMIT)).unwrap();
            s.write_all(first).unwrap();
            s
        };
        // The start of a ClientHello, then nothing: gone at the timeout.
        let mut stalled = open(&[0x16, 0x03, 0x01, 0x00, 0xf0, 0x01]);
        // A TLS record header, then garbage: dropped at once.
        let mut garbage = open(&[0x16, 0x03, 0x01, 0x00, 0x05, 0xff, 0xff, 0xff, 0xff, 0xff]);
        let started = Instant::now();
        let mut rest = Vec::new();
        let _ = garbage.read_to_end(&mut rest);
        assert!(started.elapsed() < Duration::from_millis(250), "garbage lingered");
        let _ = stalled.read_to_end(&mut rest);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < FAST,
            "the stalled handshake ended after {took:?}"
        );
        // Real clients were never kept out.
        let (channel, _) = connect(&u, Some(ca.client_config()));
        round_trip(&channel.expect("a TLS connect"));
    }
}
