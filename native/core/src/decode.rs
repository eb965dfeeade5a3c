//! vLLM payload bytes of every release to events, without a copy of any string.
//!
//! Tolerant where vLLM grew (unknown trailing positions and unknown map keys are skipped and
//! counted), strict where meaning would be lost (an unknown tag, a wrong type, a value out of
//! range, tokens that cannot fill their blocks, malformed msgpack, nesting deeper than
//! [`MAX_DEPTH`]).
//!
//! Every payload gets the outcome `kvbridge.schemas.decode_batch` gives it: the same batch, or
//! an error at the same event index and field (`tests/test_decode_differential.py` checks
//! this). So the first problem in wire order wins, as msgspec meets it: strings are checked
//! for UTF-8 when a field of type `str` reads them (a string where an int belongs is a type
//! error), skipped values are only framed, and an event with fields no release has is also
//! read generically as a whole (its strings, timestamps and map keys checked), as
//! decode_batch's event-by-event path reads it. Where decode_batch is at fault (see
//! `known_divergence` in `tools/fuzz_decoders.py`) this decoder follows the wire format.

use std::fmt;
use std::ops::Range;

use crate::layout::{
    stored_position, CLEARED, REMOVED, REMOVED_ARRAY_FIELDS, REMOVED_AS_STORED, REMOVED_FIELDS,
    REMOVED_REQUIRED, STORED, STORED_ARRAY_FIELDS, STORED_FIELDS, STORED_REQUIRED, U32_MAX,
};
use crate::msgpack::{fixstr, too_deep, Item, Lax, ReadError, Reader, MAX_DEPTH};

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
    /// The msgpack of the token ids (the array's items, not its header) when every one is in
    /// its shortest form: the bytes the writers would write for them, copied instead.
    pub token_msgpack: Option<&'a [u8]>,
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

/// Where an error lies: an event's field, and up to two list indices in it
/// (`lookahead_token_ids[1][3]`).
#[derive(Clone, Copy)]
struct At<'f> {
    event: usize,
    field: &'f str,
    elements: [usize; 2],
    depth: u8,
}

impl<'f> At<'f> {
    fn new(event: usize, field: &'f str) -> Self {
        At {
            event,
            field,
            elements: [0; 2],
            depth: 0,
        }
    }

    fn name(&self) -> String {
        let mut name = self.field.to_string();
        for element in &self.elements[..usize::from(self.depth)] {
            name.push_str(&format!("[{element}]"));
        }
        name
    }

    fn error(&self, text: impl fmt::Display) -> SchemaError {
        event_error(self.event, &self.name(), text)
    }

    fn at(&self, element: usize) -> At<'f> {
        let mut inner = *self;
        inner.elements[usize::from(self.depth).min(1)] = element;
        inner.depth = (self.depth + 1).min(2);
        inner
    }

    /// The error of a value inside this one that msgspec decoded as `Any` (an extra key).
    fn generic_error(&self, error: GenericError) -> SchemaError {
        match error {
            GenericError::Malformed(text) => malformed_event(self.event, text),
            GenericError::Timestamp { text, path } => {
                // A path through a map key reads "`key` in `$...`" in msgspec's error, which
                // decode_batch cannot map to a field.
                if path.contains(&Segment::Key) {
                    return event_error(self.event, "event", text);
                }
                let mut name = self.name();
                for segment in path {
                    match segment {
                        Segment::Index(index) => name.push_str(&format!("[{index}]")),
                        Segment::Value => name.push_str("[...]"),
                        Segment::Key => unreachable!("checked above"),
                    }
                }
                event_error(self.event, &name, text)
            }
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

fn malformed_batch(error: impl fmt::Display) -> SchemaError {
    batch_error(format!("malformed msgpack: {error}"))
}

fn event_error(index: usize, field: &str, text: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: Some(field.to_string()),
        message: format!("event {index}: field '{field}': {text}"),
    }
}

fn malformed_event(index: usize, error: impl fmt::Display) -> SchemaError {
    SchemaError {
        event_index: Some(index),
        field: None,
        message: format!("event {index}: malformed msgpack: {error}"),
    }
}

fn expected(what: &str, item: &Lax<'_>) -> String {
    format!("Expected `{what}`, got `{}`", item.type_name())
}

/// Decodes one payload. Hashes and tokens go to `arena` (cleared first).
pub fn decode<'a>(payload: &'a [u8], arena: &mut Arena) -> Result<Batch<'a>, SchemaError> {
    arena.clear();
    if payload.is_empty() {
        return Err(batch_error("empty payload"));
    }
    // Most payloads are valid and shaped as vLLM writes them: a pass that takes only that
    // shape. Anything else gets one general pass, and anything that fails that is decoded again
    // the exact way, framing every event before decoding any, since that decides which error a
    // payload with several problems reports.
    if let Some(batch) = fast::decode(payload, arena) {
        return Ok(batch);
    }
    arena.clear();
    if let Some(batch) = decode_in_one_pass(payload, arena) {
        return Ok(batch);
    }
    arena.clear();
    // decode_batch refuses deep nesting before anything else; a payload that decodes has been
    // framed to its last byte, within the limit, so only a failed one needs the walk.
    decode_batch(payload, arena).map_err(|error| nesting_error(payload).unwrap_or(error))
}

