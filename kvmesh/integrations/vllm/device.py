"""Device-agnostic streams and events, so one control flow serves CUDA and CPU.

On CUDA, :class:`Stream` wraps a ``torch.cuda.Stream`` and :class:`Event` a
``torch.cuda.Event``: work queued inside ``with stream:`` runs on that stream, ``wait``
orders it after an event of another stream, and nothing blocks the host unless
``synchronize`` is called. On CPU a stream is a no-op stand-in: work runs in program
order when it is issued, so an event is complete as soon as it is recorded. The connector's
tests drive the CUDA control flow (the same calls, in the same order) on CPU tensors.

Imports torch only (scripts/gpu_check.py runs it without vLLM).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Event:
    """A point in a stream's work; on CPU, always complete."""

    __slots__ = ("_ev",)

    def __init__(self, ev: Any = None) -> None:
        self._ev = ev  # torch.cuda.Event, or None on CPU

    def query(self) -> bool:
        return True if self._ev is None else bool(self._ev.query())

    def synchronize(self) -> None:
        if self._ev is not None:
            self._ev.synchronize()


class Stream:
    """A side stream on ``device`` (CUDA), or program order (CPU)."""

    def __init__(self, device: torch.device, priority: int = 0, current: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._s: Any = None
        if self.cuda:
            self._s = (
                torch.cuda.current_stream(device) if current else torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]
            )

    @classmethod
    def compute(cls, device: torch.device) -> Stream:
        """The stream vLLM's forward runs on (the current stream when called)."""
        return cls(device, current=True)

    def record(self) -> Event:
        if not self.cuda:
            return Event()
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self._s)
        return Event(ev)

    def wait(self, event: Event | None) -> None:
        """Order this stream's later work after ``event`` (no host wait)."""
        if self.cuda and event is not None and event._ev is not None:
            self._s.wait_event(event._ev)

    def synchronize(self) -> None:
        if self.cuda:
            self._s.synchronize()

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Queue the enclosed torch work on this stream."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self._s):
            yield
