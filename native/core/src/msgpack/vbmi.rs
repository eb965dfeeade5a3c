//! The token loop with AVX-512 VBMI, on the x86-64 machines that have it.
//!
//! The scalar loop of [`super::Reader::small_uints`] is bound by a chain: where a token starts
//! depends on the width of the one before. Here the payload is cut into windows of 64 bytes at
//! a fixed stride, and within each the chain is replaced by pointer doubling. The step from
//! each byte to the byte after a token starting there is one vector; composing it with itself
//! gives the steps of 2, 4, ... 64 tokens, one byte permute each. None of that depends on where
//! the window is entered, so windows overlap in the pipeline; what is left of the chain is the
//! exit for the window's entry, one permute and a move. The starts of the tokens read take six
//! permutes more, and their values three per 16 tokens.

use std::arch::x86_64::{
    __m512i, _mm512_add_epi8, _mm512_castsi512_si128, _mm512_cmpeq_epi8_mask,
    _mm512_cmple_epu8_mask, _mm512_cmplt_epu8_mask, _mm512_loadu_si512,
    _mm512_mask2_permutex2var_epi8, _mm512_mask_blend_epi8, _mm512_mask_set1_epi8,
    _mm512_maskz_permutexvar_epi8, _mm512_maskz_set1_epi8, _mm512_max_epu8,
    _mm512_permutex2var_epi8, _mm512_permutexvar_epi8, _mm512_set1_epi32, _mm512_set1_epi8,
    _mm512_storeu_si512, _mm512_sub_epi8, _mm512_test_epi8_mask, _mm_cvtsi128_si32,
};

/// The bytes a window reads.
const WINDOW: usize = 64;

/// The last offset in a window at which a token is read: the scalar loop reads a token only
/// where eight bytes remain from its start, and so does a window, within its own bytes.
const LAST_START: usize = WINDOW - 8;

/// How far apart windows start. A window's last token starts at or before [`LAST_START`] and
/// ends at most 5 bytes later, so the next window is entered within its first 6 bytes.
const STRIDE: usize = LAST_START;

/// Byte `i` is `i`.
const IOTA: [u8; WINDOW] = {
    let mut iota = [0; WINDOW];
    let mut i = 0;
    while i < WINDOW {
        iota[i] = i as u8;
        i += 1;
    }
    iota
};

/// Lane `k` of the token starts has bit `b` of `k` set: where the step of `2**b` tokens applies.
const BITS: [u64; 6] = [
    0xaaaa_aaaa_aaaa_aaaa,
    0xcccc_cccc_cccc_cccc,
    0xf0f0_f0f0_f0f0_f0f0,
    0xff00_ff00_ff00_ff00,
    0xffff_0000_ffff_0000,
    0xffff_ffff_0000_0000,
];

/// For the tokens `16 * i` to `16 * i + 15` of a window, byte `j` of u32 lane `k` takes byte
/// `16 * i + k`: a u32 lane per token, each of its bytes the token's byte.
const SPREAD: [[u8; WINDOW]; 4] = {
    let mut spread = [[0; WINDOW]; 4];
    let mut i = 0;
    while i < 4 {
        let mut byte = 0;
        while byte < WINDOW {
            spread[i][byte] = (16 * i + byte / 4) as u8;
            byte += 1;
        }
        i += 1;
    }
    spread
};