/// A valid payload's batch, decoding each event straight from the payload; `None` at the first
/// problem of any kind.
fn decode_in_one_pass<'a>(payload: &'a [u8], arena: &mut Arena) -> Option<Batch<'a>> {
    let mut reader = Reader::new(payload);
    let Ok(Lax::Item(Item::Array(fields @ 2..))) = reader.lax() else {
        return None;
    };
    let ts = match reader.lax().ok()? {
        Lax::Item(Item::Float(value)) => value,
        Lax::Item(Item::UInt(value)) => value as f64,
        Lax::Item(Item::NegInt(value)) => value as f64,
        _ => return None,
    };
    let Ok(Lax::Item(Item::Array(count))) = reader.lax() else {
        return None;
    };
    let mut events = Vec::with_capacity(count.min(reader.left()));
    let mut tally = Tally::new(0);
    let mut at = reader.position();
    for index in 0..count {
        let (decoded, used) = decode_event(index, &payload[at..], arena, &mut events).ok()?;
        at += used;
        tally.add(&decoded);
    }
    let mut reader = Reader::new(&payload[at..]);
    let dp_rank = if fields >= 3 {
        match reader.lax().ok()? {
            Lax::Item(Item::Nil) => None,
            Lax::Item(Item::UInt(value)) if value <= U32_MAX => Some(value as u32),
            _ => return None,
        }
    } else {
        None
    };
    if fields > 3 || !reader.is_empty() {
        return None; // extra batch fields are counted on a generic decoding: the exact path
    }
    Some(tally.batch(ts, dp_rank, events))
}

/// The error for a payload nested deeper than [`MAX_DEPTH`], if it is: inside an event when the
/// batch and its events are arrays and the nesting lies in an event.
fn nesting_error(payload: &[u8]) -> Option<SchemaError> {
    let path = too_deep(payload)?;
    let text = format!("nesting deeper than {MAX_DEPTH} levels");
    Some(match path.as_slice() {
        [(1, false), (index, false), ..] => SchemaError {
            event_index: Some(*index),
            field: None,
            message: format!("event {index}: {text}"),
        },
        _ => batch_error(text),
    })
}

