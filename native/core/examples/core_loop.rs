//! The core's hot path in a loop, without Python: for `benchmarks/core_instructions.py`, which
//! counts its instructions under cachegrind, and for timing it alone.
//!
//! `core_loop MODE FILE REPEAT`: MODE is `decode` (the decoder alone), `state` (decode and
//! normalize), `canonical` (both, and the relay's canonical payloads) or `tiered` (both, and
//! the msgpack of the `TieredEvent`s); FILE holds the block
//! size (u32, little-endian), then each payload as its length (u32) and bytes. Every repetition
//! starts from a fresh normalizer; the best repetition's time is printed.

use std::time::Instant;

use kvbridge_core::{decode, Arena, Limits, Normalizer, MAIN_ATTENTION_KINDS};

fn read_u32(data: &[u8], at: usize) -> Result<u32, String> {
    data.get(at..at + 4)
        .and_then(|bytes| bytes.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| format!("truncated at byte {at}"))
}

fn load(path: &str) -> Result<(usize, Vec<Vec<u8>>), String> {
    let data = std::fs::read(path).map_err(|error| format!("{path}: {error}"))?;
    let block_size = read_u32(&data, 0)? as usize;
    let mut payloads = Vec::new();
    let mut at = 4;
    while at < data.len() {
        let len = read_u32(&data, at)? as usize;
        let payload = data
            .get(at + 4..at + 4 + len)
            .ok_or_else(|| format!("truncated payload at byte {at}"))?;
        payloads.push(payload.to_vec());
        at += 4 + len;
    }
    Ok((block_size, payloads))
}

/// One pass over the payloads; returns a figure of the output so that nothing is optimized out.
fn run(mode: &str, block_size: usize, payloads: &[Vec<u8>]) -> Result<usize, String> {
    let mut sink = 0;
    if mode == "decode" {
        let mut arena = Arena::default();
        for payload in payloads {
            let batch = decode(payload, &mut arena).map_err(|error| error.to_string())?;
            sink += batch.events.len();
        }
        return Ok(sink);
    }
    let (canonical, tiered) = match mode {
        "state" => (false, false),
        "canonical" => (true, false),
        "tiered" => (false, true),
        other => {
            return Err(format!(
                "unknown mode {other:?}: decode, state, canonical or tiered"
            ))
        }
    };
    let mut normalizer = Normalizer::new(
        1,
        block_size,
        100_000,
        &MAIN_ATTENTION_KINDS,
        Limits::default(),
    );
    for (seq, payload) in payloads.iter().enumerate() {
        let output = normalizer
            .normalize(payload, Some(seq as u64), false)
            .map_err(|error| error.to_string())?;
        sink += output.events.len();
        if canonical {
            for bytes in output.canonical_payloads(block_size as u64, 1.0) {
                sink += bytes.len();
            }
        }
        if tiered {
            sink += output.tiered_events(1).len();
        }
    }
    Ok(sink)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, mode, path, repeat] = args.as_slice() else {
        return Err("usage: core_loop decode|state|canonical|tiered FILE REPEAT".into());
    };
    let repeat: usize = repeat
        .parse()
        .map_err(|_| format!("REPEAT must be a whole number, got {repeat:?}"))?;
    let (block_size, payloads) = load(path)?;
    let mut best = f64::INFINITY;
    let mut sink = 0;
    for _ in 0..repeat {
        let start = Instant::now();
        sink = run(mode, block_size, &payloads)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!("{mode} best {best:.6} s (output figure {sink})");
    Ok(())
}
