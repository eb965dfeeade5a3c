//! vLLM payload bytes of every release to events, without a copy of any string.
//!
//! Tolerant where vLLM grew (unknown trailing positions and unknown map keys are skipped and
//! counted), strict where meaning would be lost (an unknown tag, a wrong type, a value out of
//! range, tokens that cannot fill their blocks). Errors name the event index and the field the
//! way `kvbridge.schemas.decode_batch` names them, so the two decoders can be compared.

use std::fmt;
use std::ops::Range;

use crate::layout::{
    CLEARED, REMOVED, REMOVED_ARRAY_FIELDS, REMOVED_FIELDS, REMOVED_REQUIRED, STORED,
    STORED_ARRAY_FIELDS, STORED_FIELDS, STORED_REQUIRED, U32_MAX,
};
use crate::msgpack::{Item, ReadError, Reader};

/// A payload that is not a valid vLLM batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The event the error lies in, when it lies in one.
    pub event_index: Option<usize>,
    /// The field, with a list index where there is one (`token_ids[3]`).
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SchemaError {}

/// The flat storage of a batch's hashes and tokens, reused from batch to batch.
#[derive(Debug, Default)]
pub struct Arena {
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
}

impl Arena {
    fn clear(&mut self) {
        self.hashes.clear();
        self.tokens.clear();
    }
}

/// A `BlockStored`; lists are ranges of the [`Arena`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stored<'a> {
    /// Engine hashes as u64 (see [`crate::hashing::engine_hash`]).
    pub hashes: Range<usize>,
    pub parent: Option<u64>,
    pub tokens: Range<usize>,
    pub block_size: u64,
    pub lora_id: Option<i128>,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    /// The msgpack of the `extra_keys` list (checked well-formed), if not nil.
    pub extra_keys: Option<&'a [u8]>,
    pub group_idx: Option<u32>,
    pub spec_kind: Option<&'a str>,
    pub sliding_window: Option<i128>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
    pub session_id: Option<&'a str>,
    /// The msgpack of `lookahead_token_ids` (checked), if not nil.
    pub lookahead: Option<&'a [u8]>,
}

/// A `BlockRemoved`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Removed<'a> {
    pub hashes: Range<usize>,
    pub medium: Option<&'a str>,
    pub group_idx: Option<u32>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Removed<'a>),
    Cleared,
}

/// One decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch<'a> {
    pub ts: f64,
    pub dp_rank: Option<u32>,
    pub events: Vec<Event<'a>>,
    /// Unknown trailing positions and map keys skipped, counted as `decode_batch` counts them.
    pub unknown_fields: u64,
}

/// Where an error lies, for its message.
struct At<'f> {
    event: usize,
    field: &'f str,
    element: Option<usize>,
}

impl At<'_> {
    fn error(&self, text: impl fmt::Display) -> SchemaError {
        let field = match self.element {
            Some(index) => format!("{}[{index}]", self.field),
            None => self.field.to_string(),
        };
        SchemaError {
            message: format!("event {}: field '{field}': {text}", self.event),
            event_index: Some(self.event),
            field: Some(field),
        }
    }

    fn at(&self, element: usize) -> At<'_> {
        At {
            event: self.event,
            field: self.field,
            element: Some(element),
        }
    }
}

fn batch_error(text: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: None,
        field: None,
        message: format!("batch: {text}"),
    }
}

fn event_error(index: usize, field: &str, text: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: Some(field.to_string()),
        message: format!("event {index}: field '{field}': {text}"),
    }
}

fn read_error(index: usize, error: &ReadError) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: None,
        message: format!("event {index}: {error}"),
    }
}

fn expected(what: &str, item: &Item<'_>) -> String {
    format!("Expected `{what}`, got `{}`", item.type_name())
}

