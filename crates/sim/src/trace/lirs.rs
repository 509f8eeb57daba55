//! LIRS paper traces (Jiang & Zhang, SIGMETRICS'02): one block number per line, e.g. `2819`.
//! Each line is one 4 KiB read of that block (the traces are application-level page
//! references, so one line is one page). No time, one volume. Blank lines and the `*`
//! breakpoint lines of the original LIRS simulator are skipped; `\r\n` line ends are accepted
//! (loop.trace has them).

use std::io::BufRead;
use std::sync::Arc;

use super::input::{ErrorContext, Lines, TextReader};
use super::sector_list::NumberPerLine;
use super::Parser;

const BLOCK: u64 = 4096;

pub(crate) fn reader(ctx: Arc<ErrorContext>, input: Box<dyn BufRead + Send>) -> Box<dyn Parser> {
    TextReader::boxed(
        Lines::new(ctx, input),
        NumberPerLine {
            unit: BLOCK,
            expected: "a decimal 4 KiB block number (one per line, as in a LIRS trace)",
            breakpoints: true,
        },
    )
}
