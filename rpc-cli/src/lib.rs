//! `rpc`: list, describe and call the services of any rdma-rpc server from
//! the command line, as grpcurl does for gRPC. Requests are written and
//! responses printed as JSON (protobuf's canonical JSON mapping); types
//! come from the server's reflection service
//! (`Server::builder().add_reflection()`) or from `.proto` files.
//!
//! ```text
//! rpc list tcp://127.0.0.1:7471
//! rpc list tcp://127.0.0.1:7471 kv.Kv
//! rpc describe tcp://127.0.0.1:7471 kv.Kv
//! rpc describe tcp://127.0.0.1:7471 kv.PutRequest
//! rpc call tcp://127.0.0.1:7471 kv.Kv/Put '{"key": "alpha", "value": "b25l"}'
//! rpc call tcp://127.0.0.1:7471 kv.Kv/Scan '{"prefix": ""}'
//! rpc --proto proto/kv.proto call rdma://10.0.0.1:7471 kv.Kv/Get '{"key": "alpha"}'
//! ```
//!
//! The binary is a thin wrapper of [`run`], which the tests call directly.

mod describe;

use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};
use rpc_core::codegen::{MethodDescriptor, MethodKind, method_id};
use rpc_core::reflection::ReflectionClient;
use rpc_core::tls::{Certificate, ClientTlsConfig, Identity};
use rpc_core::{Channel, Code, RawMessage, Request, Status};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

/// `rpc --help`.
pub const USAGE: &str = "\
usage: rpc [OPTIONS] list URL [SERVICE]
       rpc [OPTIONS] describe URL [SYMBOL]
       rpc [OPTIONS] call URL package.Service/Method [JSON | -]

  list      the services the server serves, or the methods of SERVICE
  describe  a service, method, message or enum as .proto text (all services
            without SYMBOL)
  call      calls a method: JSON holds the request, or for a client or
            bidirectional stream any number of requests one after another;
            `-` reads them from standard input; without JSON a unary or
            server-streaming call sends an empty request. Each response is
            printed as JSON as it arrives.

  URL: tcp://host:port, rdma://host:port or mem://name