/// Decodes one payload. Hashes and tokens go to `arena` (cleared first).
pub fn decode<'a>(payload: &'a [u8], arena: &mut Arena) -> Result<Batch<'a>, SchemaError> {
    arena.clear();
    if payload.is_empty() {
        return Err(batch_error("empty payload"));
    }
    let mut reader = Reader::new(payload);
    let malformed = |error: ReadError| batch_error(format!("malformed msgpack: {error}"));
    let fields = match reader.item().map_err(malformed)? {
        Item::Array(len) => len,
        other => return Err(batch_error(expected("array", &other))),
    };
    if fields < 2 {
        return Err(batch_error(format!(
            "Expected `array` of at least length 2, got {fields}"
        )));
    }
    let ts = match reader.item().map_err(malformed)? {
        Item::Float(value) => value,
        Item::UInt(value) => value as f64,
        Item::NegInt(value) => value as f64,
        other => {
            return Err(batch_error(format!(
                "{} - at `$[0]`",
                expected("float", &other)
            )))
        }
    };
    let count = match reader.item().map_err(malformed)? {
        Item::Array(len) => len,
        other => {
            return Err(batch_error(format!(
                "{} - at `$[1]`",
                expected("array", &other)
            )))
        }
    };
    // Events are framed first (structure only), then decoded one by one, as decode_batch does.
    let mut raws = Vec::with_capacity(count);
    for _ in 0..count {
        raws.push(frame(&mut reader).map_err(malformed)?);
    }
    let mut dp_rank = None;
    if fields >= 3 {
        dp_rank = match reader.item().map_err(malformed)? {
            Item::Nil => None,
            Item::UInt(value) if value <= U32_MAX => Some(value as u32),
            Item::UInt(_) => {
                return Err(batch_error(format!(
                    "Expected `int` <= {U32_MAX} - at `$[2]`"
                )))
            }
            Item::NegInt(_) => return Err(batch_error("Expected `int` >= 0 - at `$[2]`")),
            other => {
                return Err(batch_error(format!(
                    "{} - at `$[2]`",
                    expected("int | null", &other)
                )))
            }
        };
    }
    let extra_batch_fields = fields.saturating_sub(3);
    for _ in 0..extra_batch_fields {
        reader.skip(1).map_err(malformed)?;
    }
    if !reader.is_empty() {
        return Err(batch_error("malformed msgpack: trailing characters"));
    }
    let mut events = Vec::with_capacity(count);
    let mut unknown = extra_batch_fields as u64;
    let mut eras = (false, false);
    let mut fast_path_unknown = 0u64;
    for (index, raw) in raws.into_iter().enumerate() {
        let decoded = decode_event(index, raw, arena)?;
        if decoded.array {
            eras.0 = true;
        } else {
            eras.1 = true;
        }
        unknown += decoded.unknown;
        fast_path_unknown += decoded.unknown_not_nil;
        events.push(decoded.event);
    }
    // decode_batch first tries one strict pass per era; a batch it accepts there counts
    // nothing unknown, even nil array positions past the array era.
    if extra_batch_fields == 0 && !(eras.0 && eras.1) && fast_path_unknown == 0 {
        unknown = 0;
    }
    Ok(Batch {
        ts,
        dp_rank,
        events,
        unknown_fields: unknown,
    })
}

/// One event's bytes, framed without checking strings (the event's own decoding checks them).
fn frame<'a>(reader: &mut Reader<'a>) -> Result<&'a [u8], ReadError> {
    reader.raw(1)
}

struct Decoded<'a> {
    event: Event<'a>,
    array: bool,
    unknown: u64,
    /// Unknown fields that would also fail decode_batch's strict one-pass decoding.
    unknown_not_nil: u64,
}

fn decode_event<'a>(
    index: usize,
    raw: &'a [u8],
    arena: &mut Arena,
) -> Result<Decoded<'a>, SchemaError> {
    // The whole event must be well-formed msgpack with valid strings, unknown fields included.
    Reader::new(raw)
        .skip(1)
        .map_err(|error| read_error(index, &error))?;
    let mut reader = Reader::new(raw);
    let head = reader.item().map_err(|error| read_error(index, &error))?;
    match head {
        Item::Array(len) => decode_array_event(index, len, &mut reader, arena),
        Item::Map(len) => decode_map_event(index, len, &mut reader, arena),
        other => Err(event_error(index, "event", expected("object", &other))),
    }
}

