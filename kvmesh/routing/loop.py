"""The event loop the front ends run on: uvloop when it is installed (it is, beside vLLM).

It takes a good part off a decision's overhead (the router's HTTP proxy, the EPP's gRPC
messages); the standard loop works the same, only slower.

:func:`freeze_heap` takes what a front end allocated while starting out of the cyclic
garbage collector's reach, as vLLM does in its own servers (``freeze_gc_heap``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def freeze_heap() -> int:
    """Collect, then ``gc.freeze()`` everything allocated so far; the number of objects frozen.

    Called once by a front end's process (``kvmesh router``, ``kvmesh epp``) when it has
    started. A full collection walks every object the collector tracks, and a started router
    holds ~145,000 of them (the modules, aiohttp, grpc, the tokenizer): 50-90 ms of a held
    event loop, and every request on it, on the 2-core machine. Full collections are rare
    (none fell within the overhead bench's 600 requests of 32k tokens), so this bounds a
    rare pause rather than a typical one. Frozen objects are never collected (they live as
    long as the process anyway); what is allocated later is, as before.
    """
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d objects out of the garbage collector's reach in %.0f ms",
              frozen, (time.perf_counter() - started) * 1e3)  # fmt: skip
    return frozen


def gc_state() -> dict[str, object]:
    """What ``/kvmesh/state`` says of the garbage collector: objects frozen at start-up
    (0: :func:`freeze_heap` was not called, e.g. a router on a thread of a test) and the
    collections run per generation."""
    return {"frozen": gc.get_freeze_count(), "collections": [s["collections"] for s in gc.get_stats()]}
