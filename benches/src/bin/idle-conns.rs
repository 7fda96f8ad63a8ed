//! `idle-conns`: what an idle connection costs each side, and that one
//! server holds many.
//!
//! ```text
//! idle-conns --url URL --connections N [--ring-size BYTES] [--idle-s S] [--json FILE]
//! ```
//!
//! Serves the echo service on URL in this process (default settings), then
//! runs the clients in a child process of this same binary, so that each
//! side's figures are its own: the child opens N channels with default
//! settings and makes one 64-byte echo call on each (every connection has
//! then carried a call and stays up, idle). Each side reads its own
//! `/proc/self/status` before and after, and the per-connection figures are
//! the differences divided by N. Then both sides leave the connections
//! idle for S seconds (default 5) and each measures its own CPU time
//! (user + system, all threads) over them:
//!
//! ```text
//! url=... connections=N ring_size=... side=server rss_kib_per_conn=... pinned_kib_per_conn=... mapped_kib_per_conn=... threads=... connect_s=... calls_s=... idle_cpu_pct=...
//! url=... connections=N ring_size=... side=client ...
//! ```
//!
//! `rss` is resident memory (VmRSS); `pinned` is memory the RDMA device has
//! pinned (VmPin: registered rings and staging areas; 0 on mem:// and
//! tcp://); `mapped` is address space (VmSize), the most a connection's
//! rings and staging could make resident once busy; `threads` counts the
//! side's threads with all N connections up; `connect_s` and `calls_s` are
//! how long the client took to open the N channels, one after another, and
//! to make the N calls, one after another; `idle_cpu_pct` is the side's
//! CPU time over the idle seconds, in percent of one core (what keeping N
//! idle connections alive costs: heartbeats, timers). Exit code 0, 1 if a
//! connection or call failed, 2 on bad arguments.

use benches::rpc::Tuning;
use examples::echo::EchoRequest;
use examples::echo::echo_client::EchoClient;
use rpc_core::{Channel, Request};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const USAGE: &str =
    "usage: idle-conns --url URL --connections N [--ring-size BYTES] [--idle-s S] [--json FILE]";

/// One side's process figures, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, Default)]
struct Status {
    rss_kib: u64,
    pin_kib: u64,
    size_kib: u64,
    threads: u64,
}

impl Status {
    fn now() -> Status {
        let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        Status {
            rss_kib: field("VmRSS:"),
            pin_kib: field("VmPin:"),
            size_kib: field("VmSize:"),
            threads: field("Threads:"),
        }
    }

    /// Waits until resident memory stops moving (a connection's last pages
    /// are touched by dispatchers just after it is up), at most a second.
    fn settled() -> Status {
        let until = Instant::now() + Duration::from_secs(1);
        let mut last = Status::now();
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let now = Status::now();
            if now.rss_kib == last.rss_kib || Instant::now() > until {
                return now;
            }
            last = now;
        }
    }

    fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.rss_kib, self.pin_kib, self.size_kib, self.threads
        )
    }

    fn decode(s: &str) -> Option<Status> {
        let v: Vec<u64> = s
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        match v[..] {
            [rss_kib, pin_kib, size_kib, threads] => Some(Status {
                rss_kib,
                pin_kib,
                size_kib,
                threads,
            }),
            _ => None,
        }
    }
}

struct Options {
    url: String,
    connections: usize,
    tuning: Tuning,
    json: Option<std::path::PathBuf>,
    /// How long both sides stay idle while each measures its CPU time.
    idle: Duration,
    client: bool,
}

fn parse() -> Result<Options, String> {
    let mut url = None;
    let mut connections = None;
    let mut tuning = Tuning::default();
    let mut json = None;
    let mut idle = Duration::from_secs(5);
    let mut client = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--url" => url = Some(value()?),
            "--connections" => {
                connections = Some(value()?.parse().map_err(|_| "--connections: a number")?)
            }
            "--ring-size" => {
                let bytes: usize = value()?.parse().map_err(|_| "--ring-size: a number")?;
                if !bytes.is_power_of_two() {
                    return Err(format!("--ring-size {bytes}: a power of two is needed"));
                }
                tuning.ring_size = Some(bytes);
            }
            "--json" => json = Some(value()?.into()),
            "--idle-s" => {
                let secs: f64 = value()?.parse().map_err(|_| "--idle-s: a number")?;
                idle = Duration::try_from_secs_f64(secs)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or("--idle-s: a positive number of seconds")?;
            }
            // The child's role: run the clients (not for users).
            "--client" => client = true,
            "--help" | "-h" => return Err(String::new()),
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    let connections = connections.ok_or("--connections is required")?;
    if connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    Ok(Options {
        url: url.ok_or("--url is required")?,
        connections,
        tuning,
        json,
        idle,
        client,
    })
}

