"""``kvbridge watch`` on a real terminal: tmux runs it, ``replay`` feeds it the bundled sample,
and the screen's text is read back with ``tmux capture-pane``.

The tmux server is a private one (``tmux -L <name>``), killed at the end; the test is skipped,
saying so, where tmux is not installed (Debian: ``apt-get install tmux``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.pipeline import StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.schemas.tiers import Tier

SAMPLE = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"
HEIGHT = 24
TIMEOUT = 30.0

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"
)


class Tmux:
    """A private tmux server with one detached session of a fixed size."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *args: str) -> str:
        result = subprocess.run(
            ["tmux", "-L", self.name, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=TIMEOUT,
        )
        return result.stdout

    def screen(self) -> list[str]:
        return self.run("capture-pane", "-p", "-t", "watch").splitlines()


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    server = Tmux(f"kvbridge-test-{os.getpid()}-{tmp_path.name}")
    socket: list[Path] = []
    try:
        yield server
        socket.append(Path(server.run("display-message", "-p", "#{socket_path}").strip()))
    finally:
        subprocess.run(
            ["tmux", "-L", server.name, "kill-server"],
            capture_output=True,
            check=False,
            timeout=TIMEOUT,
        )
        for path in socket:  # the server leaves its socket file behind
            path.unlink(missing_ok=True)


def expected_rows() -> dict[int, list[str]]:
    """worker -> [dp, device, host, disk, external] at the end of the sample, from the pipeline."""
    pipeline = StreamPipeline(4)
    for record in CaptureReader(SAMPLE):
        pipeline.feed_record(record)
    return {
        worker_id: ["0", *(str(worker.normalizer.resident_blocks(0, tier)) for tier in Tier)]
        for worker_id, worker in pipeline.workers.items()
    }


def worker_rows(screen: list[str]) -> tuple[str, dict[int, str]]:
    """The header line and each worker's row (the first row of each worker)."""
    header = next((line for line in screen if line.split()[:2] == ["worker", "dp"]), "")
    rows: dict[int, str] = {}
    for line in screen:
        cells = line.split()
        if header and len(cells) >= 6 and cells[0].isdigit() and cells[1].isdigit():
            rows.setdefault(int(cells[0]), line)
    return header, rows


HEADERS = {
    80: "worker dp device host disk ext blk/s lag ms gaps replay lost restart drops",
    132: "worker dp device host disk external blocks/s lag ms gaps replayed lost restarts drops",
}


@pytest.mark.parametrize("width", sorted(HEADERS))
def test_watch_shows_the_replayed_sample_on_a_terminal(
    tmux: Tmux, tmp_path: Path, width: int
) -> None:
    port = free_port_range(2)
    log = tmp_path / "watch.log"
    watch = [
        sys.executable, "-m", "kvbridge.cli", "watch",
        "--source", f"tcp://127.0.0.1:{port}", "--worker-id", "1",
        "--source", f"tcp://127.0.0.1:{port + 1}", "--worker-id", "2",
        "--block-size", "4", "--interval", "0.25", "--duration", "60",
    ]  # fmt: skip
    # A shell started in a fresh pane may export COLUMNS and LINES as they were at its start
    # (tmux's default 80x24), and rich would believe them over the terminal: leave them out.
    command = f"env -u COLUMNS -u LINES {shlex.join(watch)} 2>{shlex.quote(str(log))}; sleep 60"
    tmux.run(
        "new-session", "-d", "-s", "watch", "-x", str(width), "-y", str(HEIGHT),
        "-e", f"PATH={os.environ['PATH']}", "-e", f"DYN_LOG={os.environ.get('DYN_LOG', 'warn')}",
        command,
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT
    while not worker_rows(tmux.screen())[0]:  # the table is up: both sources are bound
        assert time.monotonic() < deadline, "\n".join(tmux.screen()) + log.read_text()
        time.sleep(0.1)
    replay = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "replay", str(SAMPLE),
         "--publish", f"tcp://127.0.0.1:{port}", "--pace", "max"],
        capture_output=True, text=True, check=False, timeout=TIMEOUT,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr

    expected = expected_rows()
    assert expected == {1: ["0", "5", "2", "0", "0"], 2: ["0", "3", "2", "0", "0"]}
    while True:
        screen = tmux.screen()
        header, rows = worker_rows(screen)
        shown = {worker: row.split()[1:6] for worker, row in rows.items()}
        if shown == expected and "batches 7 |" in "\n".join(screen):
            break
        assert time.monotonic() < deadline, "\n".join(screen) + log.read_text()
        time.sleep(0.1)

    # The table fits the screen: every line within the width, header and footer shown.
    assert all(len(line) <= width for line in screen), "\n".join(screen)
    assert header.split() == HEADERS[width].split(), "\n".join(screen)
    assert sorted(rows) == [1, 2]
    # No lag for a replay: the sample's batches were stamped in 2025. The lag cell is blank, and
    # the cells right of it (gaps, replayed, lost, restarts, drops) are all 0.
    lag = header.index("lag ms")
    for row in rows.values():
        assert row[lag : lag + len("lag ms")].strip() == "", "\n".join(screen)
        assert row.split()[7:] == ["0"] * 5, "\n".join(screen)
    assert "batches 7 | gaps 0 | replays 0 (recovered 0) | lost 0 | restarts 0" in screen