fn decode_batch<'a>(payload: &'a [u8], arena: &mut Arena) -> Result<Batch<'a>, SchemaError> {
    let mut reader = Reader::new(payload);
    let fields = match reader.lax().map_err(malformed_batch)? {
        Lax::Item(Item::Array(len)) => len,
        other => return Err(batch_error(expected("array", &other))),
    };
    if fields < 2 {
        return Err(batch_error(format!(
            "Expected `array` of at least length 2, got {fields}"
        )));
    }
    let ts = match reader.lax().map_err(malformed_batch)? {
        Lax::Item(Item::Float(value)) => value,
        Lax::Item(Item::UInt(value)) => value as f64,
        Lax::Item(Item::NegInt(value)) => value as f64,
        other => {
            return Err(batch_error(format!(
                "{} - at `$[0]`",
                expected("float", &other)
            )))
        }
    };
    let count = match reader.lax().map_err(malformed_batch)? {
        Lax::Item(Item::Array(len)) => len,
        other => {
            return Err(batch_error(format!(
                "{} - at `$[1]`",
                expected("array", &other)
            )))
        }
    };
    // Events are framed first (structure only), then decoded one by one, as decode_batch does.
    let mut raws = Vec::with_capacity(count.min(reader.left()));
    for _ in 0..count {
        raws.push(reader.raw_lax(2).map_err(malformed_batch)?);
    }
    let mut dp_rank = None;
    if fields >= 3 {
        let bound = |text: String| SchemaError {
            event_index: None,
            field: Some("data_parallel_rank".to_string()),
            message: format!("batch: field 'data_parallel_rank': {text}"),
        };
        dp_rank = match reader.lax().map_err(malformed_batch)? {
            Lax::Item(Item::Nil) => None,
            Lax::Item(Item::UInt(value)) if value <= U32_MAX => Some(value as u32),
            Lax::Item(Item::UInt(_)) => return Err(bound(format!("Expected `int` <= {U32_MAX}"))),
            Lax::Item(Item::NegInt(_)) => return Err(bound("Expected `int` >= 0".to_string())),
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
        reader.skip_lax(1).map_err(malformed_batch)?;
    }
    if !reader.is_empty() {
        return Err(malformed_batch("trailing characters"));
    }
    if extra_batch_fields > 0 {
        // decode_batch counts unknown batch fields on a generic decoding of the whole payload.
        generic(&mut Reader::new(payload), &mut Vec::new(), 0).map_err(|error| {
            malformed_batch(match error {
                GenericError::Malformed(text) | GenericError::Timestamp { text, .. } => text,
            })
        })?;
    }
    let mut events = Vec::with_capacity(count);
    let mut tally = Tally::new(extra_batch_fields as u64);
    for (index, raw) in raws.into_iter().enumerate() {
        let (decoded, _) = decode_event(index, raw, arena, &mut events)?;
        tally.add(&decoded);
    }
    Ok(tally.batch(ts, dp_rank, events))
}

/// What a batch's events add up to, for the unknown fields decode_batch reports.
struct Tally {
    arrays: bool,
    maps: bool,
    /// Whether decode_batch's strict one-pass decoding would accept every event so far.
    fast: bool,
    unknown: u64,
}

impl Tally {
    /// Before the events: `extra_batch_fields` unknown positions of the batch itself (which
    /// the strict pass refuses).
    fn new(extra_batch_fields: u64) -> Self {
        Tally {
            arrays: false,
            maps: false,
            fast: extra_batch_fields == 0,
            unknown: extra_batch_fields,
        }
    }

    fn add(&mut self, decoded: &Decoded) {
        self.arrays |= decoded.array;
        self.maps |= !decoded.array;
        self.fast &= decoded.fast;
        self.unknown += decoded.unknown;
    }

    /// The batch of `events`. decode_batch first tries one strict pass per era; a batch it
    /// accepts there counts nothing unknown, not even nil array positions past the array era.
    fn batch<'a>(&self, ts: f64, dp_rank: Option<u32>, events: Vec<Event<'a>>) -> Batch<'a> {
        let one_era_strict = self.fast && !(self.arrays && self.maps);
        Batch {
            ts,
            dp_rank,
            events,
            unknown_fields: if one_era_strict { 0 } else { self.unknown },
        }
    }
}

struct Decoded {
    tag: &'static str,
    array: bool,
    unknown: u64,
    /// Whether decode_batch's strict one-pass decoding would accept the event as it is.
    fast: bool,
}

/// Events are enclosed by the batch and its events list.
const EVENT_DEPTH: usize = 2;

