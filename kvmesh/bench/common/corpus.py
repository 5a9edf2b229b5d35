"""Text with a realistic word distribution for the router benchmarks.

A 47-word vocabulary lets the router's per-word tokenizer cache hit every word, so its
tokenizing cost reads near zero. Natural text follows Zipf's law (the r-th most frequent
word appears ~1/r^s as often, s ~ 1.1): a few words are very common, most are rare, and a
new document brings words the cache has not seen. :class:`Corpus` draws words that way
from a vocabulary of ``size`` made-up words (1-4 syllables), with sentence punctuation and
capitals, deterministically from a seed.
"""

from __future__ import annotations

import bisect
import itertools
import random

_ONSETS = ("", "b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p",
           "pl", "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")


class Corpus:
    """``size`` distinct words ranked by frequency, drawn with Zipf exponent ``s``."""

    def __init__(self, size: int = 30_000, s: float = 1.1, seed: int = 0) -> None:
        if size < 2:
            raise ValueError(f"a corpus needs at least 2 words, got size={size}")
        rng = random.Random(seed)
        seen: set[str] = set()
        vocab: list[str] = []
        while len(vocab) < size:
            n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
            w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
            if w not in seen:
                seen.add(w)
                vocab.append(w)
        # Short words are the frequent ones in natural text.
        vocab.sort(key=len)
        self.vocab = vocab
        self._cum = list(itertools.accumulate(1.0 / (r**s) for r in range(1, size + 1)))

    def words(self, rng: random.Random, n: int) -> str:
        """``n`` words as sentences (5-20 words, capitalised, ending in . ? or !)."""
        out: list[str] = []
        total = self._cum[-1]
        left = 0
        for _ in range(n):
            i = min(bisect.bisect_left(self._cum, rng.random() * total), len(self.vocab) - 1)
            w = self.vocab[i]
            if left == 0:
                if out:
                    out[-1] += rng.choice(".?!.")
                w = w.capitalize()
                left = rng.randint(5, 20)
            elif rng.random() < 0.07:
                out[-1] += ","
            out.append(w)
            left -= 1
        return " ".join(out) + ("." if out else "")


_DEFAULT: Corpus | None = None


def default_corpus() -> Corpus:
    """One shared 30,000-word corpus (building it takes ~0.1 s)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Corpus()
    return _DEFAULT


def zipf_words(rng: random.Random, n: int) -> str:
    """``n`` words of :func:`default_corpus`."""
    return default_corpus().words(rng, n)
