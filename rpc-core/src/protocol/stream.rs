//! Streams: flow control per stream, and which frames a stream still
//! accepts. Pure state, like the rest of the protocol.
//!
//! A stream is a call whose messages continue past the first. On the wire
//! it is a `Request` frame (carrying the request message for a
//! server-streaming method, no message otherwise), then `Message` frames in
//! either direction, a `HalfClose` when the client's request stream is
//! complete, and the server's final `Response` (no message, trailing
//! metadata) or `Error`. A `Cancel` from the client ends it early.
//!
//! **Flow control.** Each direction of each stream has a window, in
//! *window bytes*: a message costs its ring footprint ([`message_cost`]), so
//! empty messages count too. The receiver buffers at most about a window per
//! stream, and grants window back (`Window` frames) as the application
//! consumes messages. A consumer that stops reading thus stalls only its own
//! producer: the dispatcher still copies every frame out of the ring at
//! once, so the ring (shared by every call of the connection) never waits
//! for it.
//!
//! Rules (both sides check them; a peer that breaks them closes the
//! connection):
//! - a message costs its footprint, but at most half the window unless it
//!   is above [`PIPELINED_MAX`]: so two messages larger than half the
//!   window can be in flight, and the next one is on its way (a large
//!   one's descriptor sent, its payload ready to be read) while the
//!   consumer takes the one before;
//! - the sender may send a message when its cost is at most `available`,
//!   or when `available >= window / 2` (a message above
//!   [`PIPELINED_MAX`] goes then, alone, never waiting forever);
//! - the receiver grants what was consumed once at least half the window is
//!   owed.
//!
//! No deadlock: a blocked sender has `available < window / 2`, so more than
//! half the window is sent and not granted; once the consumer has consumed
//! it all, at least half the window is owed, so it is granted (in one
//! grant: a message above [`PIPELINED_MAX`] costs at most 2 GiB). What the
//! receiver holds is the window's worth of messages, or two messages larger
//! than half of it, or one above [`PIPELINED_MAX`] after at most half a
//! window's worth (which may be one message of up to [`PIPELINED_MAX`]).
//!
//! **Batches.** One `Message` frame carries one or more messages of the
//! stream; its header's `timeout_us` field says how many ([`Records`]).
//! With one, the payload is the message. With more, the payload is the
//! messages back to back, each after its length as 4 bytes little-endian.
//! A producer gathers what its stream yields at once into one frame (up to
//! [`MAX_BATCH`] bytes), so a stream of small messages costs one header,
//! one window check and one queue operation per batch instead of per
//! message; a producer that yields one message at a time sends each alone,
//! at once. The window counts frames: a batch costs its footprint.
//!
//! **Headers.** A `Message` frame with no messages (a count of 0 and no
//! payload) carries only metadata: a server whose response stream has
//! nothing to send yet sends its initial metadata so, as gRPC sends
//! headers before the first message. It may only be a direction's first
//! frame ([`Inbound::on_message`]), and it costs its footprint like any
//! other.

use super::{HEADER_LEN, align_up};

/// Default window per stream direction, in window bytes.
pub const DEFAULT_WINDOW: u32 = 256 << 10;

/// Most payload bytes a producer gathers into one batch before it sends it
/// (a single larger message goes alone). Small enough that a window holds
/// many batches in flight, large enough that the per-frame cost vanishes
/// for small messages.
pub const MAX_BATCH: usize = 16 << 10;

/// Bytes of the length before each message of a batch.
pub const RECORD_PREFIX: usize = 4;

/// Window bytes a message with `body_len` bytes of metadata and payload costs.
pub fn message_cost(body_len: usize) -> u64 {
    align_up(HEADER_LEN.saturating_add(body_len)) as u64
}

