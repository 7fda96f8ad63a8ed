//! The call table: in-flight calls keyed by id + generation.
//!
//! A [`CallId`] is a slab index and a generation. A response whose id does
//! not match a live entry (late after a timeout, duplicated, or forged) is
//! dropped and counted in [`CallTable::stale`], never handed to whichever
//! call now occupies the slot. Deadlines are kept in order (calls of one
//! timeout in a queue, any earlier one in a min-heap); time is passed in,
//! never read.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use slab::Slab;

/// Identifies one call on one connection: slab index (low 32 bits) and
/// generation (high 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

impl CallId {
    /// Builds from parts.
    pub fn new(index: u32, generation: u32) -> CallId {
        CallId(((generation as u64) << 32) | index as u64)
    }

    /// The slab index.
    pub fn index(self) -> u32 {
        self.0 as u32
    }

    /// The generation.
    pub fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// In-flight calls, each holding a `T` (the waiter).
///
/// Generations come from one wrapping counter per table, so an id is not
/// reused until 2^32 more calls have been inserted. Deadline entries also
/// carry the deadline, and count only if the live entry still has it.
#[derive(Debug)]
pub struct CallTable<T> {
    entries: Slab<Entry<T>>,
    /// Deadlines of calls, possibly including completed ones (skipped lazily).
    deadlines: Deadlines,
    /// Live entries that have a deadline (the live part of `deadlines`).
    timed: usize,
    next_generation: u32,
    stale: u64,
}

#[derive(Debug)]
struct Entry<T> {
    generation: u32,
    deadline: Option<Instant>,
    value: T,
}

/// Dead deadline entries tolerated beyond the live ones before compacting.
const HEAP_SLACK: usize = 64;

/// A min-queue of deadlines. Calls made with one timeout arrive in
/// deadline order: those go to the back of a run kept in order, in O(1),
/// and only a deadline earlier than the last one goes to a heap.
#[derive(Debug, Default)]
struct Deadlines {
    in_order: VecDeque<(Instant, CallId)>,
    heap: BinaryHeap<Reverse<(Instant, CallId)>>,
}

impl Deadlines {
    fn push(&mut self, entry: (Instant, CallId)) {
        match self.in_order.back() {
            Some(last) if *last > entry => self.heap.push(Reverse(entry)),
            _ => self.in_order.push_back(entry),
        }
    }

    /// The earliest entry, and whether it is in the heap.
    fn first(&self) -> Option<((Instant, CallId), bool)> {
        match (self.in_order.front(), self.heap.peek()) {
            (Some(a), Some(Reverse(b))) if b < a => Some((*b, true)),
            (Some(a), _) => Some((*a, false)),
            (None, Some(Reverse(b))) => Some((*b, true)),
            (None, None) => None,
        }
    }

    fn peek(&self) -> Option<(Instant, CallId)> {
        self.first().map(|(entry, _)| entry)
    }

    fn pop(&mut self) -> Option<(Instant, CallId)> {
        match self.first()? {
            (_, true) => self.heap.pop().map(|Reverse(entry)| entry),
            (_, false) => self.in_order.pop_front(),
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&(Instant, CallId)) -> bool) {
        self.in_order.retain(&mut keep);
        self.heap.retain(|Reverse(entry)| keep(entry));
    }

    fn len(&self) -> usize {
        self.in_order.len() + self.heap.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[cfg(any(test, feature = "testing"))]
    fn clear(&mut self) {
        self.in_order.clear();
        self.heap.clear();
    }
}

fn is_live<T>(entries: &Slab<Entry<T>>, deadline: Instant, id: CallId) -> bool {
    entries
        .get(id.index() as usize)
        .is_some_and(|e| e.generation == id.generation() && e.deadline == Some(deadline))
}

impl<T> Default for CallTable<T> {
    fn default() -> Self {
        CallTable::new()
    }
}

impl<T> CallTable<T> {
    /// An empty table.
    pub fn new() -> CallTable<T> {
        CallTable {
            entries: Slab::new(),
            deadlines: Deadlines::default(),
            timed: 0,
            next_generation: 0,
            stale: 0,
        }
    }

    /// Adds a call, optionally with a deadline; returns its id.
    ///
    /// # Panics
    ///
    /// If more than 2^32 calls are live at once.
    pub fn insert(&mut self, value: T, deadline: Option<Instant>) -> CallId {
        let generation = self.next_generation;
        self.next_generation = generation.wrapping_add(1);
        let entry = self.entries.vacant_entry();
        let index = u32::try_from(entry.key()).expect("more than 2^32 live calls");
        entry.insert(Entry {
            generation,
            deadline,
            value,
        });
        let id = CallId::new(index, generation);
        if let Some(deadline) = deadline {
            self.deadlines.push((deadline, id));
            self.timed += 1;
        }
        id
    }

