"""``kvbridge validate --compare-dynamo``: a real Dynamo fed each raw capture against one fed
through kvbridge, on loopback sockets, with the numbers asserted exactly.

The golden captures (``tests/fixtures/vllm-0.32.0``, recorded from vLLM 0.32) carry no prompts
in their headers; their manifests (the ``.json`` beside each) list the prompts that made the
traffic, as token ids, and every full block of them is in the capture's stores. The tests pass
those prompts in, as ``validate --prompts MANIFEST`` does.

Where Dynamo alone is right (prefix reuse, evictions, a reset, self-describing CPU events, two
engines whose hashes agree), the comparison finds nothing. It finds every block of the bytes
capture missing, every placeholder CPU block missing, and the second engine's extensions
missing when two engines hash the same tokens differently (``xxhash-a`` and ``xxhash-b``: vLLM
seeds xxhash per process). The ``two-engines`` pair is recorded with sha256, whose seed vLLM
0.29+ fixes, so their shared prompt has the same hashes on both and Dynamo alone is right.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvbridge.adapters.capture import CaptureReader, CaptureWriter, Prompt, read_prompts
from kvbridge.adapters.dynamo_compare import (
    Cause,
    DynamoComparison,
    ResidentDiff,
    compare_captures,
)
from kvbridge.adapters.dynamo_compare.recorded import load_streams
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.source import Source, StreamReset
from kvbridge.cli.validation import Report
from kvbridge.schemas.vllm import BlockRemoved, BlockStored, VllmBatch, encode_batch, layout_for
from kvbridge.testing import SimulatedEngine

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "vllm-0.32.0"
SAMPLE = ROOT / "kvbridge" / "data" / "sample.kvcap"
LAYOUT = layout_for("0.32.0")

Blocks = list[tuple[int, int, str, int, int, dict[str, int], dict[str, int]]]
"""``(worker, dp, tier, alone, bridged, missing by cause, stale by cause)`` per resident entry."""
Overlaps = list[tuple[str, list[tuple[int, tuple[int, int, int], tuple[int, int, int]]]]]
"""``(prompt, [(worker, alone (device, host, disk), bridged (...))])`` of the prompts that
differ."""


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def blocks(comparison: DynamoComparison) -> Blocks:
    return [
        (r.worker_id, r.dp_rank, r.tier, r.alone, r.bridged, r.missing, r.stale)
        for r in comparison.resident
    ]


def differing(comparison: DynamoComparison) -> Overlaps:
    def counts(overlap: object) -> tuple[int, int, int]:
        return msgspec.structs.astuple(overlap)  # type: ignore[return-value, arg-type]

    return [
        (p.prompt, [(w.worker_id, counts(w.alone), counts(w.bridged)) for w in p.workers])
        for p in comparison.prompts
        if p.differs
    ]


def golden(*names: str, prompts_of: tuple[str, ...] | None = None) -> DynamoComparison:
    """Compare golden captures together, asking the prompts of their manifests."""
    prompts = [p for name in prompts_of or names for p in read_prompts(GOLDEN / f"{name}.json")]
    return compare_captures([GOLDEN / f"{name}.kvcap" for name in names], prompts=prompts)


# --------------------------------------------------------------------------- the golden captures


def test_golden_prompts_are_the_captured_traffic() -> None:
    """Every full block of every manifest prompt was stored by the engine: the prompts the
    comparison asks about are the ones the capture was made of."""
    for manifest in sorted(GOLDEN.glob("*.json")):
        size = msgspec.json.decode(manifest.read_bytes())["block_size"]
        stored = set()
        for record in CaptureReader(manifest.with_suffix(".kvcap")):
            for event in msgspec.msgpack.decode(record.frames[2])[1]:
                tokens = event.get("token_ids") or []
                stored |= {tuple(tokens[i : i + size]) for i in range(0, len(tokens), size)}
        for prompt in read_prompts(manifest):
            tokens = prompt.token_ids
            full = [tuple(tokens[i : i + size]) for i in range(0, len(tokens) // size * size, size)]
            assert set(full) <= stored, (manifest.name, prompt.name)


@pytest.mark.parametrize(
    ("names", "resident", "prompts"),
    [
        (("prefix",), [(0, 0, "device", 25, 25, {}, {})], 9),
        (("evict",), [(0, 0, "device", 59, 59, {}, {})], 28),
        (("reset",), [(0, 0, "device", 2, 2, {}, {})], 5),
        (
            ("offload-selfdesc",),
            [(0, 0, "device", 62, 62, {}, {}), (0, 0, "host_pinned", 32, 32, {}, {})],
            90,
        ),
        (
            ("two-engines-a", "two-engines-b"),
            [(1, 0, "device", 20, 20, {}, {}), (2, 0, "device", 20, 20, {}, {})],
            12,
        ),
    ],
)
def test_where_dynamo_alone_is_right_there_is_no_difference(
    names: tuple[str, ...], resident: Blocks, prompts: int
) -> None:
    comparison = golden(*names)
    assert blocks(comparison) == resident
    assert (comparison.differs, comparison.missing, comparison.stale) == (False, 0, 0)
    assert comparison.causes == {}
    assert len(comparison.prompts) == prompts
    assert differing(comparison) == []


def test_bytes_hashes_dynamo_drops_every_batch() -> None:
    comparison = golden("bytes")
    assert blocks(comparison) == [(0, 0, "device", 0, 25, {Cause.BYTES_HASHES: 25}, {})]
    assert (comparison.missing, comparison.stale, comparison.causes) == (
        25,
        0,
        {"bytes_hashes": 25},
    )
    # The prefix prompts: Dynamo alone matches none of them.
    assert differing(comparison) == [
        (str(i), [(0, (0, 0, 0), (n, n, n))]) for i, n in enumerate([3, 4, 4, 4, 5, 5, 5, 5, 7])
    ]


def test_placeholder_cpu_events_dynamo_drops_the_cpu_tier() -> None:
    comparison = golden("offload")
    assert blocks(comparison) == [
        (0, 0, "device", 62, 62, {}, {}),
        (0, 0, "host_pinned", 0, 32, {Cause.PLACEHOLDER: 32}, {}),
    ]
    assert (comparison.missing, comparison.stale) == (32, 0)
    assert comparison.causes == {"placeholder_cpu_event": 32}
    # The prompts GPU pressure evicted to the CPU: only kvbridge's side sees them there.
    assert differing(comparison) == [
        ("5", [(0, (0, 0, 0), (0, 6, 6))]),
        ("6", [(0, (0, 0, 0), (0, 8, 8))]),
        ("7", [(0, (0, 0, 0), (0, 8, 8))]),
    ]
    assert len(comparison.prompts) == 90


def test_two_engines_with_different_seeds_dynamo_keeps_the_first_writers_hashes() -> None:
    comparison = golden("xxhash-a", "xxhash-b", prompts_of=("xxhash-a",))
    assert blocks(comparison) == [
        (1, 0, "device", 8, 8, {}, {}),
        (2, 0, "device", 3, 8, {Cause.SECOND_ENGINE: 5}, {}),
    ]
    assert (comparison.missing, comparison.stale) == (5, 0)
    assert comparison.causes == {"second_engine_hashes": 5}
    assert differing(comparison) == [
        ("1", [(1, (4, 4, 4), (4, 4, 4)), (2, (2, 2, 2), (4, 4, 4))]),
        ("2", [(1, (5, 5, 5), (5, 5, 5)), (2, (2, 2, 2), (5, 5, 5))]),
    ]


# --------------------------------------------------------------------------- the other causes


def _write(
    path: Path,
    batches: list[list[BlockStored | BlockRemoved]],
    *,
    worker_id: int = 0,
    ranks: tuple[int, ...] = (0,),
    **meta: object,
) -> None:
    """A capture of ``worker_id``, one stream per dp rank, each with every batch (one per list
    of events)."""
    with CaptureWriter(path, meta=dict(meta)) as writer:
        for rank in ranks:
            for seq, events in enumerate(batches):
                payload = encode_batch(VllmBatch(1.0 + seq, list(events), rank), LAYOUT)
                frames = [b"", seq.to_bytes(8, "big"), payload]
                stream = f"tcp://w{worker_id}-{rank}"
                writer.write(frames, stream=stream, worker_id=worker_id, received_ns=seq)


def _bytes(value: int) -> bytes:
    return bytes(24) + value.to_bytes(8, "big")


def test_each_cause_is_named_per_tier(tmp_path: Path) -> None:
    """A lower-case medium, a re-announced chunk removed once, a raw cache salt and a removal in
    a batch with bytes hashes, each on the blocks it concerns."""
    tokens = list(range(1, 13))
    capture = tmp_path / "causes.kvcap"
    cpu_chunk = BlockStored([3], 2, tokens[8:], 4, None, "CPU", None)
    _write(
        capture,
        [
            [BlockStored([1, 2, 3], None, tokens, 4, None, "GPU", None)],
            [BlockStored([1, 2], None, tokens[:8], 4, None, "cpu", None)],  # Mooncake's spelling
            [cpu_chunk, cpu_chunk],  # re-announced
            [BlockRemoved([3], "CPU")],  # one copy of two left
            [
                BlockStored(
                    [10, 11], None, list(range(100, 108)), 4, None, "GPU", None, [["t"], None]
                )
            ],
            [BlockRemoved([_bytes(3)], "GPU")],  # the whole batch rejected by Dynamo
        ],
        block_size=4,
        prompts=[
            {"name": "chain", "token_ids": tokens},
            {"name": "salted", "token_ids": list(range(100, 108)), "cache_salt": "t"},
            {"name": "unsalted", "token_ids": list(range(100, 108))},
        ],
    )
    comparison = compare_captures([capture])
    assert blocks(comparison) == [
        (0, 0, "device", 5, 4, {Cause.RAW_CACHE_SALT: 2}, {"bytes_hashes": 1, "raw_cache_salt": 2}),
        (0, 0, "host_pinned", 0, 3, {"re_announced_chunk": 1, "unknown_case_medium": 2}, {}),
    ]
    assert (comparison.missing, comparison.stale) == (5, 3)
    assert comparison.causes == {
        "bytes_hashes": 1,
        "raw_cache_salt": 4,
        "re_announced_chunk": 1,
        "unknown_case_medium": 2,
    }
    # The header's prompts: the chain is on the GPU 2 blocks deep and on the CPU 3 (Dynamo alone:
    # 3 on the GPU, which evicted one); the salted blocks exist only salted.
    assert differing(comparison) == [
        ("chain", [(0, (3, 3, 3), (2, 3, 3))]),
        ("salted", [(0, (0, 0, 0), (2, 2, 2))]),
        ("unsalted", [(0, (2, 2, 2), (0, 0, 0))]),
    ]


def test_a_second_engines_removals_leave_stale_blocks(tmp_path: Path) -> None:
    """Worker 2 stores worker 1's content under its own hashes, then evicts it: Dynamo looks its
    hashes up, finds nothing, and keeps the blocks."""
    tokens = list(range(1, 9))
    a, b = tmp_path / "a.kvcap", tmp_path / "b.kvcap"
    _write(a, [[BlockStored([1, 2], None, tokens, 4, None, "GPU", None)]], block_size=4)
    _write(
        b,
        [[BlockStored([7, 8], None, tokens, 4, None, "GPU", None)], [BlockRemoved([8], "GPU")]],
        worker_id=2,
        block_size=4,
    )
    comparison = compare_captures([a, b], prompts=[Prompt("p", tokens)])
    assert blocks(comparison) == [
        (0, 0, "device", 2, 2, {}, {}),
        (2, 0, "device", 2, 1, {}, {Cause.SECOND_ENGINE: 1}),
    ]
    assert differing(comparison) == [("p", [(0, (2, 2, 2), (2, 2, 2)), (2, (2, 2, 2), (1, 1, 1))])]


def test_each_dp_rank_of_a_worker_is_its_own_stream(tmp_path: Path) -> None:
    """A worker with two dp ranks, each rank's engine publishing a CPU placeholder: one worker
    registered with both endpoints, the blocks compared per rank."""
    capture = tmp_path / "dp.kvcap"
    _write(
        capture,
        [
            [BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)],
            [BlockStored([2], None, [], 0, None, "CPU", None, group_idx=0)],
        ],
        worker_id=5,
        ranks=(0, 1),
        block_size=4,
    )
    comparison = compare_captures([capture], prompts=[Prompt("p", list(range(8)))])
    assert blocks(comparison) == [
        (5, 0, "device", 2, 2, {}, {}),
        (5, 0, "host_pinned", 0, 1, {"placeholder_cpu_event": 1}, {}),
        (5, 1, "device", 2, 2, {}, {}),
        (5, 1, "host_pinned", 0, 1, {"placeholder_cpu_event": 1}, {}),
    ]
    assert differing(comparison) == []  # the GPU holds the whole prompt on both ranks


def test_batches_recovered_by_replay_go_back_in_sequence(tmp_path: Path) -> None:
    """The recorder received seq 5 live, then 2-4 through the replay socket: sent in that order,
    Dynamo would drop 2-4 (it ignores a seq it has passed); a listener with a replay endpoint
    would have fetched them, so they go back among the live batches."""
    capture = tmp_path / "replayed.kvcap"
    with CaptureWriter(capture, meta={"block_size": 4}) as writer:
        for received, seq in enumerate([0, 1, 5, 2, 3, 4, 6]):
            store = BlockStored([100 + seq], None, [seq] * 4, 4, None, "GPU", None)
            payload = encode_batch(VllmBatch(1.0, [store], 0), LAYOUT)
            stream = ("replay:" if 2 <= seq <= 4 else "") + "tcp://w0"
            writer.write(
                [b"", seq.to_bytes(8, "big"), payload], stream=stream, received_ns=received
            )
    comparison = compare_captures([capture])
    assert blocks(comparison) == [(0, 0, "device", 7, 7, {}, {})]


def test_a_restart_reset_starts_the_engine_order_anew_and_a_repair_is_sent_once(
    tmp_path: Path,
) -> None:
    """An engine restarts while recorded: the new process's first batches come through the
    replay socket after the ``restart`` reset, then a repair delivers its batches again.
    Ordered by seq alone, the new process's batches 0-1 would go between the old one's; the
    reset starts a run of their own (and is kept, to clear the worker through kvbridge), each
    batch of a run is sent once, and the repair's reset is left out."""
    capture = tmp_path / "restarted.kvcap"
    endpoint = "tcp://w0"
    received = [
        ("old", 0, False), ("old", 1, False), ("old", 2, False), "restart",
        ("new", 0, True), ("new", 1, True), ("new", 2, False), "repair",
        ("new", 0, True), ("new", 1, True), ("new", 2, True), ("new", 3, False),
    ]  # fmt: skip
    with CaptureWriter(capture, meta={"block_size": 4}) as writer:
        for item in received:
            if isinstance(item, str):
                writer.write_reset(StreamReset(Source(endpoint, worker_id=0), item))
                continue
            process, seq, replayed = item
            writer.write(
                [b"", seq.to_bytes(8, "big"), f"{process}{seq}".encode()],
                stream=("replay:" if replayed else "") + endpoint,
            )
    (stream,), _ = load_streams([str(capture)], 4, None)
    sent = [record.reset.reason if record.reset else record.frames[2] for record in stream.records]
    assert sent == [
        b"old0", b"old1", b"old2", "restart", b"new0", b"new1", b"new2", b"new3"
    ]  # fmt: skip


