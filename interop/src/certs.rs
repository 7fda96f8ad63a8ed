//! The interop binaries' test certificates (`--use_tls`, `--use_test_ca`):
//! a test CA and a server certificate it signed, valid for gRPC's interop
//! test name (`foo.test.google.fr`, any `*.test.google.fr`), `localhost`,
//! `127.0.0.1` and `::1`. They are made on first use, not committed (no
//! private key is), and kept in a directory that the server and the
//! client share: `$RPC_INTEROP_CERTS`, else `rdma-rpc-interop-certs` in
//! the system's temporary directory. A client of another implementation
//! trusts them with that directory's `ca.pem`.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rpc_core::tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use std::io;
use std::path::{Path, PathBuf};

/// The name gRPC's interop clients check the server's certificate for
/// (`--server_host_override`'s usual value).
pub const TEST_HOST: &str = "foo.test.google.fr";

/// The test CA's certificate and the server's certificate and key, PEM.
#[derive(Debug, Clone)]
pub struct TestCerts {
    /// Where they are kept.
    pub dir: PathBuf,
    /// The CA's certificate, which clients trust.
    pub ca: String,
    cert: String,
    key: String,
}

impl TestCerts {
    /// The directory the binaries share.
    pub fn default_dir() -> PathBuf {
        std::env::var_os("RPC_INTEROP_CERTS")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("rdma-rpc-interop-certs"))
    }

    /// The certificates kept in `dir`, made there first if it has none.
    /// Two processes that make them at once agree on one set: each makes
    /// its own beside `dir` and renames it into place; the one that loses
    /// reads the winner's.
    pub fn load_or_make(dir: &Path) -> io::Result<TestCerts> {
        if let Ok(certs) = TestCerts::load(dir) {
            return Ok(certs);
        }
        let parent = dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent)?;
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("certs");
        let fresh = parent.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&fresh);
        std::fs::create_dir_all(&fresh)?;
        let (ca, cert, key) = make().map_err(|e| io::Error::other(format!("rcgen: {e}")))?;
        std::fs::write(fresh.join("ca.pem"), &ca)?;
        std::fs::write(fresh.join("server.pem"), &cert)?;
        std::fs::write(fresh.join("server.key"), &key)?;
        if std::fs::rename(&fresh, dir).is_err() {
            // Another process put its own in place first.
            let _ = std::fs::remove_dir_all(&fresh);
        }
        TestCerts::load(dir)
    }

    /// The certificates kept in `dir`.
    pub fn load(dir: &Path) -> io::Result<TestCerts> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.join(name).display())))
        };
        Ok(TestCerts {
            dir: dir.to_owned(),
            ca: read("ca.pem")?,
            cert: read("server.pem")?,
            key: read("server.key")?,
        })
    }

    /// A server's TLS settings, with the test server certificate.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key))
    }

    /// A client's TLS settings, trusting the test CA and checking the
    /// server's certificate for `host`.
    pub fn client_config(&self, host: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .domain_name(host)
    }
}

/// A new test CA, and a server certificate and key it signed.
fn make() -> Result<(String, String, String), rcgen::Error> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "rdma-rpc interop test CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let names = [
        "*.test.google.fr",
        TEST_HOST,
        "localhost",
        "127.0.0.1",
        "::1",
    ];
    let mut server = CertificateParams::new(names.map(String::from).to_vec())?;
    server
        .distinguished_name
        .push(DnType::CommonName, "rdma-rpc interop test server");
    let cert = server.signed_by(&key, &issuer)?;
    Ok((ca_pem, cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_are_made_once_and_then_shared() {
        let dir = std::env::temp_dir().join(format!("interop-certs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = TestCerts::load_or_make(&dir).unwrap();
        let again = TestCerts::load_or_make(&dir).unwrap();
        assert_eq!(first.ca, again.ca, "the second use reads the first's");
        assert!(first.ca.contains("BEGIN CERTIFICATE"));
        assert!(first.key.contains("PRIVATE KEY"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
