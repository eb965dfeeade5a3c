//! One event of the general path: its tag wherever it stands, its fields by position or by
//! key as the release table (`crate::layout`) names them, unknown ones counted and checked.

use super::error::{event_error, expected, malformed_event, At, SchemaError};
use super::fields::{
    extra_keys, hash, hash_list, lookahead, opt_int, opt_str, token_list, u32_field,
};
use super::generic::{generic, GenericError};
use super::{Arena, Decoded, Stored, EVENT_DEPTH};
use crate::layout::{
    stored_position, CLEARED, REMOVED, REMOVED_ARRAY_FIELDS, REMOVED_AS_STORED, REMOVED_FIELDS,
    REMOVED_REQUIRED, STORED, STORED_ARRAY_FIELDS, STORED_FIELDS, STORED_REQUIRED,
};
use crate::msgpack::{Item, Lax, ReadError, Reader};

/// Checks a whole event as a generic decoding of it would (strings, timestamps, map keys).
fn check_generic(index: usize, raw: &[u8]) -> Result<(), SchemaError> {
    generic(&mut Reader::new(raw), &mut Vec::new(), EVENT_DEPTH)
        .map(|_| ())
        .map_err(|error| match error {
            GenericError::Malformed(text) | GenericError::Timestamp { text, .. } => {
                malformed_event(index, text)
            }
        })
}

/// The event type a tag names: an unknown one is an invalid value, or malformed if its bytes
/// are not even UTF-8.
fn tag_of(index: usize, item: Lax<'_>) -> Result<&'static str, SchemaError> {
    let Lax::Str(bytes) = item else {
        return Err(event_error(index, "type", expected("str", &item)));
    };
    match bytes {
        b"BlockStored" => Ok(STORED),
        b"BlockRemoved" => Ok(REMOVED),
        b"AllBlocksCleared" => Ok(CLEARED),
        _ => Err(match std::str::from_utf8(bytes) {
            Ok(other) => event_error(index, "type", format!("Invalid value '{other}'")),
            Err(_) => malformed_event(index, ReadError::Utf8),
        }),
    }
}

/// An event type's fields: their names, their positions in [`STORED_FIELDS`], how many lead
/// as required, and how many the array era sent.
pub(super) struct Fields {
    pub(super) names: &'static [&'static str],
    pub(super) positions: &'static [usize],
    pub(super) required: usize,
    pub(super) known: usize,
}

const ALL_STORED: [usize; 15] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];

pub(super) fn fields_of(tag: &str) -> Fields {
    match tag {
        STORED => Fields {
            names: &STORED_FIELDS,
            positions: &ALL_STORED,
            required: STORED_REQUIRED,
            known: STORED_ARRAY_FIELDS,
        },
        REMOVED => Fields {
            names: &REMOVED_FIELDS,
            positions: &REMOVED_AS_STORED,
            required: REMOVED_REQUIRED,
            known: REMOVED_ARRAY_FIELDS,
        },
        _ => Fields {
            names: &[],
            positions: &[],
            required: 0,
            known: 0,
        },
    }
}

/// An event of the general path: where it stands in the batch, its bytes, the reader over them
/// (the caller reads the header through it, then calls [`EventInput::array`] or
/// [`EventInput::map`]), and the event it fills.
pub(super) struct EventInput<'a, 'r> {
    pub(super) index: usize,
    pub(super) raw: &'a [u8],
    pub(super) reader: &'r mut Reader<'a>,
    pub(super) arena: &'r mut Arena,
    pub(super) stored: &'r mut Stored<'a>,
}

