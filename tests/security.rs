//! Redis security settings with real servers: AUTH with the password from a
//! file or an environment variable, an ACL user, a wrong password, and TLS
//! with a private CA and client certificates (certificates made with the
//! `openssl` command for each run).

mod common;

use std::time::Duration;

use common::{args, Certs, Daemon, Deadline, RedisServer};
use ratelimitd::protocol::{Decision, ErrorCode, Source};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_file_or_env_and_acl_user() {
    // Over TCP, as a networked Redis is reached; the port is confirmed to be
    // this server's, so no other test's server can answer in its place.
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    // An ACL user that may only touch the daemon's keys (set as the default
    // user, whom the helper's connection authenticates as).
    let _: () = redis::cmd("ACL").arg(&["SETUSER", "limiter", "on", ">l1m1ter", "~ratelimitd:*", "+@all"]).query(&mut server.conn()).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let pw = secrets.path().join("redis.pass");
    std::fs::write(&pw, "s3cret\n").unwrap();
    // No credentials in the URL: each daemon gets them the way it tests.
    let url = server.url();

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_a_private_ca() {
    let certs = Certs::make();
    // TLS only, with client certificates required.
    let server = RedisServer::start_tls_with(&certs, &["--tls-auth-clients", "yes"]);
    let url = server.url();
    let tls = Daemon::start(
        Some(&url),
        &format!(
            "tls_ca_file = \"{}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\ntimeout_ms = 500",
            certs.ca().display(),
            certs.client_cert().display(),
            certs.client_key().display()
        ),
    );
    let mut client = tls.client().await;
    let link = Deadline::start("TLS link up", Duration::from_secs(5));
    loop {
        let r = client.check(&args("tls", 5, 1000)).await.unwrap();
        if r.source == Source::Redis {
            assert_eq!(r.decision, Decision::Allowed);
            break;
        }
        link.retry_in(Duration::from_millis(50), || format!("{} / {}", r.message, tls.log())).await;
    }
    // Without the client certificate the server refuses the handshake.
    let no_cert = Daemon::start(Some(&url), &format!("tls_ca_file = \"{}\"", certs.ca().display()));
    let r = no_cert.client().await.check(&args("tls", 5, 1000)).await.unwrap();
    assert_eq!((r.source, r.error), (Source::FailClosed, ErrorCode::CircuitOpen));
}
