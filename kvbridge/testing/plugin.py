"""kvbridge's pytest plugin: a simulated vLLM engine and a Dynamo index fed from it.

Installing kvbridge registers this module through the ``pytest11`` entry point, so the fixtures
are available in any test suite without a ``conftest.py`` import (``-p no:kvbridge`` disables
them).

Fixtures
    ``vllm_publisher``
        A :class:`~kvbridge.testing.SimulatedEngine` bound to free loopback ports, with a replay
        socket and 16-token blocks. It is closed at teardown.
    ``kv_index``
        A :class:`~kvbridge.testing.SyncedIndex` (a ``TieredIndex``) fed from ``vllm_publisher``,
        as worker 0, by a kvbridge ``Relay`` on a background thread. Its reads wait until the
        relay has processed every batch published so far (``kv_index.sync(timeout=5)`` does that
        explicitly).
    ``kvbridge_engine_options``
        The keyword arguments of the engine. Empty by default; override it in a ``conftest.py`` or
        a module to change every engine there.

Choosing the engine, innermost wins
    1. ``{"block_size": 16}``, the plugin's default.
    2. The ``kvbridge_engine_options`` fixture.
    3. ``@pytest.mark.kvbridge_engine(...)`` markers on the module, the class, then the test.
       Markers set in ``pytestmark`` or on a class apply to every test inside.
    4. Indirect parametrization, to run one test against several engines::

        @pytest.mark.parametrize(
            "vllm_publisher", [{"release": "0.22.0"}, {"release": "0.33.0"}], indirect=True
        )
        def test_any_release(vllm_publisher, kv_index): ...

Example::

    @pytest.mark.kvbridge_engine(block_size=32, num_blocks=8, cpu_blocks=8)
    def test_offloaded_prefix(vllm_publisher, kv_index):
        prompt = list(range(100))
        vllm_publisher.generate(prompt)
        assert kv_index.engine_overlap(prompt).host_pinned == 3
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvbridge.testing.simulated_engine import SimulatedEngine
    from kvbridge.testing.synced_index import SyncedIndex

__all__ = ["kv_index", "kvbridge_engine_options", "pytest_configure", "vllm_publisher"]

MARKER = "kvbridge_engine"
DEFAULT_OPTIONS: dict[str, Any] = {"block_size": 16}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): keyword arguments of the SimulatedEngine behind the vllm_publisher "
        "and kv_index fixtures (block_size, num_blocks, cpu_blocks, self_describing, release, "
        "hash_seed, bytes_hashes, dp_rank, topic, ...)",
    )


@pytest.fixture
def kvbridge_engine_options() -> dict[str, Any]:
    """Engine options for every test in scope; override this fixture to change them."""
    return {}


def engine_options(request: pytest.FixtureRequest, base: dict[str, Any]) -> dict[str, Any]:
    """The engine's keyword arguments for a test: defaults, ``base``, markers, then the
    indirect parameter."""
    options = {**DEFAULT_OPTIONS, **base}
    for marker in reversed(list(request.node.iter_markers(MARKER))):
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{MARKER} takes keyword arguments only")
        options.update(marker.kwargs)
    param = getattr(request, "param", None)
    if param is not None:
        if not isinstance(param, dict):
            raise pytest.UsageError("an indirect vllm_publisher parameter must be a dict")
        options.update(param)
    return options


@pytest.fixture
def vllm_publisher(
    request: pytest.FixtureRequest, kvbridge_engine_options: dict[str, Any]
) -> Iterator[SimulatedEngine]:
    """A simulated vLLM engine publishing real KV events on free loopback ports."""
    from kvbridge.testing.simulated_engine import SimulatedEngine

    options = engine_options(request, kvbridge_engine_options)
    with SimulatedEngine(**options) as engine:
        yield engine


@pytest.fixture
def kv_index(vllm_publisher: SimulatedEngine) -> Iterator[SyncedIndex]:
    """A tiered Dynamo index fed from ``vllm_publisher`` (worker 0) by kvbridge's relay."""
    from kvbridge.testing.synced_index import SyncedIndex

    with SyncedIndex(vllm_publisher) as index:
        yield index
