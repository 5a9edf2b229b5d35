"""The one BPE tokenizer trainer of the tests, benchmarks and tiny models.

:func:`train_bpe` trains a ``tokenizers`` BPE model on given texts in one of four families
(the pre-tokenizer/normalizer shapes real models use, which the router's tokenizer
shortcuts must handle); :func:`write_tokenizer_files` writes a directory that transformers,
vLLM and the router load offline. The ``tokenizers`` package is imported inside the
functions: importing this module costs nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Family = Literal["byte-level", "llama3", "llama2", "metaspace"]
FAMILIES: tuple[Family, ...] = ("byte-level", "llama3", "llama2", "metaspace")

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS, UNK = "<s>", "</s>", "<unk>"

# Roles are checked so a typo in a test shows up as an error, not as a silently odd prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Llama 3's (tiktoken-style) pre-tokenizer split, applied before the byte mapping.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_bpe(
    texts: Iterable[str],
    vocab: int,
    *,
    family: Family = "byte-level",
    specials: Sequence[str] = SPECIAL_TOKENS,
    bos: str | None = None,
) -> Tokenizer:
    """A BPE tokenizer of at most ``vocab`` tokens trained on ``texts``.

    ``family``: ``byte-level`` (GPT-2 style: byte-level pre-tokenizer and its regex; the
    tiny models'), ``llama3`` (Llama 3's regex split, then bytes), ``llama2`` (legacy
    SentencePiece: a normalizer that prepends ``▁`` and replaces spaces), ``metaspace``
    (a ``Metaspace`` pre-tokenizer with ``prepend_scheme="first"``). ``bos``: a special
    token the post-processor puts before every sequence (none when ``None``).
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; valid: {', '.join(FAMILIES)}")
    if bos is not None and bos not in specials:
        raise ValueError(f"bos {bos!r} must be one of the special tokens {list(specials)}")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    alphabet: list[str] = []
    if family == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif family == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif family == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Metaspace()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials), initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def write_tokenizer_files(
    tok: Tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    max_len: int = 4096,
    chat_template: str = CHAT_TEMPLATE,
    specials: Sequence[str] = SPECIAL_TOKENS,
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    (BOS ``<s>``, EOS and PAD ``</s>``, the chat template) to ``out_dir``; return it.

    The config is written by hand, not by ``save_pretrained``, so the files do not vary with
    the transformers version and a torch-free router can read the chat template from them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in specials
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=1) + "\n")
    return out
