//! The life of the listening Unix socket: remove a stale file, bind, set mode
//! and group, serve, and remove the file when the daemon is done with it.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("{path}: another process is listening on this socket; stop it or choose another path (server.listen, admin.listen)")]
    InUse { path: PathBuf },
    #[error("{path}: exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{path}: {action}: {err}")]
    Io { path: PathBuf, action: &'static str, err: io::Error },
    /// The socket's directory is missing and could not be made: what to do
    /// instead, since a bare "bind: No such file or directory" names none.
    #[error(
        "{dir}: the socket's directory does not exist and cannot be created ({err}): create it for the daemon's user \
         (as root: install -d -m {mode:04o} -o USER {dir}), or set server.listen (admin.listen) to a path in a directory the daemon may write; \
         under systemd the unit's RuntimeDirectory= makes it (docs/OPERATIONS.md, \"Without systemd\")"
    )]
    NoDirectory { dir: PathBuf, mode: u32, err: io::Error },
}

/// The mode of a socket directory the daemon makes: its own user's, and
/// search (and list) for each class the socket's mode gives any access to,
/// so the directory never lets in fewer than the socket does, nor more:
/// 0660 -> 0750, 0666 -> 0755, 0600 -> 0700. (systemd's socket unit makes
/// its directory 0755.)
pub fn directory_mode(socket_mode: u32) -> u32 {
    let group = if socket_mode & 0o070 != 0 { 0o050 } else { 0 };
    let other = if socket_mode & 0o007 != 0 { 0o005 } else { 0 };
    0o700 | group | other
}

/// Makes the socket's directory if it is missing (one level: the parent of
/// a runtime directory such as /run must exist), with `directory_mode` and
/// the socket's group: on a host without systemd nothing else makes
/// /run/ratelimitd, which is not kept across reboots.
pub fn make_directory(path: &Path, mode: u32, gid: Option<u32>) -> Result<(), SocketError> {
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else { return Ok(()) };
    if dir.is_dir() {
        return Ok(());
    }
    let dir_mode = directory_mode(mode);
    let no_directory = |err| SocketError::NoDirectory { dir: dir.into(), mode: dir_mode, err };
    match std::fs::DirBuilder::new().mode(dir_mode).create(dir) {
        Ok(()) => {}
        // Made meanwhile (another daemon's admin socket, say): fine.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => return Ok(()),
        Err(e) => return Err(no_directory(e)),
    }
    // The umask took bits off: the mode asked for, exactly.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dir_mode)).map_err(no_directory)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(dir, None, Some(gid)).map_err(no_directory)?;
    }
    tracing::info!(directory = %dir.display(), mode = format_args!("{dir_mode:04o}"), "made the socket's directory");
    Ok(())
}

/// Refuses `path` if a process listens on it (or it is not a socket), and
/// touches nothing: `Ok(true)` when a stale socket file is there, to be
/// replaced, `Ok(false)` when nothing is. Start-up asks this of every socket
/// before it binds any, so a daemon that cannot start never removes another
/// daemon's files (`daemon::serve`).
pub fn refuse_if_live(path: &Path) -> Result<bool, SocketError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(SocketError::InUse { path: path.into() });
            }
            Ok(true)
        }
        Ok(_) => Err(SocketError::NotASocket { path: path.into() }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(SocketError::Io { path: path.into(), action: "inspect", err }),
    }
}

/// A bound listener whose file is removed on drop (if it is still ours).
#[derive(Debug)]
pub struct BoundSocket {
    listener: Option<UnixListener>,
    path: PathBuf,
    inode: u64,
}

impl BoundSocket {
    /// Makes the directory if it is missing, removes a stale socket file,
    /// binds, and applies mode and group id (resolved by the
    /// configuration's preflight).
    pub fn bind(path: &Path, mode: u32, gid: Option<u32>) -> Result<Self, SocketError> {
        let io_err = |action: &'static str| move |err| SocketError::Io { path: path.into(), action, err };
        make_directory(path, mode, gid)?;
        if refuse_if_live(path)? {
            tracing::info!(path = %path.display(), "removing stale socket file");
            std::fs::remove_file(path).map_err(io_err("remove stale socket"))?;
        }
        // Bind under a temporary name, set group and mode, then rename into
        // place: clients never see the socket with the umask's permissions.
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let listener = UnixListener::bind(&tmp).map_err(io_err("bind"))?;
        let prepared = (|| {
            if let Some(gid) = gid {
                std::os::unix::fs::chown(&tmp, None, Some(gid)).map_err(io_err("set socket group"))?;
            }
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(io_err("set socket mode"))?;
            std::fs::rename(&tmp, path).map_err(io_err("move socket into place"))?;
            std::fs::metadata(path).map_err(io_err("stat")).map(|m| m.ino())
        })();
        match prepared {
            Ok(inode) => Ok(Self { listener: Some(listener), path: path.into(), inode }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The listener, to hand to the server; the file stays until `self` drops.
    pub fn take_listener(&mut self) -> Option<UnixListener> {
        self.listener.take()
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        // Only remove the file if it is still the one we bound: a newer daemon
        // may have replaced it already.
        if std::fs::metadata(&self.path).is_ok_and(|m| m.ino() == self.inode) {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "could not remove the socket file");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stale_socket_is_replaced_and_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        // A socket file nobody listens on: what a crashed daemon leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let s = BoundSocket::bind(&path, 0o660, None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        drop(s);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn a_missing_directory_is_made_with_the_socket_s_classes_and_an_impossible_one_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run").join("s.sock");
        let s = BoundSocket::bind(&path, 0o660, None).unwrap();
        let mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o750);
        drop(s);
        assert_eq!(directory_mode(0o600), 0o700);
        assert_eq!(directory_mode(0o666), 0o755);
        // Under a regular file no directory can be made, even by root.
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let err = BoundSocket::bind(&file.join("run").join("s.sock"), 0o660, None).unwrap_err().to_string();
        assert!(err.contains("the socket's directory does not exist and cannot be created") && err.contains("install -d -m 0750 -o USER"), "{err}");
    }

    #[tokio::test]
    async fn live_socket_and_regular_file_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _live = BoundSocket::bind(&path, 0o600, None).unwrap();
        assert!(matches!(BoundSocket::bind(&path, 0o600, None), Err(SocketError::InUse { .. })));
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(BoundSocket::bind(&file, 0o600, None), Err(SocketError::NotASocket { .. })));
        assert!(file.exists());
    }
}
