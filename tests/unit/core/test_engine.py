"""CacheEngine through its public API: cpu, a shared ``mem://`` remote, disk, and faults."""

from __future__ import annotations

import importlib.util
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.tiers.testing import FaultyTier, MemoryTier, reset_memory_stores

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
CHUNK_BYTES = CS * LAYOUT.bytes_per_token  # 4096
GB = 1024**3
HAS_DISK = importlib.util.find_spec("kvmesh.tiers.disk") is not None


def cpu_gb(chunks: int) -> float:
    return chunks * CHUNK_BYTES / GB  # exact: CHUNK_BYTES is a power of two


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 32000 for i in range(n)]


def kv_for(tokens: list[int]) -> torch.Tensor:
    """KV that depends on the whole prefix, like a real model's (exact in float32)."""
    prefix = torch.tensor(np.cumsum(np.asarray(tokens, dtype=np.int64)) % 9973, dtype=torch.float32)
    n = len(tokens)
    kv = prefix.view(1, 1, n, 1, 1).expand(LAYOUT.shape(n)).clone()
    kv += torch.arange(2).view(2, 1, 1, 1, 1) * 0.5
    kv += torch.arange(2).view(1, 2, 1, 1, 1) * 0.25
    kv += torch.arange(2).view(1, 1, 1, 2, 1) * 0.125
    kv += torch.arange(8).view(1, 1, 1, 1, 8) / 64
    return kv


@pytest.fixture(autouse=True)
def _fresh_stores() -> Iterator[None]:
    reset_memory_stores()
    yield
    reset_memory_stores()


@pytest.fixture
def store_name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make() -> Iterator[Callable[..., CacheEngine]]:
    engines: list[CacheEngine] = []

    def _make(model_id: str = "m", **cfg: Any) -> CacheEngine:
        cfg.setdefault("chunk_size", CS)
        cfg.setdefault("max_local_cpu_size", cpu_gb(64))
        eng = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id=model_id)
        engines.append(eng)
        return eng

    yield _make
    for eng in engines:
        eng.close(timeout=10)


def assert_retrieves(eng: CacheEngine, tokens: list[int], n_expected: int) -> None:
    n, kv = eng.retrieve(tokens)
    assert n == n_expected
    assert kv.shape == LAYOUT.shape(n)
    assert kv.dtype == torch.float32
    assert torch.equal(kv, kv_for(tokens)[:, :, :n])


# -- basic store / lookup / retrieve ----------------------------------------------------
def test_store_lookup_retrieve_exact_bytes(make: Callable[..., CacheEngine]) -> None:
    eng = make()
    toks = prompt(40, 1)
    assert eng.lookup(toks) == 0
    assert eng.retrieve(toks)[0] == 0
    assert eng.store(toks, kv_for(toks)) == 32  # two full chunks; the 8-token tail is not cached
    assert eng.lookup(toks) == 32
    assert eng.lookup(toks[:31]) == 16
    assert eng.lookup(toks[:16]) == 16
    assert eng.lookup(prompt(40, 2)) == 0
    assert_retrieves(eng, toks, 32)
    assert eng.locate(toks) == [(0, 16, "cpu"), (16, 32, "cpu")]
    # a prompt sharing only the first chunk hits only that chunk
    other = toks[:16] + prompt(24, 3)
    assert eng.lookup(other) == 16
    assert_retrieves(eng, other, 16)
    # storing again is a no-op that still reports the cached length
    assert eng.store(toks, kv_for(toks)) == 32
    assert eng.stats()["cpu"]["stores"] == 2


def test_token_inputs_as_tensor_and_array(make: Callable[..., CacheEngine]) -> None:
    eng = make()
    toks = prompt(32, 4)
    eng.store(torch.tensor(toks), kv_for(toks))
    assert eng.lookup(np.array(toks, dtype=np.int32)) == 32
    n, kv = eng.retrieve(torch.tensor(toks, dtype=torch.int32))
    assert n == 32 and torch.equal(kv, kv_for(toks))


