//! Checks on the code `build.rs` generated from `../proto`, at the type and
//! data level only: nothing here calls into the runtime (connecting, sending,
//! serving).

use examples::acme::common::{self, Ack, Page, Priority};
use examples::acme::storage::v1::{
    self, GetObjectRequest, Object, Token, keywords_client::KeywordsClient,
    keywords_server::KeywordsServer, object, object::chunk, object_store_client::ObjectStoreClient,
};
use examples::echo;
use examples::kv::{self, kv_client::KvClient, kv_server::KvServer};
use rpc_core::codegen::{MethodDescriptor, ServiceDescriptor, UnaryCall, method_id};
// What hand-written code uses: prost and the well-known types as rpc-core
// re-exports them, at the generated code's version.
use rpc_core::prost::Message;
use rpc_core::prost_types;
use rpc_core::{Code, Request, Response, Service, Status};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

fn all_descriptors() -> [&'static ServiceDescriptor; 10] {
    [
        &echo::echo_server::DESCRIPTOR,
        &kv::kv_server::DESCRIPTOR,
        &common::admin_server::DESCRIPTOR,
        &common::health_server::DESCRIPTOR,
        &v1::object_store_server::DESCRIPTOR,
        &v1::keywords_server::DESCRIPTOR,
        &v1::sync_server::DESCRIPTOR,
        &v1::self_server::DESCRIPTOR,
        &v1::t_server::DESCRIPTOR,
        &examples::acme::options::blobs_server::DESCRIPTOR,
    ]
}

fn method_names(descriptor: &ServiceDescriptor) -> Vec<&'static str> {
    descriptor.methods.iter().map(|m| m.name).collect()
}

#[test]
fn descriptors_name_services_and_rpcs_in_proto_order() {
    let expected: [(&str, &[&str]); 9] = [
        ("echo.Echo", &["Echo", "Stream"]),
        ("kv.Kv", &["Put", "Get", "Delete", "Scan"]),
        ("acme.common.Admin", &[]),
        ("acme.common.Health", &["Check"]),
        (
            "acme.storage.v1.ObjectStore",
            &["Put", "Get", "Ping", "Stat", "Undocumented"],
        ),
        (
            "acme.storage.v1.Keywords",
            &[
                "Type",
                "Match",
                "Async",
                "Self",
                "Connect",
                "New",
                "Clone",
                "FromBytes",
                "IntoParts",
                "ToTokenMut",
                "Cmp",
            ],
        ),
        ("acme.storage.v1.Sync", &["Pull"]),
        ("acme.storage.v1.Self", &["Call"]),
        ("acme.storage.v1.T", &["Get"]),
    ];
    for (descriptor, (name, methods)) in all_descriptors().into_iter().zip(expected) {
        assert_eq!(descriptor.name, name);
        assert_eq!(method_names(descriptor), methods, "{name}");
    }
}

#[test]
fn method_paths_and_ids_are_derived_from_names() {
    let mut ids = HashMap::new();
    for descriptor in all_descriptors() {
        for MethodDescriptor { name, path, id, .. } in descriptor.methods {
            assert_eq!(*path, format!("/{}/{name}", descriptor.name));
            assert_eq!(*id, method_id(path), "{path}");
            assert_ne!(*id, 0, "{path}");
            if let Some(other) = ids.insert(*id, *path) {
                panic!("{path} and {other} share id {id:#x}");
            }
        }
    }
    assert_eq!(kv::kv_server::DESCRIPTOR.methods[0].path, "/kv.Kv/Put");
    assert_eq!(
        v1::keywords_server::DESCRIPTOR.methods[3].path,
        "/acme.storage.v1.Keywords/Self"
    );
}

