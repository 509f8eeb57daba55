//! The writes an NBD server acknowledged but has not yet been asked to make durable.
//!
//! A server may acknowledge a write while it sits in a volatile cache (librbd's cache under
//! `qemu-nbd --cache=writeback`, say) and lose it when the server process restarts. NBD makes
//! a write durable only once a FLUSH sent after its reply succeeded. So every write this
//! device sends is kept here, from before it is sent until a FLUSH that covers it succeeded,
//! and after a reconnection the whole log is sent again, in order, before any other request.
//! A caller that was told "written" can then rely on the next successful `flush` as the
//! engine does: it marks data clean, or answers a client's FLUSH, only after one.
//!
//! Bound: the log holds at most `limit` bytes and [`MAX_ENTRIES`] entries of acknowledged
//! writes (past either, the device flushes before it sends another write) plus the writes in
//! flight.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Most entries kept before a flush is forced, whatever their bytes.
pub(crate) const MAX_ENTRIES: usize = 16_384;

/// A change to the export's contents that must be re-sent if the server may have lost it.
#[derive(Debug)]
pub(crate) enum Change {
    Write { offset: u64, data: Vec<u8> },
    Zeroes { offset: u64, len: u64 },
}

impl Change {
    pub(crate) fn range(&self) -> (u64, u64) {
        match self {
            Change::Write { offset, data } => (*offset, *offset + data.len() as u64),
            Change::Zeroes { offset, len } => (*offset, *offset + *len),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Change::Write { data, .. } => data.len(),
            Change::Zeroes { .. } => 0,
        }
    }
}

struct Entry {
    change: Arc<Change>,
    /// The server answered it: a FLUSH sent from now on covers it.
    acknowledged: bool,
}

pub(crate) struct ReplayLog {
    entries: BTreeMap<u64, Entry>,
    next_seq: u64,
    bytes: usize,
    limit: usize,
}

impl ReplayLog {
    pub(crate) fn new(limit: usize) -> ReplayLog {
        ReplayLog {
            entries: BTreeMap::new(),
            next_seq: 0,
            bytes: 0,
            limit,
        }
    }

    /// Whether the log is past its limit: the device flushes before it sends more. Past
    /// [`MAX_ENTRIES`] entries too (WRITE_ZEROES entries carry no bytes).
    pub(crate) fn over_limit(&self) -> bool {
        self.bytes > self.limit || self.entries.len() > MAX_ENTRIES
    }

    /// Records a change about to be sent; returns its sequence number.
    pub(crate) fn record(&mut self, change: Change) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += change.bytes();
        let change = Arc::new(change);
        let entry = Entry {
            change,
            acknowledged: false,
        };
        self.entries.insert(seq, entry);
        seq
    }

    pub(crate) fn acknowledged(&mut self, seq: u64) {
        if let Some(entry) = self.entries.get_mut(&seq) {
            entry.acknowledged = true;
        }
    }

    /// Drops a change the server refused or that was given up on: its caller was told it
    /// failed, so nothing relies on it.
    pub(crate) fn forget(&mut self, seq: u64) {
        if let Some(entry) = self.entries.remove(&seq) {
            self.bytes -= entry.change.bytes();
        }
    }

    /// The changes acknowledged by now: a FLUSH sent after this call covers them.
    pub(crate) fn acknowledged_now(&self) -> Vec<u64> {
        let acked = self.entries.iter().filter(|(_, e)| e.acknowledged);
        acked.map(|(seq, _)| *seq).collect()
    }

    /// Drops the changes a successful FLUSH covered.
    pub(crate) fn durable(&mut self, seqs: &[u64]) {
        for seq in seqs {
            self.forget(*seq);
        }
    }

    /// Every change kept, oldest first: what a new connection must carry before anything else.
    pub(crate) fn to_replay(&self) -> Vec<Arc<Change>> {
        self.entries
            .values()
            .map(|e| Arc::clone(&e.change))
            .collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(offset: u64, len: usize) -> Change {
        Change::Write {
            offset,
            data: vec![1; len],
        }
    }

    #[test]
    fn a_flush_drops_only_what_was_acknowledged_before_it() {
        let mut log = ReplayLog::new(8192);
        let a = log.record(write(0, 4096));
        let b = log.record(write(4096, 4096));
        log.acknowledged(a);
        let covered = log.acknowledged_now();
        log.acknowledged(b); // answered after the FLUSH was sent: not covered
        log.durable(&covered);
        assert_eq!(log.len(), 1);
        assert_eq!(log.to_replay()[0].range(), (4096, 8192));
        assert_eq!(log.bytes(), 4096);
        log.forget(b);
        assert_eq!((log.len(), log.bytes()), (0, 0));
    }

    #[test]
    fn replays_in_the_order_sent_and_counts_its_bound() {
        let mut log = ReplayLog::new(4096);
        log.record(write(8192, 4096));
        assert!(!log.over_limit());
        log.record(Change::Zeroes {
            offset: 0,
            len: 1 << 30,
        });
        log.record(write(0, 4096));
        assert!(log.over_limit());
        let ranges: Vec<_> = log.to_replay().iter().map(|c| c.range()).collect();
        assert_eq!(ranges, [(8192, 12288), (0, 1 << 30), (0, 4096)]);
    }
}
