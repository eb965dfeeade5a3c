"""The order and budgets of one poll's reads (kvbridge/adapters/round_robin.py), on plain
sources: each holds a number of messages, and a read takes what its quota allows."""

from __future__ import annotations

from kvbridge.adapters.round_robin import POLL_ROUND, RoundRobin


class Sources:
    """Sources that hold ``held[name]`` messages, and the reads made of them in order."""

    def __init__(self, held: dict[str, int], waits: frozenset[str] = frozenset()) -> None:
        self.held = dict(held)
        self.waits = waits
        self.reads: list[tuple[str, int]] = []

    def read_from(self, source: str, quota: int) -> tuple[int, bool]:
        read = min(quota, self.held[source])
        self.held[source] -= read
        self.reads.append((source, read))
        return read, source in self.waits and read > 0


def round_robin(names: str, poll_budget: int, source_budget: int) -> RoundRobin[str]:
    rounds = RoundRobin[str](poll_budget=poll_budget, source_budget=source_budget)
    for name in names:
        rounds.add(name)
    return rounds


def test_rounds_stop_at_the_source_budget_and_the_poll_budget() -> None:
    rounds = round_robin("abc", poll_budget=100, source_budget=50)
    sources = Sources({"a": 200, "b": 10, "c": 200})
    rounds.read(["c", "a", "b"], sources.read_from)
    # a, b and c a round each (b runs dry), then a up to its source budget, then c up to the
    # poll's: 32 + 10 + 32 + 18 + 8 = 100.
    assert POLL_ROUND == 32
    assert sources.reads == [("a", 32), ("b", 10), ("c", 32), ("a", 18), ("c", 8)]
    # The budget cut c's round short: the next poll starts with c, then a.
    sources.reads.clear()
    rounds.read(["a", "c"], sources.read_from)
    assert sources.reads[:2] == [("c", 32), ("a", 32)]


def test_the_next_poll_starts_after_the_last_source_served() -> None:
    rounds = round_robin("abc", poll_budget=64, source_budget=1000)
    sources = Sources({"a": 100, "b": 100, "c": 100})
    rounds.read(["a", "b", "c"], sources.read_from)
    assert sources.reads == [("a", 32), ("b", 32)]  # b's full round spent the budget
    sources.reads.clear()
    rounds.read(["a", "b", "c"], sources.read_from)
    assert sources.reads == [("c", 32), ("a", 32)]


def test_a_source_that_waits_is_not_read_again_in_the_poll() -> None:
    rounds = round_robin("ab", poll_budget=1000, source_budget=1000)
    sources = Sources({"a": 100, "b": 100}, waits=frozenset("a"))
    rounds.read(["a", "b"], sources.read_from)
    assert sources.reads == [("a", 32), ("b", 32), ("b", 32), ("b", 32), ("b", 4)]


def test_a_replaced_source_keeps_its_place() -> None:
    rounds = round_robin("abc", poll_budget=32, source_budget=1000)
    rounds.replace("a", "z")
    sources = Sources({"z": 100, "b": 100, "c": 100})
    rounds.read(["c", "b", "z"], sources.read_from)
    assert sources.reads == [("z", 32)]
    sources.reads.clear()
    rounds.read(["c", "b", "z"], sources.read_from)
    assert sources.reads == [("b", 32)]
