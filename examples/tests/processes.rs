//! Client and server in separate processes: the `kv-server` and `kv-client`
//! binaries against each other and against in-test peers, including peers
//! killed in the middle of their calls.

#[macro_use]
mod common;

use common::procs::{Proc, ServerProc};
use common::*;
use examples::kv::kv_client::KvClient;
use examples::kv::kv_server::KvServer;
use examples::kv::{GetRequest, PutRequest, ScanRequest};
use examples::services::KvStore;
use examples::workload;
use futures::FutureExt;
use rpc_core::codegen::{ServerCall, Service, ServiceDescriptor};
use rpc_core::{Code, Server, Status};
use std::io::Read;
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

/// What a `kv-client` run printed.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `kv-client --connect url args...` to completion (bounded).
fn kv_client(url: &str, args: &[&str]) -> Run {
    let mut proc = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_kv-client"))
            .args(["--connect", url])
            .args(args),
    );
    let mut stdout = proc.child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = stdout.read_to_string(&mut out);
        out
    });
    let status = proc.wait();
    Run {
        code: status.code(),
        stdout: reader.join().unwrap(),
        stderr: proc.all_stderr(),
    }
}

/// Runs `kv-client` and expects exit status 0 and exactly `stdout`.
#[track_caller]
fn expect_output(url: &str, args: &[&str], stdout: &str) {
    let run = kv_client(url, args);
    assert_eq!(run.code, Some(0), "kv-client {args:?} failed: {run:?}");
    assert_eq!(run.stdout, stdout, "kv-client {args:?}: {run:?}");
}

on_network_fabrics! {
    fn kv_client_and_kv_server_processes(url: &str) {
        let server = ServerProc::kv(url);
        let u = server.url.as_str();
        expect_output(u, &["put", "a", "1"], "ok\n");
        expect_output(u, &["put", "a", "2"], "ok (replaced)\n");
        expect_output(u, &["get", "a"], "2\n");
        let missing = kv_client(u, &["get", "nope"]);
        assert_eq!(missing.code, Some(1), "{missing:?}");
        assert_eq!(missing.stdout, "");
        assert!(missing.stderr.contains("not found: nope"), "{missing:?}");
        expect_output(u, &["put", "ab", "x y"], "ok\n");
        expect_output(u, &["put", "b", "z"], "ok\n");
        expect_output(u, &["scan", "a"], "a\t2\nab\tx y\n");
        expect_output(u, &["scan", ""], "a\t2\nab\tx y\nb\tz\n");
        expect_output(u, &["delete", "a"], "deleted\n");
        expect_output(u, &["delete", "a"], "not found\n");
        assert_eq!(kv_client(u, &["get", "a"]).code, Some(1));
        expect_output(u, &["scan", "a"], "ab\tx y\n");

        let bench = kv_client(u, &["bench", "--calls", "2000", "--concurrency", "8"]);
        assert_eq!(bench.code, Some(0), "{bench:?}");
        assert!(bench.stdout.starts_with("calls=2000 errors=0 "), "{bench:?}");
        // What the bench stored is there for a client in this process too.
        let kv = KvClient::new(channel(u));
        let value = kv.get(GetRequest { key: "key-0".into() }).wait().unwrap().into_inner().value;
        assert_eq!(value, Some(workload::value_for("key-0")));
        let scan = kv
            .scan(ScanRequest { prefix: "b".into(), limit: 0 })
            .wait()
            .unwrap()
            .into_inner();
        assert_eq!(scan.entries.len(), 1);
        assert_eq!(scan.entries[0].value, &b"z"[..]);
    }
}

