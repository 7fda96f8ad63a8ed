//! What leaves in a frame: [`OutFrame`], everything of a frame to send but
//! the ack, checked into its header against the peer's limits; and what a
//! failed send tells the caller (`SendError` as a `Status`).

use crate::protocol::{CallId, FrameKind, Header, SendError};
use crate::{Metadata, Status};

/// A frame to send: everything but the ack, which is stamped at posting.
pub(crate) struct OutFrame<'a> {
    pub kind: FrameKind,
    /// The header's flags, but [`FLAG_LENT`] (the sender sets that).
    pub flags: u16,
    pub call_id: CallId,
    pub method_id: u32,
    pub status: u16,
    pub timeout_us: u32,
    pub metadata: Option<&'a Metadata>,
    pub payload_len: usize,
}

impl OutFrame<'_> {
    /// The frame's header, once its metadata fits a header's length field
    /// and its body (metadata and payload) is at most `max` bytes.
    pub(crate) fn header(&self, max: usize) -> Result<Header, SendError> {
        let md_len = self.metadata.map_or(0, Metadata::encoded_len);
        if md_len > crate::metadata::MAX_ENCODED_LEN {
            return Err(SendError::Metadata(md_len));
        }
        let len = md_len + self.payload_len;
        if len > max {
            return Err(SendError::TooLarge { len, max });
        }
        Ok(Header {
            kind: self.kind,
            status: self.status,
            method_id: self.method_id,
            call_id: self.call_id,
            payload_len: self.payload_len as u32,
            metadata_len: md_len as u16,
            timeout_us: self.timeout_us,
            ack: 0,
            flags: self.flags,
        })
    }
}

impl From<SendError> for Status {
    fn from(e: SendError) -> Status {
        match e {
            SendError::Closed(why) => Status::unavailable(format!("connection closed: {why}")),
            SendError::TooLarge { len, max } => Status::resource_exhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {max} bytes (a server \
                 raises it with ServerBuilder::max_message_size, a client with \
                 ChannelBuilder::max_message_size)"
            )),
            SendError::Full(why) => Status::resource_exhausted(why),
            SendError::Metadata(len) => Status::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {} bytes",
                crate::metadata::MAX_ENCODED_LEN
            )),
            SendError::NoBuffer(why) => {
                Status::resource_exhausted(format!("no buffer for a large message: {why}"))
            }
        }
    }
}
