"""``split_words`` (numpy-assisted word split) gives exactly ``_WORD_RE.split`` per piece."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router import tokenize
from kvmesh.router.testing import _WORDS
from kvmesh.router.tokenize import _WORD_RE, PromptTokenizer, split_words

# Characters around the cut rule's edges: spaces of every kind, digits, "_", letters that are
# not ASCII, a number that is no digit ("²"), a lone surrogate, CJK.
_ATOMS = [" ", "  ", "\n", "\t", "\x1c", "\u00a0", "\u2003", "1", "12", "_", "_x", "é", "Ω", "²", "½"]
_ATOMS += ["\ud800", "東京", "'s", "(", ".", "a", "Z", *_WORDS[:20]]


@pytest.fixture
def pt(tok_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tok_dir)


def _want(pieces: list[str]) -> list[list[str]]:
    return [_WORD_RE.split(p) for p in pieces]


@pytest.fixture
def numpy_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenize, "_NP_SPLIT_CHARS", 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_ATOMS), max_size=30).map("".join), max_size=12))
def test_split_words_equals_the_regex_split(pieces: list[str]) -> None:
    old = tokenize._NP_SPLIT_CHARS
    tokenize._NP_SPLIT_CHARS = 0  # not the fixture: hypothesis runs many examples per call
    try:
        assert split_words(pieces) == _want(pieces)
        assert split_words([" " + p for p in pieces]) == _want([" " + p for p in pieces])
    finally:
        tokenize._NP_SPLIT_CHARS = old


def test_split_words_on_long_cut_pieces(numpy_always: None, pt: PromptTokenizer) -> None:
    """The pieces ``_cut`` makes of a long text (each after the first starts at a space)."""
    rng = random.Random(4)
    for _ in range(20):
        text = " ".join(rng.choice(_ATOMS) for _ in range(rng.randint(1, 4000)))
        pieces = pt._cut(text)
        assert split_words(pieces) == _want(pieces)


def test_empty_and_tiny_pieces(numpy_always: None) -> None:
    for pieces in ([], [""], ["", " ", ""], [" "], ["a b"], [" a", "", " b c "], ["x", " y"]):
        assert split_words(pieces) == _want(pieces)


def test_long_new_prompts_keep_their_ids(pt: PromptTokenizer) -> None:
    """End to end above the numpy threshold: the ids are the tokenizer's own."""
    rng = random.Random(6)
    atoms = [a for a in _ATOMS if a != "\ud800"]  # tokenizers (Rust strings) refuses surrogates
    for _ in range(6):
        text = " ".join(rng.choice(atoms) for _ in range(rng.randint(2000, 6000)))
        assert len(text) > tokenize._NP_SPLIT_CHARS
        for add in (True, False):
            assert pt.encode(text, add).tolist() == pt._tok.encode(text, add_special_tokens=add).ids