options:
  --proto FILE          take the types from this .proto file instead of the
                        server's reflection service (repeatable)
  -I, --import-path DIR where --proto files and their imports are found
                        (repeatable; default: each file's directory)
  -H, --header 'KEY: VALUE'
                        request metadata (repeatable)
  --timeout SECONDS     the call's deadline (fractions allowed)
  --compact             one line of JSON per response
  --emit-defaults       print fields that hold their default value
  --tls-ca FILE         trust servers whose certificate this CA (PEM) issued
  --tls-domain NAME     the name the server's certificate must carry
  --tls-cert FILE --tls-key FILE
                        this client's certificate and key, for mutual TLS

exit status: 0 on success, 2 for bad usage or input, 1 when the types
cannot be learnt, 64 + the gRPC status code when a call fails (e.g. 69 for
NOT_FOUND, 78 for UNAVAILABLE).";

/// Why `rpc` failed, which decides its exit status.
#[derive(Debug)]
enum Failure {
    /// Bad arguments or input: exit 2.
    Usage(String),
    /// The types could not be learnt, or another local failure: exit 1.
    Other(String),
    /// A call failed: exit 64 + its code.
    Call(String, Status),
}

fn usage(message: impl Into<String>) -> Failure {
    Failure::Usage(message.into())
}

/// Runs `rpc` with `args` (without the program name), reading requests
/// from `stdin` for `-`, printing responses to `out` and failures to
/// `err`. Returns the exit status.
pub fn run(args: &[String], stdin: &mut dyn Read, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let result = Options::parse(args).and_then(|(options, command)| match command {
        Command::Help => writeln!(out, "{USAGE}").map_err(|e| Failure::Other(e.to_string())),
        command => options.execute(command, stdin, out),
    });
    match result {
        Ok(()) => 0,
        Err(Failure::Usage(message)) => {
            let _ = writeln!(err, "rpc: {message}\n(rpc --help for usage)");
            2
        }
        Err(Failure::Other(message)) => {
            let _ = writeln!(err, "rpc: {message}");
            1
        }
        Err(Failure::Call(what, status)) => {
            let _ = writeln!(
                err,
                "rpc: {what} failed: {:?}: {}",
                status.code(),
                status.message()
            );
            64 + status.code() as i32
        }
    }
}

/// What to do.
enum Command {
    Help,
    List {
        url: String,
        service: Option<String>,
    },
    Describe {
        url: String,
        symbol: Option<String>,
    },
    Call {
        url: String,
        method: String,
        data: Option<String>,
    },
}

#[derive(Default)]
struct Options {
    protos: Vec<PathBuf>,
    imports: Vec<PathBuf>,
    headers: Vec<(String, String)>,
    timeout: Option<Duration>,
    compact: bool,
    emit_defaults: bool,
    tls_ca: Option<String>,
    tls_domain: Option<String>,
    tls_cert: Option<String>,
    tls_key: Option<String>,
}

impl Options {
    fn parse(args: &[String]) -> Result<(Options, Command), Failure> {
        let mut options = Options::default();
        let mut words = Vec::new();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let mut value = |name: &str| {
                args.next()
                    .cloned()
                    .ok_or_else(|| usage(format!("{name} needs a value")))
            };
            match arg.as_str() {
                "-h" | "--help" => return Ok((options, Command::Help)),
                "--proto" => options.protos.push(value(arg)?.into()),
                "-I" | "--import-path" => options.imports.push(value(arg)?.into()),
                "-H" | "--header" => {
                    let header = value(arg)?;
                    let (key, val) = header
                        .split_once(':')
                        .ok_or_else(|| usage(format!("{arg} {header:?}: want 'KEY: VALUE'")))?;
                    options
                        .headers
                        .push((key.trim().to_owned(), val.trim().to_owned()));
                }
                "--timeout" => {
                    let v = value(arg)?;
                    let secs: f64 = v
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s > 0.0 && *s < 1e9)
                        .ok_or_else(|| usage(format!("--timeout {v:?}: want seconds")))?;
                    options.timeout = Some(Duration::from_secs_f64(secs));
                }
                "--compact" => options.compact = true,
                "--emit-defaults" => options.emit_defaults = true,
                "--tls-ca" => options.tls_ca = Some(value(arg)?),
                "--tls-domain" => options.tls_domain = Some(value(arg)?),
                "--tls-cert" => options.tls_cert = Some(value(arg)?),
                "--tls-key" => options.tls_key = Some(value(arg)?),
                // `-` alone is data (standard input), not an option.
                flag if flag.starts_with('-') && flag != "-" => {
                    return Err(usage(format!("unknown option {flag:?}")));
                }
                _ => words.push(arg.clone()),
            }
        }
        let mut words = words.into_iter();
        let command = match (words.next().as_deref(), words.next()) {
            (None, _) => return Ok((options, Command::Help)),
            (Some(_), None) => return Err(usage("missing URL")),
            (Some("list"), Some(url)) => Command::List {
                url,
                service: words.next(),
            },
            (Some("describe"), Some(url)) => Command::Describe {
                url,
                symbol: words.next(),
            },
            (Some("call"), Some(url)) => Command::Call {
                url,
                method: words
                    .next()
                    .ok_or_else(|| usage("call: missing package.Service/Method"))?,
                data: words.next(),
            },
            (Some(other), _) => return Err(usage(format!("unknown command {other:?}"))),
        };
        if let Some(extra) = words.next() {
            return Err(usage(format!("unexpected argument {extra:?}")));
        }
        Ok((options, command))
    }

    fn channel(&self, url: &str) -> Result<Channel, Failure> {
        let mut builder = Channel::builder(url).reconnect(false);
        if let Some(ca) = &self.tls_ca {
            let ca = Certificate::from_pem_file(ca).map_err(|e| usage(e.message()))?;
            let mut config = ClientTlsConfig::new().ca_certificate(ca);
            if let Some(domain) = &self.tls_domain {
                config = config.domain_name(domain.clone());
            }
            match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => {
                    let identity =
                        Identity::from_pem_files(cert, key).map_err(|e| usage(e.message()))?;
                    config = config.identity(identity);
                }
                (None, None) => {}
                _ => return Err(usage("--tls-cert and --tls-key go together")),
            }
            builder = builder.tls_config(config).map_err(|e| usage(e.message()))?;
        } else if self.tls_domain.is_some() || self.tls_cert.is_some() || self.tls_key.is_some() {
            return Err(usage(
                "--tls-domain, --tls-cert and --tls-key need --tls-ca",
            ));
        }
        builder
            .connect()
            .map_err(|status| Failure::Call(format!("connecting to {url}"), status))
    }

    fn execute(
        &self,
        command: Command,
        stdin: &mut dyn Read,
        out: &mut dyn Write,
    ) -> Result<(), Failure> {
        let url = match &command {
            Command::Help => return Ok(()),
            Command::List { url, .. }
            | Command::Describe { url, .. }
            | Command::Call { url, .. } => url,
        };
        let channel = self.channel(url)?;
        let types = Types::new(self, &channel)?;
        let mut text = String::new();
        match command {
            Command::Help => {}
            Command::List { service: None, .. } => {
                for name in types.services()? {
                    text.push_str(&name);
                    text.push('\n');
                }
            }
            Command::List {
                service: Some(service),
                ..
            } => {
                let pool = types.pool_for(&service)?;
                let service = pool
                    .get_service_by_name(&service)
                    .ok_or_else(|| not_a(&service, "service"))?;
                for m in service.methods() {
                    text.push_str(m.full_name());
                    text.push('\n');
                }
            }
            Command::Describe { symbol: None, .. } => {
                for name in types.services()? {
                    match types.pool_for(&name) {
                        Ok(pool) => {
                            let service = pool
                                .get_service_by_name(&name)
                                .ok_or_else(|| not_a(&name, "service"))?;
                            text.push_str(&format!("{name} is a service:\n"));
                            text.push_str(&describe::service(&service));
                        }
                        Err(Failure::Call(_, status)) if status.code() == Code::NotFound => {
                            text.push_str(&format!(
                                "{name} is a service without descriptors: {}\n",
                                status.message()
                            ));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Command::Describe {
                symbol: Some(symbol),
                ..
            } => {
                let symbol = symbol.replace('/', ".");
                let symbol = symbol.trim_start_matches('.');
                let pool = types.pool_for(symbol)?;
                text = describe_symbol(&pool, symbol)?;
            }
            Command::Call { method, data, .. } => {
                return self.call(&channel, &types, &method, data.as_deref(), stdin, out);
            }
        }
        out.write_all(text.as_bytes())
            .map_err(|e| Failure::Other(format!("writing the output: {e}")))
    }

    /// Calls `method` with the requests in `data`, printing each response.
    fn call(
        &self,
        channel: &Channel,
        types: &Types<'_>,
        method: &str,
        data: Option<&str>,
        stdin: &mut dyn Read,
        out: &mut dyn Write,
    ) -> Result<(), Failure> {
        let (service_name, method_name) = method
            .rsplit_once('/')
            .or_else(|| method.rsplit_once('.'))
            .filter(|(s, m)| !s.is_empty() && !m.is_empty())
            .ok_or_else(|| usage(format!("{method:?}: want package.Service/Method")))?;
        let service_name = service_name.trim_start_matches('.');
        let pool = types.pool_for(service_name)?;
        let service = pool
            .get_service_by_name(service_name)
            .ok_or_else(|| not_a(service_name, "service"))?;
        let desc = service
            .methods()
            .find(|m| m.name() == method_name)
            .ok_or_else(|| usage(format!("{service_name} has no method {method_name:?}")))?;
        let kind = match (desc.is_client_streaming(), desc.is_server_streaming()) {
            (false, false) => MethodKind::Unary,
            (false, true) => MethodKind::ServerStreaming,
            (true, false) => MethodKind::ClientStreaming,
            (true, true) => MethodKind::Streaming,
        };
        let path = format!("/{service_name}/{method_name}");
        let what = path[1..].to_owned();
        // The call API takes static descriptors, as generated code has;
        // this one lives as long as the process, which makes one call.
        let rpc: &'static MethodDescriptor = Box::leak(Box::new(MethodDescriptor {
            name: Box::leak(method_name.to_owned().into_boxed_str()),
            id: method_id(&path),
            path: Box::leak(path.into_boxed_str()),
            kind,
        }));

        // Every request is read and checked before the call starts: bad
        // input sends nothing.
        let text = match data {
            Some("-") => {
                let mut text = String::new();
                stdin
                    .read_to_string(&mut text)
                    .map_err(|e| Failure::Other(format!("reading standard input: {e}")))?;
                Some(text)
            }
            other => other.map(str::to_owned),
        };
        let mut requests = match &text {
            Some(text) => parse_requests(&desc.input(), text)?,
            None if kind.client_streams() => Vec::new(),
            None => vec![RawMessage::default()],
        };
        if !kind.client_streams() && requests.len() != 1 {
            return Err(usage(format!(
                "{what} takes one request, not {}",
                requests.len()
            )));
        }

        let mut request = Request::new(());
        for (key, value) in &self.headers {
            request
                .metadata_mut()
                .insert(key, value.clone())
                .map_err(|e| usage(format!("-H {key:?}: {e}")))?;
        }
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        let output = desc.output();
        let mut print = |raw: RawMessage| self.print(&output, raw, out);
        let failed = |status| Failure::Call(what.clone(), status);
        match kind {
            MethodKind::Unary => {
                let request = request.map(|()| requests.remove(0));
                let response = channel.unary(rpc, request).wait().map_err(failed)?;
                print(response.into_inner())
            }
            MethodKind::ServerStreaming => {
                let request = request.map(|()| requests.remove(0));
                for response in channel.server_streaming::<RawMessage, RawMessage>(rpc, request) {
                    print(response.map_err(failed)?)?;
                }
                Ok(())
            }
            MethodKind::ClientStreaming => {
                let (mut sender, call) = channel.client_streaming_sender(rpc, request);
                let sent = requests.into_iter().try_for_each(|r| sender.send(r));
                // A failed send means the call is over: its outcome says why.
                let closed = sent.and_then(|()| sender.close());
                let response = call.wait().map_err(failed)?;
                closed.map_err(failed)?;
                print(response.into_inner())
            }
            MethodKind::Streaming => {
                let (mut sender, responses) =
                    channel.streaming_sender::<RawMessage, RawMessage>(rpc, request);
                // Sent from a thread of its own while the responses are
                // read here, so that a server answering each request as it
                // comes is never left waiting for its reader.
                std::thread::scope(|scope| {
                    let feeder = scope.spawn(move || {
                        requests
                            .into_iter()
                            .try_for_each(|r| sender.send(r))
                            .and_then(|()| sender.close())
                    });
                    for response in responses {
                        print(response.map_err(failed)?)?;
                    }
                    let sent = feeder
                        .join()
                        .unwrap_or_else(|_| Err(Status::internal("the sending thread panicked")));
                    sent.map_err(failed)
                })
            }
        }
    }

    /// Prints `raw`, a message of type `output`, as JSON.
    fn print(
        &self,
        output: &MessageDescriptor,
        raw: RawMessage,
        out: &mut dyn Write,
    ) -> Result<(), Failure> {
        let message = DynamicMessage::decode(output.clone(), &raw.0[..]).map_err(|e| {
            Failure::Other(format!(
                "a response is not a valid {}: {e}",
                output.full_name()
            ))
        })?;
        let options = SerializeOptions::new().skip_default_fields(!self.emit_defaults);
        let mut json = Vec::new();
        let written = if self.compact {
            message.serialize_with_options(&mut serde_json::Serializer::new(&mut json), &options)
        } else {
            message.serialize_with_options(&mut serde_json::Serializer::pretty(&mut json), &options)
        };
        written.map_err(|e| Failure::Other(format!("printing a response: {e}")))?;
        json.push(b'\n');
        out.write_all(&json)
            .and_then(|()| out.flush())
            .map_err(|e| Failure::Other(format!("writing the output: {e}")))
    }
}

