"""The tests' Ray start-up (``support/ray_start.py``) against a real Ray whose GCS server misses
its start-up wait: the one timeout a loaded machine can cause is retried, from scratch, once."""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support.ray_start import STARTUP_TIMEOUTS, init_ray  # noqa: E402

GCS_WAIT = "RAY_gcs_server_port_wait_time_s"
"""Ray's own setting of how long ``ray.init`` waits for the GCS server's port file; at 0 it
looks once, before the server can have written it."""

OPTIONS: dict[str, Any] = {
    "address": "local",
    "num_cpus": 1,
    "include_dashboard": False,
    "logging_level": "WARNING",
}


def test_a_gcs_server_that_misses_its_wait_is_a_startup_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv(GCS_WAIT, "0")
    try:
        with pytest.raises(RuntimeError, match=r"Timed out waiting for file .*gcs_server_port"):
            ray.init(**OPTIONS)
    finally:
        ray.shutdown()
    assert "Timed out waiting for file" in STARTUP_TIMEOUTS


def test_init_ray_starts_ray_again_after_a_startup_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first ``ray.init`` misses the GCS server's port (its wait is 0), the next waits
    Ray's default of 30 s and starts."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    real_init = ray.init
    waits: list[str] = []

    def init_with_one_short_wait(**options: Any) -> Any:
        waits.append("30" if waits else "0")
        monkeypatch.setenv(GCS_WAIT, waits[-1])
        return real_init(**options)

    monkeypatch.setattr(ray, "init", init_with_one_short_wait)
    try:
        init_ray(**OPTIONS)
        assert ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == 1.0
    finally:
        ray.shutdown()
    assert waits[:2] == ["0", "30"]  # a second timeout is retried once more
    assert len(waits) <= 3
