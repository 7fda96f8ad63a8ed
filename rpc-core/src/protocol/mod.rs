//! The wire protocol as pure state: frame headers, doorbells, ring
//! arithmetic, credits, the call table, and one connection's state machine
//! built from them ([`connection`]).
//!
//! Nothing here touches memory registration, threads, sockets or clocks (time
//! is passed in), so every corner is testable with plain unit and property
//! tests. The dispatcher drives these types with what the fabric reports.
//!
//! A connection has two rings, one per direction. Each side owns the ring it
//! *receives* into and tracks the *peer's* ring as a sender:
//!
//! ```text
//!  sender                                            receiver
//!  SendRing::reserve(len) -> offset                  RecvRing (owns the memory)
//!  encode header+metadata+payload at offset
//!  RDMA WRITE WITH IMM (imm = Doorbell::Frame)  ---> recv completion: locate(imm)
//!                                                    decode Header at offset
//!                                                    consume(slot, frame_len)
//!  SendRing::release(..) <--- ack in any header  <-- CreditReturn::take_ack()
//!                        <--- or Doorbell::Credit (zero-length write)
//! ```

pub mod calls;
pub mod connection;
pub mod credits;
pub mod doorbell;
pub mod header;
pub mod ring;
// Streams' flow control and life cycle: the pure part of streaming, ahead
// of the client and server support that will drive it.
#[allow(dead_code)]
pub mod stream;

#[cfg(test)]
mod sim;

// Some of these are used only by tests, benchmarks and the workspace's
// misbehaving peers (through `rpc_core::testing`).
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use calls::{CallId, CallTable};
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use connection::{Arrived, Receiver, Reserved, SendError, Sender, Transmit};
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use credits::{CreditError, CreditReturn};
pub use doorbell::Doorbell;
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use header::{
    FrameKind, HEADER_LEN, Header, HeaderError, NO_WIRE_DEADLINE, VERSION, field_timeout,
    timeout_field,
};
#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
pub use ring::{ALIGN, RecvRing, RingError, SendRing, Slot, Staging, align_up, staging_size};
