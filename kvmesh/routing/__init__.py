"""The one routing core, driven by three front ends: ``kvmesh router`` (:mod:`kvmesh.router`,
an OpenAI proxy), ``kvmesh epp`` (:mod:`kvmesh.epp`, Envoy's ext_proc) and ``kvmesh sim``
(:mod:`kvmesh.sim`, the fleet simulator). Each drives this package and nothing of the others.

=====================  =================================================================
``config``             RoutingConfig (policy, weights, replicas, ...), ReplicaConfig
``tokenize``           the engine-exact tokenizer (``chat_template``: chat rendering)
``prompts``            a request body's token ids (local, or a replica's /tokenize)
``scorers``            RoutingRequest, ReplicaState, the weighted scorers
``table``              ReplicaTable: the candidates as arrays
``picker``             Picker (weighted sum), build_picker
``cost``, ``fit``      policy cost: the TTFT cost model, its online fit (``costhooks``:
                       what the core does around it; ``costmetrics``, ``reports``)
``body``               what the router and the EPP accept of a client's body
``sessions``           SessionTable
``pool``               Pool (replica state and this router's counts), TableLedger
``health``             Monitor: health checks and gauge scrapes over HTTP
``dispatcher``         Dispatcher: a request's lifecycle (decide -> Ticket: sent / served /
                       first byte / finished, or Refusal); a policy's own tickets (track)
``core``               RoutingCore: all of it as a live service (events, health, dispatcher)
=====================  =================================================================

The index itself is :mod:`kvmesh.index`. Nothing here imports torch, vllm, or any front
end; the scoring modules import no server framework (the simulator runs them). Heavy
names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.routing.config import POLICIES, MediumWeights, ReplicaConfig, RoutingConfig, Weights
from kvmesh.routing.picker import Decision, Picker, build_picker
from kvmesh.routing.scorers import ReplicaState, RoutingRequest, Scorer
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.table import ReplicaTable

if TYPE_CHECKING:
    from kvmesh.routing.core import RoutingCore
    from kvmesh.routing.dispatcher import Dispatcher, Refusal, Ticket
    from kvmesh.routing.tokenize import PromptTokenizer

__all__ = [
    "POLICIES",
    "Decision",
    "Dispatcher",
    "MediumWeights",
    "Picker",
    "PromptTokenizer",
    "Refusal",
    "ReplicaConfig",
    "ReplicaState",
    "ReplicaTable",
    "RoutingConfig",
    "RoutingCore",
    "RoutingRequest",
    "Scorer",
    "SessionTable",
    "Ticket",
    "Weights",
    "build_picker",
]

_LAZY = {
    "RoutingCore": "kvmesh.routing.core",
    "Dispatcher": "kvmesh.routing.dispatcher",
    "Refusal": "kvmesh.routing.dispatcher",
    "Ticket": "kvmesh.routing.dispatcher",
    "PromptTokenizer": "kvmesh.routing.tokenize",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.routing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