/// Where types come from: the server's reflection service, or `.proto`
/// files.
enum Types<'a> {
    Reflection(ReflectionClient, &'a Channel),
    Files(DescriptorPool),
}

impl<'a> Types<'a> {
    fn new(options: &Options, channel: &'a Channel) -> Result<Types<'a>, Failure> {
        if options.protos.is_empty() {
            return Ok(Types::Reflection(
                ReflectionClient::new(channel.clone()),
                channel,
            ));
        }
        let mut includes = options.imports.clone();
        if includes.is_empty() {
            for proto in &options.protos {
                let dir = proto.parent().unwrap_or(std::path::Path::new("."));
                let dir = if dir.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    dir.to_owned()
                };
                if !includes.contains(&dir) {
                    includes.push(dir);
                }
            }
        }
        let mut compiler = protox::Compiler::new(&includes)
            .map_err(|e| Failure::Other(format!("--proto: {e:?}")))?;
        compiler.include_imports(true).include_source_info(true);
        for proto in &options.protos {
            // Named as the compiler knows it: relative to its include dir.
            let name = includes
                .iter()
                .find_map(|dir| proto.strip_prefix(dir).ok())
                .unwrap_or(proto);
            compiler
                .open_file(name)
                .map_err(|e| Failure::Other(format!("--proto {}: {e:?}", proto.display())))?;
        }
        Ok(Types::Files(compiler.descriptor_pool()))
    }

