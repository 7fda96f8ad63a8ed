//! Faults on the wire between two hosts: two Soft-RoCE guests joined by a
//! virtual Ethernet wire (`scripts/rxe/pair`), the wire degraded from the
//! client's guest with `scripts/rxe/wire` while calls run, over rdma://
//! and tcp:// in turn. This file's own test binary plays both roles in the
//! guests (`guest::server`, `guest::client`); the host's test boots the
//! pair and reads what the client reports.
//!
//! What the client asserts, on each fabric:
//! - *loss* (1 % and 5 % of what the client's guest sends: its requests
//!   and its acknowledgements of the server's packets): every call of a
//!   few thousand at 8 in flight completes with its own answer (checked
//!   byte for byte), no error; and a stream of 4 MiB messages (lent, read
//!   by RDMA READ on rdma://) arrives whole. Calls/s and p99 beside the
//!   clean wire's, in the same run.
//! - *at most once*: the server counts executions per call; none ran twice.
//!
//! These boot two QEMU guests, so they are ignored by default; the
//! two-guest tier of `scripts/test` runs them:
//! `cargo test -p examples --test faults -- --ignored --test-threads 1`.

#[macro_use]
mod common;

use common::*;
use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::{Echo, EchoServer};
use examples::echo::{EchoReply, EchoRequest, StreamRequest};
use rpc_core::{BoxStream, Request, Response, Server, Status};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Ports the server guest serves on.
const RDMA_PORT: u16 = 7481;
const TCP_PORT: u16 = 7482;

/// Calls per phase, and how many are in flight.
const CALLS: u64 = 2_000;
const IN_FLIGHT: usize = 8;

/// The large messages of the stream: lent (by RDMA READ on rdma://).
const LARGE: u32 = 4 << 20;
const LARGE_COUNT: u64 = 2;

/// Executions per call id (`id` metadata), and the calls that ran twice.
#[derive(Default)]
struct Executions {
    seen: HashMap<String, u32>,
    twice: Vec<String>,
}

/// Echoes, counting executions per call; a request with `report`
/// metadata answers with the count of calls that ran more than once
/// (`twice`) and of calls seen (`calls`).
#[derive(Clone, Default)]
struct Counting(Arc<Mutex<Executions>>);

impl Echo for Counting {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let mut ex = self.0.lock().unwrap();
        if request.metadata().get("report").is_some() {
            let mut reply = Response::new(EchoReply::default());
            reply
                .metadata_mut()
                .insert("twice", ex.twice.len().to_string())
                .unwrap();
            reply
                .metadata_mut()
                .insert("calls", ex.seen.len().to_string())
                .unwrap();
            return Ok(reply);
        }
        let id = request.metadata().get("id").unwrap_or("").to_owned();
        let n = ex.seen.entry(id.clone()).or_insert(0);
        *n += 1;
        if *n == 2 {
            ex.twice.push(id.clone());
        }
        drop(ex);
        let mut reply = Response::new(EchoReply {
            payload: request.into_inner().payload,
        });
        reply.metadata_mut().insert("id", id).unwrap();
        Ok(reply)
    }

    type StreamStream = BoxStream<EchoReply>;

    async fn stream(
        &self,
        request: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let StreamRequest { count, size } = request.into_inner();
        let stream = futures::stream::iter(0..count).map(move |i| {
            Ok(EchoReply {
                payload: pattern(size as usize, i).into(),
            })
        });
        Ok(Response::new(Box::pin(stream) as BoxStream<EchoReply>))
    }
}

use futures::StreamExt;

/// The payload of call `seq`: names it, so that another call's answer
/// cannot pass.
fn payload(seq: u64) -> Vec<u8> {
    let mut p = seq.to_le_bytes().to_vec();
    p.resize(64, (seq % 251) as u8);
    p
}

/// The request of call `seq`, tagged with its id.
fn request(seq: u64) -> Request<EchoRequest> {
    let mut request = Request::new(EchoRequest {
        payload: payload(seq).into(),
    });
    request
        .metadata_mut()
        .insert("id", seq.to_string())
        .unwrap();
    request
}

/// Checks that `reply` is call `seq`'s own answer, whole.
fn check_answer(reply: &Response<EchoReply>, seq: u64, what: &str) {
    assert_eq!(
        reply.metadata().get("id"),
        Some(seq.to_string().as_str()),
        "{what}: call {seq} got another call's answer"
    );
    assert!(
        reply.get_ref().payload == payload(seq)[..],
        "{what}: call {seq}: its payload came back changed"
    );
}

/// What a phase measured.
struct Phase {
    rps: f64,
    p99_us: f64,
}