/// Decodes the event `raw` starts with (bytes may follow it) onto `events`; returns what it
/// was and its length.
fn decode_event<'a>(
    index: usize,
    raw: &'a [u8],
    arena: &mut Arena,
    events: &mut Vec<Event<'a>>,
) -> Result<(Decoded, usize), SchemaError> {
    // The event is built in its place: it is large, and moving it costs.
    events.push(Event::Stored(Stored::default()));
    let Some(Event::Stored(stored)) = events.last_mut() else {
        unreachable!("just pushed");
    };
    let mut reader = Reader::new(raw);
    let input = EventInput {
        index,
        raw,
        reader: &mut reader,
        arena,
        stored,
    };
    let decoded = if let Some(len) = input.reader.fixmap_header() {
        input.map(len)
    } else {
        match input
            .reader
            .lax()
            .map_err(|error| malformed_event(index, error))?
        {
            Lax::Item(Item::Array(len)) => input.array(len),
            Lax::Item(Item::Map(len)) => input.map(len),
            other => Err(event_error(index, "event", expected("object", &other))),
        }
    }?;
    let slot = events.last_mut().expect("just pushed");
    match decoded.tag {
        STORED => {}
        REMOVED => {
            let Event::Stored(stored) = slot else {
                unreachable!("built as a store");
            };
            let removed = Removed {
                hashes: stored.hashes.clone(),
                medium: stored.medium,
                group_idx: stored.group_idx,
                locality: stored.locality,
                ownership: stored.ownership,
            };
            *slot = Event::Removed(removed);
        }
        _ => *slot = Event::Cleared,
    }
    Ok((decoded, reader.position()))
}

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
struct Fields {
    names: &'static [&'static str],
    positions: &'static [usize],
    required: usize,
    known: usize,
}

const ALL_STORED: [usize; 15] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];

