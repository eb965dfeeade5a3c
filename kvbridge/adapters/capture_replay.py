"""Publishing a capture's frames again, byte for byte: each recorded stream on a PUB socket of
its own, at the recorded pace or as fast as the sockets take them (``kvbridge replay``), and the
order of receipt over several streams that both this and ``validate --compare-dynamo`` follow."""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, Literal

import msgspec
import structlog

from kvbridge.adapters.capture import FrameRecord
from kvbridge.adapters.publisher import Publisher

__all__ = ["LONG_WAIT_S", "StreamReplay", "in_receipt_order", "replay_capture", "replay_streams"]

log = structlog.get_logger("kvbridge.capture")


class StreamReplay(msgspec.Struct):
    """What :func:`replay_streams` did with one stream."""

    endpoint: str
    """The endpoint it was published on, as given."""
    sent: int = 0
    resets: int = 0
    """Reset records passed over: a publisher has no reset to send (a subscriber of the replay
    finds its own discontinuities, as the recorder's did)."""
    subscribed: bool = False
    """Whether a subscriber was connected before the first message went out."""


def replay_streams(
    streams: Sequence[tuple[str, Sequence[FrameRecord]]],
    *,
    bind: bool | None = None,
    pace: Literal["original", "max"] = "original",
    wait_subscribers: float = 5.0,
    stop: threading.Event | None = None,
    no_subscriber: Callable[[str], None] | None = None,
) -> list[StreamReplay]:
    """Publish each stream's frames on a PUB socket of its own, byte for byte (its reset
    records are counted, not sent: :attr:`StreamReplay.resets`).

    ``streams`` are ``(endpoint, records)`` pairs. Each endpoint follows vLLM's bind/connect rule
    unless ``bind`` says otherwise, so a subscriber configured for the recorded engine works
    unchanged. The messages of all streams go out in the order of their receive times (each
    stream's own order kept): ``pace="original"`` keeps the recorded gaps between them, ``"max"``
    sends as fast as the sockets take them. Waits up to ``wait_subscribers`` seconds in all for a
    first subscriber on every socket, since a PUB socket drops what it sends before anyone
    listens; ``no_subscriber`` is called with the endpoint of each that has none when the wait
    ends (unless ``stop`` ended it), before anything is sent: a replay at the recorded pace may
    take hours to finish.
    """
    messages = [[record for record in records if record.reset is None] for _, records in streams]
    results = [
        StreamReplay(endpoint, resets=len(records) - len(sent))
        for (endpoint, records), sent in zip(streams, messages, strict=True)
    ]
    with contextlib.ExitStack() as sockets:
        publishers = [
            sockets.enter_context(Publisher(endpoint, bind=bind)) for endpoint, _ in streams
        ]
        deadline = time.monotonic() + wait_subscribers
        for publisher, result in zip(publishers, results, strict=True):
            result.subscribed = wait_subscribers > 0 and _wait_for_subscriber(
                publisher, deadline, stop
            )
        stopped = stop is not None and stop.is_set()  # a wait cut short says nothing
        if no_subscriber is not None and wait_subscribers > 0 and not stopped:
            for result in results:
                if not result.subscribed:
                    no_subscriber(result.endpoint)
        ordered = in_receipt_order(messages)
        start = time.monotonic()
        first_ns = min((stream[0].received_ns for stream in messages if stream), default=0)
        for index, record in ordered:
            if stop is not None and stop.is_set():
                break
            if pace == "original":
                delay = (record.received_ns - first_ns) / 1e9 - (time.monotonic() - start)
                if delay > LONG_WAIT_S:
                    log.warning(
                        "long wait: the capture's receive times are this far apart",
                        seconds=round(delay, 1),
                        stream=streams[index][0],
                        sent=results[index].sent,
                    )
                if delay > 0 and stop is not None:
                    if stop.wait(delay):
                        break  # stopped while waiting: the message is not sent
                elif delay > 0:
                    time.sleep(delay)
            publishers[index].send_frames(record.frames)
            results[index].sent += 1
        time.sleep(0.1)  # let ZMQ flush before the sockets close (linger is 0)
    return results


LONG_WAIT_S: Final = 60.0
"""A wait between two messages of an original-paced replay longer than this is logged before it
starts: a capture's receive time that is far off (a damaged record) would otherwise stall the
replay silently."""

_STOP_CHECK_S: Final = 0.1
"""How often a wait for subscribers looks at the stop event: a signal ends it this fast."""


def _wait_for_subscriber(
    publisher: Publisher, deadline: float, stop: threading.Event | None
) -> bool:
    """Wait until ``deadline`` for one subscriber, in short slices so that ``stop`` ends it."""
    while stop is None or not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if publisher.wait_for_subscribers(timeout=min(_STOP_CHECK_S, remaining)):
            return True
    return False


def in_receipt_order(
    streams: Sequence[Iterable[FrameRecord]],
) -> Iterator[tuple[int, FrameRecord]]:
    """``(stream index, record)`` over all streams, merged by receive time; each stream keeps
    its own order, and a tie goes to the earlier stream."""
    tagged = [_tagged(index, records) for index, records in enumerate(streams)]
    for _, index, record in heapq.merge(*tagged, key=lambda item: item[0]):
        yield index, record


def _tagged(index: int, records: Iterable[FrameRecord]) -> Iterator[tuple[int, int, FrameRecord]]:
    return ((record.received_ns, index, record) for record in records)


def replay_capture(
    records: Sequence[FrameRecord],
    endpoint: str,
    *,
    pace: Literal["original", "max"] = "original",
    wait_subscribers: float = 5.0,
    stop: threading.Event | None = None,
    bind: bool | None = None,
) -> int:
    """Publish the captured frames on one PUB socket, byte for byte, in capture order (every
    stream merged: see :func:`replay_streams` to keep them apart).

    ``endpoint`` follows vLLM's bind/connect rule unless ``bind`` says otherwise.
    ``pace="original"`` keeps the recorded gaps between messages; ``"max"`` sends as fast as the
    socket takes them. Waits up to ``wait_subscribers`` seconds for a first subscriber, since a
    PUB socket drops what it sends before anyone listens. Returns the number of messages sent.
    """
    (result,) = replay_streams(
        [(endpoint, records)], bind=bind, pace=pace, wait_subscribers=wait_subscribers, stop=stop
    )
    return result.sent