    /// The names of the services: those the server serves, or those the
    /// `.proto` files declare.
    fn services(&self) -> Result<Vec<String>, Failure> {
        match self {
            Types::Reflection(client, channel) => client
                .list_services()
                .map_err(|s| reflection_failed(s, channel)),
            Types::Files(pool) => Ok(pool.services().map(|s| s.full_name().to_owned()).collect()),
        }
    }

    /// A pool that holds `symbol` and everything it refers to.
    fn pool_for(&self, symbol: &str) -> Result<DescriptorPool, Failure> {
        match self {
            Types::Files(pool) => Ok(pool.clone()),
            Types::Reflection(client, channel) => {
                // A method's file is its service's: asking for `a.B.C`
                // where `C` is a method also works, but its service
                // name is what call and list pass.
                let set = client
                    .file_containing_symbol(symbol)
                    .map_err(|s| reflection_failed(s, channel))?;
                DescriptorPool::from_file_descriptor_set(set).map_err(|e| {
                    Failure::Other(format!(
                        "the server's descriptors for {symbol} are invalid: {e}"
                    ))
                })
            }
        }
    }
}

/// A reflection request's failure: a server without reflection is told
/// apart, because `--proto` is the way round it.
fn reflection_failed(status: Status, channel: &Channel) -> Failure {
    if status.code() == Code::Unimplemented {
        Failure::Other(format!(
            "{} has no reflection service (add `.add_reflection()` to its server \
             builder), or pass the types with --proto FILE",
            channel.url()
        ))
    } else {
        Failure::Call("reflection".into(), status)
    }
}

