//! LIRS in 19 bytes per slot (`lirs-lean`): the algorithm of `lirs.rs` with its stack S kept
//! as access times instead of a list, and its ghosts in a table of 3-byte entries.
//!
//! What LIRS needs of S is only where an entry stands against the bottom LIR line: a resident
//! HIR line hit while in S becomes LIR, and a missed key whose ghost is in S comes back as
//! LIR. S is ordered by last use, entries are pushed only on top and pruned only from the
//! bottom, and the bottom is the least recently used LIR line. So an entry is in S exactly
//! when its last use is more recent than the bottom LIR line's, and S itself need not be
//! stored: each slot keeps the time of its last use (a counter of `insert`s and `touch`es),
//! the LIR lines are an LRU list (its oldest end is the bottom), and the resident HIR lines
//! are the queue Q as in `lirs.rs`. One pair of links per slot serves both lists, since a
//! line is in exactly one. Pruning costs nothing: the bottom's time only grows (a LIR line is
//! only ever touched, demoted or removed), and whatever is older than it is out of S.
//!
//! Ghosts (non-resident HIR keys in S) are entries of a bucketed hash table sized once, for
//! as many ghosts as there are slots (as `lirs.rs`): 8 entries per bucket, chosen by the
//! evicted line's 32-bit fingerprint, each a 16-bit tag of that fingerprint and an 8-bit
//! epoch. Ghosts are numbered into epochs in the order they are made (1/128 of the capacity
//! each), and the table remembers, per epoch, the last-use time of the most recent line it
//! made a ghost of. A ghost counts as in S when its epoch's time is more recent than the
//! bottom LIR line's (ghosts are made from Q's oldest end, so an epoch covers a short range
//! of last-use times); it is forgotten once 128 epochs are newer (the table's capacity, as
//! the oldest ghost of a full `lirs.rs` table is forgotten). A place is reused when empty,
//! forgotten, or below S; a full bucket gives up its oldest ghost. A sweep that looks at
//! about one entry per new ghost clears forgotten entries before the 8-bit epoch number comes
//! round again. No index is needed: the bucket is the index. A tag is 16 bits of the
//! fingerprint (one chance in 2^16 per entry of the bucket that a new key finds another's
//! ghost, about 1 in 8,000 misses with a full bucket; that ranks the line LIR, never changes
//! data).
//!
//! RAM per slot: links 8, last-use time 4 (31 bits; the top bit says the line is HIR), the
//! fingerprint of the key 4 (for its ghost, as `lirs.rs` keeps), ghost table 3 (one 3-byte
//! entry per slot, rounded up to a whole bucket): 19 bytes, plus 1 KiB of per-epoch times.
//! `lirs.rs` takes 48.
//!
//! Times are 31-bit and wrap (every 2^31 accesses, about 6 hours at 100,000 per second), so
//! they are compared as ages (`now - time`, modulo 2^31). Ages must stay below 2^31: every
//! access also looks at one slot (a full pass within 2^28 accesses at up to 2^28 slots, more
//! per access above) and one epoch, and pulls a time older than 2^29 accesses forward to
//! 2^29. Lines unused for that long all look equally old to the S test, nothing else.
//!
//! How it differs from `lirs.rs` (which it follows call for call): the in-S test of a ghost
//! has the precision of an epoch; ghosts are forgotten in the order they were made, a bucket
//! at a time when its 8 places are in use, rather than strictly oldest first; a key may
//! (rarely) meet another's ghost, as above. On the shared traces the hit ratios are within
//! about a point of `lirs`, on both sides, at every size (docs/policies.md).
//!
//! The engine's calls, as in `lirs.rs`: `insert` is a miss (a key whose ghost is in S becomes
//! LIR; while fewer lines than the LIR target are LIR, any new line does), `touch` a hit,
//! `remove` after `victim` leaves a ghost if the line is still in S, any other `remove` drops
//! the slot without one. `victim(key)` looks the missed key's ghost up (and forgets it) before
//! choosing, so the eviction cannot push it out first. The victim is the first evictable line
//! of Q (unevictable ones move to Q's end), else the least recently used evictable LIR line.