/// `CALLS` calls at `IN_FLIGHT`, each checked against its request; ids
/// `first..`. Panics on any error or wrong answer.
fn run_calls(client: &EchoClient, first: u64, what: &str) -> Phase {
    let mut inflight = VecDeque::new();
    let mut latencies = Vec::with_capacity(CALLS as usize);
    let start = Instant::now();
    let mut next = first;
    let end = first + CALLS;
    while next < end || !inflight.is_empty() {
        while next < end && inflight.len() < IN_FLIGHT {
            inflight.push_back((next, Instant::now(), client.echo(request(next))));
            next += 1;
        }
        let (seq, at, call) = inflight.pop_front().expect("in flight");
        let reply = call
            .wait()
            .unwrap_or_else(|e| panic!("{what}: call {seq} failed: {e}"));
        latencies.push(at.elapsed());
        check_answer(&reply, seq, what);
    }
    let elapsed = start.elapsed();
    latencies.sort();
    Phase {
        rps: CALLS as f64 / elapsed.as_secs_f64(),
        p99_us: latencies[latencies.len() * 99 / 100].as_secs_f64() * 1e6,
    }
}

/// A stream of `LARGE_COUNT` messages of `LARGE` bytes, each checked.
fn run_stream(client: &EchoClient, what: &str) {
    let stream = client.stream(StreamRequest {
        count: LARGE_COUNT,
        size: LARGE,
    });
    let mut n = 0u64;
    for reply in stream {
        let reply = reply.unwrap_or_else(|e| panic!("{what}: stream message {n}: {e}"));
        assert!(
            reply.payload == pattern(LARGE as usize, n)[..],
            "{what}: stream message {n} damaged"
        );
        n += 1;
    }
    assert_eq!(n, LARGE_COUNT, "{what}: stream messages");
}

/// How a call of a partition's load ended.
#[derive(Default, Debug)]
struct Outcomes {
    ok: u64,
    unavailable: u64,
    deadline: u64,
    /// The longest a call took.
    longest: Duration,
    /// The first failure's status.
    first_error: Option<String>,
}

/// `n` calls at `IN_FLIGHT`, each with `deadline`, ids `first..`, while
/// `during` runs once `n / 4` were made: each must end with its own
/// answer, or fail `Unavailable` or `DeadlineExceeded`, and none may
/// outlive its deadline by more than a second.
fn calls_through(
    client: &EchoClient,
    first: u64,
    n: u64,
    deadline: Duration,
    during: impl FnOnce(),
    what: &str,
) -> Outcomes {
    let mut out = Outcomes::default();
    let mut inflight = VecDeque::new();
    let mut during = Some(during);
    let mut next = first;
    let end = first + n;
    while next < end || !inflight.is_empty() {
        while next < end && inflight.len() < IN_FLIGHT {
            if next - first == n / 4 {
                if let Some(f) = during.take() {
                    f();
                }
            }
            let mut request = request(next);
            request.set_timeout(deadline);
            inflight.push_back((next, Instant::now(), client.echo(request)));
            next += 1;
        }
        let (seq, at, call) = inflight.pop_front().expect("in flight");
        let result = call.wait();
        let took = at.elapsed();
        out.longest = out.longest.max(took);
        assert!(
            took <= deadline + Duration::from_secs(1),
            "{what}: call {seq} took {took:?}, past its deadline of {deadline:?}"
        );
        match result {
            Ok(reply) => {
                check_answer(&reply, seq, what);
                out.ok += 1;
            }
            Err(e) if e.code() == rpc_core::Code::Unavailable => {
                out.unavailable += 1;
                out.first_error.get_or_insert_with(|| e.to_string());
            }
            Err(e) if e.code() == rpc_core::Code::DeadlineExceeded => {
                out.deadline += 1;
                out.first_error.get_or_insert_with(|| e.to_string());
            }
            Err(e) => panic!("{what}: call {seq} failed {e}"),
        }
    }
    out
}

/// Runs `scripts/rxe/wire` with `args` (in the client's guest).
fn wire(args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/rxe/wire");
    let status = Command::new(script)
        .args(args)
        .status()
        .expect("scripts/rxe/wire");
    assert!(status.success(), "wire {args:?}: {status}");
}

/// The roles the guests play (run by the host's test, in the guests).
mod guest {
    use super::*;

