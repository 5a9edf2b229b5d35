"""BlockIndex: media, REMOTE sharing, eviction bound, speculative TTL, mixed block sizes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvmesh.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.index import BlockIndex, Medium, PrefixMatch, PromptKeys
from kvmesh.index.speculative import SpeculativeTable

G, C, D, R = Medium.GPU, Medium.CPU, Medium.DISK, Medium.REMOTE
TOKENS = tuple(range(100, 612))  # 512 tokens


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stored(
    hashes: list[int] | range,
    tokens: tuple[int, ...],
    bs: int = 16,
    parent: int | bytes | None = None,
    medium: str | None = None,
    **kw: object,
) -> EventBatch:
    ev = BlockStored(tuple(hashes), parent, tokens, bs, medium=medium, **kw)  # type: ignore[arg-type]
    return EventBatch(0.0, (ev,))


def removed(hashes: list[int], medium: str | None = None) -> EventBatch:
    return EventBatch(0.0, (BlockRemoved(tuple(hashes), medium),))


def ranges(index: BlockIndex, tokens: object = TOKENS, **kw: object) -> dict[str, tuple[object, ...]]:
    return {name: m.ranges for name, m in index.match(tokens, **kw).items()}  # type: ignore[arg-type]


def test_chained_events_and_best_medium() -> None:
    idx = BlockIndex()
    idx.apply("a", stored([1, 2], TOKENS[:32]))
    idx.apply("a", stored([3], TOKENS[32:48], parent=2))
    idx.apply("a", stored([1, 2, 3, 4], TOKENS[:64], medium="CPU"))  # offloaded copy
    assert ranges(idx) == {"a": ((0, 48, G), (48, 64, C))}
    idx.apply("a", removed([2]))  # GPU copy of block 2 evicted: CPU still has it
    assert ranges(idx) == {"a": ((0, 16, G), (16, 32, C), (32, 48, G), (48, 64, C))}
    idx.apply("a", removed([2], "CPU"))
    assert ranges(idx) == {"a": ((0, 16, G),)}
    m = idx.match(list(TOKENS))["a"]
    assert m.tokens == 16 and m.tokens_by_medium() == {G: 16}


def test_engine_hashes_are_opaque_per_replica() -> None:
    idx = BlockIndex()
    # Different engine hash algorithms (int vs bytes, other seeds) for the same tokens.
    idx.apply("a", stored([1, 2], TOKENS[:32]))
    idx.apply("b", stored([b"\x01" * 32, b"\x02" * 32], TOKENS[:32], medium="DISK"))
    idx.apply("b", stored([b"\x03" * 32], TOKENS[32:48], parent=b"\x02" * 32, medium="DISK"))
    assert ranges(idx) == {"a": ((0, 32, G),), "b": ((0, 48, D),)}
    idx.apply("b", removed([2]))  # hash 2 is a's, not b's: nothing happens to b
    assert ranges(idx)["b"] == ((0, 48, D),)


def test_orphans_and_bad_events_are_counted_not_indexed() -> None:
    idx = BlockIndex()
    idx.apply("a", stored([5], TOKENS[16:32], parent=4))
    idx.apply("a", stored([1, 2], TOKENS[:20]))  # token count does not fit
    for i, medium in enumerate(("X1", "X2", "X3", "X4")):  # four media kept by their names ...
        idx.apply("b", stored([10 + i], TOKENS[:16], medium=medium))
    idx.apply("a", stored([1], TOKENS[:16], medium="TAPE"))  # ... and no room for a fifth
    idx.apply("a", stored([1], TOKENS[:16], group_idx=1))
    idx.apply("a", stored([1], (), bs=0, medium="CPU"))  # vLLM offloading placeholder
    stats = idx.stats()
    counted = ("orphans", "invalid", "unknown_medium", "ignored_group", "placeholders")
    assert [stats[k] for k in counted] == [1, 1, 1, 1, 1]
    assert len(idx) == 1 and set(idx.match(TOKENS)) == {"b"}


def test_remote_is_shared_by_every_registered_replica() -> None:
    idx = BlockIndex()
    idx.add_replica("b")
    idx.apply("a", stored([1, 2], TOKENS[:32], medium="REMOTE"))
    idx.apply("a", stored([1], TOKENS[:16], medium="GPU"))
    assert ranges(idx) == {"a": ((0, 16, G), (16, 32, R)), "b": ((0, 32, R),)}
    assert ranges(idx, replicas=["b", "nobody"]) == {"b": ((0, 32, R),)}
    idx.remove_replica("a")  # the reporter leaves: its REMOTE entries go with it
    assert idx.match(TOKENS) == {}
    assert idx.replicas() == ["b"]


def test_clear_and_remove_replica() -> None:
    idx = BlockIndex()
    idx.apply("a", stored([1, 2], TOKENS[:32]))
    idx.apply("b", stored([7], TOKENS[:16], medium="CPU"))
    idx.apply("a", EventBatch(0.0, (AllBlocksCleared(),)))
    assert ranges(idx) == {"b": ((0, 16, C),)}
    assert idx.replicas() == ["a", "b"]
    idx.apply("a", stored([1], TOKENS[:16]))  # a starts again from scratch
    assert ranges(idx) == {"a": ((0, 16, G),), "b": ((0, 16, C),)}
    idx.remove_replica("b")
    idx.apply("c", stored([9], TOKENS[:16], medium="DISK"))  # may reuse b's slot
    assert ranges(idx) == {"a": ((0, 16, G),), "c": ((0, 16, D),)}
    assert len(idx) == 1


def test_a_batch_from_an_unregistered_replica_is_dropped_when_registering_is_off() -> None:
    """The router's subscribers apply with ``register=False``: a batch that lands after its
    replica was removed is dropped and counted, where the default registers the sender."""
    idx = BlockIndex()
    idx.add_replica("a")
    idx.apply("a", stored([1, 2], TOKENS[:32]), register=False)
    assert ranges(idx) == {"a": ((0, 32, G),)}
    idx.remove_replica("a")
    idx.apply("a", stored([1, 2], TOKENS[:32]), register=False)
    idx.apply("never", stored([5], TOKENS[:16], medium="CPU"), register=False)
    assert idx.replicas() == [] and ranges(idx) == {} and len(idx) == 0
    assert idx.stats()["unregistered"] == 2
    idx.apply("a", stored([1], TOKENS[:16]))  # the default still registers
    assert idx.replicas() == ["a"] and ranges(idx) == {"a": ((0, 16, G),)}


def test_lora_cache_salt_and_multimodal_keys_separate_prefixes() -> None:
    idx = BlockIndex()
    # vLLM 0.32's extra_keys per block: the LoRA name on every block, the salt on the first,
    # (mm_identifier, offset) pairs where an image is.
    idx.apply("a", stored([1, 2], TOKENS[:32], lora_name="ad", extra_keys=(("ad",), ("ad",))))
    idx.apply("b", stored([1, 2], TOKENS[:32], extra_keys=(("s1",), None)))
    idx.apply("c", stored([1, 2], TOKENS[:32], lora_name="ad", extra_keys=(("ad", "s1"), ("ad",))))
    idx.apply("d", stored([1, 2], TOKENS[:32], extra_keys=(None, (("img", 3),))))
    idx.apply("e", stored([1, 2], TOKENS[:32], extra_keys=(None, None)))
    assert ranges(idx) == {"d": ((0, 16, G),), "e": ((0, 32, G),)}
    assert ranges(idx, lora_name="ad") == {"a": ((0, 32, G),)}
    assert ranges(idx, cache_salt="s1") == {"b": ((0, 32, G),)}
    assert ranges(idx, lora_name="ad", cache_salt="s1") == {"c": ((0, 32, G),)}
    idx.add_speculative("f", TOKENS[:32], cache_salt="s2")
    assert ranges(idx, cache_salt="s2") == {"f": ((0, 32, G),)}


def test_mixed_block_sizes_combine_to_the_longest_prefix() -> None:
    idx = BlockIndex()
    idx.apply("a", stored([1, 2], TOKENS[:32], bs=16))  # vLLM GPU blocks
    idx.apply("a", stored([10, 11], TOKENS[:512], bs=256, medium="CPU"))  # kvmesh chunks
    idx.apply("a", stored([20], TOKENS[:128], bs=128, medium="DISK"))  # vLLM CPU block size
    idx.apply("b", stored([30], TOKENS[:128], bs=128))
    assert ranges(idx) == {"a": ((0, 32, G), (32, 512, C)), "b": ((0, 128, G),)}
    assert ranges(idx, block_size=128) == {"a": ((0, 128, D),), "b": ((0, 128, G),)}
    m = idx.match(TOKENS)["a"]
    assert m.tokens == 512 and m.tokens_by_medium() == {G: 32, C: 480}
    assert m.block_mediums(128) == [C, C, C, C]
    assert m.block_mediums(16)[:3] == [G, G, C]
    assert PrefixMatch(((0, 10, G), (10, 20, C))).block_mediums(16) == [C]


def test_eviction_keeps_the_bound_and_the_recently_used() -> None:
    idx = BlockIndex(max_blocks=20)
    prompts = [tuple(range(i * 1000, i * 1000 + 64)) for i in range(10)]
    for i, p in enumerate(prompts[:5]):
        idx.apply("a", stored(range(i * 10, i * 10 + 4), p))
    assert len(idx) == 20
    assert "a" in idx.match(prompts[0])  # touching prompt 0 makes prompt 1 the oldest
    idx.apply("a", stored(range(50, 54), prompts[5]))
    assert len(idx) == 20 and idx.stats()["evictions"] == 4
    assert idx.match(prompts[1]) == {}
    assert idx.match(prompts[0])["a"].tokens == 64
    for i, p in enumerate(prompts[6:], start=6):
        idx.apply("a", stored(range(i * 10, i * 10 + 4), p))
    assert len(idx) == 20
    # Engine-hash maps shrink with the blocks: removing evicted hashes is a no-op, and a
    # child of an evicted parent is an orphan.
    assert idx._table.records == 20
    idx.apply("a", removed(list(range(0, 100))))
    assert len(idx) == 0
    idx.apply("a", stored([99], tuple(range(5000, 5016)), parent=3))
    assert idx.stats()["orphans"] == 1


def test_speculative_entries_expire() -> None:
    clock = Clock()
    idx = BlockIndex(clock=clock, default_block_size=16)
    idx.add_speculative("a", TOKENS[:40], ttl_s=2.0)  # before any event: default size 16
    assert ranges(idx) == {"a": ((0, 32, G),)}
    idx.apply("b", stored([1], TOKENS[:128], bs=128, medium="CPU"))
    idx.add_speculative("b", TOKENS, ttl_s=1.0)  # now the sizes seen: 16 (spec) and 128
    assert ranges(idx) == {"a": ((0, 32, G),), "b": ((0, 512, G),)}
    clock.t = 1.5
    assert ranges(idx) == {"a": ((0, 32, G),), "b": ((0, 128, C),)}
    idx.add_speculative("a", TOKENS[:16], ttl_s=5.0)  # refresh the first block only
    clock.t = 3.0
    assert ranges(idx) == {"a": ((0, 16, G),), "b": ((0, 128, C),)}
    clock.t = 10.0
    assert ranges(idx) == {"b": ((0, 128, C),)}
    assert idx.stats()["speculative_blocks"] == 0
    assert idx._sizes() == (128,)


def test_prompt_keys_are_hashed_once_and_match_like_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router hashes a prompt once for its match and its speculative entry together."""
    import kvmesh.index.prefix as prefix

    clock = Clock()
    idx = BlockIndex(clock=clock)
    idx.apply("a", stored([1, 2], TOKENS[:32]))
    idx.apply("a", stored([3], TOKENS[:128], bs=128, medium="CPU"))
    calls: list[int] = []
    real = prefix.query_chain
    monkeypatch.setattr(prefix, "query_chain", lambda t, bs, *a: calls.append(bs) or real(t, bs, *a))
    prompt = PromptKeys(np.array(TOKENS, dtype=np.uint32))
    assert ranges(idx, prompt) == ranges(idx, TOKENS) == {"a": ((0, 32, G), (32, 128, C))}
    idx.add_speculative("b", prompt, ttl_s=1.0)
    assert ranges(idx, prompt)["b"] == ((0, 512, G),)
    assert sorted(calls) == [16, 16, 128, 128]  # twice per size: once for the tuple TOKENS
    assert len(prompt) == 512
    # A LoRA name or salt given with a PromptKeys must be the one it was made for.
    salted = PromptKeys(TOKENS[:32], cache_salt="s")
    assert PromptKeys.of(salted) is salted and PromptKeys.of(salted, cache_salt="s") is salted
    with pytest.raises(ValueError, match="cache_salt"):
        idx.match(salted, cache_salt="t")
    with pytest.raises(ValueError, match="lora_name"):
        idx.add_speculative("b", salted, lora_name="ad")
    idx.add_speculative("c", salted)
    assert ranges(idx, TOKENS[:32], cache_salt="s") == {"c": ((0, 32, G),)}
    with pytest.raises(TypeError):
        PromptKeys("hello")