fn full_object() -> Object {
    Object {
        name: "reports/2024.csv".into(),
        kind: object::Kind::File.into(),
        chunks: vec![
            object::Chunk {
                offset: 0,
                data: rpc_core::Bytes::from_static(b"a,b\n"),
                checksum: Some(chunk::Checksum {
                    algorithm: "crc32c".into(),
                    digest: vec![1, 2, 3, 4].into(),
                }),
            },
            object::Chunk {
                offset: 4,
                data: rpc_core::Bytes::from_static(b"1,2\n"),
                checksum: None,
            },
        ],
        labels: HashMap::from([
            ("team".to_owned(), "storage".to_owned()),
            ("tier".to_owned(), "cold".to_owned()),
        ]),
        pages: HashMap::from([(
            7,
            Page {
                size: 100,
                token: "t7".into(),
            },
        )]),
        priority: Priority::High.into(),
        created_at: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 5,
        }),
        ttl: Some(prost_types::Duration {
            seconds: 3600,
            nanos: 0,
        }),
        extra: Some(prost_types::Any {
            type_url: "type.googleapis.com/acme.common.Ack".into(),
            value: Ack {
                ok: true,
                reason: String::new(),
            }
            .encode_to_vec(),
        }),
        attributes: Some(prost_types::Struct {
            fields: BTreeMap::from([
                (
                    "size".to_owned(),
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::NumberValue(8.0)),
                    },
                ),
                (
                    "owner".to_owned(),
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::StringValue("ana".into())),
                    },
                ),
            ]),
        }),
        location: Some(object::Location::Inline(object::Chunk {
            offset: 0,
            data: rpc_core::Bytes::from_static(b"inline"),
            checksum: None,
        })),
        r#type: "text/csv".into(),
        r#match: true,
        r#ref: "v2".into(),
        r#async: true,
        self_: "me".into(),
    }
}

#[test]
fn messages_round_trip() {
    let object = full_object();
    let bytes = object.encode_to_vec();
    assert_eq!(bytes.len(), object.encoded_len());
    let decoded = Object::decode(bytes.as_slice()).unwrap();
    assert_eq!(decoded, object);

    // The packed `Any` unpacks to the message it holds.
    let extra = decoded.extra.unwrap();
    assert!(Ack::decode(extra.value.as_slice()).unwrap().ok);

    // Each oneof variant survives on its own.
    for location in [
        object::Location::Path("/srv/data".into()),
        object::Location::Inode(42),
    ] {
        let object = Object {
            location: Some(location.clone()),
            ..Object::default()
        };
        let decoded = Object::decode(object.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.location, Some(location));
    }

    // A default message encodes to nothing.
    assert!(Object::default().encode_to_vec().is_empty());
}

#[test]
fn enums_convert_from_wire_values_and_names() {
    assert_eq!(object::Kind::try_from(2), Ok(object::Kind::Directory));
    assert!(object::Kind::try_from(99).is_err());
    assert_eq!(object::Kind::Directory.as_str_name(), "KIND_DIRECTORY");
    assert_eq!(Priority::from_str_name("PRIORITY_LOW"), Some(Priority::Low));

    let object = Object {
        kind: object::Kind::Directory.into(),
        priority: Priority::High.into(),
        ..Object::default()
    };
    let decoded = Object::decode(object.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.kind(), object::Kind::Directory);
    assert_eq!(decoded.priority(), Priority::High);
}

/// The client methods have the expected types. The closures are coerced to
/// function pointers and never called, so the runtime is not touched.
#[test]
fn client_methods_have_typed_signatures() {
    let _: fn(&str) -> Result<KvClient, Status> = KvClient::connect;
    let _: fn(rpc_core::Channel) -> KvClient = KvClient::new;
    let _: fn(&KvClient) -> &rpc_core::Channel = KvClient::channel;
    let _: fn(&KvClient, kv::PutRequest) -> UnaryCall<kv::PutReply> = |c, r| c.put(r);
    let _: fn(&KvClient, Request<kv::ScanRequest>) -> UnaryCall<kv::ScanReply> = |c, r| c.scan(r);

    let _: fn(&ObjectStoreClient, Object) -> UnaryCall<Ack> = |c, r| c.put(r);
    let _: fn(&ObjectStoreClient, GetObjectRequest) -> UnaryCall<Object> = |c, r| c.get(r);
    let _: fn(&ObjectStoreClient, ()) -> UnaryCall<()> = |c, r| c.ping(r);
    let _: fn(&ObjectStoreClient, object::Chunk) -> UnaryCall<prost_types::Timestamp> =
        |c, r| c.stat(r);
    let _: fn(&ObjectStoreClient, Page) -> UnaryCall<Ack> = |c, r| c.undocumented(r);

    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.r#type(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.r#match(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.r#async(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.self_(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Ack> = |c, r| c.connect_(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Ack> = |c, r| c.new_(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.clone(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.from_bytes(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.into_parts(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.to_token_mut(r);
    let _: fn(&KeywordsClient, Token) -> UnaryCall<Token> = |c, r| c.cmp(r);
    let _: fn(&KeywordsClient) -> KeywordsClient = Clone::clone;
    let _: fn(&v1::self_client::SelfClient, Token) -> UnaryCall<Token> = |c, r| c.call(r);
}

