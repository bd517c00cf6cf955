//! The command line's side of the admin API: one HTTP/1.1 request per
//! connection, blocking (the CLI does one thing and exits).

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::AdminListen;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the admin API at {at}: {err}")]
    Connect { at: String, err: std::io::Error },
    #[error("admin API at {at}: {err}")]
    Io { at: String, err: std::io::Error },
    #[error("admin API at {at}: malformed response")]
    Malformed { at: String },
}

/// A response: the status and the JSON body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: serde_json::Value,
}

/// Percent-encodes a query value.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Sends `method path` with `body` (JSON, if any) and `token` (bearer, if any).
pub fn request(listen: &AdminListen, token: Option<&str>, method: &str, path: &str, body: Option<&str>) -> Result<Reply, ClientError> {
    request_with(listen, None, token, method, path, body)
}

/// `request`, over TLS with `tls` on a TCP listener (`admin_api::tls::client_config`):
/// the server's certificate must be valid for the listener's IP address.
pub fn request_with(listen: &AdminListen, tls: Option<Arc<rustls::ClientConfig>>, token: Option<&str>, method: &str, path: &str, body: Option<&str>) -> Result<Reply, ClientError> {
    let at = match listen {
        AdminListen::Unix { path, .. } => path.display().to_string(),
        AdminListen::Tcp(a) => a.to_string(),
    };
    let mut stream: Box<dyn ReadWrite> = match listen {
        AdminListen::Unix { path, .. } => Box::new(std::os::unix::net::UnixStream::connect(path).map_err(|err| ClientError::Connect { at: at.clone(), err })?),
        AdminListen::Tcp(a) => {
            let tcp = std::net::TcpStream::connect_timeout(a, Duration::from_secs(5)).map_err(|err| ClientError::Connect { at: at.clone(), err })?;
            match tls {
                None => Box::new(tcp),
                Some(cfg) => {
                    let name = rustls::pki_types::ServerName::IpAddress(a.ip().into());
                    let conn = rustls::ClientConnection::new(cfg, name).map_err(|e| ClientError::Connect { at: at.clone(), err: std::io::Error::other(e) })?;
                    Box::new(rustls::StreamOwned::new(conn, tcp))
                }
            }
        }
    };
    stream.timeouts(Duration::from_secs(30));
    let body = body.unwrap_or("");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: ratelimitd\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    head.push_str("\r\n");
    let io = |err| ClientError::Io { at: at.clone(), err };
    let mut message = head.into_bytes();
    message.extend_from_slice(body.as_bytes());
    // The server answers a refused request (no token, a body too large)
    // without reading the rest and closes: the answer is still there to read.
    let written = stream.write_all(&message);
    let mut raw = Vec::new();
    let read = stream.read_to_end(&mut raw);
    if let Some(reply) = parse(&raw) {
        return Ok(reply);
    }
    written.map_err(io)?;
    read.map_err(io)?;
    Err(ClientError::Malformed { at })
}

/// The token in `file`, trimmed.
pub fn read_token(file: &Path) -> std::io::Result<String> {
    Ok(std::fs::read_to_string(file)?.trim().to_string())
}

trait ReadWrite: Read + Write {
    fn timeouts(&mut self, t: Duration);
}

impl ReadWrite for std::os::unix::net::UnixStream {
    fn timeouts(&mut self, t: Duration) {
        let _ = self.set_read_timeout(Some(t));
        let _ = self.set_write_timeout(Some(t));
    }
}

impl ReadWrite for rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream> {
    fn timeouts(&mut self, t: Duration) {
        self.sock.timeouts(t);
    }
}

impl ReadWrite for std::net::TcpStream {
    fn timeouts(&mut self, t: Duration) {
        let _ = self.set_read_timeout(Some(t));
        let _ = self.set_write_timeout(Some(t));
    }
}

/// Status and body of a response with Content-Length (what the server sends).
fn parse(raw: &[u8]) -> Option<Reply> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let body = &raw[end + 4..];
    let body = if body.is_empty() { serde_json::Value::Null } else { serde_json::from_slice(body).ok()? };
    Some(Reply { status, body })
}
