//! Services, methods, messages and enums written back as `.proto` text,
//! with the comments of their source where the descriptors carry them.

use prost_reflect::{
    EnumDescriptor, FieldDescriptor, FileDescriptor, Kind, MessageDescriptor, MethodDescriptor,
    ServiceDescriptor,
};
use std::fmt::Write;

/// The leading comment of the element at `path` in `file`, as `//` lines
/// indented by `indent`.
fn comments(file: &FileDescriptor, path: &[i32], indent: &str, out: &mut String) {
    let Some(info) = &file.file_descriptor_proto().source_code_info else {
        return;
    };
    let Some(location) = info.location.iter().find(|l| l.path == path) else {
        return;
    };
    let Some(text) = &location.leading_comments else {
        return;
    };
    for line in text.trim_end().lines() {
        let _ = writeln!(out, "{indent}//{line}");
    }
}

/// `service Name { rpc ... }`.
pub(crate) fn service(service: &ServiceDescriptor) -> String {
    let mut out = String::new();
    let file = service.parent_file();
    comments(&file, service.path(), "", &mut out);
    let _ = writeln!(out, "service {} {{", service.name());
    for m in service.methods() {
        comments(&file, m.path(), "  ", &mut out);
        let _ = writeln!(out, "  {}", rpc_line(&m));
    }
    out.push_str("}\n");
    out
}

/// `rpc Name(Request) returns (stream Response);`, with its comment.
pub(crate) fn method(method: &MethodDescriptor) -> String {
    let mut out = String::new();
    comments(&method.parent_file(), method.path(), "", &mut out);
    let _ = writeln!(out, "{}", rpc_line(method));
    out
}

fn rpc_line(m: &MethodDescriptor) -> String {
    let stream = |on: bool| if on { "stream " } else { "" };
    format!(
        "rpc {}({}{}) returns ({}{});",
        m.name(),
        stream(m.is_client_streaming()),
        m.input().full_name(),
        stream(m.is_server_streaming()),
        m.output().full_name()
    )
}

/// `message Name { fields; nested types }`.
pub(crate) fn message(message: &MessageDescriptor) -> String {
    let mut out = String::new();
    write_message(message, "", &mut out);
    out
}

fn write_message(message: &MessageDescriptor, indent: &str, out: &mut String) {
    let file = message.parent_file();
    comments(&file, message.path(), indent, out);
    let _ = writeln!(out, "{indent}message {} {{", message.name());
    let inner = format!("{indent}  ");
    let mut oneofs_done = Vec::new();
    for field in message.fields() {
        match field.containing_oneof().filter(|o| !o.is_synthetic()) {
            None => write_field(&field, &inner, out),
            Some(oneof) => {
                if oneofs_done.contains(&oneof.name().to_owned()) {
                    continue;
                }
                oneofs_done.push(oneof.name().to_owned());
                comments(&file, oneof.path(), &inner, out);
                let _ = writeln!(out, "{inner}oneof {} {{", oneof.name());
                let deeper = format!("{inner}  ");
                for f in oneof.fields() {
                    write_field(&f, &deeper, out);
                }
                let _ = writeln!(out, "{inner}}}");
            }
        }
    }
    for nested in message.child_messages().filter(|m| !m.is_map_entry()) {
        write_message(&nested, &inner, out);
    }
    for e in message.child_enums() {
        write_enum(&e, &inner, out);
    }
    let _ = writeln!(out, "{indent}}}");
}

fn write_field(field: &FieldDescriptor, indent: &str, out: &mut String) {
    comments(&field.parent_file(), field.path(), indent, out);
    let label = if field.is_map() {
        ""
    } else if field.is_list() {
        "repeated "
    } else if field.field_descriptor_proto().proto3_optional() {
        "optional "
    } else {
        ""
    };
    let ty = match field.kind() {
        Kind::Message(m) if field.is_map() => format!(
            "map<{}, {}>",
            kind_name(&m.map_entry_key_field().kind()),
            kind_name(&m.map_entry_value_field().kind())
        ),
        kind => kind_name(&kind),
    };
    let _ = writeln!(
        out,
        "{indent}{label}{ty} {} = {};",
        field.name(),
        field.number()
    );
}

fn kind_name(kind: &Kind) -> String {
    match kind {
        Kind::Double => "double".into(),
        Kind::Float => "float".into(),
        Kind::Int32 => "int32".into(),
        Kind::Int64 => "int64".into(),
        Kind::Uint32 => "uint32".into(),
        Kind::Uint64 => "uint64".into(),
        Kind::Sint32 => "sint32".into(),
        Kind::Sint64 => "sint64".into(),
        Kind::Fixed32 => "fixed32".into(),
        Kind::Fixed64 => "fixed64".into(),
        Kind::Sfixed32 => "sfixed32".into(),
        Kind::Sfixed64 => "sfixed64".into(),
        Kind::Bool => "bool".into(),
        Kind::String => "string".into(),
        Kind::Bytes => "bytes".into(),
        Kind::Message(m) => m.full_name().into(),
        Kind::Enum(e) => e.full_name().into(),
    }
}

/// `enum Name { VALUE = n; }`.
pub(crate) fn enumeration(e: &EnumDescriptor) -> String {
    let mut out = String::new();
    write_enum(e, "", &mut out);
    out
}

fn write_enum(e: &EnumDescriptor, indent: &str, out: &mut String) {
    let file = e.parent_file();
    comments(&file, e.path(), indent, out);
    let _ = writeln!(out, "{indent}enum {} {{", e.name());
    for value in e.values() {
        comments(&file, value.path(), &format!("{indent}  "), out);
        let _ = writeln!(out, "{indent}  {} = {};", value.name(), value.number());
    }
    let _ = writeln!(out, "{indent}}}");
}
