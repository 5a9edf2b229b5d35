"""Render a chat request the way vLLM (through transformers) renders it, without either.

vLLM 0.32's ``/v1/chat/completions``: text content parts joined with ``"\\n"``, the template
rendered with ``add_generation_prompt=True`` (the request may override it) in the sandbox
transformers uses, with the same options, filters and globals; ``continue_final_message``
cuts what the template wrote after the final message, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from kvmesh.errors import TokenizeError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_FIXED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # render()'s own


class ChatTemplate:
    """A model's chat template, compiled once; ``render(body)`` gives a chat body's prompt text."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self._template = _compile(source)
        self._specials = dict(special_tokens)

    def render(self, body: Mapping[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizeError("'messages' must be a non-empty list")
        conv = [_message(m) for m in messages]
        cont = bool(body.get("continue_final_message", False))
        add_gen = bool(body.get("add_generation_prompt", not cont))
        if cont:
            conv[-1]["content"] = str(conv[-1].get("content", "")) + _CONTINUE_TAG
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, Mapping):
            raise TokenizeError("'chat_template_kwargs' must be an object")
        clash = sorted(set(extra) & _FIXED)
        if clash:
            # transformers passes these by name too: the render call itself would fail.
            raise TokenizeError(f"'chat_template_kwargs' may not set {', '.join(clash)}")
        try:
            text = self._template.render(
                messages=conv,
                tools=body.get("tools"),
                documents=body.get("documents"),
                add_generation_prompt=add_gen,
                **{**self._specials, **extra},
            )
        except Exception as exc:
            # A template is code run over the request's data: a TypeError or ZeroDivisionError
            # from odd input is as much the request's fault as a TemplateError.
            raise TokenizeError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if cont:
            # As transformers does: cut everything the template wrote after the final message.
            loc = text.rfind(_CONTINUE_TAG.strip())
            if loc < 0:
                raise TokenizeError("continue_final_message: the template dropped the final message")
            text = text[:loc] if text.startswith(_CONTINUE_TAG, loc) else text[:loc].rstrip()
        return text


def find_template(d: Path, cfg: Mapping[str, Any]) -> str | None:
    # Newer HF models keep the template in its own file; it wins over the config key.
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "chat_template.json").is_file():
        cfg = {"chat_template": json.loads((d / "chat_template.json").read_text()).get("chat_template")}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise TokenizeError("each message must be an object with a string 'role'")
    out = dict(m)
    content = m.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        # vLLM's "string" content format: the text parts, joined by newlines.
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        out["content"] = "\n".join(str(t) for t in texts)
    elif not isinstance(content, str):
        raise TokenizeError("message 'content' must be a string or a list of content parts")
    return out


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body (transformers tracks it; we need not)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API wants a class attribute

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _compile(source: str) -> jinja2.Template:
    # The same environment as transformers' chat templates, so templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
