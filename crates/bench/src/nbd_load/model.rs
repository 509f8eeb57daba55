//! The verifying model: what every 4 KiB block of the export may read as, given the requests
//! completed and in flight, and what it may read as after a crash.
//!
//! Rules the load generator keeps, so every check is exact:
//! * a block has at most one changing request (WRITE, TRIM, WRITE_ZEROES) in flight, and none
//!   starts while a READ of it is in flight; a READ may start while a change is in flight and
//!   may then see the old or the new content (per block);
//! * a WRITE's blocks hold (block, version) patterns; WRITE_ZEROES reads as zeroes; after a
//!   TRIM a block may read as zeroes or as what it held before (NBD promises nothing; this
//!   cache keeps one of the two) until it is written again.
//!
//! Durability (for a verify after `kill -9`): a FLUSH makes every change completed before it
//! was sent durable, on every connection (the export is multi-connection safe); a FUA change
//! is durable when it completes. After a crash a block may hold its last durable state or any
//! later one, including changes in flight at the crash.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::pattern::Observed;

/// What a block may read as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowed {
    pub zero: bool,
    /// Zeroes are allowed because of a TRIM (kept across a verify: the old data may stay).
    pub trimmed: bool,
    pub versions: Vec<u64>,
}

impl Allowed {
    pub fn zero() -> Allowed {
        Allowed {
            zero: true,
            ..Allowed::default()
        }
    }

    pub fn data(version: u64) -> Allowed {
        Allowed {
            versions: vec![version],
            ..Allowed::default()
        }
    }

    pub fn admits(&self, observed: Observed) -> bool {
        match observed {
            Observed::Zero => self.zero,
            Observed::Data(version) => self.versions.contains(&version),
            _ => false,
        }
    }

    pub fn add(&mut self, other: &Allowed) {
        self.zero |= other.zero;
        self.trimmed |= other.trimmed;
        for &version in &other.versions {
            if !self.versions.contains(&version) {
                self.versions.push(version);
            }
        }
    }

    /// What a TRIM of a block holding `self` leaves: zeroes or the old content.
    fn trimmed(&self) -> Allowed {
        let mut out = self.clone();
        out.zero = true;
        out.trimmed = true;
        out
    }

    /// After a verify saw `observed`, a later read must see the same, unless a TRIM allows
    /// either (then nothing is narrowed).
    pub fn narrowed_to(&self, observed: Observed) -> Allowed {
        match observed {
            _ if self.trimmed => self.clone(),
            Observed::Zero => Allowed::zero(),
            Observed::Data(version) => Allowed::data(version),
            _ => self.clone(),
        }
    }
}

impl fmt::Display for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self
            .versions
            .iter()
            .map(|v| format!("version {v}"))
            .collect();
        if self.zero {
            parts.push(
                if self.trimmed {
                    "zeroes (trimmed)"
                } else {
                    "zeroes"
                }
                .into(),
            );
        }
        write!(f, "{}", parts.join(" or "))
    }
}

/// A change a request makes to each of its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Write,
    Zeroes,
    Trim,
}

struct Entry {
    allowed: Allowed,
    /// Completion number (see [`Model::completed`]).
    completed: u64,
    durable: bool,
}

#[derive(Default)]
struct BlockState {
    /// Completed states, oldest first; the first is the newest known durable one.
    history: Vec<Entry>,
    /// The content of the change in flight, if any.
    pending: Option<Allowed>,
    readers: u32,
}

impl BlockState {
    fn current(&self) -> &Allowed {
        // `history` is never empty: every block starts with one entry.
        &self.history[self.history.len() - 1].allowed
    }
}

/// The whole export's model. Callers hold it behind one mutex.
pub struct Model {
    blocks: Vec<BlockState>,
    salt: u64,
    next_version: u64,
    /// Changes completed so far (numbers them).
    completed: u64,
    /// Every change numbered up to this is durable (the newest acknowledged FLUSH's mark).
    durable_upto: u64,
    /// Keep each block's changes since its last durable one, for a check after a crash. This
    /// is what bounds the model's memory: one entry per block, plus one per change not yet
    /// covered by a FLUSH or FUA. Without it only the current state is kept.
    track_durability: bool,
}

