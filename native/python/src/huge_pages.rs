//! The extension's allocator: the system's, except that every block of 2 MiB or more is a
//! mapping of its own, advised to the kernel as huge-page backed.
//!
//! A normalizer's state is a few large arrays (the slab of blocks, the tokens, the index
//! tables) read at random, one block after another. In 4 KiB pages each read can miss the TLB;
//! in 2 MiB pages the whole state is a handful of entries. The kernel does this only where it
//! is asked to (`madvise` mode, the common default), and Python's heap never asks.
//!
//! The advice is a property of the memory, not of the block: given to a block inside malloc's
//! heap, it would outlive the block and cover whatever malloc put there next (Python's objects
//! among them). So a large block is not malloc's: it is mapped on allocation, grown with
//! `mremap` (no copy) and unmapped when freed, and the advice goes with the mapping.

use std::alloc::{GlobalAlloc, Layout, System};

/// The size of a transparent huge page on x86-64 and aarch64 (4 KiB base pages): blocks of at
/// least this size are mapped and advised.
const HUGE_PAGE: usize = 2 << 20;

/// The largest alignment a mapping is known to have (the smallest base page); a block that
/// asks for more stays with the system allocator.
const MAPPED_ALIGN: usize = 4 << 10;

/// The system allocator, with blocks of at least [`HUGE_PAGE`] mapped and advised.
pub struct HugePages;

/// Whether a block of this layout is mapped (and advised) rather than malloc's.
fn is_mapped(size: usize, align: usize) -> bool {
    cfg!(target_os = "linux") && size >= HUGE_PAGE && align <= MAPPED_ALIGN
}

#[cfg(target_os = "linux")]
mod mapped {
    /// Asks the kernel to back the mapping `[block, block + size)` with huge pages wherever a
    /// whole one fits. The advice covers the whole mapping, not only its aligned interior: a
    /// part would split the mapping in two or three, and `mremap` resizes only a range inside
    /// one.
    ///
    /// # Safety
    /// `[block, block + size)` must be a mapping of this allocator.
    unsafe fn advise(block: *mut u8, size: usize) {
        // A kernel without transparent huge pages answers EINVAL and leaves the pages as they
        // were; the advice is best effort, and errno is put back so that the caller of the
        // allocation sees the errno it had.
        let errno = libc::__errno_location();
        let saved = *errno;
        libc::madvise(block.cast(), size, libc::MADV_HUGEPAGE);
        *errno = saved;
    }

    /// A new mapping of `size` bytes (zeroed, page-aligned), advised; null if there is none.
    ///
    /// # Safety
    /// `size` must not be zero.
    pub unsafe fn map(size: usize) -> *mut u8 {
        let block = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if block == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        advise(block.cast(), size);
        block.cast()
    }

    /// Unmaps a block [`map`] or [`remap`] returned, of that `size`.
    ///
    /// # Safety
    /// `block` must be such a block, not used after.
    pub unsafe fn unmap(block: *mut u8, size: usize) {
        libc::munmap(block.cast(), size);
    }

    /// The block, resized (moved by the kernel if it must, its bytes kept); null if it cannot
    /// be, the block then left as it was.
    ///
    /// # Safety
    /// `block` must be a block [`map`] or [`remap`] returned, of `size` bytes.
    pub unsafe fn remap(block: *mut u8, size: usize, new_size: usize) -> *mut u8 {
        let moved = libc::mremap(block.cast(), size, new_size, libc::MREMAP_MAYMOVE);
        if moved == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        advise(moved.cast(), new_size);
        moved.cast()
    }
}

// SAFETY: a block is mapped (module `mapped`) exactly when `is_mapped` holds for its layout,
// which `alloc`, `dealloc` and `realloc` all decide from the layout the caller gives (the one it
// was allocated with, as `GlobalAlloc` requires), so a block is always freed or resized by the
// allocator that made it. A mapping is page-aligned and `is_mapped` admits only alignments up
// to the smallest page, so it satisfies the layout; anonymous mappings are zeroed, as
// `alloc_zeroed` requires; `mremap` keeps the bytes. Every other block is `System`'s, untouched.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        #[cfg(target_os = "linux")]
        if is_mapped(layout.size(), layout.align()) {
            return mapped::map(layout.size());
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        #[cfg(target_os = "linux")]
        if is_mapped(layout.size(), layout.align()) {
            return mapped::map(layout.size());
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        #[cfg(target_os = "linux")]
        if is_mapped(layout.size(), layout.align()) {
            return mapped::unmap(block, layout.size());
        }
        System.dealloc(block, layout)
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (was, will) = (
            is_mapped(layout.size(), layout.align()),
            is_mapped(new_size, layout.align()),
        );
        #[cfg(target_os = "linux")]
        if was && will {
            return mapped::remap(block, layout.size(), new_size);
        }
        if !was && !will {
            return System.realloc(block, layout, new_size);
        }
        // Across the threshold: a new block from the other allocator, the bytes copied over.
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        let moved = self.alloc(new_layout);
        if !moved.is_null() {
            std::ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
            self.dealloc(block, layout);
        }
        moved
    }
}
