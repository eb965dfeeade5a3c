//! The values of an event's fields, each read as `decode_batch`'s types declare it: engine
//! hashes, token ids, bounded ints, strings, and the nested lists kept as msgpack.

use std::ops::Range;

use super::error::{expected, malformed_event, At, SchemaError};
use super::generic::generic;
use super::{Arena, EVENT_DEPTH};
use crate::layout::U32_MAX;
use crate::msgpack::{Item, Lax, ReadError, Reader};

pub(super) fn hash(at: &At<'_>, item: Lax<'_>, what: &str) -> Result<u64, SchemaError> {
    match item {
        Lax::Item(Item::UInt(value)) => Ok(value),
        Lax::Item(Item::NegInt(value)) => Ok(value as u64),
        Lax::Item(Item::Bin(bytes)) => Ok(crate::hashing::engine_hash_bytes(bytes)),
        other => Err(at.error(expected(what, &other))),
    }
}

pub(super) fn hash_list(
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
pub(super) fn token_list<'a>(
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
pub(super) fn u32_field(
    at: &At<'_>,
    item: Lax<'_>,
    nullable: bool,
) -> Result<Option<u32>, SchemaError> {
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

pub(super) fn opt_int(at: &At<'_>, item: Lax<'_>) -> Result<Option<i128>, SchemaError> {
    match item {
        Lax::Item(Item::Nil) => Ok(None),
        Lax::Item(Item::UInt(value)) => Ok(Some(i128::from(value))),
        Lax::Item(Item::NegInt(value)) => Ok(Some(i128::from(value))),
        other => Err(at.error(expected("int | null", &other))),
    }
}

pub(super) fn opt_str<'a>(at: &At<'_>, item: Lax<'a>) -> Result<Option<&'a str>, SchemaError> {
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
pub(super) fn extra_keys<'a>(
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
pub(super) fn lookahead<'a>(
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
