//! The configuration in force written back in the file's own terms, for
//! `GET /config` and `ratelimitd config-show`: TOML with the file's table
//! and field names, modes in octal (`socket_mode = "0660"`), durations
//! with their unit (`timeout = "20ms"`), every default written out, old
//! spellings in their new form, the Redis URL without its password.
//! Written from the typed values (what a reload kept running included),
//! so it says what the daemon does, not what the file said; read back, it
//! is the same configuration.

use std::fmt::Write;
use std::time::Duration;

use super::model::{AdminListen, Config, PolicyLimit, RedisTarget, SecretSource};
use super::validate::{duration_text_of, parse_duration};
use crate::window::CALENDAR;

/// `key = value` lines of one table.
#[derive(Default)]
struct Table(String);

impl Table {
    fn put(&mut self, key: &str, value: impl Into<toml::Value>) -> &mut Self {
        let _ = writeln!(self.0, "{key} = {}", value.into());
        self
    }

    fn some(&mut self, key: &str, value: Option<impl Into<toml::Value>>) -> &mut Self {
        if let Some(v) = value {
            self.put(key, v);
        }
        self
    }

    /// `key` = the duration as `written` (the file's text, if it still
    /// means `d`), else in its largest whole unit.
    fn duration(&mut self, key: &str, d: Duration, written: Option<&String>) -> &mut Self {
        let text = match written {
            Some(t) if parse_duration(t).ok() == Some(d) => t.clone(),
            _ => duration_text_of(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        self.put(key, text)
    }

    fn path(&mut self, key: &str, p: Option<&std::path::Path>) -> &mut Self {
        self.some(key, p.map(|p| p.display().to_string()))
    }
}

fn mode(m: u32) -> String {
    format!("{m:04o}")
}

fn int(n: impl TryInto<i64>) -> toml::Value {
    toml::Value::Integer(n.try_into().unwrap_or(i64::MAX))
}

/// `password_file` or `password_env`, as the file names the secret.
fn secret(t: &mut Table, s: Option<&SecretSource>) {
    match s {
        Some(SecretSource::File(p)) => t.path("password_file", Some(p)),
        Some(SecretSource::Env(v)) => t.put("password_env", v.as_str()),
        None => t,
    };
}

impl Config {
    /// The configuration in force, for `GET /config` and `ratelimitd
    /// config-show`: TOML in the file's terms, the Redis URL without its
    /// password (secret sources are files or variables, named, never read
    /// here).
    pub fn dump(&self) -> String {
        to_toml(self)
    }
}

fn to_toml(c: &Config) -> String {
    let mut out = String::new();
    let mut section = |name: &str, t: &Table| {
        let _ = write!(out, "{}[{name}]\n{}", if out.is_empty() { "" } else { "\n" }, t.0);
    };

    let s = &c.server;
    let mut t = Table::default();
    t.path("listen", Some(&s.listen)).put("socket_mode", mode(s.socket_mode)).some("socket_group", s.socket_group.as_deref());
    t.put("max_connections", int(s.max_connections)).put("max_in_flight_per_connection", int(s.max_in_flight_per_connection));
    let w = |path: &str| c.written_durations.get(path);
    t.duration("shutdown_grace", s.shutdown_grace, w("server.shutdown_grace")).duration("idle_timeout", s.idle_timeout, w("server.idle_timeout"));
    t.duration("frame_timeout", s.frame_timeout, w("server.frame_timeout")).duration("write_timeout", s.write_timeout, w("server.write_timeout"));
    t.put("worker_threads", int(s.worker_threads));
    section("server", &t);

    let mut sentinel = None;
    if let Some(r) = &c.redis {
        let mut t = Table::default();
        match &r.target {
            RedisTarget::Url(url) => {
                t.put("url", super::model::redacted_url(url));
            }
            RedisTarget::Cluster(cl) => {
                t.put("cluster", cl.seeds.iter().map(|h| toml::Value::String(h.to_string())).collect::<Vec<_>>()).put("cluster_tls", cl.tls);
            }
            RedisTarget::Sentinel(se) => {
                let mut st = Table::default();
                st.put("master_name", se.master_name.as_str()).put("addresses", se.addresses.iter().map(|h| toml::Value::String(h.to_string())).collect::<Vec<_>>());
                st.some("username", se.username.as_deref());
                secret(&mut st, se.password.as_ref());
                sentinel = Some(st);
            }
        }
        t.some("username", r.username.as_deref());
        secret(&mut t, r.password.as_ref());
        t.path("tls_ca_file", r.tls.ca.as_deref());
        if let Some((cert, key)) = &r.tls.client {
            t.path("tls_cert_file", Some(cert)).path("tls_key_file", Some(key));
        }
        t.duration("timeout", r.timeout, w("redis.timeout")).duration("connect_timeout", r.connect_timeout, w("redis.connect_timeout"));
        t.put("breaker_failures", int(r.breaker_failures)).put("min_in_flight", int(r.min_in_flight)).put("max_in_flight", int(r.max_in_flight));
        t.put("key_prefix", r.key_prefix.as_str()).put("clock", format!("{:?}", r.clock).to_lowercase());
        t.put("quota_leases", r.quota_leases).put("batch_cold_keys", r.batch_cold_keys);
        section("redis", &t);
    }
    if let Some(st) = &sentinel {
        section("redis.sentinel", st);
    }

    let b = &c.limits.bounds;
    let mut t = Table::default();
    t.put("max_key_len", int(b.max_key_len)).put("max_limit", int(b.max_limit)).put("max_window_ms", int(b.max_window_ms)).put("max_cost", int(b.max_cost));
    t.put("max_local_keys", int(c.limits.max_local_keys));
    section("limits", &t);

    let mut t = Table::default();
    t.put("level", c.log.level.as_str()).put("format", format!("{:?}", c.log.format).to_lowercase());
    section("log", &t);

    if let Some(m) = &c.metrics {
        let mut t = Table::default();
        t.put("listen", m.listen.to_string());
        section("metrics", &t);
    }

    let d = &c.denial_cache;
    let mut t = Table::default();
    t.put("enabled", d.enabled).put("slots", int(d.slots)).duration("max_age", d.max_age, w("denial_cache.max_age"));
    section("denial_cache", &t);

    let a = &c.admin;
    let mut t = Table::default();
    match &a.listen {
        Some(AdminListen::Unix { path, mode: m }) => {
            t.path("listen", Some(path)).put("socket_mode", mode(*m));
        }
        Some(AdminListen::Tcp(addr)) => {
            t.put("listen", addr.to_string());
        }
        None => {}
    }
    t.path("token_file", a.token_file.as_deref()).path("read_token_file", a.read_token_file.as_deref());
    t.duration("overrides_refresh", a.overrides_refresh, w("admin.overrides_refresh"));
    if let Some(tls) = &a.tls {
        t.path("tls_cert_file", Some(&tls.cert_file)).path("tls_key_file", Some(&tls.key_file)).path("tls_ca_file", tls.ca_file.as_deref());
    }
    t.put("max_connections", int(a.max_connections)).duration("read_timeout", a.read_timeout, w("admin.read_timeout"));
    section("admin", &t);

    for p in &c.policies {
        let mut t = Table::default();
        t.put("name", p.name.as_str()).put("limit", int(p.limit));
        match (p.lease_ms, p.calendar_window_ms) {
            (Some(lease), _) => {
                t.put("algorithm", "concurrency").duration("lease", Duration::from_millis(u64::from(lease)), w(&format!("policy.{}.lease", p.name)));
            }
            (None, Some(cal)) if cal >= CALENDAR => {
                let code = cal - CALENDAR;
                let (minutes, offset) = (code >> 12, (code & 0xFFF) as i32 - 2048);
                t.put("window", if minutes == 0 { "month".to_string() } else { duration_text_of(u64::from(minutes) * 60_000) });
                if offset != 0 {
                    t.put("utc_offset", format!("{}{:02}:{:02}", if offset < 0 { '-' } else { '+' }, offset.abs() / 60, offset.abs() % 60));
                }
                t.put("algorithm", p.algorithm.as_str());
            }
            (None, _) => {
                t.duration("window", p.window, w(&format!("policy.{}.window", p.name))).put("algorithm", p.algorithm.as_str());
            }
        }
        t.some("on_error", p.fail_policy.map(|f| f.as_str())).some("local_limit", p.local_limit.map(int));
        // Written when not the default: a concurrency policy takes neither.
        if p.shadow {
            t.put("shadow", true);
        }
        if p.shards > 1 {
            t.put("shards", int(p.shards));
        }
        if let Some(pen) = &p.penalty {
            let mut inline = Table::default();
            inline.duration("within", Duration::from_millis(u64::from(pen.within_ms)), w(&format!("policy.{}.penalty.within", p.name)));
            inline.duration("ban", Duration::from_millis(u64::from(pen.ban_ms)), w(&format!("policy.{}.penalty.ban", p.name)));
            let [within, ban] = [0, 1].map(|i| inline.0.lines().nth(i).unwrap_or_default().to_string());
            let _ = writeln!(t.0, "penalty = {{ after = {}, {within}, {ban} }}", pen.after);
        }
        let _ = write!(out, "\n[[policy]]\n{}", t.0);
        if !p.overrides.is_empty() {
            let mut o = Table::default();
            for (key, limit) in &p.overrides {
                // Client keys: always quoted (and escaped).
                let quoted = toml::Value::String(key.clone()).to_string();
                match limit {
                    PolicyLimit::Limit(n) => o.put(&quoted, int(*n)),
                    PolicyLimit::Unlimited => o.put(&quoted, "unlimited"),
                };
            }
            let _ = write!(out, "\n[policy.overrides]\n{}", o.0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::model::Config;
    use std::path::Path;

    /// Read back, the text is the same configuration: every field of the
    /// file has its name and form in it.
    #[test]
    fn the_text_reads_back_as_the_same_configuration() {
        let file = "[server]\nsocket_mode = \"0640\"\nidle_timeout = \"90s\"\n\
            [redis]\nurl = \"redis://u:secret@127.0.0.1:6379/0\"\ntimeout = \"25ms\"\n\
            [metrics]\nlisten = \"127.0.0.1:9464\"\n\
            [[policy]]\nname = \"login\"\nlimit = 5\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\npenalty = { after = 3, within = \"1m\", ban = \"10m\" }\n\
            [policy.overrides]\n\"tenant \\\"x\\\"\" = 50\nvip = \"unlimited\"\n\
            [[policy]]\nname = \"monthly\"\nlimit = 1000\nwindow = \"month\"\nutc_offset = \"-05:30\"\nalgorithm = \"fixed\"\n\
            [[policy]]\nname = \"slots\"\nlimit = 4\nalgorithm = \"concurrency\"\nlease = \"30s\"\n";
        let c = Config::parse(Path::new("t.toml"), file).unwrap();
        let shown = c.dump();
        assert!(shown.contains("socket_mode = \"0640\"\n") && shown.contains("idle_timeout = \"90s\"\n") && shown.contains("timeout = \"25ms\"\n"), "{shown}");
        // Durations as written (60s stays 60s), defaults in their largest unit.
        assert!(shown.contains("window = \"60s\"\n") && shown.contains("shutdown_grace = \"5s\"\n") && shown.contains("ban = \"10m\" }"), "{shown}");
        assert!(shown.contains("url = \"redis://u:***@127.0.0.1:6379/0\"") && !shown.contains("secret"), "{shown}");
        let back = Config::parse(Path::new("shown.toml"), &shown.replace("u:***@", "u:secret@")).unwrap_or_else(|e| panic!("{e}\n{shown}"));
        assert_eq!(back.dump(), shown, "shown again, the same text");
        // The same configuration (the text writes out every default, so
        // its own list of durations as written is longer).
        let typed = |c: &Config| Config { written_durations: Default::default(), ..c.clone() };
        assert_eq!(typed(&back), typed(&c), "{shown}");
    }
}
