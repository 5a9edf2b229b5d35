"""The event loop the front ends run on: uvloop when it is installed (it is, beside vLLM).

It takes a good part off a decision's overhead (the router's HTTP proxy, the EPP's gRPC
messages); the standard loop works the same, only slower.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
