//! Whether a tcp:// peer is still there: the kernel's keepalive probes a
//! quiet connection for the heartbeat, and `TCP_INFO` tells how long what
//! was sent has gone unacknowledged. Reading `TCP_INFO` is the soft
//! fabrics' one use of `unsafe`.

use super::TcpWire;
use crate::fabric::bootstrap;
use crate::fabric::{FabricError, Probe};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Unanswered keepalive probes after which the kernel fails a tcp://
/// connection whose heartbeat it keeps ([`TcpWire::probe_every`]): the
/// first goes after one interval of silence, the rest one interval apart,
/// so a vanished host is noticed within four intervals of the last thing
/// it sent, inside [`crate::heartbeat_bound`].
pub(crate) const KEEPALIVE_PROBES_FOR_HEARTBEAT: u32 = 3;

/// How long the peer's kernel has acknowledged nothing while bytes of
/// `stream` wait for it, from `TCP_INFO`; `None` unless bytes are in flight
/// and their retransmission timer ran out twice in a row (0.6 s at least),
/// or two window probes went unanswered.
/// That second condition keeps out a connection that merely has not heard
/// from its peer for a while: a dispatcher that stopped reading (a long
/// handler) and now sends again, whose peer's acks are on their way. A
/// peer that stopped reading (a zero window) acknowledges the window
/// probes, and nothing is in flight meanwhile: that is not silence either.
#[cfg(test)]
pub(crate) fn unacknowledged_for(stream: &TcpStream) -> Option<Duration> {
    tcp_info(stream).and_then(|(info, _)| unacknowledged(&info))
}

/// See [`unacknowledged_for`].
fn unacknowledged(info: &libc::tcp_info) -> Option<Duration> {
    // Bytes in flight, sent twice more without an ack; or window probes
    // (the peer had advertised a zero window) twice unanswered: a live
    // peer's kernel answers every probe, which resets the count.
    let retried = info.tcpi_unacked > 0 && info.tcpi_retransmits >= 2;
    let probed = info.tcpi_probes >= 2;
    if !(retried || probed) {
        return None;
    }
    Some(Duration::from_millis(u64::from(info.tcpi_last_ack_recv)))
}

/// `TCP_INFO` of `stream`, if the kernel gives it, and whether it gave it
/// up to `tcpi_notsent_bytes` (Linux 4.6 on; older kernels fill less).
///
/// The soft fabrics' one use of `unsafe`: `TCP_INFO` is not in the
/// socket crates' safe APIs.
#[allow(unsafe_code)]
fn tcp_info(stream: &TcpStream) -> Option<(libc::tcp_info, bool)> {
    // SAFETY: plain old data; zero is valid.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for writes of `len` bytes, and `len` tells
    // the kernel so; the socket is open (`stream` owns it).
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    let full = len as usize
        >= std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + std::mem::size_of::<u32>();
    (rc == 0).then_some((info, full))
}

impl TcpWire {
    /// The socket, for tests that look at its options.
    #[cfg(test)]
    pub(crate) fn stream(&self) -> &TcpStream {
        &self.conn.stream
    }

    /// Whether the last look found everything sent acknowledged (and the
    /// next may skip `TCP_INFO` unless something is sent meanwhile).
    #[cfg(test)]
    pub(crate) fn settled(&self) -> bool {
        self.conn.tx().settled
    }

    /// See [`unacknowledged_for`]. A connection that sent nothing since a
    /// look found all it had sent acknowledged is not asked again: on a
    /// quiet connection the heartbeat's look then costs no system call.
    pub(crate) fn unacknowledged_for(&self) -> Option<Duration> {
        let flushed = {
            let mut tx = self.conn.tx();
            if tx.settled && !tx.sent_since_look {
                return None;
            }
            tx.sent_since_look = false;
            tx.flushed()
        };
        let Some((info, full)) = tcp_info(&self.conn.stream) else {
            self.conn.tx().settled = false;
            return None;
        };
        let settled = flushed && full && info.tcpi_unacked == 0 && info.tcpi_notsent_bytes == 0;
        // A send meanwhile set `sent_since_look` again: the next look asks.
        self.conn.tx().settled = settled;
        unacknowledged(&info)
    }

    /// Heartbeats every `every`: from a second up, the kernel's keepalive
    /// probes the quiet connection, every whole second of `every`, and
    /// fails it after [`KEEPALIVE_PROBES_FOR_HEARTBEAT`] unanswered ones;
    /// neither side's process wakes up for it. Below a second (keepalive
    /// counts whole seconds), credit doorbells.
    ///
    /// `TCP_USER_TIMEOUT` is turned off then: it would also end the
    /// keepalive's probing no sooner than itself (20 s), and data left
    /// unacknowledged is what the dispatcher's heartbeat looks for
    /// ([`unacknowledged_for`]) at the same pace.
    pub(crate) fn probe_every(&self, every: Duration) -> Result<Probe, FabricError> {
        let secs = every.as_secs();
        if secs == 0 {
            return Ok(Probe::Doorbell);
        }
        let every = Duration::from_secs(secs);
        bootstrap::keep_alive(
            &self.conn.stream,
            every,
            every,
            KEEPALIVE_PROBES_FOR_HEARTBEAT,
            None,
        )?;
        Ok(Probe::Transport)
    }
}
