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

/// Turns any error into a usage error with the same text (for checks of settings that come
/// only from the command line or a config file).
pub fn as_usage_error(error: anyhow::Error) -> anyhow::Error {
    usage_error(error_text(&error))
}

/// The error and its causes, `: `-separated, leaving out a cause its wrapper already shows
/// (library errors print their source in their own message).
pub fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if text.ends_with(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
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
        assert_eq!(error_text(&wrapped), "serve: no cache given");
        assert_eq!(exit_status(&anyhow::anyhow!("disk on fire")), 1);
    }
}
