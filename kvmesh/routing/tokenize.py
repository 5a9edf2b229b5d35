"""Tokenize a request the way the vLLM engine will, without torch or transformers.

Importing ``transformers.AutoTokenizer`` pulls in torch (seconds of start-up), so the
tokenizer is ``tokenizers.Tokenizer.from_file(tokenizer.json)`` and the chat template is
rendered with jinja2 in the sandbox transformers uses, with the same options and globals.
``/v1/completions`` is ``encode(prompt, add_special_tokens=True)`` (BOS per tokenizer.json's
post-processor), a prompt of token ids used as is; a chat is rendered by
:mod:`kvmesh.routing.chat_template`, then ``encode(text, add_special_tokens=False)``.

Caching. Prompts that share a beginning (a system prompt, a growing chat, an agent's
transcript) are the common case for a prefix router, so a text is tokenized in pieces and
each piece is cached. tokenizers splits a text at added tokens *before* normalising and
pre-tokenizing and tokenizes each piece on its own, so splitting there gives the same ids;
long pieces are further cut at word starts (see ``_cut``), where the pre-tokenizer starts a
new pre-token anyway. A piece not seen before is cut at *every* word start and its words come
from a word cache: natural text repeats its words so much that a new prompt's ids are mostly
looked up rather than computed (a few times faster than tokenizers for a new 2,000-token
prompt); only new words go to tokenizers, in one batch. A self-check at load compares each
shortcut against whole-text encodes and turns off any that disagrees (e.g. Metaspace
"first", added tokens with lstrip/rstrip); exact repeats are cached whole as well.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from kvmesh.errors import TokenizeError
from kvmesh.routing.chat_template import ChatTemplate, find_template

TokenArray = np.ndarray  # 1-D uint32, what the index hashes without another conversion
# Cached ids are kept as the bytes of a uint32 array: joined by one b"".join, read by one
# np.frombuffer, and 4 bytes a token (a list of ints costs ~36).
_Ids = bytes


class _LRU:
    """LRU bounded by a total cost (~bytes held), so long prompts cannot blow memory.

    Locked: the router tokenizes large prompts on worker threads, small ones on its loop.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._d: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._cost = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        with self._lock:
            item = self._d.get(key)
            if item is None:
                self.misses += 1
                return None
            self.hits += 1
            self._d.move_to_end(key)
            return item[0]

    def put(self, key: Any, value: Any, cost: int) -> None:
        if cost > self.capacity:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._cost -= old[1]
            self._d[key] = (value, cost)
            self._cost += cost
            while self._cost > self.capacity:
                self._cost -= self._d.popitem(last=False)[1][1]


