//! Writers that produce the smallest encoding of each value, as msgspec does.

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
        let word = (u64::from(marker) << (8 * (width - 1)) | u64::from(value)) << (64 - 8 * width);
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
