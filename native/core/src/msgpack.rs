//! A zero-copy msgpack reader with bounds on everything, and the few writers the encoders need.
//!
//! The reader never allocates and never recurses without a depth check: a length that exceeds
//! the bytes left, a truncated value, invalid UTF-8 or nesting past [`MAX_DEPTH`] is an error,
//! whatever the input.

use std::fmt;

/// The deepest nesting of arrays and maps any payload may have, the outermost value being level
/// 1: `kvbridge.schemas.vllm.MAX_NESTING`. Real payloads nest at most six levels (batch, events,
/// event, extra keys, a block's keys, an `(identifier, offset)` pair); anything deeper is refused
/// before it can exhaust a stack.
pub const MAX_DEPTH: usize = 64;

/// Why bytes are not the msgpack they should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// The input ends inside a value.
    Truncated,
    /// A marker byte msgpack does not define (0xc1).
    BadMarker(u8),
    /// A string that is not UTF-8.
    Utf8,
    /// Nesting deeper than [`MAX_DEPTH`].
    TooDeep,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Truncated => f.write_str("Input data was truncated"), // as msgspec says it
            ReadError::BadMarker(byte) => write!(f, "invalid opcode, '\\x{byte:02x}'"),
            ReadError::Utf8 => f.write_str("invalid utf-8"),
            ReadError::TooDeep => write!(f, "nesting deeper than {MAX_DEPTH} levels"),
        }
    }
}

/// One msgpack item: a scalar, or the header of a container whose items follow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Item<'a> {
    Nil,
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    NegInt(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext(i8, &'a [u8]),
}

impl Item<'_> {
    /// The type name msgspec uses in its errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            Item::Nil => "null",
            Item::Bool(_) => "bool",
            Item::UInt(_) | Item::NegInt(_) => "int",
            Item::Float(_) => "float",
            Item::Str(_) => "str",
            Item::Bin(_) => "bytes",
            Item::Array(_) => "array",
            Item::Map(_) => "object",
            Item::Ext(..) => "ext",
        }
    }
}

/// One item read the way msgspec reads a value before it knows the type it wants: a string's
/// bytes are not checked for UTF-8 yet, and a container's length is not checked against the
/// bytes left (its items are read, or fail, one by one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lax<'a> {
    Str(&'a [u8]),
    Item(Item<'a>),
}

impl<'a> Lax<'a> {
    /// The type name msgspec uses in its errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            Lax::Str(_) => "str",
            Lax::Item(item) => item.type_name(),
        }
    }

    /// The string, checked for UTF-8; `None` if not a string.
    pub fn str(&self) -> Option<Result<&'a str, ReadError>> {
        match self {
            Lax::Str(bytes) => Some(std::str::from_utf8(bytes).map_err(|_| ReadError::Utf8)),
            Lax::Item(_) => None,
        }
    }
}

/// `text` as a msgpack fixstr: its marker, then its bytes, for a constant that
/// [`Reader::consume`] matches. `N` is one more than the text's length (at most 31), which the
/// compiler checks where the constant is built.
pub const fn fixstr<const N: usize>(text: &str) -> [u8; N] {
    let bytes = text.as_bytes();
    assert!(
        bytes.len() < 32 && bytes.len() + 1 == N,
        "a fixstr holds N - 1 < 32 bytes"
    );
    let mut out = [0u8; N];
    out[0] = 0xa0 | bytes.len() as u8;
    let mut index = 0;
    while index < bytes.len() {
        out[index + 1] = bytes[index];
        index += 1;
    }
    out
}

/// The bits of a small uint's form that are its value, by the form's width in bytes (1, 2, 3
/// or 5; the other entries are never read): a fixint's byte, else the bytes after the marker.
const SMALL_UINT_MASKS: [u32; 6] = [0, 0x7f, 0xff, 0xffff, 0, u32::MAX];

