"""The router's block index: replica × medium × block, longest consecutive prefix, TTLs."""

from kvmesh.index.block_index import BlockIndex
from kvmesh.index.prefix import Medium, PrefixMatch, PromptKeys, parse_medium

__all__ = ["BlockIndex", "Medium", "PrefixMatch", "PromptKeys", "parse_medium"]