impl Model {
    /// A model where every block holds `snapshot`'s allowed values, all durable.
    pub fn new(snapshot: Snapshot, track_durability: bool) -> Model {
        let blocks = snapshot
            .blocks
            .into_iter()
            .map(|allowed| BlockState {
                history: vec![Entry {
                    allowed,
                    completed: 0,
                    durable: true,
                }],
                ..BlockState::default()
            })
            .collect();
        Model {
            blocks,
            salt: snapshot.salt,
            next_version: snapshot.next_version,
            completed: 0,
            durable_upto: 0,
            track_durability,
        }
    }

    pub fn salt(&self) -> u64 {
        self.salt
    }

    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Starts a READ of `first..first+count` unless a block is past the end; returns what
    /// each block may read as (the current content, or the change in flight).
    pub fn try_read(&mut self, first: u64, count: u64) -> Option<Vec<Allowed>> {
        let range = self.range(first, count)?;
        let mut allowed = Vec::with_capacity(range.len());
        for block in &mut self.blocks[range] {
            block.readers += 1;
            let mut now = block.current().clone();
            if let Some(pending) = &block.pending {
                now.add(pending);
            }
            allowed.push(now);
        }
        Some(allowed)
    }

    pub fn end_read(&mut self, first: u64, count: u64) {
        if let Some(range) = self.range(first, count) {
            for block in &mut self.blocks[range] {
                block.readers = block.readers.saturating_sub(1);
            }
        }
    }

    /// Starts a change of `first..first+count` if no block has a change or a read in flight.
    /// Returns the version a WRITE must write (0 for the others).
    pub fn try_change(&mut self, first: u64, count: u64, change: Change) -> Option<u64> {
        let range = self.range(first, count)?;
        let busy = |b: &BlockState| b.pending.is_some() || b.readers > 0;
        if self.blocks[range.clone()].iter().any(busy) {
            return None;
        }
        let version = match change {
            Change::Write => {
                self.next_version += 1;
                self.next_version
            }
            Change::Zeroes | Change::Trim => 0,
        };
        for block in &mut self.blocks[range] {
            block.pending = Some(match change {
                Change::Write => Allowed::data(version),
                Change::Zeroes => Allowed::zero(),
                Change::Trim => block.current().trimmed(),
            });
        }
        Some(version)
    }

    /// The change on `first..first+count` completed successfully.
    pub fn end_change(&mut self, first: u64, count: u64, fua: bool) {
        self.completed += 1;
        let (completed, durable_upto) = (self.completed, self.durable_upto);
        // Without durability tracking every state is as good as durable: keep only the last.
        let fua = fua || !self.track_durability;
        let Some(range) = self.range(first, count) else {
            return;
        };
        for block in &mut self.blocks[range] {
            if let Some(allowed) = block.pending.take() {
                block.history.push(Entry {
                    allowed,
                    completed,
                    durable: fua,
                });
            }
            prune(block, durable_upto);
        }
    }

    /// The change failed: the blocks may hold the old or the new content from now on.
    pub fn fail_change(&mut self, first: u64, count: u64) {
        self.completed += 1;
        let completed = self.completed;
        let Some(range) = self.range(first, count) else {
            return;
        };
        for block in &mut self.blocks[range] {
            if let Some(pending) = block.pending.take() {
                let mut either = block.current().clone();
                either.add(&pending);
                block.history.push(Entry {
                    allowed: either,
                    completed,
                    durable: !self.track_durability,
                });
                prune(block, self.durable_upto);
            }
        }
    }

    /// A FLUSH is about to be sent: returns its mark (the changes it covers).
    pub fn flush_mark(&self) -> u64 {
        self.completed
    }

    /// A FLUSH with `mark` was acknowledged.
    pub fn end_flush(&mut self, mark: u64) {
        self.durable_upto = self.durable_upto.max(mark);
    }

    /// What each block may read as now (changes still in flight included).
    pub fn snapshot_now(&self) -> Snapshot {
        self.snapshot(|block| {
            let mut allowed = block.current().clone();
            if let Some(pending) = &block.pending {
                allowed.add(pending);
            }
            allowed
        })
    }

