"""The kvmesh router: an OpenAI-compatible proxy over the routing core (:mod:`kvmesh.routing`).

:class:`Router` and :class:`RouterService` pull in aiohttp and are imported on first use.
Nothing here imports torch or vllm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.router.config import RouterConfig

if TYPE_CHECKING:
    from kvmesh.router.app import RouterService
    from kvmesh.router.server import Router

__all__ = ["Router", "RouterConfig", "RouterService"]

_LAZY = {
    "Router": "kvmesh.router.server",
    "RouterService": "kvmesh.router.app",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.router' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
