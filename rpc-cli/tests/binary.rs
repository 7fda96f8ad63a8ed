//! The `rpc` binary itself, as a user runs it: its usage, its exit codes,
//! and a clear error (not a hang) for a server that is not there. What it
//! does against real servers is checked through `rpc_cli::run` in
//! `examples/tests/cli.rs`; the rdma:// tier runs this binary in the guest.

use std::process::{Command, Output};

fn rpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rpc"))
        .args(args)
        .output()
        .expect("the rpc binary runs")
}

#[test]
fn help_prints_the_usage_and_exits_zero() {
    let out = rpc(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let usage = String::from_utf8_lossy(&out.stdout);
    for command in ["list", "describe", "call"] {
        assert!(usage.contains(command), "usage names `{command}`: {usage}");
    }
}

#[test]
fn a_wrong_command_is_a_usage_error() {
    let out = rpc(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rpc --help for usage"), "{err}");
}

#[test]
fn a_server_that_is_not_there_fails_unavailable() {
    // Nothing listens on port 1: the connect is refused at once.
    let out = rpc(&["list", "tcp://127.0.0.1:1"]);
    // 64 + the status code: Unavailable is 14.
    assert_eq!(
        out.status.code(),
        Some(64 + 14),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Unavailable"), "{err}");
}
