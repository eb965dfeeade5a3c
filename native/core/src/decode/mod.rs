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
//!
//! A payload takes the first of three paths that accepts it:
//!
//! - `fast`: the shape vLLM writes, with nothing but fast paths;
//! - `decode_in_one_pass`: any valid payload, each event decoded where it lies
//!   (`event`, its fields read by `fields`);
//! - this module's `decode_batch`: the exact path, which frames every event before decoding
//!   any and so reports the error the Python `decode_batch` reports (`error`).
//!
//! Unknown fields and extra keys are checked as msgspec decodes a value of type `Any`
//! (`generic`).

mod error;
mod event;
mod fast;
mod fields;
mod generic;

use std::ops::Range;

use crate::layout::{REMOVED, STORED, U32_MAX};
use crate::msgpack::{too_deep, Item, Lax, Reader, MAX_DEPTH};

pub use error::SchemaError;
use error::{batch_error, event_error, expected, malformed_batch, malformed_event};
use event::EventInput;
use generic::{generic, GenericError};

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
    /// Engine hashes as u64 (an int as it is, a bytes hash by [`crate::hashing::engine_hash_bytes`]).
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
}
