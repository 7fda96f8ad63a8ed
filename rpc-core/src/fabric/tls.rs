//! TLS under the TCP connections of tcp:// and of the rdma:// handshake
//! (feature `tls`): the TLS state of one connection ([`Session`]), the
//! client's handshake, and what a failed handshake means in words.
//!
//! The settings come from [`crate::tls`] ([`ServerTls`], [`ClientTls`]).
//! The TLS handshake runs first; our hello, the authentication records and,
//! on tcp://, every write after them travel inside it. Rustls does the
//! work with the `ring` provider. Without the feature, the types here are
//! empty stand-ins: nothing can build one, and code that handles them
//! compiles to nothing.
//!
//! What a peer that speaks the other language gets: a server with TLS
//! tells a plaintext client so in a plaintext refusal record (its first
//! byte is our hello's, never a TLS record's), and a server without TLS
//! tells a TLS client so the same way (a TLS record's first byte is 0x16);
//! the TLS client looks at the first byte the server answers with before
//! handing anything to rustls. Either connect fails at once with a clear
//! status, not a timeout.

/// Why a server with TLS refuses a client that sent a plaintext hello.
pub(crate) const REQUIRES_TLS: &str = "this server requires TLS and the client connected without it \
     (see ChannelBuilder::tls_config)";

/// Why a server without TLS refuses a client that opened with TLS.
pub(crate) const NO_TLS: &str = "this server does not use TLS and the client connected with it \
     (connect without ChannelBuilder::tls_config, or serve with ServerBuilder::tls_config)";

/// Whether the first bytes a peer sent open a TLS handshake record.
pub(crate) fn looks_like_tls(first: &[u8]) -> bool {
    matches!(first, [0x16, 0x03, ..])
}

/// Whether the first bytes a server answered with are a TLS record
/// (a handshake or an alert).
pub(crate) fn is_tls_record(first: &[u8]) -> bool {
    matches!(first, [0x15 | 0x16, 0x03, ..])
}

#[cfg(feature = "tls")]
mod imp {
    use crate::Code;
    use crate::fabric::record::{self, Record};
    use crate::fabric::{FabricError, FabricUrl};
    use rustls::pki_types::{CertificateDer, ServerName};
    use rustls::{AlertDescription, CertificateError, Error as TlsError};
    use std::io::{self, ErrorKind, IoSlice, Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;

    /// A server's TLS settings, ready to serve (from
    /// [`ServerTlsConfig`](crate::tls::ServerTlsConfig)).
    #[derive(Clone)]
    pub struct ServerTls {
        pub(crate) config: Arc<rustls::ServerConfig>,
        /// What it was built from (the gRPC face builds tonic's from it).
        #[cfg(feature = "grpc")]
        pub(crate) source: crate::tls::ServerTlsConfig,
    }

    impl std::fmt::Debug for ServerTls {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ServerTls").finish_non_exhaustive()
        }
    }

    /// A client's TLS settings, ready to connect (from
    /// [`ClientTlsConfig`](crate::tls::ClientTlsConfig)).
    #[derive(Clone)]
    pub struct ClientTls {
        pub(crate) config: Arc<rustls::ClientConfig>,
        /// The name the server's certificate must carry; by default the
        /// URL's host.
        pub(crate) domain: Option<ServerName<'static>>,
        /// What it was built from (`grpc://` builds tonic's from it).
        #[cfg(feature = "grpc")]
        pub(crate) source: crate::tls::ClientTlsConfig,
    }

