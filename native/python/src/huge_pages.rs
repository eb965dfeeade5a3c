//! The extension's allocator: the system's, with the interior of every large block advised to
//! be backed by transparent huge pages.
//!
//! A normalizer's state is a few large arrays (the slab of blocks, the tokens, the index
//! tables) read at random, one block after another. In 4 KiB pages each read can miss the TLB;
//! in 2 MiB pages the whole state is a handful of entries. The kernel does this only where it
//! is asked to (`madvise` mode, the common default), and Python's heap never asks.

use std::alloc::{GlobalAlloc, Layout, System};

/// The size of a transparent huge page on x86-64 and aarch64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// The system allocator, with blocks of at least [`HUGE_PAGE`] advised as huge-page backed.
pub struct HugePages;

/// Asks the kernel to back the whole huge pages inside `[block, block + size)` with huge pages.
fn advise(block: *mut u8, size: usize) {
    let start = (block as usize).next_multiple_of(HUGE_PAGE);
    let end = (block as usize + size) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: `[start, end)` lies inside the block the system allocator just returned, so
        // it is mapped and ours. MADV_HUGEPAGE changes only how the kernel may back those pages
        // (their contents, protection and addresses stay as they are), so nothing any
        // reference can observe changes. A kernel without transparent huge pages answers
        // EINVAL and leaves the pages as they were; the advice is best effort, so the answer is
        // not needed.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

// SAFETY: every method hands the request to `System` unchanged and returns its answer; the
// advice given on the way (see `advise`) does not change the memory it returns.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc(layout);
        if !block.is_null() && layout.size() >= HUGE_PAGE {
            advise(block, layout.size());
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc_zeroed(layout);
        if !block.is_null() && layout.size() >= HUGE_PAGE {
            advise(block, layout.size());
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        System.dealloc(block, layout)
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = System.realloc(block, layout, new_size);
        if !moved.is_null() && new_size >= HUGE_PAGE {
            advise(moved, new_size);
        }
        moved
    }
}
