//! What a valid configuration needs from the outside world, fetched once per
//! load: the passwords (from files or the environment), the TLS material,
//! and the socket group's id. Kept apart from the pure validation so that
//! `check-config` and a reload report these failures the same way, and so
//! that nothing downstream reads a file or looks up a group again.

use std::path::{Path, PathBuf};

use super::model::{Config, ConfigError, Problems, RedisTarget, SecretSource};

/// What `preflight` fetched.
#[derive(Clone, Default)]
pub struct Resolved {
    /// The gid of `server.socket_group`.
    pub socket_gid: Option<u32>,
    /// Secrets and TLS material of `[redis]`.
    pub redis: RedisSecrets,
}

/// Secrets are never printed: `Debug` shows only whether each is set.
#[derive(Clone, Default)]
pub struct RedisSecrets {
    /// The master's password.
    pub password: Option<String>,
    /// The sentinels' password.
    pub sentinel_password: Option<String>,
    /// PEM material; `None` without TLS files.
    pub tls: Option<TlsMaterial>,
}

/// PEM bytes of the TLS files.
#[derive(Clone, Default)]
pub struct TlsMaterial {
    pub ca: Option<Vec<u8>>,
    /// Client certificate and key (mutual TLS).
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("socket_gid", &self.socket_gid)
            .field("password", &self.redis.password.as_ref().map(|_| "***"))
            .field("sentinel_password", &self.redis.sentinel_password.as_ref().map(|_| "***"))
            .field("tls", &self.redis.tls.is_some())
            .finish()
    }
}

/// Fetches what `cfg` names; every failure is reported, with the field.
/// `origin` names the configuration in errors.
pub fn preflight(cfg: &Config, origin: &Path) -> Result<Resolved, ConfigError> {
    let mut p = Problems::default();
    let mut resolved = Resolved::default();
    if let Some(group) = &cfg.server.socket_group {
        match nix::unistd::Group::from_name(group) {
            Ok(Some(g)) => resolved.socket_gid = Some(g.gid.as_raw()),
            Ok(None) => p.add("server.socket_group", format!("group '{group}' does not exist")),
            Err(e) => p.add("server.socket_group", format!("cannot look up group '{group}': {e}")),
        }
    }
    if let Some(r) = &cfg.redis {
        resolved.redis.password = read_secret(&mut p, ("redis.password_file", "redis.password_env"), r.password.as_ref());
        if let RedisTarget::Sentinel(s) = &r.target {
            resolved.redis.sentinel_password = read_secret(&mut p, ("redis.sentinel.password_file", "redis.sentinel.password_env"), s.password.as_ref());
        }
        if r.tls.ca.is_some() || r.tls.client.is_some() {
            let ca = r.tls.ca.as_ref().and_then(|path| read_pem(&mut p, "redis.tls_ca_file", path));
            let client = r.tls.client.as_ref().and_then(|(cert, key)| {
                let cert = read_pem(&mut p, "redis.tls_cert_file", cert);
                let key = read_pem(&mut p, "redis.tls_key_file", key);
                cert.zip(key)
            });
            resolved.redis.tls = Some(TlsMaterial { ca, client });
        }
    }
    p.into_result(origin, resolved)
}

/// The first line of a file, or an environment variable; never empty.
fn read_secret(p: &mut Problems, fields: (&'static str, &'static str), source: Option<&SecretSource>) -> Option<String> {
    match source? {
        SecretSource::File(path) => match std::fs::read_to_string(path) {
            Ok(text) => match text.lines().next().unwrap_or("") {
                "" => {
                    p.add(fields.0, format!("{} is empty", path.display()));
                    None
                }
                line => Some(line.to_string()),
            },
            Err(e) => {
                p.add(fields.0, format!("cannot read {}: {e}", path.display()));
                None
            }
        },
        SecretSource::Env(var) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => Some(v),
            _ => {
                p.add(fields.1, format!("environment variable {var} is not set"));
                None
            }
        },
    }
}

fn read_pem(p: &mut Problems, field: &'static str, path: &PathBuf) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            p.add(field, format!("{}: {e}", path.display()));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str) -> Result<Resolved, String> {
        let path = Path::new("test.toml");
        let cfg = Config::parse(path, text).map_err(|e| e.to_string())?;
        preflight(&cfg, path).map_err(|e| e.to_string())
    }

    #[test]
    fn secrets_come_from_a_file_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        std::fs::write(&f, "s3cret\nsecond line\n").unwrap();
        let r = run(&format!("[redis]\npassword_file = \"{}\"\n", f.display())).unwrap();
        assert_eq!(r.redis.password.as_deref(), Some("s3cret"));
        assert!(!format!("{r:?}").contains("s3cret"));
        let e = run("[redis]\npassword_env = \"RATELIMITD_TEST_UNSET_VAR\"\n").unwrap_err();
        assert_eq!(e, "test.toml: redis.password_env: environment variable RATELIMITD_TEST_UNSET_VAR is not set");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let e = run(&format!("[redis]\npassword_file = \"{}\"\n", empty.display())).unwrap_err();
        assert!(e.ends_with("is empty"), "{e}");
    }

    #[test]
    fn every_missing_file_and_group_is_reported() {
        let e = run("[server]\nsocket_group = \"no-such-group-xyz\"\n[redis]\nurl = \"rediss://h\"\ntls_ca_file = \"/nonexistent/ca.pem\"\npassword_file = \"/nonexistent/pw\"\n").unwrap_err();
        let lines: Vec<_> = e.lines().collect();
        assert_eq!(lines.len(), 3, "{e}");
        assert!(lines[0].contains("server.socket_group: group 'no-such-group-xyz' does not exist"), "{e}");
        assert!(lines[1].contains("redis.password_file: cannot read /nonexistent/pw"), "{e}");
        assert!(lines[2].contains("redis.tls_ca_file: /nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn the_group_is_resolved_to_its_id() {
        let r = run("[server]\nsocket_group = \"root\"\n").unwrap();
        assert_eq!(r.socket_gid, Some(0));
    }
}
