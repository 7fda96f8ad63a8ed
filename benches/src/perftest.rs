//! The raw-verbs baseline for `rdma://`: perftest's `ib_write_lat` and
//! `ib_write_bw`, server and client as two processes on the device (port,
//! GID) our run used, with the same payload size and count, the client
//! connecting to the URL's host.
//!
//! `ib_write_lat` ping-pongs RDMA WRITEs and reports half the round trip;
//! this baseline's latencies are doubled back to round trips, so they
//! compare with a call's. Its `rps` is `ib_write_bw`'s message rate with
//! `concurrency` writes outstanding (`-t`, the send-queue depth); its p50 is
//! `2 × t_typical` (perftest's median), p99 and p99.9 are perftest's
//! percentiles doubled. With several connections, `ib_write_bw` runs as
//! many queue pairs (`-q`). perftest's own figures are kept in `extra`.
//!
//! In stream mode only `ib_write_bw` runs, at perftest's default send-queue
//! depth (a stream keeps as many messages in flight as its window allows,
//! whatever the number of streams): its `rps` is the message rate, and the
//! record has no latencies (they are 0; perftest's gaps are not measured).

use crate::measure::{Kind, Measurement, Mode, Params};
use rpc_core::fabric::FabricUrl;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long one perftest client may run.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// The device, port and GID index our verbs fabric picks for `url` (the
/// same choice, made by the same code).
pub fn device_of(url: &str) -> Result<(String, u8, u8), String> {
    let parsed = FabricUrl::parse(url).map_err(|e| format!("{url}: {e}"))?;
    let fabric = rpc_core::fabric::verbs::VerbsFabric::open(&parsed)
        .map_err(|e| format!("perftest baseline: cannot open the RDMA device of {url}: {e}"))?;
    let c = fabric.choice();
    Ok((c.device.clone(), c.port, c.gid_index))
}

