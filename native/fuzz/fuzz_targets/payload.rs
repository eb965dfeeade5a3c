//! Arbitrary bytes as a vLLM payload: to `kvbridge_core::decode`, then to a few normalizers
//! (block sizes 1, 4 and 16) that live for the whole run, so that their state (ranks, tiers,
//! placeholders, retired blocks, contexts) accumulates across inputs the way a worker's does.
//! Now and then a normalizer resets a rank or every rank, and every output is encoded both ways.
//!
//! Nothing may panic, and the relay's canonical payloads must decode again.

#![no_main]

use std::cell::RefCell;

use kvbridge_core::decode::Event;
use kvbridge_core::normalize::Limits;
use kvbridge_core::{decode, Arena, Normalizer, Output, MAIN_ATTENTION_KINDS};
use libfuzzer_sys::fuzz_target;

/// (block size, evicted hashes retained, caps on ranks, live blocks and contexts) of each
/// normalizer: small caps on the first two, so that their evictions run often.
const NORMALIZERS: [(usize, usize, [usize; 3]); 3] = [
    (1, 0, [2, 64, 3]),
    (4, 64, [8, 4096, 64]),
    (16, 4096, [1024, 4_000_000, 65_536]),
];

/// A normalizer whose state outgrows this starts afresh (libFuzzer's RSS limit is 2 GB).
const HEAP_LIMIT: usize = 64 << 20;

/// Inputs after which every normalizer starts afresh anyway, so that a long run also covers
/// young state.
const GENERATION: u64 = 250_000;

struct State {
    normalizers: Vec<Normalizer>,
    arena: Arena,
    runs: u64,
}

impl State {
    fn new() -> Self {
        State {
            normalizers: (0..NORMALIZERS.len()).map(fresh).collect(),
            arena: Arena::default(),
            runs: 0,
        }
    }

    fn run(&mut self, data: &[u8]) {
        self.runs += 1;
        check_decode(data, &mut self.arena);
        let mix = fnv(data);
        let runs = self.runs;
        for (index, normalizer) in self.normalizers.iter_mut().enumerate() {
            if runs.is_multiple_of(GENERATION) || normalizer.heap_bytes() > HEAP_LIMIT {
                *normalizer = fresh(index);
            }
            // The input's hash picks the options, so that a crashing input tends to crash again.
            let pick = mix.rotate_left(index as u32 * 8);
            let seq = (pick & 1 == 0).then_some(runs);
            let reset_first = pick % 29 == 3;
            if let Ok(output) = normalizer.normalize(data, seq, reset_first) {
                encode(normalizer, &output);
            }
            match pick % 53 {
                0 => {
                    let output = normalizer.reset(None);
                    encode(normalizer, &output);
                }
                1 => {
                    let rank = normalizer.dp_ranks().first().copied().unwrap_or(0);
                    let output = normalizer.reset(Some(rank));
                    encode(normalizer, &output);
                }
                2 => {
                    let output = normalizer.reset(Some((pick >> 32) as u32));
                    encode(normalizer, &output);
                }
                _ => {}
            }
        }
    }
}

fn fresh(index: usize) -> Normalizer {
    let (block_size, retain, [max_ranks, max_blocks, max_contexts]) = NORMALIZERS[index];
    let limits = Limits {
        max_ranks,
        max_blocks,
        max_contexts,
    };
    Normalizer::new(
        index as u64 + 1,
        block_size,
        retain,
        &MAIN_ATTENTION_KINDS,
        limits,
    )
}

/// Decodes, and reads every range the batch hands out.
fn check_decode(data: &[u8], arena: &mut Arena) {
    let Ok(batch) = decode(data, arena) else {
        return;
    };
    for event in &batch.events {
        match event {
            Event::Stored(stored) => {
                let _ = &arena.hashes[stored.hashes.clone()];
                let _ = &arena.tokens[stored.tokens.clone()];
            }
            Event::Removed(removed) => {
                let _ = &arena.hashes[removed.hashes.clone()];
            }
            Event::Cleared => {}
        }
    }
}

/// Both encodings of an output; the canonical payloads are vLLM payloads and must decode,
/// alone and merged (the output twice): merged without a bound they hold every event of the
/// two but a clear that collapses where they meet, and bounded to 0 bytes exactly every one;
/// `Output::canonical_size` bounds the bytes alone.
fn encode(normalizer: &Normalizer, output: &Output) {
    let ts = output.batch.map_or(0.0, |(ts, _)| ts);
    let block_size = normalizer.block_size as u64;
    let events = |payloads: &[Vec<u8>]| {
        let mut arena = Arena::default();
        let mut count = 0;
        for payload in payloads {
            match decode(payload, &mut arena) {
                Ok(batch) => count += batch.events.len(),
                Err(error) => {
                    panic!("a canonical payload does not decode: {error}: {payload:02x?}")
                }
            }
        }
        count
    };
    let payloads = output.canonical_payloads(block_size, ts);
    let written: usize = payloads.iter().map(Vec::len).sum();
    assert!(
        written <= output.canonical_size(),
        "{written} bytes, over canonical_size"
    );
    let alone = events(&payloads);
    let twice = [(output, ts), (output, ts)];
    let merged = events(&kvbridge_core::canonical_payloads(
        &twice,
        block_size,
        usize::MAX,
    ));
    assert!(
        merged <= 2 * alone && merged + 1 >= 2 * alone,
        "{merged} events from 2 x {alone}"
    );
    let apart = events(&kvbridge_core::canonical_payloads(&twice, block_size, 0));
    assert_eq!(apart, 2 * alone);
    let _ = output.tiered_events(normalizer.worker_id);
}

/// FNV-1a of the input's first and last bytes and its length: cheap, and stable per input.
fn fnv(data: &[u8]) -> u64 {
    let head = &data[..data.len().min(64)];
    let tail = &data[data.len().saturating_sub(64)..];
    let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ data.len() as u64;
    for byte in head.iter().chain(tail) {
        hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::new());
}

fuzz_target!(|data: &[u8]| {
    STATE.with_borrow_mut(|state| state.run(data));
});