def test_speculative_table_sweeps_expired_keys_and_keeps_the_latest_expiry() -> None:
    table = SpeculativeTable()
    keys = [bytes([i]) * 16 for i in range(40)]
    table.add(0, 16, tuple(keys[:10]), 5.0)
    table.add(0, 16, tuple(keys[:5]), 3.0)  # earlier than what key 0-4 have: they keep 5.0
    table.expire(4.0)
    assert sorted(table.holders(keys[0], 4.0)) == [0] and table.sizes[16] == 1
    # A batch every 10 ms living 1 s: expired keys are swept in bulk, so the table stays near
    # its ~200 live keys (bounded by twice that plus a slack) instead of growing to 2,000.
    for t in range(2000):
        now = 10.0 + t * 0.01
        table.expire(now)
        table.add(1, 16, (keys[t % 40], t.to_bytes(16, "little")), now + 1.0)
    assert len(table) < 700
    assert list(table.holders(keys[0], 30.0)) == [1]  # rid 0's batches expired at 3.0 and 5.0
    assert list(table.holders(keys[5], 30.6)) == [1]  # last added at t=1965: held until 30.65
    assert list(table.holders(keys[5], 30.7)) == []
    table.drop(1)
    table.expire(100.0)
    assert len(table) == 0 and table.sizes == {16: 0}


