//! A reusable, 4096-byte aligned scratch buffer for request payloads.
//!
//! The backend may do O_DIRECT I/O straight into the buffers it is given, and
//! O_DIRECT needs page-aligned memory, which `Vec<u8>` does not promise.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::proto::Errno;

/// Alignment (and capacity granularity) of every buffer.
pub(crate) const BUFFER_ALIGN: usize = 4096;

pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    capacity: usize,
}

// SAFETY: AlignedBuf exclusively owns its allocation, like Vec<u8>; nothing
// in it is tied to a thread.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes rounded up to a whole number of pages (at least
    /// one), zero-filled so every byte handed out is initialised.
    pub(crate) fn new(len: usize) -> Result<AlignedBuf, Errno> {
        let capacity = len
            .div_ceil(BUFFER_ALIGN)
            .max(1)
            .checked_mul(BUFFER_ALIGN)
            .ok_or(Errno::NoMem)?;
        let layout = Layout::from_size_align(capacity, BUFFER_ALIGN).map_err(|_| Errno::NoMem)?;
        // SAFETY: the layout has a non-zero size (capacity >= BUFFER_ALIGN).
        let raw = unsafe { alloc_zeroed(layout) };
        // A failed allocation becomes ENOMEM for this one request instead of
        // aborting the whole server.
        let ptr = NonNull::new(raw).ok_or(Errno::NoMem)?;
        Ok(AlignedBuf { ptr, capacity })
    }

    /// Returns the first `len` bytes, first replacing the allocation with a
    /// larger one if needed. Contents are scratch and not preserved.
    pub(crate) fn prefix_mut(&mut self, len: usize) -> Result<&mut [u8], Errno> {
        if len > self.capacity {
            *self = AlignedBuf::new(len)?;
        }
        // SAFETY: ptr points to `capacity >= len` initialised bytes owned by
        // self, and `&mut self` guarantees exclusive access for the lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) })
    }

    /// The first `len` bytes, clamped to the capacity so this cannot fail.
    pub(crate) fn prefix(&self, len: usize) -> &[u8] {
        let len = len.min(self.capacity);
        // SAFETY: ptr points to `capacity >= len` initialised bytes owned by
        // self; the shared borrow of self prevents mutation meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }

    fn layout(&self) -> Layout {
        // The same (size, align) pair succeeded in `new`, so this cannot fail;
        // the fallback only exists to avoid a panic path.
        Layout::from_size_align(self.capacity, BUFFER_ALIGN).unwrap_or(Layout::new::<u8>())
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = self.layout();
        // SAFETY: ptr was returned by alloc_zeroed with exactly this layout
        // and is freed only here, once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_and_grow() -> Result<(), Errno> {
        let mut buf = AlignedBuf::new(1)?;
        assert_eq!(buf.capacity, BUFFER_ALIGN);
        assert_eq!(buf.prefix(10).len(), 10);
        assert_eq!(buf.prefix(1 << 20).len(), BUFFER_ALIGN, "clamped");
        let grown = buf.prefix_mut(3 * BUFFER_ALIGN + 1)?;
        assert_eq!(grown.len(), 3 * BUFFER_ALIGN + 1);
        assert_eq!(grown.as_ptr() as usize % BUFFER_ALIGN, 0);
        grown.fill(0xab);
        assert_eq!(buf.capacity, 4 * BUFFER_ALIGN);
        assert!(buf.prefix(3 * BUFFER_ALIGN).iter().all(|&b| b == 0xab));
        Ok(())
    }

    #[test]
    fn absurd_sizes_fail_softly() {
        assert_eq!(AlignedBuf::new(usize::MAX).err(), Some(Errno::NoMem));
    }
}