/// Largest message that may be in flight with another one larger than half
/// the window (see the module's rules). Above it, a second message in
/// flight would hold twice its size on each side (the sender's encoded
/// copy, the receiver's read buffer), and the copies, not the transfer,
/// bound such a stream: tcp:// streams of 256 MiB messages ran at 560-730
/// MB/s two at a time against 805-830 MB/s one at a time.
pub const PIPELINED_MAX: u64 = 64 << 20;

/// What a message with `body_len` bytes of metadata and payload takes
/// from a window of `window` bytes: its cost, at most half the window up to
/// [`PIPELINED_MAX`].
fn window_cost(window: u64, body_len: usize) -> i64 {
    let cost = message_cost(body_len);
    if cost > PIPELINED_MAX {
        // Capped so that one grant (32 bits) always gives it all back.
        cost.min(u64::from(u32::MAX / 2)) as i64
    } else {
        cost.min(window / 2) as i64
    }
}

/// A stream rule the peer broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamError {
    /// A message beyond the window.
    WindowExceeded {
        /// What the message cost.
        cost: u64,
        /// What the window allowed.
        allowed: i64,
    },
    /// A grant of more than was ever sent.
    GrantTooLarge {
        /// The grant.
        grant: u32,
        /// What was sent and not yet granted back.
        outstanding: u64,
    },
    /// A message after the peer closed its side of the stream.
    MessageAfterClose,
    /// A message on a direction that carries none (the requests of a
    /// server-streaming call, the responses of a client-streaming one).
    MessageNotExpected,
    /// A second half-close.
    DoubleHalfClose,
    /// A `Message` frame whose payload is not the number of messages its
    /// header says.
    BadBatch {
        /// Messages the header announced.
        count: u32,
    },
    /// A `Message` frame with no messages (metadata only) after the
    /// direction's first frame.
    HeadersNotFirst,
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            StreamError::WindowExceeded { cost, allowed } => write!(
                f,
                "stream message of {cost} window bytes exceeds the window ({allowed} allowed)"
            ),
            StreamError::GrantTooLarge { grant, outstanding } => write!(
                f,
                "stream window grant of {grant} bytes exceeds the {outstanding} outstanding"
            ),
            StreamError::MessageAfterClose => write!(f, "stream message after half-close"),
            StreamError::MessageNotExpected => {
                write!(f, "stream message on a direction that carries none")
            }
            StreamError::DoubleHalfClose => write!(f, "stream half-closed twice"),
            StreamError::BadBatch { count } => write!(
                f,
                "stream message frame does not hold the {count} messages its header announces"
            ),
            StreamError::HeadersNotFirst => {
                write!(
                    f,
                    "stream frame of metadata only after the stream's first frame"
                )
            }
        }
    }
}

impl std::error::Error for StreamError {}

/// The sending side's window of one stream direction.
#[derive(Debug, Clone)]
pub struct SendWindow {
    window: u64,
    /// Window minus what was sent and not granted back; negative after a
    /// message above [`PIPELINED_MAX`].
    available: i64,
}

impl SendWindow {
    /// A window of `window` bytes (at least one message's worth).
    pub fn new(window: u32) -> SendWindow {
        let window = u64::from(window).max(message_cost(0));
        SendWindow {
            window,
            available: window as i64,
        }
    }

    /// Whether a message of `body_len` bytes may go now (see the module's
    /// rules); if so, its cost is taken.
    pub fn try_send(&mut self, body_len: usize) -> bool {
        let cost = window_cost(self.window, body_len);
        if cost <= self.available || self.available >= (self.window / 2) as i64 {
            self.available -= cost;
            true
        } else {
            false
        }
    }

    /// Gives back the cost [`SendWindow::try_send`] took for a message of
    /// `body_len` bytes that did not leave after all.
    pub fn unsend(&mut self, body_len: usize) {
        let cost = window_cost(self.window, body_len);
        self.available = (self.available + cost).min(self.window as i64);
    }

    /// Window bytes available now (negative after a message above
    /// [`PIPELINED_MAX`]).
    pub fn available(&self) -> i64 {
        self.available
    }

