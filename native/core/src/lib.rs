//! kvbridge's core: vLLM KV-event payloads of every release in, canonical Dynamo events out.
//!
//! [`decode()`] reads a payload's msgpack without copying its strings, [`Normalizer`] keeps one
//! worker's state (canonical hashes, reference counts per dp rank and tier, placeholders,
//! retired blocks, drop counters) and [`Output`] writes the result as bytes. No input can make
//! any of it panic: every malformed payload is a [`SchemaError`].

pub mod decode;
pub mod hashing;
pub mod layout;
pub mod media;
pub mod msgpack;
pub mod normalize;
pub mod output;
pub mod state;
pub mod tiered;

pub use decode::{decode, Arena, Batch, Event, SchemaError};
pub use media::Tier;
pub use normalize::{
    Action, Counters, DropReason, FirstDrop, Limits, Normalizer, MAIN_ATTENTION_KINDS,
};
pub use output::{canonical_payloads, Body, OutEvent, Output, Store};
