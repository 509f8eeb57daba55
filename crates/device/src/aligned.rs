//! A heap buffer aligned to 4096 bytes, as O_DIRECT requires (`Vec<u8>` does not promise it).
//! Shared by the engine and the NBD server so every request buffer can go to the device as is.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::ALIGN;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `len` bytes (capacity rounded up to whole 4 KiB pages, at least
    /// one), or `None` when the memory cannot be had: a server turns that into ENOMEM for one
    /// request instead of aborting.
    pub fn try_zeroed(len: usize) -> Option<AlignedBuf> {
        let capacity = len.div_ceil(ALIGN).max(1).checked_mul(ALIGN)?;
        let layout = Layout::from_size_align(capacity, ALIGN).ok()?;
        // SAFETY: layout has a non-zero size (capacity >= ALIGN).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len, capacity })
    }

    /// Like `try_zeroed`, for sizes the program chose itself (metadata pages, one line):
    /// running out of memory there ends the process as any allocation failure does.
    pub fn zeroed(len: usize) -> AlignedBuf {
        match Self::try_zeroed(len) {
            Some(buf) => buf,
            None => std::alloc::handle_alloc_error(Layout::new::<[u8; ALIGN]>()),
        }
    }

    /// Sets the length, replacing the allocation (contents not kept) when it exceeds the
    /// capacity. False, with the buffer unchanged, when the memory cannot be had.
    pub fn try_resize_discarding(&mut self, len: usize) -> bool {
        if len > self.capacity {
            match Self::try_zeroed(len) {
                Some(bigger) => *self = bigger,
                None => return false,
            }
        }
        self.len = len;
        true
    }

    /// `try_resize_discarding` for sizes the program chose itself.
    pub fn resize_discarding(&mut self, len: usize) {
        if !self.try_resize_discarding(len) {
            std::alloc::handle_alloc_error(Layout::new::<[u8; ALIGN]>());
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from alloc_zeroed with this size and alignment, which were valid
        // then (so from_size_align_unchecked holds), and is freed only here.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.capacity, ALIGN),
            )
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for capacity >= len initialized (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// True when `buf`, `offset` and the length all meet O_DIRECT alignment.
pub fn is_aligned(buf: &[u8], offset: u64) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(ALIGN)
        && buf.len().is_multiple_of(ALIGN)
        && offset.is_multiple_of(ALIGN as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_growing() {
        let mut b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.len(), 10_000);
        assert_eq!(b.capacity(), 12_288);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 1;
        b.resize_discarding(5);
        assert_eq!(b.len(), 5);
        assert!(b.try_resize_discarding(1 << 20));
        assert_eq!(b.len(), 1 << 20);
        assert!(is_aligned(&b, 8192));
    }

    #[test]
    fn absurd_sizes_fail_softly() {
        assert!(AlignedBuf::try_zeroed(usize::MAX).is_none());
        let mut b = AlignedBuf::zeroed(0);
        assert!(!b.try_resize_discarding(usize::MAX));
        assert_eq!(b.len(), 0);
    }
}
