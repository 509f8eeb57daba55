//! The control socket: one request line in, one JSON reply line out. Requests: `stats`,
//! `info`, `flush` (start writing back everything), `flush-stop`, `commit`,
//! `set-mode NAME MODE`, and JSON objects for requests with paths in them:
//! `{"request": "volume-add", "spec": ...}` (`volume::AddSpec`), `{"request":
//! "volume-remove", "name": ...}` (asked again until `done`) and `volume-remove-cancel`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ssdcache_engine::Cache;
use ssdcache_nbd::Server;
use ssdcache_trace::record::Recorder;

use crate::report;
use crate::wear::WearWatch;

/// Default control socket of a cache, derived from its UUID so `stats --cache` finds it.
pub fn default_path(cache_uuid: &[u8; 16]) -> PathBuf {
    crate::runtime_dir().join(format!("{}.ctl", uuid::Uuid::from_bytes(*cache_uuid)))
}

/// Listens on a Unix socket only its owner may use (mode 0600), replacing a stale one. The
/// directory must exist: a path the user typed is never silently created.
pub fn bind(path: &Path) -> Result<UnixListener> {
    bind_socket(path, false)
}

/// Like `bind`, creating the parent directory: for the default paths in the runtime directory
/// (`/run/ssdcache` as root), which may not exist after a reboot.
pub fn bind_creating_dir(path: &Path) -> Result<UnixListener> {
    bind_socket(path, true)
}

fn bind_socket(path: &Path, create_dir: bool) -> Result<UnixListener> {
    prepare_socket_path(path, create_dir)?;
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot make {} private (mode 0600)", path.display()))?;
    Ok(listener)
}

/// The directory a socket goes in ("." for a bare name).
fn socket_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Makes `path` free for a new socket: checks (or creates) its directory, and removes a stale
/// socket or link left by a daemon that died (`kill -9`, a crash). Refuses a socket some live
/// server still answers on, and anything that is not a socket or a link (a typo must not
/// delete a file).
pub fn prepare_socket_path(path: &Path, create_dir: bool) -> Result<()> {
    let dir = socket_dir(path);
    if create_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    } else if !dir.is_dir() {
        bail!(
            "cannot make socket {}: directory {} does not exist; create it first or choose \
             another path",
            path.display(),
            dir.display()
        );
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot check {}", path.display())),
    };
    let kind = meta.file_type();
    if !kind.is_socket() && !kind.is_symlink() {
        bail!(
            "{} exists and is not a socket; remove it or choose another path",
            path.display()
        );
    }
    if UnixStream::connect(path).is_ok() {
        bail!(
            "socket {} is in use by a running server; stop it or choose another path",
            path.display()
        );
    }
    remove_stale(path)
}

fn remove_stale(path: &Path) -> Result<()> {
    tracing::info!(
        "removing stale socket {} (left by a daemon that died)",
        path.display()
    );
    std::fs::remove_file(path)
        .with_context(|| format!("cannot remove stale socket {}", path.display()))
}

/// Makes `link` (in the runtime directory, created if needed) a symlink to the control socket
/// `target`, replacing a link left by an earlier daemon of this cache, whether it points to a
/// dead socket or to `target` itself (a daemon killed with -9 that used the same --control).
/// Refuses a link or socket through which another live daemon answers.
pub fn link(target: &Path, link: &Path) -> Result<PathBuf> {
    let dir = socket_dir(link);
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let target = std::fs::canonicalize(target)
        .with_context(|| format!("cannot resolve {}", target.display()))?;
    if let Ok(meta) = std::fs::symlink_metadata(link) {
        let ours = meta.file_type().is_symlink()
            && std::fs::read_link(link).is_ok_and(|old| old == target);
        if !ours {
            prepare_socket_path(link, true)?;
        }
    }
    // A new link under a temporary name, renamed over the old one: never a moment without it.
    let temporary = dir.join(format!(
        ".{}.{}.tmp",
        link.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&temporary);
    std::os::unix::fs::symlink(&target, &temporary)
        .and_then(|()| std::fs::rename(&temporary, link))
        .with_context(|| format!("cannot link {} to {}", link.display(), target.display()))?;
    Ok(link.to_owned())
}

/// What the control socket's requests act on: the serving daemon's parts.
pub struct Daemon {
    pub cache: Arc<Cache>,
    pub cache_path: PathBuf,
    /// Volumes added while serving get their export here.
    pub server: Arc<Server>,
    /// `serve --read-only`: added volumes are exported read-only too.
    pub read_only: bool,
    /// `serve --emulate-hdd`: added volumes' backing devices are slowed the same way.
    pub emulate_hdd: bool,
    pub recorder: Option<Arc<Recorder>>,
    pub wear: Arc<WearWatch>,
    /// Names of the volumes removed while serving (a removal's last poll answers `done`).
    pub removed: std::sync::Mutex<Vec<String>>,
    /// Removals under way, with when their client last asked (`volume::REMOVAL_LEASE`).
    pub removing: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// Held while a volume is added, removed or a removal withdrawn: the control thread and
    /// the removal watchdog never act on volumes at the same time.
    pub volume_ops: std::sync::Mutex<()>,
    /// Volume names serve's config file mentions, with its path: a removal warns about them.
    pub config_naming: std::collections::BTreeMap<String, PathBuf>,
    /// The service manager (`systemctl status`), told when the volumes or their modes change.
    pub manager: Arc<crate::notify::Notifier>,
    /// The serving status last sent (by `refresh_status`, or the one serve's `READY` carries).
    pub status_sent: std::sync::Mutex<Option<String>>,
}

impl Daemon {
    /// Tells the service manager what is served now, if that changed since the last time:
    /// after a volume was added or removed, a removal withdrawn, a mode changed.
    pub fn refresh_status(&self) {
        let status = crate::serve::serving_status(&self.cache);
        let mut sent = self.status_sent.lock().unwrap_or_else(|p| p.into_inner());
        if sent.as_deref() != Some(status.as_str()) {
            self.manager.status(&status);
            *sent = Some(status);
        }
    }
}

/// Answers requests on a thread of its own until the process exits. One request at a time:
/// two volume additions never race. A second thread withdraws removals whose client stopped
/// asking (`volume::withdraw_abandoned_removals`).
pub fn spawn(listener: UnixListener, daemon: Daemon) -> Result<()> {
    let daemon = Arc::new(daemon);
    let watched = daemon.clone();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Err(e) = answer(conn, &daemon) {
                    tracing::debug!("control request failed: {e:#}");
                }
                daemon.refresh_status();
            }
        })
        .context("cannot start the control socket's thread")?;
    std::thread::Builder::new()
        .name("removal-watch".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            crate::volume::withdraw_abandoned_removals(&watched);
            watched.refresh_status();
        })
        .context("cannot start the removal watchdog's thread")?;
    Ok(())
}

