//! The control socket: one request line in, one JSON reply line out. Requests: `stats`,
//! `info`, `flush` (start writing back everything), `flush-stop`, `commit`, and
//! `set-mode NAME MODE`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ssdcache_engine::Cache;
use ssdcache_sim::record::Recorder;

use crate::report;

/// Default control socket of a cache, derived from its UUID so `stats --cache` finds it.
pub fn default_path(cache_uuid: &[u8; 16]) -> PathBuf {
    crate::runtime_dir().join(format!("{}.ctl", uuid::Uuid::from_bytes(*cache_uuid)))
}

/// Listens on a Unix socket only its owner may use (mode 0600), replacing a stale one.
pub fn bind(path: &Path) -> Result<UnixListener> {
    prepare_socket_path(path)?;
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Creates the parent directory and removes a stale socket left by a dead daemon; refuses a
/// socket some live server still answers on.
pub fn prepare_socket_path(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if std::fs::symlink_metadata(path).is_ok() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "socket {} is in use by a running server; stop it or choose another path",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    Ok(())
}

/// Makes `link` a symlink to the control socket `target` (replacing a stale one).
pub fn link(target: &Path, link: &Path) -> Result<PathBuf> {
    prepare_socket_path(link)?;
    let target = std::fs::canonicalize(target)?;
    std::os::unix::fs::symlink(&target, link)
        .with_context(|| format!("cannot link {} to {}", link.display(), target.display()))?;
    Ok(link.to_owned())
}

/// Answers requests until the process exits.
pub fn spawn(
    listener: UnixListener,
    cache: Arc<Cache>,
    cache_path: PathBuf,
    recorder: Option<Arc<Recorder>>,
) {
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            if let Err(e) = answer(conn, &cache, &cache_path, recorder.as_deref()) {
                tracing::debug!("control request failed: {e:#}");
            }
        }
    });
}

fn answer(
    conn: UnixStream,
    cache: &Cache,
    cache_path: &Path,
    recorder: Option<&Recorder>,
) -> Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?.take(4096)).read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let stats = || report::live_stats(cache, cache_path, recorder.map(Recorder::status));
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
                "unknown request {:?}; known: stats, info, flush, flush-stop, commit, set-mode NAME MODE",
                line.trim()
            )
        }),
    };
    let mut out = serde_json::to_vec(&reply)?;
    out.push(b'\n');
    (&conn).write_all(&out)?;
    Ok(())
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
