//! A heap buffer aligned to 4096 bytes, as O_DIRECT requires.

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
    /// A zero-filled buffer of `len` bytes (capacity rounded up to 4096, at least 4096).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let capacity = len.div_ceil(ALIGN).max(1) * ALIGN;
        let layout = Self::layout(capacity);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len, capacity }
    }

    fn layout(capacity: usize) -> Layout {
        match Layout::from_size_align(capacity, ALIGN) {
            Ok(l) => l,
            Err(_) => panic!("buffer of {capacity} bytes exceeds the address space"),
        }
    }

    /// Sets the length, reallocating (contents not kept) when it exceeds the capacity.
    pub fn resize_discarding(&mut self, len: usize) {
        if len > self.capacity {
            *self = AlignedBuf::zeroed(len);
        }
        self.len = len;
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated by alloc_zeroed with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity)) }
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
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.len(), 10_000);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 1;
        b.resize_discarding(5);
        assert_eq!(b.len(), 5);
        b.resize_discarding(1 << 20);
        assert_eq!(b.len(), 1 << 20);
        assert!(is_aligned(&b, 8192));
    }
}
