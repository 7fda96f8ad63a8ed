//! What generated items and wire paths are called: a service's full
//! name, a method's path (what its id is hashed from), the id as written
//! into code, and the Rust names of streaming methods' extra items. The
//! generator writes them and the validation checks them, from here.

use heck::{ToSnakeCase, ToUpperCamelCase};

/// `package.Service`, or `Service` in a file without a package.
pub(crate) fn service_full_name(package: &str, service: &str) -> String {
    if package.is_empty() {
        service.to_owned()
    } else {
        format!("{package}.{service}")
    }
}

/// `/package.Service/Method`: what the method id is computed from.
pub(crate) fn method_path(service_full_name: &str, method: &str) -> String {
    format!("/{service_full_name}/{method}")
}

/// Hex with the halves grouped, as written into generated code: `0x1234_abcd`.
pub(crate) fn id_literal(id: u32) -> String {
    format!("0x{:04x}_{:04x}", id >> 16, id & 0xffff)
}

/// The blocking client method of a client-streaming or bidirectional rpc
/// named `proto_name` in the proto: `record_route_sender`. Never a keyword,
/// nor one of the client's own methods.
pub(crate) fn sender_method_name(proto_name: &str) -> String {
    format!("{}_sender", proto_name.to_snake_case())
}

/// The server trait's associated type for the responses of a
/// server-streaming or bidirectional rpc named `proto_name` in the proto:
/// `ListFeaturesStream`. Never a keyword.
pub(crate) fn stream_type_name(proto_name: &str) -> String {
    format!("{}Stream", proto_name.to_upper_camel_case())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(service_full_name("kv", "Kv"), "kv.Kv");
        assert_eq!(service_full_name("", "Kv"), "Kv");
        assert_eq!(method_path("a.b.Svc", "Get"), "/a.b.Svc/Get");
    }

    #[test]
    fn id_literal_groups_halves() {
        assert_eq!(id_literal(0x1234_abcd), "0x1234_abcd");
        assert_eq!(id_literal(1), "0x0000_0001");
        assert_eq!(id_literal(u32::MAX), "0xffff_ffff");
    }
}