def test_save_unfull_chunk_caches_the_tail(make: Callable[..., CacheEngine]) -> None:
    eng = make(save_unfull_chunk=True)
    toks = prompt(40, 5)
    assert eng.store(toks, kv_for(toks)) == 40
    assert eng.lookup(toks) == 40
    assert_retrieves(eng, toks, 40)
    assert eng.lookup(toks[:39]) == 32


def test_salts_and_models_do_not_share(make: Callable[..., CacheEngine], store_name: str) -> None:
    url = f"mem://{store_name}"
    a = make(remote_url=url, cache_salt="a")
    b = make(remote_url=url, cache_salt="b")
    c = make("other-model", remote_url=url, cache_salt="a")
    toks = prompt(32, 6)
    a.store(toks, kv_for(toks))
    assert a.wait_for_writes(10)
    assert b.lookup(toks) == 0
    assert c.lookup(toks) == 0
    assert b.retrieve(toks)[0] == 0


# -- remote tier ------------------------------------------------------------------------
def test_retrieve_after_cpu_clear_loads_from_remote_and_promotes(
    make: Callable[..., CacheEngine], store_name: str
) -> None:
    eng = make(remote_url=f"mem://{store_name}")
    toks = prompt(40, 7)
    eng.store(toks, kv_for(toks))
    assert eng.wait_for_writes(10)
    assert eng.clear(tier="cpu") == {"cpu": 2}
    assert eng.locate(toks) == [(0, 16, "remote"), (16, 32, "remote")]
    assert eng.lookup(toks) == 32
    with eng.retrieve_chunks(toks) as chunks:
        assert [c.tier for c in chunks] == ["remote", "remote"]
        assert [(c.start, c.end) for c in chunks] == [(0, 16), (16, 32)]
    assert eng.locate(toks) == [(0, 16, "cpu"), (16, 32, "cpu")]  # promoted
    assert_retrieves(eng, toks, 32)
    assert eng.stats()["remote"]["hits"] == 2


def test_replicas_share_the_remote(make: Callable[..., CacheEngine], store_name: str) -> None:
    url = f"mem://{store_name}"
    a, b = make(remote_url=url), make(remote_url=url)
    toks = prompt(48, 8)
    a.store(toks, kv_for(toks))
    assert a.wait_for_writes(10)
    assert b.lookup(toks) == 48
    assert_retrieves(b, toks, 48)


def test_remote_serde_naive_and_zstd(make: Callable[..., CacheEngine], store_name: str) -> None:
    for serde_name in ("naive", "zstd"):
        eng = make(remote_url=f"mem://{store_name}-{serde_name}", remote_serde=serde_name)
        toks = prompt(32, 9)
        eng.store(toks, kv_for(toks))
        assert eng.wait_for_writes(10)
        eng.clear(tier="cpu")
        assert_retrieves(eng, toks, 32)


def test_prefetch_brings_remote_chunks_to_cpu(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"mem://{store_name}")
    toks = prompt(48, 10)
    eng.store(toks, kv_for(toks))
    assert eng.wait_for_writes(10)
    eng.clear(tier="cpu")
    assert eng.prefetch(toks) is True
    eng.prefetcher.wait(10)
    assert [w for _, _, w in eng.locate(toks)] == ["cpu"] * 3
    assert_retrieves(eng, toks, 48)


def test_wait_for_writes(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"faulty://{store_name}")
    remote = eng.lower["remote"]
    assert isinstance(remote, FaultyTier)
    remote.latency_s = 0.3
    toks = prompt(32, 11)
    keys = eng.keys.keys(toks)
    eng.store(toks, kv_for(toks))
    assert eng.wait_for_writes(timeout=0.01) is False
    assert eng.wait_for_writes(timeout=20) is True
    remote.latency_s = 0
    assert remote.contains(keys) == [True, True]
    assert eng.stats()["remote"]["write_queue_depth"] == 0
    assert eng.wait_for_writes(timeout=0) is True  # nothing pending


