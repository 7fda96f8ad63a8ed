//! TLS for `tcp://` and for the handshake of `rdma://` (feature `tls`, on
//! by default), configured as in tonic.
//!
//! ```ignore
//! use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
//!
//! let identity = Identity::from_pem_files("server.pem", "server.key")?;
//! let server = Server::builder()
//!     .tls_config(ServerTlsConfig::new().identity(identity))?
//!     .add_service(KvServer::new(Store))
//!     .serve("tcp://0.0.0.0:7471")?;
//!
//! let ca = Certificate::from_pem_file("ca.pem")?;
//! let channel = Channel::builder("tcp://kv.example.com:7471")
//!     .tls_config(ClientTlsConfig::new().ca_certificate(ca))?
//!     .connect()?;
//! ```
//!
//! On `tcp://` everything after the TCP connect travels inside TLS: the
//! hello, the authentication records and every call. On `rdma://` TLS
//! covers the handshake over TCP (the hellos, with the ring addresses and
//! keys, and the authentication records); the calls themselves go over the
//! RDMA device and are **not** encrypted by TLS. `mem://` stays inside
//! one process and ignores these settings.
//!
//! The client checks the server's certificate against the CA certificates
//! it is given (there are no built-in roots) and the name it connects to:
//! the URL's host, or [`ClientTlsConfig::domain_name`]. A server with
//! [`ServerTlsConfig::client_ca_root`] requires a client certificate issued
//! by that CA (mutual TLS); handlers then see who the client is in
//! [`Request::peer`](crate::Request::peer): the certificate's first DNS
//! name, else its first URI, else its subject's common name (unless an
//! [`Authenticator`](crate::auth::Authenticator) named the client).
//!
//! Rustls with the `ring` provider: TLS 1.3 and 1.2, no session resumption.

use crate::Status;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::Path;
use std::sync::Arc;

/// A PEM-encoded X.509 certificate, or a chain of them.
#[derive(Clone)]
pub struct Certificate {
    pem: Vec<u8>,
    /// The file it came from, for error messages.
    origin: Option<String>,
}

impl std::fmt::Debug for Certificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Certificate")
            .field("origin", &self.origin)
            .field("pem_len", &self.pem.len())
            .finish()
    }
}

impl Certificate {
    /// A certificate (or a chain) from PEM text: `-----BEGIN CERTIFICATE-----`
    /// blocks. It is parsed when the config is given to a builder, which
    /// fails then if it holds none.
    pub fn from_pem(pem: impl AsRef<[u8]>) -> Certificate {
        Certificate {
            pem: pem.as_ref().to_vec(),
            origin: None,
        }
    }

    /// Reads a PEM file of one or more certificates. Fails, naming the
    /// file, if it cannot be read or holds no certificate.
    pub fn from_pem_file(path: impl AsRef<Path>) -> Result<Certificate, Status> {
        let path = path.as_ref();
        let cert = Certificate {
            pem: read(path, "certificate")?,
            origin: Some(path.display().to_string()),
        };
        cert.parse()?;
        Ok(cert)
    }

    /// The PEM text.
    pub fn get_ref(&self) -> &[u8] {
        &self.pem
    }

    /// Where the certificate came from, in messages.
    fn what(&self) -> String {
        match &self.origin {
            Some(path) => path.clone(),
            None => "the PEM text given".into(),
        }
    }

    fn parse(&self) -> Result<Vec<CertificateDer<'static>>, Status> {
        let certs = CertificateDer::pem_slice_iter(&self.pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                Status::invalid_argument(format!(
                    "{}: not a valid PEM certificate: {e}",
                    self.what()
                ))
            })?;
        if certs.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{}: no certificate in it (expected -----BEGIN CERTIFICATE-----)",
                self.what()
            )));
        }
        Ok(certs)
    }
}

/// A certificate chain and its private key: what a server (or a client,
/// for mutual TLS) proves itself with.
#[derive(Clone)]
pub struct Identity {
    cert: Certificate,
    key: Vec<u8>,
    key_origin: Option<String>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("cert", &self.cert)
            .field("key_origin", &self.key_origin)
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// An identity from PEM text: the certificate chain (leaf first) and
    /// its private key (PKCS#8, PKCS#1 or SEC1). Parsed when the config is
    /// given to a builder.
    pub fn from_pem(cert: impl AsRef<[u8]>, key: impl AsRef<[u8]>) -> Identity {
        Identity {
            cert: Certificate::from_pem(cert),
            key: key.as_ref().to_vec(),
            key_origin: None,
        }
    }