/// A `kv.Kv` implementation, called directly through the trait.
#[derive(Default)]
struct MemoryKv {
    entries: Mutex<BTreeMap<String, rpc_core::Bytes>>,
}

impl kv::kv_server::Kv for MemoryKv {
    async fn put(
        &self,
        request: Request<kv::PutRequest>,
    ) -> Result<Response<kv::PutReply>, Status> {
        let kv::PutRequest { key, value } = request.into_inner();
        let replaced = self.entries.lock().unwrap().insert(key, value).is_some();
        Ok(Response::new(kv::PutReply { replaced }))
    }

    async fn get(
        &self,
        request: Request<kv::GetRequest>,
    ) -> Result<Response<kv::GetReply>, Status> {
        let value = self
            .entries
            .lock()
            .unwrap()
            .get(&request.get_ref().key)
            .cloned();
        Ok(Response::new(kv::GetReply { value }))
    }

    async fn delete(
        &self,
        request: Request<kv::DeleteRequest>,
    ) -> Result<Response<kv::DeleteReply>, Status> {
        let existed = self
            .entries
            .lock()
            .unwrap()
            .remove(&request.get_ref().key)
            .is_some();
        Ok(Response::new(kv::DeleteReply { existed }))
    }

    async fn scan(&self, _: Request<kv::ScanRequest>) -> Result<Response<kv::ScanReply>, Status> {
        Err(Status::new(Code::Unimplemented, "scan"))
    }
}

#[test]
fn server_trait_is_implementable_and_wrappable() {
    use kv::kv_server::Kv;

    let store = MemoryKv::default();
    let put = |key: &str| {
        futures::executor::block_on(store.put(Request::new(kv::PutRequest {
            key: key.into(),
            value: rpc_core::Bytes::from_static(b"v"),
        })))
        .unwrap()
        .into_inner()
        .replaced
    };
    assert!(!put("a"));
    assert!(put("a"));
    let reply =
        futures::executor::block_on(store.get(Request::new(kv::GetRequest { key: "a".into() })))
            .unwrap();
    assert_eq!(reply.into_inner().value.as_deref(), Some(&b"v"[..]));

    let server = KvServer::new(store);
    assert_eq!(server.get_ref().entries.lock().unwrap().len(), 1);
    let shared = Arc::new(MemoryKv::default());
    let from_arc = KvServer::from_arc(Arc::clone(&shared));
    assert!(std::ptr::eq(from_arc.get_ref(), &*shared));
    let clone = from_arc.clone();
    assert!(std::ptr::eq(clone.get_ref(), from_arc.get_ref()));
    assert_eq!(
        format!("{server:?}"),
        r#"KvServer { service: "kv.Kv", .. }"#
    );

    let service: &dyn Service = &server;
    assert!(std::ptr::eq(
        service.descriptor(),
        &kv::kv_server::DESCRIPTOR
    ));
}

/// Implements the trait whose methods are named with Rust keywords.
struct Echoes;

fn echo_token(request: Request<Token>) -> Result<Response<Token>, Status> {
    Ok(Response::new(request.into_inner()))
}

