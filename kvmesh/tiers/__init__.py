"""Storage tiers, chosen by URL scheme (see :mod:`kvmesh.tiers.base`)."""

from kvmesh.tiers.base import ChunkData, Tier, TierOptions, open_tier, register_tier

__all__ = ["ChunkData", "Tier", "TierOptions", "open_tier", "register_tier"]