#[cfg(test)]
thread_local! {
    /// Set by the tests that run the scalar loop on a machine with AVX-512 VBMI too.
    pub(super) static SCALAR_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this CPU runs [`small_uints`] (the standard library caches the answer).
#[inline]
pub(super) fn available() -> bool {
    #[cfg(test)]
    if SCALAR_ONLY.get() {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("popcnt")
}

/// The 64 bytes of `bytes` as a vector.
#[target_feature(enable = "avx512f")]
fn load(bytes: &[u8; WINDOW]) -> __m512i {
    // SAFETY: the load reads the 64 bytes of a `[u8; 64]`, and `loadu` needs no alignment.
    unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
}

/// Byte `index` of `vector`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn byte(vector: __m512i, index: usize) -> usize {
    let picked = _mm512_permutexvar_epi8(_mm512_set1_epi8(index as i8), vector);
    (_mm_cvtsi128_si32(_mm512_castsi512_si128(picked)) & 0xff) as usize
}

/// What [`small_uints`] read.
pub(super) struct Run {
    /// Where reading stopped.
    pub pos: usize,
    /// How many integers it read.
    pub count: usize,
    /// Whether it stopped at an item of another form (else at `limit`, or near the end of the
    /// data, where the scalar loop carries on).
    pub stopped: bool,
}

/// Reads up to `limit` small uints (fixint, uint8, uint16 or uint32) from `data[pos..]` into
/// `out`, as [`super::Reader::small_uint`] reads each, while whole windows remain.
///
/// # Safety
///
/// The CPU must support AVX-512 F, BW and VBMI and POPCNT ([`available`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,popcnt")]
pub(super) unsafe fn small_uints(data: &[u8], pos: usize, limit: usize, out: &mut Vec<u32>) -> Run {
    let iota = load(&IOTA);
    // In the tables of the permutes below, offsets 0-63 are the window's bytes and 64 + i is
    // "stop at byte i": a step from there stays there.
    let stop = _mm512_add_epi8(iota, _mm512_set1_epi8(WINDOW as i8));
    let byte_of_lane = _mm512_set1_epi32(0x0302_0100);
    let (mut base, mut entry, mut count) = (pos, 0, 0);
    while count < limit && base + WINDOW <= data.len() {
        let bytes: &[u8; WINDOW] = data[base..base + WINDOW].try_into().expect("a window");
        let window = load(bytes);
        // The width of a token starting at each byte, 0 where none does.
        let marker = |value: u8| _mm512_cmpeq_epi8_mask(window, _mm512_set1_epi8(value as i8));
        let fixint = _mm512_cmplt_epu8_mask(window, _mm512_set1_epi8(-128));
        let width = _mm512_maskz_set1_epi8(fixint, 1);
        let width = _mm512_mask_set1_epi8(width, marker(0xcc), 2);
        let width = _mm512_mask_set1_epi8(width, marker(0xcd), 3);
        let width = _mm512_mask_set1_epi8(width, marker(0xce), 5);
        let readable = _mm512_test_epi8_mask(width, width)
            & _mm512_cmple_epu8_mask(iota, _mm512_set1_epi8(LAST_START as i8));
        let mut steps = [_mm512_mask_blend_epi8(readable, stop, _mm512_add_epi8(iota, width)); 7];
        for power in 1..steps.len() {
            steps[power] = _mm512_permutex2var_epi8(steps[power - 1], steps[power - 1], stop);
        }
        // What is left of the chain: 64 steps from the entry reach the byte this window stops
        // at (no entry is more than 57 tokens from it).
        let exit = byte(steps[6], entry) - WINDOW;

        // The start of token k is the step of k tokens from the entry: the steps of 2**b
        // tokens for each bit b of k, composed in any order (they are powers of one step).
        let mut starts = _mm512_set1_epi8(entry as i8);
        for (step, lanes) in steps.iter().zip(BITS) {
            starts = _mm512_mask2_permutex2var_epi8(*step, starts, lanes, stop);
        }
        // Starts rise to the byte after the last token read; the lanes below 64 are those
        // tokens and that byte.
        let found = _mm512_cmplt_epu8_mask(starts, _mm512_set1_epi8(WINDOW as i8)).count_ones()
            as usize
            - 1;
        let read = found.min(limit - count);
        // Token k's value: its last byte is at start + width - 1, and its value is the
        // `max(width - 1, 1)` bytes ending there, read backwards into a little-endian u32.
        let one = _mm512_set1_epi8(1);
        let widths = _mm512_permutexvar_epi8(starts, width);
        let last = _mm512_sub_epi8(_mm512_add_epi8(starts, widths), one);
        let lengths = _mm512_max_epu8(_mm512_sub_epi8(widths, one), one);
        // Values go straight into `out`'s spare room, in whole groups of 16: copying `read` of
        // them from a buffer would be a `memmove` call per window.
        out.reserve(WINDOW);
        let room = out.spare_capacity_mut();
        for (group, spread) in SPREAD.iter().enumerate().take(read.div_ceil(16)) {
            let spread = load(spread);
            let index = _mm512_sub_epi8(_mm512_permutexvar_epi8(spread, last), byte_of_lane);
            let lengths = _mm512_permutexvar_epi8(spread, lengths);
            let keep = _mm512_cmplt_epu8_mask(byte_of_lane, lengths);
            let group_values = _mm512_maskz_permutexvar_epi8(keep, index, window);
            // SAFETY: `16 * group + 16 <= 64` and `room` holds at least 64 u32s.
            unsafe {
                _mm512_storeu_si512(
                    room[16 * group..].as_mut_ptr().cast::<__m512i>(),
                    group_values,
                );
            }
        }
        // SAFETY: `read <= found <= 57`, and the stores above wrote the first
        // `16 * read.div_ceil(16)` u32s of `room`, so its first `read` are initialized.
        unsafe { out.set_len(out.len() + read) };
        count += read;
        if count == limit {
            return Run {
                pos: base + byte(starts, read),
                count,
                stopped: false,
            };
        }
        if exit <= LAST_START {
            return Run {
                pos: base + exit,
                count,
                stopped: true,
            };
        }
        base += STRIDE;
        entry = exit - STRIDE;
    }
    Run {
        pos: base + entry,
        count,
        stopped: false,
    }
}
