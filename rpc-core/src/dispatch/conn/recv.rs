//! Receiving on a connection: a doorbell's frames copied out of the ring
//! (credits returned once they are), each handed on as it arrives; and the
//! buffers incoming messages are copied into, kept for reuse.

use super::Conn;
use crate::Metadata;
use crate::dispatch::{Frame, LastFrame};
use crate::fabric::{Fabric, Region};
use crate::protocol::{Doorbell, HEADER_LEN, Header};
use std::sync::atomic::Ordering;

/// Message buffers a connection keeps for reuse, and the largest it keeps.
const MAX_POOLED_BUFFERS: usize = 256;
const MAX_POOLED_BUFFER: usize = 256 << 10;

impl<F: Fabric> Conn<F> {
    /// Handles a doorbell: each frame its write carries goes to `deliver`,
    /// in order. `Err` is a protocol violation.
    pub(in crate::dispatch) fn on_doorbell(
        &self,
        imm: u32,
        byte_len: u32,
        max_message: usize,
        deliver: &mut dyn FnMut(Frame),
        wants: &dyn Fn(&Header) -> bool,
    ) -> Result<(), String> {
        if !self.heard.load(Ordering::Relaxed) {
            self.heard.store(true, Ordering::Release);
        }
        match Doorbell::decode(imm) {
            None => Err(format!("invalid immediate {imm:#010x}")),
            Some(Doorbell::Credit { ack }) => {
                if byte_len != 0 {
                    return Err(format!(
                        "credit doorbell carries {byte_len} bytes (it must carry none)"
                    ));
                }
                let mut s = self.send_state();
                s.proto
                    .on_ack(ack)
                    .map_err(|e| format!("bad credit: {e}"))?;
                self.flush(&mut s);
                Ok(())
            }
            Some(Doorbell::Frame { offset_units }) => {
                let mut at = Some((offset_units, byte_len));
                while let Some((offset_units, left)) = at {
                    let mut recv = self.recv.lock().unwrap_or_else(|e| e.into_inner());
                    let arrived = recv.on_frame(offset_units, left, max_message, |offset| {
                        let mut raw = [0u8; HEADER_LEN];
                        self.recv_region.copy_to(offset, &mut raw);
                        raw
                    })?;
                    at = arrived.next;
                    let header = arrived.header;
                    let md_len = header.metadata_len as usize;
                    let start = arrived.offset + HEADER_LEN;
                    let metadata = if md_len == 0 {
                        Some(Metadata::new())
                    } else {
                        self.recv_region.read(start, md_len, Metadata::decode)
                    };
                    let mut payload = self.take_buffer();
                    payload.resize(header.payload_len as usize, 0);
                    self.recv_region.copy_to(start + md_len, &mut payload);
                    drop(recv);
                    // Copied out: only now may the credit go back.
                    let mut s = self.send_state();
                    s.proto.on_consumed(arrived.consumed);
                    s.proto
                        .on_ack(header.ack)
                        .map_err(|e| format!("bad credit: {e}"))?;
                    // Closed by an earlier frame of this write (a stream
                    // rule it broke): the rest goes nowhere.
                    if s.proto.death().is_some() {
                        return Ok(());
                    }
                    drop(s);
                    let _last = LastFrame::mark(self.qp_num, at.is_none());
                    self.arrive(
                        Frame {
                            header,
                            metadata,
                            payload: payload.into(),
                        },
                        deliver,
                        wants,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// A buffer for an incoming message, reused if one was given back.
    pub(super) fn take_buffer(&self) -> Vec<u8> {
        let mut buf = self
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.clear();
        buf
    }

    /// Gives back a buffer that held an incoming message, once decoded.
    pub(crate) fn recycle(&self, buf: crate::payload::Payload) {
        let Some(buf) = buf.into_heap() else {
            return; // a lent buffer goes back to the fabric's cache
        };
        if buf.capacity() == 0 || buf.capacity() > MAX_POOLED_BUFFER {
            return;
        }
        let mut pool = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < MAX_POOLED_BUFFERS {
            pool.push(buf);
        }
    }
}
