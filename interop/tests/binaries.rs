//! The interop binaries as processes, as gRPC's interop runs use them:
//! `interop-client --test_case all` against `interop-server`, on tcp://
//! and over the gRPC face (`--server_port`), in the clear and over TLS
//! with the test certificates. (mem:// is in-process only, rdma:// needs
//! the Soft-RoCE guest: tests/cases.rs runs those.)

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An `interop-server` process, stopped (SIGTERM) when dropped.
struct ServerProc {
    child: Child,
    /// The `tcp://` URL it serves.
    tcp: String,
    /// The port of its gRPC face.
    port: u16,
}

impl ServerProc {
    fn start(args: &[&str], certs: &std::path::Path) -> ServerProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_interop-server"))
            .args(["--port", "0", "--listen", "tcp://127.0.0.1:0"])
            .args(args)
            .env("RPC_INTEROP_CERTS", certs)
            .stdout(Stdio::piped())
            .spawn()
            .expect("interop-server starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut tcp, mut port) = (None, None);
        while tcp.is_none() || port.is_none() {
            let line = lines
                .next()
                .expect("interop-server prints where it listens")
                .unwrap();
            if let Some(url) = line.strip_prefix("interop-server listening on ") {
                if let Some(face) = url.strip_prefix("grpc://") {
                    port = face.rsplit(':').next().and_then(|p| p.parse().ok());
                } else {
                    tcp = Some(url.to_owned());
                }
            }
        }
        // Whatever else it prints is read, so that it never blocks.
        std::thread::spawn(move || lines.for_each(drop));
        ServerProc {
            child,
            tcp: tcp.unwrap(),
            port: port.unwrap(),
        }
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which it still is (not
        // yet waited for).
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `interop-client` with `args` and the test cases `all`: its output,
/// after checking that every case passed and it exited 0.
fn client(args: &[&str], certs: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_interop-client"))
        .args(args)
        .args(["--test_case", "all"])
        .env("RPC_INTEROP_CERTS", certs)
        .output()
        .expect("interop-client runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.ends_with("19 passed, 0 failed\n"),
        "interop-client {args:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A directory of test certificates for this test alone.
fn certs_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("interop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn every_case_passes_between_the_binaries_on_tcp_and_over_the_face() {
    let certs = certs_dir("plain");
    let server = ServerProc::start(&[], &certs);
    client(&["--url", &server.tcp], &certs);
    let port = server.port.to_string();
    client(
        &["--server_host", "localhost", "--server_port", &port],
        &certs,
    );
}

#[test]
fn every_case_passes_between_the_binaries_over_tls() {
    let certs = certs_dir("tls");
    let server = ServerProc::start(&["--use_tls", "true"], &certs);
    let tls = ["--use_tls", "true", "--use_test_ca", "true"];
    let port = server.port.to_string();
    let face = ["--server_host", "127.0.0.1", "--server_port", &port];
    let overridden = ["--server_host_override", interop::certs::TEST_HOST];
    client(&[&face[..], &tls, &overridden].concat(), &certs);
    client(&[&["--url", &server.tcp][..], &tls].concat(), &certs);
    // In the clear, a TLS server is not reached: every case fails.
    let out = Command::new(env!("CARGO_BIN_EXE_interop-client"))
        .args(face)
        .args(["--test_case", "empty_unary"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let _ = std::fs::remove_dir_all(&certs);
}