use super::ghost::{fingerprint, Fingerprint};
use super::ReplacementPolicy;

/// No slot: the end of a list, or no victim pending.
const NIL: u32 = u32::MAX;
/// The `older` link of a slot in neither list (untracked).
const UNLINKED: u32 = u32::MAX - 1;
const LIR: usize = 0;
/// The queue Q of resident HIR lines.
const HIR: usize = 1;
/// In a slot's `stamp`: the line is HIR (in Q).
const HIR_FLAG: u32 = 1 << 31;
/// The time bits of a `stamp`.
const TIME: u32 = HIR_FLAG - 1;
/// Ages beyond this are pulled forward to it (wrap safety).
const OLDEST_AGE: u32 = 1 << 29;
/// Slots a full pass of the wrap sweep may take, in accesses.
const SWEEP_PASS: u32 = 1 << 28;

/// Places of a ghost bucket.
const WAYS: usize = 8;
/// Epoch numbers (the 8 bits of an entry).
const EPOCHS: u32 = 256;
/// Epochs a ghost stays: the table's capacity is `LIVE_EPOCHS` epochs of ghosts.
const LIVE_EPOCHS: u32 = 128;
/// An empty place's tag (a fingerprint's tag is never 0).
const EMPTY: u16 = 0;

/// `now - time` modulo 2^31: how many accesses ago `time` was.
fn age(now: u32, time: u32) -> u32 {
    now.wrapping_sub(time) & TIME
}

/// `age` as S compares it: the wrap sweep pulls stored times no further back than
/// `OLDEST_AGE`, so all ages beyond it count as equal wherever the sweep has reached (review
/// 27, F1: idle lines were ranked by where the sweep was).
fn stack_age(now: u32, time: u32) -> u32 {
    age(now, time).min(OLDEST_AGE)
}

/// Ghosts: 16-bit tags and 8-bit epochs in buckets of `WAYS` places, chosen by fingerprint.
struct StampedGhosts {
    tags: Vec<u16>,
    epochs: Vec<u8>,
    buckets: u32,
    /// The epoch new ghosts are numbered into, and how many it has.
    epoch: u32,
    in_epoch: u32,
    per_epoch: u32,
    /// Per epoch, the most recent last-use time of the lines it made ghosts of.
    newest: Vec<u32>,
    /// The next place the sweep looks at, and places per new ghost.
    sweep_at: usize,
    sweep_step: u32,
}

impl StampedGhosts {
    /// Room for `capacity` ghosts (at least one bucket).
    fn new(capacity: u32) -> StampedGhosts {
        let capacity = capacity.max(1);
        let buckets = capacity.div_ceil(WAYS as u32);
        let places = buckets as usize * WAYS;
        let per_epoch = capacity.div_ceil(LIVE_EPOCHS);
        // A forgotten entry must be cleared before its epoch number comes round again:
        // within EPOCHS - LIVE_EPOCHS - 1 epochs of new ghosts.
        let window = u64::from(EPOCHS - LIVE_EPOCHS - 1) * u64::from(per_epoch);
        let sweep_step = (places as u64).div_ceil(window) as u32;
        StampedGhosts {
            tags: vec![EMPTY; places],
            epochs: vec![0; places],
            buckets,
            epoch: 0,
            in_epoch: 0,
            per_epoch,
            newest: vec![0; EPOCHS as usize],
            sweep_at: 0,
            sweep_step,
        }
    }

    /// The first place of `print`'s bucket: the high bits of the fingerprint, scaled.
    fn bucket(&self, print: Fingerprint) -> usize {
        ((u64::from(print) * u64::from(self.buckets)) >> 32) as usize * WAYS
    }

