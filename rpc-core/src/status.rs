//! `Status` and `Code`: how a call fails, with gRPC's status codes.

use crate::{Bytes, InvalidMetadata, Metadata};
use std::fmt;

/// The metadata key under which a status's binary details travel, as in
/// gRPC (there, a `google.rpc.Status` message by convention).
pub(crate) const DETAILS_KEY: &str = "grpc-status-details-bin";

/// A gRPC status code. The numeric values are gRPC's, so they can be mapped
/// one to one onto other gRPC-speaking systems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Code {
    /// Not an error.
    Ok = 0,
    /// The operation was cancelled, typically by the caller.
    Cancelled = 1,
    /// Unknown error.
    Unknown = 2,
    /// The client specified an invalid argument (for example a payload that
    /// is not a valid protobuf message).
    InvalidArgument = 3,
    /// The deadline expired before the operation could complete.
    DeadlineExceeded = 4,
    /// Some requested entity was not found.
    NotFound = 5,
    /// The entity a client attempted to create already exists.
    AlreadyExists = 6,
    /// The caller lacks permission.
    PermissionDenied = 7,
    /// Some resource is exhausted: a full ring with no waiting allowed, or a
    /// message larger than the connection accepts.
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation.
    FailedPrecondition = 9,
    /// The operation was aborted.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The method is not implemented or not known to the server.
    Unimplemented = 12,
    /// An internal invariant was broken (for example a handler panicked).
    Internal = 13,
    /// The service is currently unavailable: the peer is gone or the
    /// connection failed.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The request does not have valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// Maps a wire value to a code; values outside gRPC's range become `Unknown`.
    pub fn from_u16(value: u16) -> Code {
        use Code::*;
        match value {
            0 => Ok,
            1 => Cancelled,
            2 => Unknown,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            _ => Unknown,
        }
    }

    /// A short human-readable description, as gRPC spells it.
    pub fn description(self) -> &'static str {
        use Code::*;
        match self {
            Ok => "ok",
            Cancelled => "cancelled",
            Unknown => "unknown",
            InvalidArgument => "invalid argument",
            DeadlineExceeded => "deadline exceeded",
            NotFound => "not found",
            AlreadyExists => "already exists",
            PermissionDenied => "permission denied",
            ResourceExhausted => "resource exhausted",
            FailedPrecondition => "failed precondition",
            Aborted => "aborted",
            OutOfRange => "out of range",
            Unimplemented => "unimplemented",
            Internal => "internal",
            Unavailable => "unavailable",
            DataLoss => "data loss",
            Unauthenticated => "unauthenticated",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// The error of a call: a [`Code`] and a message, as in gRPC, with
/// optional trailing metadata and binary details.
#[derive(Clone, PartialEq, Eq)]
pub struct Status {
    code: Code,
    message: String,
    /// Trailing metadata and details (boxed: most statuses have neither).
    extra: Option<Box<Extra>>,
}

#[derive(Clone, PartialEq, Eq, Default)]
struct Extra {
    /// Trailing metadata sent with the status.
    metadata: Metadata,
    /// Binary details (gRPC's `grpc-status-details-bin`).
    details: Bytes,
}

macro_rules! constructors {
    ($($(#[$doc:meta])* $name:ident => $code:ident),* $(,)?) => {
        $( $(#[$doc])* pub fn $name(message: impl Into<String>) -> Status {
            Status::new(Code::$code, message)
        } )*
    };
}

impl Status {
    /// A status with the given code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
            extra: None,
        }
    }

    /// A status with binary details: by convention an encoded
    /// `google.rpc.Status` carrying the richer error model's messages
    /// (`BadRequest`, `RetryInfo`, ...), as with gRPC's
    /// `grpc-status-details-bin`. They travel with the status, counted in
    /// its 64 KiB of trailing metadata, and through a server's gRPC face.
    ///
    /// ```
    /// use rpc_core::{Code, Status};
    /// let status = Status::with_details(Code::InvalidArgument, "bad name", vec![8, 3]);
    /// assert_eq!(status.details(), &[8, 3]);
    /// ```
    pub fn with_details(
        code: Code,
        message: impl Into<String>,
        details: impl Into<Bytes>,
    ) -> Status {
        let mut status = Status::new(code, message);
        status.set_details(details.into());
        status
    }

    /// This status with `metadata` as its trailing metadata: it travels
    /// with the status to the caller (at most 64 KiB encoded, details
    /// included).
    pub fn with_metadata(mut self, metadata: Metadata) -> Status {
        let details = self.extra.take().map(|e| e.details).unwrap_or_default();
        self.extra = Extra { metadata, details }.boxed();
        self
    }

    fn set_details(&mut self, details: Bytes) {
        let metadata = self.extra.take().map(|e| e.metadata).unwrap_or_default();
        self.extra = Extra { metadata, details }.boxed();
    }

    /// The binary details that came with the status (empty if none).
    pub fn details(&self) -> &[u8] {
        self.extra.as_ref().map_or(&[], |e| &e.details)
    }

    /// The trailing metadata with the details under [`DETAILS_KEY`], as an
    /// `Error` frame carries them.
    pub(crate) fn wire_metadata(&self) -> Option<std::borrow::Cow<'_, Metadata>> {
        let extra = self.extra.as_ref()?;
        if extra.details.is_empty() {
            return Some(std::borrow::Cow::Borrowed(&extra.metadata));
        }
        let mut metadata = extra.metadata.clone();
        metadata.set(DETAILS_KEY.to_owned(), extra.details.to_vec());
        Some(std::borrow::Cow::Owned(metadata))
    }

    /// The status an `Error` frame describes: [`DETAILS_KEY`] taken out of
    /// its metadata as the details.
    pub(crate) fn from_wire(code: Code, message: String, metadata: Option<&Metadata>) -> Status {
        let mut status = Status::new(code, message);
        let Some(metadata) = metadata.filter(|md| !md.is_empty()) else {
            return status;
        };
        let mut metadata = metadata.clone();
        let details = metadata
            .remove(DETAILS_KEY)
            .map(Bytes::from)
            .unwrap_or_default();
        status.extra = Extra { metadata, details }.boxed();
        status
    }

    /// Prefixes the message with `context` (`"{context}: {message}"`).
    pub(crate) fn add_context(&mut self, context: &str) {
        self.message = format!("{context}: {}", self.message);
    }

    /// The trailing metadata that came with the status, if any.
    pub fn metadata(&self) -> Option<&Metadata> {
        self.extra
            .as_ref()
            .map(|e| &e.metadata)
            .filter(|md| !md.is_empty())
    }

    constructors! {
        /// A `Cancelled` status.
        cancelled => Cancelled,
        /// An `Unknown` status.
        unknown => Unknown,
        /// An `InvalidArgument` status.
        invalid_argument => InvalidArgument,
        /// A `DeadlineExceeded` status.
        deadline_exceeded => DeadlineExceeded,
        /// A `NotFound` status.
        not_found => NotFound,
        /// An `AlreadyExists` status.
        already_exists => AlreadyExists,
        /// A `PermissionDenied` status.
        permission_denied => PermissionDenied,
        /// A `ResourceExhausted` status.
        resource_exhausted => ResourceExhausted,
        /// A `FailedPrecondition` status.
        failed_precondition => FailedPrecondition,
        /// An `Aborted` status.
        aborted => Aborted,
        /// An `OutOfRange` status.
        out_of_range => OutOfRange,
        /// An `Unimplemented` status.
        unimplemented => Unimplemented,
        /// An `Internal` status.
        internal => Internal,
        /// An `Unavailable` status.
        unavailable => Unavailable,
        /// A `DataLoss` status.
        data_loss => DataLoss,
        /// An `Unauthenticated` status.
        unauthenticated => Unauthenticated,
    }

    /// The status code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message, for humans.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl Extra {
    /// `None` when there is nothing to keep.
    fn boxed(self) -> Option<Box<Extra>> {
        (!self.metadata.is_empty() || !self.details.is_empty()).then(|| Box::new(self))
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Status");
        d.field("code", &self.code).field("message", &self.message);
        if let Some(metadata) = self.metadata() {
            d.field("metadata", metadata);
        }
        if !self.details().is_empty() {
            d.field("details", &format_args!("{} bytes", self.details().len()));
        }
        d.finish()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Status {}

impl From<prost::DecodeError> for Status {
    fn from(e: prost::DecodeError) -> Status {
        Status::invalid_argument(format!("message is not valid protobuf: {e}"))
    }
}

impl From<InvalidMetadata> for Status {
    /// `InvalidArgument`, naming the key.
    fn from(e: InvalidMetadata) -> Status {
        Status::invalid_argument(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_the_wire_value() {
        for v in 0..=16u16 {
            assert_eq!(Code::from_u16(v) as u16, v);
        }
        assert_eq!(Code::from_u16(17), Code::Unknown);
        assert_eq!(Code::from_u16(u16::MAX), Code::Unknown);
    }

    #[test]
    fn details_and_metadata_travel_in_the_wire_metadata() {
        let mut md = Metadata::new();
        md.insert("retry", "later").unwrap();
        let status =
            Status::with_details(Code::Aborted, "conflict", vec![1, 2, 3]).with_metadata(md);
        assert_eq!(status.details(), &[1, 2, 3]);
        assert_eq!(status.metadata().unwrap().get("retry"), Some("later"));
        let wire = status.wire_metadata().unwrap();
        assert_eq!(wire.get_bin(DETAILS_KEY), Some(&[1u8, 2, 3][..]));
        let back = Status::from_wire(Code::Aborted, "conflict".into(), Some(&wire));
        assert_eq!(back, status);
        assert_eq!(
            back.metadata().unwrap().len(),
            1,
            "the details are not metadata"
        );
        // Neither: nothing extra, and no metadata on the wire.
        let plain = Status::internal("x");
        assert!(plain.wire_metadata().is_none() && plain.metadata().is_none());
        assert!(plain.details().is_empty());
        assert_eq!(
            Status::from_wire(Code::Internal, "x".into(), Some(&Metadata::new())),
            plain
        );
        // Empty metadata keeps the details.
        let only =
            Status::with_details(Code::Internal, "x", vec![9]).with_metadata(Metadata::new());
        assert_eq!(only.details(), &[9]);
        assert!(only.metadata().is_none());
    }

    #[test]
    fn display_names_code_and_message() {
        let s = Status::unavailable("peer closed");
        assert_eq!(s.to_string(), "unavailable: peer closed");
        assert_eq!(s.code(), Code::Unavailable);
    }
}