def test_token_validation() -> None:
    idx = BlockIndex()
    with pytest.raises(TypeError):
        idx.match("hello")
    with pytest.raises(TypeError):
        idx.match([1.5, 2.5])
    with pytest.raises(ValueError):
        idx.match([-1, 2])
    assert idx.match([]) == {} and idx.match(np.arange(10)) == {}


def test_concurrent_events_and_lookups() -> None:
    idx = BlockIndex(max_blocks=500)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(name: str) -> None:
        try:
            for i in range(300):
                toks = tuple(range(i % 7 * 100, i % 7 * 100 + 64))
                idx.apply(name, stored(range(i * 4, i * 4 + 4), toks, medium=("GPU", "CPU")[i % 2]))
                if i % 50 == 0:
                    idx.clear_replica(name)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                idx.match(tuple(range(300, 364)))
                idx.add_speculative("s", tuple(range(64)), ttl_s=0.001)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(3)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert errors == []
    assert len(idx) <= 500


def test_media_without_an_alias_are_kept_by_name_and_ranked_below_the_replicas_own() -> None:
    """A publisher's medium with no alias is indexed under its name; a replica's best medium
    on a block is its own GPU, CPU, disk, then a named local medium, then a named one on
    another host (whatever order they came in), then the shared tier."""
    idx = BlockIndex()
    idx.apply("b", stored([1, 2], TOKENS[:32], medium="nvme_of"))  # the medium's name is case-blind
    idx.apply("b", stored([1], TOKENS[:16], medium="DISK"))
    idx.apply("a", stored([1, 2], TOKENS[:32], medium="STORAGE:REMOTE"))  # met after NVME_OF
    idx.apply("a", stored([1], TOKENS[:16], medium="NVME_OF"))
    got = {n: [(s, e, getattr(m, "name", m)) for s, e, m in r] for n, r in ranges(idx).items()}
    assert got == {
        "a": [(0, 16, "NVME_OF"), (16, 32, "STORAGE:REMOTE")],
        "b": [(0, 16, "DISK"), (16, 32, "NVME_OF")],
    }
    assert idx.media.named == ("NVME_OF", "STORAGE:REMOTE") and idx.stats()["unknown_medium"] == 0
    idx.apply("a", removed([1], "NVME_OF"))  # removing one medium leaves the other
    assert [(s, e, m.name) for s, e, m in ranges(idx)["a"]] == [(0, 32, "STORAGE:REMOTE")]
    # vLLM 0.32's qualifiers: a tier of another host or a secondary tier is not this replica's disk
    idx.apply("c", stored([1], TOKENS[:16], medium="STORAGE", locality="REMOTE", ownership="obj"))
    assert [m.name for _, _, m in ranges(idx)["c"]] == ["STORAGE:REMOTE/obj"]


def test_a_sliding_window_group_never_counts_as_a_prefix() -> None:
    # vLLM 0.32 tags stores with their group's kind: kvmesh's swa model has group 0 = sliding
    # window (window 32 here) and group 1 = full attention. Only group 1 names a prefix.
    idx = BlockIndex()
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}
    idx.apply("a", stored([1, 2, 3], TOKENS[:48], **swa))
    assert ranges(idx) == {} and idx.stats()["ignored_group"] == 1
    idx.apply("a", stored([11, 12], TOKENS[:32], group_idx=1, kv_cache_spec_kind="full_attention"))
    assert ranges(idx) == {"a": ((0, 32, G),)}
    idx.apply("a", removed([1, 2, 3]))  # group 0's removals (group_idx None = 0) leave group 1 alone
    assert ranges(idx) == {"a": ((0, 32, G),)}
    idx.apply("a", EventBatch(0.0, (BlockRemoved((12,), None, 1),)))  # the full group's own removal
    assert ranges(idx) == {"a": ((0, 16, G),)}
