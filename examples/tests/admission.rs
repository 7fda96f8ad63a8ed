//! Who may connect, and how many: authentication at the handshake and a
//! cap on connections (silent handshakes: `idle_handshakes.rs`).

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use rpc_core::{Channel, Code, SharedSecret, SharedSecrets};

const KEY: &str = "correct horse battery staple";

fn secret(name: &str, key: &str) -> SharedSecret {
    SharedSecret::new(name, key).unwrap()
}

/// A second URL like `url` for another server in the same test.
fn another(url: &str) -> String {
    if url.starts_with("mem://") {
        format!("{url}.other")
    } else {
        url.to_owned()
    }
}

/// Who the server says called, from the test service's `who` answer.
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

on_every_fabric! {
    fn only_clients_with_the_secret_connect(url: &str) {
        let probe = Probe::new();
        let server = serve(
            test_server(&probe).authenticator(
                SharedSecrets::new()
                    .with(secret("billing", KEY))
                    .with(secret("orders", "another key, just as long")),
            ),
            url,
        );
        let u = server.local_url();
        let scheme = u.split("://").next().unwrap();

        let e = expect_code(Channel::builder(u).connect(), Code::Unauthenticated);
        assert!(e.message().contains("requires a credential"), "{e}");
        let e = expect_code(
            Channel::builder(u).credential(secret("billing", "not the right key")).connect(),
            Code::Unauthenticated,
        );
        assert!(e.message().contains("wrong shared secret"), "{e}");
        let e = expect_code(
            Channel::builder(u).credential(secret("nobody", KEY)).connect(),
            Code::Unauthenticated,
        );
        assert!(e.message().contains("wrong shared secret"), "{e}");
        // No handler ran for any of them.
        assert!(probe.seen().entered.is_empty());

        // The right secret connects, and handlers see who it is.
        let channel = Channel::builder(u)
            .credential(secret("billing", KEY))
            .timeout(LIMIT)
            .connect()
            .unwrap_or_else(|e| panic!("the right secret was refused: {e}"));
        assert_eq!(who(channel), (scheme.to_owned(), Some("billing".to_owned())));
        let channel = Channel::builder(u)
            .credential(secret("orders", "another key, just as long"))
            .timeout(LIMIT)
            .connect()
            .unwrap();
        assert_eq!(who(channel).1.as_deref(), Some("orders"));

        // A server that asks for no credential: anyone connects and has no
        // identity, but a client that holds a secret will not trust it.
        let open = serve(test_server(&probe), &another(url));
        assert_eq!(who(common::channel(open.local_url())), (scheme.to_owned(), None));
        let e = expect_code(
            Channel::builder(open.local_url()).credential(secret("billing", KEY)).connect(),
            Code::Unauthenticated,
        );
        assert!(e.message().contains("did not authenticate itself"), "{e}");
    }
}

on_every_fabric! {
    fn a_server_at_its_connection_limit_refuses_clearly(url: &str) {
        let probe = Probe::new();
        let server = serve(test_server(&probe).max_connections(2), url);
        let u = server.local_url();
        let first = channel(u);
        let _second = channel(u);
        let e = expect_code(Channel::connect(u), Code::ResourceExhausted);
        assert!(e.message().contains("limit of 2 connections"), "{e}");
        // Room again once a client leaves.
        drop(first);
        let third = connect_when_there_is_room(u);
        assert_eq!(who(third).1, None);
    }
}