    impl std::fmt::Debug for ClientTls {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ClientTls")
                .field("domain", &self.domain)
                .finish_non_exhaustive()
        }
    }

    impl crate::tls::ServerTlsConfig {
        /// These settings, checked and ready to serve.
        pub(crate) fn build(&self) -> Result<ServerTls, crate::Status> {
            Ok(ServerTls {
                config: self.rustls_config()?,
                #[cfg(feature = "grpc")]
                source: self.clone(),
            })
        }
    }

    impl crate::tls::ClientTlsConfig {
        /// These settings, checked and ready to connect.
        pub(crate) fn build(&self) -> Result<ClientTls, crate::Status> {
            let (config, domain) = self.rustls_config()?;
            Ok(ClientTls {
                config,
                domain,
                #[cfg(feature = "grpc")]
                source: self.clone(),
            })
        }
    }

    impl ClientTls {
        /// These settings, checking `name` where they name no domain
        /// (for endpoints whose URLs hold addresses a name resolved to).
        pub(crate) fn with_default_domain(self, name: &str) -> Result<ClientTls, crate::Status> {
            if self.domain.is_some() {
                return Ok(self);
            }
            let domain = ServerName::try_from(name.to_owned()).map_err(|_| {
                crate::Status::invalid_argument(format!(
                    "{name:?} is not a valid TLS server name; set ClientTlsConfig::domain_name"
                ))
            })?;
            Ok(ClientTls {
                domain: Some(domain),
                ..self
            })
        }
    }

    /// One connection's TLS state: what rustls decrypted and has not been
    /// read yet, and what it encrypted and has not been written yet.
    pub struct Session(Box<rustls::Connection>);

    impl std::fmt::Debug for Session {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Session")
                .field("handshaking", &self.0.is_handshaking())
                .finish_non_exhaustive()
        }
    }

    /// An I/O error carrying a TLS failure: its text says what went wrong.
    fn tls_failure(e: TlsError) -> io::Error {
        io::Error::new(ErrorKind::InvalidData, e)
    }

    impl Session {
        /// The server side of a new connection.
        pub(crate) fn server(tls: &ServerTls) -> Result<Session, String> {
            let conn = rustls::ServerConnection::new(tls.config.clone())
                .map_err(|e| format!("cannot start a TLS session: {e}"))?;
            Ok(Session::new(rustls::Connection::Server(conn)))
        }

        fn new(mut conn: rustls::Connection) -> Session {
            // What is written is encrypted at once and kept until the
            // socket takes it: the layers above bound what they send.
            conn.set_buffer_limit(None);
            Session(Box::new(conn))
        }

        /// Whether the TLS handshake is still going on.
        pub(crate) fn is_handshaking(&self) -> bool {
            self.0.is_handshaking()
        }

        /// Whether encrypted bytes wait for the socket.
        pub(crate) fn wants_write(&self) -> bool {
            self.0.wants_write()
        }

        /// Plaintext rustls has already decrypted, into `buf`: `WouldBlock`
        /// when there is none, `Ok(0)` after the peer's `close_notify`.
        pub(crate) fn read_plaintext(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.reader().read(buf)
        }

        /// Reads ciphertext from `stream` once and decrypts what it
        /// completes. `Ok(0)` at the end of the stream; a TLS failure is an
        /// `InvalidData` error whose text says why (the alert it raised is
        /// queued for the peer: see [`Session::flush`]).
        pub(crate) fn read_tls(&mut self, stream: &TcpStream) -> io::Result<usize> {
            let n = self.0.read_tls(&mut &*stream)?;
            if n > 0 {
                self.0.process_new_packets().map_err(tls_failure)?;
            }
            Ok(n)
        }

        /// Reads plaintext without blocking: what is decrypted already, else
        /// what `stream` has (`WouldBlock` when that is nothing yet).
        pub(crate) fn read_nonblocking(
            &mut self,
            stream: &TcpStream,
            buf: &mut [u8],
        ) -> io::Result<usize> {
            loop {
                match self.read_plaintext(buf) {
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    // Ok(0): the peer's close_notify; an end without one
                    // is `UnexpectedEof`.
                    other => return other,
                }
                let read = self.read_tls(stream);
                // Handshake messages and alerts go out as soon as they are
                // made; what the socket does not take now goes when it is
                // writable.
                let _ = self.flush(stream);
                if read? == 0 {
                    return Ok(0);
                }
            }
        }

        /// Reads plaintext from a blocking `stream` (its read timeout
        /// applies, cut to what is left until `deadline`), completing the
        /// handshake first if it is not done.
        pub(crate) fn read_blocking(
            &mut self,
            stream: &TcpStream,
            buf: &mut [u8],
            deadline: Option<std::time::Instant>,
        ) -> io::Result<usize> {
            loop {
                match self.read_plaintext(buf) {
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    other => return other,
                }
                self.flush_blocking(stream)?;
                record::read_within(stream, deadline)?;
                let read = self.read_tls(stream);
                // An alert raised by what was read goes to the peer.
                let _ = self.flush_blocking(stream);
                if read? == 0 {
                    return Err(ErrorKind::UnexpectedEof.into());
                }
            }
        }

        /// Encrypts `bufs` as one piece of the byte stream (rustls cuts it
        /// into records), to be written by [`Session::flush`].
        pub(crate) fn queue(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
            let total: usize = bufs.iter().map(|b| b.len()).sum();
            let n = self.0.writer().write_vectored(bufs)?;
            if n != total {
                // Cannot happen without a buffer limit; never lose bytes.
                return Err(io::Error::other("TLS refused part of a write"));
            }
            Ok(())
        }

        /// Writes what is encrypted to a nonblocking `stream` until done
        /// (`Ok(true)`) or the socket is full (`Ok(false)`).
        pub(crate) fn flush(&mut self, stream: &TcpStream) -> io::Result<bool> {
            while self.0.wants_write() {
                match self.0.write_tls(&mut &*stream) {
                    Ok(0) => return Err(ErrorKind::WriteZero.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            Ok(true)
        }

        /// Writes what is encrypted to a blocking `stream`.
        pub(crate) fn flush_blocking(&mut self, stream: &TcpStream) -> io::Result<()> {
            while self.0.wants_write() {
                match self.0.write_tls(&mut &*stream) {
                    Ok(0) => return Err(ErrorKind::WriteZero.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }

        /// Writes `buf` to a blocking `stream`, encrypted.
        pub(crate) fn write_blocking(&mut self, stream: &TcpStream, buf: &[u8]) -> io::Result<()> {
            self.queue(&[IoSlice::new(buf)])?;
            self.flush_blocking(stream).map_err(|e| {
                // A peer that ended the session may have said why first:
                // its alert explains the failed write.
                match self.read_tls(stream) {
                    Err(alert) if tls_error(&alert).is_some() => alert,
                    _ => e,
                }
            })
        }

        /// Queues the `close_notify` alert: the peer learns the end was
        /// ours, not a truncation.
        pub(crate) fn close_notify(&mut self) {
            self.0.send_close_notify();
        }

        /// Who the peer's certificate says it is (mutual TLS): its first
        /// DNS name, else its first URI (a SPIFFE ID, say), else its
        /// subject's common name. `None` without a client certificate.
        pub(crate) fn peer_identity(&self) -> Option<String> {
            identity_of(self.0.peer_certificates()?.first()?)
        }
    }

    /// The name a verified certificate gives its holder.
    pub(crate) fn identity_of(cert: &CertificateDer<'_>) -> Option<String> {
        let cert = webpki::EndEntityCert::try_from(cert).ok()?;
        if let Some(name) = cert.valid_dns_names().next() {
            return Some(name.to_owned());
        }
        if let Some(uri) = cert.valid_uri_names().next() {
            return Some(uri.to_owned());
        }
        common_name(cert.subject())
    }

    /// The first common name (2.5.4.3) in a DER `Name`'s contents: a
    /// sequence of sets of (type, value) sequences. Anything malformed is
    /// `None`.
    fn common_name(mut name: &[u8]) -> Option<String> {
        const CN: &[u8] = &[0x55, 0x04, 0x03];
        while !name.is_empty() {
            let (tag, rdn, rest) = der(name)?;
            name = rest;
            if tag != 0x31 {
                return None;
            }
            let mut set = rdn;
            while !set.is_empty() {
                let (tag, attr, rest) = der(set)?;
                set = rest;
                if tag != 0x30 {
                    return None;
                }
                let (tag, oid, value) = der(attr)?;
                if tag != 0x06 || oid != CN {
                    continue;
                }
                let (tag, value, _) = der(value)?;
                // UTF8String, PrintableString, IA5String, TeletexString.
                if matches!(tag, 0x0c | 0x13 | 0x16 | 0x14) {
                    return std::str::from_utf8(value).ok().map(str::to_owned);
                }
            }
        }
        None
    }

    /// One DER element: (tag, contents, what follows). Single-byte tags,
    /// definite lengths of up to four bytes.
    fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = b.split_first()?;
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let (bytes, after) = rest.split_at(n);
            rest = after;
            bytes
                .iter()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
        };
        if rest.len() < len {
            return None;
        }
        let (contents, after) = rest.split_at(len);
        Some((tag, contents, after))
    }

    /// Runs a client's TLS handshake on `stream` (blocking, by `deadline`),
    /// for the server at `url`.
    pub(crate) fn client_handshake(
        stream: &mut TcpStream,
        tls: &ClientTls,
        url: &FabricUrl,
        deadline: std::time::Instant,
    ) -> Result<Session, FabricError> {
        let name = match &tls.domain {
            Some(name) => name.clone(),
            None => ServerName::try_from(url.host.clone()).map_err(|_| {
                FabricError::invalid(
                    "tls",
                    format!(
                        "{:?} is not a valid TLS server name; set ClientTlsConfig::domain_name",
                        url.host
                    ),
                )
            })?,
        };
        let shown = match &name {
            ServerName::DnsName(d) => d.as_ref().to_owned(),
            ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
            other => format!("{other:?}"),
        };
        let conn = rustls::ClientConnection::new(tls.config.clone(), name)
            .map_err(|e| FabricError::invalid("tls", format!("cannot start TLS: {e}")))?;
        let mut session = Session::new(rustls::Connection::Client(conn));
        let mut first = true;
        while session.is_handshaking() {
            session
                .flush_blocking(stream)
                .map_err(|e| handshake_io(e, &shown))?;
            if first {
                // What the server answers first: a TLS record, or one of
                // our plaintext records (it does not use TLS).
                first = false;
                let mut b = [0u8; 1];
                match stream.peek(&mut b) {
                    Ok(0) => return Err(closed_in_handshake()),
                    Ok(_) if b[0] == record::TAG_REFUSED[0] => {
                        return Err(plaintext_server(stream));
                    }
                    Ok(_) => {}
                    Err(e) => return Err(handshake_io(e, &shown)),
                }
            }
            record::read_within(stream, Some(deadline)).map_err(|e| handshake_io(e, &shown))?;
            let read = session.read_tls(stream);
            // The alert a failure raised tells the server why.
            let _ = session.flush_blocking(stream);
            match read {
                Ok(0) => return Err(closed_in_handshake()),
                Ok(_) => {}
                Err(e) => return Err(handshake_io(e, &shown)),
            }
        }
        session
            .flush_blocking(stream)
            .map_err(|e| handshake_io(e, &shown))?;
        Ok(session)
    }

    fn closed_in_handshake() -> FabricError {
        FabricError::unreachable(
            "tls",
            "the server closed the connection during the TLS handshake (does it serve TLS?)",
        )
    }

    /// A server that answered a TLS client with a plaintext record: its
    /// refusal, or that it does not speak TLS.
    fn plaintext_server(stream: &mut TcpStream) -> FabricError {
        let mut tag = [0u8; 8];
        if stream.read_exact(&mut tag).is_ok() && &tag == record::TAG_REFUSED {
            if let Some((code, why)) = record::read_refusal(stream) {
                return record::refused_by_server(code, &why);
            }
        }
        FabricError::refused(
            Code::Unavailable,
            "tls",
            "the server does not use TLS and this channel requires it",
        )
    }

    /// A handshake I/O failure in words.
    fn handshake_io(e: io::Error, server: &str) -> FabricError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                FabricError::unreachable("tls", "timed out in the TLS handshake")
            }
            ErrorKind::UnexpectedEof => closed_in_handshake(),
            _ => match tls_error(&e) {
                Some(t) => {
                    let (code, why) = describe(t, server);
                    FabricError::refused(code, "tls", why)
                }
                None => FabricError::io("tls", e),
            },
        }
    }

    /// The rustls error inside an I/O error, if that is what it is.
    pub(crate) fn tls_error(e: &io::Error) -> Option<&TlsError> {
        e.get_ref()?.downcast_ref::<TlsError>()
    }

    /// A client's TLS failure after its side of the handshake finished
    /// (TLS 1.3: the server checks the client's certificate then), in
    /// words; `None` if `e` is not a TLS failure.
    pub(crate) fn client_failure(e: &io::Error) -> Option<FabricError> {
        let (code, why) = describe(tls_error(e)?, "the server");
        Some(FabricError::refused(code, "tls", why))
    }

    /// What a TLS failure on the client means, with the status code its
    /// connect fails with.
    fn describe(e: &TlsError, server: &str) -> (Code, String) {
        use AlertDescription as A;
        let unavailable = |why: String| (Code::Unavailable, why);
        match e {
            TlsError::InvalidCertificate(c) => unavailable(match c {
                CertificateError::UnknownIssuer => format!(
                    "the certificate of {server} is not trusted: no CA this channel trusts \
                     (ClientTlsConfig::ca_certificate) issued it"
                ),
                CertificateError::NotValidForName => format!(
                    "the certificate of {server} is not valid for that name; \
                     ClientTlsConfig::domain_name sets the name to check"
                ),
                CertificateError::NotValidForNameContext { presented, .. } => format!(
                    "the certificate of {server} is not valid for that name (it names {}); \
                     ClientTlsConfig::domain_name sets the name to check",
                    presented.join(", ")
                ),
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    format!("the certificate of {server} has expired")
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    format!("the certificate of {server} is not valid yet")
                }
                other => format!("the certificate of {server} is not acceptable: {other:?}"),
            }),
            TlsError::AlertReceived(A::CertificateRequired) => (
                Code::Unauthenticated,
                "the server requires a client certificate and this channel has none \
                     (ClientTlsConfig::identity)"
                    .into(),
            ),
            TlsError::AlertReceived(
                a @ (A::BadCertificate
                | A::UnknownCA
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::CertificateRevoked
                | A::UnsupportedCertificate
                | A::AccessDenied),
            ) => (
                Code::Unauthenticated,
                format!("the server rejected this channel's client certificate ({a:?})"),
            ),
            TlsError::AlertReceived(a) => {
                unavailable(format!("the server ended the TLS handshake: {a:?}"))
            }
            TlsError::NoCertificatesPresented => {
                unavailable(format!("{server} presented no certificate"))
            }
            TlsError::PeerIncompatible(p) => unavailable(format!(
                "no TLS version or cipher suite in common with {server}: {p:?}"
            )),
            other => unavailable(format!("TLS with {server} failed: {other}")),
        }
    }

    /// What a failed TLS handshake on the server means, for its log.
    pub(crate) fn server_failure(e: &io::Error) -> String {
        use AlertDescription as A;
        match tls_error(e) {
            Some(TlsError::NoCertificatesPresented) => {
                "TLS handshake failed: the client presented no certificate and this server \
                 requires one"
                    .into()
            }
            Some(TlsError::InvalidCertificate(c)) => {
                format!("TLS handshake failed: the client's certificate is not acceptable ({c:?})")
            }
            Some(TlsError::AlertReceived(
                a @ (A::UnknownCA
                | A::BadCertificate
                | A::CertificateUnknown
                | A::CertificateExpired
                | A::DecryptError),
            )) => format!(
                "TLS handshake failed: the client does not accept this server's certificate ({a:?})"
            ),
            Some(t) => format!("TLS handshake failed: {t}"),
            None => format!("TLS handshake failed: {e}"),
        }
    }

    /// Sends a refusal through `session` on a blocking stream, then ends
    /// the TLS session.
    pub(crate) fn refuse(session: &mut Session, stream: &TcpStream, record: &Record) {
        let _ = session.queue(&[IoSlice::new(&record.encode())]);
        session.close_notify();
        let _ = session.flush_blocking(stream);
    }

    /// Writes a handshake record through `session` without blocking; false
    /// if the connection failed (what the socket does not take now goes
    /// when it is writable).
    pub(crate) fn send_nonblocking(
        session: &mut Session,
        stream: &TcpStream,
        bytes: &[u8],
    ) -> bool {
        session.queue(&[IoSlice::new(bytes)]).is_ok() && session.flush(stream).is_ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn common_names_are_found_and_garbage_is_not() {
            // SEQUENCE-less Name contents: SET { SEQUENCE { OID 2.5.4.3, UTF8String "svc" } }
            let rdn = [
                0x31, 0x0c, 0x30, 0x0a, 0x06, 0x03, 0x55, 0x04, 0x03, 0x0c, 0x03, b's', b'v', b'c',
            ];
            assert_eq!(common_name(&rdn).as_deref(), Some("svc"));
            for n in 0..rdn.len() {
                // Truncated: never a panic.
                let _ = common_name(&rdn[..n]);
            }
            assert_eq!(common_name(&[0x31, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
            assert_eq!(common_name(&[0x31, 0x80]), None);
        }
    }
}

#[cfg(not(feature = "tls"))]
mod imp {
    //! Without the `tls` feature nothing can build these: each is empty.
    use crate::fabric::{FabricError, FabricUrl};
    use std::io::{self, IoSlice};
    use std::net::TcpStream;

    /// A server's TLS settings (this build has no TLS).
    #[derive(Debug, Clone)]
    pub enum ServerTls {}

    /// A client's TLS settings (this build has no TLS).
    #[derive(Debug, Clone)]
    pub enum ClientTls {}

    impl ClientTls {
        pub(crate) fn with_default_domain(self, _: &str) -> Result<ClientTls, crate::Status> {
            match self {}
        }
    }

    /// One connection's TLS state (this build has no TLS).
    #[derive(Debug)]
    pub enum Session {}

    impl Session {
        pub(crate) fn server(tls: &ServerTls) -> Result<Session, String> {
            match *tls {}
        }
        pub(crate) fn wants_write(&self) -> bool {
            match *self {}
        }
        pub(crate) fn read_plaintext(&mut self, _: &mut [u8]) -> io::Result<usize> {
            match *self {}
        }
        pub(crate) fn read_tls(&mut self, _: &TcpStream) -> io::Result<usize> {
            match *self {}
        }
        pub(crate) fn read_nonblocking(
            &mut self,
            _: &TcpStream,
            _: &mut [u8],
        ) -> io::Result<usize> {
            match *self {}
        }
        pub(crate) fn read_blocking(
            &mut self,
            _: &TcpStream,
            _: &mut [u8],
            _: Option<std::time::Instant>,
        ) -> io::Result<usize> {
            match *self {}
        }
        pub(crate) fn queue(&mut self, _: &[IoSlice<'_>]) -> io::Result<()> {
            match *self {}
        }
        pub(crate) fn flush(&mut self, _: &TcpStream) -> io::Result<bool> {
            match *self {}
        }
        pub(crate) fn flush_blocking(&mut self, _: &TcpStream) -> io::Result<()> {
            match *self {}
        }
        pub(crate) fn write_blocking(&mut self, _: &TcpStream, _: &[u8]) -> io::Result<()> {
            match *self {}
        }
        pub(crate) fn close_notify(&mut self) {
            match *self {}
        }
        pub(crate) fn peer_identity(&self) -> Option<String> {
            match *self {}
        }
    }

    pub(crate) fn client_handshake(
        _: &mut TcpStream,
        tls: &ClientTls,
        _: &FabricUrl,
        _: std::time::Instant,
    ) -> Result<Session, FabricError> {
        match *tls {}
    }

    pub(crate) fn client_failure(_: &io::Error) -> Option<FabricError> {
        None
    }

    pub(crate) fn server_failure(e: &io::Error) -> String {
        format!("handshake read failed: {e}")
    }

    pub(crate) fn refuse(session: &mut Session, _: &TcpStream, _: &crate::fabric::record::Record) {
        match *session {}
    }

    pub(crate) fn send_nonblocking(session: &mut Session, _: &TcpStream, _: &[u8]) -> bool {
        match *session {}
    }
}

#[cfg(all(feature = "tls", feature = "grpc"))]
pub(crate) use imp::identity_of;
pub use imp::{ClientTls, ServerTls, Session};
pub(crate) use imp::{client_failure, client_handshake, refuse, send_nonblocking, server_failure};
