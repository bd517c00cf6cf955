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

use super::model::{AdminListen, Config, DescriptorMode, EnvoyHeaderStyle, PolicyConfig, PolicyLimit, RedisTarget, SecretSource};
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

/// The text being written: `[table]`s in the file's order.
struct Dump<'a> {
    c: &'a Config,
    out: String,
}

fn to_toml(c: &Config) -> String {
    let mut d = Dump { c, out: String::new() };
    d.server();
    d.redis();
    d.limits_and_log();
    d.denial_cache_and_admin();
    d.envoy();
    d.policies();
    d.out
}

impl Dump<'_> {
    /// `[name]` and its lines, a blank line before every table but the first.
    fn section(&mut self, name: &str, t: &Table) {
        let _ = write!(self.out, "{}[{name}]\n{}", if self.out.is_empty() { "" } else { "\n" }, t.0);
    }

    /// `[[name]]` and its lines.
    fn array_entry(&mut self, name: &str, t: &Table) {
        let _ = write!(self.out, "\n[[{name}]]\n{}", t.0);
    }

    /// The file's text of the duration at `path` (`server.idle_timeout`).
    fn written(&self, path: &str) -> Option<&String> {
        self.c.written_durations.get(path)
    }

    fn server(&mut self) {
        let s = &self.c.server;
        let w = |path: &str| self.written(path);
        let mut t = Table::default();
        t.path("listen", Some(&s.listen)).put("socket_mode", mode(s.socket_mode)).some("socket_group", s.socket_group.as_deref());
        t.put("max_connections", int(s.max_connections)).put("max_in_flight_per_connection", int(s.max_in_flight_per_connection));
        t.duration("shutdown_grace", s.shutdown_grace, w("server.shutdown_grace")).duration("idle_timeout", s.idle_timeout, w("server.idle_timeout"));
        t.duration("frame_timeout", s.frame_timeout, w("server.frame_timeout")).duration("write_timeout", s.write_timeout, w("server.write_timeout"));
        t.put("worker_threads", int(s.worker_threads)).put("spin_us", int(s.spin.as_micros()));
        self.section("server", &t);
    }

    /// `[redis]`, and `[redis.sentinel]` after it for a Sentinel.
    fn redis(&mut self) {
        let Some(r) = &self.c.redis else { return };
        let w = |path: &str| self.written(path);
        let mut t = Table::default();
        let mut sentinel = None;
        match &r.target {
            RedisTarget::Url(url) => {
                t.put("url", super::model::redacted_url(url));
            }
            RedisTarget::Cluster(cl) => {
                t.put("cluster", strings(cl.seeds.iter().map(ToString::to_string))).put("cluster_tls", cl.tls);
            }
            RedisTarget::Sentinel(se) => {
                let mut st = Table::default();
                st.put("master_name", se.master_name.as_str()).put("addresses", strings(se.addresses.iter().map(ToString::to_string)));
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
        self.section("redis", &t);
        if let Some(st) = &sentinel {
            self.section("redis.sentinel", st);
        }
    }

    /// `[limits]`, `[log]` and `[metrics]`: no duration among them.
    fn limits_and_log(&mut self) {
        let c = self.c;
        let b = &c.limits.bounds;
        let mut t = Table::default();
        t.put("max_key_len", int(b.max_key_len)).put("max_limit", int(b.max_limit)).put("max_window_ms", int(b.max_window_ms)).put("max_cost", int(b.max_cost));
        t.put("max_local_keys", int(c.limits.max_local_keys));
        self.section("limits", &t);

        let mut t = Table::default();
        t.put("level", c.log.level.as_str()).put("format", format!("{:?}", c.log.format).to_lowercase());
        self.section("log", &t);

        if let Some(m) = &c.metrics {
            let mut t = Table::default();
            t.put("listen", m.listen.to_string());
            self.section("metrics", &t);
        }
    }

    fn denial_cache_and_admin(&mut self) {
        let w = |path: &str| self.written(path);
        let d = &self.c.denial_cache;
        let mut dt = Table::default();
        dt.put("enabled", d.enabled).put("slots", int(d.slots)).duration("max_age", d.max_age, w("denial_cache.max_age"));

        let a = &self.c.admin;
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
        self.section("denial_cache", &dt);
        self.section("admin", &t);
    }

    /// `[envoy]` and its `[[envoy.route]]`s, as the file wrote them.
    fn envoy(&mut self) {
        let Some(e) = &self.c.envoy else { return };
        let mut t = Table::default();
        t.some("listen", e.listen.map(|a| a.to_string())).path("socket", e.socket.as_deref()).put("socket_mode", mode(e.socket_mode));
        t.put("config", strings(e.written.config.iter().map(|p| p.display().to_string()))).some("algorithm", e.written.algorithm.as_deref()).some("on_error", e.written.on_error.as_deref());
        t.put("descriptors", match e.descriptors {
            DescriptorMode::AllOrNothing => "all_or_nothing",
            DescriptorMode::Each => "each",
        });
        t.put("header_style", match e.header_style {
            EnvoyHeaderStyle::None => "none",
            EnvoyHeaderStyle::Ratelimit => "ratelimit",
            EnvoyHeaderStyle::X => "x",
            EnvoyHeaderStyle::Draft => "draft",
        });
        t.put("max_connections", int(e.max_connections));
        self.section("envoy", &t);
        for (domain, descriptor, policy) in &e.written.routes {
            let mut r = Table::default();
            r.put("domain", domain.as_str()).put("descriptor", strings(descriptor.iter().cloned())).put("policy", policy.as_str());
            self.array_entry("envoy.route", &r);
        }
    }

    /// Every `[[policy]]` the file wrote as a table (the YAML files' limits
    /// are shown as the files `[envoy]` names, not as tables).
    fn policies(&mut self) {
        let c = self.c;
        for p in c.policies.iter().filter(|p| !c.envoy.as_ref().is_some_and(|e| e.written.yaml_policies.contains(&p.name))) {
            let t = self.policy(p);
            self.array_entry("policy", &t);
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
                let _ = write!(self.out, "\n[policy.overrides]\n{}", o.0);
            }
        }
    }

    fn policy(&self, p: &PolicyConfig) -> Table {
        let w = |field: &str| self.written(&format!("policy.{}.{field}", p.name));
        let r = &p.rule;
        let mut t = Table::default();
        t.put("name", p.name.as_str()).put("limit", int(r.limit));
        let ms = |ms: u32| Duration::from_millis(u64::from(ms));
        match (r.lease_ms, r.calendar_window_ms()) {
            (Some(lease), _) => {
                t.put("algorithm", "concurrency").duration("lease", ms(lease), w("lease"));
            }
            (None, Some(cal)) => {
                let code = cal - CALENDAR;
                let (minutes, offset) = (code >> 12, (code & 0xFFF) as i32 - 2048);
                t.put("window", if minutes == 0 { "month".to_string() } else { duration_text_of(u64::from(minutes) * 60_000) });
                if offset != 0 {
                    t.put("utc_offset", format!("{}{:02}:{:02}", if offset < 0 { '-' } else { '+' }, offset.abs() / 60, offset.abs() % 60));
                }
                t.put("algorithm", r.algorithm.as_str());
            }
            (None, None) => {
                t.duration("window", ms(r.window_ms), w("window")).put("algorithm", r.algorithm.as_str());
            }
        }
        t.some("on_error", r.fail_policy.map(|f| f.as_str())).some("local_limit", r.local_limit.map(int));
        // Written when not the default: a concurrency policy takes neither.
        if r.shadow {
            t.put("shadow", true);
        }
        if r.shards > 1 {
            t.put("shards", int(r.shards));
        }
        if let Some(pen) = &r.penalty {
            let mut inline = Table::default();
            inline.duration("within", ms(pen.within_ms), w("penalty.within"));
            inline.duration("ban", ms(pen.ban_ms), w("penalty.ban"));
            let [within, ban] = [0, 1].map(|i| inline.0.lines().nth(i).unwrap_or_default().to_string());
            let _ = writeln!(t.0, "penalty = {{ after = {}, {within}, {ban} }}", pen.after);
        }
        t
    }
}