@pytest.mark.parametrize("recorded_reset", [True, False], ids=["reset record", "seq back"])
@pytest.mark.parametrize("new_seqs", [[0, 1, 2], [0, 1, 2, 3, 4]], ids=["below", "past"])
def test_a_restarted_engine_is_cleared_bridged_and_ignored_alone(
    tmp_path: Path, recorded_reset: bool, new_seqs: list[int]
) -> None:
    """An engine stores one block a batch, seqs 0-3, and restarts: the new process stores one
    a batch again from seq 0. Through kvbridge the restart clears the worker (the capture's
    ``restart`` record, or in a capture without resets the live seq going back). Dynamo alone
    keeps the old process's 4 blocks (stale) and ignores the new process's batches until its
    seq passes 3 (missing): a batch at seq 4 is applied on both sides. A new process whose
    last seq is below the old one's still gets its sentinel seen (sent past the old last)."""
    capture = tmp_path / "restart.kvcap"
    endpoint = "tcp://w0"

    def batch(seq: int, token: int) -> list[bytes]:
        store = BlockStored([100 + token], None, [token] * 4, 4, None, "GPU", None)
        return [b"", seq.to_bytes(8, "big"), encode_batch(VllmBatch(1.0, [store], 0), LAYOUT)]

    with CaptureWriter(capture, meta={"block_size": 4}) as writer:
        for seq in range(4):
            writer.write(batch(seq, seq), stream=endpoint)
        if recorded_reset:
            writer.write_reset(StreamReset(Source(endpoint, worker_id=0), "restart"))
        for seq in new_seqs:
            writer.write(batch(seq, 10 + seq), stream=endpoint)
    comparison = compare_captures([capture])
    passed = [seq for seq in new_seqs if seq > 3]
    ignored = len(new_seqs) - len(passed)
    assert blocks(comparison) == [
        (
            0,
            0,
            "device",
            4 + len(passed),
            len(new_seqs),
            {"engine_restart": ignored},
            {"engine_restart": 4},
        )
    ]
    assert comparison.causes == {"engine_restart": ignored + 4}


