//! `rpc-bench`'s command line.

use std::path::PathBuf;

/// The usage message (printed with exit code 2 on bad arguments).
pub const USAGE: &str = "\
usage: rpc-bench --url URL --size BYTES --calls N --concurrency C [--tokio]
                 [--connections K] [--warmup N] [--json FILE]
                 [--baseline tonic|perftest|channel|plaintext] [--spin-us N] [--tls]
                 [--ring-size BYTES] [--rendezvous-above BYTES]
                 [--compression gzip|zstd|deflate] [--payload repeating|random]
       rpc-bench --stream --url URL --size BYTES --calls N [--concurrency C]
                 [--stream-len M] [--connections K] [--warmup N] [--json FILE]
                 [--baseline tonic|perftest|channel|plaintext] [--spin-us N] [--tls]
                 [--ring-size BYTES] [--rendezvous-above BYTES]
                 [--compression gzip|zstd|deflate] [--payload repeating|random]

Runs N unary echo calls of BYTES-byte payloads against an echo server
embedded in this process on URL (mem://name, tcp://host:port, rdma://host:port;
port 0 picks a free one), C calls outstanding over K connections (default 1),
after N/10 warm-up calls, at least one (--warmup), and prints

  url=... size=... concurrency=... calls=... errors=... p50_us=... p99_us=... p999_us=... rps=... cpu_us_per_call=...

cpu_us_per_call is the process's CPU time (user + system, all threads: client
and server) over the measured calls, divided by their number.

--stream measures server streaming instead: N messages of BYTES bytes read
from echo Stream calls, C streams at a time (default 1), each asking for M
messages (default: N/C per round, one long stream per lane), and prints

  url=... mode=stream size=... concurrency=... messages=... errors=... gap_p50_us=... gap_p99_us=... gap_p999_us=... msgs_per_s=... mb_per_s=... cpu_us_per_msg=...

