//! The entries of a soft completion queue: a lock-free ring of slots that
//! the producers (whoever posts a write to a queue pair of this queue, or
//! reads its sockets) fill and the poller drains, with an overflow list for
//! bursts the ring cannot hold.
//!
//! A spinning poller looks at one slot, the next one due; a push writes one
//! slot and publishes it with its sequence number (Vyukov's bounded queue).
//! A hand-off between a producer and the poller therefore moves the one
//! cache line of that slot, not a lock's, a counter's and a buffer's.
//!
//! Order: entries that one thread pushes come out in the order it pushed
//! them, overflow or not. Once a push finds the ring full it sets
//! `overflowed`, and from then on every push that sees the flag goes to
//! the overflow list until the poller has drained both (a push that read
//! the flag just before it was set may still land in the ring: it is
//! concurrent with the list's entries, so neither order is wrong). The
//! poller takes from the list only when every slot claimed in the ring has
//! been taken, so nothing a thread pushed into the ring before it pushed
//! into the list is overtaken.
//!
//! Sleeping: a poller may sleep when [`EntryQueue::is_empty`] says so.
//! That is true when the slot due next is not published, even if entries
//! wait behind it (in later slots or in the list): the producer that
//! claimed that slot is between its claim and its publication, which
//! cannot fail, and after publishing it looks for sleepers and wakes them.

use super::Line;
use crate::fabric::{Completion, CompletionKind, WcStatus};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Slots in the ring (a power of two).
const CAPACITY: usize = 1024;

struct Slot {
    /// `pos + 1` when the entry for position `pos` is in the slot,
    /// `pos` when the slot is free for position `pos`.
    seq: AtomicUsize,
    /// The entry, as [`encode`] packs it: written by the one producer that
    /// claimed the slot before it publishes `seq`, read by the one poller
    /// that took it after it saw `seq` (so plain relaxed loads and stores).
    entry: [AtomicU64; 4],
}

/// `Completion` in four words: `wr_id`; `qp_num`, the kind and the status
/// tag; the immediate and byte count; the status's code.
fn encode(c: &Completion) -> [u64; 4] {
    let (kind, imm) = match c.kind {
        CompletionKind::Send => (0u64, 0u64),
        CompletionKind::Read => (1, 0),
        CompletionKind::RecvImm { imm, byte_len } => {
            (2, u64::from(imm) | u64::from(byte_len) << 32)
        }
    };
    let (status, code) = match c.status {
        WcStatus::Success => (0u64, 0u32),
        WcStatus::RemoteAccess => (1, 0),
        WcStatus::RnrRetryExceeded => (2, 0),
        WcStatus::RetryExceeded => (3, 0),
        WcStatus::Flushed => (4, 0),
        WcStatus::DeviceError { event } => (5, event),
        WcStatus::Other { vendor } => (6, vendor),
    };
    [
        c.wr_id,
        u64::from(c.qp_num) | kind << 32 | status << 40,
        imm,
        u64::from(code),
    ]
}

/// The inverse of [`encode`].
fn decode(w: [u64; 4]) -> Completion {
    let kind = match (w[1] >> 32) & 0xff {
        0 => CompletionKind::Send,
        1 => CompletionKind::Read,
        _ => CompletionKind::RecvImm {
            imm: w[2] as u32,
            byte_len: (w[2] >> 32) as u32,
        },
    };
    let code = w[3] as u32;
    let status = match (w[1] >> 40) & 0xff {
        0 => WcStatus::Success,
        1 => WcStatus::RemoteAccess,
        2 => WcStatus::RnrRetryExceeded,
        3 => WcStatus::RetryExceeded,
        4 => WcStatus::Flushed,
        5 => WcStatus::DeviceError { event: code },
        _ => WcStatus::Other { vendor: code },
    };
    Completion {
        wr_id: w[0],
        qp_num: w[1] as u32,
        kind,
        status,
    }
}

/// A multi-producer queue of completions; see the module docs.
pub(super) struct EntryQueue {
    slots: Box<[Slot]>,
    /// The next position to take.
    head: Line<AtomicUsize>,
    /// The next position to claim.
    tail: Line<AtomicUsize>,
    /// Set while `overflow` may hold entries: pushes go there.
    overflowed: Line<AtomicBool>,
    overflow: Mutex<VecDeque<Completion>>,
}

