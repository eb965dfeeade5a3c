"""Differential fuzzing of the two payload decoders: ``kvbridge.schemas.decode_batch`` (msgspec)
and the Rust core's ``kvbridge._core.decode_view``.

    .venv/bin/python tools/fuzz_decoders.py --count 1000000 [--seed 0] [--show 10]

Runs every fixture payload, every payload frame of the golden captures, then ``--count``
payloads of :func:`kvbridge.testing.corpus.payload_corpus` through both decoders and compares
their outcomes: the same batch (ts, dp rank, unknown fields, every event's fields), or the same
error (batch or event level, event index and field; messages may differ). Prints the number of
agreements by outcome, the disagreements by outcome pair, and the first disagreements with
their payloads in hex. Exits 1 if the decoders disagree on any payload.

``tests/test_decode_differential.py`` imports the comparison from here.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvbridge import _core
from kvbridge.normalizers.hashing import engine_hash_u64
from kvbridge.schemas import SchemaError, decode_batch
from kvbridge.schemas.vllm import REMOVED_FIELDS, STORED_FIELDS

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

Outcome = tuple[Any, ...]
"""``("ok", ts, dp_rank, unknown_fields, events)`` or ``("error", event_index, field)``, or
``("raised", type, message)`` for anything but the decoder's own error."""

_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
_HASH_LISTS = frozenset({"block_hashes"})
_HASHES = frozenset({"parent_block_hash"})
_RAW = frozenset({"extra_keys", "lookahead_token_ids"})
"""Fields the core hands over as their msgpack: compared after decoding and re-encoding."""

_encode = msgspec.msgpack.Encoder().encode
_generic = msgspec.msgpack.Decoder()


def _ts(value: float) -> bytes:
    """A float by its bits: NaN equals NaN, -0.0 differs from 0.0."""
    return struct.pack(">d", value)


def _canonical(value: Any) -> Any:
    """A decoded value as bytes (NaNs inside included), or None."""
    return None if value is None else _encode(value)


def _event(tag: str, fields: Iterable[Any], *, raw: bool) -> tuple[Any, ...]:
    """One event as ``(tag, field values...)``, converted the same way for both decoders.
    ``raw``: the core's form, whose extra keys and lookahead tokens are msgpack bytes."""
    out: list[Any] = [tag]
    for name, value in zip(_FIELDS[tag], fields, strict=True):
        if name in _HASH_LISTS:
            value = tuple(engine_hash_u64(item) for item in value)
        elif name in _HASHES:
            value = None if value is None else engine_hash_u64(value)
        elif name == "token_ids":
            value = tuple(value)
        elif name in _RAW:
            value = _canonical(_generic.decode(value) if raw and value is not None else value)
        out.append(value)
    return tuple(out)


def python_outcome(payload: bytes) -> Outcome:
    """What ``decode_batch`` makes of a payload."""
    try:
        batch = decode_batch(payload)
    except SchemaError as error:
        return ("error", error.event_index, error.field)
    except Exception as error:  # a bug: decode_batch raises SchemaError only
        return ("raised", type(error).__name__, str(error)[:200])
    events = []
    for event in batch.events:
        tag = str(type(event).__struct_config__.tag)
        fields = msgspec.structs.astuple(event)[: len(_FIELDS[tag])]
        events.append(_event(tag, fields, raw=False))
    return ("ok", _ts(batch.ts), batch.data_parallel_rank, batch.unknown_fields, tuple(events))


def core_outcome(payload: bytes) -> Outcome:
    """What the Rust core's decoder makes of a payload."""
    try:
        ts, rank, unknown, events = _core.decode_view(payload)
    except _core.PayloadError as error:
        _, event_index, field = error.args
        return ("error", event_index, field)
    except BaseException as error:  # a panic (pyo3's PanicException) or worse
        if isinstance(error, KeyboardInterrupt):
            raise
        return ("raised", type(error).__name__, str(error)[:200])
    return (
        "ok",
        _ts(ts),
        rank,
        unknown,
        tuple(_event(str(event[0]), event[1:], raw=True) for event in events),
    )