    /// The peer granted `grant` bytes back.
    pub fn on_grant(&mut self, grant: u32) -> Result<(), StreamError> {
        let outstanding = (self.window as i64 - self.available) as u64;
        if u64::from(grant) > outstanding {
            return Err(StreamError::GrantTooLarge { grant, outstanding });
        }
        self.available += i64::from(grant);
        Ok(())
    }
}

/// The receiving side's window of one stream direction.
#[derive(Debug, Clone)]
pub struct RecvWindow {
    window: u64,
    /// What the sender may still send, as far as grants sent go.
    allowed: i64,
    /// Consumed and not yet granted back.
    owed: u64,
}

impl RecvWindow {
    /// A window of `window` bytes (the same the sender was told).
    pub fn new(window: u32) -> RecvWindow {
        let window = u64::from(window).max(message_cost(0));
        RecvWindow {
            window,
            allowed: window as i64,
            owed: 0,
        }
    }

    /// A message of `body_len` bytes arrived: checks it against the window.
    pub fn on_message(&mut self, body_len: usize) -> Result<(), StreamError> {
        let cost = window_cost(self.window, body_len);
        if cost > self.allowed && self.allowed < (self.window / 2) as i64 {
            return Err(StreamError::WindowExceeded {
                cost: cost as u64,
                allowed: self.allowed,
            });
        }
        self.allowed -= cost;
        Ok(())
    }

    /// The application took a message of `body_len` bytes: returns a grant
    /// to send in a `Window` frame, once enough is owed.
    pub fn on_consumed(&mut self, body_len: usize) -> Option<u32> {
        self.owed += window_cost(self.window, body_len) as u64;
        if self.owed < self.window / 2 {
            return None;
        }
        // A grant fits in the header's 32 bits: less than half the window
        // was owed before this message, which costs at most 2 GiB.
        let grant = u32::try_from(self.owed).unwrap_or(u32::MAX);
        self.owed -= u64::from(grant);
        self.allowed += i64::from(grant);
        Some(grant)
    }

    /// Window bytes received and not yet granted back (what is buffered or
    /// owed).
    pub fn outstanding(&self) -> u64 {
        (self.window as i64 - self.allowed) as u64
    }
}

/// The messages of one `Message` frame's payload: `count` of them (from
/// its header), raw if one, length-prefixed if more. Walks untrusted bytes
/// without panicking; [`Records::check`] validates a whole payload first.
#[derive(Debug, Clone)]
pub struct Records {
    at: usize,
    left: u32,
    single: bool,
}

impl Records {
    /// The messages of a payload whose header announced `count`.
    pub fn new(count: u32) -> Records {
        Records {
            at: 0,
            left: count,
            single: count == 1,
        }
    }

    /// Whether `payload` holds exactly `count` messages (none: a frame of
    /// metadata only, with no payload).
    pub fn check(payload: &[u8], count: u32) -> Result<(), StreamError> {
        let mut records = Records::new(count);
        if count == 0 {
            return if payload.is_empty() {
                Ok(())
            } else {
                Err(StreamError::BadBatch { count })
            };
        }
        while records.left > 0 {
            if records.next_range(payload).is_none() {
                return Err(StreamError::BadBatch { count });
            }
        }
        if records.at == payload.len() {
            Ok(())
        } else {
            Err(StreamError::BadBatch { count })
        }
    }

    /// Messages not yet taken.
    pub fn left(&self) -> u32 {
        self.left
    }

    /// Where the next message lies in `payload`; `None` when all were
    /// taken, or when the bytes do not hold another (a payload that
    /// passed [`Records::check`] always does).
    pub fn next_range(&mut self, payload: &[u8]) -> Option<std::ops::Range<usize>> {
        if self.left == 0 {
            return None;
        }
        let range = if self.single {
            0..payload.len()
        } else {
            let prefix = payload.get(self.at..self.at.checked_add(RECORD_PREFIX)?)?;
            let len = u32::from_le_bytes(prefix.try_into().ok()?) as usize;
            let start = self.at + RECORD_PREFIX;
            let end = start.checked_add(len)?;
            if end > payload.len() {
                return None;
            }
            start..end
        };
        self.at = range.end;
        self.left -= 1;
        Some(range)
    }
}

