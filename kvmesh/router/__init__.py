"""The kvmesh router (the llm-d endpoint-picker role): tokenize, score, proxy.

Scoring is pure code (:mod:`~kvmesh.router.scorers`, :mod:`~kvmesh.router.picker`) that the
trace simulator imports without a server; :class:`Router` and :class:`RouterService` pull in
aiohttp and are imported on first use. Nothing here imports torch or vllm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.router.config import POLICIES, MediumWeights, ReplicaConfig, RouterConfig, Weights
from kvmesh.router.picker import Decision, Picker, build_picker
from kvmesh.router.scorers import ReplicaState, RoutingRequest, Scorer, SessionTable

if TYPE_CHECKING:
    from kvmesh.router.app import RouterService
    from kvmesh.router.server import Router
    from kvmesh.router.tokenize import PromptTokenizer

__all__ = [
    "POLICIES",
    "Decision",
    "MediumWeights",
    "Picker",
    "PromptTokenizer",
    "ReplicaConfig",
    "ReplicaState",
    "Router",
    "RouterConfig",
    "RouterService",
    "RoutingRequest",
    "Scorer",
    "SessionTable",
    "Weights",
    "build_picker",
]

_LAZY = {
    "Router": "kvmesh.router.server",
    "RouterService": "kvmesh.router.app",
    "PromptTokenizer": "kvmesh.router.tokenize",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.router' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
