"""``kvbridge replay``: publish a capture's frames as the recorded engines did, one PUB socket
per recorded stream (the i-th on ``--publish``'s port + i, in the order the streams first appear
in the capture), so that a relay, ``watch`` or Dynamo itself can be run against a recording.

The log says which worker and block size each stream had, and the ``--source`` arguments that
subscribe: bind and connect must be opposite on the two sides, and a wrong pair delivers nothing
without any error, so the command spells the right one out.
"""

from __future__ import annotations

import argparse

import structlog

from kvbridge.adapters.capture import CaptureReader, capture_streams
from kvbridge.adapters.capture_replay import replay_streams
from kvbridge.adapters.endpoints import Endpoint, Mode
from kvbridge.cli import live
from kvbridge.cli.sockets import check_uses, engine_mode, offset

__all__ = ["run_replay"]

log = structlog.get_logger("kvbridge")


def run_replay(args: argparse.Namespace) -> int:
    """Publish every stream of the capture at ``--pace``, after waiting up to
    ``--wait-subscribers`` seconds for a subscriber on each."""
    reader = CaptureReader(args.capture)
    streams = capture_streams(reader)
    publish: Endpoint = args.publish
    mode = engine_mode(publish)
    uses = [offset("--publish", publish, i, "stream", mode) for i in range(len(streams))]
    check_uses(args, uses)
    block_size = reader.block_size
    plan = list(zip(uses, streams.items(), strict=True))
    subscribe: list[str] = []
    for use, (stream, records) in plan:
        worker_id = records[0].worker_id
        log.info(
            "replaying",
            stream=stream,
            worker_id=worker_id,
            block_size=block_size,
            messages=sum(1 for record in records if record.reset is None),
            publish=use.endpoint.address,
            mode=mode,
        )
        subscribe += [
            "--source",
            _subscriber_arg(use.endpoint, mode),
            "--worker-id",
            str(worker_id),
        ]
    if subscribe:
        if block_size:
            subscribe += ["--block-size", str(block_size)]
        log.info("subscribe with: " + " ".join(subscribe))
    else:
        log.warning(f"{args.capture}: the capture has no frames")
    results = replay_streams(
        [(use.address, records) for use, (_, records) in plan],
        bind=mode == "bind",
        pace=args.pace,
        wait_subscribers=args.wait_subscribers,
        stop=live.until(args),
        no_subscriber=lambda endpoint: log.warning(
            _no_subscriber(endpoint, mode, args.wait_subscribers)
        ),
    )
    sent = sum(result.sent for result in results)
    resets = sum(result.resets for result in results)  # a subscriber finds its own
    log.info(
        "replayed", capture=args.capture, messages=sent, resets=resets, publish=publish.address
    )
    return 0


def _subscriber_arg(endpoint: Endpoint, replay_mode: Mode) -> str:
    """The ``--source`` that meets ``replay``'s socket: it must do the opposite."""
    default = "connect" if endpoint.engine_binds else "bind"
    wanted = "connect" if replay_mode == "bind" else "bind"
    return endpoint.address if wanted == default else f"{wanted}:{endpoint.address}"


def _no_subscriber(endpoint: str, mode: Mode, waited: float) -> str:
    if mode == "bind":
        how = f"replay binds {endpoint}, so the subscriber must connect to it"
    else:
        how = f"replay connects to {endpoint}, so the subscriber must bind it"
    return (
        f"no subscriber on {endpoint} after {waited:g} s: is anyone subscribed there? {how} "
        "(both sides binding or both connecting deliver nothing)"
    )
