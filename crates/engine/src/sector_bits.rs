//! One sector bitmap per cache slot, packed to the line's sector count: the map keeps four of
//! these (valid, dirty, unverified, recorded dirty), so their width is most of their RAM. A
//! 64 KiB line has 16 sectors: 2 bytes per bitmap instead of the 32 a full `SectorBitmap`
//! takes, or the 8 of one u64 word per slot.

use ssdcache_format::SectorBitmap;

/// Sectors a `SectorBitmap` holds (lines of up to 1 MiB of 4 KiB sectors).
const MAX_SECTORS: usize = 256;

/// A bitmap of `width` bits per slot in one array of u64 words. `width` is the line's sector
/// count, a power of two (line sizes are powers of two, `Layout::compute` checks), so a slot
/// with up to 64 sectors lies within one word (64 / `width` slots share it) and one with more
/// takes whole words of its own: a slot's bits never straddle words, so a load or store is one
/// shift and mask, or a copy of whole words.
#[derive(Debug)]
pub struct SlotBitmaps {
    words: Vec<u64>,
    /// Bits per slot: a power of two from 1 to `MAX_SECTORS`.
    width: usize,
}

impl SlotBitmaps {
    /// Empty bitmaps for `slots` slots of `sectors_per_line` sectors (rounded up to a power of
    /// two, and to at most `MAX_SECTORS`: what a `SectorBitmap` holds).
    pub fn new(slots: usize, sectors_per_line: usize) -> SlotBitmaps {
        let width = sectors_per_line.clamp(1, MAX_SECTORS).next_power_of_two();
        SlotBitmaps {
            words: vec![0; (slots * width).div_ceil(64)],
            width,
        }
    }

    /// The low `width` bits of one word (when `width` < 64).
    fn mask(&self) -> u64 {
        (1u64 << self.width) - 1
    }

    /// Words per slot when a slot takes whole words.
    fn words_per_slot(&self) -> usize {
        self.width / 64
    }

    /// A slot's bitmap (sectors past `width` clear).
    pub fn get(&self, slot: u32) -> SectorBitmap {
        let mut bits = SectorBitmap::default();
        if self.width >= 64 {
            let n = self.words_per_slot();
            let at = slot as usize * n;
            bits.0[..n].copy_from_slice(&self.words[at..at + n]);
        } else {
            let bit = slot as usize * self.width;
            bits.0[0] = (self.words[bit / 64] >> (bit % 64)) & self.mask();
        }
        bits
    }

    /// Sets a slot's bitmap. Sectors past `width` are not kept (the map never sets them:
    /// every sector range is checked against the line first).
    pub fn set(&mut self, slot: u32, bits: &SectorBitmap) {
        debug_assert!(
            (self.width..MAX_SECTORS).all(|s| !bits.get(s)),
            "sector past the line's {} in slot {slot}'s bitmap",
            self.width
        );
        if self.width >= 64 {
            let n = self.words_per_slot();
            let at = slot as usize * n;
            self.words[at..at + n].copy_from_slice(&bits.0[..n]);
        } else {
            let bit = slot as usize * self.width;
            let mask = self.mask();
            let word = &mut self.words[bit / 64];
            *word = (*word & !(mask << (bit % 64))) | ((bits.0[0] & mask) << (bit % 64));
        }
    }

    /// Whether no sector of the slot is set.
    pub fn is_empty(&self, slot: u32) -> bool {
        if self.width >= 64 {
            let n = self.words_per_slot();
            let at = slot as usize * n;
            self.words[at..at + n].iter().all(|&w| w == 0)
        } else {
            let bit = slot as usize * self.width;
            (self.words[bit / 64] >> (bit % 64)) & self.mask() == 0
        }
    }

    /// Clears one slot's bitmap.
    pub fn clear(&mut self, slot: u32) {
        self.set(slot, &SectorBitmap::default());
    }

    /// Clears every slot's bitmap.
    pub fn clear_all(&mut self) {
        self.words.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bitmap(words: [u64; 4], sectors: usize) -> SectorBitmap {
        let mut b = SectorBitmap(words);
        for s in sectors..MAX_SECTORS {
            b.set(s, false);
        }
        b
    }

    /// Bytes per slot for each line size: the point of the type.
    #[test]
    fn a_slot_takes_its_sector_count_in_bits() {
        for (sectors, bytes_for_1024_slots) in [(1, 128), (16, 2048), (64, 8192), (256, 32768)] {
            let b = SlotBitmaps::new(1024, sectors);
            assert_eq!(b.words.len() * 8, bytes_for_1024_slots, "{sectors} sectors");
        }
    }

    proptest! {
        /// Random stores into neighbouring slots, against a plain array of full bitmaps:
        /// every slot reads back its own last store, whatever its neighbours did.
        #[test]
        fn slots_keep_their_own_bits(
            shift in 0usize..=8,
            slots in 1usize..200,
            ops in prop::collection::vec((0usize..200, any::<[u64; 4]>(), any::<bool>()), 0..400),
        ) {
            let sectors = 1usize << shift;
            let mut packed = SlotBitmaps::new(slots, sectors);
            let mut model = vec![SectorBitmap::default(); slots];
            for (slot, words, clear) in ops {
                let slot = slot % slots;
                let bits = if clear { SectorBitmap::default() } else { bitmap(words, sectors) };
                if clear {
                    packed.clear(slot as u32);
                } else {
                    packed.set(slot as u32, &bits);
                }
                model[slot] = bits;
                for (s, want) in model.iter().enumerate() {
                    prop_assert_eq!(packed.get(s as u32), *want, "slot {}", s);
                    prop_assert_eq!(packed.is_empty(s as u32), want.is_empty(), "slot {}", s);
                }
            }
            packed.clear_all();
            prop_assert!((0..slots as u32).all(|s| packed.is_empty(s)));
        }
    }
}
