"""vLLM's KV cache groups, as kvmesh sees them (the hybrid KV cache manager, HMA).

With the hybrid manager on, vLLM splits a model's attention layers into KV cache groups,
one per kind of attention: each group has its own block table, so the same block id means
different memory in two groups, and a sliding-window group frees (replaces by the null
block) every block that fell out of its window. kvmesh therefore keeps one key space per
group: the group's index, attention kind, window, block size and layers go into the
chunk key's model identity (:attr:`Group.tag`), so chunks of two groups never collide.

Supported kinds: full attention (MLA included: both store every token) and sliding
window (only the last ``window`` tokens before a load point are stored and loaded).
Anything else (Mamba / linear-attention state, chunked local attention, cross attention,
mixed-type groups) is refused by name: :func:`classify` raises :class:`UnsupportedGroups`,
whose message names the kind and the layers, and the connector then stays out of the way
(vLLM runs without kvmesh) rather than ever load KV it does not understand.

Duck-typed over vLLM's ``KVCacheConfig`` (class names, not imports), so it is unit-tested
without starting vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_window"
# vLLM's spec classes kvmesh stores as every-token KV. MLA's latent is one plane per token.
_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_SLIDING_SPECS = frozenset({"SlidingWindowSpec"})


class UnsupportedGroups(ValueError):
    """A KV cache group kvmesh cannot cache; the message names its kind and layers."""


@dataclass(frozen=True)
class Group:
    index: int  # vLLM's group index: the position of its block ids in every block-id tuple
    kind: str  # FULL or SLIDING
    layers: tuple[str, ...]
    block_size: int
    window: int | None = None  # sliding window in tokens (SLIDING only)

    @property
    def tag(self) -> str:
        """The group's part of the chunk key namespace."""
        kind = self.kind if self.window is None else f"{self.kind}{self.window}"
        return f"g{self.index}:{kind}:bs{self.block_size}:{','.join(self.layers)}"

    def first_needed(self, point: int) -> int:
        """The first token whose KV a load up to ``point`` needs in this group: 0 for full
        attention; for a sliding window, the window's start (vLLM attends to the last
        ``window`` tokens, the current one included)."""
        if self.window is None:
            return 0
        return max(0, point - self.window)


def classify(kv_cache_config: Any) -> list[Group]:
    """The groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``), in vLLM's order.

    Raises :class:`UnsupportedGroups` naming every group kvmesh cannot cache, or a model
    without a full-attention group (a sliding-window-only model loses the prefix's early
    KV as it runs, so no stored prefix could ever be reloaded whole)."""
    groups: list[Group] = []
    refused: list[str] = []
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        layers = tuple(str(n) for n in g.layer_names)
        block_size = int(getattr(spec, "block_size", 0) or 0)
        if name in _FULL_SPECS:
            # With the hybrid manager off, vLLM gives sliding-window layers a full-attention
            # spec (every token's block kept): cached as full attention, like before.
            groups.append(Group(i, FULL, layers, block_size))
        elif name in _SLIDING_SPECS and int(getattr(spec, "sliding_window", 0) or 0) > 0:
            groups.append(Group(i, SLIDING, layers, block_size, int(spec.sliding_window)))
        else:
            refused.append(f"group {i} ({name}: layers {', '.join(layers)})")
    if refused:
        raise UnsupportedGroups(
            "kvmesh cannot cache these KV cache groups: "
            + "; ".join(refused)
            + ". kvmesh supports full attention, MLA and sliding-window attention groups; "
            "Mamba / linear-attention state and other kinds are not supported"
        )
    if groups and not any(g.kind == FULL for g in groups):
        raise UnsupportedGroups(
            "kvmesh needs a full-attention KV cache group; this model has only sliding-window "
            f"groups ({'; '.join(g.tag for g in groups)})"
        )
    return groups


def main_group(groups: Sequence[Group]) -> int:
    """Index of the group whose chunks decide a prefix hit: the first full-attention one."""
    return next((g.index for g in groups if g.kind == FULL), 0)