fn tag_of(index: usize, item: Item<'_>) -> Result<&'static str, SchemaError> {
    match item {
        Item::Str(STORED) => Ok(STORED),
        Item::Str(REMOVED) => Ok(REMOVED),
        Item::Str(CLEARED) => Ok(CLEARED),
        Item::Str(other) => Err(event_error(
            index,
            "type",
            format!("Invalid value '{other}'"),
        )),
        other => Err(event_error(index, "type", expected("str", &other))),
    }
}

fn fields_of(tag: &str) -> (&'static [&'static str], usize, usize) {
    match tag {
        STORED => (&STORED_FIELDS, STORED_REQUIRED, STORED_ARRAY_FIELDS),
        REMOVED => (&REMOVED_FIELDS, REMOVED_REQUIRED, REMOVED_ARRAY_FIELDS),
        _ => (&[], 0, 0),
    }
}

fn decode_array_event<'a>(
    index: usize,
    len: usize,
    reader: &mut Reader<'a>,
    arena: &mut Arena,
) -> Result<Decoded<'a>, SchemaError> {
    if len == 0 {
        return Err(event_error(
            index,
            "event",
            "Expected `array` of at least length 1, got 0",
        ));
    }
    let item = reader.item().map_err(|error| read_error(index, &error))?;
    let tag = tag_of(index, item)?;
    let (names, required, known) = fields_of(tag);
    let given = len - 1;
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
    let mut builder = EventBuilder::new(tag);
    for name in names.iter().take(given.min(known)) {
        builder.field(index, name, reader, arena)?;
    }
    // Positions past the array era: unknown. Nil ones up to the newest field count are what
    // decode_batch's strict pass would accept, the rest fail it.
    let mut unknown_not_nil = 0;
    for position in known..given {
        let is_nil = reader.peek() == Some(0xc0);
        reader.skip(2).map_err(|error| read_error(index, &error))?;
        if !is_nil || position >= names.len() {
            unknown_not_nil += 1;
        }
    }
    Ok(Decoded {
        event: builder.finish(index)?,
        array: true,
        unknown: given.saturating_sub(known) as u64,
        unknown_not_nil,
    })
}

fn decode_map_event<'a>(
    index: usize,
    len: usize,
    reader: &mut Reader<'a>,
    arena: &mut Arena,
) -> Result<Decoded<'a>, SchemaError> {
    // The tag may stand anywhere among the keys: find it first.
    let start = reader.clone();
    let mut tag = None;
    for _ in 0..len {
        let key = reader.item().map_err(|error| read_error(index, &error))?;
        if key == Item::Str("type") {
            let item = reader.item().map_err(|error| read_error(index, &error))?;
            tag = Some(tag_of(index, item)?);
            break;
        }
        reader.skip(2).map_err(|error| read_error(index, &error))?;
    }
    let Some(tag) = tag else {
        return Err(event_error(
            index,
            "event",
            "Object missing required field `type`",
        ));
    };
    *reader = start;
    let (names, required, _) = fields_of(tag);
    let mut builder = EventBuilder::new(tag);
    let mut unknown = 0;
    for _ in 0..len {
        let key = reader.item().map_err(|error| read_error(index, &error))?;
        let name = match key {
            Item::Str("type") => {
                reader.skip(2).map_err(|error| read_error(index, &error))?;
                continue;
            }
            Item::Str(name) => names.iter().find(|known| **known == name),
            other => return Err(event_error(index, "event", expected("str", &other))),
        };
        match name {
            Some(name) => builder.field(index, name, reader, arena)?,
            None => {
                unknown += 1;
                reader.skip(2).map_err(|error| read_error(index, &error))?;
            }
        }
    }
    if let Some(missing) = names[..required].iter().position(|name| !builder.has(name)) {
        return Err(event_error(
            index,
            "event",
            format!("Object missing required field `{}`", names[missing]),
        ));
    }
    Ok(Decoded {
        event: builder.finish(index)?,
        array: false,
        unknown,
        unknown_not_nil: unknown,
    })
}

