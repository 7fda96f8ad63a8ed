//! A connection's heartbeat: when it ticks, what a beat posts (a probe the
//! queue pair offers, or a credit doorbell), and when a peer whose
//! transport acknowledges nothing is taken for dead.

use super::Conn;
use crate::fabric::{Fabric, Probe, QueuePair};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A connection's heartbeat schedule.
#[derive(Debug, Clone, Copy)]
pub(in crate::dispatch) struct Heartbeat {
    /// Half the interval: how often it ticks.
    half: Duration,
    /// When the next tick is due.
    next: Instant,
    /// How long the peer's transport may acknowledge nothing while writes
    /// wait (see [`QueuePair::unacknowledged_for`](crate::fabric::QueuePair::unacknowledged_for)).
    unacked_limit: Duration,
    /// Beat only once the peer has written to us (see [`Conn::heard`]).
    after_peer: bool,
    /// How a beat reaches the peer, as the queue pair said.
    probe: Probe,
}

impl<F: Fabric> Conn<F> {
    /// Beats every `interval` when idle (see [`Sender::heartbeat_tick`]),
    /// once the peer has written to us if `after_peer` (the server's side);
    /// returns when its first tick is due.
    pub(in crate::dispatch) fn start_heartbeat(
        &self,
        interval: Duration,
        after_peer: bool,
        now: Instant,
    ) -> Instant {
        let mut s = self.send_state();
        let probe = match s.qp.as_mut().map(|qp| qp.probe_every(interval)) {
            Some(Ok(probe)) => probe,
            Some(Err(e)) => {
                tracing::warn!(qp_num = self.qp_num, error = %e, "heartbeats fall back to credit doorbells");
                Probe::Doorbell
            }
            None => Probe::Doorbell,
        };
        let beat = Heartbeat {
            half: interval / 2,
            next: now + interval / 2,
            unacked_limit: crate::dispatch::config::unacked_limit(interval),
            after_peer,
            probe,
        };
        s.heartbeat = Some(beat);
        beat.next
    }

    /// A heartbeat tick, if one is due by `now`: posts a heartbeat if the
    /// connection sent nothing for a while. Returns when the next is due,
    /// or why the peer is taken for dead: its transport acknowledged
    /// nothing for too long while writes waited.
    pub(in crate::dispatch) fn heartbeat_tick(
        &self,
        now: Instant,
    ) -> Result<Option<Instant>, String> {
        let mut s = self.send_state();
        let Some(beat) = s.heartbeat.as_mut() else {
            return Ok(None);
        };
        // Due within a quarter of its period counts as due: the pass that
        // runs for one connection's beat takes every other one due about
        // then, so passes over a dispatcher's connections come at most four
        // times per period, however many connections there are, instead
        // of once per connection. A beat or check a little early changes
        // no bound: none is ever late.
        if now + beat.half / 4 < beat.next {
            return Ok(Some(beat.next));
        }
        beat.next = now + beat.half;
        let (next, limit, probe) = (beat.next, beat.unacked_limit, beat.probe);
        let waits_for_peer = beat.after_peer && !self.heard.load(Ordering::Acquire);
        // Looked at before the peer has written too: a server's hello that
        // its client's host never acknowledged is noticed the same way.
        if let Some(silent) = s.qp.as_ref().and_then(|qp| qp.unacknowledged_for()) {
            if silent >= limit {
                return Err(format!(
                    "peer unreachable: nothing acknowledged for {:.1} s",
                    silent.as_secs_f64()
                ));
            }
        }
        if waits_for_peer {
            return Ok(Some(next));
        }
        let silent = match probe {
            // The transport probes the quiet connection itself.
            Probe::Transport => return Ok(Some(next)),
            Probe::Doorbell => false,
            Probe::Silent => true,
        };
        if let Some(wr_id) = s.proto.heartbeat_tick(silent) {
            tracing::trace!(qp_num = self.qp_num, wr_id, silent, "heartbeat");
            self.post_transmits(&mut s);
        }
        Ok(Some(next))
    }
}
