//! A command-line client of the example key-value store.
//!
//! ```text
//! kv-client --connect tcp://127.0.0.1:7471 put KEY VALUE
//! kv-client --connect tcp://127.0.0.1:7471 get KEY
//! kv-client --connect tcp://127.0.0.1:7471 delete KEY
//! kv-client --connect tcp://127.0.0.1:7471 scan PREFIX
//! kv-client --connect tcp://127.0.0.1:7471 bench --calls 20000 --concurrency 8
//! kv-client --connect tcp://127.0.0.1:7471 health kv.Kv
//! kv-client --connect tcp://kv.example.com:7471 --tls-ca ca.pem get KEY
//! ```

use examples::cli::{CLIENT_TLS_USAGE, client_tls, fail, parse, take_opt};
use examples::kv::kv_client::KvClient;
use examples::kv::{DeleteRequest, GetRequest, PutRequest, ScanRequest};
use examples::workload;
use rpc_core::health::{HealthClient, ServingStatus};
use rpc_core::{Channel, Status};
use std::time::Duration;

const USAGE: &str = "usage: kv-client --connect URL [--timeout-ms MS] COMMAND
commands:
  put KEY VALUE
  get KEY                       (exit status 1 when the key is absent)
  delete KEY
  scan PREFIX
  bench [--calls N] [--concurrency C]
  health [SERVICE]              (grpc.health.v1 Check; exit status 1 unless SERVING)";

fn main() {
    examples::init_logging("warn");
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let connect = take_opt(&mut args, "--connect").unwrap_or_else(|| fail(USAGE));
    let timeout_ms: u64 =
        take_opt(&mut args, "--timeout-ms").map_or(10_000, |v| parse(&v, "--timeout-ms"));
    if args.is_empty() || args[0] == "--help" || args[0] == "-h" {
        println!("{USAGE}\n{CLIENT_TLS_USAGE}");
        return;
    }
    let builder = Channel::builder(&connect).timeout(Duration::from_millis(timeout_ms));
    let channel = client_tls(&mut args, builder)
        .connect()
        .unwrap_or_else(|status| {
            fail(&format!(
                "kv-client: cannot connect to {connect}: {}",
                status.message()
            ))
        });
    let client = KvClient::new(channel.clone());
    let command = args.remove(0);
    let result =
        match (command.as_str(), args.as_slice()) {
            ("put", [key, value]) => client
                .put(PutRequest {
                    key: key.clone(),
                    value: value.clone().into_bytes().into(),
                })
                .wait()
                .map(|r| {
                    println!(
                        "ok{}",
                        if r.into_inner().replaced {
                            " (replaced)"
                        } else {
                            ""
                        }
                    )
                }),
            ("get", [key]) => client.get(GetRequest { key: key.clone() }).wait().map(|r| {
                match r.into_inner().value {
                    Some(v) => println!("{}", String::from_utf8_lossy(&v)),
                    None => {
                        eprintln!("not found: {key}");
                        std::process::exit(1);
                    }
                }
            }),
            ("delete", [key]) => client
                .delete(DeleteRequest { key: key.clone() })
                .wait()
                .map(|r| {
                    println!(
                        "{}",
                        if r.into_inner().existed {
                            "deleted"
                        } else {
                            "not found"
                        }
                    )
                }),
            ("scan", [prefix]) => client
                .scan(ScanRequest {
                    prefix: prefix.clone(),
                    limit: 0,
                })
                .wait()
                .map(|r| {
                    let r = r.into_inner();
                    for e in &r.entries {
                        println!("{}\t{}", e.key, String::from_utf8_lossy(&e.value));
                    }
                    if r.truncated {
                        eprintln!(
                            "(more entries matched; showing the first {})",
                            r.entries.len()
                        );
                    }
                }),
            ("bench", rest) => {
                let mut rest = rest.to_vec();
                let calls = take_opt(&mut rest, "--calls").map_or(20_000, |v| parse(&v, "--calls"));
                let concurrency =
                    take_opt(&mut rest, "--concurrency").map_or(8, |v| parse(&v, "--concurrency"));
                if !rest.is_empty() {
                    fail(&format!("unexpected arguments {rest:?}\n{USAGE}"));
                }
                let summary = workload::run(&client, calls, concurrency as usize);
                println!("{summary}");
                if let Some(e) = &summary.first_error {
                    eprintln!("first error: {e}");
                }
                match summary.first_error {
                    // The real status of the first failure: a lost connection
                    // says Unavailable, not that some calls failed.
                    Some(first) if summary.errors > 0 => Err(Status::new(
                        first.code(),
                        format!(
                            "{} calls failed, the first with: {}",
                            summary.errors,
                            first.message()
                        ),
                    )),
                    _ => Ok(()),
                }
            }
            ("health", service) => {
                let service = service.first().map_or("", String::as_str);
                HealthClient::new(channel).check(service).wait().map(|r| {
                    let status = ServingStatus::try_from(r.into_inner().status)
                        .unwrap_or(ServingStatus::Unknown);
                    println!("{status:?}");
                    if status != ServingStatus::Serving {
                        std::process::exit(1);
                    }
                })
            }
            _ => fail(&format!("bad command {command:?} {args:?}\n{USAGE}")),
        };
    if let Err(status) = result {
        eprintln!("kv-client: {command} failed: {status}");
        std::process::exit(1);
    }
}
