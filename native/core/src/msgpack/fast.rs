//! The readers of the decoder's fast path: each takes one of the forms vLLM writes (a small
//! uint, a fixmap or array header, a short string, a hash) or a run of them, and consumes
//! nothing when the next item is another form, which the general reads then take.

use super::Reader;

/// The bits of a small uint's form that are its value, by the form's width in bytes (1, 2, 3
/// or 5; the other entries are never read): a fixint's byte, else the bytes after the marker.
const SMALL_UINT_MASKS: [u32; 6] = [0, 0x7f, 0xff, 0xffff, 0, u32::MAX];

/// How many token ids [`Reader::small_uints`] reads per window of widths.
const SMALL_UINTS_WINDOW: usize = 64;

/// The width of the integer a marker starts, for the forms [`Reader::small_uint`] reads (a
/// fixint, uint8, uint16 or uint32), or 0 for any other item: computed without a table or a
/// branch, so that a pass of it over many bytes vectorizes.
#[inline(always)]
pub(super) fn small_uint_width(marker: u8) -> u8 {
    u8::from(marker < 0x80)
        | (u8::from(marker == 0xcc) * 2)
        | (u8::from(marker == 0xcd) * 3)
        | (u8::from(marker == 0xce) * 5)
}

/// The width of an integer below 2**32 in its shortest msgpack form, less one.
#[inline(always)]
fn shortest_extra_width(value: u32) -> u32 {
    u32::from(value > 0x7f) + u32::from(value > 0xff) + 2 * u32::from(value > 0xffff)
}

/// What [`Reader::small_uints`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmallUints {
    /// How many integers.
    pub count: usize,
    /// Whether each was in its shortest form, so that their bytes are what
    /// [`super::write::small_uints`] writes for them.
    pub shortest: bool,
}

impl<'a> Reader<'a> {
    /// Consumes `bytes` if they come next: an item whose whole encoding is known (e.g. a
    /// [`super::fixstr`]), matched in one comparison.
    #[inline(always)]
    pub fn consume<const N: usize>(&mut self, bytes: &[u8; N]) -> bool {
        let next = self.data.get(self.pos..).and_then(<[u8]>::first_chunk::<N>);
        let matched = next == Some(bytes);
        self.pos += if matched { N } else { 0 };
        matched
    }

    /// A non-negative integer below 2**32, if that is what comes next (else nothing is
    /// consumed): the fast path of token lists.
    #[inline(always)]
    pub fn small_uint(&mut self) -> Option<u32> {
        let rest = self.data.get(self.pos..)?;
        let (&marker, tail) = rest.split_first()?;
        let (value, width) = match marker {
            0x00..=0x7f => (u32::from(marker), 1),
            0xcc if !tail.is_empty() => (u32::from(tail[0]), 2),
            0xcd if tail.len() >= 2 => (u32::from(u16::from_be_bytes([tail[0], tail[1]])), 3),
            0xce if tail.len() >= 4 => {
                (u32::from_be_bytes([tail[0], tail[1], tail[2], tail[3]]), 5)
            }
            _ => return None,
        };
        self.pos += width;
        Some(value)
    }

    /// An array's length, as [`Reader::lax`] reads its header (not checked against the bytes
    /// left), if an array comes next (else nothing is consumed).
    #[inline(always)]
    pub fn array_header(&mut self) -> Option<usize> {
        match *self.data.get(self.pos..)? {
            [marker @ 0x90..=0x9f, ..] => {
                self.pos += 1;
                Some(usize::from(marker & 0x0f))
            }
            [0xdc, high, low, ..] => {
                self.pos += 3;
                Some(usize::from(u16::from_be_bytes([high, low])))
            }
            _ => None,
        }
    }