    /// 16 bits of the fingerprint, mixed so that they do not follow the bucket's bits.
    fn tag(print: Fingerprint) -> u16 {
        ((print.wrapping_mul(0x9e37_79b1) >> 16) as u16).max(1)
    }

    /// How many epochs ago a place's ghost was made.
    fn epoch_age(&self, place: usize) -> u32 {
        self.epoch.wrapping_sub(u32::from(self.epochs[place])) % EPOCHS
    }

    /// The place holds a ghost not yet forgotten.
    fn kept(&self, place: usize) -> bool {
        self.tags[place] != EMPTY && self.epoch_age(place) < LIVE_EPOCHS
    }

    /// The last-use time that stands for the ghost at `place`.
    fn time_of(&self, place: usize) -> u32 {
        self.newest[self.epochs[place] as usize]
    }

    /// Finds `print`'s ghost and forgets it; returns the time that stands for it.
    fn take(&mut self, print: Fingerprint) -> Option<u32> {
        let tag = Self::tag(print);
        let b = self.bucket(print);
        let place = (b..b + WAYS).find(|&p| self.tags[p] == tag && self.kept(p))?;
        self.tags[place] = EMPTY;
        Some(self.time_of(place))
    }

    /// Records a ghost of `print` for a line last used at `time`; `below_stack(time)` tells
    /// a time below the bottom of S (a ghost that stands there is no longer in S).
    fn record(&mut self, print: Fingerprint, time: u32, below_stack: impl Fn(u32) -> bool) {
        self.sweep();
        if self.in_epoch == self.per_epoch {
            self.epoch = (self.epoch + 1) % EPOCHS;
            self.in_epoch = 0;
        }
        let e = self.epoch as usize;
        if self.in_epoch == 0 || age(time, self.newest[e]) < OLDEST_AGE {
            self.newest[e] = time;
        }
        self.in_epoch += 1;
        let tag = Self::tag(print);
        let b = self.bucket(print);
        // The key's own older ghost, else a free place, else the oldest ghost.
        let place = (b..b + WAYS)
            .find(|&p| self.tags[p] == tag)
            .or_else(|| (b..b + WAYS).find(|&p| !self.kept(p) || below_stack(self.time_of(p))))
            .unwrap_or_else(|| {
                (b..b + WAYS)
                    .max_by_key(|&p| (self.epoch_age(p), std::cmp::Reverse(p)))
                    .expect("a bucket has places")
            });
        self.tags[place] = tag;
        self.epochs[place] = self.epoch as u8;
    }

    /// Clears forgotten ghosts, `sweep_step` places per new ghost.
    fn sweep(&mut self) {
        for _ in 0..self.sweep_step {
            if self.tags[self.sweep_at] != EMPTY && !self.kept(self.sweep_at) {
                self.tags[self.sweep_at] = EMPTY;
            }
            self.sweep_at += 1;
            if self.sweep_at == self.tags.len() {
                self.sweep_at = 0;
            }
        }
    }

    /// Pulls one epoch's time forward if it is older than `OLDEST_AGE` (every epoch once in
    /// `EPOCHS` accesses).
    fn clamp_one(&mut self, now: u32) {
        let t = &mut self.newest[(now % EPOCHS) as usize];
        if age(now, *t) > OLDEST_AGE {
            *t = now.wrapping_sub(OLDEST_AGE) & TIME;
        }
    }
}

pub struct LirsLean {
    /// Links of the LIR list or Q (a tracked slot is in exactly one); `older` is `UNLINKED`
    /// for an untracked slot.
    older: Vec<u32>,
    newer: Vec<u32>,
    /// The slot's last use (31 bits) and `HIR_FLAG` when it is in Q.
    stamp: Vec<u32>,
    /// The fingerprint of each slot's key, for its ghost (the engine holds the key itself).
    prints: Vec<Fingerprint>,
    newest: [u32; 2],
    oldest: [u32; 2],
    len: [u32; 2],
    now: u32,
    sweep_at: usize,
    sweep_step: u32,
    lir_target: u32,
    ghosts: StampedGhosts,
    /// The slot the last `victim` returned, until the next call.
    victim: u32,
    /// The key whose ghost the last `victim` found in S (and forgot), until its `insert`.
    ghost_hit: Option<u64>,
}