def test_stored_so_far_includes_the_store_still_running(
    make: Callable[..., CacheEngine], store_name: str
) -> None:
    """A chunk's disk or remote write is queued before the store puts it in the cpu tier, so
    a wait that counted queued writes only could end with the write landed and the chunk not
    in the pool yet (a controller test once saw 3 of 4 chunks in the cpu tier, all 4 below).
    ``wait_for_stores`` and ``wait_for_writes`` wait for the stores running at the call, and
    for what a registered barrier (the vLLM connector's saver) still holds."""
    eng = make(remote_url=f"faulty://{store_name}")
    toks = prompt(4 * CS, 12)
    kv = kv_for(toks)
    second, go = threading.Event(), threading.Event()

    def fill(s: int, e: int, out: torch.Tensor) -> None:
        if s == CS:  # the first chunk is in, its write queued; the second waits
            second.set()
            go.wait(10)
        out.copy_(kv[:, :, s:e])

    t = threading.Thread(target=eng.store_with, args=(toks, fill))
    t.start()
    try:
        assert second.wait(10)
        assert eng.wait_for_stores(timeout=0.05) is False
        assert eng.wait_for_writes(timeout=0.05) is False
        go.set()
        assert eng.wait_for_writes(timeout=10) is True
        assert eng.lookup(toks) == 4 * CS and eng.lower["remote"].contains(eng.keys.keys(toks)) == [True] * 4
    finally:
        go.set()
        t.join(10)
    held: list[float | None] = []
    eng.store_barriers.append(lambda timeout: held.append(timeout) or False)  # a saver still busy
    assert eng.wait_for_stores(timeout=1.0) is False and eng.wait_for_writes(timeout=1.0) is False
    assert held and all(h is not None and 0 <= h <= 1.0 for h in held)


# -- pins, clear, move ------------------------------------------------------------------
def test_pinned_chunks_survive_eviction_until_unpinned(make: Callable[..., CacheEngine]) -> None:
    eng = make(max_local_cpu_size=cpu_gb(4))
    assert eng.cpu.pool.num_slots == 4
    a = prompt(32, 12)
    eng.store(a, kv_for(a))
    assert eng.pin(a) == 2
    assert eng.stats()["cpu"]["pinned"] == 2
    for seed in range(20, 26):
        t = prompt(32, seed)
        eng.store(t, kv_for(t))
    assert eng.lookup(a) == 32
    assert_retrieves(eng, a, 32)
    eng.unpin(a)
    assert eng.stats()["cpu"]["pinned"] == 0
    for seed in range(30, 33):
        t = prompt(32, seed)
        assert eng.store(t, kv_for(t)) == 32
    assert eng.lookup(a) == 0


def test_lookup_with_pin_holds_what_it_promised(make: Callable[..., CacheEngine]) -> None:
    eng = make(max_local_cpu_size=cpu_gb(4))
    a = prompt(32, 13)
    eng.store(a, kv_for(a))
    assert eng.lookup(a, pin=True) == 32
    for seed in range(40, 46):
        t = prompt(32, seed)
        eng.store(t, kv_for(t))
    assert_retrieves(eng, a, 32)
    eng.unpin(a)
    assert eng.stats()["cpu"]["pinned"] == 0


def test_clear_by_tier_and_tokens(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"mem://{store_name}")
    a, b = prompt(32, 14), prompt(32, 15)
    eng.store(a, kv_for(a))
    eng.store(b, kv_for(b))
    assert eng.wait_for_writes(10)
    assert eng.clear(tier="remote", tokens=a) == {"remote": 2}
    assert eng.locate(a) == [(0, 16, "cpu"), (16, 32, "cpu")]
    eng.pin(b)
    assert eng.clear(tier="cpu") == {"cpu": 2}  # a goes, pinned b stays
    assert eng.lookup(a) == 0
    assert [w for _, _, w in eng.locate(b)] == ["cpu", "cpu"]
    assert eng.clear(tier="cpu", force=True) == {"cpu": 2}
    assert [w for _, _, w in eng.locate(b)] == ["remote", "remote"]
    assert eng.clear() == {"cpu": 0, "remote": 2}
    assert eng.lookup(b) == 0
    with pytest.raises(ValueError, match="unknown tier 'disk'"):
        eng.clear(tier="disk")


