//! TLS on the admin API's TCP listener (docs/ADMIN.md, "TCP and TLS"),
//! against the real daemon binary: certificates made for each run with
//! `openssl` (a self-signed one, and one signed by a private CA); the API
//! answers over TLS only, still requires its token, and the command line
//! reaches it trusting `tls_ca_file` or the certificate itself. Without
//! Redis: the penalty box's bans of the memory backend are what is asked.

mod common;

use std::path::Path;
use std::process::Command;

use common::ports::on_own_port;
use common::{Certs, Daemon};
use ratelimitd::admin_api::client::{request, request_with};
use ratelimitd::admin_api::tls::client_config;
use ratelimitd::config::{AdminListen, AdminTls};

const POLICIES: &str = "[[policy]]\nname = \"login\"\nlimit = 2\nwindow = \"1s\"\npenalty = { after = 3, within = \"10s\", ban = \"3s\" }\n";

/// A self-signed certificate for 127.0.0.1 (CA:FALSE: a certificate that is
/// its own trust anchor must not be a CA's, for rustls) in `dir`.
fn self_signed(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("admin.crt"), dir.join("admin.key"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ratelimitd-admin", "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:FALSE", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl must be installed");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (cert, key)
}

/// A daemon with the admin API on a TCP port of its own, `tls` lines in `[admin]`.
fn daemon(token_file: &Path, tls: &str) -> (Daemon, u16) {
    on_own_port("ratelimitd admin", |port| {
        Daemon::try_start_config(&format!("[admin]\nlisten = \"127.0.0.1:{port}\"\ntoken_file = \"{}\"\n{tls}\n{POLICIES}", token_file.display())).map(|d| (d, port))
    })
}

fn tcp(port: u16) -> AdminListen {
    AdminListen::Tcp(format!("127.0.0.1:{port}").parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_listener_speaks_tls_only_and_still_requires_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let (cert, key) = self_signed(dir.path());
    let (d, port) = daemon(&token, &format!("tls_cert_file = \"{}\"\ntls_key_file = \"{}\"", cert.display(), key.display()));
    let trust = client_config(&AdminTls { cert_file: cert.clone(), key_file: key.clone(), ca_file: None }).unwrap();

    // Over TLS with the token: answered.
    let r = request_with(&tcp(port), Some(trust.clone()), Some("s3cret"), "GET", "/v1/bans", None).unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body);
    // Over TLS without it, or with another: refused.
    let r = request_with(&tcp(port), Some(trust.clone()), None, "GET", "/v1/bans", None).unwrap();
    assert_eq!(r.status, 401, "{:?}", r.body);
    let r = request_with(&tcp(port), Some(trust.clone()), Some("guess"), "DELETE", "/v1/bans?policy=login&key=k", None).unwrap();
    assert_eq!((r.status, r.body["error"].as_str()), (401, Some("wrong token")));
    // Plain HTTP to the TLS port: no answer at all (the handshake fails).
    assert!(request(&tcp(port), Some("s3cret"), "GET", "/v1/bans", None).is_err(), "plain HTTP was answered");
    // A client that trusts another certificate does not talk to it.
    let other = tempfile::tempdir().unwrap();
    let (other_cert, other_key) = self_signed(other.path());
    let stranger = client_config(&AdminTls { cert_file: other_cert, key_file: other_key, ca_file: None }).unwrap();
    assert!(request_with(&tcp(port), Some(stranger), Some("s3cret"), "GET", "/v1/bans", None).is_err(), "a certificate the client does not trust was accepted");
    // The command line reads the same [admin] and trusts the certificate itself.
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["ban", "--config"]).arg(&d.config).arg("list").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("no key is banned"), "{text}");
    assert!(d.log().contains("tls=true"), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_signed_by_a_private_ca_is_trusted_through_tls_ca_file() {
    let certs = Certs::make();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret").unwrap();
    let tls = format!("tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\ntls_ca_file = \"{}\"", certs.server_cert().display(), certs.server_key().display(), certs.ca().display());
    let (d, port) = daemon(&token, &tls);
    let mut c = d.client().await;
    for _ in 0..5 {
        c.check_policy(&ratelimitd::protocol::PolicyCheckArgs { policy: b"login", key: b"k1", cost: 1, on_error: ratelimitd::protocol::FailPolicy::Closed, local_limit: 0 }).await.unwrap();
    }
    let trust = client_config(&AdminTls { cert_file: certs.server_cert(), key_file: certs.server_key(), ca_file: Some(certs.ca()) }).unwrap();
    let r = request_with(&tcp(port), Some(trust), Some("s3cret"), "GET", "/v1/bans", None).unwrap();
    assert_eq!(r.body["bans"][0]["key"], serde_json::json!("k1"), "{:?}", r.body);
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["ban", "--config"]).arg(&d.config).args(["lift", "--policy", "login", "--key", "k1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("ban lifted"), "{text}");
}

#[test]
fn unusable_tls_files_stop_the_daemon_with_the_field_and_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret").unwrap();
    let (cert, key) = self_signed(dir.path());
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let other = tempfile::tempdir().unwrap();
    let (_, other_key) = self_signed(other.path());
    for (tls, says) in [
        (format!("tls_cert_file = \"{}\"\ntls_key_file = \"{}\"", not_pem.display(), key.display()), format!("admin.tls_cert_file {}: holds no PEM certificate", not_pem.display())),
        (format!("tls_cert_file = \"{}\"\ntls_key_file = \"{}\"", cert.display(), dir.path().join("missing.key").display()), "admin.tls_key_file".to_string()),
        (format!("tls_cert_file = \"{}\"\ntls_key_file = \"{}\"", cert.display(), other_key.display()), "does not go with the certificate".to_string()),
    ] {
        let e = Daemon::try_start_config(&format!("[admin]\nlisten = \"127.0.0.1:1\"\ntoken_file = \"{}\"\n{tls}\n", token.display())).err().expect("started with unusable TLS files");
        assert!(e.contains(&says), "{says:?} not in:\n{e}");
    }
}