impl LirsLean {
    pub fn new(slots: u32) -> LirsLean {
        let hir_target = (slots / 100).max(1);
        let n = slots as usize;
        LirsLean {
            older: vec![UNLINKED; n],
            newer: vec![NIL; n],
            stamp: vec![0; n],
            prints: vec![0; n],
            newest: [NIL; 2],
            oldest: [NIL; 2],
            len: [0; 2],
            now: 0,
            sweep_at: 0,
            sweep_step: slots.div_ceil(SWEEP_PASS), // 0 only without slots
            lir_target: slots.saturating_sub(hir_target),
            ghosts: StampedGhosts::new(slots),
            victim: NIL,
            ghost_hit: None,
        }
    }

    fn is_tracked(&self, slot: u32) -> bool {
        self.older
            .get(slot as usize)
            .is_some_and(|&o| o != UNLINKED)
    }

    /// The list of a tracked slot.
    fn list_of(&self, slot: u32) -> usize {
        if self.stamp[slot as usize] & HIR_FLAG != 0 {
            HIR
        } else {
            LIR
        }
    }

    fn time_of(&self, slot: u32) -> u32 {
        self.stamp[slot as usize] & TIME
    }

    /// Pushes an untracked slot at the newest end of `list`, with `time` as its last use.
    fn push_newest(&mut self, list: usize, slot: u32, time: u32) {
        let i = slot as usize;
        let head = self.newest[list];
        self.older[i] = head;
        self.newer[i] = NIL;
        if head == NIL {
            self.oldest[list] = slot;
        } else {
            self.newer[head as usize] = slot;
        }
        self.newest[list] = slot;
        self.len[list] += 1;
        self.stamp[i] = if list == HIR { time | HIR_FLAG } else { time };
    }

    /// Takes a tracked slot out of its list (it is then untracked).
    fn unlink(&mut self, slot: u32) {
        let list = self.list_of(slot);
        let i = slot as usize;
        let (o, w) = (self.older[i], self.newer[i]);
        if o == NIL {
            self.oldest[list] = w;
        } else {
            self.newer[o as usize] = w;
        }
        if w == NIL {
            self.newest[list] = o;
        } else {
            self.older[w as usize] = o;
        }
        self.older[i] = UNLINKED;
        self.newer[i] = NIL;
        self.len[list] -= 1;
    }

    /// Moves a tracked slot to the newest end of `list`, keeping or setting its time.
    fn move_to_newest(&mut self, list: usize, slot: u32, time: u32) {
        self.unlink(slot);
        self.push_newest(list, slot, time);
    }

    /// The next access's time. Also pulls forward the times of the slots and the epoch the
    /// wrap sweep comes to.
    fn tick(&mut self) -> u32 {
        self.now = (self.now + 1) & TIME;
        for _ in 0..self.sweep_step {
            let i = self.sweep_at;
            if self.older[i] != UNLINKED && age(self.now, self.stamp[i] & TIME) > OLDEST_AGE {
                let flag = self.stamp[i] & HIR_FLAG;
                self.stamp[i] = flag | (self.now.wrapping_sub(OLDEST_AGE) & TIME);
            }
            self.sweep_at = if i + 1 == self.older.len() { 0 } else { i + 1 };
        }
        self.ghosts.clamp_one(self.now);
        self.now
    }

    /// How long ago the bottom of S (the least recently used LIR line) was used, as S
    /// compares it (`stack_age`); `None` when there is no LIR line, and so nothing in S.
    fn bottom_age(&self) -> Option<u32> {
        let b = self.oldest[LIR];
        (b != NIL).then(|| stack_age(self.now, self.time_of(b)))
    }

