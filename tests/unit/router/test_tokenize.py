"""The router tokenizes like the engine: same ids as transformers/vLLM, and it stays torch-free."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvmesh.errors import TokenizeError
from kvmesh.harness.tokenizer import Family, train_bpe
from kvmesh.router.testing import _WORDS
from kvmesh.routing.tokenize import PromptTokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def pt(tok_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tok_dir)


def _text(rng: random.Random, n: int, specials: bool = True) -> str:
    extra: tuple[str, ...] = ("\n", "  ", "12,345", "don't", "café", "!?", "\t", " x")
    extra += ("<s>", "</s>", "<|user|>") if specials else ()
    return " ".join(rng.choice(_WORDS + extra) for _ in range(n))


CHATS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "You are a cat."},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "meow"},
        {"role": "user", "content": "and  again\n\twith spaces "},
    ],
]


def test_same_ids_as_transformers(tok_dir: Path, pt: PromptTokenizer) -> None:
    """vLLM: completions encode with special tokens; chat renders the template, then encodes without."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    rng = random.Random(0)
    for n in (1, 5, 300, 900):
        text = _text(rng, n)
        assert pt.completion({"prompt": text}).tolist() == hf(text)["input_ids"]
        assert (
            pt.completion({"prompt": text, "add_special_tokens": False}).tolist()
            == hf(text, add_special_tokens=False)["input_ids"]
        )
    for chat in CHATS:
        want_text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert pt.render_chat({"messages": chat}) == want_text
        want = hf(want_text, add_special_tokens=False)["input_ids"]
        assert pt.chat({"messages": chat}).tolist() == want
        cont = hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
        assert pt.render_chat({"messages": chat, "continue_final_message": True}) == cont
        no_gen = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        assert pt.render_chat({"messages": chat, "add_generation_prompt": False}) == no_gen


def test_content_parts_and_token_prompts(pt: PromptTokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert pt.render_chat({"messages": parts}) == pt.render_chat(
        {"messages": [{"role": "user", "content": "a\nb"}]}
    )
    assert pt.completion({"prompt": [5, 6, 7]}).tolist() == [5, 6, 7]
    assert (
        pt.completion({"prompt": ["first", "second"]}).tolist() == pt.completion({"prompt": "first"}).tolist()
    )
    for bad in ({"prompt": 3}, {"prompt": [1, "x"]}):
        with pytest.raises(TokenizeError):
            pt.completion(bad)
    with pytest.raises(TokenizeError, match="messages"):
        pt.chat({"messages": []})
    with pytest.raises(TokenizeError, match="chat template failed"):
        pt.chat({"messages": [{"role": "robot", "content": "x"}]})  # the template raises


def test_pieces_and_cuts_give_the_same_ids(pt: PromptTokenizer) -> None:
    assert pt._split_re is not None and pt._chunk_chars > 0  # both shortcuts on for this tokenizer
    rng = random.Random(1)
    for _ in range(100):
        text = _text(rng, rng.randint(0, 1500))
        for add in (True, False):
            assert pt.encode(text, add).tolist() == pt._tok.encode(text, add_special_tokens=add).ids


def test_growing_chat_only_tokenizes_the_new_turn(pt: PromptTokenizer) -> None:
    rng = random.Random(2)
    chat = [{"role": "system", "content": _text(rng, 800, specials=False)}]
    for turn in range(4):
        chat.append({"role": "user", "content": _text(rng, 50, specials=False)})
        before = pt.cache_stats()["piece_misses"]
        ids = pt.chat({"messages": chat})
        assert (
            ids.tolist() == pt._tok.encode(pt.render_chat({"messages": chat}), add_special_tokens=False).ids
        )
        new = pt.cache_stats()["piece_misses"] - before
        # the long system prompt was cut into pieces once; later turns add two messages + "\n"s
        assert new <= 2 if turn else new > 3
        chat.append({"role": "assistant", "content": _text(rng, 20, specials=False)})
    assert pt.chat({"messages": chat[:-1]}) is pt.chat({"messages": chat[:-1]})  # exact repeat: cached


def test_long_prompts_share_cached_leading_pieces(pt: PromptTokenizer) -> None:
    rng = random.Random(3)
    shared = _text(rng, 1200, specials=False)
    pt.encode(shared + " tail one", True)
    before = pt.cache_stats()["piece_misses"]
    pt.encode(shared + " another different tail", True)
    assert pt.cache_stats()["piece_misses"] - before <= 2


def test_new_prompts_are_assembled_from_cached_words(pt: PromptTokenizer) -> None:
    """A new prompt of words seen before costs no tokenizers call, only look-ups."""
    assert pt._use_words
    rng = random.Random(5)
    pt.encode(" ".join(_WORDS) + " " + _text(rng, 400), True)
    calls: list[list[str]] = []
    real = pt._encode_many
    pt._encode_many = lambda texts, add: calls.append(texts) or real(texts, add)  # type: ignore[method-assign]
    for i in range(20):
        text = f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 1200)))
        text += " café" if i % 2 else ""
        for add in (True, False):
            assert pt.encode(text, add).tolist() == pt._tok.encode(text, add_special_tokens=add).ids
    # Only the new heads ("0:", "1:", …) went to tokenizers, as whole words, and " café" once.
    new = [t for texts in calls for t in texts]
    assert len(new) == len(set(new)) and set(new) <= {f"{i}:" for i in range(20)} | {" café"}