impl EntryQueue {
    pub(super) fn new() -> EntryQueue {
        EntryQueue {
            slots: (0..CAPACITY)
                .map(|i| Slot {
                    seq: AtomicUsize::new(i),
                    entry: Default::default(),
                })
                .collect(),
            head: Line(AtomicUsize::new(0)),
            tail: Line(AtomicUsize::new(0)),
            overflowed: Line(AtomicBool::new(false)),
            overflow: Mutex::new(VecDeque::new()),
        }
    }

    /// Adds `c` behind everything this thread pushed before.
    pub(super) fn push(&self, c: Completion) {
        if !self.overflowed.load(Ordering::Acquire) && self.push_ring(c) {
            return;
        }
        let mut list = self.overflow.lock().unwrap_or_else(|e| e.into_inner());
        // The poller clears the flag under this lock once both are drained:
        // if it did since the check above, the ring is the place again.
        if !self.overflowed.load(Ordering::Acquire) && self.push_ring(c) {
            return;
        }
        self.overflowed.store(true, Ordering::Release);
        list.push_back(c);
    }

    /// Claims a slot and publishes `c` in it; false if the ring is full.
    fn push_ring(&self, c: Completion) -> bool {
        let mut pos = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos % CAPACITY];
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos) as isize {
                0 => match self.tail.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // Position `pos` is this thread's, and its slot free
                        // (`seq == pos`, seen with Acquire after the poller
                        // handed it back): nobody reads the words until the
                        // store below publishes them.
                        for (word, value) in slot.entry.iter().zip(encode(&c)) {
                            word.store(value, Ordering::Relaxed);
                        }
                        slot.seq.store(pos.wrapping_add(1), Ordering::Release);
                        return true;
                    }
                    Err(now) => pos = now,
                },
                // The slot still holds the entry of `pos - CAPACITY`: full.
                d if d < 0 => return false,
                // Another producer took `pos`: try the newest tail.
                _ => pos = self.tail.load(Ordering::Relaxed),
            }
        }
    }

    /// Takes the next entry of the ring, if it has been published.
    fn pop_ring(&self) -> Option<Completion> {
        let mut pos = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos % CAPACITY];
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos.wrapping_add(1)) as isize {
                0 => match self.head.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // `seq == pos + 1`, seen with Acquire: the producer
                        // of `pos` wrote the words before it published them,
                        // and the compare-exchange gave `pos` to this thread.
                        let c = decode(std::array::from_fn(|i| {
                            slot.entry[i].load(Ordering::Relaxed)
                        }));
                        slot.seq
                            .store(pos.wrapping_add(CAPACITY), Ordering::Release);
                        return Some(c);
                    }
                    Err(now) => pos = now,
                },
                // Not published yet (or never claimed): nothing to take.
                d if d < 0 => return None,
                _ => pos = self.head.load(Ordering::Relaxed),
            }
        }
    }

    /// Moves up to `max` published entries of the ring to `out`.
    fn drain_ring(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(c) = self.pop_ring() else { break };
            out.push(c);
            n += 1;
        }
        n
    }

    /// Moves up to `max` entries to `out`, oldest first; returns how many.
    pub(super) fn pop_into(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut n = self.drain_ring(out, max);
        if n == max || !self.overflowed.load(Ordering::Acquire) {
            return n;
        }
        let mut list = self.overflow.lock().unwrap_or_else(|e| e.into_inner());
        // Entries a thread published in the ring before it pushed to the
        // list (under this lock) are visible now: take them first.
        n += self.drain_ring(out, max - n);
        // A slot claimed and not yet published holds back the slots behind
        // it, and one of those may hold an entry older than the list's
        // from the same thread: leave the list until the ring is empty.
        if n == max || self.head.load(Ordering::Relaxed) != self.tail.load(Ordering::Acquire) {
            return n;
        }
        let take = list.len().min(max - n);
        out.extend(list.drain(..take));
        n += take;
        if list.is_empty() {
            self.overflowed.store(false, Ordering::Release);
        }
        n
    }

    /// True if nothing can be taken now: the slot due next is not
    /// published, and the overflow list is empty or held back by a slot
    /// claimed and not yet published (whose producer wakes sleepers once
    /// it publishes; see the module docs).
    pub(super) fn is_empty(&self) -> bool {
        self.empty_from(self.head.load(Ordering::Relaxed))
    }

    /// [`EntryQueue::is_empty`], starting from a reading of `head` that
    /// another poller may have made stale meanwhile.
    fn empty_from(&self, mut pos: usize) -> bool {
        loop {
            let seq = self.slots[pos % CAPACITY].seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos.wrapping_add(1)) as isize {
                0 => return false,
                d if d < 0 => {
                    return !self.overflowed.load(Ordering::Acquire)
                        || self.tail.load(Ordering::Acquire) != pos;
                }
                // Taken by another poller since `pos` was read: the slot
                // says nothing about the entries after it. Look again.
                _ => pos = self.head.load(Ordering::Relaxed),
            }
        }
    }

    /// Entries in the ring and the list (a snapshot, for debugging).
    pub(super) fn len(&self) -> usize {
        let head = self.head.load(Ordering::Relaxed);
        let ring = self.tail.load(Ordering::Relaxed).saturating_sub(head);
        let list = self.overflow.lock().map(|l| l.len()).unwrap_or(0);
        ring + list
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(thread: u32, i: u64) -> Completion {
        Completion {
            wr_id: i,
            qp_num: thread,
            kind: CompletionKind::Send,
            status: WcStatus::Success,
        }
    }

    #[test]
    fn keeps_each_threads_order_through_overflow() {
        const THREADS: u32 = 4;
        const EACH: u64 = 200_000;
        let q = Arc::new(EntryQueue::new());
        let producers: Vec<_> = (0..THREADS)
            .map(|t| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        q.push(entry(t, i));
                        if i % 5000 == 0 {
                            // Let the ring fill up now and then.
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u64; THREADS as usize];
        let mut out = Vec::new();
        let mut got = 0;
        let mut overflowed = false;
        while got < THREADS as u64 * EACH {
            out.clear();
            overflowed |= q.overflowed.load(Ordering::Relaxed);
            // Sometimes let the producers run ahead so the ring overflows.
            if got % 100_000 < 10 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let n = q.pop_into(&mut out, 64);
            for c in &out[..n] {
                let t = c.qp_num as usize;
                assert_eq!(c.wr_id, next[t], "thread {t}'s entries out of order");
                next[t] += 1;
            }
            got += n as u64;
        }
        for p in producers {
            p.join().unwrap();
        }
        assert!(q.is_empty());
        assert_eq!(q.len(), 0);
        assert!(overflowed, "the test never filled the ring");
    }

    #[test]
    fn entries_keep_every_field() {
        let statuses = [
            WcStatus::Success,
            WcStatus::RemoteAccess,
            WcStatus::RnrRetryExceeded,
            WcStatus::RetryExceeded,
            WcStatus::Flushed,
            WcStatus::DeviceError { event: u32::MAX },
            WcStatus::Other {
                vendor: 0xdead_beef,
            },
        ];
        let kinds = [
            CompletionKind::Send,
            CompletionKind::Read,
            CompletionKind::RecvImm {
                imm: u32::MAX,
                byte_len: 0x8000_0001,
            },
        ];
        for status in statuses {
            for kind in kinds {
                let c = Completion {
                    wr_id: u64::MAX - 3,
                    qp_num: u32::MAX,
                    kind,
                    status,
                };
                assert_eq!(decode(encode(&c)), c);
            }
        }
    }

    /// A slot taken by another poller between the reading of `head` and
    /// the look at its slot must not hide the entries after it (a poller
    /// would sleep with entries queued and no push left to wake it).
    #[test]
    fn a_stale_head_does_not_hide_entries() {
        let q = EntryQueue::new();
        q.push(entry(0, 0));
        q.push(entry(0, 1));
        let mut out = Vec::new();
        assert_eq!(q.pop_into(&mut out, 1), 1);
        assert!(!q.empty_from(0), "entry 1 is queued");
        assert_eq!(q.pop_into(&mut out, 1), 1);
        assert!(q.empty_from(0) && q.empty_from(1) && q.is_empty());
    }

    #[test]
    fn a_full_ring_spills_and_drains_in_order() {
        let q = EntryQueue::new();
        for i in 0..(CAPACITY as u64 * 3) {
            q.push(entry(0, i));
        }
        assert!(q.overflowed.load(Ordering::Relaxed));
        let mut out = Vec::new();
        let mut next = 0;
        while !q.is_empty() {
            out.clear();
            q.pop_into(&mut out, 100);
            for c in &out {
                assert_eq!(c.wr_id, next);
                next += 1;
            }
        }
        assert_eq!(next, CAPACITY as u64 * 3);
        assert!(!q.overflowed.load(Ordering::Relaxed));
        // The ring is the place again.
        q.push(entry(0, 7));
        assert!(!q.overflowed.load(Ordering::Relaxed));
        out.clear();
        assert_eq!(q.pop_into(&mut out, 10), 1);
        assert_eq!(out[0].wr_id, 7);
    }
}