    /// Something last used at `time` stands above the bottom of S.
    fn in_stack(&self, time: u32) -> bool {
        self.bottom_age()
            .is_some_and(|b| stack_age(self.now, time) < b)
    }

    /// Demotes the bottom LIR lines to Q's end until no more than the target are LIR. Their
    /// times stay: they are below the new bottom, out of S.
    fn demote_excess(&mut self) {
        while self.len[LIR] > self.lir_target {
            let b = self.oldest[LIR];
            let time = self.time_of(b);
            self.move_to_newest(HIR, b, time);
        }
    }

    /// Forgets the ghost of `key`; true when it was in S.
    fn take_ghost(&mut self, key: u64) -> bool {
        self.ghosts
            .take(fingerprint(key))
            .is_some_and(|t| self.in_stack(t))
    }

    #[cfg(test)]
    fn is_lir(&self, slot: u32) -> Option<bool> {
        self.is_tracked(slot).then(|| self.list_of(slot) == LIR)
    }

    /// Heap bytes of the policy's arrays, as allocated.
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        self.older.capacity() * 4
            + self.newer.capacity() * 4
            + self.stamp.capacity() * 4
            + self.prints.capacity() * 4
            + self.ghosts.tags.capacity() * 2
            + self.ghosts.epochs.capacity()
            + self.ghosts.newest.capacity() * 4
    }
}

impl ReplacementPolicy for LirsLean {
    fn insert(&mut self, slot: u32, key: u64) {
        self.victim = NIL;
        if self.is_tracked(slot) {
            self.remove(slot);
        }
        self.prints[slot as usize] = fingerprint(key);
        let now = self.tick();
        if self.ghost_hit.take() == Some(key) || self.take_ghost(key) {
            // Its reuse distance beat the least recent LIR line's: it becomes LIR.
            self.push_newest(LIR, slot, now);
            self.demote_excess();
        } else if self.len[LIR] < self.lir_target {
            self.push_newest(LIR, slot, now);
        } else {
            self.push_newest(HIR, slot, now);
        }
    }

    fn touch(&mut self, slot: u32) {
        if !self.is_tracked(slot) {
            return;
        }
        self.victim = NIL;
        let was = self.time_of(slot);
        let now = self.tick();
        if self.list_of(slot) == LIR {
            self.move_to_newest(LIR, slot, now);
        } else if self.in_stack(was) {
            // A HIR line still in S: reused sooner than the bottom LIR line.
            self.move_to_newest(LIR, slot, now);
            self.demote_excess();
        } else {
            self.move_to_newest(HIR, slot, now);
        }
    }

    fn remove(&mut self, slot: u32) {
        let evicted = std::mem::replace(&mut self.victim, NIL) == slot;
        if !self.is_tracked(slot) {
            return;
        }
        self.unlink(slot);
        let time = self.time_of(slot);
        // A victim leaves a ghost where it stood in S, if it stood in S (a bottom LIR line, or
        // a HIR line below the bottom, does not).
        if evicted && self.in_stack(time) {
            let now = self.now;
            let bottom = self.bottom_age().expect("something is in S");
            self.ghosts.record(self.prints[slot as usize], time, |t| {
                stack_age(now, t) >= bottom
            });
        }
    }

    fn victim(&mut self, incoming: u64, evictable: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.victim = NIL;
        if self.ghost_hit != Some(incoming) {
            self.ghost_hit = self.take_ghost(incoming).then_some(incoming);
        }
        for _ in 0..self.len[HIR] {
            let s = self.oldest[HIR];
            if evictable(s) {
                self.victim = s;
                return Some(s);
            }
            let time = self.time_of(s);
            self.move_to_newest(HIR, s, time);
        }
        let mut n = self.oldest[LIR];
        while n != NIL {
            if evictable(n) {
                self.victim = n;
                return Some(n);
            }
            n = self.newer[n as usize];
        }
        None
    }

