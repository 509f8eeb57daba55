//! Errors of the trace readers. Every error names the file; errors about the content also name
//! the line (text formats) or the byte offset in the decompressed stream (binary formats), what
//! was found there and what was expected.

use std::fmt;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    // The I/O error is in the message, not a `source`: a chain would print it twice.
    #[error("{}: cannot open the trace: {cause}", path.display())]
    Open { path: PathBuf, cause: io::Error },

    /// Reading failed: an I/O error, or a corrupt or truncated compressed stream.
    #[error("{}: {message}: {cause}", path.display())]
    Read {
        path: PathBuf,
        message: String,
        cause: io::Error,
    },

    /// A line of a text trace is not what its format expects.
    #[error("{} line {line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: u64,
        message: String,
    },

    /// A record of a binary trace is not what its format expects (offsets count bytes of the
    /// decompressed stream).
    #[error("{} byte offset {offset}: {message}", path.display())]
    Record {
        path: PathBuf,
        offset: u64,
        message: String,
    },

    /// The file as a whole: empty, or of a format that cannot be told.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
}

/// A `--format` name that is not one of [`super::Format`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown trace format `{found}`; the formats are: {}",
    super::Format::names_list()
)]
pub struct ParseFormatError {
    pub found: String,
}

/// Shows untrusted trace bytes inside an error message: lossy UTF-8, control characters escaped,
/// cut after a few dozen characters so a binary file does not flood the terminal.
pub(crate) struct Snippet<'a>(pub &'a [u8]);

impl fmt::Display for Snippet<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MAX_CHARS: usize = 60;
        let text = String::from_utf8_lossy(self.0);
        for (shown, c) in text.chars().enumerate() {
            if shown == MAX_CHARS {
                return f.write_str("…");
            }
            write!(f, "{}", c.escape_debug())?;
        }
        Ok(())
    }
}