/// Fills an event field by field, in wire order.
struct EventBuilder<'a> {
    tag: &'static str,
    stored: Stored<'a>,
    seen: u32,
}

impl<'a> EventBuilder<'a> {
    fn new(tag: &'static str) -> Self {
        EventBuilder {
            tag,
            stored: Stored::default(),
            seen: 0,
        }
    }

    fn has(&self, name: &str) -> bool {
        let (names, _, _) = fields_of(self.tag);
        names
            .iter()
            .position(|known| *known == name)
            .is_some_and(|bit| self.seen & (1 << bit) != 0)
    }

    fn field(
        &mut self,
        event: usize,
        name: &'static str,
        reader: &mut Reader<'a>,
        arena: &mut Arena,
    ) -> Result<(), SchemaError> {
        let (names, _, _) = fields_of(self.tag);
        if let Some(bit) = names.iter().position(|known| *known == name) {
            self.seen |= 1 << bit;
        }
        let at = At {
            event,
            field: name,
            element: None,
        };
        let item_start = reader.position();
        let item = reader.item().map_err(|error| read_error(event, &error))?;
        let stored = &mut self.stored;
        match name {
            "block_hashes" => stored.hashes = hash_list(&at, item, reader, arena)?,
            "parent_block_hash" => {
                stored.parent = match item {
                    Item::Nil => None,
                    other => Some(hash(&at, other, "int | bytes | null")?),
                }
            }
            "token_ids" => stored.tokens = token_list(&at, item, reader, arena)?,
            "block_size" => {
                stored.block_size = u64::from(u32_field(&at, item, false)?.unwrap_or(0))
            }
            "lora_id" => stored.lora_id = opt_int(&at, item)?,
            "medium" => stored.medium = opt_str(&at, item)?,
            "lora_name" => stored.lora_name = opt_str(&at, item)?,
            "extra_keys" => stored.extra_keys = extra_keys(&at, item, item_start, reader)?,
            "group_idx" => stored.group_idx = u32_field(&at, item, true)?,
            "kv_cache_spec_kind" => stored.spec_kind = opt_str(&at, item)?,
            "kv_cache_spec_sliding_window" => stored.sliding_window = opt_int(&at, item)?,
            "locality" => stored.locality = opt_str(&at, item)?,
            "ownership" => stored.ownership = opt_str(&at, item)?,
            "session_id" => stored.session_id = opt_str(&at, item)?,
            "lookahead_token_ids" => stored.lookahead = lookahead(&at, item, item_start, reader)?,
            _ => unreachable!("a field of the layout table"),
        }
        Ok(())
    }

    fn finish(self, index: usize) -> Result<Event<'a>, SchemaError> {
        let stored = self.stored;
        match self.tag {
            STORED => {
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
                Ok(Event::Stored(stored))
            }
            REMOVED => Ok(Event::Removed(Removed {
                hashes: stored.hashes,
                medium: stored.medium,
                group_idx: stored.group_idx,
                locality: stored.locality,
                ownership: stored.ownership,
            })),
            _ => Ok(Event::Cleared),
        }
    }
}

fn hash(at: &At<'_>, item: Item<'_>, what: &str) -> Result<u64, SchemaError> {
    match item {
        Item::UInt(value) => Ok(value),
        Item::NegInt(value) => Ok(value as u64),
        Item::Bin(bytes) => Ok(crate::hashing::engine_hash_bytes(bytes)),
        other => Err(at.error(expected(what, &other))),
    }
}

fn hash_list(
    at: &At<'_>,
    item: Item<'_>,
    reader: &mut Reader<'_>,
    arena: &mut Arena,
) -> Result<Range<usize>, SchemaError> {
    let Item::Array(len) = item else {
        return Err(at.error(expected("array", &item)));
    };
    let start = arena.hashes.len();
    arena.hashes.reserve(len);
    for element in 0..len {
        let item = reader
            .item()
            .map_err(|error| read_error(at.event, &error))?;
        arena
            .hashes
            .push(hash(&at.at(element), item, "int | bytes")?);
    }
    Ok(start..arena.hashes.len())
}