/// A TOML array of strings.
fn strings(items: impl Iterator<Item = String>) -> toml::Value {
    toml::Value::Array(items.map(toml::Value::String).collect())
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

    /// `[envoy]` as the file wrote it: its YAML files named, not their
    /// limits as tables; the routes; read back, the same configuration.
    #[test]
    fn envoy_is_shown_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("rl.yaml");
        std::fs::write(&yaml, "domain: edge\ndescriptors:\n  - key: ip\n    rate_limit: { unit: second, requests_per_unit: 5 }\n").unwrap();
        let file = format!("[envoy]\nlisten = \"127.0.0.1:8081\"\nconfig = [{:?}]\n[[envoy.route]]\ndomain = \"edge\"\ndescriptor = [\"tenant\"]\npolicy = \"per_tenant\"\n[[policy]]\nname = \"per_tenant\"\nlimit = 10\nwindow = \"1m\"\n", yaml.display().to_string());
        let c = Config::parse(Path::new("t.toml"), &file).unwrap_or_else(|e| panic!("{e}"));
        let shown = c.dump();
        assert!(shown.contains("[envoy]\nlisten = \"127.0.0.1:8081\"\n") && shown.contains("[[envoy.route]]\ndomain = \"edge\"\ndescriptor = [\"tenant\"]\npolicy = \"per_tenant\"\n"), "{shown}");
        assert!(!shown.contains("name = \"edge.ip\""), "the YAML's limit is the file's, not a table: {shown}");
        let back = Config::parse(Path::new("shown.toml"), &shown).unwrap_or_else(|e| panic!("{e}\n{shown}"));
        assert_eq!(back.dump(), shown);
        let typed = |c: &Config| Config { written_durations: Default::default(), ..c.clone() };
        assert_eq!(typed(&back), typed(&c), "{shown}");
    }
}