/// What a stream direction's receiving end has seen: whether a frame came,
/// and whether the peer closed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inbound {
    started: bool,
    closed: bool,
}

impl Inbound {
    /// A `Message` frame of `count` messages arrived on this direction
    /// (none: metadata only, which only the first frame may be).
    pub fn on_message(&mut self, count: u32) -> Result<(), StreamError> {
        if self.closed {
            return Err(StreamError::MessageAfterClose);
        }
        if count == 0 && self.started {
            return Err(StreamError::HeadersNotFirst);
        }
        self.started = true;
        Ok(())
    }

    /// The peer closed this direction.
    pub fn on_close(&mut self) -> Result<(), StreamError> {
        if std::mem::replace(&mut self.closed, true) {
            Err(StreamError::DoubleHalfClose)
        } else {
            Ok(())
        }
    }

    /// Whether the peer closed this direction.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether a `Message` frame came on this direction.
    pub fn is_started(&self) -> bool {
        self.started
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[test]
    fn costs_count_empty_messages() {
        assert_eq!(message_cost(0), 64);
        assert_eq!(message_cost(32), 64);
        assert_eq!(message_cost(33), 128);
    }

    #[test]
    fn a_full_window_blocks_until_a_grant() {
        let mut tx = SendWindow::new(1024);
        let mut rx = RecvWindow::new(1024);
        let mut sent = 0;
        while tx.try_send(0) {
            rx.on_message(0).unwrap();
            sent += 1;
        }
        // 512 bytes go freely; from there only messages that fit.
        assert_eq!(sent, 16);
        assert!(rx.on_message(0).is_err(), "one more breaks the window");
        let mut grant = None;
        for _ in 0..8 {
            grant = grant.or(rx.on_consumed(0));
        }
        let grant = grant.expect("half the window owed is granted");
        assert_eq!(grant, 512);
        tx.on_grant(grant).unwrap();
        assert!(tx.try_send(0));
    }

    #[test]
    fn oversized_messages_go_two_at_a_time() {
        let mut tx = SendWindow::new(1024);
        let mut rx = RecvWindow::new(1024);
        // Each costs half the window, whatever its size: the second goes
        // while the first is still being read, the third waits.
        for _ in 0..2 {
            assert!(tx.try_send(4000));
            rx.on_message(4000).unwrap();
        }
        assert!(!tx.try_send(0), "nothing more until one is granted back");
        assert!(rx.on_message(0).is_err(), "one more breaks the window");
        let grant = rx.on_consumed(4000).expect("half the window owed at once");
        assert_eq!(grant, 512);
        tx.on_grant(grant).unwrap();
        assert_eq!(tx.available(), 512);
        assert!(tx.try_send(100_000));
        rx.on_message(100_000).unwrap();
    }

    #[test]
    fn a_message_above_the_pipelined_size_goes_alone() {
        let huge = PIPELINED_MAX as usize + 1;
        let mut tx = SendWindow::new(1024);
        let mut rx = RecvWindow::new(1024);
        assert!(tx.try_send(huge));
        rx.on_message(huge).unwrap();
        assert!(!tx.try_send(0), "nothing more until it is granted back");
        assert!(rx.on_message(0).is_err(), "one more breaks the window");
        let grant = rx.on_consumed(huge).expect("owed at once");
        tx.on_grant(grant).unwrap();
        assert_eq!(tx.available(), 1024);
        // After one of half the window, a huge one still goes (half the
        // window is available), and then nothing.
        assert!(tx.try_send(4000) && tx.try_send(huge));
        rx.on_message(4000).unwrap();
        rx.on_message(huge).unwrap();
        assert!(!tx.try_send(0));
    }

    fn batch(messages: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            out.extend_from_slice(&(m.len() as u32).to_le_bytes());
            out.extend_from_slice(m);
        }
        out
    }

