//! Examples of rdma-rpc, and the Rust code generated from `../proto`.
//!
//! `build.rs` runs `rpc_codegen::compile_protos` over the `.proto` files;
//! each protobuf package becomes a module here through
//! `rpc_core::include_proto!`.

pub mod cli;
pub mod route_guide;
pub mod services;
pub mod workload;

/// Logs to stderr (`RUST_LOG` filters; default `warn`, or `info` for
/// servers), without colours unless stderr is a terminal.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

pub mod echo {
    //! The `echo` package: a service that returns what it receives, used by
    //! tests and benchmarks.
    rpc_core::include_proto!("echo");
}

pub mod kv {
    //! The `kv` package: a small key-value store, the example service of
    //! rdma-rpc.
    rpc_core::include_proto!("kv");
}

pub mod routeguide {
    //! The `routeguide` package: gRPC's route guide, one rpc of each kind
    //! (served by [`crate::route_guide`]).
    rpc_core::include_proto!("routeguide");
}

pub mod acme {
    //! Test packages (`proto/test`): they exercise the code generator on
    //! dotted packages, imports across packages, well-known types, nested
    //! types, oneofs, maps and names that are Rust keywords.

    pub mod common {
        //! The `acme.common` package: types imported by `acme.storage.v1`.
        rpc_core::include_proto!("acme.common");
    }

    pub mod options {
        //! The `acme.options` package, generated with prost options (see
        //! `build.rs`): `Bytes`, `BTreeMap`, attributes, a boxed field and an
        //! extern path to [`super::common`].
        include!(concat!(env!("OUT_DIR"), "/options/acme.options.rs"));
    }

    pub mod storage {
        //! The `acme.storage` packages.

        pub mod v1 {
            //! The `acme.storage.v1` package: an object store, and services
            //! named with Rust keywords.
            rpc_core::include_proto!("acme.storage.v1");
        }
    }
}