    /// What each block may read as after a crash now: its last durable state or anything
    /// after it, including changes in flight. Needs durability tracking (else it is only the
    /// current state).
    pub fn snapshot_after_crash(&self) -> Snapshot {
        let durable_upto = self.durable_upto;
        self.snapshot(|block| {
            let floor = floor_index(block, durable_upto);
            let mut allowed = Allowed::default();
            for entry in &block.history[floor..] {
                allowed.add(&entry.allowed);
            }
            if let Some(pending) = &block.pending {
                allowed.add(pending);
            }
            allowed
        })
    }

    fn snapshot(&self, allowed: impl Fn(&BlockState) -> Allowed) -> Snapshot {
        Snapshot {
            salt: self.salt,
            next_version: self.next_version,
            blocks: self.blocks.iter().map(allowed).collect(),
        }
    }

    fn range(&self, first: u64, count: u64) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(first).ok()?;
        let end = start.checked_add(usize::try_from(count).ok()?)?;
        (end <= self.blocks.len()).then_some(start..end)
    }
}

/// The newest entry known durable: FUA, or completed before an acknowledged FLUSH was sent.
fn floor_index(block: &BlockState, durable_upto: u64) -> usize {
    block
        .history
        .iter()
        .rposition(|e| e.durable || e.completed <= durable_upto)
        .unwrap_or(0)
}

/// Drops the entries older than the durable floor (they can never be read again).
fn prune(block: &mut BlockState, durable_upto: u64) {
    let floor = floor_index(block, durable_upto);
    if floor > 0 {
        block.history.drain(..floor);
    }
}

/// What every block may read as, with what is needed to recognise it: the model's state
/// between runs (a file, see [`Snapshot::save`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub salt: u64,
    /// Versions below this were used; a continuing run writes above it.
    pub next_version: u64,
    pub blocks: Vec<Allowed>,
}

const FILE_MAGIC: &str = "ssdcache-nbd-load-model 1";

impl Snapshot {
    /// A fresh export that reads as zeroes everywhere.
    pub fn zeroed(blocks: u64, salt: u64) -> Snapshot {
        Snapshot {
            salt,
            next_version: 0,
            blocks: (0..blocks).map(|_| Allowed::zero()).collect(),
        }
    }

    /// Text: a header, then one line per block that may read as anything but zeroes only:
    /// `BLOCK TOKEN...` where a token is a version, `z` (zeroes) or `t` (zeroes, after a TRIM).
    /// Written to a temporary file, synced, then renamed over `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp");
        let file =
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut out = BufWriter::new(file);
        writeln!(out, "{FILE_MAGIC}")?;
        writeln!(out, "salt {}", self.salt)?;
        writeln!(out, "next_version {}", self.next_version)?;
        writeln!(out, "blocks {}", self.blocks.len())?;
        for (index, allowed) in self.blocks.iter().enumerate() {
            if *allowed == Allowed::zero() {
                continue;
            }
            write!(out, "{index}")?;
            for version in &allowed.versions {
                write!(out, " {version}")?;
            }
            match (allowed.zero, allowed.trimmed) {
                (true, true) => write!(out, " t")?,
                (true, false) => write!(out, " z")?,
                _ => {}
            }
            writeln!(out)?;
        }
        let file = out.into_inner().context("writing the model")?;
        file.sync_all().context("syncing the model")?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot rename to {}", path.display()))
    }

    pub fn load(path: &Path) -> Result<Snapshot> {
        let file =
            File::open(path).with_context(|| format!("cannot open model {}", path.display()))?;
        let mut lines = BufReader::new(file).lines();
        let mut next = |what: &str| -> Result<String> {
            lines
                .next()
                .with_context(|| format!("model {} ends before {what}", path.display()))?
                .context("reading the model")
        };
        if next("its header")? != FILE_MAGIC {
            bail!(
                "{} is not a model written by nbd-load (first line)",
                path.display()
            );
        }
        let salt = header_value(&next("salt")?, "salt")?;
        let next_version = header_value(&next("next_version")?, "next_version")?;
        let count = header_value(&next("blocks")?, "blocks")?;
        let mut snapshot = Snapshot::zeroed(count, salt);
        snapshot.next_version = next_version;
        for line in lines {
            let line = line.context("reading the model")?;
            parse_block_line(&line, &mut snapshot.blocks)
                .with_context(|| format!("model {}: bad line {line:?}", path.display()))?;
        }
        Ok(snapshot)
    }
}