    /// Removes the live call `id`, keeping the deadlines tidy.
    fn take(&mut self, id: CallId) -> Option<T> {
        if !self.contains(id) {
            return None;
        }
        let index = id.index() as usize;
        let entry = self.entries.remove(index);
        if entry.deadline.is_some() {
            self.timed -= 1;
            self.prune();
        }
        Some(entry.value)
    }

    /// Drops dead entries from the front of the deadlines, and compacts
    /// them when dead entries behind live ones pile up.
    fn prune(&mut self) {
        while let Some((deadline, id)) = self.deadlines.peek() {
            if is_live(&self.entries, deadline, id) {
                break;
            }
            self.deadlines.pop();
        }
        if self.deadlines.len() > 2 * self.timed + HEAP_SLACK {
            let entries = &self.entries;
            self.deadlines
                .retain(|&(deadline, id)| is_live(entries, deadline, id));
        }
    }

    /// Removes and returns the call `id` if it is live (index and generation
    /// match). Otherwise counts a stale id and returns `None`.
    pub fn complete(&mut self, id: CallId) -> Option<T> {
        let value = self.take(id);
        if value.is_none() {
            self.stale += 1;
        }
        value
    }

    /// Like [`CallTable::complete`] but does not count a miss as stale (for
    /// local cancellation, which may race with completion).
    pub fn remove(&mut self, id: CallId) -> Option<T> {
        self.take(id)
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: CallId) -> bool {
        self.entries
            .get(id.index() as usize)
            .is_some_and(|e| e.generation == id.generation())
    }

    /// The live call `id`, mutably.
    pub fn get_mut(&mut self, id: CallId) -> Option<&mut T> {
        self.entries
            .get_mut(id.index() as usize)
            .filter(|e| e.generation == id.generation())
            .map(|e| &mut e.value)
    }

    /// Removes and returns one call whose deadline is at or before `now`.
    /// Call repeatedly until `None`. Entries of completed calls left among
    /// the deadlines are skipped lazily.
    ///
    /// Calls expire in deadline order (ties by id).
    pub fn pop_expired(&mut self, now: Instant) -> Option<(CallId, T)> {
        while let Some((deadline, id)) = self.deadlines.peek() {
            if !is_live(&self.entries, deadline, id) {
                self.deadlines.pop();
                continue;
            }
            if deadline > now {
                return None;
            }
            self.deadlines.pop();
            let entry = self.entries.remove(id.index() as usize);
            self.timed -= 1;
            self.prune();
            return Some((id, entry.value));
        }
        None
    }

    /// The earliest deadline among live calls (may be one of an already
    /// completed call until lazily skipped; callers just wake early).
    ///
    /// This table drops dead entries from the front of its deadlines
    /// whenever a call leaves it, so in practice the answer is exact.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.peek().map(|(deadline, _)| deadline)
    }

    /// Removes every live call (for a connection that failed), in index order.
    #[cfg(any(test, feature = "testing"))]
    pub fn drain(&mut self) -> Vec<(CallId, T)> {
        self.deadlines.clear();
        self.timed = 0;
        std::mem::take(&mut self.entries)
            .into_iter()
            .map(|(index, e)| (CallId::new(index as u32, e.generation), e.value))
            .collect()
    }

    /// Removes every live call whose value satisfies `pred` (for one
    /// connection that failed, of several sharing the table), in index order.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<(CallId, T)> {
        let ids: Vec<CallId> = self
            .entries
            .iter()
            .filter(|(_, e)| pred(&e.value))
            .map(|(index, e)| CallId::new(index as u32, e.generation))
            .collect();
        ids.into_iter()
            .filter_map(|id| self.take(id).map(|v| (id, v)))
            .collect()
    }

