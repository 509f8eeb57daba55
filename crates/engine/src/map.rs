//! The mapping from (volume, backing line) to cache slot, with per-sector valid bits and the
//! replacement policy. Everything here runs under one mutex held only for bookkeeping, never
//! across I/O.

use std::collections::HashMap;

use crate::locks::{line_key, LineKey, LineLocks};
use crate::policy::ReplacementPolicy;
use ssdcache_format::superblock::MAX_VOLUMES;
use ssdcache_format::{LineRecord, SectorBitmap};

const NO_KEY: LineKey = u64::MAX;

pub struct MapState {
    map: HashMap<LineKey, u32>,
    /// Key held by each slot, `NO_KEY` when free.
    keys: Vec<LineKey>,
    /// Valid-sector words, `words_per_line` per slot.
    valid: Vec<u64>,
    words_per_line: usize,
    sectors_per_line: usize,
    free: Vec<u32>,
    policy: Box<dyn ReplacementPolicy>,
    /// Lines and valid sectors held per volume, for occupancy statistics.
    lines_used: [u64; MAX_VOLUMES],
    sectors_valid: [u64; MAX_VOLUMES],
}

/// Where a line is cached and which of its sectors are valid.
#[derive(Debug, Clone, Copy)]
pub struct Lookup {
    pub slot: u32,
    pub valid: SectorBitmap,
}

impl MapState {
    pub fn new(
        line_count: u32,
        sectors_per_line: usize,
        policy: Box<dyn ReplacementPolicy>,
    ) -> MapState {
        let words_per_line = sectors_per_line.div_ceil(64);
        MapState {
            map: HashMap::new(),
            keys: vec![NO_KEY; line_count as usize],
            valid: vec![0; line_count as usize * words_per_line],
            words_per_line,
            sectors_per_line,
            // Popping from the end hands out low slots first.
            free: (0..line_count).rev().collect(),
            policy,
            lines_used: [0; MAX_VOLUMES],
            sectors_valid: [0; MAX_VOLUMES],
        }
    }

    fn bitmap(&self, slot: u32) -> SectorBitmap {
        let at = slot as usize * self.words_per_line;
        let mut b = SectorBitmap::default();
        b.0[..self.words_per_line].copy_from_slice(&self.valid[at..at + self.words_per_line]);
        b
    }

    fn store_bitmap(&mut self, slot: u32, b: &SectorBitmap) {
        let at = slot as usize * self.words_per_line;
        self.valid[at..at + self.words_per_line].copy_from_slice(&b.0[..self.words_per_line]);
    }

    fn volume_of(key: LineKey) -> usize {
        (key >> 48) as usize
    }

    /// Looks a line up and, if cached, counts it as used.
    pub fn lookup(&mut self, volume: u16, line: u64) -> Option<Lookup> {
        let slot = *self.map.get(&line_key(volume, line))?;
        self.policy.touch(slot);
        Some(Lookup {
            slot,
            valid: self.bitmap(slot),
        })
    }

    /// Finds a slot for a line not in the map: a free one, or the policy's victim among lines
    /// no request holds. The caller holds the line's lock. `None` when every slot is busy.
    pub fn allocate(&mut self, volume: u16, line: u64, locks: &LineLocks) -> Option<u32> {
        let key = line_key(volume, line);
        debug_assert!(!self.map.contains_key(&key), "allocate of a mapped line");
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let keys = &self.keys;
                let victim = self
                    .policy
                    .victim(&mut |s| !locks.is_held(keys[s as usize]))?;
                self.release(victim);
                self.free.pop()?
            }
        };
        debug_assert_eq!(self.keys[slot as usize], NO_KEY);
        self.keys[slot as usize] = key;
        self.map.insert(key, slot);
        self.lines_used[Self::volume_of(key)] += 1;
        self.policy.insert(slot);
        Some(slot)
    }

    /// Frees a slot: unmapped, no valid sectors, back on the free list.
    fn release(&mut self, slot: u32) {
        let key = self.keys[slot as usize];
        debug_assert_ne!(key, NO_KEY, "release of a free slot");
        let vol = Self::volume_of(key);
        self.sectors_valid[vol] -= u64::from(self.bitmap(slot).count());
        self.lines_used[vol] -= 1;
        self.map.remove(&key);
        self.keys[slot as usize] = NO_KEY;
        self.store_bitmap(slot, &SectorBitmap::default());
        self.policy.remove(slot);
        self.free.push(slot);
    }

    /// Marks sectors `first..first+count` of a slot valid or invalid; frees the slot when no
    /// valid sector remains.
    pub fn set_valid(&mut self, slot: u32, first: usize, count: usize, on: bool) {
        debug_assert!(first + count <= self.sectors_per_line);
        let key = self.keys[slot as usize];
        if key == NO_KEY {
            return;
        }
        let mut b = self.bitmap(slot);
        let before = b.count();
        for s in first..first + count {
            b.set(s, on);
        }
        let after = b.count();
        let vol = Self::volume_of(key);
        self.sectors_valid[vol] = self.sectors_valid[vol] + u64::from(after) - u64::from(before);
        self.store_bitmap(slot, &b);
        if after == 0 {
            self.release(slot);
        }
    }

    /// Drops sectors of a line from the cache, if it is cached.
    pub fn invalidate(&mut self, volume: u16, line: u64, first: usize, count: usize) {
        if let Some(&slot) = self.map.get(&line_key(volume, line)) {
            self.set_valid(slot, first, count, false);
        }
    }

    pub fn occupancy(&self, volume: u16) -> (u64, u64) {
        let v = usize::from(volume);
        (self.lines_used[v], self.sectors_valid[v])
    }

    pub fn used_lines(&self) -> usize {
        self.map.len()
    }

    /// The record of every slot, for a checkpoint.
    pub fn records(&self) -> impl Iterator<Item = LineRecord> + '_ {
        self.keys.iter().enumerate().map(|(slot, &key)| {
            if key == NO_KEY {
                return LineRecord::FREE;
            }
            LineRecord {
                volume: (key >> 48) as u16,
                flags: 0,
                backing_line: key & ((1 << 48) - 1),
                valid: self.bitmap(slot as u32),
                dirty: SectorBitmap::default(),
            }
        })
    }

    /// Rebuilds the free list after `restore` calls.
    pub fn rebuild_free_list(&mut self) {
        let n = self.keys.len() as u32;
        self.free = (0..n)
            .rev()
            .filter(|&s| self.keys[s as usize] == NO_KEY)
            .collect();
    }

    /// Restores a slot from a checkpoint record (call `rebuild_free_list` after the last). Records for unknown volumes or lines past a
    /// volume's end are dropped by the caller before this.
    pub fn restore(&mut self, slot: u32, rec: &LineRecord) {
        let key = line_key(rec.volume, rec.backing_line);
        if rec.valid.is_empty() || self.map.contains_key(&key) || self.keys[slot as usize] != NO_KEY
        {
            return;
        }
        self.keys[slot as usize] = key;
        self.map.insert(key, slot);
        self.lines_used[usize::from(rec.volume)] += 1;
        self.policy.insert(slot);
        let mut valid = rec.valid;
        for s in self.sectors_per_line..256 {
            valid.set(s, false);
        }
        self.sectors_valid[usize::from(rec.volume)] += u64::from(valid.count());
        self.store_bitmap(slot, &valid);
    }
}
