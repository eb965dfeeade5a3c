//! What a store's `extra_keys` hold for its hashes: multimodal object hashes, and the cache
//! salt.

use crate::decode::Stored;
use crate::hashing::{identifier_hash, DYNAMO_SALT_PREFIX};
use crate::msgpack::{Item, Reader};

/// Each block's extra keys, as msgpack, from the event's `extra_keys` list (`None` for nil).
pub(super) fn block_keys(raw: &[u8]) -> Vec<Option<&[u8]>> {
    items(raw)
        .map(|keys| (keys != [0xc0]).then_some(keys))
        .collect()
}

/// A 64-hex-digit multimodal digest: vLLM up to 0.18 puts it bare into the extra keys.
fn is_digest(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|byte| byte.is_ascii_hexdigit())
}

fn digest_hash(key: &str) -> u64 {
    u64::from_str_radix(&key[..16], 16).unwrap_or(0)
}

/// The multimodal object hashes among one block's extra keys, as Dynamo derives them: a hex
/// digest by its first 16 hex digits, any other identifier by its XXH3-64. A key is an
/// `(identifier, offset)` pair from vLLM 0.19, a bare digest before.
pub(super) fn mm_hashes(keys: &[u8], out: &mut Vec<u64>) {
    for key in items(keys) {
        let mut reader = Reader::new(key);
        match reader.item() {
            Ok(Item::Str(key)) if is_digest(key) => out.push(digest_hash(key)),
            Ok(Item::Array(len)) if len > 0 => {
                if let Ok(Item::Str(id)) = reader.item() {
                    out.push(if is_digest(id) {
                        digest_hash(id)
                    } else {
                        identifier_hash(id)
                    });
                }
            }
            _ => {}
        }
    }
}

/// The msgpack of each item of a msgpack array (checked by the decoder); none for other values.
fn items(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut reader = Reader::new(raw);
    let len = match reader.item() {
        Ok(Item::Array(len)) => len,
        _ => 0,
    };
    (0..len).map_while(move |_| reader.raw(2).ok())
}

/// The msgpack of the first item of a msgpack array (checked by the decoder).
fn first_item(raw: &[u8]) -> Option<&[u8]> {
    let mut reader = Reader::new(raw);
    match reader.item() {
        Ok(Item::Array(len)) if len > 0 => reader.raw(2).ok(),
        _ => None,
    }
}

/// The cache salt in the first block's extra keys: the first string that is neither a digest
/// nor the LoRA name. Dynamo's own `dynamo-cache-salt:` prefix is removed.
pub(super) fn cache_salt<'a>(stored: &Stored<'a>) -> Option<&'a str> {
    let first = first_item(stored.extra_keys?).filter(|keys| *keys != [0xc0])?;
    let mut lora_seen = stored.lora_name.is_none();
    for key in items(first) {
        let Ok(Item::Str(key)) = Reader::new(key).item() else {
            continue;
        };
        if is_digest(key) {
            continue;
        }
        if !lora_seen && Some(key) == stored.lora_name {
            lora_seen = true;
            continue;
        }
        let salt = key.strip_prefix(DYNAMO_SALT_PREFIX).unwrap_or(key);
        return (!salt.is_empty()).then_some(salt);
    }
    None
}
