//! The payloads vLLM writes, decoded with nothing but fast paths: `None` for anything else
//! (another shape, or a problem), which the general decoder then reads. What this accepts, it
//! decodes to the batch the general decoder would: every event's tag comes first and its
//! fields follow in layout order, no field is unknown, and every value is of the plain kind.

use std::ops::Range;

use super::error::At;
use super::event::fields_of;
use super::{fields, Arena, Batch, Event, Removed, Stored};
use crate::layout::{CLEARED, REMOVED, STORED, STORED_FIELDS};
use crate::msgpack::{fixstr, Item, Lax, Reader};

pub(super) fn decode<'a>(payload: &'a [u8], arena: &mut Arena) -> Option<Batch<'a>> {
    let mut reader = Reader::new(payload);
    let fields = match reader.array_header()? {
        fields @ (2 | 3) => fields,
        _ => return None,
    };
    let ts = match reader.peek()? {
        0xcb => match reader.lax().ok()? {
            Lax::Item(Item::Float(value)) => value,
            _ => return None,
        },
        _ => return None,
    };
    let count = reader.array_header()?;
    let mut events = Vec::with_capacity(count.min(reader.left()));
    for index in 0..count {
        let (len, is_map) = match reader.peek()? {
            0x80..=0x8f => (reader.fixmap_header()?, true),
            0x90..=0x9f => (reader.array_header()?, false),
            _ => return None,
        };
        let input = EventInput {
            index,
            reader: &mut reader,
            arena,
            events: &mut events,
        };
        if is_map {
            input.map(len)?;
        } else {
            input.array(len)?;
        }
    }
    let dp_rank = match fields {
        3 if reader.nil() => None,
        3 => Some(reader.small_uint()?),
        _ => None,
    };
    if !reader.is_empty() {
        return None;
    }
    Some(Batch {
        ts,
        dp_rank,
        events,
        unknown_fields: 0,
    })
}

const REMOVED_TAG: [u8; REMOVED.len() + 1] = fixstr(REMOVED);
const STORED_TAG: [u8; STORED.len() + 1] = fixstr(STORED);
const CLEARED_TAG: [u8; CLEARED.len() + 1] = fixstr(CLEARED);

/// The tag, matched as its msgpack bytes, the most frequent first.
fn tag(reader: &mut Reader<'_>) -> Option<&'static str> {
    if reader.consume(&REMOVED_TAG) {
        Some(REMOVED)
    } else if reader.consume(&STORED_TAG) {
        Some(STORED)
    } else if reader.consume(&CLEARED_TAG) {
        Some(CLEARED)
    } else {
        None
    }
}

/// Whether two short strings are equal, compared in words rather than by a call to
/// `memcmp` (keys and tags are 4 to 28 bytes).
#[inline(always)]
fn same(a: &[u8], b: &[u8]) -> bool {
    fn word(bytes: Option<&[u8; 8]>) -> u64 {
        bytes.map_or(0, |bytes| u64::from_le_bytes(*bytes))
    }
    if a.len() != b.len() {
        return false;
    }
    match a.len() {
        0..=3 => a.iter().zip(b).all(|(x, y)| x == y),
        // The first and the last four (eight) bytes, overlapping, cover up to 8 (16).
        4..=7 => {
            let half = |bytes: &[u8], at: usize| {
                u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            };
            let last = a.len() - 4;
            half(a, 0) == half(b, 0) && half(a, last) == half(b, last)
        }
        8..=16 => {
            word(a.first_chunk()) == word(b.first_chunk())
                && word(a.last_chunk()) == word(b.last_chunk())
        }
        17..=24 => {
            word(a.first_chunk()) == word(b.first_chunk())
                && word(a[8..].first_chunk()) == word(b[8..].first_chunk())
                && word(a.last_chunk()) == word(b.last_chunk())
        }
        _ => a == b,
    }
}

/// An event of the fast path, its header read: where it stands in the batch, the reader at
/// its first item, and where it goes.
struct EventInput<'a, 'r> {
    index: usize,
    reader: &'r mut Reader<'a>,
    arena: &'r mut Arena,
    events: &'r mut Vec<Event<'a>>,
}

impl<'a> EventInput<'a, '_> {
    /// A map event of `len` entries, its tag first and its keys in layout order.
    fn map(self, len: usize) -> Option<()> {
        if len == 0 || !same(self.reader.str_bytes()?, b"type") {
            return None;
        }
        let tag = tag(self.reader)?;
        let fields = fields_of(tag);
        let mut next = 0;
        let mut seen = 0u32;
        // Built in its place (a store is large); a failed event fails the whole payload.
        self.events.push(Event::start(tag));
        let event = self.events.last_mut()?;
        for _ in 1..len {
            let key = self.reader.str_bytes()?;
            // Keys come in layout order; some may be left out.
            while !same(STORED_FIELDS[*fields.positions.get(next)?].as_bytes(), key) {
                next += 1;
            }
            let position = fields.positions[next];
            next += 1;
            seen |= 1 << position;
            event.field(self.index, position, self.reader, self.arena)?;
        }
        let required = fields.positions[..fields.required]
            .iter()
            .fold(0u32, |bits, &position| bits | 1 << position);
        if seen & required != required {
            return None;
        }
        event.check()
    }

    /// An array event of `len` items, no position past its layout's.
    fn array(self, len: usize) -> Option<()> {
        if len == 0 {
            return None;
        }
        let tag = tag(self.reader)?;
        let fields = fields_of(tag);
        let given = len - 1;
        if given < fields.required || given > fields.known {
            return None;
        }
        self.events.push(Event::start(tag));
        let event = self.events.last_mut()?;
        for &position in &fields.positions[..given] {
            event.field(self.index, position, self.reader, self.arena)?;
        }
        event.check()
    }
}

