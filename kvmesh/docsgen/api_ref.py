"""The admin and controller API references, rendered from the OpenAPI documents the servers
serve (``kvmesh.admin.schema.openapi_document``): one section per operation, one row per
body field."""

from __future__ import annotations

import json
from typing import Any

from kvmesh.docsgen.markdown import GENERATED_NOTE, code, table

_LIMITS = (
    ("minimum", "≥"),
    ("exclusiveMinimum", ">"),
    ("maximum", "≤"),
    ("exclusiveMaximum", "<"),
    ("minLength", "length ≥"),
    ("maxLength", "length ≤"),
    ("maxItems", "items ≤"),
)


def schema_type(schema: dict[str, Any]) -> str:
    """A JSON-schema type as a reader writes it: ``integer (≥ 0)``, ``list of integer or null``."""
    if "anyOf" in schema:
        kinds = [s for s in schema["anyOf"] if s.get("type") != "null"]
        text = " or ".join(schema_type(s) for s in kinds)
        return text + (" or null" if len(kinds) < len(schema["anyOf"]) else "")
    if "enum" in schema:
        text = " | ".join(str(v) for v in schema["enum"])
    elif schema.get("type") == "array":
        text = "list of " + schema_type(schema.get("items", {}))
    elif "$ref" in schema:
        text = schema["$ref"].rsplit("/", 1)[-1]
    else:
        text = str(schema.get("type", "any"))
    limits = [f"{sign} {schema[k]}" for k, sign in _LIMITS if k in schema]
    return text + (f" ({', '.join(limits)})" if limits else "")


def _body_rows(body: dict[str, Any]) -> list[list[str]]:
    required = set(body.get("required", ()))
    rows = []
    for name, prop in body.get("properties", {}).items():
        default = "required" if name in required else code(json.dumps(prop.get("default")))
        rows.append([code(name), schema_type(prop), default, prop.get("description", "")])
    return rows


def api_page(title: str, intro: str, doc: dict[str, Any]) -> str:
    schemas = doc["components"]["schemas"]
    out = [f"# {title}\n", GENERATED_NOTE + "\n", intro + "\n"]
    index = []
    for path, methods in doc["paths"].items():
        op = methods.get("post") or next(iter(methods.values()))
        verbs = ", ".join(m.upper() for m in methods)
        index.append(
            [
                f"[{code(verbs + ' ' + path)}](#{op['operationId']})",
                op.get("summary", ""),
                "yes" if "security" in op else "",
            ]
        )
    out.append(table(["operation", "what it does", "mutating (never without the token)"], index))
    for path, methods in doc["paths"].items():
        op = methods.get("post") or next(iter(methods.values()))
        out.append(f"## {op['operationId']} {{ #{op['operationId']} }}\n")
        out.append(f"`{', '.join(m.upper() for m in methods)} {path}`: {op.get('summary', '')}.")
        ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        body = schemas.get(ref.get("$ref", "").rsplit("/", 1)[-1], {})
        if body.get("description"):
            out.append(" ".join(body["description"].split()).replace("``", "`"))
        auth = (
            "Mutating: refused without the bearer token."
            if "security" in op
            else "Read-only: open on loopback when no token is configured; with a token, every call needs it."
        )
        if "get" in methods:
            auth += " `GET` takes the body's defaults."
        out.append(auth + "\n")
        rows = _body_rows(body)
        out.append(table(["field", "type", "default", "meaning"], rows) if rows else "No body fields.\n")
    out.append(
        'Every error is `{"error": {"message": ..., "field": ...}}`: 401 without the token a call '
        "needs, 422 for a bad body, naming the field (an unknown field lists the valid ones).\n"
    )
    return "\n".join(out)


def admin_page() -> str:
    from kvmesh.admin.schema import ENGINE_PREFIX, OPS, openapi_document

    return api_page(
        "Engine admin API",
        "Served by every engine (inside each vLLM worker when the connector runs; `admin_host` / "
        f"`admin_port` in the [cache configuration](config.md)); its OpenAPI is at "
        f"`{ENGINE_PREFIX}openapi.json`. The [controller](controller-api.md) fans calls out to it. "
        "How to use both: [Operating the cache](../controller.md).",
        openapi_document(OPS, ENGINE_PREFIX, "kvmesh engine admin API"),
    )


def controller_page() -> str:
    from kvmesh.admin.schema import CONTROLLER_OPS, CONTROLLER_PREFIX, openapi_document

    return api_page(
        "Controller API",
        "Served by `kvmesh router` (`controller:` in its [configuration](router-config.md)); its "
        f"OpenAPI is at `{CONTROLLER_PREFIX}openapi.json`. Every operation answers per replica, so a "
        "dead replica is an error entry, not a failed call. A prompt is given as `tokens`, as "
        "`prompt` text or as chat `messages` (tokenized as the router tokenizes). From the shell: "
        "[`kvmesh cache`](cli.md#kvmesh-cache). How to use it: [Operating the cache](../controller.md).",
        openapi_document(CONTROLLER_OPS, CONTROLLER_PREFIX, "kvmesh controller"),
    )