class PromptTokenizer:
    """A model's tokenizer and chat template; thread-safe (the caches are locked)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        cache_bytes: int = 64 << 20,
        chunk_chars: int = 512,
    ) -> None:
        self._tok = tokenizer
        self._fast = hasattr(tokenizer, "encode_batch_fast")  # tokenizers >= 0.21
        self._specials = dict(special_tokens)
        self._template = ChatTemplate(chat_template, self._specials) if chat_template else None
        # Half for whole prompts (exact repeats), a quarter for the pieces of growing chats.
        self._cache = _LRU(cache_bytes // 2)
        self._pieces = _LRU(cache_bytes // 4)
        # A quarter for words. Plain dicts (their get/set are atomic): a word is looked up every
        # ~3 tokens, and a lock and an LRU per look-up would cost more than tokenizing. When full,
        # they are cleared.
        self._words: dict[str, _Ids] = {}  # word → ids of " " + word (it followed a cut space)
        self._heads: dict[str, _Ids] = {}  # a piece's first word, not after a space → its ids
        self._max_words = max(1, cache_bytes // 4 // _WORD_COST)
        self._word_misses = 0
        self._split_re = _added_token_regex(tokenizer)
        self._added_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        prefix, suffix = self._special_affixes()
        self._prefix = _ids_bytes(prefix)
        self._suffix = _ids_bytes(suffix)
        self._added = {i: _ids_bytes([i]) for i in self._added_ids.values()}
        self._chunk_chars = 0
        self._use_words = False
        self._max_token_chars: int | None = None
        self._self_check(chunk_chars)

    @classmethod
    def from_dir(cls, model_dir: str | Path, cache_bytes: int = 64 << 20) -> PromptTokenizer:
        """Load ``tokenizer.json`` and the chat template of an HF model directory."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{d}/tokenizer.json not found: the router needs a fast (tokenizers) tokenizer; "
                "save one with transformers' save_pretrained or use --tokenizer remote"
            )
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        specials = {
            name: _token_text(cfg.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if _token_text(cfg.get(name))
        }
        return cls(tok, find_template(d, cfg), specials, cache_bytes)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest vocabulary entry (byte-level
        and Metaspace vocabularies spell a token with at least as many characters as its
        text has). What bounds a text prompt's length before it is tokenized."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1)
        return self._max_token_chars

    def cache_stats(self) -> dict[str, int]:
        return {
            "hits": self._cache.hits,
            "misses": self._cache.misses,
            "piece_hits": self._pieces.hits,
            "piece_misses": self._pieces.misses,
            "words": len(self._words) + len(self._heads),
            "word_misses": self._word_misses,
        }

    # -- requests ---------------------------------------------------------------------------

    def completion(self, body: Mapping[str, Any]) -> TokenArray:
        """Token ids of a ``/v1/completions`` body (its first prompt, for a batch)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch is routed by its first prompt
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t <= 0xFFFFFFFF for t in prompt):
            return np.asarray(prompt, dtype=np.uint32)
        raise TokenizeError(
            "'prompt' must be a string, a list of strings, or a list of token ids (0..2**32-1)"
        )

    def chat(self, body: Mapping[str, Any]) -> TokenArray:
        """Token ids of a ``/v1/chat/completions`` body, as vLLM renders and encodes it."""
        text = self.render_chat(body)
        return self.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a chat body (see :mod:`kvmesh.routing.chat_template`)."""
        if self._template is None:
            raise TokenizeError("the model has no chat template; use /v1/completions")
        return self._template.render(body)

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> TokenArray:
        """Token ids of ``text``, identical to ``tokenizer.encode(text, add_special_tokens)``."""
        key = (text, add_special_tokens)
        ids: TokenArray | None = self._cache.get(key)
        if ids is None:
            ids = self._encode_uncached(text, add_special_tokens)
            ids.flags.writeable = False  # shared by the cache: nobody may change it
            self._cache.put(key, ids, len(text) + ids.nbytes + 200)
        return ids

    def _encode_uncached(self, text: str, add_special_tokens: bool) -> TokenArray:
        if self._split_re is None:
            return np.array(self._encode_many([text], add_special_tokens)[0], dtype=np.uint32)
        parts: list[str | int] = []  # text pieces and added-token ids, in order
        pos = 0
        for m in self._split_re.finditer(text):
            if m.start() > pos:
                parts += self._cut(text[pos : m.start()])
            parts.append(self._added_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            parts += self._cut(text[pos:])
        found: dict[str, _Ids] = {}
        missing: list[str] = []
        for piece in dict.fromkeys(p for p in parts if isinstance(p, str)):
            cached = self._pieces.get(piece)
            if cached is None:
                missing.append(piece)
            else:
                found[piece] = cached
        if missing:
            for piece, ids in zip(missing, self._encode_pieces(missing), strict=True):
                found[piece] = ids
                self._pieces.put(piece, ids, len(piece) + len(ids) + 200)
        out: list[_Ids] = [self._prefix] if add_special_tokens else []
        out += [found[p] if isinstance(p, str) else self._added[p] for p in parts]
        if add_special_tokens:
            out.append(self._suffix)
        return np.frombuffer(b"".join(out), dtype=np.uint32)

    def _encode_pieces(self, pieces: list[str]) -> list[_Ids]:
        """Ids of special-free pieces: from the word cache, or one tokenizers batch for all."""
        if not self._use_words:
            # One batch call for every piece (tokenizers runs a batch in parallel).
            return [_ids_bytes(ids) for ids in self._encode_many(pieces, False)]
        out: list[_Ids] = []
        misses: list[tuple[int, list[_Ids | None], list[str]]] = []
        words, heads = self._words, self._heads
        for piece in pieces:
            # Word j > 0 is " " + ws[j] (the split consumed the space): cached as words[ws[j]].
            # The head is cached like the others if it starts with a space, else in heads.
            ws = _WORD_RE.split(piece)
            head = ws[0]
            ids = [words.get(head[1:]) if head[:1] == " " else heads.get(head), *map(words.get, ws[1:])]
            try:
                out.append(b"".join(ids))  # type: ignore[arg-type]  # a None (a miss) raises
            except TypeError:
                misses.append((len(out), ids, ws))
                out.append(b"")
        if misses:
            self._fill_words(out, misses)
        return out

    def _fill_words(self, out: list[_Ids], misses: list[tuple[int, list[_Ids | None], list[str]]]) -> None:
        """Tokenize the missing words of some pieces, in one batch; cache them; finish ``out``."""
        holes = [(i, ids, [(j, _word(ws, j)) for j in _nones(ids)]) for i, ids, ws in misses]
        texts = list(dict.fromkeys(text for _, _, gaps in holes for _, text in gaps))
        got = {t: _ids_bytes(ids) for t, ids in zip(texts, self._encode_many(texts, False), strict=True)}
        self._word_misses += len(got)
        words, heads = self._words, self._heads
        if len(words) + len(heads) + len(got) > self._max_words:
            words.clear()
            heads.clear()
        for text, data in got.items():
            if len(text) <= _MAX_WORD_CHARS:
                if text[:1] == " ":
                    words[text[1:]] = data
                else:
                    heads[text] = data
        # From ``got``, not the caches: another thread may clear them at any time.
        for i, ids, gaps in holes:
            for j, text in gaps:
                ids[j] = got[text]
            out[i] = b"".join(ids)  # type: ignore[arg-type]  # no None is left

    def _cut(self, text: str) -> list[str]:
        """Split a special-free text at safe points about every ``chunk_chars`` characters.

        A cut lies just before a space that follows a non-space and precedes a letter: every
        pre-tokenizer the self-check accepted starts a new pre-token there, so the pieces
        tokenize to the whole. Cut points depend only on the text before them, so two prompts
        with a common beginning share their leading pieces, and those come from the cache.
        """
        if not self._chunk_chars or len(text) < 2 * self._chunk_chars:
            return [text]
        out: list[str] = []
        start = 0
        while len(text) - start >= 2 * self._chunk_chars:
            m = _CUT_RE.search(text, start + self._chunk_chars)
            if m is None:
                break
            out.append(text[start : m.start()])
            start = m.start()
        out.append(text[start:])
        return out

    def _encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if sum(map(len, texts)) < _BATCH_CHARS:
            # A few words: a batch call wakes tokenizers' thread pool, which costs more than this.
            return [self._tok.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
        # encode_batch_fast skips the offsets that encode computes: ~25% less time, same ids.
        if self._fast:
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """What the post-processor puts around a single sequence (e.g. ``[BOS]``, ``[]``)."""
        plain, full = self._encode_many(["a"], False)[0], self._encode_many(["a"], True)[0]
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return [], []

    def _self_check(self, chunk_chars: int) -> None:
        """Keep each shortcut (split at added tokens, cut long texts) only if it gives the same ids."""
        specials = "".join(self._added_ids)
        samples = [
            f"{specials}hello world{specials}\n  x",
            f" lead {specials} mid\n\n{specials}tail 123 ",
            "plain text, no specials at all.",
            _CHECK_TEXT,
            _CHECK_TEXT.replace(" ", "  ").replace("\n", " \n"),
        ]

        def agrees() -> bool:
            for text in samples:
                for add in (False, True):
                    self._pieces = _LRU(self._pieces.capacity)
                    self._words.clear()
                    self._heads.clear()
                    if (
                        self._encode_uncached(text, add).tolist()
                        != self._tok.encode(text, add_special_tokens=add).ids
                    ):
                        return False
            return True

        self._chunk_chars = 0
        self._use_words = False
        if self._split_re is not None and not agrees():
            self._split_re = None
        if self._split_re is not None and chunk_chars > 0:
            self._chunk_chars = 7  # tiny, so the check text is cut at every opportunity
            self._chunk_chars = chunk_chars if agrees() else 0
        if self._chunk_chars:
            # Words are cut where pieces are, only at every opportunity: check that as well.
            self._use_words = True
            self._use_words = agrees()
        self._pieces = _LRU(self._pieces.capacity)
        self._words.clear()
        self._heads.clear()
        self._word_misses = 0


_CUT_RE = re.compile(r"(?<=\S) (?=[^\W\d_])")
# The same cut points, matching (consuming) the space: with a literal first, re finds it fast.
_WORD_RE = re.compile(r" (?<=\S )(?=[^\W\d_])")
_BATCH_CHARS = 2048  # less text than this is encoded one text at a time, without the thread pool
_MAX_WORD_CHARS = 64  # longer "words" (a URL, a run of CJK) are rare repeats: not worth a slot
_WORD_COST = 160  # ~bytes one cached word holds: key, value, dict slot
# Words, numbers, punctuation runs, repeated spaces, newlines, non-ASCII letters, code.
_CHECK_TEXT = (
    "The quick brown fox (jumps) over 1234567 lazy dogs; don't it's we'll I'M!? "
    "Voilà: naïve café, Größe, ĳssel, Ελληνικά ÆØÅ — 東京 タワー 👋 emoji.\n\n"
    "def f(x):\n    return x**2  # comment\n\tTabbed   spaced words\n"
    "a b c d e f g h i j k l m n o p q r s t u v w x y z, A B C D E.F.G. 3.14 and 2,000 items.  End"
)


# -- helpers ------------------------------------------------------------------------------


def _token_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])  # an AddedToken serialised as a dict
    return ""


def _added_token_regex(tok: Tokenizer) -> re.Pattern[str] | None:
    added = list(tok.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.normalized or t.single_word for t in added):
        return None
    spec = json.loads(tok.to_str())
    pipeline = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")])
    if '"prepend_scheme": "first"' in pipeline:
        return None  # Metaspace "first" treats the first piece differently from the rest
    # Longest first: tokenizers matches added tokens leftmost-longest.
    contents = sorted((t.content for t in added), key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in contents))


def _nones(ids: list[_Ids | None]) -> list[int]:
    """Positions of the ``None`` entries (the cache misses) of a piece's word ids."""
    out: list[int] = []
    j = -1
    with contextlib.suppress(ValueError):
        while True:
            j = ids.index(None, j + 1)  # a C-level scan: most of a piece's words are found
            out.append(j)
    return out


def _word(ws: list[str], j: int) -> str:
    """Text of word ``j`` of a piece split by ``_WORD_RE`` (the split consumed a space before each)."""
    return ws[j] if j == 0 else " " + ws[j]


def _ids_bytes(ids: Sequence[int]) -> _Ids:
    return np.array(ids, dtype=np.uint32).tobytes()


def tokens_of(ids: Sequence[int]) -> TokenArray:
    """Token ids (e.g. from a replica's ``/tokenize``) as the uint32 array the index hashes."""
    return np.asarray(ids, dtype=np.uint32)