impl v1::keywords_server::Keywords for Echoes {
    async fn r#type(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn r#match(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn r#async(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn self_(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn connect(&self, _: Request<Token>) -> Result<Response<Ack>, Status> {
        Ok(Response::new(Ack {
            ok: true,
            reason: String::new(),
        }))
    }
    async fn new(&self, _: Request<Token>) -> Result<Response<Ack>, Status> {
        Ok(Response::new(Ack::default()))
    }
    async fn clone(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn from_bytes(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn into_parts(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn to_token_mut(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
    async fn cmp(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
}

/// Implements the trait of the service named `Self`.
struct Myself;

impl v1::self_server::Self_ for Myself {
    async fn call(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
}

/// Implements the trait named like `std::marker::Sync`.
struct Puller;

impl v1::sync_server::Sync for Puller {
    async fn pull(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
}

/// Implements the trait named `T`, like the generated server's type parameter.
struct Tee;

impl v1::t_server::T for Tee {
    async fn get(&self, request: Request<Token>) -> Result<Response<Token>, Status> {
        echo_token(request)
    }
}

/// Implements the service without rpcs.
struct Nothing;

impl common::admin_server::Admin for Nothing {}

#[test]
fn keyword_named_services_are_implementable_and_served_as_dyn_service() {
    use v1::keywords_server::Keywords;

    let token = || Token { text: "t".into() };
    assert_eq!(
        futures::executor::block_on(Echoes.r#type(Request::new(token())))
            .unwrap()
            .into_inner(),
        token()
    );
    assert_eq!(
        futures::executor::block_on(Echoes.self_(Request::new(token())))
            .unwrap()
            .into_inner(),
        token()
    );
    assert!(
        futures::executor::block_on(Keywords::connect(&Echoes, Request::new(token())))
            .unwrap()
            .get_ref()
            .ok
    );

    let services: Vec<Box<dyn Service>> = vec![
        Box::new(KeywordsServer::new(Echoes)),
        Box::new(v1::sync_server::SyncServer::new(Puller)),
        Box::new(common::admin_server::AdminServer::new(Nothing)),
        Box::new(v1::self_server::SelfServer::new(Myself)),
        Box::new(v1::t_server::TServer::new(Tee)),
    ];
    let names: Vec<&str> = services.iter().map(|s| s.descriptor().name).collect();
    assert_eq!(
        names,
        [
            "acme.storage.v1.Keywords",
            "acme.storage.v1.Sync",
            "acme.common.Admin",
            "acme.storage.v1.Self",
            "acme.storage.v1.T",
        ]
    );
}

/// `build.rs` compiles `proto/options` with the prost options real projects
/// use; each one shows in the generated types.
#[test]
fn prost_options_reach_the_generated_code() {
    use examples::acme::options::{self, Blob, Key, blobs_client::BlobsClient};
    use rpc_core::codegen::prost::bytes::Bytes;

    let key = |bucket: &str, number| Key {
        bucket: bucket.to_owned(),
        number,
    };
    // `bytes`: a `Bytes` field; `btree_map`: labels iterate in order;
    // `boxed`: the key is a `Box<Key>`; `extern_path`: the ack is the type
    // of `acme::common`, not a copy.
    let blob = Blob {
        data: Bytes::from_static(b"payload"),
        labels: BTreeMap::from([
            ("zone".to_owned(), "b".to_owned()),
            ("app".to_owned(), "kv".to_owned()),
        ]),
        key: Some(Box::new(key("photos", 7))),
        ack: Some(Ack {
            ok: true,
            reason: String::new(),
        }),
    };
    let labels: Vec<&str> = blob.labels.keys().map(String::as_str).collect();
    assert_eq!(labels, ["app", "zone"]);
    let decoded = Blob::decode(blob.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded, blob);
    assert!(
        format!("{decoded:?}").contains("zone"),
        "Debug of a BTreeMap field"
    );

    // `type_attribute`: keys derive `Ord`, so they sort.
    let mut keys = vec![key("b", 1), key("a", 2), key("a", 1)];
    keys.sort();
    assert_eq!(keys, [key("a", 1), key("a", 2), key("b", 1)]);

    // `field_attribute`: the attribute is on the field in the source.
    let source = include_str!(concat!(env!("OUT_DIR"), "/options/acme.options.rs"));
    let data = source.find("pub data:").expect("the data field");
    assert!(source[..data].ends_with("///Set by a field attribute.\n    "));

    // The service's messages are the extern ones too.
    let _: fn(&BlobsClient, Blob) -> UnaryCall<Ack> = |c, b| c.put(b);
    assert_eq!(
        options::blobs_server::DESCRIPTOR.methods[0].path,
        "/acme.options.Blobs/Put"
    );
}