    #[test]
    #[ignore = "a role in a guest of scripts/rxe/pair (faults_on_the_wire runs it)"]
    fn server() {
        let ip = std::env::var("RXE_IP").expect("in a guest");
        let counting = Counting::default();
        let _rdma = serve(
            Server::builder().add_service(EchoServer::new(counting.clone())),
            &format!("rdma://{ip}:{RDMA_PORT}"),
        );
        let _tcp = serve(
            Server::builder().add_service(EchoServer::new(counting)),
            &format!("tcp://{ip}:{TCP_PORT}"),
        );
        println!("fault-server listening");
        // Until the pair stops this guest.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }

    #[test]
    #[ignore = "a role in a guest of scripts/rxe/pair (faults_on_the_wire runs it)"]
    fn client() {
        let peer = std::env::var("RXE_PEER_IP").expect("in a guest of the pair");
        let mut id = 0u64;
        for (fabric, port) in [("rdma", RDMA_PORT), ("tcp", TCP_PORT)] {
            let url = format!("{fabric}://{peer}:{port}");
            let channel = loop {
                let attempt = rpc_core::Channel::builder(&url)
                    .timeout(Duration::from_secs(60))
                    .connect();
                match attempt {
                    Ok(c) => break c,
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            };
            let client = EchoClient::new(channel.clone());
            for loss in [0u32, 1, 5] {
                if loss > 0 {
                    wire(&["loss", &loss.to_string()]);
                }
                let what = format!("{fabric} at {loss}% loss");
                let phase = run_calls(&client, id, &what);
                id += CALLS;
                let start = Instant::now();
                run_stream(&client, &what);
                let stream_s = start.elapsed().as_secs_f64();
                println!(
                    "fault-result fabric={fabric} loss={loss} calls={CALLS} rps={:.0} p99_us={:.0} \
                     stream_s={stream_s:.2}",
                    phase.rps, phase.p99_us
                );
            }
            wire(&["clear"]);

            // A short partition, within what the transport rides out (RC
            // retransmits for about 0.94 s; TCP for longer, and the
            // heartbeat allows 5 s): calls end with their answers after
            // the heal, or fail by their deadline.
            let short = if fabric == "rdma" { "0.5" } else { "1.5" };
            let what = format!("{fabric}, {short} s partition");
            let out = calls_through(
                &client,
                id,
                400,
                Duration::from_secs(10),
                || wire(&["partition", short]),
                &what,
            );
            id += 400;
            println!(
                "fault-partition fabric={fabric} secs={short} ok={} unavailable={} deadline={} \
                 longest_ms={} first_error={:?}",
                out.ok,
                out.unavailable,
                out.deadline,
                out.longest.as_millis(),
                out.first_error
            );
            std::thread::sleep(Duration::from_secs(2)); // healed

            // A long partition, past the RC retry budget and the heartbeat
            // bound: the calls in flight fail Unavailable within the bound
            // (or their deadline), the channel reconnects by itself once
            // the wire heals, and a wait-for-ready call made during the
            // partition succeeds after it.
            let what = format!("{fabric}, 8 s partition");
            let cut = Instant::now();
            let out = calls_through(
                &client,
                id,
                200,
                Duration::from_secs(30),
                || wire(&["partition", "8"]),
                &what,
            );
            id += 200;
            let failed_by = cut.elapsed();
            let mut waiting = request(id);
            waiting.set_wait_for_ready(true);
            waiting.set_timeout(Duration::from_secs(60));
            let ready_call = client.echo(waiting);
            id += 1;
            let ready = ready_call.wait();
            let healed_by = cut.elapsed();
            println!(
                "fault-partition fabric={fabric} secs=8 ok={} unavailable={} deadline={} \
                 load_ended_s={:.1} wait_for_ready={} at_s={:.1} first_error={:?}",
                out.ok,
                out.unavailable,
                out.deadline,
                failed_by.as_secs_f64(),
                if ready.is_ok() { "ok" } else { "failed" },
                healed_by.as_secs_f64(),
                out.first_error
            );
            let reply = ready.unwrap_or_else(|e| panic!("{what}: the wait-for-ready call: {e}"));
            check_answer(&reply, id - 1, &what);
            // And new calls go as before.
            run_calls(&client, id, &format!("{fabric} after the partitions"));
            id += CALLS;
            assert_eq!(channel.stale_responses(), 0, "{fabric}: stray responses");
            let mut report = Request::new(EchoRequest::default());
            report.metadata_mut().insert("report", "1").unwrap();
            let counts = client.echo(report).wait().expect("the server's report");
            let twice = counts.metadata().get("twice").unwrap_or("?").to_owned();
            let calls = counts.metadata().get("calls").unwrap_or("?").to_owned();
            println!("fault-executions fabric={fabric} calls={calls} twice={twice}");
            assert_eq!(twice, "0", "{fabric}: calls executed twice");
        }
        println!("fault-client done");
    }
}

/// Boots the pair, runs the roles, and checks what the client reported.
#[test]
#[ignore = "boots two QEMU guests; scripts/test runs it"]
fn faults_on_the_wire() {
    let exe = std::env::current_exe().expect("this test binary");
    let exe = exe.display();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("scripts/rxe/pair"))
        .arg(format!("{exe} --ignored --exact guest::server --nocapture"))
        .arg(format!("{exe} --ignored --exact guest::client --nocapture"))
        .env("RXE_TIMEOUT", "900")
        .current_dir(&root)
        .output()
        .expect("run scripts/rxe/pair");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the client guest failed: {}",
        out.status
    );
    let results: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("fault-result "))
        .collect();
    assert_eq!(
        results.len(),
        6,
        "a result per fabric and loss: {results:?}"
    );
    let partitions = stdout
        .lines()
        .filter(|l| l.contains("fault-partition "))
        .count();
    assert_eq!(partitions, 4, "two partitions per fabric");
    assert_eq!(
        stdout.lines().filter(|l| l.contains("twice=0")).count(),
        2,
        "no call executed twice, on either fabric"
    );
    assert!(stdout.contains("fault-client done"));
}