    /// A map's length, as [`Reader::lax`] reads a fixmap's header, if a fixmap comes next (else
    /// nothing is consumed).
    #[inline(always)]
    pub fn fixmap_header(&mut self) -> Option<usize> {
        match *self.data.get(self.pos..)? {
            [marker @ 0x80..=0x8f, ..] => {
                self.pos += 1;
                Some(usize::from(marker & 0x0f))
            }
            _ => None,
        }
    }

    /// A string's bytes, unchecked as [`Reader::lax`] leaves them, if a whole fixstr or str8
    /// comes next (else nothing is consumed).
    #[inline(always)]
    pub fn str_bytes(&mut self) -> Option<&'a [u8]> {
        let data = self.data;
        let (start, len) = match *data.get(self.pos..)? {
            [marker @ 0xa0..=0xbf, ..] => (self.pos + 1, usize::from(marker & 0x1f)),
            [0xd9, len, ..] => (self.pos + 2, usize::from(len)),
            _ => return None,
        };
        let bytes = data.get(start..start + len)?;
        self.pos = start + len;
        Some(bytes)
    }

    /// Consumes a nil, if one comes next.
    #[inline(always)]
    pub fn nil(&mut self) -> bool {
        let nil = self.data.get(self.pos) == Some(&0xc0);
        self.pos += usize::from(nil);
        nil
    }

    /// Reads up to `count` non-negative integers below 2**32 into `out`, as [`Reader::small_uint`]
    /// reads each, and stops at the first other item (left unread).
    ///
    /// The fast path of token lists. Where each token starts depends on the width of the one
    /// before, which varies from token to token: that chain, not the decoding, bounds the loop.
    /// So the width a token starting at each byte would have is worked out first for a window
    /// of bytes (a pass with no chain, which vectorizes), and the chain is then one load from
    /// that window and an add per token. On x86-64 machines with AVX-512 VBMI, `vbmi` reads
    /// whole windows of 64 bytes first, with no chain per token; this loop takes the rest.
    #[inline]
    pub fn small_uints(&mut self, count: usize, out: &mut Vec<u32>) -> SmallUints {
        let data = self.data;
        let mut pos = self.pos;
        let start = out.len();
        let mut done = 0;
        let mut widths = [0u8; SMALL_UINTS_WINDOW * 5 + 5];
        // A list whose items take the general path calls this again after each: for one that
        // starts with such an item, return before working out a window's widths.
        let stopped = data
            .get(pos..)
            .filter(|rest| rest.len() >= 8)
            .is_none_or(|rest| small_uint_width(rest[0]) == 0);
        #[cfg(target_arch = "x86_64")]
        let stopped = if !stopped && super::vbmi::available() {
            // SAFETY: `available` found the CPU features `small_uints` needs.
            let run = unsafe { super::vbmi::small_uints(data, pos, count, out) };
            pos = run.pos;
            done = run.count;
            run.stopped
        } else {
            stopped
        };
        while done < count && !stopped {
            let chunk = (count - done).min(SMALL_UINTS_WINDOW);
            // Eight bytes are read for every token whatever its width (the widest is 5): a
            // token starts only where eight remain, the last few of a payload take the general
            // path. Past the window's bytes the widths are 0, which stops the chain.
            let span = (chunk * 5).min(data.len().saturating_sub(pos + 7));
            for (width, &marker) in widths.iter_mut().zip(&data[pos..pos + span]) {
                *width = small_uint_width(marker);
            }
            widths[span..span + 5].fill(0);
            // Room for one window at a time, written by index (no capacity check per token).
            out.resize(start + done + chunk, 0);
            let mut offset = 0;
            let mut read = 0;
            for value in &mut out[start + done..] {
                let width = widths[offset];
                if width == 0 {
                    break;
                }
                let at = pos + offset;
                let word = u64::from_be_bytes(data[at..at + 8].try_into().expect("8 bytes"));
                // The form's bytes are the word's top `width`; a fixint is its marker, any
                // other form the bytes after its marker, which the mask keeps.
                let form = (word >> (64 - 8 * u32::from(width))) as u32;
                *value = form & SMALL_UINT_MASKS[usize::from(width)];
                offset += usize::from(width);
                read += 1;
            }
            pos += offset;
            done += read;
            if read < chunk {
                break;
            }
        }
        out.truncate(start + done);
        // No form is shorter than the shortest: the widths add up to the shortest's exactly
        // when each is its value's shortest. A separate pass, summed in u32 by chunks that
        // cannot overflow it, so that it vectorizes.
        let extra: usize = out[start..]
            .chunks(1 << 28)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|&value| shortest_extra_width(value))
                    .sum::<u32>() as usize
            })
            .sum();
        let shortest = extra + done == pos - self.pos;
        self.pos = pos;
        SmallUints {
            count: done,
            shortest,
        }
    }

    /// Reads up to `count` hashes into `out` as the hash lists' fast path takes them (an
    /// integer of any width, [`Reader::any_int`], or a bin8 of up to 255 bytes as
    /// [`crate::hashing::engine_hash_bytes`] reads it), and stops at the first other item
    /// (left unread); returns how many it read.
    #[inline]
    pub fn hashes(&mut self, count: usize, out: &mut Vec<u64>) -> usize {
        let mut values = std::mem::take(out);
        let mut done = 0;
        while done < count {
            match self.hash() {
                Some(value) => values.push(value),
                None => break,
            }
            done += 1;
        }
        *out = values;
        done
    }

    /// One hash as [`Reader::hashes`] reads them, if that is what comes next (else nothing is
    /// consumed).
    #[inline(always)]
    pub fn hash(&mut self) -> Option<u64> {
        match *self.data.get(self.pos..)? {
            [0xcf, ref tail @ ..] if tail.len() >= 8 => {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(&tail[..8]);
                self.pos += 9;
                Some(u64::from_be_bytes(bytes))
            }
            [0xc4, len, ref tail @ ..] if tail.len() >= usize::from(len) => {
                let len = usize::from(len);
                self.pos += 2 + len;
                Some(crate::hashing::engine_hash_bytes(&tail[..len]))
            }
            _ => self.any_int(),
        }
    }

    /// An integer of any width as u64 (a negative one as its two's complement), if that is
    /// what comes next (else nothing is consumed): the fast path of hash lists.
    #[inline(always)]
    pub fn any_int(&mut self) -> Option<u64> {
        let rest = self.data.get(self.pos..)?;
        let (&marker, tail) = rest.split_first()?;
        let (value, width) = match marker {
            0x00..=0x7f => (u64::from(marker), 1),
            0xe0..=0xff => (i64::from(marker as i8) as u64, 1),
            0xcf | 0xd3 if tail.len() >= 8 => {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(&tail[..8]);
                (u64::from_be_bytes(bytes), 9)
            }
            0xce if tail.len() >= 4 => (
                u64::from(u32::from_be_bytes([tail[0], tail[1], tail[2], tail[3]])),
                5,
            ),
            0xd2 if tail.len() >= 4 => (
                i64::from(i32::from_be_bytes([tail[0], tail[1], tail[2], tail[3]])) as u64,
                5,
            ),
            _ => return None,
        };
        self.pos += width;
        Some(value)
    }

    /// Skips a scalar that is not a string, bin or ext; `false` (nothing consumed) otherwise.
    #[inline(always)]
    pub(super) fn skip_plain_scalar(&mut self) -> bool {
        let Some(&marker) = self.data.get(self.pos) else {
            return false;
        };
        let width = match marker {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => 1,
            0xcc | 0xd0 => 2,
            0xcd | 0xd1 => 3,
            0xce | 0xd2 | 0xca => 5,
            0xcf | 0xd3 | 0xcb => 9,
            _ => return false,
        };
        if self.pos + width > self.data.len() {
            return false;
        }
        self.pos += width;
        true
    }
}