fn token(at: &At<'_>, item: Item<'_>) -> Result<u32, SchemaError> {
    match item {
        Item::UInt(value) if value <= U32_MAX => Ok(value as u32),
        Item::UInt(_) => Err(at.error(format!("Expected `int` <= {U32_MAX}"))),
        Item::NegInt(_) => Err(at.error("Expected `int` >= 0")),
        other => Err(at.error(expected("int", &other))),
    }
}

fn token_list(
    at: &At<'_>,
    item: Item<'_>,
    reader: &mut Reader<'_>,
    arena: &mut Arena,
) -> Result<Range<usize>, SchemaError> {
    let Item::Array(len) = item else {
        return Err(at.error(expected("array", &item)));
    };
    let start = arena.tokens.len();
    arena.tokens.reserve(len);
    for element in 0..len {
        let item = reader
            .item()
            .map_err(|error| read_error(at.event, &error))?;
        arena.tokens.push(token(&at.at(element), item)?);
    }
    Ok(start..arena.tokens.len())
}

/// A field declared as a non-negative 32-bit int (`nullable`: or nil).
fn u32_field(at: &At<'_>, item: Item<'_>, nullable: bool) -> Result<Option<u32>, SchemaError> {
    match item {
        Item::Nil if nullable => Ok(None),
        Item::UInt(value) if value <= U32_MAX => Ok(Some(value as u32)),
        Item::UInt(_) => Err(at.error(format!("Expected `int` <= {U32_MAX}"))),
        Item::NegInt(_) => Err(at.error("Expected `int` >= 0")),
        other => Err(at.error(expected(
            if nullable { "int | null" } else { "int" },
            &other,
        ))),
    }
}

fn opt_int(at: &At<'_>, item: Item<'_>) -> Result<Option<i128>, SchemaError> {
    match item {
        Item::Nil => Ok(None),
        Item::UInt(value) => Ok(Some(i128::from(value))),
        Item::NegInt(value) => Ok(Some(i128::from(value))),
        other => Err(at.error(expected("int | null", &other))),
    }
}

fn opt_str<'a>(at: &At<'_>, item: Item<'a>) -> Result<Option<&'a str>, SchemaError> {
    match item {
        Item::Nil => Ok(None),
        Item::Str(value) => Ok(Some(value)),
        other => Err(at.error(expected("str | null", &other))),
    }
}

/// `list[list[Any] | None] | None`: kept as msgpack, read again where it matters.
fn extra_keys<'a>(
    at: &At<'_>,
    item: Item<'_>,
    header: usize,
    reader: &mut Reader<'a>,
) -> Result<Option<&'a [u8]>, SchemaError> {
    let len = match item {
        Item::Nil => return Ok(None),
        Item::Array(len) => len,
        other => return Err(at.error(expected("array | null", &other))),
    };
    for element in 0..len {
        match reader
            .item()
            .map_err(|error| read_error(at.event, &error))?
        {
            Item::Nil => {}
            Item::Array(keys) => {
                for _ in 0..keys {
                    reader
                        .skip(4)
                        .map_err(|error| read_error(at.event, &error))?;
                }
            }
            other => return Err(at.at(element).error(expected("array | null", &other))),
        }
    }
    Ok(Some(reader.since(header)))
}

/// `list[list[TokenId]] | None`, checked and kept as msgpack.
fn lookahead<'a>(
    at: &At<'_>,
    item: Item<'_>,
    header: usize,
    reader: &mut Reader<'a>,
) -> Result<Option<&'a [u8]>, SchemaError> {
    let len = match item {
        Item::Nil => return Ok(None),
        Item::Array(len) => len,
        other => return Err(at.error(expected("array | null", &other))),
    };
    for element in 0..len {
        let inner = at.at(element);
        match reader
            .item()
            .map_err(|error| read_error(at.event, &error))?
        {
            Item::Array(tokens) => {
                for _ in 0..tokens {
                    let item = reader
                        .item()
                        .map_err(|error| read_error(at.event, &error))?;
                    token(&inner, item)?;
                }
            }
            other => return Err(inner.error(expected("array", &other))),
        }
    }
    Ok(Some(reader.since(header)))
}
