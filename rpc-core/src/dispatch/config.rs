//! The tunables shared by clients and servers.

use super::*;

/// Tunables shared by clients and servers.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Receive ring per connection, bytes (power of two); `None`: the
    /// fabric's default ([`Fabric::DEFAULT_RING_SIZE`]).
    pub ring_size: Option<usize>,
    /// Largest message (metadata + payload) accepted, bytes.
    pub max_message: usize,
    /// Payloads above this many bytes travel by rendezvous (see
    /// [`DEFAULT_LEND_ABOVE`]); at most what fits half the ring.
    pub lend_above: usize,
    /// Bytes of encoded frames a connection may queue while the peer's ring is full.
    pub max_backlog: usize,
    /// Zero-length receives kept posted on the shared receive queue.
    pub srq_depth: u32,
    /// How long the poller spins on an empty queue before it blocks.
    pub spin: Duration,
    /// Connection set-up time limit.
    pub connect_timeout: Duration,
    /// A connection that sent nothing for this long sends a heartbeat
    /// (see [`DEFAULT_HEARTBEAT`]); `None`: no heartbeats.
    pub heartbeat: Option<Duration>,
}

/// The default heartbeat interval. A connection that sent nothing for one
/// to one and a half intervals probes its peer with something the peer's
/// transport, not its process, must acknowledge: on rdma:// a zero-length
/// RDMA WRITE without an immediate (the peer's process never sees it), on
/// tcp:// the kernel's keepalive at this interval (neither process wakes
/// for it; below a second, and on mem://, a zero-length credit doorbell).
/// A peer host that vanished is then noticed within [`heartbeat_bound`]: on
/// rdma:// within 1.5 intervals plus the reliable connection's retries (7
/// sends 134 ms apart; longer on NICs that stretch the ack timeout), about
/// 2.5 s with the default; on tcp:// within 4 intervals of silence, or once
/// the kernel has seen no acknowledgement for three intervals (at least
/// 2 s) while bytes are in flight, about 3.5-4 s.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

/// The shortest heartbeat interval accepted.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// How long a peer's transport may acknowledge nothing while writes wait
/// for it before the connection is taken for dead, with heartbeats every
/// `interval`: three intervals, and at least 2 s (TCP retransmits a lost
/// segment after 200 ms, then 400 ms, 800 ms...: a few losses in a row are
/// not a dead host).
pub(crate) fn unacked_limit(interval: Duration) -> Duration {
    (interval * 3).max(Duration::from_secs(2))
}

/// The longest a vanished peer host goes unnoticed with heartbeats every
/// `interval` (5 s with the default): then every pending call fails with
/// `Unavailable` and the connection's memory is returned. A heartbeat
/// leaves within 1.5 intervals of the connection's last write, and the
/// check runs every half interval: 2 intervals plus 3 intervals (at least
/// 2 s) without acknowledgements at most. RDMA's reliable connections fail
/// the heartbeat's write sooner, and on tcp:// the kernel's keepalive
/// (intervals of a second or more) fails a quiet connection within 4
/// intervals, rounded down to whole seconds, of the peer's last word (see
/// [`DEFAULT_HEARTBEAT`]).
pub fn heartbeat_bound(interval: Duration) -> Duration {
    interval * 2 + unacked_limit(interval)
}

/// The default largest message: 64 MiB (metadata and payload).
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

/// The largest message that can be allowed: 4 GiB less a byte.
pub const MAX_MESSAGE_LIMIT: usize = u32::MAX as usize;

/// Payloads larger than this travel by rendezvous by default: the sender
/// lends the encoded message, the receiver reads it with an RDMA READ
/// straight into its own buffer. Below it, a copy through the ring costs
/// less than the read's extra round trip.
pub const DEFAULT_LEND_ABOVE: usize = 32 << 10;

impl Default for Config {
    fn default() -> Config {
        Config {
            // The fabric's: see `Fabric::DEFAULT_RING_SIZE`.
            ring_size: None,
            max_message: DEFAULT_MAX_MESSAGE,
            lend_above: DEFAULT_LEND_ABOVE,
            max_backlog: 64 << 20,
            srq_depth: 4096,
            spin: Duration::from_micros(50),
            connect_timeout: Duration::from_secs(5),
            heartbeat: Some(DEFAULT_HEARTBEAT),
        }
    }
}

impl Config {
    /// The receive ring per connection on fabric `F`: the one set, or the
    /// fabric's default.
    pub(crate) fn ring_size<F: Fabric>(&self) -> usize {
        self.ring_size.unwrap_or(F::DEFAULT_RING_SIZE)
    }

    pub(crate) fn validate(&self) -> Result<(), Status> {
        if let Some(every) = self.heartbeat {
            if every < MIN_HEARTBEAT {
                return Err(Status::invalid_argument(format!(
                    "heartbeat interval {every:?} is shorter than the minimum of {MIN_HEARTBEAT:?}"
                )));
            }
        }
        if let Some(bytes) = self.ring_size {
            crate::protocol::ring::check_capacity(bytes)
                .map_err(|e| Status::invalid_argument(format!("ring size: {e}")))?;
        }
        if self.max_message > MAX_MESSAGE_LIMIT {
            return Err(Status::invalid_argument(format!(
                "max message size {} exceeds the limit of {MAX_MESSAGE_LIMIT} bytes",
                self.max_message
            )));
        }
        Ok(())
    }
}
