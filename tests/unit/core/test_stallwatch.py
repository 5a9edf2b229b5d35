"""The stall watch: every thread's stack on stderr when no service loop ran for the setting,
nothing while one keeps running, nothing once the last one stopped."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmesh.core import stallwatch


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    stallwatch.reset_for_tests()
    yield
    stallwatch.reset_for_tests()


def test_setting_is_off_unless_a_number_of_seconds_of_at_least_one() -> None:
    assert stallwatch.setting({}) == 0.0
    assert stallwatch.setting({stallwatch.ENV: "3"}) == 3.0
    assert stallwatch.setting({stallwatch.ENV: "soon"}) == 0.0
    assert stallwatch.setting({stallwatch.ENV: "0.2"}) == 0.0


def test_a_loop_that_stops_running_gets_every_stack_dumped(capfd: pytest.CaptureFixture[str]) -> None:
    stallwatch.reset_for_tests(1.0)
    stallwatch.started()
    stallwatch.pet(time.monotonic())
    time.sleep(1.5)  # the loop "held up": no pet for longer than the setting
    err = capfd.readouterr().err
    assert "Timeout (0:00:01)!" in err and "test_a_loop_that_stops_running" in err
    stallwatch.stopped()


def test_a_running_loop_and_a_stopped_one_dump_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    stallwatch.reset_for_tests(1.0)
    stallwatch.started()
    end = time.monotonic() + 1.6
    while time.monotonic() < end:  # petted every 50 ms, like a selector loop
        stallwatch.pet(time.monotonic())
        time.sleep(0.05)
    stallwatch.stopped()  # the last loop: the pending dump is cancelled
    time.sleep(1.3)
    assert "Timeout" not in capfd.readouterr().err


def test_off_by_default_pets_cost_nothing(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(stallwatch.ENV, raising=False)
    stallwatch.started()
    stallwatch.pet(time.monotonic())
    time.sleep(0.1)
    assert not stallwatch.enabled()
    stallwatch.stopped()
    assert "Timeout" not in capfd.readouterr().err