where a gap is the time between two messages of a stream (for the first,
since the call was issued), MB are 10^6 payload bytes, and cpu_us_per_msg
is the process's CPU time over the measured messages, divided by their
number. Baselines: tonic (server streaming, the same messages), channel
(a producer thread per stream sending the same payloads through a bounded
crossbeam channel: the in-process floor) and perftest (ib_write_bw's
message rate at BYTES, perftest's default queue depth).

--baseline measures a reference with the same size, calls and concurrency and
prints its line and the ratios ours/theirs (tonic and channel run in this
process, alternating with ours in up to 5 rounds; perftest runs afterwards):
  tonic     gRPC (tonic) on 127.0.0.1, server and client in this process
  perftest  ib_write_lat and ib_write_bw on the device of an rdma:// URL
  channel   a crossbeam-channel ping-pong between two threads
  plaintext rdma-rpc itself without TLS, on the same URL (with --tls)
--tokio makes our calls from C tasks spawned on a multi-thread tokio runtime
(a worker per core), as the tonic baseline's are, instead of C lanes joined
on one thread; its records name the fabric tcp-tokio (mem-tokio, ...).
--url grpc-face:// measures tonic's clients against our server's gRPC face
(ServerBuilder::grpc) instead of our clients; with --baseline tonic, against
tonic's own server in the same run.
--tls runs our server and clients over TLS (a CA and a server certificate are
made for the run; tcp:// is all TLS, rdma:// only its handshake); its records
name the fabric tls.
--json FILE appends every line as a JSON record (JSON Lines).
--spin-us N (an experiment, not a default) sets how long server and client
poll an idle queue before they sleep (the builders' spin(); default: 50 µs,
adapted to the gaps observed).
--compression ENCODING has both sides send their messages compressed (the
builders' send_compressed()); --payload random makes the payloads random
bytes (incompressible) instead of the default's repeated byte. The fabric
label gets -ENCODING and -random added.
--ring-size BYTES (an experiment, not a default) sets the receive ring of
server and clients (the builders' ring_size(); a power of two).
--rendezvous-above BYTES (an experiment, not a default) sets the payload size
above which messages travel by rendezvous, each side (the builders'
rendezvous_above(); default 32 KiB).
Payloads above 63 MiB raise both sides' max_message_size to fit (the
default limit is 64 MiB), as the tonic baseline's limits are raised.
Exit code: 0, 1 if any call failed or a baseline could not run, 2 on bad arguments.";

/// A baseline measured in the same invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// gRPC over tonic, loopback TCP.
    Tonic,
    /// perftest's `ib_write_lat` and `ib_write_bw`.
    Perftest,
    /// A crossbeam-channel ping-pong.
    Channel,
    /// rdma-rpc without TLS (for `--tls` runs).
    Plaintext,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Where the embedded server listens.
    pub url: String,
    /// Payload bytes per request (and reply).
    pub size: usize,
    /// Measured calls.
    pub calls: u64,
    /// Calls kept outstanding.
    pub concurrency: usize,
    /// Connections (Channels) the calls are spread over.
    pub connections: usize,
    /// Warm-up calls, not measured.
    pub warmup: u64,
    /// Where to append JSON records.
    pub json: Option<PathBuf>,
    /// The baseline to measure too.
    pub baseline: Option<Baseline>,
    /// Experiment knobs (`--spin-us`, `--ring-size`, `--rendezvous-above`;
    /// None: the default).
    pub tuning: crate::rpc::Tuning,
    /// Server streams instead of unary calls (`--stream`): `calls` counts
    /// messages.
    pub stream: bool,
    /// Stream mode: messages per stream (None: a round's over the streams).
    pub stream_len: Option<u64>,
    /// Ours runs over TLS (`--tls`).
    pub tls: bool,
    /// Our calls are made from tasks on a multi-thread tokio runtime
    /// (`--tokio`).
    pub tokio: bool,
}

impl Options {
    /// Parses the arguments (without the program name). `Ok(None)` means
    /// `--help` was asked for; `Err` holds what is wrong.
    pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Option<Options>, String> {
        let mut url = None;
        let mut size = None;
        let mut calls = None;
        let mut concurrency = None;
        let mut connections = 1u64;
        let mut warmup = None;
        let mut json = None;
        let mut baseline = None;
        let mut tuning = crate::rpc::Tuning::default();
        let mut stream = false;
        let mut stream_len = None;
        let mut tls = false;
        let mut tokio = false;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let (name, inline_value) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n.to_owned(), Some(v.to_owned())),
                _ => (arg.clone(), None),
            };
            if let Some(flag) = match name.as_str() {
                "--stream" => Some(&mut stream),
                "--tls" => Some(&mut tls),
                "--tokio" => Some(&mut tokio),
                _ => None,
            } {
                if inline_value.is_some() {
                    return Err(format!("{name} takes no value"));
                }
                *flag = true;
                continue;
            }
            let mut value = || {
                inline_value
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match name.as_str() {
                "--url" => url = Some(value()?),
                "--size" => size = Some(number(&name, &value()?)?),
                "--calls" => calls = Some(number(&name, &value()?)?),
                "--concurrency" => concurrency = Some(number(&name, &value()?)?),
                "--connections" => connections = number(&name, &value()?)?,
                "--warmup" => warmup = Some(number(&name, &value()?)?),
                "--json" => json = Some(PathBuf::from(value()?)),
                "--baseline" => {
                    baseline = Some(match value()?.as_str() {
                        "tonic" => Baseline::Tonic,
                        "perftest" => Baseline::Perftest,
                        "channel" => Baseline::Channel,
                        "plaintext" => Baseline::Plaintext,
                        other => {
                            return Err(format!(
                                "unknown baseline {other:?}: expected tonic, perftest, channel or plaintext"
                            ));
                        }
                    })
                }
                "--spin-us" => {
                    tuning.spin = Some(std::time::Duration::from_micros(number(&name, &value()?)?))
                }
                "--ring-size" => {
                    let bytes = number(&name, &value()?)?;
                    if !bytes.is_power_of_two() {
                        return Err(format!("--ring-size {bytes}: a power of two is needed"));
                    }
                    tuning.ring_size = Some(bytes as usize);
                }
                "--rendezvous-above" => {
                    tuning.rendezvous_above = Some(number(&name, &value()?)? as usize)
                }
                "--stream-len" => stream_len = Some(number(&name, &value()?)?),
                "--compression" => {
                    let v = value()?;
                    tuning.compression =
                        Some(rpc_core::Encoding::from_name(&v).ok_or_else(|| {
                            format!("--compression {v:?}: expected gzip, zstd or deflate")
                        })?);
                }
                "--payload" => {
                    tuning.random_payload = match value()?.as_str() {
                        "repeating" => false,
                        "random" => true,
                        other => {
                            return Err(format!(
                                "--payload {other:?}: expected repeating or random"
                            ));
                        }
                    }
                }
                "--help" | "-h" => return Ok(None),
                _ => return Err(format!("unexpected argument {arg:?}")),
            }
        }
        let url: String = url.ok_or("--url is required")?;
        let size: u64 = size.ok_or("--size is required")?;
        let calls = calls.ok_or("--calls is required")?;
        let concurrency = match concurrency {
            Some(c) => c as usize,
            None if stream => 1,
            None => return Err("--concurrency is required".into()),
        };
        let connections = connections as usize;
        if calls == 0 {
            return Err("--calls must be at least 1".into());
        }
        if concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if connections == 0 || connections > concurrency {
            return Err(format!(
                "--connections must be between 1 and --concurrency ({concurrency})"
            ));
        }
        if !["mem://", "tcp://", "rdma://", "grpc-face://"]
            .iter()
            .any(|s| url.starts_with(s))
        {
            return Err(format!(
                "--url {url:?}: expected mem://name, tcp://host:port, rdma://host:port or grpc-face://"
            ));
        }
        if stream_len.is_some() && !stream {
            return Err("--stream-len needs --stream".into());
        }
        if stream_len == Some(0) {
            return Err("--stream-len must be at least 1".into());
        }
        if stream && size > u32::MAX as u64 {
            return Err("--size: a stream's messages are at most 4 GiB".into());
        }
        if baseline == Some(Baseline::Perftest) && !url.starts_with("rdma://") {
            return Err("--baseline perftest needs an rdma:// URL (it runs on that device)".into());
        }
        if baseline == Some(Baseline::Plaintext) && !(tls && url.starts_with("tcp://")) {
            return Err("--baseline plaintext needs --tls and a tcp:// URL".into());
        }
        if tls && url.starts_with("mem://") {
            return Err("--tls: mem:// has no TLS".into());
        }
        if tokio && (stream || url.starts_with("grpc-face://")) {
            return Err("--tokio: for our unary calls only".into());
        }
        Ok(Some(Options {
            url,
            size: size as usize,
            calls,
            concurrency,
            connections,
            warmup: warmup.unwrap_or((calls / 10).max(1)),
            json,
            baseline,
            tuning,
            stream,
            stream_len,
            tls,
            tokio,
        }))
    }

    /// The fabric of the URL: `mem`, `tcp` or `rdma`.
    pub fn fabric(&self) -> &str {
        self.url.split("://").next().unwrap_or("")
    }
}

