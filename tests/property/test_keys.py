"""Properties of chunk keys: determinism, the prefix property, isolation, string form."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout

LAYOUT = KVLayout(2, 2, 8, "float32")
TOKEN = st.integers(min_value=0, max_value=2**32 - 1)
# Small vocabularies make equal chunks (and equal prefixes) likely, which is where bugs hide.
SMALL_TOKEN = st.integers(min_value=0, max_value=3)
TOKENS = st.lists(st.one_of(TOKEN, SMALL_TOKEN), max_size=40)
CHUNK_SIZE = st.integers(min_value=1, max_value=8)
SALT = st.one_of(st.none(), st.text(max_size=8))

FAST = settings(deadline=None, max_examples=60)


def texts(builder: KeyBuilder, tokens: object) -> list[str]:
    return [k.text for k in builder.keys(tokens)]


@FAST
@given(tokens=TOKENS, cs=CHUNK_SIZE, salt=SALT, shard=st.integers(0, 7))
def test_keys_are_deterministic_and_independent_of_input_container(
    tokens: list[int], cs: int, salt: str | None, shard: int
) -> None:
    a = KeyBuilder("m", LAYOUT, cs, shard=shard, salt=salt)
    b = KeyBuilder("m", KVLayout(2, 2, 8, "float32"), cs, shard=shard, salt=salt)
    first = texts(a, tokens)
    assert first == texts(a, tokens)
    assert first == texts(b, tokens)
    assert first == texts(b, tuple(tokens))
    assert first == texts(b, np.array(tokens, dtype=np.int64))
    assert first == texts(b, np.array(tokens, dtype=np.uint32))
    assert len(first) == len(tokens) // cs
    assert len(set(first)) == len(first), "two chunks of one prompt share a key"


@FAST
@given(tokens=TOKENS, cs=CHUNK_SIZE)
def test_prefix_property(tokens: list[int], cs: int) -> None:
    kb = KeyBuilder("m", LAYOUT, cs)
    full = kb.keys(tokens)
    for k in range(len(tokens) // cs + 1):
        assert kb.keys(tokens[: k * cs]) == full[:k]
        # tokens after the last full chunk boundary never change the keys before it
        assert kb.keys(tokens[: k * cs + cs - 1]) == full[:k]


@FAST
@given(tokens=TOKENS, cs=CHUNK_SIZE, data=st.data())
def test_changing_a_token_changes_its_chunk_key_and_all_later_ones(
    tokens: list[int], cs: int, data: st.DataObject
) -> None:
    n_full = len(tokens) // cs
    assume(n_full >= 1)
    pos = data.draw(st.integers(0, n_full * cs - 1), label="position")
    new = data.draw(TOKEN.filter(lambda t: t != tokens[pos]), label="new token")
    changed = list(tokens)
    changed[pos] = new
    kb = KeyBuilder("m", LAYOUT, cs)
    before, after = kb.keys(tokens), kb.keys(changed)
    i = pos // cs
    assert before[:i] == after[:i]
    for j in range(i, n_full):
        assert before[j] != after[j], f"chunk {j} key unchanged after editing chunk {i}"
        assert before[j].prefix_hash != after[j].prefix_hash


@FAST
@given(t1=TOKENS, t2=TOKENS, s1=SALT, s2=SALT, cs=CHUNK_SIZE)
def test_different_salts_never_share_a_key(
    t1: list[int], t2: list[int], s1: str | None, s2: str | None, cs: int
) -> None:
    assume(s1 != s2)
    a = KeyBuilder("m", LAYOUT, cs, salt=s1)
    b = KeyBuilder("m", LAYOUT, cs, salt=s2)
    for other in (t1, t2):
        ka, kb = a.keys(t1), b.keys(other)
        assert not set(texts(a, t1)) & set(texts(b, other))
        assert not {k.prefix_hash for k in ka} & {k.prefix_hash for k in kb}
        assert all(not b.owns(k) for k in ka)
        assert all(not a.owns(k) for k in kb)


VARIANTS = [
    ("m", LAYOUT, 4),
    ("m2", LAYOUT, 4),
    ("M", LAYOUT, 4),
    ("m", KVLayout(3, 2, 8, "float32"), 4),
    ("m", KVLayout(2, 1, 8, "float32"), 4),
    ("m", KVLayout(2, 2, 16, "float32"), 4),
    ("m", KVLayout(2, 2, 8, "float16"), 4),
    ("m", KVLayout(2, 2, 8, "bfloat16"), 4),
    ("m", LAYOUT, 2),
    ("m", LAYOUT, 8),
]


@FAST
@given(tokens=st.lists(SMALL_TOKEN, min_size=8, max_size=40), i=st.integers(0, 9), j=st.integers(0, 9))
def test_different_models_layouts_and_chunk_sizes_never_share(tokens: list[int], i: int, j: int) -> None:
    assume(i != j)
    a = KeyBuilder(*VARIANTS[i][:2], chunk_size=VARIANTS[i][2])
    b = KeyBuilder(*VARIANTS[j][:2], chunk_size=VARIANTS[j][2])
    assert a.namespace != b.namespace
    ka, kb = a.keys(tokens), b.keys(tokens)
    assert ka and kb
    assert not set(texts(a, tokens)) & set(texts(b, tokens))
    assert not {k.prefix_hash for k in ka} & {k.prefix_hash for k in kb}


def test_shards_get_distinct_keys_for_the_same_prefix() -> None:
    tokens = list(range(16))
    k0 = KeyBuilder("m", LAYOUT, 4, shard=0).keys(tokens)
    k1 = KeyBuilder("m", LAYOUT, 4, shard=1).keys(tokens)
    assert not {k.text for k in k0} & {k.text for k in k1}


@FAST
@given(tokens=TOKENS, cs=CHUNK_SIZE, shard=st.integers(0, 1000), unfull=st.booleans())
def test_string_form_round_trips(tokens: list[int], cs: int, shard: int, unfull: bool) -> None:
    kb = KeyBuilder("m", LAYOUT, cs, shard=shard, save_unfull_chunk=unfull)
    for key in kb.keys(tokens):
        text = str(key)
        assert text == key.text
        assert text.startswith(f"kvm2-{kb.namespace}-r{shard}-")
        assert ChunkKey.parse(text, cs) == key
        assert kb.parse(text) == key
        assert kb.owns(ChunkKey.parse(text, cs))


HEX = "0123456789abcdef"
HEXISH = st.text(alphabet="0123456789abcdefABCDEFg", min_size=14, max_size=66)
DIGITS = st.text(alphabet="0123456789\u0663", min_size=0, max_size=4)  # U+0663: an Arabic-Indic 3
OLD_HASH = st.text(alphabet=HEX, min_size=32, max_size=32)  # kvm1's 128-bit xxh3
NEAR_KEYS = st.builds(
    lambda head, ns, shard, h, tail, end: f"{head}-{ns}-r{shard}-{h}{tail}{end}",
    st.sampled_from(["kvm2", "kvm2", "kvm1", "KVM2", ""]),
    st.one_of(st.text(alphabet=HEX, min_size=16, max_size=16), HEXISH),
    DIGITS,
    st.one_of(st.text(alphabet=HEX, min_size=64, max_size=64), OLD_HASH, HEXISH),
    st.one_of(st.just(""), DIGITS.map(lambda d: f"-p{d}")),
    st.sampled_from(["", "", "\n", " ", "-"]),
)


def canonical_key(text: str, cs: int) -> bool:
    """Independent oracle: the exact documented grammar, canonical numbers, partial < cs."""
    parts = text.split("-")
    if len(parts) not in (4, 5) or parts[0] != "kvm2":
        return False
    ns, shard, h = parts[1:4]

    def number(s: str) -> bool:
        return s.isascii() and s.isdigit() and (s == "0" or not s.startswith("0"))

    ok = len(ns) == 16 and set(ns) <= set(HEX) and len(h) == 64 and set(h) <= set(HEX)
    ok = ok and shard.startswith("r") and number(shard[1:])
    if len(parts) == 5:
        p = parts[4]
        ok = ok and p.startswith("p") and number(p[1:]) and 0 < int(p[1:]) < cs
    return ok


@FAST
@given(text=st.one_of(st.text(max_size=80), NEAR_KEYS), cs=st.integers(1, 8))
def test_parse_accepts_exactly_the_canonical_key_grammar(text: str, cs: int) -> None:
    """No input is filtered out: texts that look like keys are where a lax parser fails."""
    expected = canonical_key(text, cs)
    try:
        key = ChunkKey.parse(text, cs)
    except ValueError:
        assert not expected, f"rejected a valid key {text!r}"
        return
    assert expected, f"parsed a non-key {text!r}"
    assert key.text == text  # what parses is the canonical string form


@FAST
@given(tokens=TOKENS, cs=CHUNK_SIZE)
def test_save_unfull_chunk_adds_one_partial_key(tokens: list[int], cs: int) -> None:
    full = KeyBuilder("m", LAYOUT, cs).keys(tokens)
    with_partial = KeyBuilder("m", LAYOUT, cs, save_unfull_chunk=True).keys(tokens)
    rest = len(tokens) % cs
    assert with_partial[: len(full)] == full
    if rest == 0:
        assert with_partial == full
        assert all("-p" not in k.text for k in with_partial)
        return
    assert len(with_partial) == len(full) + 1
    last = with_partial[-1]
    assert last.num_tokens == rest
    assert last.text.endswith(f"-p{rest}")
    assert all(not k.text.endswith(f"-p{k.num_tokens}") for k in full)
    # the partial key names the whole prefix: it changes when an earlier token changes
    if len(tokens) > rest:
        changed = list(tokens)
        changed[0] = (changed[0] + 1) % 2**32
        assert KeyBuilder("m", LAYOUT, cs, save_unfull_chunk=True).keys(changed)[-1] != last
    # a longer tail is a different chunk, not the same key
    longer = [*tokens, 0]
    if (len(longer) % cs) != 0:
        assert KeyBuilder("m", LAYOUT, cs, save_unfull_chunk=True).keys(longer)[-1] != last