on_network_fabrics! {
    fn killed_server_fails_pending_and_later_calls(url: &str) {
        let mut server = ServerProc::kv(url);
        let kv = KvClient::new(channel(&server.url));
        let put = |key: String| kv.put(PutRequest { key, value: b"v".to_vec().into() });
        put("before".into()).wait().unwrap();

        // Clients hammering the server when it dies.
        let (tx, errors) = mpsc::channel();
        let workers: Vec<_> = (0..3)
            .map(|w| {
                let kv = kv.clone();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for i in 0.. {
                        let request = PutRequest { key: format!("w{w}-{i}"), value: vec![1; 100].into() };
                        if let Err(e) = kv.put(request).wait() {
                            tx.send(e).unwrap();
                            return;
                        }
                    }
                })
            })
            .collect();
        drop(tx);
        // Freeze the server so these calls are certainly pending when it dies.
        server.proc.signal("STOP");
        let mut pending: Vec<_> = (0..50).map(|i| put(format!("pending-{i}"))).collect();
        for call in &mut pending {
            assert!(call.now_or_never().is_none(), "a stopped server answered");
        }
        server.proc.kill();

        let started = Instant::now();
        for call in pending {
            expect_code(call.wait(), Code::Unavailable);
        }
        for _ in &workers {
            let e: Status = errors.recv_timeout(LIMIT).expect("a worker's call hung");
            assert_eq!(e.code(), Code::Unavailable, "{e}");
        }
        for w in workers {
            w.join().unwrap();
        }
        // A killed process's kernel closes its sockets: noticed at once, well
        // within a second (the bound ARCHITECTURE.md gives for kill -9).
        let took = started.elapsed();
        eprintln!("{url}: pending calls failed {took:?} after the kill");
        assert!(took < Duration::from_secs(1), "failing the calls took {took:?}");
        // Later calls fail at once, and the channel says why.
        expect_code(put("after".into()).wait(), Code::Unavailable);
        assert!(!kv.channel().is_connected());
        // Nobody listens there any more.
        let e = rpc_core::Channel::connect(&server.url).expect_err("connected to a dead server");
        assert_eq!(e.code(), Code::Unavailable, "{e}");
    }
}

