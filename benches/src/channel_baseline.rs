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

use crate::measure::{Bench, Kind, Measurement, Params, Tally, interleave};
use crate::payload;
use crossbeam_channel::bounded;
use std::time::{Duration, Instant};

/// The ping-pong as a [`Bench`]: each round runs on two fresh threads.
#[derive(Debug, Clone)]
pub struct ChannelBench {
    size: usize,
    window: usize,
}

impl ChannelBench {
    /// The ping-pong for `params`' size and concurrency.
    pub fn new(params: &Params) -> ChannelBench {
        ChannelBench {
            size: params.size,
            window: params.concurrency,
        }
    }

    /// What the records call it.
    pub fn url(&self) -> String {
        format!("channel://crossbeam?threads=2&window={}", self.window)
    }
}

impl Bench for ChannelBench {
    fn round(&mut self, first: u64, calls: u64) -> (Tally, Duration) {
        ping_pong(self.size, first, calls, self.window)
    }
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
