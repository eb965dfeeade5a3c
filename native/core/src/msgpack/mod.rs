//! A zero-copy msgpack reader with bounds on everything, and the few writers the encoders need.
//!
//! The reader never allocates and never recurses without a depth check: a length that exceeds
//! the bytes left, a truncated value, invalid UTF-8 or nesting past [`MAX_DEPTH`] is an error,
//! whatever the input.
//!
//! The general reads are here; `fast` holds the readers of the decoder's fast path (token
//! ids, hashes, headers of the forms vLLM writes), `vbmi` the token loop for x86-64 machines
//! with AVX-512 VBMI, and [`write`](mod@write) the writers.

mod fast;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vbmi;
pub mod write;

use std::fmt;

pub use fast::SmallUints;

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