def kind(outcome: Outcome) -> str:
    """A coarse name of an outcome, for counting."""
    if outcome[0] == "ok":
        return "ok, unknown fields" if outcome[3] else "ok"
    if outcome[0] == "error":
        return "batch error" if outcome[1] is None else "event error"
    return f"raised {outcome[1]}"


def compare(payload: bytes) -> tuple[Outcome, Outcome]:
    """Both decoders' outcomes (python, core); they agree if the two are equal."""
    return python_outcome(payload), core_outcome(payload)


_POSITION = re.compile(r"^\[(\d+)\](.*)$")


def _array_events(payload: bytes) -> list[msgspec.Raw]:
    """The raw events of an array batch, or none if it does not frame."""
    try:
        batch = msgspec.msgpack.decode(payload, type=list[msgspec.Raw])
        return msgspec.msgpack.decode(batch[1], type=list[msgspec.Raw]) if len(batch) > 1 else []
    except (msgspec.DecodeError, RecursionError, TypeError):
        return []


def fixture_payloads() -> Iterator[tuple[str, bytes]]:
    """(name, payload) of every payload fixture and every payload frame of the golden
    captures."""
    from kvbridge.adapters.capture import CaptureReader

    for directory in ("layouts", "releases"):
        for path in sorted((FIXTURES / directory).glob("*.msgpack")):
            yield f"{directory}/{path.name}", path.read_bytes()
    for path in sorted((FIXTURES / "vllm-0.32.0").glob("*.kvcap")):
        for index, record in enumerate(CaptureReader(path)):
            if record.frames:
                yield f"{path.name}#{index}", bytes(record.frames[-1])


def describe(payload: bytes, python: Outcome, core: Outcome, limit: int = 600) -> str:
    """A disagreement, for a report."""
    text = payload.hex()
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(payload)} bytes)"

    def show(outcome: Outcome) -> str:
        if outcome[0] != "ok":
            return repr(outcome)
        _, ts, rank, unknown, events = outcome
        return repr(("ok", struct.unpack(">d", ts)[0], rank, unknown, events))[:limit]

    return f"  payload {text}\n    decode_batch: {show(python)}\n    core:         {show(core)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="corpus payloads to run")
    parser.add_argument("--seed", type=int, default=0, help="the corpus seed")
    parser.add_argument("--show", type=int, default=10, help="disagreements to print")
    args = parser.parse_args(argv)

    from kvbridge.testing.corpus import labelled_corpus

    def sources() -> Iterator[tuple[str, bytes]]:
        for _, payload in fixture_payloads():
            yield "fixture", payload
        yield from labelled_corpus(args.seed, args.count)

    agreed: Counter[str] = Counter()
    disagreed: Counter[tuple[str, str]] = Counter()
    by_kind: Counter[str] = Counter()
    shown: list[str] = []
    start = time.perf_counter()
    total = 0
    for label, payload in sources():
        total += 1
        python, core = compare(payload)
        if python == core:
            agreed[kind(python)] += 1
            continue
        disagreed[kind(python), kind(core)] += 1
        by_kind[label] += 1
        if len(shown) < args.show:
            shown.append(f"[{label}]\n{describe(payload, python, core)}")
    elapsed = time.perf_counter() - start

    print(f"{total} payloads ({args.count} of corpus seed {args.seed}) in {elapsed:.1f} s")
    print(f"agree: {sum(agreed.values())}")
    for name, count in agreed.most_common():
        print(f"  {name}: {count}")
    print(f"disagree: {sum(disagreed.values())}")
    for (python_kind, core_kind), count in disagreed.most_common():
        print(f"  decode_batch {python_kind} / core {core_kind}: {count}")
    for label, count in by_kind.most_common():
        print(f"  corpus kind {label}: {count}")
    if shown:
        print(f"first {len(shown)} disagreements:")
        print("\n".join(shown))
    return 1 if disagreed else 0


if __name__ == "__main__":
    sys.exit(main())