def test_a_full_word_cache_is_cleared_and_ids_stay_right(tok_dir: Path) -> None:
    small = PromptTokenizer.from_dir(tok_dir, cache_bytes=64_000)  # room for ~100 words
    assert small._use_words and small._max_words == 100
    rng = random.Random(6)
    for _ in range(60):
        text = _text(rng, rng.randint(0, 400)) + " " + "".join(rng.choice("xyzw") for _ in range(6))
        assert small.encode(text, True).tolist() == small._tok.encode(text).ids
        assert len(small._words) + len(small._heads) <= 100
    assert small.cache_stats()["word_misses"] > 100


def test_shortcuts_turn_off_when_they_would_change_ids(tmp_path: Path) -> None:
    """A Metaspace 'first' pre-tokenizer treats the first piece specially: no splitting allowed."""
    texts = [_text(random.Random(i), 30) for i in range(200)]
    tok = train_bpe(texts, 300, family="metaspace", specials=["<unk>", "<s>", "</s>"])
    pt = PromptTokenizer(tok, None, {})
    assert pt._split_re is None and pt._chunk_chars == 0 and not pt._use_words
    text = "<s>" + _text(random.Random(9), 400) + "</s> more"
    assert pt.encode(text, False).tolist() == tok.encode(text, add_special_tokens=False).ids
    with pytest.raises(TokenizeError, match="no chat template"):
        pt.chat({"messages": [{"role": "user", "content": "x"}]})


def test_template_from_separate_file(tmp_path: Path, tok_dir: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert PromptTokenizer.from_dir(d).render_chat({"messages": [{"role": "user", "content": "x"}]}) == "x!"
    (d / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}?")
    assert (
        PromptTokenizer.from_dir(d).render_chat({"messages": [{"role": "user", "content": "x"}]}) == "<s>x?"
    )
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        PromptTokenizer.from_dir(tmp_path)


_IMPORT_CHECK = textwrap.dedent(
    """
    import sys
    import kvmesh.router.app, kvmesh.router.server, kvmesh.router.cli
    print("heavy=" + ",".join(m for m in ("torch", "vllm", "transformers") if m in sys.modules))
    """
)


def test_importing_the_router_does_not_import_torch() -> None:
    """DESIGN: the router never imports torch or vllm; it must start fast."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "heavy="


def _trained(kind: Family) -> Tokenizer:
    texts = [_text(random.Random(i), 40, specials=False) for i in range(300)]
    return train_bpe(texts, 400, family=kind, specials=["<unk>", "<s>", "</s>"])


@pytest.mark.parametrize(("kind", "cuts"), [("llama3", True), ("llama2", False)])
def test_self_check_on_other_tokenizer_families(kind: str, cuts: bool) -> None:
    tok = _trained(kind)
    pt = PromptTokenizer(tok, None, {})
    assert (pt._chunk_chars > 0) is cuts
    assert pt._use_words is cuts
    rng = random.Random(4)
    for _ in range(40):
        text = _text(rng, rng.randint(0, 800))
        for add in (True, False):
            assert pt.encode(text, add).tolist() == tok.encode(text, add_special_tokens=add).ids