fn number(name: &str, value: &str) -> Result<u64, String> {
    value
        .parse()
        .map_err(|_| format!("{name} needs a non-negative integer, got {value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Option<Options>, String> {
        Options::parse(s.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn parses_and_rejects() {
        let o = parse(
            "--url tcp://127.0.0.1:0 --size 64 --calls 20000 --concurrency=8 --baseline tonic",
        )
        .unwrap()
        .unwrap();
        assert_eq!(o.size, 64);
        assert_eq!(o.calls, 20000);
        assert_eq!(o.concurrency, 8);
        assert_eq!(o.connections, 1);
        assert_eq!(o.warmup, 2000);
        assert_eq!(o.baseline, Some(Baseline::Tonic));
        assert_eq!(o.fabric(), "tcp");
        assert_eq!(parse("--help").unwrap(), None);
        for bad in [
            "",
            "--url mem://a --size 64 --calls 10",
            "--url mem://a --size x --calls 10 --concurrency 1",
            "--url mem://a --size 64 --calls 0 --concurrency 1",
            "--url mem://a --size 64 --calls 10 --concurrency 0",
            "--url mem://a --size 64 --calls 10 --concurrency 2 --connections 3",
            "--url mem://a --size 64 --calls 10 --concurrency 1 --baseline grpc",
            "--url mem://a --size 64 --calls 10 --concurrency 1 --baseline perftest",
            "--url http://a --size 64 --calls 10 --concurrency 1",
            "--url mem://a --size 64 --calls 10 --concurrency 1 --bogus",
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn parses_stream_mode() {
        let o = parse("--stream --url tcp://127.0.0.1:0 --size 1024 --calls 1000 --baseline tonic")
            .unwrap()
            .unwrap();
        assert!(o.stream);
        assert_eq!((o.concurrency, o.stream_len, o.warmup), (1, None, 100));
        let o = parse("--url mem://a --size 64 --calls 10 --stream --concurrency 4 --stream-len=5")
            .unwrap()
            .unwrap();
        assert_eq!((o.concurrency, o.stream_len), (4, Some(5)));
        assert!(
            !parse("--url mem://a --size 64 --calls 10 --concurrency 1")
                .unwrap()
                .unwrap()
                .stream
        );
        for bad in [
            "--stream=yes --url mem://a --size 64 --calls 10",
            "--url mem://a --size 64 --calls 10 --concurrency 1 --stream-len 5",
            "--stream --url mem://a --size 64 --calls 10 --stream-len 0",
            "--stream --url mem://a --size 5000000000 --calls 10",
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }
}
