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


def test_usage_counts_this_process_cpu_and_each_cpus_steal() -> None:
    psutil = pytest.importorskip("psutil")
    before = stallwatch.usage()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of CPU in this thread
        pass
    after = stallwatch.usage()
    assert after.at > before.at and after.cpu_s - before.cpu_s >= 0.25
    assert after.major_faults >= before.major_faults >= 0
    assert len(after.steal_s) == len(after.busy_s) == psutil.cpu_count()
    assert all(a >= b for a, b in zip(after.steal_s, before.steal_s, strict=True))
    assert sum(after.busy_s) - sum(before.busy_s) >= 0.2  # this thread's 0.3 s among them


def test_meanwhile_says_what_the_process_and_the_host_did() -> None:
    before = stallwatch.Usage(at=10.0, cpu_s=2.0, major_faults=5, steal_s=(1.0, 7.0), busy_s=(50.0, 60.0))
    after = stallwatch.Usage(at=15.6, cpu_s=2.04, major_faults=7, steal_s=(1.0, 11.8), busy_s=(55.5, 60.5))
    # The thread runs on cpu 1 only: its steal is what held it (4.8 s of 5.6).
    assert stallwatch.meanwhile(before, after, {1}) == (
        "meanwhile (5.6 s) the process used 0.04 s of CPU in all its threads and had 2 major page "
        "faults; busy (every process) cpu1 0.50 s; the hypervisor took (steal) cpu1 4.80 s; "
        "the thread runs on cpu 1"
    )
    assert "steal) cpu0 0.00 s, cpu1 4.80 s" in stallwatch.meanwhile(before, after)
    no_psutil = stallwatch.Usage(at=10.0, cpu_s=2.0, major_faults=5)
    line = stallwatch.meanwhile(no_psutil, after, {0, 1})
    assert "steal" not in line and "busy" not in line and line.endswith("the thread runs on cpu 0,1")