    fn tracked(&self) -> u32 {
        self.len[LIR] + self.len[HIR]
    }

    fn name(&self) -> &'static str {
        "lirs-lean"
    }
}

#[cfg(test)]
mod tests {
    use super::super::{simulate_hits, Lirs};
    use super::*;
    use ssdcache_device::SplitMix64 as Rng;

    fn evict(p: &mut LirsLean) -> u32 {
        let v = p.victim(u64::MAX, &mut |_| true).unwrap();
        p.remove(v);
        v
    }

    fn full(slots: u32) -> LirsLean {
        let mut p = LirsLean::new(slots);
        for s in 0..slots {
            p.insert(s, u64::from(s));
        }
        p
    }

    #[test]
    fn warm_up_fills_lir_then_new_lines_are_hir() {
        let p = full(100);
        assert!((0..99).all(|s| p.is_lir(s) == Some(true)));
        assert_eq!(p.is_lir(99), Some(false));
        assert_eq!(p.tracked(), 100);
    }

    #[test]
    fn a_scan_only_cycles_through_the_hir_slots() {
        let mut p = full(100);
        for k in 0..10_000u64 {
            let v = evict(&mut p);
            assert_eq!(v, 99, "the scan evicted a LIR line");
            p.insert(v, 1000 + k);
        }
        assert!((0..99).all(|s| p.is_lir(s) == Some(true)));
    }

    #[test]
    fn a_ghost_hit_becomes_lir_and_demotes_the_bottom() {
        let mut p = full(100);
        p.touch(5);
        // Slot 99 (key 99, HIR, used after every LIR line but 5) leaves a ghost in S.
        assert_eq!(evict(&mut p), 99);
        p.insert(99, 99);
        assert_eq!(p.is_lir(99), Some(true));
        // The bottom LIR line (slot 0, least recent) was demoted to HIR, and goes next.
        assert_eq!(p.is_lir(0), Some(false));
        assert_eq!(evict(&mut p), 0);
    }

    #[test]
    fn a_ghost_below_the_bottom_is_not_in_the_stack() {
        let mut p = full(100);
        assert_eq!(evict(&mut p), 99);
        p.insert(99, 1000);
        // Every LIR line is used after key 99 was: the bottom moves above its ghost.
        for s in 0..99 {
            p.touch(s);
        }
        let v = p.victim(99, &mut |_| true).unwrap();
        assert_eq!(v, 99);
        p.remove(v);
        p.insert(v, 99);
        assert_eq!(p.is_lir(99), Some(false), "an old ghost made it LIR");
        assert!((0..99).all(|s| p.is_lir(s) == Some(true)));
    }

    #[test]
    fn a_miss_on_the_oldest_ghost_of_a_full_table_still_becomes_lir() {
        let mut p = full(100);
        // A scan through the HIR slot leaves 100 ghosts (keys 99, 1000..1099), all above the
        // bottom LIR line: the table's capacity, and key 99 is its oldest.
        for k in 0..100 {
            assert_eq!(evict(&mut p), 99);
            p.insert(99, 1000 + k);
        }
        // Key 99 misses: its ghost counts although the victim's ghost needs room.
        let v = p.victim(99, &mut |_| true).unwrap();
        assert_eq!(v, 99);
        p.remove(v);
        p.insert(v, 99);
        assert_eq!(p.is_lir(99), Some(true));
        assert_eq!(p.is_lir(0), Some(false), "the bottom LIR line was demoted");
        // The victim (key 1099) left a ghost: it comes back as LIR too.
        let v = p.victim(1099, &mut |_| true).unwrap();
        assert_eq!(v, 0);
        p.remove(v);
        p.insert(v, 1099);
        assert_eq!(p.is_lir(0), Some(true));
    }