/// Runs both perftest pairs for `url`'s device and host.
pub fn run(url: &str, params: Params) -> Result<Measurement, String> {
    let (lat_bin, bw_bin) = tools()?;
    let host = FabricUrl::parse(url)
        .map_err(|e| format!("{url}: {e}"))?
        .host;
    let (device, port, gid) = device_of(url)?;
    // perftest runs at least 5 iterations.
    let iters = params.calls.max(5).to_string();
    let size = params.size.to_string();
    let common = |tcp_port: u16| -> Vec<String> {
        [
            "-d",
            &device,
            "-i",
            &port.to_string(),
            "-x",
            &gid.to_string(),
            "-s",
            &size,
            "-n",
            &iters,
            "-p",
            &tcp_port.to_string(),
            "-F",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let bw_args = |tcp_port: u16| {
        let mut args = common(tcp_port);
        if params.mode == Mode::Unary {
            args.extend(["-t".to_owned(), params.concurrency.max(1).to_string()]);
        }
        if params.connections > 1 {
            args.extend(["-q".to_owned(), params.connections.to_string()]);
        }
        args
    };
    let bw = || {
        measure_with_retries("ib_write_bw", &size, || {
            let out = run_pair(&bw_bin, bw_args(free_port()?), &host)?;
            Ok((parse_bw(&out, params.size), out))
        })
    };
    let url = format!("perftest://{device}/{host}?port={port}&gid={gid}");
    if params.mode == Mode::Stream {
        let bw = bw()?;
        let mut m = Measurement::from_tally(
            Kind::Perftest,
            "rdma",
            url,
            params,
            &crate::measure::Tally::default(),
            0,
            Duration::from_secs_f64(params.calls as f64 / (bw.msg_rate_mpps * 1e6)),
        );
        m.warmup = 0;
        m.extra.insert("bw_avg_MBps".to_owned(), bw.avg_mbps);
        m.extra.insert(
            "bw_msg_rate_per_s".to_owned(),
            (bw.msg_rate_mpps * 1e6).round(),
        );
        return Ok(m);
    }
    let lat = measure_with_retries("ib_write_lat", &size, || {
        let out = run_pair(&lat_bin, common(free_port()?), &host)?;
        Ok((parse_lat(&out, params.size), out))
    })?;
    let bw = bw()?;

    let rps = bw.msg_rate_mpps * 1e6;
    let mut cdf = vec![(0.0, 2.0 * lat.t_min), (0.5, 2.0 * lat.t_typical)];
    cdf.extend(lat.p99.map(|v| (0.99, 2.0 * v)));
    cdf.extend(lat.p999.map(|v| (0.999, 2.0 * v)));
    cdf.push((1.0, 2.0 * lat.t_max));
    let mut extra = BTreeMap::new();
    extra.insert("lat_t_min_us".to_owned(), lat.t_min);
    extra.insert("lat_t_typical_us".to_owned(), lat.t_typical);
    extra.insert("lat_t_avg_us".to_owned(), lat.t_avg);
    extra.insert("lat_t_max_us".to_owned(), lat.t_max);
    if let Some(v) = lat.p99 {
        extra.insert("lat_p99_us".to_owned(), v);
    }
    if let Some(v) = lat.p999 {
        extra.insert("lat_p999_us".to_owned(), v);
    }
    extra.insert("bw_avg_MBps".to_owned(), bw.avg_mbps);
    extra.insert("bw_msg_rate_per_s".to_owned(), rps.round());
    Ok(Measurement {
        kind: Kind::Perftest,
        mode: Mode::Unary,
        stream_len: None,
        fabric: "rdma".to_owned(),
        url,
        size: params.size,
        concurrency: params.concurrency,
        connections: params.connections,
        calls: params.calls,
        warmup: 0,
        errors: 0,
        p50_us: 2.0 * lat.t_typical,
        p99_us: 2.0 * lat.p99.unwrap_or(lat.t_max),
        p999_us: 2.0 * lat.p999.unwrap_or(lat.t_max),
        rps,
        elapsed_s: params.calls as f64 / rps.max(f64::EPSILON),
        // perftest busy-polls a core on each side whatever the load: its
        // CPU time says nothing per message.
        cpu_us_per_call: None,
        cdf,
        extra,
        ratio_p50: None,
        ratio_rps: None,
        ratio_cpu: None,
        first_error: None,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

/// Runs `attempt` until it yields a result line, at most three times:
/// perftest sometimes prints no figures, or `inf` ones (its clock
/// calibration fails now and then in an emulated guest). Each retry is
/// reported on stderr.
fn measure_with_retries<T>(
    name: &str,
    size: &str,
    mut attempt: impl FnMut() -> Result<(Option<T>, String), String>,
) -> Result<T, String> {
    let mut last = String::new();
    for n in 1..=3 {
        match attempt()? {
            (Some(result), _) => return Ok(result),
            (None, out) => {
                eprintln!(
                    "rpc-bench: {name} gave no usable result line for {size} bytes (attempt {n} of 3)"
                );
                last = out;
            }
        }
    }
    Err(format!(
        "perftest baseline: no usable result line for {size} bytes in {name}'s output:\n{last}"
    ))
}

/// `ib_write_lat`'s result line, one-way µs.
#[derive(Debug, Clone, PartialEq)]
pub struct Lat {
    /// Smallest.
    pub t_min: f64,
    /// Largest.
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// 99th percentile (newer perftest only).
    pub p99: Option<f64>,
    /// 99.9th percentile (newer perftest only).
    pub p999: Option<f64>,
}

/// `ib_write_bw`'s result line.
#[derive(Debug, Clone, PartialEq)]
pub struct Bw {
    /// Average bandwidth, MB/s.
    pub avg_mbps: f64,
    /// Message rate, millions per second.
    pub msg_rate_mpps: f64,
}

/// The numbers of the result line for `size`: the line whose first field
/// is `size` and that has at least `min` numeric fields (`inf` and `nan`
/// parse, for the caller to judge: perftest prints `-nan` for a standard
/// deviation that overflowed).
fn result_fields(output: &str, size: usize, min: usize) -> Option<Vec<f64>> {
    output.lines().find_map(|line| {
        let fields: Vec<f64> = line
            .split_whitespace()
            .map(|f| f.parse::<f64>().ok())
            .collect::<Option<_>>()?;
        (fields.len() >= min && fields[0] == size as f64).then_some(fields)
    })
}

/// Parses `ib_write_lat`'s output: `#bytes #iterations t_min t_max
/// t_typical t_avg t_stdev [99% [99.9%]]`. `None` unless the latencies
/// used are finite (the standard deviation is not used).
pub fn parse_lat(output: &str, size: usize) -> Option<Lat> {
    let f = result_fields(output, size, 7)?;
    let finite = |v: f64| v.is_finite().then_some(v);
    Some(Lat {
        t_min: finite(f[2])?,
        t_max: finite(f[3])?,
        t_typical: finite(f[4])?,
        t_avg: finite(f[5])?,
        p99: f.get(7).copied().and_then(finite),
        p999: f.get(8).copied().and_then(finite),
    })
}

/// Parses `ib_write_bw`'s output: `#bytes #iterations BW_peak BW_average
/// MsgRate[Mpps]`.
pub fn parse_bw(output: &str, size: usize) -> Option<Bw> {
    let f = result_fields(output, size, 5)?;
    // The rate is printed to 6 decimals of Mpps: below 1,000 messages/s
    // (large messages) it has at most 3 digits, and the average bandwidth
    // (MB = 2^20 bytes) says it more precisely.
    let rate = if f[4] < 0.001 && size > 0 {
        f[3] * 1_048_576.0 / size as f64 / 1e6
    } else {
        f[4]
    };
    (f[3].is_finite() && rate.is_finite() && rate > 0.0).then_some(Bw {
        avg_mbps: f[3],
        msg_rate_mpps: rate,
    })
}

/// Where `ib_write_lat` and `ib_write_bw` are; `Err` says how to install
/// them. `rpc-bench` checks this before measuring anything.
pub fn tools() -> Result<(PathBuf, PathBuf), String> {
    Ok((find("ib_write_lat")?, find("ib_write_bw")?))
}

fn find(name: &str) -> Result<PathBuf, String> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "perftest baseline: {name} not found in PATH: install perftest \
                 (apt-get install perftest; `scripts/rxe/run --setup` does, for the Soft-RoCE guest)"
            )
        })
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("0.0.0.0:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("perftest baseline: no free TCP port: {e}"))
}

/// A child whose stdout and stderr are collected by background threads.
struct Proc {
    child: Child,
    out: std::thread::JoinHandle<String>,
}

impl Proc {
    fn spawn(bin: &PathBuf, args: &[String]) -> Result<Proc, String> {
        let mut child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("perftest baseline: cannot run {}: {e}", bin.display()))?;
        let mut stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let out = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s + &err.join().unwrap_or_default()
        });
        Ok(Proc { child, out })
    }

    /// Waits up to `timeout`; kills the process past it. Returns whether it
    /// exited successfully, and its output.
    fn finish(mut self, timeout: Duration) -> (Result<(), String>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break Err(format!("timed out after {timeout:?}"));
                }
                Err(e) => break Err(format!("wait failed: {e}")),
            }
        };
        let out = self.out.join().unwrap_or_default();
        let result = match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(format!("exited with {s}")),
            Err(e) => Err(e),
        };
        (result, out)
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Runs `bin` as a server, then as a client connecting to `host`
/// (retrying while the server is not listening yet); returns the client's
/// output.
fn run_pair(bin: &PathBuf, args: Vec<String>, host: &str) -> Result<String, String> {
    let name = bin
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let mut server = Proc::spawn(bin, &args)?;
    let mut client_args = args.clone();
    client_args.push(host.to_owned());
    let mut attempts = 0;
    loop {
        std::thread::sleep(Duration::from_millis(300));
        attempts += 1;
        let client = Proc::spawn(bin, &client_args)?;
        let (result, out) = client.finish(RUN_TIMEOUT);
        match result {
            Ok(()) => {
                let (server_result, server_out) = server.finish(Duration::from_secs(30));
                return match server_result {
                    Ok(()) => Ok(out),
                    Err(e) => Err(format!(
                        "perftest baseline: {name} server {e}:\n{server_out}\nclient output:\n{out}"
                    )),
                };
            }
            // The server may not listen yet: perftest's client does not retry.
            Err(_) if attempts < 40 && server.running() && out.contains("Couldn't connect") => {}
            Err(e) => {
                let _ = server.child.kill();
                let (_, server_out) = server.finish(Duration::from_secs(5));
                return Err(format!(
                    "perftest baseline: {name} {} client {e}:\n{out}\nserver output:\n{server_out}",
                    client_args.join(" ")
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perftest_output() {
        let lat = "\
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 64      2000          15.83          258.44       21.20               26.47          13.61           105.05                  243.19 
---------------------------------------------------------------------------------------
";
        let l = parse_lat(lat, 64).unwrap();
        assert_eq!(l.t_typical, 21.20);
        assert_eq!(l.p99, Some(105.05));
        assert_eq!(l.p999, Some(243.19));
        assert_eq!(parse_lat(lat, 65), None);
        assert_eq!(parse_lat(&lat.replace("21.20", "inf"), 64), None);
        let nan_stdev = parse_lat(&lat.replace("13.61", "-nan"), 64).unwrap();
        assert_eq!(nan_stdev.t_typical, 21.20);
        let bw = "\
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 64         2000             1.75               1.70   		   0.027862
";
        let b = parse_bw(bw, 64).unwrap();
        assert_eq!(b.avg_mbps, 1.70);
        assert_eq!(b.msg_rate_mpps, 0.027862);
        let large = "\
 16777216   24               22.10              21.67              0.000001
";
        let b = parse_bw(large, 16 << 20).unwrap();
        assert!((b.msg_rate_mpps * 1e6 - 1.354).abs() < 0.001, "{b:?}");
    }
}
