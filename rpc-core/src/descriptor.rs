//! What generated code says about a service: its name, its rpcs and their
//! stable ids. Shared by clients (which method to call) and servers (where
//! to route a call).

/// Describes one rpc of a service.
#[derive(Debug)]
pub struct MethodDescriptor {
    /// The rpc's name as written in the .proto file (`Get`).
    pub name: &'static str,
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// Stable id: [`method_id`] of `path`.
    pub id: u32,
    /// Which of the four kinds of rpc it is.
    pub kind: MethodKind,
}

/// The four kinds of rpc, by which sides stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MethodKind {
    /// One request, one response.
    Unary,
    /// One request, a stream of responses.
    ServerStreaming,
    /// A stream of requests, one response.
    ClientStreaming,
    /// Streams both ways (bidirectional).
    Streaming,
}

impl MethodKind {
    /// The kind whose client streams requests if `client_streams` and
    /// whose server streams responses if `server_streams`.
    pub(crate) fn of(client_streams: bool, server_streams: bool) -> MethodKind {
        match (client_streams, server_streams) {
            (false, false) => MethodKind::Unary,
            (false, true) => MethodKind::ServerStreaming,
            (true, false) => MethodKind::ClientStreaming,
            (true, true) => MethodKind::Streaming,
        }
    }

    /// Whether the client sends a stream of requests.
    pub fn client_streams(self) -> bool {
        matches!(self, MethodKind::ClientStreaming | MethodKind::Streaming)
    }

    /// Whether the server sends a stream of responses.
    pub fn server_streams(self) -> bool {
        matches!(self, MethodKind::ServerStreaming | MethodKind::Streaming)
    }
}

/// Describes a service: its full name and its rpcs.
#[derive(Debug)]
pub struct ServiceDescriptor {
    /// `package.Service`.
    pub name: &'static str,
    /// The rpcs.
    pub methods: &'static [MethodDescriptor],
}

/// The stable id of a method: 32-bit FNV-1a of its path `/package.Service/Method`,
/// with 0 (reserved) mapped to 1. Generated code carries the value computed at
/// build time; [`crate::Server`] recomputes it and refuses a mismatch.
pub const fn method_id(path: &str) -> u32 {
    let bytes = path.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if hash == 0 { 1 } else { hash }
}

#[cfg(test)]
mod tests {
    use super::method_id;

    #[test]
    fn method_id_is_fnv1a_and_never_zero() {
        // Reference values of 32-bit FNV-1a.
        assert_eq!(method_id(""), 0x811c_9dc5);
        assert_eq!(method_id("a"), 0xe40c_292c);
        assert_eq!(method_id("/kv.Kv/Get"), method_id("/kv.Kv/Get"));
        assert_ne!(method_id("/kv.Kv/Get"), method_id("/kv.Kv/Put"));
    }
}