impl<'a> EventInput<'a, '_> {
    /// An array event of `len` items: the tag, then the fields by position.
    pub(super) fn array(self, len: usize) -> Result<Decoded, SchemaError> {
        let index = self.index;
        let malformed = |error: ReadError| malformed_event(index, error);
        if len == 0 {
            return Err(event_error(
                index,
                "event",
                "Expected `array` of at least length 1, got 0",
            ));
        }
        let tag = tag_of(index, self.reader.lax().map_err(malformed)?)?;
        let fields = fields_of(tag);
        let (names, required, known) = (fields.names, fields.required, fields.known);
        let given = len - 1;
        // Positions past the array era are unknown: decode_batch decodes such an event
        // generically, drops them and decodes the rest.
        let unknown = given.saturating_sub(known);
        if unknown > 0 {
            check_generic(index, self.raw)?;
        }
        if given < required {
            return Err(event_error(
                index,
                "event",
                format!(
                    "Expected `array` of at least length {}, got {len}",
                    required + 1
                ),
            ));
        }
        let mut builder = EventBuilder::new(tag, self.stored);
        for &position in fields.positions.iter().take(given.min(known)) {
            builder.field(index, position, self.reader, self.arena)?;
        }
        // The strict pass accepts nil up to the newest layout's fields, and nothing past them.
        let mut fast = given <= names.len();
        for _ in known..given {
            fast &= self.reader.peek() == Some(0xc0);
            self.reader.skip_lax(EVENT_DEPTH + 1).map_err(malformed)?;
        }
        builder.finish(index)?;
        Ok(Decoded {
            tag,
            array: true,
            unknown: unknown as u64,
            fast,
        })
    }

    /// A map event of `len` entries: the tag wherever it stands, the fields by key.
    pub(super) fn map(self, len: usize) -> Result<Decoded, SchemaError> {
        let index = self.index;
        let malformed = |error: ReadError| malformed_event(index, error);
        let key_of = |keys: &mut Reader<'a>| {
            if let Some(bytes) = keys.str_bytes() {
                return Ok(bytes);
            }
            match keys.lax().map_err(malformed)? {
                Lax::Str(bytes) => Ok(bytes),
                other => Err(event_error(index, "event", expected("str", &other))),
            }
        };
        // The tag may stand anywhere among the keys: msgspec looks for it first, then decodes
        // every key from the start (or from the second key if the tag was the first).
        let start = self.reader.clone();
        let mut tag = None;
        for position in 0..len {
            if key_of(self.reader)? == b"type" {
                tag = Some((
                    tag_of(index, self.reader.lax().map_err(malformed)?)?,
                    position,
                ));
                break;
            }
            self.reader.skip_lax(EVENT_DEPTH + 1).map_err(malformed)?;
        }
        let Some((tag, position)) = tag else {
            return Err(event_error(
                index,
                "event",
                "Object missing required field `type`",
            ));
        };
        let mut keys = len - 1;
        if position > 0 {
            *self.reader = start;
            keys = len;
        }
        let fields = fields_of(tag);
        let mut builder = EventBuilder::new(tag, self.stored);
        // Unknown keys, each counted once as decode_batch counts them (on a generic decoding).
        let mut unknown: Vec<&[u8]> = Vec::new();
        for _ in 0..keys {
            let key = key_of(self.reader)?;
            if key == b"type" {
                let again = self.reader.lax().map_err(malformed)?;
                if tag_of(index, again)? != tag {
                    let Lax::Str(bytes) = again else {
                        unreachable!("tag_of took a str")
                    };
                    return Err(event_error(
                        index,
                        "type",
                        format!("Invalid value '{}'", String::from_utf8_lossy(bytes)),
                    ));
                }
                continue;
            }
            let position = stored_position(key).filter(|p| fields.positions.contains(p));
            match position {
                Some(position) => builder.field(index, position, self.reader, self.arena)?,
                None => {
                    // The strict pass stops at the first unknown key, and its error quotes the
                    // key: one that is not UTF-8 fails there as malformed.
                    if unknown.is_empty() && std::str::from_utf8(key).is_err() {
                        return Err(malformed_event(index, ReadError::Utf8));
                    }
                    if !unknown.contains(&key) {
                        unknown.push(key);
                    }
                    self.reader.skip_lax(EVENT_DEPTH + 1).map_err(malformed)?;
                }
            }
        }
        let required = &fields.positions[..fields.required];
        if let Some(&missing) = required.iter().find(|&&position| !builder.has(position)) {
            let missing = STORED_FIELDS[missing];
            return Err(event_error(
                index,
                "event",
                format!("Object missing required field `{missing}`"),
            ));
        }
        if !unknown.is_empty() {
            check_generic(index, self.raw)?;
        }
        builder.finish(index)?;
        Ok(Decoded {
            tag,
            array: false,
            unknown: unknown.len() as u64,
            fast: unknown.is_empty(),
        })
    }
}

/// Fills an event field by field, in wire order.
struct EventBuilder<'a, 'b> {
    tag: &'static str,
    stored: &'b mut Stored<'a>,
    seen: u32,
}

impl<'a, 'b> EventBuilder<'a, 'b> {
    /// `stored` is where the event is built, a default `Stored`.
    fn new(tag: &'static str, stored: &'b mut Stored<'a>) -> Self {
        EventBuilder {
            tag,
            stored,
            seen: 0,
        }
    }

    /// Whether the field at this position of [`STORED_FIELDS`] was given.
    fn has(&self, position: usize) -> bool {
        self.seen & (1 << position) != 0
    }

    /// Reads the field at this position of [`STORED_FIELDS`].
    fn field(
        &mut self,
        event: usize,
        position: usize,
        reader: &mut Reader<'a>,
        arena: &mut Arena,
    ) -> Result<(), SchemaError> {
        self.seen |= 1 << position;
        let at = At::new(event, STORED_FIELDS[position]);
        let item_start = reader.position();
        let item = reader
            .lax()
            .map_err(|error| malformed_event(event, error))?;
        let stored = &mut *self.stored;
        match position {
            0 => stored.hashes = hash_list(&at, item, reader, arena)?,
            1 => {
                stored.parent = match item {
                    Lax::Item(Item::Nil) => None,
                    other => Some(hash(&at, other, "int | bytes | null")?),
                }
            }
            2 => (stored.tokens, stored.token_msgpack) = token_list(&at, item, reader, arena)?,
            3 => stored.block_size = u64::from(u32_field(&at, item, false)?.unwrap_or(0)),
            4 => stored.lora_id = opt_int(&at, item)?,
            5 => stored.medium = opt_str(&at, item)?,
            6 => stored.lora_name = opt_str(&at, item)?,
            7 => stored.extra_keys = extra_keys(&at, item, item_start, reader)?,
            8 => stored.group_idx = u32_field(&at, item, true)?,
            9 => stored.spec_kind = opt_str(&at, item)?,
            10 => stored.sliding_window = opt_int(&at, item)?,
            11 => stored.locality = opt_str(&at, item)?,
            12 => stored.ownership = opt_str(&at, item)?,
            13 => stored.session_id = opt_str(&at, item)?,
            14 => stored.lookahead = lookahead(&at, item, item_start, reader)?,
            _ => unreachable!("a field of the layout table"),
        }
        Ok(())
    }

    /// Checks a store's tokens against its blocks.
    fn finish(self, index: usize) -> Result<(), SchemaError> {
        let stored = &*self.stored;
        if self.tag == STORED {
            let tokens = stored.tokens.len();
            let blocks = stored.hashes.len();
            let size = stored.block_size;
            if tokens > 0 && (size == 0 || (tokens as u128) < blocks as u128 * size as u128) {
                return Err(event_error(
                    index,
                    "token_ids",
                    format!("{tokens} tokens cannot fill {blocks} blocks of {size}"),
                ));
            }
        }
        Ok(())
    }
}
