"""Runtime control of the cache: an admin HTTP API per engine, the controller's client CLI.

* :mod:`kvmesh.admin.schema` — request bodies, auth, OpenAPI (no torch; the router uses it).
* :mod:`kvmesh.admin.ops` — the operations on one :class:`~kvmesh.CacheEngine`.
* :mod:`kvmesh.admin.server` — :class:`AdminServer`, the engine's HTTP endpoint.
* :mod:`kvmesh.admin.cli` — ``kvmesh cache ...`` against the controller on the router.

The controller itself lives on the router: :mod:`kvmesh.router.controller`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.admin.server import AdminServer, start_admin

__all__ = ["AdminServer", "start_admin"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvmesh.admin import server

        return getattr(server, name)
    raise AttributeError(f"module 'kvmesh.admin' has no attribute {name!r}")