/// Raises this process's descriptor limit to its hard limit.
fn allow_descriptors() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The child: opens the channels, makes a call on each, reports its
/// figures on stdout and holds the connections until stdin closes.
fn client(o: &Options) -> Result<(), String> {
    let before = Status::settled();
    let start = Instant::now();
    let mut clients = Vec::with_capacity(o.connections);
    for i in 0..o.connections {
        let mut builder = Channel::builder(&o.url);
        if let Some(bytes) = o.tuning.ring_size {
            builder = builder.ring_size(bytes);
        }
        let channel = builder
            .connect()
            .map_err(|s| format!("connection {i}: {}", s.message()))?;
        clients.push(EchoClient::new(channel));
    }
    let connect_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for (i, c) in clients.iter().enumerate() {
        let payload = rpc_core::Bytes::from(vec![i as u8; 64]);
        let reply = c
            .echo(Request::new(EchoRequest {
                payload: payload.clone(),
            }))
            .wait()
            .map_err(|s| format!("call on connection {i}: {}", s.message()))?;
        if reply.into_inner().payload != payload {
            return Err(format!("connection {i}: wrong echo"));
        }
    }
    let calls_s = start.elapsed().as_secs_f64();
    let after = Status::settled();
    println!(
        "{} {} {connect_s} {calls_s}",
        before.encode(),
        after.encode()
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // The parent measures the server over the same idle seconds.
    println!("{}", idle_cpu_pct(o.idle));
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Held until the parent has measured the server.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(clients);
    Ok(())
}

/// This process's CPU time over the next `idle` (spent sleeping here), in
/// percent of one core.
fn idle_cpu_pct(idle: Duration) -> f64 {
    let start = (Instant::now(), benches::measure::process_cpu());
    std::thread::sleep(idle);
    let cpu = benches::measure::process_cpu().saturating_sub(start.1);
    100.0 * cpu.as_secs_f64() / start.0.elapsed().as_secs_f64()
}

fn line(
    o: &Options,
    side: &str,
    before: Status,
    after: Status,
    times: (f64, f64),
    idle_cpu: f64,
) -> String {
    let (connect_s, calls_s) = times;
    let n = o.connections as f64;
    let per = |a: u64, b: u64| (a.saturating_sub(b)) as f64 / n;
    format!(
        "url={} connections={} ring_size={} side={side} rss_kib_per_conn={:.1} \
         pinned_kib_per_conn={:.1} mapped_kib_per_conn={:.1} threads={} connect_s={connect_s:.2} calls_s={calls_s:.2} \
         idle_cpu_pct={idle_cpu:.2}",
        o.url,
        o.connections,
        o.tuning
            .ring_size
            .map_or_else(|| "default".to_owned(), |b| b.to_string()),
        per(after.rss_kib, before.rss_kib),
        per(after.pin_kib, before.pin_kib),
        per(after.size_kib, before.size_kib),
        after.threads,
    )
}

fn json(line: &str) -> String {
    let fields: Vec<String> = line
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| match v.parse::<f64>() {
            Ok(_) => format!("\"{k}\":{v}"),
            Err(_) => format!("\"{k}\":\"{v}\""),
        })
        .collect();
    format!("{{{}}}", fields.join(","))
}

fn server(o: &Options) -> Result<(), String> {
    let handle = benches::rpc::serve(&o.url, &o.tuning, None)?;
    let url = handle.local_url().to_owned();
    let before = Status::settled();
    let mut args = vec![
        "--client".to_owned(),
        "--url".to_owned(),
        url.clone(),
        "--connections".to_owned(),
        o.connections.to_string(),
    ];
    if let Some(bytes) = o.tuning.ring_size {
        args.extend(["--ring-size".to_owned(), bytes.to_string()]);
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the clients: {e}"))?;
    let mut report = String::new();
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    stdout.read_line(&mut report).map_err(|e| e.to_string())?;
    let after = Status::settled();
    let server_idle_cpu = idle_cpu_pct(o.idle);
    let mut idle_line = String::new();
    stdout
        .read_line(&mut idle_line)
        .map_err(|e| e.to_string())?;
    drop(child.stdin.take());
    let status = child.wait().map_err(|e| e.to_string())?;
    let numbers: Vec<&str> = report.split_whitespace().collect();
    let parsed = (numbers.len() == 10)
        .then(|| {
            Some((
                Status::decode(&numbers[0..4].join(" "))?,
                Status::decode(&numbers[4..8].join(" "))?,
                (
                    numbers[8].parse::<f64>().ok()?,
                    numbers[9].parse::<f64>().ok()?,
                ),
            ))
        })
        .flatten();
    let client_idle_cpu = idle_line.trim().parse::<f64>().ok();
    let Some(((client_before, client_after, times), client_idle_cpu)) =
        parsed.zip(client_idle_cpu).filter(|_| status.success())
    else {
        return Err(format!("the clients failed ({status})"));
    };
    let o = Options {
        url,
        connections: o.connections,
        tuning: o.tuning,
        json: o.json.clone(),
        idle: o.idle,
        client: false,
    };
    let lines = [
        line(&o, "server", before, after, times, server_idle_cpu),
        line(
            &o,
            "client",
            client_before,
            client_after,
            times,
            client_idle_cpu,
        ),
    ];
    for l in &lines {
        println!("{l}");
    }
    if let Some(path) = &o.json {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        for l in &lines {
            writeln!(f, "{}", json(l)).map_err(|e| e.to_string())?;
        }
    }
    drop(handle);
    Ok(())
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("idle-conns: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    allow_descriptors();
    let result = if o.client { client(&o) } else { server(&o) };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idle-conns: {e}");
            ExitCode::from(1)
        }
    }
}