    fn walk(payload: &[u8], count: u32) -> Vec<Vec<u8>> {
        let mut records = Records::new(count);
        std::iter::from_fn(|| records.next_range(payload).map(|r| payload[r].to_vec())).collect()
    }

    #[test]
    fn records_of_a_batch() {
        let payload = batch(&[b"ab", b"", b"cde"]);
        assert_eq!(Records::check(&payload, 3), Ok(()));
        assert_eq!(
            walk(&payload, 3),
            vec![b"ab".to_vec(), vec![], b"cde".to_vec()]
        );
        // One message: the payload itself, whatever its bytes.
        assert_eq!(Records::check(&payload, 1), Ok(()));
        assert_eq!(walk(&payload, 1), vec![payload.clone()]);
        for bad in [0, 2, 4] {
            assert_eq!(
                Records::check(&payload, bad),
                Err(StreamError::BadBatch { count: bad })
            );
        }
        // No messages: metadata only, with no payload.
        assert_eq!(Records::check(&[], 0), Ok(()));
        assert_eq!(walk(&[], 0), Vec::<Vec<u8>>::new());
        // A length past the end, a truncated prefix.
        assert!(Records::check(&[9, 0, 0, 0, 1], 2).is_err());
        assert!(Records::check(&[0, 0, 0, 0, 1], 2).is_err());
        assert!(Records::check(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0], 2).is_err());
    }

    proptest! {
        /// Any bytes and any count: checking and walking never panic, and
        /// a checked payload yields exactly its count.
        #[test]
        fn prop_records_never_panic(payload in proptest::collection::vec(any::<u8>(), 0..64), count in 0u32..6) {
            let ok = Records::check(&payload, count).is_ok();
            let walked = walk(&payload, count);
            if ok {
                prop_assert_eq!(walked.len(), count as usize);
            }
        }

        /// Whatever messages are batched come back as they were.
        #[test]
        fn prop_batches_round_trip(messages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 2..20)) {
            let refs: Vec<&[u8]> = messages.iter().map(|m| &m[..]).collect();
            let payload = batch(&refs);
            prop_assert_eq!(Records::check(&payload, messages.len() as u32), Ok(()));
            prop_assert_eq!(walk(&payload, messages.len() as u32), messages);
        }
    }

    #[test]
    fn bad_peers_are_caught() {
        let mut tx = SendWindow::new(1024);
        assert!(matches!(
            tx.on_grant(1),
            Err(StreamError::GrantTooLarge { .. })
        ));
        let mut rx = RecvWindow::new(1024);
        rx.on_message(1000).unwrap();
        rx.on_message(1000).unwrap();
        assert!(matches!(
            rx.on_message(0),
            Err(StreamError::WindowExceeded { .. })
        ));
        let mut inbound = Inbound::default();
        inbound.on_message(0).unwrap();
        inbound.on_message(3).unwrap();
        assert_eq!(inbound.on_message(0), Err(StreamError::HeadersNotFirst));
        inbound.on_close().unwrap();
        assert_eq!(inbound.on_message(1), Err(StreamError::MessageAfterClose));
        assert_eq!(inbound.on_close(), Err(StreamError::DoubleHalfClose));
        let mut late = Inbound::default();
        late.on_message(1).unwrap();
        assert_eq!(late.on_message(0), Err(StreamError::HeadersNotFirst));
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// The producer offers a message of this many bytes.
        Produce(u32),
        /// The network delivers the next message.
        Deliver,
        /// The consumer takes a buffered message.
        Consume,
        /// The network delivers the next grant.
        Grant,
    }

    fn step(window: u32) -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..window * 2).prop_map(Step::Produce),
            // Now and then one around the largest that may be pipelined.
            1 => (PIPELINED_MAX as u32 - 100..PIPELINED_MAX as u32 + 100).prop_map(Step::Produce),
            3 => Just(Step::Deliver),
            3 => Just(Step::Consume),
            2 => Just(Step::Grant),
        ]
    }

    /// A producer and a consumer of one stream direction, with a network
    /// in between each way.
    struct Flow {
        tx: SendWindow,
        rx: RecvWindow,
        window: u64,
        largest: u64,
        /// The largest window cost offered.
        largest_cost: u64,
        waiting: VecDeque<usize>,
        wire: VecDeque<usize>,
        buffered: VecDeque<usize>,
        grants: VecDeque<u32>,
        offered: u64,
        consumed: u64,
    }

    impl Flow {
        fn new(window: u32) -> Flow {
            Flow {
                tx: SendWindow::new(window),
                rx: RecvWindow::new(window),
                window: u64::from(window).max(64),
                largest: 0,
                largest_cost: 0,
                waiting: VecDeque::new(),
                wire: VecDeque::new(),
                buffered: VecDeque::new(),
                grants: VecDeque::new(),
                offered: 0,
                consumed: 0,
            }
        }

        fn run(&mut self, step: &Step) -> Result<(), TestCaseError> {
            match *step {
                Step::Produce(len) => {
                    self.largest = self.largest.max(message_cost(len as usize));
                    self.largest_cost = self
                        .largest_cost
                        .max(window_cost(self.window, len as usize) as u64);
                    self.waiting.push_back(len as usize);
                    self.offered += 1;
                }
                Step::Deliver => {
                    if let Some(len) = self.wire.pop_front() {
                        prop_assert_eq!(self.rx.on_message(len), Ok(()));
                        self.buffered.push_back(len);
                    }
                }
                Step::Consume => {
                    if let Some(len) = self.buffered.pop_front() {
                        self.consumed += 1;
                        if let Some(g) = self.rx.on_consumed(len) {
                            self.grants.push_back(g);
                        }
                    }
                }
                Step::Grant => {
                    if let Some(g) = self.grants.pop_front() {
                        prop_assert_eq!(self.tx.on_grant(g), Ok(()));
                    }
                }
            }
            // The producer sends what its window lets it, in order.
            while let Some(&len) = self.waiting.front() {
                if !self.tx.try_send(len) {
                    break;
                }
                self.wire.push_back(len);
                self.waiting.pop_front();
            }
            let held: u64 = self
                .buffered
                .iter()
                .chain(self.wire.iter())
                .map(|&l| message_cost(l))
                .sum();
            // The window's worth, or two messages larger than half of it.
            prop_assert!(
                held <= self.window.max(2 * self.largest),
                "{} held, window {}",
                held,
                self.window
            );
            // Half the window and one message above PIPELINED_MAX at most.
            let most = self.window.max(self.window / 2 + self.largest_cost);
            prop_assert!(self.rx.outstanding() <= most);
            Ok(())
        }
    }

    proptest! {
        /// Whatever the schedule: the receiver never sees a violation, it
        /// buffers at most the window or two oversized messages, and once the
        /// consumer catches up every message offered goes through.
        #[test]
        fn prop_windows_never_overflow_nor_deadlock(
            window in 64u32..8192,
            steps in proptest::collection::vec(step(8192), 1..400),
        ) {
            let mut flow = Flow::new(window);
            for s in &steps {
                flow.run(s)?;
            }
            for _ in 0..100_000 {
                if flow.waiting.is_empty() && flow.wire.is_empty() && flow.buffered.is_empty() {
                    break;
                }
                for s in [Step::Deliver, Step::Consume, Step::Grant] {
                    flow.run(&s)?;
                }
            }
            prop_assert!(
                flow.waiting.is_empty() && flow.wire.is_empty() && flow.buffered.is_empty(),
                "deadlock: {} waiting, available {}",
                flow.waiting.len(),
                flow.tx.available()
            );
            prop_assert_eq!(flow.consumed, flow.offered);
        }
    }
}
