//! fio's I/O logs (`write_iolog`, replayed by `read_iolog`), versions 2 and 3. Line 1 is
//! `fio version 2 iolog` or `fio version 3 iolog`; then, whitespace-separated:
//!
//! ```text
//! v2: filename action                    v2: filename action offset length
//! v3: timestamp filename action          v3: timestamp filename action offset length
//! ```
//!
//! Offsets and lengths are bytes; the v3 timestamp is microseconds since the start of the run
//! (fio writes `utime_since_now`). v2 has no timestamps; its `wait` action sets the time: fio's
//! HOWTO calls its offset microseconds relative to the previous wait, but fio's replay code
//! (`read_iolog_get` in iolog.c, unchanged since 2009) waits until `offset` milliseconds after
//! the job started, and this reader follows the code. Actions `read` and `write` are requests; `trim`,
//! `sync`, `datasync`, `sync_file_range`, `syncfs`, `wait` and the file actions `add`, `open`,
//! `close` are skipped records; any other action is an error. Each file name is a volume
//! (in order of its first read or write).

use std::io::BufRead;
use std::sync::Arc;

use super::error::Snippet;
use super::input::{
    first_fields, parse_u64, split_whitespace, Clock, ErrorContext, Line, LineParser, Lines,
    TextReader, VolumeTable,
};
use super::{Op, Parser, Request, TraceError};

const MICROSECOND_NS: u64 = 1_000;
const MILLISECOND_US: u64 = 1_000;
const HEADER_V2: &[u8] = b"fio version 2 iolog";
const HEADER_V3: &[u8] = b"fio version 3 iolog";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V2,
    V3,
}

pub(crate) fn reader(
    ctx: Arc<ErrorContext>,
    input: Box<dyn BufRead + Send>,
) -> Result<Box<dyn Parser>, TraceError> {
    let mut lines = Lines::new(Arc::clone(&ctx), input);
    let version = match lines.next_line()? {
        Some(line) => match line.text.trim_ascii() {
            HEADER_V2 => Version::V2,
            HEADER_V3 => Version::V3,
            other => {
                return Err(line.error(format!(
                    "expected the header `fio version 2 iolog` or `fio version 3 iolog` of a fio iolog, found `{}`",
                    Snippet(other)
                )))
            }
        },
        None => return Err(ctx.file_error("no header line: expected `fio version 3 iolog`")),
    };
    Ok(TextReader::boxed(
        lines,
        FioLines {
            version,
            volumes: VolumeTable::default(),
            clock: Clock::default(),
            waited_us: 0,
            skipped: 0,
        },
    ))
}

struct FioLines {
    version: Version,
    volumes: VolumeTable,
    clock: Clock,
    /// v2: the time the last `wait` action waited for, the only time such a log has.
    waited_us: u64,
    skipped: u64,
}

enum Action {
    Io(Op),
    /// trim, the syncs, the file actions: no data moved through a cache.
    NoData,
    Wait,
}

fn action(name: &[u8], with_range: bool) -> Option<Action> {
    Some(match (name, with_range) {
        (b"read", true) => Action::Io(Op::Read),
        (b"write", true) => Action::Io(Op::Write),
        (b"wait", true) => Action::Wait,
        (b"trim" | b"sync" | b"datasync" | b"sync_file_range" | b"syncfs", true) => Action::NoData,
        (b"add" | b"open" | b"close", false) => Action::NoData,
        _ => return None,
    })
}

impl FioLines {
    fn shape(&self) -> &'static str {
        match self.version {
            Version::V2 => "`filename action` or `filename action offset length` (fio iolog v2)",
            Version::V3 => {
                "`timestamp filename action` or `timestamp filename action offset length` (fio iolog v3)"
            }
        }
    }
}

impl LineParser for FioLines {
    fn parse_line(&mut self, line: &Line<'_>) -> Result<Option<Request>, TraceError> {
        let (fields, count) = first_fields::<5>(split_whitespace(line.text));
        let (timestamp, rest) = match (self.version, count) {
            (Version::V2, 2 | 4) => (None, &fields[..count]),
            (Version::V3, 3 | 5) => (Some(fields[0]), &fields[1..count]),
            _ => return Err(line.error(format!("expected {}, found {count} fields", self.shape()))),
        };
        let (file, name) = (rest[0], rest[1]);
        let with_range = rest.len() == 4;
        let Some(action) = action(name, with_range) else {
            return Err(line.bad_field(
                "action",
                name,
                if with_range {
                    "read, write, trim, sync, datasync or wait before an offset and a length"
                } else {
                    "add, open or close after a file name alone"
                },
            ));
        };
        let time_us = match timestamp {
            Some(field) => parse_u64(field)
                .ok_or_else(|| line.bad_field("timestamp", field, "decimal microseconds"))?,
            None => self.waited_us,
        };
        let (offset, len) = if with_range {
            let offset = parse_u64(rest[2])
                .ok_or_else(|| line.bad_field("offset", rest[2], "a decimal byte offset"))?;
            let len = parse_u64(rest[3])
                .ok_or_else(|| line.bad_field("length", rest[3], "a decimal byte count"))?;
            (offset, len)
        } else {
            (0, 0)
        };
        let op = match action {
            Action::Io(op) => op,
            Action::Wait => {
                if self.version == Version::V2 {
                    let until_us = offset.saturating_mul(MILLISECOND_US);
                    self.waited_us = self.waited_us.max(until_us);
                }
                self.skipped += 1;
                return Ok(None);
            }
            Action::NoData => {
                self.skipped += 1;
                return Ok(None);
            }
        };
        let volume = self.volumes.id(file, line)?;
        let time_ns = self
            .clock
            .since_first(time_us)
            .saturating_mul(MICROSECOND_NS);
        line.request(time_ns, volume, op, offset, len)
    }

    fn volume_names(&self) -> &[String] {
        self.volumes.names()
    }

    fn skipped(&self) -> u64 {
        self.skipped
    }
}
