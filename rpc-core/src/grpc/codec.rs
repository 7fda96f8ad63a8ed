//! Ours in gRPC's terms, for the face and the gateway alike: metadata and
//! statuses mapped key for key and code for code, and a `grpc-timeout`
//! read as a duration.

use crate::{Metadata, Status};
use prost::bytes::Bytes;
use std::time::Duration;

/// A gRPC request's metadata as ours; keys ours refuses are left out.
pub(super) fn metadata_from_grpc(map: &tonic::metadata::MetadataMap) -> Metadata {
    use tonic::metadata::KeyAndValueRef;
    let mut ours = Metadata::new();
    for entry in map.iter() {
        let _ = match entry {
            KeyAndValueRef::Ascii(key, value) => {
                if crate::metadata::is_reserved(key.as_str()) {
                    continue;
                }
                match value.to_str() {
                    Ok(v) => ours.insert(key.as_str(), v),
                    Err(_) => continue,
                }
            }
            KeyAndValueRef::Binary(key, _) if crate::metadata::is_reserved(key.as_str()) => {
                continue;
            }
            KeyAndValueRef::Binary(key, value) => match value.to_bytes() {
                Ok(v) => ours.insert_bin(key.as_str(), v.to_vec()),
                Err(_) => continue,
            },
        };
    }
    ours
}

/// Our metadata as gRPC's: `-bin` keys binary, the rest text, gRPC's own
/// keys left out. A binary
/// value under a text key (set with `insert_bin`) that HTTP/2 cannot carry
/// is left out, with a warning: gRPC has no way to send it under that key.
pub(super) fn metadata_to_grpc(metadata: &Metadata) -> tonic::metadata::MetadataMap {
    use tonic::metadata::{BinaryMetadataKey, MetadataKey, MetadataValue};
    let mut map = tonic::metadata::MetadataMap::new();
    for (key, value) in metadata.iter() {
        // gRPC's own keys, which only a peer can have put here (ours
        // refuses them): they would break the HTTP/2 message.
        if crate::metadata::is_reserved(key) {
            continue;
        }
        if key.ends_with("-bin") {
            if let Ok(k) = BinaryMetadataKey::from_bytes(key.as_bytes()) {
                map.insert_bin(k, MetadataValue::from_bytes(value));
            }
        } else if let (Ok(k), Some(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            std::str::from_utf8(value)
                .ok()
                .and_then(|v| MetadataValue::try_from(v).ok()),
        ) {
            map.insert(k, v);
        } else {
            tracing::warn!(
                key,
                "metadata entry left out of a gRPC message: its value is not text a gRPC \
                 header can hold, and its key does not end in -bin"
            );
        }
    }
    map
}

/// Our status as gRPC's (same codes), its metadata sent as trailers and
/// its details as `grpc-status-details-bin`.
pub(super) fn to_grpc(status: Status) -> tonic::Status {
    let metadata = status.metadata().map(metadata_to_grpc).unwrap_or_default();
    tonic::Status::with_details_and_metadata(
        tonic::Code::from_i32(status.code() as i32),
        status.message().to_owned(),
        Bytes::copy_from_slice(status.details()),
        metadata,
    )
}

/// tonic's status as ours (same codes).
pub(super) fn from_grpc(status: tonic::Status) -> Status {
    use std::error::Error;
    // A status tonic made of a transport error (it has a source): the
    // connection failed or the server hung up (a TLS handshake that
    // refused us, say), whatever code tonic chose for it.
    if let (Some(source), tonic::Code::Cancelled | tonic::Code::Unknown) =
        (status.source(), status.code())
    {
        // tonic's own timer for the call's `grpc-timeout`: the deadline
        // passed, whichever side noticed first.
        if source.is::<tonic::TimeoutExpired>() {
            return Status::deadline_exceeded(format!("gRPC call: {}", status.message()));
        }
        return Status::unavailable(format!("gRPC server: {}: {source}", status.message()));
    }
    Status::with_details(
        crate::Code::from_u16(status.code() as u16),
        status.message().to_owned(),
        status.details().to_vec(),
    )
    .with_metadata(metadata_from_grpc(status.metadata()))
}

/// A `grpc-timeout` value: up to 8 digits and a unit (`H`, `M`, `S`, `m`,
/// `u`, `n`).
pub(super) fn parse_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_timeout;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        assert_eq!(parse_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "5", "S", "123456789S", "5s", "-5S", "5X"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
    }
}
