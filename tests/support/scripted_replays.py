"""Engines replaced one after another on fixed ports, whose replay endpoint is a ROUTER of the
test's own that answers requests by number: a test decides exactly which replay goes
unanswered (and so times out), whatever the timing."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import zmq

from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.replay_protocol import answer_frames, end_frames, parse_request
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import SubscriberStats
from kvbridge.adapters.subscriber import Subscriber
from support.polling import TIMEOUT, wait_until
from support.rebind import bound_again, listener_gone


class ScriptedReplays:
    """A replay ROUTER on ``base + 1`` and bare PUB engines on ``base``. Request ``n`` (counted
    from 1, in the order they come) is answered with the batches ``answers[n]``, numbered from
    the seq it asks for, and the end marker; or, if ``answers`` has no ``n``, never answered."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        base: int,
        answers: Mapping[int, Sequence[bytes]],
    ) -> None:
        self.ctx, self.base, self.answers = ctx, base, answers
        self.source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
        self.requests = 0
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{base + 1}")

        self.engines: list[Publisher] = []

    def _engine(self) -> Publisher:
        return Publisher(f"tcp://127.0.0.1:{self.base}", bind=True, context=self.ctx)

    def first_batch(
        self, subscriber: Subscriber
    ) -> tuple[list[Message | StreamReset], Callable[[], None]]:
        """Bind the first engine, which publishes its batch 0 (``b"first 0"``), until
        ``subscriber`` delivered it: what it delivered, and a step of the test's waits from
        then on (a poll onto that list, then the requests served)."""
        items: list[Message | StreamReset] = []

        def step() -> None:
            items.extend(subscriber.poll(20))
            self.serve()

        self.engines.append(self._engine())
        assert self.engines[0].wait_for_subscribers(timeout=TIMEOUT)
        self.engines[0].publish(b"first 0")
        wait_until(lambda: subscriber.stats.messages == 1, step)
        return items, step

    def replace(self, stats: SubscriberStats, step: Callable[[], object]) -> Publisher:
        """Close the engine there, call ``step`` until the subscriber of ``stats`` counts the
        drop, then bind the next engine and wait until the subscriber is connected to it."""
        drops = stats.disconnects + 1
        self.engines[-1].close()
        listener_gone(self.base)
        wait_until(lambda: stats.disconnects == drops, step)
        self.engines.append(bound_again(self._engine))
        assert self.engines[-1].wait_for_subscribers(timeout=TIMEOUT)
        return self.engines[-1]

    def serve(self) -> None:
        """Read the requests waiting, answering each as ``answers`` says."""
        while self.router.poll(0):
            request = parse_request(self.router.recv_multipart())
            assert request is not None
            identity, start = request
            self.requests += 1
            payloads = self.answers.get(self.requests)
            if payloads is None:
                continue
            for seq, payload in enumerate(payloads, start=start):
                frames = answer_frames(identity, b"", seq, payload, topic_frame=True)
                self.router.send_multipart(frames)
            self.router.send_multipart(end_frames(identity, topic_frame=True))

    def close(self) -> None:
        if self.engines:
            self.engines[-1].close()
        self.router.close()
