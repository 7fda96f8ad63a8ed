//! The messages of the tcp:// wire (see the [module](super)): their tags
//! and the lengths of their fixed parts, those parts built, and a `NAK`'s
//! status as a byte and back. The reader takes them apart by these
//! lengths.

use crate::fabric::soft::SoftRegion;
use crate::fabric::{WcStatus, WriteImm};

pub(super) const TAG_WRITE: u8 = 1;
pub(super) const TAG_NAK: u8 = 2;
pub(super) const TAG_WRITE_SIGNALED: u8 = 3;
pub(super) const TAG_ACK: u8 = 4;
pub(super) const TAG_READ: u8 = 5;
pub(super) const TAG_READ_RESP: u8 = 6;
pub(super) const WRITE_HEADER: usize = 1 + 8 + 8 + 4 + 4 + 4;
pub(super) const ACK_LEN: usize = 1 + 8;
pub(super) const NAK_LEN: usize = 1 + 8 + 1;

fn status_code(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::RemoteAccess => 1,
        WcStatus::RnrRetryExceeded => 2,
        WcStatus::RetryExceeded => 3,
        WcStatus::Flushed => 4,
        WcStatus::Other { .. } | WcStatus::DeviceError { .. } => 5,
    }
}

/// The fixed part of a `WRITE` message for `w`, whose payload (`len`
/// bytes) follows it.
pub(super) fn write_head(w: &WriteImm<'_, SoftRegion>, len: u32) -> [u8; WRITE_HEADER] {
    let mut h = [0u8; WRITE_HEADER];
    h[0] = if w.signaled {
        TAG_WRITE_SIGNALED
    } else {
        TAG_WRITE
    };
    h[1..9].copy_from_slice(&w.wr_id.to_le_bytes());
    h[9..17].copy_from_slice(&w.remote_addr.to_le_bytes());
    h[17..21].copy_from_slice(&w.rkey.to_le_bytes());
    h[21..25].copy_from_slice(&w.imm.to_le_bytes());
    h[25..29].copy_from_slice(&len.to_le_bytes());
    h
}

/// The fixed part of a `READ` (`tag` [`TAG_READ`]) or `READ_RESP`
/// ([`TAG_READ_RESP`]) message.
pub(super) fn read_head(tag: u8, wr_id: u64, addr: u64, rkey: u32, len: u32) -> [u8; WRITE_HEADER] {
    let mut h = [0u8; WRITE_HEADER];
    h[0] = tag;
    h[1..9].copy_from_slice(&wr_id.to_le_bytes());
    h[9..17].copy_from_slice(&addr.to_le_bytes());
    h[17..21].copy_from_slice(&rkey.to_le_bytes());
    h[25..29].copy_from_slice(&len.to_le_bytes());
    h
}

/// An `ACK` message: the signaled write `wr_id` was applied.
pub(super) fn ack_message(wr_id: u64) -> [u8; ACK_LEN] {
    let mut ack = [0u8; ACK_LEN];
    ack[0] = TAG_ACK;
    ack[1..9].copy_from_slice(&wr_id.to_le_bytes());
    ack
}

/// A `NAK` message: the write `wr_id` was rejected with `status`.
pub(super) fn nak_message(wr_id: u64, status: WcStatus) -> [u8; NAK_LEN] {
    let mut nak = [0u8; NAK_LEN];
    nak[0] = TAG_NAK;
    nak[1..9].copy_from_slice(&wr_id.to_le_bytes());
    nak[9] = status_code(status);
    nak
}

pub(super) fn status_from(code: u8) -> WcStatus {
    match code {
        1 => WcStatus::RemoteAccess,
        2 => WcStatus::RnrRetryExceeded,
        3 => WcStatus::RetryExceeded,
        4 => WcStatus::Flushed,
        v => WcStatus::Other { vendor: v as u32 },
    }
}