def test_move_to_remote_and_back(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"mem://{store_name}")
    toks = prompt(40, 16)
    eng.store(toks, kv_for(toks))
    assert eng.wait_for_writes(10)
    eng.clear(tier="remote")
    assert eng.move(toks, "remote") == 2 * CHUNK_BYTES
    assert eng.locate(toks) == [(0, 16, "remote"), (16, 32, "remote")]
    assert eng.lookup(toks) == 32
    assert eng.cpu.contains(eng.keys.keys(toks)) == [False, False]
    assert eng.move(toks, "cpu") == 2 * CHUNK_BYTES
    assert [w for _, _, w in eng.locate(toks)] == ["cpu", "cpu"]
    assert_retrieves(eng, toks, 32)
    with pytest.raises(ValueError, match="unknown tier"):
        eng.move(toks, "tape")


# -- stats and validation ---------------------------------------------------------------
def test_stats_keys(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"mem://{store_name}")
    toks = prompt(32, 17)
    eng.store(toks, kv_for(toks))
    eng.retrieve(toks)
    st = eng.stats()
    assert set(st) == {"engine", "cpu", "remote"}
    for name in ("cpu", "remote"):
        for counter in ("hits", "misses", "stores", "evictions", "corrupt", "errors", "skipped_stores"):
            assert isinstance(st[name][counter], int), (name, counter)
    assert st["cpu"]["pinned"] == 0
    assert st["cpu"]["capacity_bytes"] == 64 * CHUNK_BYTES
    assert st["cpu"]["stores"] == 2
    assert st["cpu"]["hits"] == 2
    assert st["remote"]["health"] == "up"
    assert "write_queue_depth" in st["remote"]


def test_wrong_kv_shape_or_dtype_names_expected_and_actual(make: Callable[..., CacheEngine]) -> None:
    eng = make()
    toks = prompt(32, 18)
    with pytest.raises(ValueError) as exc:
        eng.store(toks, torch.zeros(2, 2, 31, 2, 8))
    assert "(2, 2, 31, 2, 8)" in str(exc.value) and "(2, 2, 32, 2, 8)" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        eng.store(toks, torch.zeros(LAYOUT.shape(32), dtype=torch.float16))
    assert "float16" in str(exc.value) and "float32" in str(exc.value)
    with pytest.raises(ValueError, match=r"\(2, 2, 32, 2, 8\)"):
        eng.store(toks, torch.zeros(2, 32, 2, 2, 8))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        eng.store(toks, np.zeros(LAYOUT.shape(32), dtype=np.float32))  # type: ignore[arg-type]
    assert eng.lookup(toks) == 0
    assert eng.stats()["cpu"]["objects"] == 0


@pytest.mark.parametrize("bad", ["hello", [1.0, 2.0], [1, None], np.zeros((2, 16), dtype=np.int64)])
def test_tokens_not_ints_raise_type_error(make: Callable[..., CacheEngine], bad: object) -> None:
    eng = make()
    with pytest.raises(TypeError):
        eng.store(bad, torch.zeros(LAYOUT.shape(2)))
    with pytest.raises(TypeError):
        eng.lookup(bad)
    with pytest.raises(TypeError):
        eng.retrieve(bad)
    with pytest.raises(ValueError):
        eng.lookup([-1] * 16)


def test_pool_full_of_pinned_chunks_skips_and_counts(make: Callable[..., CacheEngine]) -> None:
    eng = make(max_local_cpu_size=cpu_gb(2))
    a, b = prompt(32, 19), prompt(32, 20)
    eng.store(a, kv_for(a))
    eng.pin(a)
    assert eng.store(b, kv_for(b)) == 0
    st = eng.stats()
    # Both chunks of b are dropped (the second is useless without the first), and say why.
    assert st["engine"]["skipped_stores"] == 2
    assert st["engine"]["skipped_by_reason"] == {"pool_full": 2}
    assert st["cpu"]["skipped_by_reason"]["pool_full"] >= 1
    assert eng.lookup(b) == 0
    assert_retrieves(eng, a, 32)


