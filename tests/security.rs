//! Redis security settings with real servers: AUTH with the password from a
//! file or an environment variable, an ACL user, a wrong password, and TLS
//! with a private CA and client certificates (certificates made with the
//! `openssl` command for each run).

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{args, Daemon};
use ratelimitd::protocol::{Decision, ErrorCode, Source};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Server {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_with(args: &[&str], ready: impl Fn() -> bool) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir.path())
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !ready() {
        assert!(t0.elapsed() < Duration::from_secs(10), "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Server { child, _dir: dir }
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_file_or_env_and_acl_user() {
    let port = free_port();
    let p = port.to_string();
    let _redis = redis_with(&["--port", &p, "--requirepass", "s3cret"], || port_open(port));
    // An ACL user that may only touch the daemon's keys.
    let admin = redis::Client::open(format!("redis://:s3cret@127.0.0.1:{port}/0").as_str()).unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "limiter", "on", ">l1m1ter", "~ratelimitd:*", "+@all"])
        .query(&mut admin.get_connection().unwrap())
        .unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let pw = secrets.path().join("redis.pass");
    std::fs::write(&pw, "s3cret\n").unwrap();
    let url = format!("redis://127.0.0.1:{port}/0");

    let from_file = Daemon::start(Some(&url), &format!("password_file = \"{}\"", pw.display()));
    let r = from_file.client().await.check(&args("auth", 5, 1000)).await.unwrap();
    assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Redis), "{}", r.message);

    // The environment of the daemon process (set in its config through a
    // variable the test process also has).
    std::env::set_var("RATELIMITD_TEST_REDIS_PASSWORD", "s3cret");
    let from_env = Daemon::start(Some(&url), "password_env = \"RATELIMITD_TEST_REDIS_PASSWORD\"");
    let r = from_env.client().await.check(&args("auth", 5, 1000)).await.unwrap();
    assert_eq!((r.source, r.count), (Source::Redis, 2));

    let acl_pw = secrets.path().join("acl.pass");
    std::fs::write(&acl_pw, "l1m1ter").unwrap();
    let acl = Daemon::start(Some(&url), &format!("username = \"limiter\"\npassword_file = \"{}\"", acl_pw.display()));
    let r = acl.client().await.check(&args("auth", 5, 1000)).await.unwrap();
    assert_eq!((r.source, r.count), (Source::Redis, 3));

    // A wrong password: the link never comes up; requests get their policy at once.
    let bad = secrets.path().join("bad.pass");
    std::fs::write(&bad, "nope").unwrap();
    let wrong = Daemon::start(Some(&url), &format!("password_file = \"{}\"", bad.display()));
    let r = wrong.client().await.check(&args("auth", 5, 1000)).await.unwrap();
    assert_eq!((r.decision, r.source, r.error), (Decision::Denied, Source::FailClosed, ErrorCode::CircuitOpen));
    assert!(!wrong.log().contains("nope"), "the password never reaches the log");
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl must be installed (scripts/test installs it)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, a server certificate for 127.0.0.1/localhost and a client certificate.
fn make_certs(dir: &Path) {
    openssl(dir, &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.crt"]);
    for (name, ext) in [("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")] {
        openssl(dir, &["req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={name}"), "-keyout", &format!("{name}.key"), "-out", &format!("{name}.csr")]);
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        openssl(
            dir,
            &["x509", "-req", "-in", &format!("{name}.csr"), "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", &format!("{name}.ext"), "-out", &format!("{name}.crt")],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_a_private_ca() {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let c = |f: &str| certs.path().join(f).display().to_string();
    let port = free_port();
    let p = port.to_string();
    let _redis = redis_with(
        &["--port", "0", "--tls-port", &p, "--tls-cert-file", &c("server.crt"), "--tls-key-file", &c("server.key"), "--tls-ca-cert-file", &c("ca.crt"), "--tls-auth-clients", "yes"],
        || port_open(port),
    );
    let url = format!("rediss://127.0.0.1:{port}/0");
    let tls = Daemon::start(
        Some(&url),
        &format!("tls_ca_file = \"{}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\ntimeout_ms = 500", c("ca.crt"), c("client.crt"), c("client.key")),
    );
    let mut client = tls.client().await;
    let t0 = Instant::now();
    loop {
        let r = client.check(&args("tls", 5, 1000)).await.unwrap();
        if r.source == Source::Redis {
            assert_eq!(r.decision, Decision::Allowed);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "TLS link never came up: {} / {}", r.message, tls.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Without the client certificate the server refuses the handshake.
    let no_cert = Daemon::start(Some(&url), &format!("tls_ca_file = \"{}\"", c("ca.crt")));
    let r = no_cert.client().await.check(&args("tls", 5, 1000)).await.unwrap();
    assert_eq!((r.source, r.error), (Source::FailClosed, ErrorCode::CircuitOpen));
}