def test_a_restart_recorded_last_still_clears_the_worker_bridged(tmp_path: Path) -> None:
    """The recording stops right after the engine restarted: the new process sent nothing.
    Through kvbridge the worker is cleared at the restart, as the relay clears it; Dynamo
    alone keeps the old process's 3 blocks."""
    capture = tmp_path / "restart-last.kvcap"
    endpoint = "tcp://w0"
    with CaptureWriter(capture, meta={"block_size": 4}) as writer:
        for seq in range(3):
            store = BlockStored([100 + seq], None, [seq] * 4, 4, None, "GPU", None)
            payload = encode_batch(VllmBatch(1.0, [store], 0), LAYOUT)
            writer.write([b"", seq.to_bytes(8, "big"), payload], stream=endpoint)
        writer.write_reset(StreamReset(Source(endpoint, worker_id=0), "restart"))
    comparison = compare_captures([capture])
    assert blocks(comparison) == [(0, 0, "device", 3, 0, {}, {"engine_restart": 3})]


def test_a_worker_in_two_captures_is_refused() -> None:
    with pytest.raises(ValueError, match="worker 0 is in both"):
        compare_captures([GOLDEN / "prefix.kvcap", GOLDEN / "evict.kvcap"])


# --------------------------------------------------------------------------- the command