    /// Reads the certificate chain and the private key from PEM files.
    /// Fails, naming the file, if either cannot be read or holds nothing
    /// of the kind.
    pub fn from_pem_files(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<Identity, Status> {
        let key_path = key_path.as_ref();
        let identity = Identity {
            cert: Certificate::from_pem_file(cert_path)?,
            key: read(key_path, "private key")?,
            key_origin: Some(key_path.display().to_string()),
        };
        identity.parse_key()?;
        Ok(identity)
    }

    fn parse_key(&self) -> Result<PrivateKeyDer<'static>, Status> {
        let what = self
            .key_origin
            .clone()
            .unwrap_or_else(|| "the private key PEM given".into());
        PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| {
            Status::invalid_argument(format!(
                "{what}: no usable private key in it (expected -----BEGIN PRIVATE KEY-----, \
                 RSA PRIVATE KEY or EC PRIVATE KEY): {e}"
            ))
        })
    }

    fn parse(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), Status> {
        Ok((self.cert.parse()?, self.parse_key()?))
    }

    /// Names the files, for errors about the pair.
    fn what(&self) -> String {
        match &self.key_origin {
            Some(key) => format!("{} with {key}", self.cert.what()),
            None => "the identity given".into(),
        }
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, Status> {
    std::fs::read(path).map_err(|e| {
        Status::invalid_argument(format!(
            "cannot read the {what} file {}: {e}",
            path.display()
        ))
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server's TLS settings: its identity and, for mutual TLS, the CA its
/// clients' certificates must come from. Given to
/// [`ServerBuilder::tls_config`](crate::ServerBuilder::tls_config).
#[derive(Debug, Clone, Default)]
pub struct ServerTlsConfig {
    identity: Option<Identity>,
    client_ca_root: Option<Certificate>,
    client_auth_optional: bool,
}

impl ServerTlsConfig {
    /// Settings with nothing set yet: an identity is required.
    pub fn new() -> ServerTlsConfig {
        ServerTlsConfig::default()
    }

    /// The certificate chain and key the server presents.
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// Requires clients to present a certificate issued by this CA (mutual
    /// TLS). Handlers see the client's name in
    /// [`Request::peer`](crate::Request::peer).
    pub fn client_ca_root(mut self, ca: Certificate) -> Self {
        self.client_ca_root = Some(ca);
        self
    }

    /// With [`ServerTlsConfig::client_ca_root`]: also admit clients that
    /// present no certificate (those that do must still present a valid one).
    pub fn client_auth_optional(mut self, optional: bool) -> Self {
        self.client_auth_optional = optional;
        self
    }

    /// The rustls configuration, checked (the fabric's `ServerTls` is
    /// built from it).
    pub(crate) fn rustls_config(&self) -> Result<Arc<rustls::ServerConfig>, Status> {
        let identity = self.identity.as_ref().ok_or_else(|| {
            Status::invalid_argument(
                "ServerTlsConfig needs an identity (ServerTlsConfig::identity)",
            )
        })?;
        let (chain, key) = identity.parse()?;
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Status::internal(format!("TLS: {e}")))?;
        let builder = match &self.client_ca_root {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in ca.parse()? {
                    roots.add(cert).map_err(|e| {
                        Status::invalid_argument(format!(
                            "{}: not usable as a CA certificate: {e}",
                            ca.what()
                        ))
                    })?;
                }
                let mut verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                );
                if self.client_auth_optional {
                    verifier = verifier.allow_unauthenticated();
                }
                let verifier = verifier.build().map_err(|e| {
                    Status::invalid_argument(format!("{}: client CA: {e}", ca.what()))
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| {
            Status::invalid_argument(format!(
                "{}: not a usable certificate and key: {e}",
                identity.what()
            ))
        })?;
        // Every connection runs a full handshake: no tickets to keep, and
        // the client's certificate is checked every time.
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(Arc::new(config))
    }
}

/// A client's TLS settings: the CA certificates it trusts, the name the
/// server's certificate must carry, and its own identity for mutual TLS.
/// Given to [`ChannelBuilder::tls_config`](crate::ChannelBuilder::tls_config).
#[derive(Debug, Clone, Default)]
pub struct ClientTlsConfig {
    cas: Vec<Certificate>,
    domain: Option<String>,
    identity: Option<Identity>,
}

impl ClientTlsConfig {
    /// Settings with nothing set yet: at least one CA certificate is required.
    pub fn new() -> ClientTlsConfig {
        ClientTlsConfig::default()
    }

    /// Trusts servers whose certificate this CA issued (call again to
    /// trust several).
    pub fn ca_certificate(mut self, ca: Certificate) -> Self {
        self.cas.push(ca);
        self
    }

    /// The name the server's certificate must be valid for (default: the
    /// URL's host, a DNS name or an IP address).
    pub fn domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain = Some(name.into());
        self
    }

    /// The certificate chain and key this client presents to a server
    /// that asks for one (mutual TLS).
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// The rustls configuration, checked, and the name the server's
    /// certificate must carry if these settings name one (the fabric's
    /// `ClientTls` is built from them).
    #[allow(clippy::type_complexity)]
    pub(crate) fn rustls_config(
        &self,
    ) -> Result<(Arc<rustls::ClientConfig>, Option<ServerName<'static>>), Status> {
        if self.cas.is_empty() {
            return Err(Status::invalid_argument(
                "ClientTlsConfig needs the CA certificate that issued the server's \
                 (ClientTlsConfig::ca_certificate)",
            ));
        }
        let mut roots = rustls::RootCertStore::empty();
        for ca in &self.cas {
            for cert in ca.parse()? {
                roots.add(cert).map_err(|e| {
                    Status::invalid_argument(format!(
                        "{}: not usable as a CA certificate: {e}",
                        ca.what()
                    ))
                })?;
            }
        }
        let domain = match &self.domain {
            None => None,
            Some(d) => Some(ServerName::try_from(d.clone()).map_err(|_| {
                Status::invalid_argument(format!("{d:?} is not a valid TLS server name"))
            })?),
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Status::internal(format!("TLS: {e}")))?
            .with_root_certificates(roots);
        let mut config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some(identity) => {
                let (chain, key) = identity.parse()?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Status::invalid_argument(format!(
                        "{}: not a usable certificate and key: {e}",
                        identity.what()
                    ))
                })?
            }
        };
        config.resumption = rustls::client::Resumption::disabled();
        Ok((Arc::new(config), domain))
    }
}