def test_pool_too_small_for_a_chunk_is_a_config_error() -> None:
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        CacheEngine({"chunk_size": CS, "max_local_cpu_size": 1e-9}, layout=LAYOUT, model_id="m")


# -- disk: write-through and write-back -------------------------------------------------
def _disk_keys_present(eng: CacheEngine, tokens: list[int]) -> list[bool]:
    return eng.lower["disk"].contains(eng.keys.keys(tokens))


def test_write_through_reaches_disk_at_once(make: Callable[..., CacheEngine], tmp_path: Path) -> None:
    eng = make(local_disk=str(tmp_path / "disk"), max_local_cpu_size=cpu_gb(4))
    a = prompt(32, 21)
    eng.store(a, kv_for(a))
    assert eng.wait_for_writes(10)
    assert _disk_keys_present(eng, a) == [True, True]
    eng.clear(tier="cpu")
    assert eng.locate(a) == [(0, 16, "disk"), (16, 32, "disk")]
    assert_retrieves(eng, a, 32)


def test_write_back_reaches_disk_only_on_eviction(make: Callable[..., CacheEngine], tmp_path: Path) -> None:
    eng = make(local_disk=str(tmp_path / "disk"), write_mode="back", max_local_cpu_size=cpu_gb(2))
    a, b = prompt(32, 22), prompt(32, 23)
    assert eng.store(a, kv_for(a)) == 32
    assert eng.wait_for_writes(10)
    assert _disk_keys_present(eng, a) == [False, False]
    assert eng.store(b, kv_for(b)) == 32  # evicts a's two chunks, which are written back
    assert eng.wait_for_writes(10)
    assert _disk_keys_present(eng, a) == [True, True]
    assert _disk_keys_present(eng, b) == [False, False]
    assert eng.stats()["cpu"]["evictions"] == 2
    assert eng.locate(a) == [(0, 16, "disk"), (16, 32, "disk")]
    assert_retrieves(eng, a, 32)  # from disk, promoted (evicting b to disk in turn)
    assert eng.wait_for_writes(10)
    assert_retrieves(eng, b, 32)


# -- faults -----------------------------------------------------------------------------
def test_remote_down_never_fails_the_request(make: Callable[..., CacheEngine], store_name: str) -> None:
    eng = make(remote_url=f"faulty://{store_name}")
    remote = eng.lower["remote"]
    assert isinstance(remote, FaultyTier)
    remote.down = True
    a = prompt(32, 24)
    assert eng.store(a, kv_for(a)) == 32
    assert eng.wait_for_writes(10)
    assert eng.stats()["remote"]["errors"] >= 1
    assert eng.stats()["remote"]["health"] == "down"
    assert_retrieves(eng, a, 32)  # from cpu
    eng.clear(tier="cpu")
    errors = eng.stats()["remote"]["errors"]
    assert eng.lookup(a) == 0
    assert eng.locate(a) == []
    assert eng.retrieve(a)[0] == 0
    assert eng.prefetch(a)
    eng.prefetcher.wait(10)
    assert eng.clear() == {"cpu": 0, "remote": 0}
    assert eng.stats()["remote"]["errors"] > errors
    remote.down = False
    b = prompt(32, 25)
    eng.store(b, kv_for(b))
    assert eng.wait_for_writes(10)
    assert remote.contains(eng.keys.keys(b)) == [True, True]


def test_remote_down_falls_back_to_disk(
    make: Callable[..., CacheEngine], store_name: str, tmp_path: Path
) -> None:
    eng = make(remote_url=f"faulty://{store_name}", local_disk=str(tmp_path / "d"))
    a = prompt(32, 26)
    eng.store(a, kv_for(a))
    assert eng.wait_for_writes(10)
    eng.lower["remote"].down = True  # type: ignore[attr-defined]
    eng.clear(tier="cpu")
    assert eng.lookup(a) == 32
    assert_retrieves(eng, a, 32)


