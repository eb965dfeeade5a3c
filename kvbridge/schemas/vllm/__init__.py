"""vLLM's KV-cache event wire format, for every release that publishes it (0.9.0 through 0.33.0).

vLLM has shipped twelve distinct layouts: positional arrays up to 0.23 (a field appended every
few releases) and tagged maps from 0.24 (defaulted fields left out). Rather than one decoder per
release, the events are typed once with every field ever shipped, and the per-release
differences live in one table, :data:`LAYOUTS`, which the decoder, the encoder, the fixtures and
the JSON Schema export all read.

Decoding is tolerant but never guesses: unknown trailing positions and unknown map keys are
ignored and counted, while an unknown event tag, a wrong type, a value out of its range, a
``BlockStored`` whose tokens cannot cover its hashes, malformed msgpack or arrays and maps nested
deeper than :data:`MAX_NESTING` raise :class:`SchemaError` (naming the event index and the field
where they are known). :func:`decode_batch` raises nothing else for any payload.

The package's modules each have one job: :mod:`~kvbridge.schemas.vllm.types` (the event types),
:mod:`~kvbridge.schemas.vllm.layouts` (the per-release table), :mod:`~kvbridge.schemas.vllm.decode`
(the entry point, over the one-pass :mod:`~kvbridge.schemas.vllm.fast_decode` and the
event-by-event :mod:`~kvbridge.schemas.vllm.event_decode`, which reads headers with
:mod:`~kvbridge.schemas.vllm.msgpack_headers`) and :mod:`~kvbridge.schemas.vllm.encode`.
"""

from kvbridge.schemas.vllm import layouts, types
from kvbridge.schemas.vllm.decode import decode_batch
from kvbridge.schemas.vllm.encode import encode_batch

# The table's and the types' names, as their own __all__ lists them.
from kvbridge.schemas.vllm.layouts import *  # noqa: F403
from kvbridge.schemas.vllm.types import *  # noqa: F403

__all__ = ["decode_batch", "encode_batch"]
__all__ += layouts.__all__
__all__ += types.__all__
