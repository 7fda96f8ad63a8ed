//! What the stream mode (`rpc-bench --stream`) shares between our run and
//! tonic's: how a round's messages are split into streams, and how each
//! stream's messages are checked and timed.
//!
//! A round of N messages at concurrency C is C lanes, each opening echo
//! `Stream` calls one after the other and reading them to the end, until
//! the round's N messages have been asked for: each call asks for
//! `stream_len` messages, or by default ⌈N / C⌉, so that each lane reads
//! one long stream per round (what is measured is then the streams'
//! steady state, not the set-up of calls). Every message is checked (its
//! length and its index in the stream, see
//! [`examples::services::StreamPayloads`]), and timed: its latency is the
//! gap since its stream's previous message arrived, or, for the first,
//! since the call was issued.

use crate::measure::Tally;
use examples::services::StreamPayloads;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Hands out the messages of a round as streams: lanes take the next
/// stream's length until none are left.
#[derive(Debug)]
pub struct Chunks {
    left: AtomicU64,
    len: u64,
}

impl Chunks {
    /// The `messages` of a round for `concurrency` lanes, `stream_len` per
    /// stream (None: ⌈messages / concurrency⌉).
    pub fn new(messages: u64, concurrency: usize, stream_len: Option<u64>) -> Chunks {
        let len = stream_len
            .unwrap_or_else(|| messages.div_ceil(concurrency.max(1) as u64))
            .max(1);
        Chunks {
            left: AtomicU64::new(messages),
            len,
        }
    }

    /// How many messages the next stream asks for; None once the round's
    /// messages are all handed out.
    pub fn take(&self) -> Option<u64> {
        let mut left = self.left.load(Ordering::Relaxed);
        loop {
            if left == 0 {
                return None;
            }
            let n = left.min(self.len);
            match self.left.compare_exchange_weak(
                left,
                left - n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(n),
                Err(now) => left = now,
            }
        }
    }
}

/// Checks and times the messages of one stream into a [`Tally`]. Start it
/// just before the call is issued.
#[derive(Debug)]
pub struct Consumer<'a> {
    tally: &'a mut Tally,
    size: usize,
    count: u64,
    received: u64,
    last: Instant,
}

impl<'a> Consumer<'a> {
    /// A stream that should bring `count` messages of `size` bytes.
    pub fn start(tally: &'a mut Tally, size: usize, count: u64) -> Consumer<'a> {
        Consumer {
            tally,
            size,
            count,
            received: 0,
            last: Instant::now(),
        }
    }

    /// The stream's next message arrived with this payload.
    pub fn message(&mut self, payload: &[u8]) {
        let now = Instant::now();
        let gap = now - self.last;
        self.last = now;
        let index = self.received;
        self.received += 1;
        let outcome = if index >= self.count {
            Err(format!(
                "stream of {} messages: message {index} is one too many",
                self.count
            ))
        } else if StreamPayloads::matches(payload, self.size, index) {
            Ok(())
        } else {
            Err(format!(
                "stream message {index}: {} bytes, not the {}-byte payload of that index",
                payload.len(),
                self.size
            ))
        };
        self.tally.record(gap, outcome);
    }

    /// The stream ended: cleanly (`Ok`), or with an error. Messages it
    /// never delivered count as failed; an error after all of them counts
    /// once.
    pub fn end(self, outcome: Result<(), String>) {
        let missing = self.count.saturating_sub(self.received);
        let why = |e: Option<String>| {
            let e = e.map_or_else(String::new, |e| format!(": {e}"));
            format!(
                "stream ended after {} of {} messages{e}",
                self.received, self.count
            )
        };
        match outcome {
            Ok(()) => self.tally.record_failures(missing, why(None)),
            Err(e) => self.tally.record_failures(missing.max(1), why(Some(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_a_round() {
        let take_all = |c: &Chunks| std::iter::from_fn(|| c.take()).collect::<Vec<_>>();
        assert_eq!(take_all(&Chunks::new(10, 3, None)), vec![4, 4, 2]);
        assert_eq!(take_all(&Chunks::new(10, 1, None)), vec![10]);
        assert_eq!(take_all(&Chunks::new(10, 2, Some(3))), vec![3, 3, 3, 1]);
        assert_eq!(take_all(&Chunks::new(0, 2, None)), Vec::<u64>::new());
    }

    #[test]
    fn consumer_checks_and_counts() {
        let payloads = |n, size| StreamPayloads::new(n, size).collect::<Vec<_>>();
        let mut t = Tally::default();
        let mut c = Consumer::start(&mut t, 64, 3);
        for p in payloads(3, 64) {
            c.message(&p);
        }
        c.end(Ok(()));
        assert_eq!((t.hist.len(), t.errors), (3, 0));

        // Out of order, short and failed streams.
        let mut t = Tally::default();
        let p = payloads(3, 5);
        let mut c = Consumer::start(&mut t, 5, 3);
        c.message(&p[1]);
        c.end(Err("boom".into()));
        assert_eq!((t.hist.len(), t.errors), (0, 3));
        let mut c = Consumer::start(&mut t, 5, 2);
        c.message(&p[0]);
        c.end(Ok(()));
        assert_eq!((t.hist.len(), t.errors), (1, 4));
        assert!(t.first_error.unwrap().contains("message 0"));
        let mut t = Tally::default();
        let mut c = Consumer::start(&mut t, 5, 1);
        c.message(&p[0]);
        c.message(&p[1]);
        c.end(Err("late".into()));
        assert_eq!((t.hist.len(), t.errors), (1, 2));
    }
}
