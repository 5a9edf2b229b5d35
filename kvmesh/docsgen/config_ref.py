"""The configuration reference: every key of every settings model, read from the models.

``CacheConfig`` (the cache, in a YAML file, ``kv_connector_extra_config`` or ``KVMESH_*``
variables), the connector's own keys (``CONNECTOR_KEYS``), ``RouterConfig`` (``kvmesh router
--config``) and ``EppConfig`` (``kvmesh epp --config``). Nested models are flattened into dotted
keys (``weights.prefix``), as they are written in YAML.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvmesh.docsgen.markdown import GENERATED_NOTE, code, table

_CONSTRAINTS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
)


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``str or null``, ``through | back``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is tuple:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, list):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def constraint_text(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for kind, attr, sign in _CONSTRAINTS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(see below)"
        return code(repr(value))
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, int) and not isinstance(field.default, bool) and field.default >= 1 << 20:
        mib = field.default / (1 << 20)
        return code(repr(field.default)) + (f" ({mib:g} MiB)" if mib == int(mib) else "")
    return code(repr(field.default))


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds (itself, optional, or a tuple of them), if any."""
    for cand in (annotation, *typing.get_args(annotation)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _doc(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring, reST's double backticks as Markdown's."""
    first = (model.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


def model_rows(
    model: type[BaseModel], prefix: str = "", env_prefix: str | None = None
) -> tuple[list[list[str]], list[tuple[str, type[BaseModel]]]]:
    """``key | type | default | meaning`` rows of ``model``'s own keys, and the nested models
    (``(dotted key, model)``) that get sections of their own."""
    rows: list[list[str]] = []
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = prefix + name
        sub = _model_of(field.annotation)
        if sub is not None:
            nested.append((key, sub))
            if typing.get_origin(field.annotation) is not tuple:
                continue
        limits = constraint_text(field)
        row = [code(key), type_name(field.annotation), default_text(field), field.description or ""]
        if limits:
            row[1] += f" ({limits})"
        if env_prefix is not None:
            row.insert(1, code(env_prefix + name.upper()))
        rows.append(row)
    return rows, nested


def model_sections(
    title: str, intro: str, model: type[BaseModel], prefix: str = "", opaque: dict[str, str] | None = None
) -> str:
    """``model`` as a section (its docstring, its keys) and one subsection per nested model;
    ``opaque`` keys are described by a sentence instead of being expanded."""
    opaque = opaque or {}
    rows, nested = model_rows(model, prefix)
    text = f"## {title}\n\n" + " ".join(t for t in (intro, _doc(model)) if t) + "\n\n"
    text += table(["key", "type", "default", "meaning"], rows)
    for key, sub in nested:
        if key in opaque:
            text += f"\n### `{key}`\n\n{opaque[key]}\n"
            continue
        is_list = typing.get_origin(model.model_fields[key.rsplit(".", 1)[-1]].annotation) is tuple
        sub_rows, _ = model_rows(sub, "" if is_list else key + ".")
        head = f"each entry of `{key}`" if is_list else f"`{key}`"
        text += f"\n### {head}\n\n{_doc(sub)}\n\n" + table(["key", "type", "default", "meaning"], sub_rows)
    return text


def cache_page() -> str:
    from kvmesh.config import ENV_PREFIX, CacheConfig
    from kvmesh.integrations.vllm.options import CONNECTOR_KEYS
    from kvmesh.tiers.base import served_schemes

    rows, _ = model_rows(CacheConfig, env_prefix=ENV_PREFIX)
    out = [
        "# Cache configuration\n",
        GENERATED_NOTE + "\n",
        "Every key of `kvmesh.CacheConfig`, the settings of one cache engine. They come from a "
        "YAML file (`CacheConfig.from_file`, or `config_file` in the connector), inline keys in "
        "vLLM's `kv_connector_extra_config`, or environment variables (later ones win); an "
        "unknown key or a bad value is an error naming the key. LMCache's keys are read too: "
        "[Coming from LMCache](../lmcache.md).\n",
        "## Cache keys\n",
        table(["key", "variable", "type", "default", "meaning"], rows),
        f"`{ENV_PREFIX}CONFIG_FILE` names a YAML file read before the other variables. "
        "URL schemes kvmesh opens (`remote_url`; `local_disk` takes `file://` or a path): "
        + ", ".join(code(s + "://") for s in served_schemes())
        + " ([Storage backends and codecs](backends.md)).\n",
        "## Connector keys\n",
        "Keys of `kv_connector_extra_config` that belong to the vLLM connector rather than the "
        "cache (`kvmesh.integrations.vllm.options.CONNECTOR_KEYS`); `kv_role` and `kv_port` are "
        "vLLM's own `--kv-transfer-config` fields.\n",
        table(["key", "meaning"], [[code(k), v] for k, v in CONNECTOR_KEYS.items()]),
    ]
    return "\n".join(out)


def router_page() -> str:
    from kvmesh.epp.config import EppConfig
    from kvmesh.router.config import RouterConfig

    out = [
        "# Router and EPP configuration\n",
        GENERATED_NOTE + "\n",
        "The YAML keys of `kvmesh router --config` and `kvmesh epp --config`; command-line flags "
        "([CLI](cli.md)) override them. Nested sections are YAML mappings (`weights: {prefix: 2}`), "
        "shown as dotted keys. An entry of `replicas` may also be the command line's string form "
        "`URL[,events=EP][,replay=EP][,admin=URL][,name=NAME][,role=ROLE]`.\n",
        model_sections("kvmesh router", "", RouterConfig),
        model_sections(
            "kvmesh epp",
            "",
            EppConfig,
            opaque={
                "routing": "Every key of [kvmesh router](#kvmesh-router) above, the same way "
                "(its `replicas` are static endpoints; Kubernetes discovery adds the pool's pods)."
            },
        ),
    ]
    return "\n".join(out)