fn answer(conn: UnixStream, daemon: &Daemon) -> Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?.take(4096)).read_line(&mut line)?;
    let reply = if line.trim_start().starts_with('{') {
        answer_json(&line, daemon)
    } else {
        answer_words(&line, daemon)?
    };
    let mut out = serde_json::to_vec(&reply)?;
    out.push(b'\n');
    (&conn).write_all(&out)?;
    Ok(())
}

/// A request given as a JSON object (`{"request": NAME, ...}`): those carrying paths.
fn answer_json(line: &str, daemon: &Daemon) -> serde_json::Value {
    let request: serde_json::Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return serde_json::json!({ "error": format!("bad JSON request: {e}") }),
    };
    let name = request["name"].as_str().unwrap_or_default();
    let _one_at_a_time = daemon.volume_ops.lock().unwrap_or_else(|p| p.into_inner());
    let result = crate::volume::refuse_other_cache(daemon, &request).and_then(|()| {
        match request["request"].as_str() {
            Some("volume-add") => crate::volume::add_online(daemon, &request),
            Some("volume-remove") => crate::volume::remove_online(daemon, name),
            Some("volume-remove-cancel") => crate::volume::cancel_remove_online(daemon, name),
            other => Err(anyhow::anyhow!(
                "unknown JSON request {other:?}; known: volume-add, volume-remove, \
             volume-remove-cancel"
            )),
        }
    });
    result.unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }))
}

fn answer_words(line: &str, daemon: &Daemon) -> Result<serde_json::Value> {
    let Daemon {
        cache,
        cache_path,
        recorder,
        wear,
        ..
    } = daemon;
    let words: Vec<&str> = line.split_whitespace().collect();
    let stats = || {
        report::live_stats(
            cache,
            cache_path,
            recorder.as_deref().map(Recorder::status),
            wear,
        )
    };
    let reply = match words.as_slice() {
        ["stats"] => serde_json::to_value(stats())?,
        ["info"] => serde_json::to_value(report::live_info(cache, cache_path))?,
        ["flush"] => {
            cache.request_drain(true);
            serde_json::to_value(stats())?
        }
        ["flush-stop"] => {
            cache.request_drain(false);
            cache.release_held_modes();
            serde_json::json!({ "ok": true })
        }
        ["commit"] => match cache.commit() {
            Ok(()) => serde_json::json!({ "ok": true }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        },
        ["set-mode", name, mode] => match crate::writeback::set_mode_online(cache, name, mode) {
            Ok(v) => v,
            Err(e) => serde_json::json!({ "error": format!("{e:#}") }),
        },
        _ => serde_json::json!({
            "error": format!(
                "unknown request {:?}; known: stats, info, flush, flush-stop, commit, set-mode NAME MODE, {{\"request\": \"volume-add\", ...}}",
                line.trim()
            )
        }),
    };
    Ok(reply)
}

/// Sends one request to a daemon; `None` when no daemon listens there.
pub fn query(path: &Path, request: &str) -> Result<Option<serde_json::Value>> {
    let Ok(mut conn) = UnixStream::connect(path) else {
        return Ok(None);
    };
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.write_all(format!("{request}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(conn)
        .read_line(&mut line)
        .with_context(|| format!("no answer on control socket {}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&line)
        .with_context(|| format!("bad answer on control socket {}", path.display()))?;
    if let Some(err) = value.get("error") {
        bail!("daemon refused the request: {err}");
    }
    Ok(Some(value))
}
