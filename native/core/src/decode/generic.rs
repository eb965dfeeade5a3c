//! A value checked as msgspec decodes a value of type `Any`: what `decode_batch` does to the
//! fields no release declares and to the keys of `extra_keys`.

use crate::msgpack::{Item, Lax, ReadError, Reader, MAX_DEPTH};

/// One step of the path msgspec reports below a generic value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Segment {
    Index(usize),
    /// A map's value (`[...]` in msgspec's paths).
    Value,
    /// Inside a map's key.
    Key,
}

/// Why a generic decoding fails: malformed input (msgspec's `DecodeError`), or a timestamp
/// extension that is no datetime (its `ValidationError`, with the path to it).
#[derive(Debug)]
pub(super) enum GenericError {
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
pub(super) fn generic(
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
