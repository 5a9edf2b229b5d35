"""The one tokenizer trainer: its families, its files, and the loaders that read them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvmesh.harness.tokenizer import (
    CHAT_TEMPLATE,
    FAMILIES,
    SPECIAL_TOKENS,
    train_bpe,
    write_tokenizer_files,
)

WORDS = ("the", "cat", "sat", "on", "mat", "river", "stone", "cache", "block", "don't", "12,345", "café")


def _texts(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_encodes_without_unknowns(family: str) -> None:
    tok = train_bpe(_texts(), 400, family=family, specials=["<unk>", "<s>", "</s>"])  # type: ignore[arg-type]
    assert tok.get_vocab_size() <= 400
    for text in ("the cat sat on the mat", "don't café 12,345"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids and tok.token_to_id("<unk>") not in ids
        if family in ("byte-level", "llama3"):  # byte-level decoders give the text back exactly
            assert tok.decode(ids) == text


def test_families_split_differently() -> None:
    text = "the  cat's 12345 mat"
    shapes = {
        f: tuple(train_bpe(_texts(), 400, family=f).encode(text, add_special_tokens=False).tokens)  # type: ignore[arg-type]
        for f in FAMILIES
    }
    assert len(set(shapes.values())) > 1


def test_training_is_deterministic() -> None:
    a, b = train_bpe(_texts(), 500, bos="<s>"), train_bpe(_texts(), 500, bos="<s>")
    assert a.to_str() == b.to_str()


def test_bos_post_processor_and_special_ids() -> None:
    tok = train_bpe(_texts(), 500, bos="<s>")
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode("the cat").ids[0] == tok.token_to_id("<s>")
    assert tok.encode("the cat", add_special_tokens=False).ids[0] != tok.token_to_id("<s>")
    assert train_bpe(_texts(), 500).encode("the cat").ids[0] != tok.token_to_id("<s>")  # no bos asked


def test_bad_arguments_name_the_valid_values() -> None:
    with pytest.raises(ValueError, match="valid: byte-level, llama3, llama2, metaspace"):
        train_bpe(_texts(), 400, family="wordpiece")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="special tokens"):
        train_bpe(_texts(), 400, bos="<bos>")


def test_written_files_load_in_transformers_and_the_router(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvmesh.routing.tokenize import PromptTokenizer

    out = write_tokenizer_files(train_bpe(_texts(), 500, bos="<s>"), tmp_path / "tok", max_len=1024)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["model_max_length"] == 1024
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "</s>"
    hf = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "sat on"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nthe cat</s>\n<|user|>\nsat on</s>\n<|assistant|>\n"
    router = PromptTokenizer.from_dir(out)
    assert router.encode("the cat sat", True).tolist() == hf("the cat sat")["input_ids"]
    with pytest.raises(Exception, match="role must be system, user or assistant"):
        hf.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_the_router_test_tokenizer_is_the_harness_one(tok_dir: Path) -> None:
    """``write_test_tokenizer`` (the ``tok_dir`` fixture) goes through the one trainer."""
    from kvmesh.router.testing import corpus

    again = write_tokenizer_files(train_bpe(corpus(), 600, bos="<s>"), tok_dir.parent / "again")
    assert (again / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()
    assert (again / "tokenizer_config.json").read_text() == (tok_dir / "tokenizer_config.json").read_text()