def test_cli_exit_codes_and_text() -> None:
    offload = str(GOLDEN / "offload.kvcap")
    result = kvbridge("validate", "--compare-dynamo", offload)
    assert result.returncode == 0, result.stderr  # valid: a difference is not invalid data
    lines = result.stdout.splitlines()
    assert lines[0] == "valid: 42 frames, 275 events, 0 invalid frames in 1 capture(s)"
    assert lines[1:] == [
        "Dynamo alone vs through kvbridge: DIFFERS (32 missing, 0 stale in 1 capture(s))",
        "  worker 0 dp 0 device: alone 62, bridged 62",
        "  worker 0 dp 0 host_pinned: alone 0, bridged 32; missing 32 (placeholder_cpu_event 32)",
    ]
    assert (
        kvbridge("validate", "--compare-dynamo", "--fail-on-dynamo-diff", offload).returncode == 1
    )
    same = kvbridge(
        "validate", "--compare-dynamo", "--fail-on-dynamo-diff", str(GOLDEN / "reset.kvcap")
    )
    assert same.returncode == 0, same.stdout + same.stderr


def test_cli_json_follows_its_schema_and_takes_a_manifests_prompts() -> None:
    result = kvbridge(
        "validate", "--compare-dynamo", "--format", "json",
        "--prompts", str(GOLDEN / "bytes.json"), str(GOLDEN / "bytes.kvcap"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = msgspec.json.decode(result.stdout, type=Report)
    assert report.valid
    assert report.dynamo is not None
    assert report.dynamo.resident == [
        ResidentDiff(0, 0, "device", alone=0, bridged=25, missing={"bytes_hashes": 25}, stale={})
    ]
    assert [len(p.workers) for p in report.dynamo.prompts] == [1] * 9
    schema = msgspec.json.decode(kvbridge("validate", "--json-schema").stdout)
    definitions = schema["$defs"]
    assert definitions["Report"]["properties"]["dynamo"]["anyOf"][0] == {
        "$ref": "#/$defs/DynamoComparison"
    }
    assert definitions["DynamoComparison"]["required"] == [
        "captures", "differs", "missing", "stale", "causes", "resident",
    ]  # fmt: skip
    assert set(definitions) >= {"ResidentDiff", "PromptOverlap", "WorkerOverlap", "TierCounts"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "p.json"], "--prompts goes with --compare-dynamo"),
        (["--fail-on-dynamo-diff"], "--fail-on-dynamo-diff goes with --compare-dynamo"),
    ],
)
def test_cli_flags_that_need_compare_dynamo(args: list[str], message: str) -> None:
    result = kvbridge("validate", *args, str(SAMPLE))
    assert (result.returncode, result.stderr) == (2, f"kvbridge validate: error: {message}\n")