fn not_a(symbol: &str, what: &str) -> Failure {
    usage(format!("{symbol:?} is not a {what}"))
}

/// `symbol` described as `.proto` text.
fn describe_symbol(pool: &DescriptorPool, symbol: &str) -> Result<String, Failure> {
    if let Some(s) = pool.get_service_by_name(symbol) {
        return Ok(format!("{symbol} is a service:\n{}", describe::service(&s)));
    }
    if let Some(m) = pool.get_message_by_name(symbol) {
        return Ok(format!("{symbol} is a message:\n{}", describe::message(&m)));
    }
    if let Some(e) = pool.get_enum_by_name(symbol) {
        return Ok(format!(
            "{symbol} is an enum:\n{}",
            describe::enumeration(&e)
        ));
    }
    if let Some((service, method)) = symbol.rsplit_once('.') {
        if let Some(m) = pool
            .get_service_by_name(service)
            .and_then(|s| s.methods().find(|m| m.name() == method))
        {
            return Ok(format!("{symbol} is a method:\n{}", describe::method(&m)));
        }
    }
    Err(usage(format!(
        "{symbol:?} is not a service, method, message or enum"
    )))
}

/// The JSON values in `text`, one after another, as messages of `input`.
fn parse_requests(input: &MessageDescriptor, text: &str) -> Result<Vec<RawMessage>, Failure> {
    let mut requests = Vec::new();
    for (i, value) in serde_json::Deserializer::from_str(text)
        .into_iter::<serde_json::Value>()
        .enumerate()
    {
        let value = value.map_err(|e| usage(format!("request {}: not JSON: {e}", i + 1)))?;
        let message = DynamicMessage::deserialize(input.clone(), value).map_err(|e| {
            usage(format!(
                "request {}: not a {}: {e}",
                i + 1,
                input.full_name()
            ))
        })?;
        requests.push(RawMessage(message.encode_to_vec()));
    }
    Ok(requests)
}