fn fields_of(tag: &str) -> Fields {
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
struct EventInput<'a, 'r> {
    index: usize,
    raw: &'a [u8],
    reader: &'r mut Reader<'a>,
    arena: &'r mut Arena,
    stored: &'r mut Stored<'a>,
}

impl<'a> EventInput<'a, '_> {
    /// An array event of `len` items: the tag, then the fields by position.
    fn array(self, len: usize) -> Result<Decoded, SchemaError> {
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
    fn map(self, len: usize) -> Result<Decoded, SchemaError> {
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

fn hash(at: &At<'_>, item: Lax<'_>, what: &str) -> Result<u64, SchemaError> {
    match item {
        Lax::Item(Item::UInt(value)) => Ok(value),
        Lax::Item(Item::NegInt(value)) => Ok(value as u64),
        Lax::Item(Item::Bin(bytes)) => Ok(crate::hashing::engine_hash_bytes(bytes)),
        other => Err(at.error(expected(what, &other))),
    }
}

fn hash_list(
    at: &At<'_>,
    item: Lax<'_>,
    reader: &mut Reader<'_>,
    arena: &mut Arena,
) -> Result<Range<usize>, SchemaError> {
    let Lax::Item(Item::Array(len)) = item else {
        return Err(at.error(expected("array", &item)));
    };
    let start = arena.hashes.len();
    arena.hashes.reserve(len.min(reader.left()));
    let mut element = 0;
    while element < len {
        element += reader.hashes(len - element, &mut arena.hashes);
        if element == len {
            break;
        }
        let item = reader
            .lax()
            .map_err(|error| malformed_event(at.event, error))?;
        arena
            .hashes
            .push(hash(&at.at(element), item, "int | bytes")?);
        element += 1;
    }
    Ok(start..arena.hashes.len())
}

fn token(at: &At<'_>, item: Lax<'_>) -> Result<u32, SchemaError> {
    match item {
        Lax::Item(Item::UInt(value)) if value <= U32_MAX => Ok(value as u32),
        Lax::Item(Item::UInt(_)) => Err(at.error(format!("Expected `int` <= {U32_MAX}"))),
        Lax::Item(Item::NegInt(_)) => Err(at.error("Expected `int` >= 0")),
        other => Err(at.error(expected("int", &other))),
    }
}

/// A token list's range in the arena, and its items' msgpack if every one was in its shortest
/// form (see [`Stored::token_msgpack`]).
fn token_list<'a>(
    at: &At<'_>,
    item: Lax<'_>,
    reader: &mut Reader<'a>,
    arena: &mut Arena,
) -> Result<(Range<usize>, Option<&'a [u8]>), SchemaError> {
    let Lax::Item(Item::Array(len)) = item else {
        return Err(at.error(expected("array", &item)));
    };
    let start = arena.tokens.len();
    let items_start = reader.position();
    let mut element = 0;
    let mut shortest = true;
    while element < len {
        let read = reader.small_uints(len - element, &mut arena.tokens);
        element += read.count;
        shortest &= read.shortest;
        if element == len {
            break;
        }
        let item = reader
            .lax()
            .map_err(|error| malformed_event(at.event, error))?;
        arena.tokens.push(token(&at.at(element), item)?);
        // An item the fast read left may be in any integer form.
        shortest = false;
        element += 1;
    }
    let msgpack = shortest.then(|| reader.since(items_start));
    Ok((start..arena.tokens.len(), msgpack))
}

/// A field declared as a non-negative 32-bit int (`nullable`: or nil).
fn u32_field(at: &At<'_>, item: Lax<'_>, nullable: bool) -> Result<Option<u32>, SchemaError> {
    match item {
        Lax::Item(Item::Nil) if nullable => Ok(None),
        Lax::Item(Item::UInt(value)) if value <= U32_MAX => Ok(Some(value as u32)),
        Lax::Item(Item::UInt(_)) => Err(at.error(format!("Expected `int` <= {U32_MAX}"))),
        Lax::Item(Item::NegInt(_)) => Err(at.error("Expected `int` >= 0")),
        other => Err(at.error(expected(
            if nullable { "int | null" } else { "int" },
            &other,
        ))),
    }
}

fn opt_int(at: &At<'_>, item: Lax<'_>) -> Result<Option<i128>, SchemaError> {
    match item {
        Lax::Item(Item::Nil) => Ok(None),
        Lax::Item(Item::UInt(value)) => Ok(Some(i128::from(value))),
        Lax::Item(Item::NegInt(value)) => Ok(Some(i128::from(value))),
        other => Err(at.error(expected("int | null", &other))),
    }
}

fn opt_str<'a>(at: &At<'_>, item: Lax<'a>) -> Result<Option<&'a str>, SchemaError> {
    match item {
        Lax::Item(Item::Nil) => Ok(None),
        Lax::Str(_) => match item.str() {
            Some(Ok(value)) => Ok(Some(value)),
            _ => Err(malformed_event(at.event, ReadError::Utf8)),
        },
        other => Err(at.error(expected("str | null", &other))),
    }
}

/// `list[list[Any] | None] | None`: checked as msgspec decodes it, kept as msgpack.
fn extra_keys<'a>(
    at: &At<'_>,
    item: Lax<'_>,
    header: usize,
    reader: &mut Reader<'a>,
) -> Result<Option<&'a [u8]>, SchemaError> {
    let mut path = Vec::new();
    nested_list(at, item, header, reader, true, |inner, reader| {
        // Keys are `Any`: generic values, errors located below the key.
        generic(reader, &mut path, EVENT_DEPTH + 3)
            .map(|_| ())
            .map_err(|error| inner.generic_error(error))
    })
}

/// `list[list[TokenId]] | None`, checked and kept as msgpack.
fn lookahead<'a>(
    at: &At<'_>,
    item: Lax<'_>,
    header: usize,
    reader: &mut Reader<'a>,
) -> Result<Option<&'a [u8]>, SchemaError> {
    nested_list(at, item, header, reader, false, |inner, reader| {
        let item = reader
            .lax()
            .map_err(|error| malformed_event(inner.event, error))?;
        token(inner, item).map(|_| ())
    })
}