def test_corrupt_remote_chunk_is_a_miss_never_wrong_kv(
    make: Callable[..., CacheEngine], store_name: str
) -> None:
    eng = make(remote_url=f"faulty://{store_name}")
    remote = eng.lower["remote"]
    assert isinstance(remote, FaultyTier)
    a = prompt(48, 27)
    remote.corrupt_next = True  # the first chunk written is damaged
    eng.store(a, kv_for(a))
    assert eng.wait_for_writes(10)
    eng.clear(tier="cpu")
    assert eng.retrieve(a)[0] == 0
    assert eng.stats()["remote"]["corrupt"] == 1
    assert remote.contains(eng.keys.keys(a)) == [False, True, True]  # the bad one was dropped

    # damage the second chunk of another prompt by hand: the first still loads
    b = prompt(48, 28)
    eng.store(b, kv_for(b))
    assert eng.wait_for_writes(10)
    eng.clear(tier="cpu")
    raw = remote.raw_store()
    k1 = eng.keys.keys(b)[1].text
    blob = bytearray(raw[k1])
    blob[len(blob) // 2 + 40] ^= 0x10
    raw[k1] = bytes(blob)
    assert_retrieves(eng, b, 16)
    assert eng.stats()["remote"]["corrupt"] == 2


def test_foreign_chunk_under_our_key_is_never_served(
    make: Callable[..., CacheEngine], store_name: str
) -> None:
    """A valid chunk whose tokens differ from the prompt (a collision, a buggy writer)."""
    from kvmesh.core import serde

    eng = make(remote_url=f"mem://{store_name}")
    remote = eng.lower["remote"]
    assert isinstance(remote, MemoryTier)
    a, other = prompt(32, 29), prompt(32, 30)
    key = eng.keys.keys(a)[0]
    fake = kv_for(other)[:, :, :16].contiguous().view(torch.uint8).reshape(-1).numpy()
    remote.raw_store()[key.text] = serde.encode_bytes(
        key, LAYOUT, np.array(other[:16], dtype=np.uint32), fake
    )
    assert eng.retrieve(a)[0] == 0
    assert eng.stats()["remote"]["corrupt"] == 1


# -- threads ----------------------------------------------------------------------------
def test_concurrent_store_and_retrieve_give_exact_bytes(
    make: Callable[..., CacheEngine], store_name: str
) -> None:
    eng = make(remote_url=f"mem://{store_name}", max_local_cpu_size=cpu_gb(12))
    base = prompt(32, 31)
    prompts = [base + prompt(32, s) for s in range(40, 44)] + [prompt(64, s) for s in range(50, 54)] + [base]
    expected = {id(p): kv_for(p) for p in prompts}
    errors: list[BaseException] = []
    deadline = time.monotonic() + 2.0

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            while time.monotonic() < deadline:
                p = rnd.choice(prompts)
                op = rnd.random()
                if op < 0.4:
                    stored = eng.store(p, expected[id(p)])
                    assert stored % CS == 0 and stored <= len(p)
                elif op < 0.95:
                    n, kv = eng.retrieve(p)
                    assert n % CS == 0 and n <= len(p)
                    assert torch.equal(kv, expected[id(p)][:, :, :n]), f"wrong KV for {n} tokens"
                else:
                    eng.clear(tier="cpu")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert eng.wait_for_writes(10)
    for p in prompts:
        eng.store(p, expected[id(p)])
        n, kv = eng.retrieve(p)
        assert torch.equal(kv, expected[id(p)][:, :, :n])
    assert eng.cpu.pool.free_slots + len(eng.cpu) == eng.cpu.pool.num_slots  # no leaked slot


def test_write_back_steady_state_skips_nothing(make: Callable[..., CacheEngine], tmp_path: Path) -> None:
    eng = make(local_disk=str(tmp_path / "disk"), write_mode="back", max_local_cpu_size=cpu_gb(2))
    prompts = [prompt(32, s) for s in range(60, 66)]
    for p in prompts:
        assert eng.store(p, kv_for(p)) == 32
    assert eng.wait_for_writes(10)
    st = eng.stats()
    assert st["engine"]["skipped_stores"] == 0
    assert st["cpu"]["skipped_stores"] == 0
    for p in prompts[:-1]:
        assert _disk_keys_present(eng, p) == [True, True]
    for p in prompts:
        assert_retrieves(eng, p, 32)
