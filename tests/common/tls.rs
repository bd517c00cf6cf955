//! A private CA and certificates for TLS tests, made with the `openssl`
//! command for each run (nothing long-lived is checked in).

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// `ca.crt`, a server certificate for 127.0.0.1/localhost and a client
/// certificate (clientAuth), all signed by the CA, in a temp dir.
pub struct Certs {
    dir: TempDir,
}

impl Certs {
    pub fn make() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        openssl(d, &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.crt"]);
        for (name, ext) in [("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")] {
            openssl(d, &["req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={name}"), "-keyout", &format!("{name}.key"), "-out", &format!("{name}.csr")]);
            std::fs::write(d.join(format!("{name}.ext")), ext).unwrap();
            openssl(
                d,
                &["x509", "-req", "-in", &format!("{name}.csr"), "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", &format!("{name}.ext"), "-out", &format!("{name}.crt")],
            );
        }
        Self { dir }
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.crt")
    }

    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.dir.path().join("client.crt")
    }

    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client.key")
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl must be installed (scripts/test installs it)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}
