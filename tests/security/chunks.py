"""What the stored-chunk attack tests share: the model's layout, the chunk size, prompts and
KV (see ``conftest.py`` for the fixtures)."""

from __future__ import annotations

import numpy as np
import torch

from kvmesh import KVLayout

LAYOUT = KVLayout(2, 2, 16, "bfloat16")
CHUNK = 64


def prompt(n: int, seed: int) -> list[int]:
    """Token ids that are all distinct and large, so a leak of any run is unambiguous."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.choice(np.arange(70_000, 4_000_000), size=n, replace=False)]


def kv_for(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(n), generator=gen).to(torch.bfloat16)


def raw_bytes(kv: torch.Tensor) -> memoryview:
    return kv.contiguous().view(torch.uint8).reshape(-1).numpy().copy().data
