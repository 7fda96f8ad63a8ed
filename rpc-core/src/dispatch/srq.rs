//! Provisioning of the shared receive queue: every incoming write consumes
//! one posted receive, whichever connection it is for. A connection adds
//! receives for the most writes its peer can have in flight; consumed ones
//! are replaced as the dispatcher polls them; a closed connection's share is
//! absorbed by later replacements instead of being posted again.

use super::*;

/// The receives a dispatcher owes the shared receive queue.
#[derive(Debug, Default)]
pub(crate) struct SrqProvision {
    /// Receives posted for connections since closed: consumed receives up
    /// to this many are not replaced.
    surplus: AtomicU64,
}

impl SrqProvision {
    /// Receives to post for a new connection: its peer may send a frame per
    /// `ALIGN` bytes of this side's ring, plus a credit per frame it
    /// received from the peer ring's worth of frames, before the dispatcher
    /// replaces any; provisioning for all of it makes a busy dispatcher
    /// delay the peer instead of failing it with RNR errors.
    pub(crate) fn for_connection(ring_size: usize, peer_ring: usize) -> Result<u32, Status> {
        u32::try_from((ring_size + peer_ring) / ALIGN)
            .map_err(|_| Status::resource_exhausted("rings too large to provision receives"))
    }

    /// A closed connection's receives stay posted: count them as surplus.
    pub(crate) fn returned(&self, receives: u32) {
        self.surplus.fetch_add(receives as u64, Ordering::AcqRel);
    }

    /// Posts receives on `fabric` in place of `consumed` ones, less any
    /// surplus. On error nothing is owed twice: the caller retries with the
    /// same count.
    pub(crate) fn replenish<F: Fabric>(&self, fabric: &F, consumed: u32) -> Result<(), Status> {
        let mut surplus = self.surplus.load(Ordering::Acquire);
        let absorbed = loop {
            let absorbed = surplus.min(consumed as u64);
            match self.surplus.compare_exchange_weak(
                surplus,
                surplus - absorbed,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break absorbed as u32,
                Err(now) => surplus = now,
            }
        };
        if consumed > absorbed {
            if let Err(e) = fabric.post_recv(consumed - absorbed) {
                // Give the surplus back for the retry.
                self.surplus.fetch_add(absorbed as u64, Ordering::AcqRel);
                return Err(e.into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::soft::SoftFabric;

    #[test]
    fn closed_connections_receives_are_absorbed_before_posting_more() {
        let fabric = SoftFabric::new();
        let srq = SrqProvision::default();
        assert_eq!(
            SrqProvision::for_connection(1 << 16, 1 << 16).unwrap(),
            2048
        );
        srq.returned(100);
        // 60 consumed: all absorbed by the surplus, nothing posted.
        srq.replenish(&fabric, 60).unwrap();
        assert_eq!(srq.surplus.load(Ordering::Acquire), 40);
        // 100 more: 40 absorbed, 60 posted.
        srq.replenish(&fabric, 100).unwrap();
        assert_eq!(srq.surplus.load(Ordering::Acquire), 0);
        assert_eq!(fabric.srq_posted(), 60);
    }
}