def test_cli_two_captures_of_one_worker_is_one_line() -> None:
    result = kvbridge(
        "validate", "--compare-dynamo", str(GOLDEN / "prefix.kvcap"), str(GOLDEN / "evict.kvcap")
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"kvbridge validate: error: worker 0 is in both {GOLDEN / 'prefix.kvcap'} and "
        f"{GOLDEN / 'evict.kvcap'}: captures compared together are one fleet, so compare these "
        "in separate runs"
    )


def test_record_keeps_prompts_in_the_header_for_the_comparison(tmp_path: Path) -> None:
    """``record --prompts``: the sample replayed into the recorder; the new capture's header
    has the prompts as token ids, and ``validate --compare-dynamo`` asks them of both sides."""
    prompts = tmp_path / "prompts.json"
    prompts.write_bytes(msgspec.json.encode(CaptureReader(SAMPLE).meta["prompts"]))
    port = free_port_range(2)
    out = tmp_path / "again.kvcap"
    recorder = subprocess.Popen(
        [
            sys.executable, "-m", "kvbridge.cli", "record",
            "--source", f"bind:tcp://*:{port}", "--worker-id", "1",
            "--source", f"bind:tcp://*:{port + 1}", "--worker-id", "2",
            "--block-size", "4", "--prompts", str(prompts),
            "--out", str(out), "--count", "7", "--duration", "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        replay = kvbridge(
            "replay", str(SAMPLE), "--publish", f"tcp://127.0.0.1:{port}", "--pace", "max"
        )
        assert replay.returncode == 0, replay.stderr
    finally:
        _, err = recorder.communicate(timeout=60)
    assert recorder.returncode == 0, err
    reader = CaptureReader(out)
    assert reader.prompts == CaptureReader(SAMPLE).prompts
    assert [p.name for p in reader.prompts] == ["support-bot", "code-review", "translate"]
    comparison = compare_captures([out])
    assert [(p.prompt, p.differs) for p in comparison.prompts] == [
        ("support-bot", True),
        ("code-review", False),
        ("translate", True),
    ]
    assert comparison.causes == {
        "bytes_hashes": 5,
        "placeholder_cpu_event": 2,
    }


def test_bad_prompts_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"token_ids": [1, -2]}]')
    result = kvbridge("validate", "--compare-dynamo", "--prompts", str(bad), str(SAMPLE))
    assert result.returncode == 2
    assert result.stderr == (
        f"kvbridge validate: error: {bad}: prompt 0: Expected `int` >= 0 - at `$.token_ids[1]`\n"
    )