/// A `list[list[T]] | None` whose inner lists may be nil if `nullable`: each inner item is
/// read by `check`, given where it lies; the whole list is kept as msgpack.
fn nested_list<'a>(
    at: &At<'_>,
    item: Lax<'_>,
    header: usize,
    reader: &mut Reader<'a>,
    nullable: bool,
    mut check: impl FnMut(&At<'_>, &mut Reader<'a>) -> Result<(), SchemaError>,
) -> Result<Option<&'a [u8]>, SchemaError> {
    let len = match item {
        Lax::Item(Item::Nil) => return Ok(None),
        Lax::Item(Item::Array(len)) => len,
        other => return Err(at.error(expected("array | null", &other))),
    };
    for element in 0..len {
        let inner = at.at(element);
        match reader
            .lax()
            .map_err(|error| malformed_event(at.event, error))?
        {
            Lax::Item(Item::Nil) if nullable => {}
            Lax::Item(Item::Array(items)) => {
                for position in 0..items {
                    check(&inner.at(position), reader)?;
                }
            }
            other => {
                let wanted = if nullable { "array | null" } else { "array" };
                return Err(inner.error(expected(wanted, &other)));
            }
        }
    }
    Ok(Some(reader.since(header)))
}

/// The payloads vLLM writes, decoded with nothing but fast paths: `None` for anything else
/// (another shape, or a problem), which the general decoder then reads. What this accepts, it
/// decodes to the batch the general decoder would: every event's tag comes first and its
/// fields follow in layout order, no field is unknown, and every value is of the plain kind.
mod fast {
    use super::*;

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
                            super::extra_keys(&at, item, header, reader).ok()?
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
                            super::lookahead(&at, item, header, reader).ok()?
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
        if let Some(medium) = (0..MEDIA.len()).find(|&index| reader.consume(&MEDIA_FIXSTRS[index]))
        {
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
}

/// One step of the path msgspec reports below a generic value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    Index(usize),
    /// A map's value (`[...]` in msgspec's paths).
    Value,
    /// Inside a map's key.
    Key,
}

