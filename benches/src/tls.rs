//! Certificates for `rpc-bench --tls`, made for the run: a CA and a server
//! certificate for `localhost` and the loopback addresses.

use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A CA and the server identity it issued, as PEM.
#[derive(Debug, Clone)]
pub struct TestPki {
    ca: String,
    cert: String,
    key: String,
}

impl TestPki {
    /// Makes a CA and a server certificate for `localhost`, `127.0.0.1`,
    /// `::1` and `host` (the address the benchmark serves on).
    pub fn new(host: &str) -> Result<TestPki, String> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let err = |e: rcgen::Error| format!("cannot make test certificates: {e}");
        let ca_key = KeyPair::generate().map_err(err)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "rpc-bench CA");
        let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
        let issuer = Issuer::new(ca, ca_key);
        let mut names = vec!["localhost".to_owned(), "127.0.0.1".into(), "::1".into()];
        if !names.iter().any(|n| n == host) {
            names.push(host.to_owned());
        }
        let key = KeyPair::generate().map_err(err)?;
        let cert = CertificateParams::new(names)
            .map_err(err)?
            .signed_by(&key, &issuer)
            .map_err(err)?;
        Ok(TestPki {
            ca: ca_cert.pem(),
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// The server's settings.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key))
    }

    /// The clients' settings: they trust the CA.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca))
    }
}
