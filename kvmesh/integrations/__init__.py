"""Adapters that put kvmesh inside serving engines (``kvmesh.integrations.vllm``)."""