    #[test]
    fn a_resident_hir_hit_in_the_stack_becomes_lir() {
        let mut p = full(100);
        p.touch(99); // HIR in S: becomes LIR, slot 0 demoted
        assert_eq!(p.is_lir(99), Some(true));
        assert_eq!(p.is_lir(0), Some(false));
        // Slot 0 is now HIR below the bottom: a hit keeps it HIR, at Q's end.
        p.touch(0);
        assert_eq!(p.is_lir(0), Some(false));
        p.touch(1);
        p.touch(0); // in S again and more recent than slot 2, the bottom LIR: promoted
        assert_eq!(p.is_lir(0), Some(true));
        assert_eq!(p.is_lir(2), Some(false));
    }

    #[test]
    fn an_invalidation_leaves_no_ghost() {
        let mut p = full(100);
        // HIR slot 99 dropped (not evicted): key 99 comes back as a new line, HIR.
        p.remove(99);
        p.insert(99, 99);
        assert_eq!(p.is_lir(99), Some(false));
        // Evicted, it leaves a ghost in S and comes back LIR.
        assert_eq!(evict(&mut p), 99);
        p.insert(99, 99);
        assert_eq!(p.is_lir(99), Some(true));
        // A LIR line dropped leaves room below the LIR target: the next new line is LIR.
        p.remove(50);
        p.insert(50, 5000);
        assert_eq!(p.is_lir(50), Some(true));
        // Inserting into a tracked slot drops its line first, without a ghost.
        p.insert(50, 6000);
        assert_eq!(p.tracked(), 100);
        let v = p.victim(5000, &mut |_| true).unwrap();
        p.remove(v);
        p.insert(v, 5000);
        assert_eq!(p.is_lir(v), Some(false));
    }

    #[test]
    fn respects_the_predicate() {
        let mut p = full(100);
        assert_eq!(p.victim(u64::MAX, &mut |_| false), None);
        // Q (slot 99) is busy: the least recent evictable LIR line goes.
        assert_eq!(p.victim(u64::MAX, &mut |s| s != 99 && s >= 10), Some(10));
        p.remove(10);
        assert_eq!(p.tracked(), 99);
        assert_eq!(p.victim(u64::MAX, &mut |s| s == 10), None);
        for s in 0..100 {
            p.remove(s);
        }
        assert_eq!(p.tracked(), 0);
        assert_eq!(p.victim(u64::MAX, &mut |_| true), None);
    }

    /// The times wrap at 2^31: a replay that starts just before the wrap decides exactly as
    /// one that starts at 0.
    #[test]
    fn decisions_do_not_change_where_the_time_wraps() {
        let mut rng = Rng(3);
        let keys: Vec<u64> = (0..60_000)
            .map(|_| {
                let r = rng.unit();
                (r * r * 3000.0) as u64
            })
            .collect();
        let mut a = LirsLean::new(200);
        let mut b = LirsLean::new(200);
        b.now = TIME - 30_000;
        let ra = simulate_hits(&mut a, 200, keys.iter().copied());
        let rb = simulate_hits(&mut b, 200, keys.iter().copied());
        assert!(b.now < 60_000, "the replay went through the wrap");
        assert_eq!(ra, rb);
    }

    /// The wrap sweep keeps every tracked slot's and every epoch's age at most OLDEST_AGE
    /// plus one pass.
    #[test]
    fn the_sweep_pulls_old_times_forward() {
        let mut p = full(100);
        for _ in 0..50 {
            let v = evict(&mut p);
            p.insert(v, 5000 + u64::from(v));
        }
        // Time jumps: every stamp is now far older than OLDEST_AGE.
        p.now = (p.now + (3 << 29)) & TIME;
        for _ in 0..EPOCHS {
            p.touch(0);
        }
        let now = p.now;
        for s in 0..100 {
            assert!(age(now, p.time_of(s)) <= OLDEST_AGE + EPOCHS, "slot {s}");
        }
        for e in 0..EPOCHS as usize {
            assert!(
                age(now, p.ghosts.newest[e]) <= OLDEST_AGE + EPOCHS,
                "epoch {e}"
            );
        }
        // The LIR and HIR ranks survive the jump.
        assert_eq!(p.tracked(), 100);
        assert_eq!(p.is_lir(0), Some(true));
    }

