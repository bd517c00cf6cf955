//! TLS on the admin API's TCP listener (`[admin] tls_cert_file`,
//! `tls_key_file`), with the rustls (ring) the Redis client brings: the
//! daemon's server configuration, and the command line's client one, which
//! trusts `tls_ca_file` or else the certificate file itself (a self-signed
//! certificate). A token is required on TCP with TLS too: TLS keeps it
//! secret on the wire, the token says who may do what.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::AdminTls;

/// Why a TLS file cannot be used; the message names the field and file.
#[derive(Debug, thiserror::Error)]
#[error("admin.{field} {path}: {message}")]
pub struct TlsFileError {
    field: &'static str,
    path: String,
    message: String,
}

fn problem(field: &'static str, path: &Path, message: impl std::fmt::Display) -> TlsFileError {
    TlsFileError { field, path: path.display().to_string(), message: message.to_string() }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let certs = CertificateDer::pem_file_iter(path).map_err(|e| problem(field, path, e))?.collect::<Result<Vec<_>, _>>().map_err(|e| problem(field, path, e))?;
    if certs.is_empty() {
        return Err(problem(field, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The listener's TLS: the chain and key of `tls`, TLS 1.2 and 1.3,
/// HTTP/1.1 only.
pub fn server_config(tls: &AdminTls) -> Result<Arc<rustls::ServerConfig>, TlsFileError> {
    let chain = certificates("tls_cert_file", &tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file).map_err(|e| problem("tls_key_file", &tls.key_file, e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| problem("tls_cert_file", &tls.cert_file, e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| problem("tls_key_file", &tls.key_file, format!("does not go with the certificate: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The command line's TLS: trusts `tls_ca_file`, or the certificates of
/// `tls_cert_file`.
pub fn client_config(tls: &AdminTls) -> Result<Arc<rustls::ClientConfig>, TlsFileError> {
    let (field, path) = match &tls.ca_file {
        Some(ca) => ("tls_ca_file", ca),
        None => ("tls_cert_file", &tls.cert_file),
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(field, path)? {
        roots.add(cert).map_err(|e| problem(field, path, e))?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().map_err(|e| problem(field, path, e))?.with_root_certificates(roots).with_no_client_auth();
    Ok(Arc::new(cfg))
}
