"""A flood of bad input writes a bounded number of short log lines; the counts stay exact."""

from __future__ import annotations

import io
import json

import structlog

from kvbridge.adapters.logs import DEFAULT_BURST, LogLimiter, cut
from kvbridge.adapters.pipeline import StreamPipeline
from kvbridge.adapters.source import Message, Source
from kvbridge.adapters.stream_stats import BadFrame


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_writes_its_burst_per_period_then_says_how_many_it_held_back() -> None:
    lines: list[tuple[str, dict[str, object]]] = []
    clock = Clock()
    limiter = LogLimiter(lambda event, **fields: lines.append((event, fields)), clock=clock)
    written = [limiter("bad frame", "tcp://a", seq=seq) for seq in range(100)]
    assert written == [True] * DEFAULT_BURST + [False] * (100 - DEFAULT_BURST)
    assert limiter("bad frame", "tcp://b", seq=0)  # another stream has its own lines
    clock.now = 60.0
    assert limiter("bad frame", "tcp://a", seq=100)
    assert lines[-1] == ("bad frame", {"seq": 100, "held_back": 95})
    assert len(lines) == DEFAULT_BURST + 2
    assert limiter.held == 95


def test_values_are_cut() -> None:
    assert cut("x" * 10) == "x" * 10
    assert cut("x" * 1000) == "x" * 200 + "... (800 more characters)"
    assert cut(10**30) == 10**30


def test_100k_garbage_frames_write_few_short_lines_and_count_all() -> None:
    out = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.WriteLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    try:
        pipeline = StreamPipeline(4)
        source = Source("tcp://127.0.0.1:1", worker_id=1)
        huge = b"\x93\xcb" + bytes(8) + b"\x91\x81\xa4type\xdb" + (10 << 20).to_bytes(4, "big")
        frames = [b"\xc1", huge + b"T" * (10 << 20) + b"\xc0"]
        for seq in range(100_000):
            pipeline.feed(Message(source, seq, b"", frames[seq < 3], 0))
    finally:
        structlog.reset_defaults()
    lines = out.getvalue().splitlines()
    assert pipeline.stats.bad_frames[BadFrame.SCHEMA] == 100_000
    assert len(lines) == DEFAULT_BURST
    assert max(len(line) for line in lines) < 2048
    assert all(json.loads(line)["event"] == "bad frame skipped" for line in lines)