    #[test]
    fn ghosts_are_forgotten_after_the_capacity_and_never_come_back() {
        let mut g = StampedGhosts::new(1024);
        assert_eq!(g.per_epoch, 8);
        let below = |_| false;
        for k in 0..1024u32 {
            g.record(fingerprint(u64::from(k)), k, below);
        }
        // Recent ghosts are found once.
        assert!(g.take(fingerprint(1000)).is_some());
        assert!(g.take(fingerprint(1000)).is_none());
        // Ten times the capacity later, none of the first 1024 is left, though the epoch
        // numbers went round several times.
        for k in 0..10_240u32 {
            g.record(fingerprint(1 << 40 | u64::from(k)), k, below);
        }
        let found = (0..1024u64)
            .filter(|&k| g.take(fingerprint(k)).is_some())
            .count();
        assert_eq!(found, 0);
        let recent = (9_740..10_240u64)
            .filter(|&k| g.take(fingerprint(1 << 40 | k)).is_some())
            .count();
        assert!(recent > 490, "{recent} of the last 500 ghosts found");
    }

    #[test]
    fn a_bucket_reuses_places_below_the_stack_first() {
        let mut g = StampedGhosts::new(8); // one bucket
        for k in 0..8u32 {
            g.record(fingerprint(u64::from(k)), 100 + k, |_| false);
        }
        // Everything older than time 105 is below the stack: key 50 takes such a place, and
        // the ghosts of times 105..=107 stay.
        g.record(fingerprint(50), 200, |t| t < 105);
        assert!(g.take(fingerprint(50)).is_some());
        assert!((5..8).all(|k| g.take(fingerprint(k)).is_some()));
    }

    #[test]
    fn nineteen_bytes_per_slot() {
        let slots = 1 << 20;
        let p = LirsLean::new(slots);
        let per_slot = p.heap_bytes() as f64 / f64::from(slots);
        assert!((19.0..19.01).contains(&per_slot), "{per_slot}");
    }

    /// On streams with loops, scans and skew, the hit ratio stays within a point of LIRS's.
    #[test]
    fn close_to_lirs() {
        let mut rng = Rng(11);
        let mut scan = 1u64 << 40;
        let mut streams: Vec<(&str, u32, Vec<u64>)> = Vec::new();
        let skewed: Vec<u64> = (0..200_000)
            .map(|_| {
                let r = rng.unit();
                (r * r * r * 20_000.0) as u64
            })
            .collect();
        streams.push(("skewed", 1000, skewed));
        let mixed: Vec<u64> = (0..200_000)
            .map(|i| {
                if i % 3 == 0 {
                    scan += 1;
                    scan
                } else if i % 3 == 1 {
                    (i / 3) % 1500
                } else {
                    rng.next_u64() % 400
                }
            })
            .collect();
        streams.push(("loop + hot set + scan", 1000, mixed));
        for (what, slots, keys) in streams {
            let mut lean = LirsLean::new(slots);
            let mut lirs = Lirs::new(slots);
            let (a, _) = simulate_hits(&mut lean, slots, keys.iter().copied());
            let (b, _) = simulate_hits(&mut lirs, slots, keys.iter().copied());
            let (a, b) = (a as f64 / keys.len() as f64, b as f64 / keys.len() as f64);
            eprintln!("{what}: lirs-lean {a:.4} lirs {b:.4}");
            assert!((a - b).abs() < 0.01, "{what}: lirs-lean {a} lirs {b}");
        }
    }
}

#[cfg(test)]
mod review27;
