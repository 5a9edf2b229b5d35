"""The shared limit on recurring warnings (a full Redis, a full filesystem): said at once,
then at most every ``every_s`` per reason, with the count held back in between."""

from __future__ import annotations

import threading

from kvmesh.core.saylimit import SayLimit, gib, held_back


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_said_once_then_at_most_every_period_per_reason_with_the_count_held_back() -> None:
    clock = Clock()
    say = SayLimit(300.0, clock)
    assert say.due("full") == 0
    assert [say.due("full") for _ in range(3)] == [None, None, None]
    assert say.due("read_only") == 0  # each reason has its own period
    clock.now += 299.9
    assert say.due("full") is None
    clock.now += 0.1
    assert say.due("full") == 4  # the four held back since the first
    assert say.due("full") is None
    clock.now += 300.0
    assert say.due("full") == 1
    assert say.due("read_only") == 0


def test_threads_say_it_once() -> None:
    say = SayLimit(300.0, Clock())
    said: list[int | None] = []
    lock = threading.Lock()

    def burst() -> None:
        for _ in range(500):
            got = say.due()
            with lock:
                said.append(got)

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert said.count(0) == 1 and said.count(None) == 1999


def test_wording() -> None:
    assert held_back(0) == ""
    assert held_back(3) == " (3 more since the last warning)"
    assert gib(1 << 30) == "1.0 GiB" and gib(5.5 * (1 << 30)) == "5.5 GiB"