/// The same settings for tonic (the gRPC face, and `grpc://`), from the
/// same PEM text: tonic parses them again with the same `ring` provider.
#[cfg(feature = "grpc")]
mod for_tonic {
    use super::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
    use tonic::transport as t;

    fn certificate(c: &Certificate) -> t::Certificate {
        t::Certificate::from_pem(&c.pem)
    }

    fn identity(i: &Identity) -> t::Identity {
        t::Identity::from_pem(&i.cert.pem, &i.key)
    }

    impl ServerTlsConfig {
        /// tonic's server settings for the gRPC face.
        pub(crate) fn to_tonic(&self) -> t::ServerTlsConfig {
            let mut config = t::ServerTlsConfig::new();
            if let Some(id) = &self.identity {
                config = config.identity(identity(id));
            }
            if let Some(ca) = &self.client_ca_root {
                config = config
                    .client_ca_root(certificate(ca))
                    .client_auth_optional(self.client_auth_optional);
            }
            config
        }
    }

    impl ClientTlsConfig {
        /// tonic's client settings for a `grpc://` server.
        pub(crate) fn to_tonic(&self) -> t::ClientTlsConfig {
            let mut config =
                t::ClientTlsConfig::new().ca_certificates(self.cas.iter().map(certificate));
            if let Some(domain) = &self.domain {
                config = config.domain_name(domain.clone());
            }
            if let Some(id) = &self.identity {
                config = config.identity(identity(id));
            }
            config
        }

        /// Whether `other` says the same (the same PEM text and name).
        pub(crate) fn same_as(&self, other: &ClientTlsConfig) -> bool {
            fn id(i: &Option<Identity>) -> Option<(&[u8], &[u8])> {
                i.as_ref().map(|i| (&i.cert.pem[..], &i.key[..]))
            }
            self.domain == other.domain
                && self
                    .cas
                    .iter()
                    .map(|c| &c.pem)
                    .eq(other.cas.iter().map(|c| &c.pem))
                && id(&self.identity) == id(&other.identity)
        }
    }
}