    /// Live calls.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no call is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Responses dropped because their id was not live.
    #[cfg(any(test, feature = "testing"))]
    pub fn stale(&self) -> u64 {
        self.stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn call_id_parts() {
        let id = CallId::new(7, 0xdead_beef);
        assert_eq!(id.index(), 7);
        assert_eq!(id.generation(), 0xdead_beef);
        assert_eq!(id.0, 0xdead_beef_0000_0007);
        let max = CallId::new(u32::MAX, u32::MAX);
        assert_eq!((max.index(), max.generation()), (u32::MAX, u32::MAX));
    }

    #[test]
    fn insert_complete() {
        let mut t = CallTable::new();
        assert!(t.is_empty());
        let a = t.insert("a", None);
        let b = t.insert("b", None);
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert!(t.contains(a) && t.contains(b));
        *t.get_mut(b).unwrap() = "b2";
        assert_eq!(t.complete(b), Some("b2"));
        assert!(!t.contains(b));
        assert_eq!(t.complete(a), Some("a"));
        assert!(t.is_empty());
        assert_eq!(t.stale(), 0);
    }

    #[test]
    fn stale_ids_are_counted_and_never_misdelivered() {
        let mut t = CallTable::new();
        let old = t.insert(1, None);
        assert_eq!(t.remove(old), Some(1));
        // Completing after removal (late response): None, counted.
        assert_eq!(t.complete(old), None);
        assert_eq!(t.stale(), 1);
        // The slot is reused with a different generation.
        let new = t.insert(2, None);
        assert_eq!(new.index(), old.index());
        assert_ne!(new.generation(), old.generation());
        assert_ne!(new, old);
        assert!(!t.contains(old));
        assert!(t.get_mut(old).is_none());
        assert_eq!(t.complete(old), None, "must not reach the new call");
        assert_eq!(t.stale(), 2);
        assert!(t.contains(new));
        // A duplicate completion is stale too.
        assert_eq!(t.complete(new), Some(2));
        assert_eq!(t.complete(new), None);
        assert_eq!(t.stale(), 3);
        // A forged id: unknown index.
        assert_eq!(t.complete(CallId::new(999, 0)), None);
        assert_eq!(t.stale(), 4);
    }

    #[test]
    fn remove_does_not_count_stale() {
        let mut t = CallTable::new();
        let id = t.insert((), None);
        assert_eq!(t.remove(id), Some(()));
        assert_eq!(t.remove(id), None);
        assert_eq!(t.remove(CallId::new(5, 5)), None);
        assert_eq!(t.stale(), 0);
    }

    #[test]
    fn generations_differ_across_many_reuses() {
        let mut t = CallTable::new();
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000 {
            let id = t.insert(i, None);
            assert_eq!(id.index(), 0);
            assert!(seen.insert(id));
            assert_eq!(t.complete(id), Some(i));
        }
    }

    #[test]
    fn generation_counter_wraps() {
        let mut t = CallTable::new();
        t.next_generation = u32::MAX;
        let a = t.insert('a', None);
        assert_eq!(a.generation(), u32::MAX);
        t.remove(a);
        let b = t.insert('b', None);
        assert_eq!(b.generation(), 0);
        assert_eq!(b.index(), a.index());
        assert_eq!(t.complete(a), None);
        assert_eq!(t.complete(b), Some('b'));
    }

    #[test]
    fn deadlines_expire_in_order() {
        let base = Instant::now();
        let mut t = CallTable::new();
        let c3 = t.insert(3, Some(at(base, 30)));
        let c1 = t.insert(1, Some(at(base, 10)));
        let none = t.insert(0, None);
        let c2 = t.insert(2, Some(at(base, 20)));
        assert_eq!(t.next_deadline(), Some(at(base, 10)));
        assert_eq!(t.pop_expired(at(base, 9)), None);
        assert_eq!(t.len(), 4);
        // Deadline equal to now expires.
        assert_eq!(t.pop_expired(at(base, 10)), Some((c1, 1)));
        assert_eq!(t.pop_expired(at(base, 10)), None);
        assert_eq!(t.next_deadline(), Some(at(base, 20)));
        assert_eq!(t.pop_expired(at(base, 100)), Some((c2, 2)));
        assert_eq!(t.pop_expired(at(base, 100)), Some((c3, 3)));
        assert_eq!(t.pop_expired(at(base, 100)), None);
        assert_eq!(t.next_deadline(), None);
        // Expired calls are gone; the call without a deadline stays.
        assert!(!t.contains(c1) && !t.contains(c2) && !t.contains(c3));
        assert_eq!(t.complete(c1), None);
        assert_eq!(t.len(), 1);
        assert_eq!(t.complete(none), Some(0));
    }

    #[test]
    fn mixed_runs_of_deadlines_expire_in_order() {
        // Runs of rising deadlines (calls of one timeout) mixed with earlier
        // ones (a shorter timeout), and calls completing on the way: what
        // expires comes in deadline order and is exactly the live calls.
        let base = Instant::now();
        let mut t = CallTable::new();
        let mut live = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for i in 0..2_000u64 {
            let ms = if rand(4) == 0 { rand(1_000) } else { 1_000 + i };
            let id = t.insert(i, Some(at(base, ms)));
            live.push((at(base, ms), id, i));
            if rand(3) == 0 {
                let (_, id, v) = live.swap_remove(rand(live.len() as u64) as usize);
                assert_eq!(t.complete(id), Some(v));
            }
        }
        live.sort();
        assert_eq!(t.next_deadline(), live.first().map(|e| e.0));
        let mut expired = Vec::new();
        while let Some((id, v)) = t.pop_expired(at(base, 10_000)) {
            expired.push((id, v));
        }
        let want: Vec<_> = live.iter().map(|&(_, id, v)| (id, v)).collect();
        assert_eq!(expired, want);
        assert!(t.deadlines.is_empty());
    }

    #[test]
    fn completed_calls_do_not_expire() {
        let base = Instant::now();
        let mut t = CallTable::new();
        let a = t.insert('a', Some(at(base, 1)));
        let b = t.insert('b', Some(at(base, 2)));
        let c = t.insert('c', Some(at(base, 3)));
        assert_eq!(t.complete(a), Some('a'));
        // The dead top is pruned when the call leaves.
        assert_eq!(t.next_deadline(), Some(at(base, 2)));
        assert_eq!(t.remove(c), Some('c'));
        assert_eq!(t.next_deadline(), Some(at(base, 2)));
        assert_eq!(t.pop_expired(at(base, 10)), Some((b, 'b')));
        assert_eq!(t.pop_expired(at(base, 10)), None);
        assert_eq!(t.next_deadline(), None);
        assert!(t.deadlines.is_empty());
    }

    #[test]
    fn reused_slot_does_not_inherit_old_deadline() {
        let base = Instant::now();
        let mut t = CallTable::new();
        let keep = t.insert("keep", Some(at(base, 1)));
        let old = t.insert("old", Some(at(base, 5)));
        t.remove(old);
        // The old entry is buried below a live one, so it is still in the heap.
        assert_eq!(t.deadlines.len(), 2);
        let new = t.insert("new", Some(at(base, 50)));
        assert_eq!(new.index(), old.index());
        assert_eq!(t.pop_expired(at(base, 10)), Some((keep, "keep")));
        assert_eq!(
            t.pop_expired(at(base, 10)),
            None,
            "the old deadline is not the new call's"
        );
        assert!(t.contains(new));
        assert_eq!(t.next_deadline(), Some(at(base, 50)));
        assert_eq!(t.pop_expired(at(base, 50)), Some((new, "new")));
    }

    #[test]
    fn dead_heap_entries_are_compacted() {
        let base = Instant::now();
        let mut t = CallTable::new();
        // An early live deadline pins the heap top; everything else completes.
        let pin = t.insert(0, Some(at(base, 0)));
        for i in 1..10_000u64 {
            let id = t.insert(i, Some(at(base, i)));
            assert_eq!(t.complete(id), Some(i));
            assert!(t.deadlines.len() <= 2 * t.len() + HEAP_SLACK + 1);
        }
        assert_eq!(t.len(), 1);
        assert_eq!(t.next_deadline(), Some(at(base, 0)));
        assert_eq!(t.pop_expired(at(base, 1_000_000)), Some((pin, 0)));
        assert_eq!(t.pop_expired(at(base, 1_000_000)), None);
        assert!(t.deadlines.is_empty());
    }

    #[test]
    fn drain_empties_everything() {
        let base = Instant::now();
        let mut t = CallTable::new();
        let a = t.insert('a', Some(at(base, 5)));
        let b = t.insert('b', None);
        let c = t.insert('c', Some(at(base, 1)));
        t.remove(b);
        let mut drained = t.drain();
        drained.sort();
        assert_eq!(drained, vec![(a, 'a'), (c, 'c')]);
        assert!(t.is_empty());
        assert_eq!(t.next_deadline(), None);
        assert_eq!(t.pop_expired(at(base, 100)), None);
        assert!(!t.contains(a) && !t.contains(c));
        assert_eq!(t.complete(a), None);
        assert_eq!(t.stale(), 1);
        // The table stays usable, with fresh ids.
        let d = t.insert('d', Some(at(base, 2)));
        assert!(d != a && d != b && d != c);
        assert_eq!(t.pop_expired(at(base, 2)), Some((d, 'd')));
        assert!(t.drain().is_empty());
    }
}
