//! Endpoint URLs: `mem://name`, `tcp://host:port`, `rdma://host:port[?device=NAME&gid=N]`,
//! and, for clients, `grpc://host:port` (a standard gRPC server).

use super::FabricError;
use std::fmt;

/// Which fabric a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// In-process software fabric.
    Mem,
    /// Software fabric over TCP.
    Tcp,
    /// Real RDMA verbs.
    Rdma,
    /// A standard gRPC server (HTTP/2), reached through tonic (clients
    /// only; feature `grpc`).
    Grpc,
}

/// A parsed endpoint URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricUrl {
    /// The fabric.
    pub scheme: Scheme,
    /// `mem`: the endpoint name; otherwise the host (IPv6 without brackets).
    pub host: String,
    /// The port (0 for `mem`, or to let a listener choose).
    pub port: u16,
    /// Query parameters, in order.
    pub params: Vec<(String, String)>,
}

impl FabricUrl {
    /// Parses and validates a URL.
    pub fn parse(url: &str) -> Result<FabricUrl, FabricError> {
        let bad = |why: String| FabricError::invalid("parse url", why);
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            bad(format!(
                "{url:?} is not a URL; expected mem://name, tcp://host:port or rdma://host:port"
            ))
        })?;
        let scheme = match scheme {
            "mem" => Scheme::Mem,
            "tcp" => Scheme::Tcp,
            "rdma" => Scheme::Rdma,
            "grpc" => Scheme::Grpc,
            other => {
                return Err(bad(format!(
                    "unknown scheme {other:?} in {url:?}; expected mem://, tcp://, rdma:// or grpc://"
                )));
            }
        };
        let (authority, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let mut params = Vec::new();
        for pair in query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            params.push((k.to_owned(), v.to_owned()));
        }
        if scheme == Scheme::Mem {
            let ok = !authority.is_empty()
                && authority
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok {
                return Err(bad(format!(
                    "mem:// needs a name of letters, digits, '.', '_' or '-', got {authority:?}"
                )));
            }
            return Ok(FabricUrl {
                scheme,
                host: authority.to_owned(),
                port: 0,
                params,
            });
        }
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| bad(format!("{url:?} needs host:port")))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() {
            return Err(bad(format!("{url:?} has an empty host")));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| bad(format!("{url:?} has an invalid port {port:?}")))?;
        Ok(FabricUrl {
            scheme,
            host: host.to_owned(),
            port,
            params,
        })
    }

    /// `host:port` for socket APIs (IPv6 hosts bracketed).
    pub fn socket_addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The value of query parameter `key`.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Display for FabricUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scheme {
            Scheme::Mem => write!(f, "mem://{}", self.host)?,
            Scheme::Tcp => write!(f, "tcp://{}", self.socket_addr())?,
            Scheme::Rdma => write!(f, "rdma://{}", self.socket_addr())?,
            Scheme::Grpc => write!(f, "grpc://{}", self.socket_addr())?,
        }
        for (i, (k, v)) in self.params.iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { '?' } else { '&' })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_scheme() {
        let u = FabricUrl::parse("mem://demo").unwrap();
        assert_eq!((u.scheme, u.host.as_str()), (Scheme::Mem, "demo"));
        let u = FabricUrl::parse("tcp://127.0.0.1:7471").unwrap();
        assert_eq!(
            (u.scheme, u.socket_addr().as_str()),
            (Scheme::Tcp, "127.0.0.1:7471")
        );
        let u = FabricUrl::parse("rdma://[::1]:9?device=rxe0&gid=1").unwrap();
        assert_eq!(u.scheme, Scheme::Rdma);
        assert_eq!(u.socket_addr(), "[::1]:9");
        assert_eq!(u.param("device"), Some("rxe0"));
        assert_eq!(u.param("gid"), Some("1"));
        assert_eq!(u.to_string(), "rdma://[::1]:9?device=rxe0&gid=1");
    }

    #[test]
    fn rejects_bad_urls_with_a_reason() {
        for bad in [
            "demo",
            "http://x:1",
            "tcp://x",
            "tcp://:1",
            "tcp://x:99999",
            "mem://",
            "mem://a b",
        ] {
            let e = FabricUrl::parse(bad).unwrap_err();
            assert!(!e.to_string().is_empty(), "{bad}");
        }
        assert!(
            FabricUrl::parse("http://x:1")
                .unwrap_err()
                .to_string()
                .contains("mem://")
        );
    }
}
