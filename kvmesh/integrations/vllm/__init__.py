"""kvmesh inside vLLM: the ``KVMeshConnector`` KV connector and ``kvmesh prewarm``.

``kv_connector_module_path="kvmesh.integrations.vllm"`` makes vLLM import this package and
take ``KVMeshConnector`` from it. The connector (and vLLM) is imported on first use only,
so ``kvmesh prewarm`` and other light users of this package do not pay for vLLM's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.integrations.vllm.connector import KVMeshConnector

__all__ = ["KVMeshConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVMeshConnector":
        from kvmesh.integrations.vllm.connector import KVMeshConnector

        return KVMeshConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