on_network_fabrics! {
    fn kv_client_bench_stops_on_a_lost_connection(url: &str) {
        const CONCURRENCY: u64 = 8;
        let server = ServerProc::kv(url);
        let mut bench = Proc::spawn(Command::new(env!("CARGO_BIN_EXE_kv-client")).args([
            "--connect",
            &server.url,
            "bench",
            "--calls",
            "100000000",
            "--concurrency",
            &CONCURRENCY.to_string(),
        ]));
        let mut stdout = bench.child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut out = String::new();
            let _ = stdout.read_to_string(&mut out);
            out
        });
        // Calls in flight (the first worker's first put is visible; a slow
        // guest may take well over a second to get there), then the server
        // dies.
        let waiting = Instant::now();
        while kv_client(&server.url, &["get", "key-0"]).code != Some(0) {
            assert!(waiting.elapsed() < LIMIT, "the bench made no call: {}", bench.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut server = server;
        server.proc.kill();
        let killed = Instant::now();
        let status = bench.wait();
        let took = killed.elapsed();
        let stdout = reader.join().unwrap();
        let stderr = bench.all_stderr();
        assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
        assert!(took < Duration::from_secs(10), "the bench went on for {took:?} after the kill");
        assert!(stdout.contains("stopped=connection-lost"), "{stdout}");
        // The real status, not `unknown`.
        assert!(stderr.contains("bench failed: unavailable"), "{stderr}");
        // Each worker stops after the failure it saw: no flood of failures,
        // and latencies come from the calls that succeeded.
        let errors: u64 = stdout
            .split_whitespace()
            .find_map(|f| f.strip_prefix("errors="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no errors= in {stdout:?}"));
        assert!(
            (1..=2 * CONCURRENCY).contains(&errors),
            "{errors} failures reported: {stdout}"
        );
        assert!(!stdout.contains("p50_us=-"), "successful calls were timed: {stdout}");
    }
}

/// Counts the calls a service completed, and lets a test wait for a number.
struct Counted<S> {
    inner: S,
    count: Arc<(Mutex<u64>, Condvar)>,
}

impl<S: Service> Service for Counted<S> {
    fn descriptor(&self) -> &'static ServiceDescriptor {
        self.inner.descriptor()
    }

    fn call(&self, call: ServerCall) {
        self.inner.call(call);
        let (count, cond) = &*self.count;
        *count.lock().unwrap() += 1;
        cond.notify_all();
    }
}

on_network_fabrics! {
    fn killed_client_leaves_the_server_serving(url: &str) {
        let count = Arc::new((Mutex::new(0u64), Condvar::new()));
        let server = serve(
            // Room for `other` and the bench: a newcomer gets in only once
            // the server has dropped the killed bench's connection.
            Server::builder()
                .max_connections(2)
                .add_service(Counted {
                    inner: KvServer::new(KvStore::new()),
                    count: count.clone(),
                }),
            url,
        );
        let u = server.local_url().to_owned();
        let other = KvClient::new(channel(&u));
        other.put(PutRequest { key: "mine".into(), value: b"safe".to_vec().into() }).wait().unwrap();

        let mut bench = Proc::spawn(
            Command::new(env!("CARGO_BIN_EXE_kv-client"))
                .args(["--connect", &u, "bench", "--calls", "1000000", "--concurrency", "4"]),
        );
        // Let it get going, with calls in flight, then kill it.
        {
            let (n, cond) = &*count;
            let n = n.lock().unwrap();
            let (n, timeout) = cond.wait_timeout_while(n, LIMIT, |n| *n < 1000).unwrap();
            assert!(!timeout.timed_out(), "the bench made only {} calls; {}", *n, bench.stderr());
        }
        // Another client keeps working while the bench dies.
        let busy = {
            let other = other.clone();
            std::thread::spawn(move || workload::run(&other, 2000, 4))
        };
        bench.signal("KILL");
        let killed = Instant::now();
        assert!(bench.wait().code().is_none(), "the bench exited instead of being killed");
        // The server notices the dead client within a second and frees its
        // connection: a newcomer fits under the limit again.
        let newcomer = KvClient::new(connect_when_there_is_room(&u));
        let took = killed.elapsed();
        eprintln!("{url}: the server dropped the killed client within {took:?}");
        assert!(took < Duration::from_secs(1), "the server took {took:?} to drop a killed client");
        let summary = bounded("the other client's workload", move || busy.join().unwrap());
        assert_eq!(summary.errors, 0, "{summary}: {:?}", summary.first_error);

        // The server still answers correctly, old clients and new.
        let got = other.get(GetRequest { key: "mine".into() }).wait().unwrap();
        assert_eq!(got.into_inner().value.as_deref(), Some(&b"safe"[..]));
        newcomer.put(PutRequest { key: "new".into(), value: b"n".to_vec().into() }).wait().unwrap();
        let scan = other
            .scan(ScanRequest { prefix: "new".into(), limit: 0 })
            .wait()
            .unwrap()
            .into_inner();
        assert_eq!(scan.entries.len(), 1);
        assert_eq!(scan.entries[0].value, &b"n"[..]);
        // The bench's values are intact.
        let value = newcomer.get(GetRequest { key: "key-0".into() }).wait().unwrap().into_inner().value;
        assert_eq!(value, Some(workload::value_for("key-0")));
        bounded("shutdown", move || server.shutdown());
    }
}

on_network_fabrics! {
    fn stopped_server_calls_time_out_then_recover(url: &str) {
        let server = ServerProc::kv(url);
        let kv = KvClient::new(channel(&server.url));
        kv.put(PutRequest { key: "k".into(), value: b"v".to_vec().into() }).wait().unwrap();
        // A server that is alive but not answering: calls hit their deadlines,
        // even with far more bytes outstanding than the ring and the TCP
        // buffers hold.
        server.proc.signal("STOP");
        let started = Instant::now();
        let kv2 = kv.clone();
        let calls = bounded("starting calls to a stopped server", move || {
            (0..40)
                .map(|i| {
                    let mut request = rpc_core::Request::new(PutRequest {
                        key: format!("big-{i}"),
                        value: vec![i as u8; 128 * 1024].into(),
                    });
                    request.set_timeout(Duration::from_millis(300));
                    kv2.put(request)
                })
                .collect::<Vec<_>>()
        });
        for call in calls {
            expect_code(call.wait(), Code::DeadlineExceeded);
        }
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        server.proc.signal("CONT");
        // Once it runs again, the channel works.
        let got = kv.get(GetRequest { key: "k".into() }).wait().unwrap().into_inner().value;
        assert_eq!(got.as_deref(), Some(&b"v"[..]));
    }
}

on_network_fabrics! {
    fn kv_server_shuts_down_gracefully_on_sigterm(url: &str) {
        let mut server = ServerProc::kv(url);
        let kv = KvClient::new(channel(&server.url));
        kv.put(PutRequest { key: "k".into(), value: b"v".to_vec().into() }).wait().unwrap();
        server.proc.signal("TERM");
        let status = server.proc.wait();
        let stderr = server.proc.all_stderr();
        assert!(status.success(), "kv-server exited {status}; stderr:\n{stderr}");
        assert!(stderr.contains("shutting down") && stderr.contains("stopped"), "{stderr}");
        // Its clients see the connection go, and fail fast meanwhile.
        eventually("the channel notices", || !kv.channel().is_connected());
    }
}