/// How many token ids [`Reader::small_uints`] reads per window of widths.
const SMALL_UINTS_WINDOW: usize = 64;

/// The width of the integer a marker starts, for the forms [`Reader::small_uint`] reads (a
/// fixint, uint8, uint16 or uint32), or 0 for any other item: computed without a table or a
/// branch, so that a pass of it over many bytes vectorizes.
#[inline(always)]
fn small_uint_width(marker: u8) -> u8 {
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
    /// [`write::small_uints`] writes for them.
    pub shortest: bool,
}

/// A cursor over msgpack bytes.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    /// The offset of the next item.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The bytes from `start` to the cursor.
    pub fn since(&self, start: usize) -> &'a [u8] {
        &self.data[start..self.pos]
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// Consumes `bytes` if they come next: an item whose whole encoding is known (e.g. a
    /// [`fixstr`]), matched in one comparison.
    #[inline(always)]
    pub fn consume<const N: usize>(&mut self, bytes: &[u8; N]) -> bool {
        let next = self.data.get(self.pos..).and_then(<[u8]>::first_chunk::<N>);
        let matched = next == Some(bytes);
        self.pos += if matched { N } else { 0 };
        matched
    }

    /// The next marker byte, without consuming it.
    pub fn peek(&self) -> Option<u8> {
        self.data.get(self.pos).copied()
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8], ReadError> {
        let end = self.pos.checked_add(count).ok_or(ReadError::Truncated)?;
        let bytes = self.data.get(self.pos..end).ok_or(ReadError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, ReadError> {
        let byte = *self.data.get(self.pos).ok_or(ReadError::Truncated)?;
        self.pos += 1;
        Ok(byte)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn length(&mut self, width: usize) -> Result<usize, ReadError> {
        Ok(match width {
            1 => usize::from(self.byte()?),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    /// A container length, checked against the bytes left (every item takes at least one).
    fn container(&mut self, items: usize, per_item: usize) -> Result<usize, ReadError> {
        let left = self.data.len() - self.pos;
        if items.saturating_mul(per_item) > left {
            return Err(ReadError::Truncated);
        }
        Ok(items)
    }

    fn ext(&mut self, len: usize) -> Result<Item<'a>, ReadError> {
        let kind = self.byte()? as i8;
        Ok(Item::Ext(kind, self.take(len)?))
    }

    /// The bytes left after the cursor.
    pub fn left(&self) -> usize {
        self.data.len() - self.pos
    }

    /// Reads one item; a container's items are left for the following calls. A container
    /// longer than the bytes left could hold is [`ReadError::Truncated`] at once.
    pub fn item(&mut self) -> Result<Item<'a>, ReadError> {
        match self.read(true)? {
            Lax::Str(bytes) => std::str::from_utf8(bytes)
                .map(Item::Str)
                .map_err(|_| ReadError::Utf8),
            Lax::Item(item) => Ok(item),
        }
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
    /// that window and an add per token.
    #[inline]
    pub fn small_uints(&mut self, count: usize, out: &mut Vec<u32>) -> SmallUints {
        let data = self.data;
        let mut pos = self.pos;
        let start = out.len();
        let mut done = 0;
        let mut widths = [0u8; SMALL_UINTS_WINDOW * 5 + 5];
        // A list whose items take the general path calls this again after each: for one that
        // starts with such an item, return before working out a window's widths.
        let first_is_small = data
            .get(pos..)
            .filter(|rest| rest.len() >= 8)
            .is_some_and(|rest| small_uint_width(rest[0]) != 0);
        while done < count && first_is_small {
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
    fn skip_plain_scalar(&mut self) -> bool {
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

    /// Reads one item as msgspec does before it checks the item's type: see [`Lax`].
    pub fn lax(&mut self) -> Result<Lax<'a>, ReadError> {
        self.read(false)
    }

    fn read(&mut self, bounded: bool) -> Result<Lax<'a>, ReadError> {
        let marker = self.byte()?;
        let container = |reader: &mut Self, items: usize, per_item: usize| {
            if bounded {
                reader.container(items, per_item)
            } else {
                Ok(items)
            }
        };
        Ok(Lax::Item(match marker {
            0x00..=0x7f => Item::UInt(u64::from(marker)),
            0x80..=0x8f => Item::Map(container(self, usize::from(marker & 0x0f), 2)?),
            0x90..=0x9f => Item::Array(container(self, usize::from(marker & 0x0f), 1)?),
            0xa0..=0xbf => return Ok(Lax::Str(self.take(usize::from(marker & 0x1f))?)),
            0xc0 => Item::Nil,
            0xc1 => return Err(ReadError::BadMarker(marker)),
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xc4..=0xc6 => {
                let len = self.length(1 << (marker - 0xc4))?;
                Item::Bin(self.take(len)?)
            }
            0xc7..=0xc9 => {
                let len = self.length(1 << (marker - 0xc7))?;
                self.ext(len)?
            }
            0xca => Item::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Item::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Item::UInt(u64::from(self.byte()?)),
            0xcd => Item::UInt(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Item::UInt(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Item::UInt(u64::from_be_bytes(self.be()?)),
            0xd0 => int(i64::from(self.byte()? as i8)),
            0xd1 => int(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => int(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => int(i64::from_be_bytes(self.be()?)),
            0xd4..=0xd8 => self.ext(1 << (marker - 0xd4))?,
            0xd9..=0xdb => {
                let len = self.length(1 << (marker - 0xd9))?;
                return Ok(Lax::Str(self.take(len)?));
            }
            0xdc | 0xdd => {
                let len = self.length(if marker == 0xdc { 2 } else { 4 })?;
                Item::Array(container(self, len, 1)?)
            }
            0xde | 0xdf => {
                let len = self.length(if marker == 0xde { 2 } else { 4 })?;
                Item::Map(container(self, len, 2)?)
            }
            0xe0..=0xff => Item::NegInt(i64::from(marker as i8)),
        }))
    }

    /// Skips one complete value, checking strings and nesting; `depth` containers enclose it.
    pub fn skip(&mut self, depth: usize) -> Result<(), ReadError> {
        self.skip_value(depth, true)
    }

    /// Skips one complete value as msgspec skips one: its structure and nesting are checked,
    /// its strings are not; `depth` containers enclose it.
    pub fn skip_lax(&mut self, depth: usize) -> Result<(), ReadError> {
        self.skip_value(depth, false)
    }

    fn skip_value(&mut self, depth: usize, strings: bool) -> Result<(), ReadError> {
        // An explicit stack of items left per open container: no recursion, no allocation.
        let mut pending = [0usize; MAX_DEPTH + 1];
        let mut open = 0usize;
        let mut left = 1usize;
        loop {
            while left == 0 {
                if open == 0 {
                    return Ok(());
                }
                open -= 1;
                left = pending[open];
            }
            left -= 1;
            if self.skip_plain_scalar() {
                continue;
            }
            let items = match self.read(true)? {
                Lax::Item(Item::Array(len)) => len,
                Lax::Item(Item::Map(len)) => len * 2,
                Lax::Str(bytes) if strings && std::str::from_utf8(bytes).is_err() => {
                    return Err(ReadError::Utf8)
                }
                _ => continue,
            };
            // The container just opened is nested this many levels deep, itself included.
            if depth + open + 1 > MAX_DEPTH {
                return Err(ReadError::TooDeep);
            }
            if items > 0 {
                pending[open] = left;
                open += 1;
                left = items;
            }
        }
    }

    /// Skips one value and returns its bytes.
    pub fn raw(&mut self, depth: usize) -> Result<&'a [u8], ReadError> {
        let start = self.pos;
        self.skip(depth)?;
        Ok(self.since(start))
    }

    /// Skips one value as [`Reader::skip_lax`] does and returns its bytes.
    pub fn raw_lax(&mut self, depth: usize) -> Result<&'a [u8], ReadError> {
        let start = self.pos;
        self.skip_lax(depth)?;
        Ok(self.since(start))
    }
}

/// Where the first array or map nested deeper than [`MAX_DEPTH`] opens, found from the headers
/// alone without recursion: for each enclosing container, outermost first, the position of the
/// item in it (a map counts its keys and values) and whether it is a map. `None` if nothing
/// nests that deep, or if the bytes are malformed or end first.
///
/// The walk reads one value, as `kvbridge.schemas.vllm.msgpack_headers.nesting_path` does: a container's length
/// is not checked against the bytes left, and a container past the limit is refused as soon
/// as its first byte is read.
pub fn too_deep(data: &[u8]) -> Option<Vec<(usize, bool)>> {
    // (item count, is a map, items left) of each open container, outermost first.
    let mut open: Vec<(usize, bool, usize)> = Vec::new();
    let mut root_left = 1usize;
    let mut reader = Reader::new(data);
    loop {
        let left = match open.last_mut() {
            Some((_, _, left)) => left,
            None => &mut root_left,
        };
        if *left == 0 {
            open.pop()?;
            continue;
        }
        *left -= 1;
        let marker = reader.peek()?;
        let is_map = matches!(marker, 0x80..=0x8f | 0xde | 0xdf);
        if is_map || matches!(marker, 0x90..=0x9f | 0xdc | 0xdd) {
            if open.len() >= MAX_DEPTH {
                let path = open
                    .iter()
                    .map(|&(count, is_map, left)| (count - left - 1, is_map))
                    .collect();
                return Some(path);
            }
            let items = match reader.read(false).ok()? {
                Lax::Item(Item::Array(len)) => len,
                Lax::Item(Item::Map(len)) => len.checked_mul(2)?,
                _ => unreachable!("a container marker"),
            };
            open.push((items, is_map, items));
        } else {
            reader.read(false).ok()?;
        }
    }
}

fn int(value: i64) -> Item<'static> {
    if value >= 0 {
        Item::UInt(value as u64)
    } else {
        Item::NegInt(value)
    }
}

/// Writers that produce the smallest encoding of each value, as msgspec does.
pub mod write {
    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub fn uint(out: &mut Vec<u8>, value: u64) {
        if value < 0x80 {
            out.push(value as u8);
        } else if value <= u64::from(u8::MAX) {
            out.extend_from_slice(&[0xcc, value as u8]);
        } else if value <= u64::from(u16::MAX) {
            out.push(0xcd);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        } else if value <= u64::from(u32::MAX) {
            out.push(0xce);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }

    /// Integers below 2**32 in their smallest forms, as [`uint`] writes each, with no branch on
    /// the width (which varies from token to token).
    pub fn small_uints(out: &mut Vec<u8>, values: &[u32]) {
        // Each value is stored as 8 bytes, of which its form's width are kept: room for the
        // widest form of every value, and 3 more for the last store.
        let start = out.len();
        out.resize(start + values.len() * 5 + 3, 0);
        let buffer = &mut out[start..];
        let mut at = 0;
        for &value in values {
            let class =
                usize::from(value > 0x7f) + usize::from(value > 0xff) + usize::from(value > 0xffff);
            let (marker, width) = SMALL_FORMS[class];
            let word =
                (u64::from(marker) << (8 * (width - 1)) | u64::from(value)) << (64 - 8 * width);
            buffer[at..at + 8].copy_from_slice(&word.to_be_bytes());
            at += width as usize;
        }
        out.truncate(start + at);
    }

    /// The marker and width of each smallest form of an integer below 2**32: fixint, uint8,
    /// uint16, uint32.
    const SMALL_FORMS: [(u8, u32); 4] = [(0, 1), (0xcc, 2), (0xcd, 3), (0xce, 5)];

    /// A 64-bit integer in its smallest form, as [`uint`], with the wide form (hashes) first.
    #[inline(always)]
    pub fn hash(out: &mut Vec<u8>, value: u64) {
        if value > u64::from(u32::MAX) {
            let mut bytes = [0xcf; 9];
            bytes[1..].copy_from_slice(&value.to_be_bytes());
            out.extend_from_slice(&bytes);
        } else {
            uint(out, value);
        }
    }

    pub fn float(out: &mut Vec<u8>, value: f64) {
        out.push(0xcb);
        out.extend_from_slice(&value.to_be_bytes());
    }

    pub fn str(out: &mut Vec<u8>, value: &str) {
        let len = value.len();
        if len < 32 {
            out.push(0xa0 | len as u8);
        } else {
            sized_header(out, len, [0xd9, 0xda, 0xdb]);
        }
        out.extend_from_slice(value.as_bytes());
    }

    /// The header of a string or bin of `len` bytes in its 8-, 16- or 32-bit length form,
    /// whose markers are `markers` in that order.
    fn sized_header(out: &mut Vec<u8>, len: usize, markers: [u8; 3]) {
        if len <= usize::from(u8::MAX) {
            out.extend_from_slice(&[markers[0], len as u8]);
        } else if len <= usize::from(u16::MAX) {
            out.push(markers[1]);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(markers[2]);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    /// A bin header for `len` bytes (the bytes follow).
    pub fn bin_header(out: &mut Vec<u8>, len: usize) {
        sized_header(out, len, [0xc4, 0xc5, 0xc6]);
    }

    pub fn array(out: &mut Vec<u8>, len: usize) {
        if len < 16 {
            out.push(0x90 | len as u8);
        } else if len <= usize::from(u16::MAX) {
            out.push(0xdc);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    /// A map header sized as msgspec sizes it: by the struct's field count, not the entries.
    pub fn map(out: &mut Vec<u8>, len: usize, fields: usize) {
        if fields < 16 {
            out.push(0x80 | len as u8);
        } else if fields <= usize::from(u16::MAX) {
            out.push(0xde);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(0xdf);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_integer_width() {
        let cases: &[(&[u8], Item<'_>)] = &[
            (&[0x05], Item::UInt(5)),
            (&[0xcc, 0xff], Item::UInt(255)),
            (&[0xcd, 0x01, 0x00], Item::UInt(256)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Item::UInt(u64::MAX),
            ),
            (&[0xff], Item::NegInt(-1)),
            (&[0xd0, 0x05], Item::UInt(5)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Item::NegInt(i64::MIN)),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).item().unwrap(), *want, "{bytes:02x?}");
        }
    }

    #[test]
    fn refuses_lengths_past_the_input() {
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).item(),
            Err(ReadError::Truncated)
        );
        assert_eq!(Reader::new(&[0xa3, b'a']).item(), Err(ReadError::Truncated));
        assert_eq!(Reader::new(&[0xa1, 0xff]).item(), Err(ReadError::Utf8));
        assert_eq!(Reader::new(&[0xc1]).item(), Err(ReadError::BadMarker(0xc1)));
    }

    #[test]
    fn skip_bounds_depth_without_recursion() {
        let mut deep = vec![0x91u8; 100_000];
        deep.push(0xc0);
        assert_eq!(Reader::new(&deep).skip(0), Err(ReadError::TooDeep));
        let mut too_deep = vec![0x91u8; MAX_DEPTH + 1];
        too_deep.push(0x90);
        assert_eq!(Reader::new(&too_deep).skip(0), Err(ReadError::TooDeep));
        let mut ok = vec![0x91u8; MAX_DEPTH - 1];
        ok.push(0x90);
        let mut reader = Reader::new(&ok);
        reader.skip(0).unwrap();
        assert!(reader.is_empty());
    }

    #[test]
    fn lax_reads_leave_strings_and_lengths_unchecked() {
        assert_eq!(Reader::new(&[0xa1, 0xff]).lax(), Ok(Lax::Str(&[0xff])));
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).lax(),
            Ok(Lax::Item(Item::Array(u32::MAX as usize)))
        );
        let mut reader = Reader::new(&[0x92, 0xa1, 0xff, 0xc0]);
        reader.skip_lax(0).unwrap();
        assert!(reader.is_empty());
        assert_eq!(
            Reader::new(&[0x92, 0xa1, 0xff, 0xc0]).skip(0),
            Err(ReadError::Utf8)
        );
    }

    #[test]
    fn too_deep_locates_the_first_container_past_the_limit() {
        let mut deep = vec![0x93, 0x00, 0x92, 0xc0];
        deep.extend(std::iter::repeat_n(0x91, MAX_DEPTH - 1));
        let path = too_deep(&deep).unwrap();
        assert_eq!(path.len(), MAX_DEPTH);
        assert_eq!(&path[..2], &[(1, false), (1, false)]);
        deep.truncate(deep.len() - 1);
        deep.push(0xc0);
        assert_eq!(too_deep(&deep), None);
        // Truncated or malformed before the limit: no answer.
        assert_eq!(too_deep(&[0x91, 0x91, 0xdc]), None);
        assert_eq!(too_deep(&[0x92, 0xc1, 0x91]), None);
    }

    #[test]
    fn fixstr_is_what_the_writer_writes_and_consume_matches() {
        const TAG: [u8; 13] = fixstr("BlockRemoved");
        assert_eq!(TAG, *b"\xacBlockRemoved");
        let mut written = Vec::new();
        write::str(&mut written, "BlockRemoved");
        assert_eq!(written, TAG);
        written.push(0xc0);
        let mut reader = Reader::new(&written);
        assert!(!reader.consume(&fixstr::<4>("GPU")));
        assert!(reader.consume(&TAG));
        assert!(!reader.consume(&TAG));
        assert!(reader.nil());
    }

    #[test]
    fn small_uint_width_is_what_small_uint_reads() {
        for marker in 0..=u8::MAX {
            let bytes = [marker, 0, 0, 0, 0, 0, 0, 0, 0];
            let mut reader = Reader::new(&bytes);
            let width = reader.small_uint().map_or(0, |_| reader.pos);
            assert_eq!(usize::from(small_uint_width(marker)), width, "{marker:#x}");
        }
    }

    #[test]
    fn small_uints_stop_where_the_general_path_takes_over() {
        // 200 tokens of every width, then a nil: read across windows, up to the nil, or up to
        // the last eight bytes, whichever comes first.
        let values: Vec<u32> = (0..200u32)
            .map(|i| [5, 200, 70_000, 300][i as usize % 4])
            .collect();
        let mut bytes = Vec::new();
        write::small_uints(&mut bytes, &values);
        let tokens_end = bytes.len();
        bytes.extend_from_slice(&[0xc0; 8]);
        for count in [0, 1, 63, 64, 65, 128, 200, 201] {
            let mut reader = Reader::new(&bytes);
            let mut out = vec![7];
            let read = reader.small_uints(count, &mut out);
            let expected = count.min(200);
            assert_eq!(
                read,
                SmallUints {
                    count: expected,
                    shortest: true
                }
            );
            assert_eq!(out[1..], values[..expected]);
            let mut written = Vec::new();
            write::small_uints(&mut written, &values[..expected]);
            assert_eq!(reader.pos, written.len());
        }
        // Without the padding the last tokens are left to the general path: the last one
        // read is the last with eight bytes from its start.
        let mut out = Vec::new();
        let read = Reader::new(&bytes[..tokens_end]).small_uints(200, &mut out);
        assert_eq!(read.count, 199);
        assert_eq!(out, values[..199]);
    }

    /// What `small_uints` reads, one `small_uint` at a time: items with eight bytes from their
    /// start, up to the first other one.
    fn small_uints_one_by_one(data: &[u8], pos: usize, count: usize) -> (Vec<u32>, usize) {
        let mut reader = Reader::new(data);
        reader.pos = pos;
        let mut values = Vec::new();
        while values.len() < count && data.len() - reader.pos >= 8 {
            match reader.small_uint() {
                Some(value) => values.push(value),
                None => break,
            }
        }
        (values, reader.pos)
    }

    #[test]
    fn small_uints_read_what_small_uint_reads_from_any_start() {
        // Every width, a wide form the fast path leaves (uint64), and a nil, twice.
        let mut bytes = Vec::new();
        for round in 0..2u32 {
            let values: Vec<u32> = (0..150)
                .map(|i| [9, 200, 60_000, 1 << 20][i % 4] + round)
                .collect();
            write::small_uints(&mut bytes, &values);
            bytes.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 1, 0xc0]);
        }
        for end in [bytes.len(), bytes.len() - 9, 700, 300, 10, 7, 0] {
            let data = &bytes[..end];
            for pos in 0..=end {
                for count in [0, 1, 5, 64, 65, 150, 400] {
                    let mut reader = Reader::new(data);
                    reader.pos = pos;
                    let mut out = vec![1, 2];
                    let read = reader.small_uints(count, &mut out);
                    let (expected, expected_pos) = small_uints_one_by_one(data, pos, count);
                    assert_eq!(
                        read.count,
                        expected.len(),
                        "end {end} pos {pos} count {count}"
                    );
                    assert_eq!(out[2..], expected[..]);
                    assert_eq!(reader.pos, expected_pos);
                }
            }
        }
    }

    #[test]
    fn small_uints_tell_whether_every_form_was_the_shortest() {
        let values = [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
        let mut shortest = Vec::new();
        write::small_uints(&mut shortest, &values);
        shortest.extend_from_slice(&[0xc0; 8]);
        let mut out = Vec::new();
        let read = Reader::new(&shortest).small_uints(values.len(), &mut out);
        assert_eq!(
            read,
            SmallUints {
                count: 8,
                shortest: true
            }
        );
        assert_eq!(out, values);
        // 5 as a uint8, 200 as a uint16, 70,000 as a uint32 (shortest), 1 as a uint32.
        let longer = [
            0xcc, 5, 0xcd, 0, 200, 0xce, 0, 1, 0x11, 0x70, 0xce, 0, 0, 0, 1,
        ];
        let longer: Vec<u8> = longer.iter().copied().chain([0xc0; 8]).collect();
        for (count, shortest) in [(1, false), (3, false), (4, false)] {
            let mut out = Vec::new();
            let read = Reader::new(&longer).small_uints(count, &mut out);
            assert_eq!(read, SmallUints { count, shortest });
        }
        let mut out = Vec::new();
        let read = Reader::new(&longer[5..]).small_uints(1, &mut out);
        assert_eq!(
            (read, out),
            (
                SmallUints {
                    count: 1,
                    shortest: true
                },
                vec![70_000]
            )
        );
    }

    #[test]
    fn writers_pick_the_smallest_form() {
        let values = [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
        let mut each = Vec::new();
        for value in values {
            write::uint(&mut each, u64::from(value));
        }
        let mut all = vec![0xc0];
        write::small_uints(&mut all, &values);
        assert_eq!(all[1..], each[..]);
        for value in [0, 1 << 32, u64::MAX] {
            let (mut one, mut other) = (Vec::new(), Vec::new());
            write::uint(&mut one, value);
            write::hash(&mut other, value);
            assert_eq!(one, other);
        }
        let mut out = Vec::new();
        write::uint(&mut out, 127);
        write::uint(&mut out, 128);
        write::uint(&mut out, 70_000);
        assert_eq!(out, [0x7f, 0xcc, 0x80, 0xce, 0x00, 0x01, 0x11, 0x70]);
    }
}