# --------------------------------------------------------------------------- a long capture


def test_a_10k_batch_capture_is_compared_within_30_s(tmp_path: Path) -> None:
    """10,000 batches of a simulated engine with a placeholder CPU tier: prompts sharing prefixes
    evict each other from a 256-block GPU pool into a 1024-block CPU pool."""
    rng = random.Random(14)
    prefixes = [[rng.randrange(50_000) for _ in range(64)] for _ in range(40)]
    capture = tmp_path / "long.kvcap"
    with SimulatedEngine(num_blocks=256, block_size=16, cpu_blocks=1024) as engine:
        while engine.total_published < 10_000:
            suffix = [rng.randrange(50_000) for _ in range(rng.randrange(8, 80))]
            engine.generate(rng.choice(prefixes) + suffix)
        batches = engine.published[:10_000]
        with CaptureWriter(capture, meta={"block_size": 16}) as writer:
            for seq, batch in enumerate(batches):
                frames = [b"", seq.to_bytes(8, "big"), encode_batch(batch, engine.layout)]
                writer.write(frames, stream="tcp://127.0.0.1:1", received_ns=seq)
    start = time.monotonic()
    comparison = compare_captures([capture])
    seconds = time.monotonic() - start
    print(f"10,000 batches compared in {seconds:.1f} s")
    assert seconds < 30
    assert blocks(comparison) == [
        (0, 0, "device", 255, 255, {}, {}),
        (0, 0, "host_pinned", 0, 1024, {Cause.PLACEHOLDER: 1024}, {}),
    ]


def test_readme_shows_what_the_command_prints() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- compare-dynamo-example -->\n```\n", 1)[1].split("```", 1)[0]
    command, *shown = block.splitlines()
    args = command.removeprefix("$ kvbridge ").split()
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == shown
