//! The daemon's logs: to stderr or the journal, one line per event, the
//! level changeable on SIGHUP.

use ratelimitd::config::LogFormat;
use ratelimitd::daemon::SetLogLevel;

/// Logs to stderr; returns how to change the level later (SIGHUP). A
/// `RUST_LOG` in the environment wins over `log.level`, then and later.
/// The libraries' `log` lines (the Redis client's) come through
/// `LibraryLog`: at most one a second from each of their modules.
pub fn init(level: &str, format: LogFormat) -> SetLogLevel {
    use ratelimitd::log_limit::LibraryLog;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{fmt, reload, EnvFilter, Layer};
    let from_env = EnvFilter::try_from_default_env().ok();
    let env_set = from_env.is_some();
    let (filter, handle) = reload::Layer::new(from_env.unwrap_or_else(|| EnvFilter::new(level)));
    // Under systemd (JOURNAL_STREAM set) text logs go to the journal's own
    // socket, with their level as the entry's priority and no timestamp of
    // ours (the journal stamps each entry); if that socket cannot be used,
    // to stderr without a timestamp.
    let journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let output = match (format, journald) {
        (LogFormat::Json, _) => fmt::layer().json().with_writer(std::io::stderr).boxed(),
        (LogFormat::Text, true) => match tracing_journald::layer() {
            Ok(layer) => layer.with_syslog_identifier("ratelimitd".into()).boxed(),
            Err(_) => fmt::layer().without_time().with_ansi(false).with_writer(OneLineStderr).boxed(),
        },
        (LogFormat::Text, false) => fmt::layer().with_ansi(ansi).with_writer(OneLineStderr).boxed(),
    };
    let subscriber = tracing_subscriber::registry().with(filter).with(output);
    // Not `.init()`: that would install tracing-log's own `log` logger,
    // which passes every library line on.
    tracing::subscriber::set_global_default(subscriber).expect("logging is set up once");
    if let Err(e) = LibraryLog::install() {
        tracing::warn!(error = %e, "the libraries' log lines cannot be rate-limited: another logger is installed");
    }
    Box::new(move |level: &str| {
        if env_set {
            return Ok(());
        }
        handle.reload(EnvFilter::new(level)).map_err(|e| e.to_string())?;
        LibraryLog::follow_filter();
        Ok(())
    })
}

/// stderr with one line per event: a value that holds line breaks (a
/// configuration error listing several fields, an error from Redis) has
/// them written as " | ", so a reader or a log shipper that splits on
/// lines never takes its second half for another event. The fmt layer
/// writes each event with one `write_all` of the whole line.
struct OneLineStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for OneLineStderr {
    type Writer = OneLine;
    fn make_writer(&'a self) -> OneLine {
        OneLine(std::io::stderr())
    }
}

struct OneLine(std::io::Stderr);

impl std::io::Write for OneLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.iter().any(|&b| b == b'\n' || b == b'\r') {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut line = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => line.extend_from_slice(b" | "),
                b'\r' => {}
                _ => line.push(b),
            }
        }
        if body.len() < buf.len() {
            line.push(b'\n');
        }
        self.0.write_all(&line)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
