"""``kvbridge relay``: run a :class:`~kvbridge.adapters.relay.Relay` in front of Dynamo until
stopped, the i-th ``--source`` republished on ``--publish``'s port + i (its replay on
``--publish-replay``'s port + i), as vLLM offsets dp ranks."""

from __future__ import annotations

import argparse

import structlog

from kvbridge.adapters.relay import Relay
from kvbridge.cli import live
from kvbridge.cli.sockets import check_uses, offset, source_uses

__all__ = ["run_relay"]

log = structlog.get_logger("kvbridge")


def run_relay(args: argparse.Namespace) -> int:
    """Check every socket, then relay until SIGINT, SIGTERM or ``--duration``."""
    sources = live.sources(args)
    uses = source_uses(args)
    uses += [offset("--publish", args.publish, i, "--source") for i in range(len(sources))]
    if args.publish_replay is not None:
        replay = args.publish_replay
        uses += [offset("--publish-replay", replay, i, "--source") for i in range(len(sources))]
    check_uses(args, uses)
    with (
        Relay(
            sources,
            block_size=args.block_size,
            publish=args.publish.address,
            publish_replay=args.publish_replay.address if args.publish_replay else None,
            topic=args.topic,
            buffer_steps=args.buffer_steps,
            buffer_bytes=args.buffer_bytes,
            replay_on_start=True,
            merge_bytes=args.merge_bytes,
            output_hwm=args.output_hwm,
            **live.stream_options(args),
        ) as relay,
        live.metrics_served(args, relay),
    ):
        for source, output in relay.outputs.items():
            publish, replay = relay.endpoints(source)
            log.info(
                "relaying",
                worker_id=source.worker_id,
                source=source.endpoint,
                publish=publish,
                publish_replay=replay,
                output_hwm=output.hwm,
            )
        stop = live.until(args)
        silence = live.silence(sources)
        with live.loop_failures():
            while not stop.is_set():
                relay.step(100)
                silence.check(live.delivered(relay.subscriber, sources))
    return 0
