"""The router's block index: replica × medium × block, longest consecutive prefix, TTLs."""

from kvmesh.index.block_index import BlockIndex
from kvmesh.index.media import Medium, OtherMedium, medium_name
from kvmesh.index.prefix import PrefixMatch, PromptKeys

__all__ = ["BlockIndex", "Medium", "OtherMedium", "PrefixMatch", "PromptKeys", "medium_name"]
