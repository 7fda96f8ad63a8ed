//! The in-process floor for `mem://`: a ping-pong between two threads over
//! crossbeam channels, with the same payloads, calls and concurrency.
//!
//! The client thread keeps `concurrency` requests outstanding (a closed
//! loop, like the lanes of [`crate::rpc::drive`], on one thread); the
//! server thread copies each request's payload into a fresh buffer, as our
//! server copies a frame out of its ring, and sends it back; the client
//! copies the reply into a fresh buffer too, as our client does. What is
//! left out is everything the framework adds: framing, protobuf, the rings,
//! credits, the call table, the poller and worker hand-offs.
//!
//! In stream mode each stream is a producer thread that sends the stream's
//! payloads ([`StreamPayloads`], as our echo server makes them) into a
//! bounded channel, and its lane reads and checks them as
//! [`crate::rpc::drive_streams`] does ([`Consumer`]); lanes are threads.

use crate::measure::{Bench, Kind, Measurement, Mode, Params, Tally, interleave};
use crate::payload;
use crate::stream::{Chunks, Consumer};
use crossbeam_channel::bounded;
use examples::services::StreamPayloads;
use std::time::{Duration, Instant};

/// Payloads a stream's channel holds: about what our default stream
/// window (256 KiB) holds of 64-byte messages.
const STREAM_CHANNEL: usize = 4096;

/// The ping-pong (or the streams) as a [`Bench`]: each round runs on fresh
/// threads.
#[derive(Debug, Clone)]
pub struct ChannelBench {
    size: usize,
    window: usize,
    mode: Mode,
    stream_len: Option<u64>,
}

impl ChannelBench {
    /// The ping-pong (or streams) for `params`' mode, size and concurrency.
    pub fn new(params: &Params) -> ChannelBench {
        ChannelBench {
            size: params.size,
            window: params.concurrency,
            mode: params.mode,
            stream_len: params.stream_len,
        }
    }

    /// What the records call it.
    pub fn url(&self) -> String {
        match self.mode {
            Mode::Unary => format!("channel://crossbeam?threads=2&window={}", self.window),
            Mode::Stream => format!(
                "channel://crossbeam?streams={}&capacity={STREAM_CHANNEL}",
                self.window
            ),
        }
    }
}

impl Bench for ChannelBench {
    fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration) {
        match self.mode {
            Mode::Unary => ping_pong(self.size, first, calls, self.window),
            Mode::Stream => streams(self.size, calls, self.window, self.stream_len),
        }
    }
}

/// Reads `messages` payloads from producer threads, `concurrency` streams
/// at a time, split as [`Chunks`] splits them.
fn streams(
    size: usize,
    messages: u64,
    concurrency: usize,
    stream_len: Option<u64>,
) -> (Tally, Duration) {
    let chunks = Chunks::new(messages, concurrency, stream_len);
    let lane = || {
        let mut tally = Tally::default();
        while let Some(count) = chunks.take() {
            let (tx, rx) = bounded::<Vec<u8>>(STREAM_CHANNEL);
            let mut consumer = Consumer::start(&mut tally, size, count);
            let producer = std::thread::spawn(move || {
                for payload in StreamPayloads::new(count, size) {
                    if tx.send(payload).is_err() {
                        break;
                    }
                }
            });
            for payload in rx {
                consumer.message(&payload);
            }
            let outcome = producer
                .join()
                .map_err(|_| "producer thread panicked".to_owned());
            consumer.end(outcome);
        }
        tally
    };
    let start = Instant::now();
    let mut tally = Tally::default();
    std::thread::scope(|s| {
        let lanes: Vec<_> = (0..concurrency.max(1)).map(|_| s.spawn(lane)).collect();
        for l in lanes {
            tally.merge(l.join().expect("lane panicked"));
        }
    });
    (tally, start.elapsed())
}

/// Runs the ping-pong alone: warm-up, then the measured calls in one round.
pub fn run(params: Params) -> Measurement {
    let mut bench = ChannelBench::new(&params);
    let (totals, _) = interleave(&mut bench, None, &params, 1);
    Measurement::from_totals(Kind::Channel, "mem", bench.url(), params, &totals)
}

/// A request or reply: which window slot, which call, the payload.
type Msg = (usize, u64, Vec<u8>);

fn ping_pong(size: usize, first: u64, calls: u64, window: usize) -> (Tally, Duration) {
    let window = window.max(1);
    let (to_server, server_rx) = bounded::<Msg>(window);
    let (to_client, client_rx) = bounded::<Msg>(window);
    let server = std::thread::spawn(move || {
        for (slot, seq, payload) in server_rx {
            let echo = payload.to_vec();
            drop(payload);
            if to_client.send((slot, seq, echo)).is_err() {
                break;
            }
        }
    });
    let mut tally = Tally::default();
    let mut started = vec![Instant::now(); window];
    let end = first + calls;
    let mut next = first;
    let start = Instant::now();
    let send = |slot: usize, next: &mut u64, started: &mut [Instant]| {
        if *next < end {
            let p = payload::make(size, *next);
            started[slot] = Instant::now();
            to_server
                .send((slot, *next, p))
                .expect("server thread alive");
            *next += 1;
        }
    };
    for slot in 0..window {
        send(slot, &mut next, &mut started);
    }
    for _ in 0..calls {
        let (slot, seq, echo) = client_rx.recv().expect("server thread alive");
        let got = echo.to_vec();
        let latency = started[slot].elapsed();
        drop(echo);
        tally.record(latency, payload::check(&got, size, seq));
        send(slot, &mut next, &mut started);
    }
    let elapsed = start.elapsed();
    drop(to_server);
    server.join().expect("server thread panicked");
    (tally, elapsed)
}