/// Why a generic decoding fails: malformed input (msgspec's `DecodeError`), or a timestamp
/// extension that is no datetime (its `ValidationError`, with the path to it).
#[derive(Debug)]
enum GenericError {
    Malformed(&'static str),
    Timestamp {
        text: &'static str,
        path: Vec<Segment>,
    },
}

/// Checks one value as msgspec decodes a value of type `Any` (`msgspec.msgpack.decode`):
/// strings must be UTF-8, a timestamp extension (type -1) a valid datetime, and map keys
/// hashable (arrays of hashable items, scalars, but no map and no other extension). Returns
/// whether the value would be hashable. `depth` containers enclose it.
fn generic(
    reader: &mut Reader<'_>,
    path: &mut Vec<Segment>,
    depth: usize,
) -> Result<bool, GenericError> {
    let malformed = |error: ReadError| {
        GenericError::Malformed(match error {
            ReadError::Truncated => "Input data was truncated",
            ReadError::BadMarker(_) => "invalid opcode",
            ReadError::Utf8 => "invalid utf-8",
            ReadError::TooDeep => "nesting too deep",
        })
    };
    let item = reader.lax().map_err(malformed)?;
    if depth >= MAX_DEPTH && matches!(item, Lax::Item(Item::Array(_) | Item::Map(_))) {
        return Err(malformed(ReadError::TooDeep));
    }
    Ok(match item {
        Lax::Str(bytes) => {
            std::str::from_utf8(bytes).map_err(|_| malformed(ReadError::Utf8))?;
            true
        }
        Lax::Item(Item::Ext(-1, data)) => {
            if let Err(text) = timestamp(data) {
                return Err(GenericError::Timestamp {
                    text,
                    path: path.clone(),
                });
            }
            true
        }
        Lax::Item(Item::Ext(..)) => false,
        Lax::Item(Item::Array(len)) => {
            let mut hashable = true;
            for index in 0..len {
                path.push(Segment::Index(index));
                hashable &= generic(reader, path, depth + 1)?;
                path.pop();
            }
            hashable
        }
        Lax::Item(Item::Map(len)) => {
            for _ in 0..len {
                path.push(Segment::Key);
                let hashable = generic(reader, path, depth + 1)?;
                path.pop();
                path.push(Segment::Value);
                generic(reader, path, depth + 1)?;
                path.pop();
                if !hashable {
                    return Err(GenericError::Malformed("map keys must be hashable"));
                }
            }
            false
        }
        Lax::Item(_) => true,
    })
}

/// Whether a msgpack timestamp's data is a datetime msgspec can make: 4, 8 or 12 bytes,
/// nanoseconds below a second, and within years 1 to 9999 once rounded to microseconds.
fn timestamp(data: &[u8]) -> Result<(), &'static str> {
    const MIN: i64 = -62_135_596_800;
    const MAX: i64 = 253_402_300_800;
    let word = |bytes: &[u8]| bytes.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
    let (seconds, nanos) = match data.len() {
        4 => (word(data) as i64, 0),
        8 => {
            let value = word(data);
            ((value & 0x3_ffff_ffff) as i64, value >> 34)
        }
        12 => (word(&data[4..]) as i64, word(&data[..4])),
        _ => return Err("Invalid MessagePack timestamp"),
    };
    if nanos > 999_999_999 {
        return Err("Invalid MessagePack timestamp: nanoseconds out of range");
    }
    if !(MIN..=MAX).contains(&seconds) {
        return Err("Timestamp is out of range");
    }
    let carry = i64::from((nanos + 500) / 1000 == 1_000_000);
    if seconds + carry >= MAX {
        return Err("Timestamp is out of range");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str = "93cb0000000000000000";

    fn payload(hex: &str) -> Vec<u8> {
        let digits: Vec<u8> = hex.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
        digits
            .chunks(2)
            .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
            .collect()
    }

    fn error_at(hex: &str) -> (Option<usize>, Option<String>) {
        let bytes = payload(hex);
        let error = decode(&bytes, &mut Arena::default()).unwrap_err();
        (error.event_index, error.field)
    }

    #[test]
    fn nesting_fails_inside_its_event_before_anything_else() {
        let deep = format!("93c3 92c0 {} c0 c0", "91".repeat(63));
        assert_eq!(error_at(&deep), (Some(1), None));
        let at_limit = format!("{HEAD} 91 {} c0 c0", "91".repeat(62));
        assert_eq!(error_at(&at_limit), (Some(0), Some("type".into())));
        let in_rank = format!("{HEAD} 90 {} c0", "91".repeat(64));
        assert_eq!(error_at(&in_rank), (None, None));
    }

    #[test]
    fn the_first_problem_in_wire_order_wins() {
        // block_hashes is a str (a type error, its bytes unchecked), then medium is not UTF-8.
        let hashes_first = format!(
            "{HEAD} 91 83 a474797065 ac426c6f636b52656d6f766564 \
             ac626c6f636b5f686173686573 a1ff a66d656469756d a1ff c0"
        );
        assert_eq!(
            error_at(&hashes_first),
            (Some(0), Some("block_hashes".into()))
        );
        let medium_first = format!(
            "{HEAD} 91 83 a474797065 ac426c6f636b52656d6f766564 \
             a66d656469756d a1ff ac626c6f636b5f686173686573 a178 c0"
        );
        assert_eq!(error_at(&medium_first), (Some(0), None));
    }

    #[test]
    fn unknown_fields_are_read_generically() {
        let cleared = "b0416c6c426c6f636b73436c6561726564";
        // An unknown array position that is not UTF-8, an unhashable key in one.
        assert_eq!(
            error_at(&format!("{HEAD} 91 92 {cleared} a1ff c0")),
            (Some(0), None)
        );
        let unhashable = format!("{HEAD} 91 92 {cleared} 81 8101 01 01 c0");
        assert_eq!(error_at(&unhashable), (Some(0), None));
        // Unknown map keys count once each.
        let twice = payload(&format!(
            "{HEAD} 91 83 a474797065 {cleared} a178 01 a178 02 c0"
        ));
        assert_eq!(
            decode(&twice, &mut Arena::default())
                .unwrap()
                .unknown_fields,
            1
        );
    }

    #[test]
    fn timestamps_follow_msgspec() {
        assert!(timestamp(&[0, 0, 0, 1]).is_ok());
        assert!(timestamp(&[0]).is_err());
        let mut last = [0u8; 12];
        last[4..].copy_from_slice(&253_402_300_799i64.to_be_bytes());
        assert!(timestamp(&last).is_ok());
        // 999999500 ns round up to the next second: year 10000.
        last[..4].copy_from_slice(&999_999_500u32.to_be_bytes());
        assert!(timestamp(&last).is_err());
    }
}