fn header_value(line: &str, key: &str) -> Result<u64> {
    match line.split_once(' ') {
        Some((k, value)) if k == key => value
            .parse()
            .with_context(|| format!("bad {key} {value:?}")),
        _ => bail!("expected `{key} N`, found {line:?}"),
    }
}

fn parse_block_line(line: &str, blocks: &mut [Allowed]) -> Result<()> {
    let mut tokens = line.split_whitespace();
    let index: usize = tokens.next().context("empty line")?.parse()?;
    let Some(allowed) = blocks.get_mut(index) else {
        bail!("block {index} is past the end");
    };
    *allowed = Allowed::default();
    for token in tokens {
        match token {
            "z" => allowed.zero = true,
            "t" => {
                allowed.zero = true;
                allowed.trimmed = true;
            }
            version => allowed.versions.push(version.parse()?),
        }
    }
    if !allowed.zero && allowed.versions.is_empty() {
        bail!("block {index} may read as nothing");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(blocks: u64) -> Model {
        Model::new(Snapshot::zeroed(blocks, 1), true)
    }

    #[test]
    fn reads_see_completed_changes_exactly() {
        let mut m = model(8);
        let v = m.try_change(2, 2, Change::Write).unwrap();
        assert!(
            m.try_change(3, 1, Change::Trim).is_none(),
            "one change per block"
        );
        let during = m.try_read(2, 1).unwrap();
        assert!(during[0].admits(Observed::Zero) && during[0].admits(Observed::Data(v)));
        assert!(m.try_change(5, 1, Change::Zeroes).is_some());
        m.end_change(2, 2, false);
        m.end_read(2, 1);
        let after = m.try_read(2, 2).unwrap();
        assert_eq!(after, vec![Allowed::data(v), Allowed::data(v)]);
        assert!(
            m.try_change(2, 1, Change::Write).is_none(),
            "no change under a read"
        );
        m.end_read(2, 2);
        m.try_change(2, 1, Change::Trim).unwrap();
        m.end_change(2, 1, false);
        let trimmed = &m.try_read(2, 1).unwrap()[0];
        assert!(trimmed.admits(Observed::Zero) && trimmed.admits(Observed::Data(v)));
        assert!(m.try_read(7, 2).is_none(), "past the end");
    }

    #[test]
    fn a_crash_keeps_everything_from_the_last_flush_on() {
        let mut m = model(4);
        let v1 = m.try_change(0, 1, Change::Write).unwrap();
        m.end_change(0, 1, false);
        let mark = m.flush_mark();
        let v2 = m.try_change(0, 1, Change::Write).unwrap();
        m.end_change(0, 1, false);
        m.end_flush(mark);
        let v3 = m.try_change(0, 1, Change::Write).unwrap();
        let fua = m.try_change(1, 1, Change::Write).unwrap();
        m.end_change(1, 1, true);
        let crash = m.snapshot_after_crash();
        assert_eq!(crash.blocks[0].versions, vec![v1, v2, v3]);
        assert!(!crash.blocks[0].zero, "v1 was durable");
        assert_eq!(
            crash.blocks[1],
            Allowed::data(fua),
            "FUA is durable at once"
        );
        assert_eq!(crash.blocks[2], Allowed::zero());
        assert_eq!(m.snapshot_now().blocks[0].versions, vec![v2, v3]);
    }

    #[test]
    fn without_durability_tracking_only_the_last_state_is_kept() {
        let mut m = Model::new(Snapshot::zeroed(1, 1), false);
        for _ in 0..100 {
            m.try_change(0, 1, Change::Write).unwrap();
            m.end_change(0, 1, false);
        }
        assert_eq!(m.blocks[0].history.len(), 1);
        assert_eq!(m.snapshot_after_crash().blocks[0], Allowed::data(100));
    }

    #[test]
    fn snapshots_survive_a_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model");
        let mut snapshot = Snapshot::zeroed(6, 42);
        snapshot.next_version = 9;
        snapshot.blocks[1] = Allowed::data(3);
        snapshot.blocks[4] = Allowed {
            zero: true,
            trimmed: true,
            versions: vec![5, 7],
        };
        snapshot.save(&path).unwrap();
        assert_eq!(Snapshot::load(&path).unwrap(), snapshot);
        std::fs::write(&path, "something else\n").unwrap();
        assert!(Snapshot::load(&path).is_err());
    }
}