impl<'a> Event<'a> {
    fn start(tag: &'static str) -> Self {
        match tag {
            STORED => Event::Stored(Stored::default()),
            REMOVED => Event::Removed(Removed::default()),
            _ => Event::Cleared,
        }
    }

    /// A store's tokens must fill its blocks.
    fn check(&self) -> Option<()> {
        if let Event::Stored(stored) = self {
            let (tokens, blocks) = (stored.tokens.len(), stored.hashes.len());
            let size = stored.block_size;
            if tokens > 0 && (size == 0 || (tokens as u128) < blocks as u128 * size as u128) {
                return None;
            }
        }
        Some(())
    }

    /// Reads the field at this position of [`STORED_FIELDS`] (one of the event's).
    #[inline(always)]
    fn field(
        &mut self,
        index: usize,
        position: usize,
        reader: &mut Reader<'a>,
        arena: &mut Arena,
    ) -> Option<()> {
        match self {
            Event::Removed(removed) => match position {
                0 => removed.hashes = hashes(reader, arena)?,
                5 => removed.medium = opt_str(reader)?,
                8 => removed.group_idx = opt_u32(reader)?,
                11 => removed.locality = opt_str(reader)?,
                _ => removed.ownership = opt_str(reader)?,
            },
            Event::Stored(stored) => match position {
                0 => stored.hashes = hashes(reader, arena)?,
                1 => {
                    stored.parent = if reader.nil() {
                        None
                    } else {
                        Some(reader.hash()?)
                    }
                }
                2 => {
                    let len = reader.array_header()?;
                    let start = arena.tokens.len();
                    let items_start = reader.position();
                    let read = reader.small_uints(len, &mut arena.tokens);
                    (read.count == len).then_some(())?;
                    stored.tokens = start..arena.tokens.len();
                    stored.token_msgpack = read.shortest.then(|| reader.since(items_start));
                }
                3 => stored.block_size = u64::from(reader.small_uint()?),
                4 => stored.lora_id = opt_int(reader)?,
                5 => stored.medium = opt_str(reader)?,
                6 => stored.lora_name = opt_str(reader)?,
                7 => {
                    stored.extra_keys = if reader.nil() {
                        None
                    } else {
                        let at = At::new(index, STORED_FIELDS[7]);
                        let header = reader.position();
                        let item = reader.lax().ok()?;
                        fields::extra_keys(&at, item, header, reader).ok()?
                    }
                }
                8 => stored.group_idx = opt_u32(reader)?,
                9 => stored.spec_kind = opt_str(reader)?,
                10 => stored.sliding_window = opt_int(reader)?,
                11 => stored.locality = opt_str(reader)?,
                12 => stored.ownership = opt_str(reader)?,
                13 => stored.session_id = opt_str(reader)?,
                _ => {
                    stored.lookahead = if reader.nil() {
                        None
                    } else {
                        let at = At::new(index, STORED_FIELDS[14]);
                        let header = reader.position();
                        let item = reader.lax().ok()?;
                        fields::lookahead(&at, item, header, reader).ok()?
                    }
                }
            },
            Event::Cleared => return None,
        }
        Some(())
    }
}

fn hashes(reader: &mut Reader<'_>, arena: &mut Arena) -> Option<Range<usize>> {
    let len = reader.array_header()?;
    let start = arena.hashes.len();
    arena.hashes.reserve(len.min(reader.left()));
    (reader.hashes(len, &mut arena.hashes) == len).then_some(start..arena.hashes.len())
}

/// The media nearly every event names, matched as their msgpack bytes.
const MEDIA: [&str; 2] = ["GPU", "CPU"];
const MEDIA_FIXSTRS: [[u8; 4]; 2] = [fixstr(MEDIA[0]), fixstr(MEDIA[1])];

/// Strings most events carry, taken as they are rather than checked for UTF-8 each time
/// (the media here too, for their other encodings).
const COMMON: [&str; 3] = [MEDIA[0], MEDIA[1], "full_attention"];

/// `Some(value)`: the field's value; `None`: not of the plain kind.
fn opt_str<'a>(reader: &mut Reader<'a>) -> Option<Option<&'a str>> {
    if reader.nil() {
        return Some(None);
    }
    if let Some(medium) = (0..MEDIA.len()).find(|&index| reader.consume(&MEDIA_FIXSTRS[index])) {
        return Some(Some(MEDIA[medium]));
    }
    let bytes = reader.str_bytes()?;
    if let Some(&common) = COMMON.iter().find(|known| same(known.as_bytes(), bytes)) {
        return Some(Some(common));
    }
    std::str::from_utf8(bytes).ok().map(Some)
}

fn opt_u32(reader: &mut Reader<'_>) -> Option<Option<u32>> {
    if reader.nil() {
        return Some(None);
    }
    reader.small_uint().map(Some)
}

fn opt_int(reader: &mut Reader<'_>) -> Option<Option<i128>> {
    if reader.nil() {
        return Some(None);
    }
    reader.small_uint().map(|value| Some(i128::from(value)))
}
