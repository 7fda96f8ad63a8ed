//! Certificates for the TLS tests, made when a test runs: a CA, and
//! leaves it issues for servers and clients. No private key is committed.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A certificate authority.
pub struct Ca {
    /// Its certificate, PEM.
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("a CA certificate");
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Its certificate, to trust.
    pub fn certificate(&self) -> Certificate {
        Certificate::from_pem(&self.pem)
    }

    /// A leaf certificate and its key, PEM, for `names` (DNS names or IP
    /// addresses; none for a certificate that has only `common_name`).
    pub fn leaf(&self, names: &[&str], common_name: &str) -> (String, String) {
        let key = KeyPair::generate().expect("a leaf key");
        let owned: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(owned).expect("valid names");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let cert = params.signed_by(&key, &self.issuer).expect("a leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// A leaf for a URI name (a SPIFFE ID, say).
    pub fn leaf_with_uri(&self, uri: &str) -> (String, String) {
        let key = KeyPair::generate().expect("a leaf key");
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::URI(uri.try_into().unwrap())];
        let cert = params.signed_by(&key, &self.issuer).expect("a leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// An identity for `names`.
    pub fn identity(&self, names: &[&str], common_name: &str) -> Identity {
        let (cert, key) = self.leaf(names, common_name);
        Identity::from_pem(cert, key)
    }

    /// A server identity valid for the host of `url` (and `localhost`,
    /// `server.test`).
    pub fn server_identity(&self, url: &str) -> Identity {
        let host = host_of(url);
        let mut names = vec!["localhost", "server.test", "127.0.0.1"];
        if !names.contains(&host.as_str()) {
            names.push(&host);
        }
        self.identity(&names, "test server")
    }

    /// TLS settings for a server at `url` with a certificate from this CA.
    pub fn server_config(&self, url: &str) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.server_identity(url))
    }

    /// TLS settings for a client that trusts this CA.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.certificate())
    }
}

/// The host of a `tcp://` or `rdma://` URL.
pub fn host_of(url: &str) -> String {
    rpc_core::fabric::FabricUrl::parse(url)
        .expect("a valid URL")
        .host
}
