//! What stops a daemon (`serve`, `hdd-emulator`): SIGTERM, SIGINT, or a failure reported by
//! one of its threads.

use std::sync::{mpsc, Arc};

use anyhow::{Context, Result};
use ssdcache_nbd::Server;

const SIGTERM_NAME: &str = "SIGTERM";
const SIGINT_NAME: &str = "SIGINT";

/// Whether a reason to stop given by [`StopEvents::wait`] is a request to stop (SIGTERM or
/// SIGINT), as opposed to a failure (a listener failing, the cache halting).
pub fn is_stop_signal(why: &str) -> bool {
    why == SIGTERM_NAME || why == SIGINT_NAME
}

/// What stops the daemon: SIGTERM, SIGINT, or a listener that failed, as messages for the
/// log. Signals are caught from `install` on.
pub struct StopEvents {
    events: mpsc::Receiver<String>,
    sender: mpsc::Sender<String>,
}

impl StopEvents {
    pub fn install() -> Result<StopEvents> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
            .context("cannot install signal handlers")?;
        let (sender, events) = mpsc::channel();
        let forward = sender.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    let name = match signal {
                        SIGTERM => SIGTERM_NAME.to_owned(),
                        SIGINT => SIGINT_NAME.to_owned(),
                        other => format!("signal {other}"),
                    };
                    if forward.send(name).is_err() {
                        return;
                    }
                }
            })
            .context("cannot start the signal thread")?;
        Ok(StopEvents { events, sender })
    }

    pub fn sender(&self) -> mpsc::Sender<String> {
        self.sender.clone()
    }

    /// Blocks until the first reason to stop.
    pub fn wait(&self) -> String {
        // Err cannot happen while `self.sender` lives; stopping is the safe answer anyway.
        self.events
            .recv()
            .unwrap_or_else(|_| "the signal thread ending".to_owned())
    }

    pub fn try_next(&self) -> Option<String> {
        self.events.try_recv().ok()
    }
}

/// For a server without a cache (`hdd-emulator`): the first SIGTERM or SIGINT starts a
/// graceful stop, a second closes every connection at once.
pub fn watch_signals(server: Arc<Server>) -> Result<()> {
    let stops = StopEvents::install()?;
    std::thread::Builder::new()
        .name("stop".into())
        .spawn(move || {
            let why = stops.wait();
            tracing::info!(
                "{why}: stopping (in-flight requests finish first; a second signal does not wait)"
            );
            server.shutdown();
            let why = stops.wait();
            tracing::info!("{why} again: closing every connection now");
            server.force_close();
        })
        .context("cannot start the signal thread")?;
    Ok(())
}
