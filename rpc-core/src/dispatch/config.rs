//! The tunables shared by clients and servers.

use super::*;

/// Tunables shared by clients and servers.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Receive ring per connection, bytes (power of two).
    pub ring_size: usize,
    /// Largest message (metadata + payload) accepted, bytes.
    pub max_message: usize,
    /// Bytes of encoded frames a connection may queue while the peer's ring is full.
    pub max_backlog: usize,
    /// Zero-length receives kept posted on the shared receive queue.
    pub srq_depth: u32,
    /// How long the poller spins on an empty queue before it blocks.
    pub spin: Duration,
    /// Connection set-up time limit.
    pub connect_timeout: Duration,
}

impl Default for Config {
    fn default() -> Config {
        let ring_size = 1 << 21;
        Config {
            ring_size,
            max_message: ring_size / 2 - HEADER_LEN,
            max_backlog: 64 << 20,
            srq_depth: 4096,
            spin: Duration::from_micros(50),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    pub(crate) fn validate(&self) -> Result<(), Status> {
        crate::protocol::ring::check_capacity(self.ring_size)
            .map_err(|e| Status::invalid_argument(format!("ring size: {e}")))?;
        let largest = self.ring_size / 2 - HEADER_LEN;
        if self.max_message > largest || self.max_message > u32::MAX as usize {
            return Err(Status::invalid_argument(format!(
                "max message size {} exceeds what a {}-byte ring holds ({largest})",
                self.max_message, self.ring_size
            )));
        }
        Ok(())
    }
}
