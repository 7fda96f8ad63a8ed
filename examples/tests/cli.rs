//! The `rpc` command line tool (`rpc_cli::run`, what the binary runs)
//! against `kv-server` and `route-guide-server` processes, which add the
//! reflection service, and against servers without it.

#[macro_use]
mod common;

use common::procs::ServerProc;
use common::*;
use examples::kv::kv_server::KvServer;
use examples::services::KvStore;
use rpc_core::interceptor::CallInfo;
use rpc_core::{Server, Status};
use serde_json::{Value, json};

/// What one `rpc` run did.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The JSON values it printed, in order.
    fn json(&self) -> Vec<Value> {
        serde_json::Deserializer::from_str(&self.stdout)
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }

    /// Asserts it succeeded, and returns it.
    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "rpc failed: {self:?}");
        self
    }
}

/// Runs `rpc args...` with `stdin`, bounded.
fn rpc(args: &[&str], stdin: &str) -> Run {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let stdin = stdin.to_owned();
    bounded("rpc", move || {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = rpc_cli::run(&args, &mut stdin.as_bytes(), &mut out, &mut err);
        Run {
            code,
            stdout: String::from_utf8(out).unwrap(),
            stderr: String::from_utf8(err).unwrap(),
        }
    })
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

on_network_fabrics! {
    fn rpc_lists_describes_and_calls_kv_server(url: &str) {
        let server = ServerProc::kv(url);
        let url = server.url.as_str();

        let list = rpc(&["list", url], "").ok();
        assert_eq!(
            lines(&list.stdout),
            ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "kv.Kv"]
        );
        let methods = rpc(&["list", url, "kv.Kv"], "").ok();
        assert_eq!(lines(&methods.stdout), ["kv.Kv.Put", "kv.Kv.Get", "kv.Kv.Delete", "kv.Kv.Scan"]);

        // Described from the descriptors embedded at build time, comments
        // included.
        let service = rpc(&["describe", url, "kv.Kv"], "").ok().stdout;
        assert!(service.starts_with("kv.Kv is a service:\n// Stores byte values under string keys.\nservice Kv {\n"), "{service}");
        assert!(service.contains("  rpc Put(kv.PutRequest) returns (kv.PutReply);\n"), "{service}");
        let message = rpc(&["describe", url, "kv.PutRequest"], "").ok().stdout;
        assert!(message.contains("message PutRequest {\n"), "{message}");
        assert!(message.contains("  string key = 1;\n") && message.contains("  bytes value = 2;\n"), "{message}");
        let method = rpc(&["describe", url, "kv.Kv/Get"], "").ok().stdout;
        assert!(method.contains("rpc Get(kv.GetRequest) returns (kv.GetReply);"), "{method}");

        // Calls: JSON in, JSON out ("b25l" is base64 for "one").
        let put = rpc(&["call", url, "kv.Kv/Put", r#"{"key": "alpha", "value": "b25l"}"#], "").ok();
        assert_eq!(put.json(), [json!({})]);
        let put = rpc(&["call", url, "kv.Kv.Put", "-"], r#"{"key": "beta", "value": "dHdv"}"#).ok();
        assert_eq!(put.json(), [json!({})]);
        let get = rpc(&["call", url, "kv.Kv/Get", r#"{"key": "alpha"}"#], "").ok();
        assert_eq!(get.json(), [json!({"value": "b25l"})]);
        let scan = rpc(&["call", "--compact", url, "kv.Kv/Scan", "{}"], "").ok();
        assert_eq!(scan.stdout.lines().count(), 1);
        assert_eq!(
            scan.json(),
            [json!({"entries": [{"key": "alpha", "value": "b25l"}, {"key": "beta", "value": "dHdv"}]})]
        );
        let health = rpc(&["call", url, "grpc.health.v1.Health/Check", r#"{"service": "kv.Kv"}"#], "").ok();
        assert_eq!(health.json(), [json!({"status": "SERVING"})]);

        // A failed call exits 64 + its code and names it.
        let unknown = rpc(&["call", url, "grpc.health.v1.Health/Check", r#"{"service": "no.Such"}"#], "");
        assert_eq!(unknown.code, 64 + 5, "{unknown:?}");
        assert!(unknown.stderr.contains("NotFound"), "{unknown:?}");

        // Bad input is refused before anything is sent.
        for (args, why) in [
            (vec!["call", url, "kv.Kv/Put", r#"{"key": "gamma", "valu": "eA=="}"#], "valu"),
            (vec!["call", url, "kv.Kv/Put", r#"{"key": "gamma"} {"key": "delta"}"#], "takes one request"),
            (vec!["call", url, "kv.Kv/Put", r#"{"key": "gamma""#], "not JSON"),
            (vec!["call", url, "kv.Kv/Nope", "{}"], "no method"),
            (vec!["describe", url, "kv.Nope"], "kv.Nope"),
        ] {
            let run = rpc(&args, "");
            assert_ne!(run.code, 0, "{args:?}");
            assert!(run.stderr.contains(why), "{args:?}: {run:?}");
        }
        let scan = rpc(&["call", url, "kv.Kv/Scan", r#"{"prefix": "gamma"}"#], "").ok();
        assert_eq!(scan.json(), [json!({})], "a refused put stored something");
    }
}

on_network_fabrics! {
    fn rpc_streams_both_ways_with_route_guide_server(url: &str) {
        let server = ServerProc::route_guide(url);
        let url = server.url.as_str();

        // Server streaming: one JSON value per message.
        let rect = r#"{"lo": {"latitude": 400000000, "longitude": -750000000},
                       "hi": {"latitude": 420000000, "longitude": -730000000}}"#;
        let features = rpc(&["call", "--compact", url, "routeguide.RouteGuide/ListFeatures", rect], "").ok();
        let features = features.json();
        assert!(features.len() > 10, "{features:?}");
        assert_eq!(features.len(), features.iter().filter(|f| f["name"].is_string()).count());

        // Client streaming from standard input.
        let points = r#"{"latitude": 407838351, "longitude": -746143763}
                        {"latitude": 408122808, "longitude": -743999179}"#;
        let summary = rpc(&["call", url, "routeguide.RouteGuide/RecordRoute", "-"], points).ok();
        let summary = summary.json();
        assert_eq!(summary.len(), 1);
        assert_eq!(summary[0]["pointCount"], json!(2));

        // Bidirectional: each note brings back the earlier notes at its place.
        let notes = r#"{"location": {"latitude": 1, "longitude": 2}, "message": "first"}
                       {"location": {"latitude": 1, "longitude": 2}, "message": "second"}
                       {"location": {"latitude": 1, "longitude": 2}, "message": "third"}"#;
        let chat = rpc(&["call", url, "routeguide.RouteGuide/RouteChat", notes], "").ok();
        let messages: Vec<_> = chat.json().iter().map(|n| n["message"].clone()).collect();
        assert_eq!(messages, [json!("first"), json!("first"), json!("second")]);
    }
}

const TOKEN: &str = "Bearer 41c3";

fn require_token(call: &mut CallInfo<'_>) -> Result<(), Status> {
    match call.metadata().get("authorization") {
        Some(TOKEN) => Ok(()),
        _ => Err(Status::unauthenticated("no valid token")),
    }
}

on_soft_fabrics! {
    fn rpc_without_reflection_takes_types_from_proto_files(url: &str) {
        let server = serve(
            Server::builder()
                .add_service(KvServer::new(KvStore::new()))
                .interceptor(require_token),
            url,
        );
        let url = server.local_url().to_owned();
        let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/kv.proto");

        // No reflection service: rpc says what to do instead.
        let list = rpc(&["list", &url], "");
        assert_eq!(list.code, 1, "{list:?}");
        assert!(list.stderr.contains("--proto"), "{list:?}");

        let list = rpc(&["--proto", proto, "list", &url], "").ok();
        assert_eq!(lines(&list.stdout), ["kv.Kv"]);

        // The interceptor wants a token: -H sends it.
        let put = ["--proto", proto, "call", &url, "kv.Kv/Put", r#"{"key": "k", "value": "dg=="}"#];
        let denied = rpc(&put, "");
        assert_eq!(denied.code, 64 + 16, "{denied:?}");
        assert!(denied.stderr.contains("no valid token"), "{denied:?}");
        let mut with_token = vec!["-H", "authorization: Bearer 41c3"];
        with_token.extend(put);
        rpc(&with_token, "").ok();
        let get = rpc(
            &["-H", "authorization: Bearer 41c3", "--proto", proto, "call", &url, "kv.Kv/Get", r#"{"key": "k"}"#],
            "",
        )
        .ok();
        assert_eq!(get.json(), [json!({"value": "dg=="})]);
    }
}
