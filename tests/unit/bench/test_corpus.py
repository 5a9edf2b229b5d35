"""Realistic text for the router benchmarks: a Zipf word distribution, not a tiny vocabulary."""

from __future__ import annotations

import random
from collections import Counter

from kvmesh.bench.common.corpus import Corpus


def test_words_follow_zipf_with_a_long_tail() -> None:
    corpus = Corpus(size=5000, seed=3)
    text = corpus.words(random.Random(1), 20_000)
    words = [w.strip(".,?!").lower() for w in text.split()]
    assert len(words) == 20_000
    counts = Counter(words).most_common()
    # the most common word is far more frequent than the 100th, and most words are rare
    assert counts[0][1] > 20 * counts[99][1]
    assert len(counts) > 2000  # a 47-word vocabulary would give 47
    assert sum(1 for _, c in counts if c == 1) > 500


def test_deterministic_per_seed() -> None:
    corpus = Corpus(size=1000)
    assert corpus.words(random.Random(5), 50) == corpus.words(random.Random(5), 50)
    assert corpus.words(random.Random(5), 50) != corpus.words(random.Random(6), 50)
