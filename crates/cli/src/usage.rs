//! Errors in how a command was called, told apart from failures of devices, files and sockets
//! by their exit status: 2 for bad usage (as clap's own parse errors), 1 for the rest.

use std::fmt;

/// A mistake in the command line or the config file: the user must change the command.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// `Err(usage_error(...))` in a function returning `anyhow::Result`.
pub fn usage_error(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.into()))
}

/// The exit status for an error: 2 if a `UsageError` is anywhere in its chain, else 1.
pub fn exit_status(error: &anyhow::Error) -> u8 {
    if error.chain().any(|cause| cause.is::<UsageError>()) {
        2
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn usage_errors_exit_2_even_with_context_others_1() {
        let usage: anyhow::Result<()> = Err(usage_error("no cache given"));
        let wrapped = usage.context("serve").unwrap_err();
        assert_eq!(exit_status(&wrapped), 2);
        assert_eq!(format!("{wrapped:#}"), "serve: no cache given");
        assert_eq!(exit_status(&anyhow::anyhow!("disk on fire")), 1);
    }
}
