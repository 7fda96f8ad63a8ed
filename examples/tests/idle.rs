//! An idle server and an idle connected client burn no CPU: their pollers
//! spin only briefly after traffic, then block. Nor does a thread that
//! awaits a slow call while other threads' calls keep the queue busy.

use examples::echo::echo_client::EchoClient;
use examples::echo::echo_server::{Echo, EchoServer};
use examples::echo::{EchoReply, EchoRequest, StreamRequest};
use examples::services::{EchoService, Replies};
use rpc_core::{Channel, Request, Response, Server, Status};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Threads are told apart by name only, and the client's dispatchers are
/// shared: measure one configuration at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// CPU time (user + system, in clock ticks) of each of this process's
/// threads whose names start with `prefix`, by thread id, from /proc.
fn thread_ticks(prefix: &str) -> HashMap<String, u64> {
    let mut ticks = HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread exited meanwhile
        };
        // pid (comm) state ... : comm may hold spaces, so split after ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
        let used = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        ticks.insert(task.file_name().to_string_lossy().into_owned(), used);
    }
    ticks
}

/// Ticks used between two snapshots: by threads alive in both, and all of
/// those of threads started since (a thread that exited is not counted).
fn ticks_between(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> u64 {
    after
        .iter()
        .map(|(tid, &t)| t.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum()
}

/// Clock ticks (usually 10 ms) an idle second may use: a poller that kept
/// spinning would use about 100. Each side's dispatcher still wakes for
/// its heartbeat timer (which, on tcp:// and rdma://, posts a probe the
/// peer's process never sees; on mem://, a credit doorbell the peer
/// handles).
const IDLE_TICKS: u64 = 3;

/// The same in the Soft-RoCE guest, where every instruction is emulated
/// (TCG) and the heartbeats' wake-ups cost several milliseconds each: an
/// idle second there measured 6 ticks with the host quiet (7 while the
/// host compiled). Still far from spinning.
const IDLE_TICKS_EMULATED: u64 = 10;

fn idle_cpu(url: &str) {
    idle_cpu_within(url, IDLE_TICKS)
}

fn idle_cpu_within(url: &str, limit: u64) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::builder()
        .add_service(EchoServer::new(EchoService))
        .serve(url)
        .unwrap();
    let client = EchoClient::new(Channel::connect(server.local_url()).unwrap());
    for _ in 0..100 {
        let reply = client
            .echo(Request::new(EchoRequest {
                payload: vec![1; 64].into(),
            }))
            .wait()
            .unwrap();
        assert_eq!(reply.get_ref().payload, vec![1; 64]);
    }
    // Let the pollers finish spinning, then measure a quiet second.
    std::thread::sleep(Duration::from_millis(200));
    let before = thread_ticks("rpc-");
    std::thread::sleep(Duration::from_secs(1));
    let used = ticks_between(&before, &thread_ticks("rpc-"));
    assert!(
        used <= limit,
        "{url}: idle pollers used {used} ticks in one second (limit {limit})"
    );
    drop(client);
    server.shutdown();
}

#[test]
fn idle_mem_server_and_client_use_no_cpu() {
    idle_cpu("mem://idle");
}

#[test]
fn idle_tcp_server_and_client_use_no_cpu() {
    idle_cpu("tcp://127.0.0.1:0");
}

#[test]
#[ignore = "needs an RDMA device: scripts/test runs it in the Soft-RoCE guest"]
fn rdma_idle_server_and_client_use_no_cpu() {
    let url = std::env::var("RPC_TEST_RDMA_URL").unwrap_or_else(|_| "rdma://127.0.0.1:0".into());
    idle_cpu_within(&url, IDLE_TICKS_EMULATED);
}

/// Echoes; a call whose payload is `slow` is answered after 400 ms (slept
/// on the blocking pool, the dispatcher free meanwhile).
struct SlowEcho;

impl Echo for SlowEcho {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let payload = request.into_inner().payload;
        if payload == b"slow"[..] {
            rpc_core::blocking(|| std::thread::sleep(Duration::from_millis(400))).await;
        }
        Ok(Response::new(EchoReply { payload }))
    }

    type StreamStream = Replies;

    async fn stream(&self, request: Request<StreamRequest>) -> Result<Response<Replies>, Status> {
        EchoService.stream(request).await
    }
}

/// CPU time (user + system) the calling thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A task awaiting a slow call on one thread, while another thread keeps 8
/// calls in flight on the same connection: the second thread's turns of
/// the completion queue keep finding responses, but not for the first,
/// whose thread must sleep once its spin time is up instead of spinning
/// for the others' traffic until its own response comes.
fn awaiting_thread_sleeps_through_others_traffic(url: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::builder()
        .add_service(EchoServer::new(SlowEcho))
        .serve(url)
        .unwrap();
    let client = EchoClient::new(Channel::connect(server.local_url()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let (client, stop) = (client.clone(), stop.clone());
        std::thread::spawn(move || {
            let lanes = (0..8).map(|_| async {
                let mut calls = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let reply = client
                        .echo(Request::new(EchoRequest {
                            payload: vec![7; 64].into(),
                        }))
                        .await
                        .unwrap();
                    assert_eq!(reply.get_ref().payload, vec![7; 64]);
                    calls += 1;
                }
                calls
            });
            futures::executor::block_on(futures::future::join_all(lanes))
                .into_iter()
                .sum::<u64>()
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let waiter = std::thread::spawn(move || {
        let before = thread_cpu();
        let reply = futures::executor::block_on(client.echo(Request::new(EchoRequest {
            payload: b"slow".to_vec().into(),
        })));
        (thread_cpu() - before, reply)
    });
    let (used, reply) = waiter.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let calls = busy.join().unwrap();
    assert_eq!(reply.unwrap().get_ref().payload, &b"slow"[..]);
    assert!(
        calls > 100,
        "{url}: the busy thread made only {calls} calls"
    );
    // Its spin time (at most 1 ms adaptive) and a wake-up: a few ms at most
    // even on a loaded machine; spinning through the 400 ms would use
    // hundreds.
    assert!(
        used < Duration::from_millis(100),
        "{url}: the thread awaiting a slow call used {used:?} of CPU while \
         another thread's calls ({calls}) kept the queue busy"
    );
    server.shutdown();
}

#[test]
fn mem_awaiting_thread_sleeps_through_others_traffic() {
    awaiting_thread_sleeps_through_others_traffic("mem://spin-others");
}

#[test]
fn tcp_awaiting_thread_sleeps_through_others_traffic() {
    awaiting_thread_sleeps_through_others_traffic("tcp://127.0.0.1:0");
}
