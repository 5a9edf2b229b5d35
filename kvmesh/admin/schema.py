"""Request bodies, auth and error shapes shared by the engine admin API and the controller.

No torch here: the router imports this module. Every body is a pydantic model with
``extra="forbid"``, so a misspelt field is a 422 that names it, like any bad value.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from pydantic.json_schema import models_json_schema

from kvmesh.bodylimits import decode_json
from kvmesh.errors import BodyError

TierName = Literal["cpu", "disk", "remote"]
CodecName = Literal["zstd", "raw"]
TokenId = Annotated[StrictInt, Field(ge=0, le=0xFFFFFFFF)]
MAX_TOKENS = 4_000_000
MAX_WAIT_S = 3600.0
MAX_HELD_PAGE = 4096  # held chunks per answer: one bounded call, never a full dump
ENGINE_PREFIX = "/kvmesh/admin/v1/"
CONTROLLER_PREFIX = "/kvmesh/v1/"
TOKEN_ENV = "KVMESH_ADMIN_TOKEN"  # the bearer token of both APIs, when not configured


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LookupBody(_Body):
    """How many leading tokens of ``tokens`` each tier holds, for the caller's ``cache_salt``:
    chunks stored under another salt (another tenant's) are never counted."""

    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="prompt token ids")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=1024, description="the tenant's cache salt (default: none)"
    )


class ClearBody(_Body):
    """Drop chunks: of every tier or one, all of them or only those of ``tokens``."""

    tier: TierName | None = Field(None, description="only this tier (default: every tier)")
    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="only these chunks")
    force: bool = Field(False, description="drop pinned chunks too")


class PinBody(_Body):
    """Pin (or unpin) the chunks of ``tokens``: pinned chunks survive eviction and ``clear``."""

    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    tier: Literal["cpu", "disk"] | None = Field(None, description="default: cpu and disk")


class MoveBody(_Body):
    """Make ``tier`` the highest tier holding the chunks of ``tokens``."""

    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    tier: TierName = Field(description="target tier")


class CompressBody(_Body):
    """Re-encode the chunks of ``tokens`` with ``codec`` (cpu holds raw KV: a no-op there)."""

    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    codec: CodecName = Field("zstd", description="zstd | raw")
    tier: TierName | None = Field(None, description="default: every lower tier (disk, remote)")


class DecompressBody(_Body):
    """Re-encode the chunks of ``tokens`` as raw KV."""

    tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    tier: TierName | None = Field(None, description="default: every lower tier (disk, remote)")


class HealthBody(_Body):
    """Tier states, pool use, write-queue depth."""


class CheckFinishBody(_Body):
    """Whether every async write queued before the call has landed (or been dropped)."""

    wait: bool = Field(False, description="block until it has, or until timeout_s")
    timeout_s: float = Field(60.0, gt=0, le=MAX_WAIT_S, description="longest wait with wait=true")


class StatsBody(_Body):
    """Counters per tier: hits, misses, bytes, evictions, corrupt and unauthenticated objects."""


class HeldBody(_Body):
    """One page of the chunks this engine's kvmesh tiers hold, as the KV events that
    announced them (``BlockStored`` with vLLM's block hashes): what a restarted router
    replays into its index."""

    cursor: int = Field(0, ge=0, le=2**62, description="where to continue: the previous answer's next")
    limit: int = Field(1024, ge=1, le=MAX_HELD_PAGE, description="most chunks in this answer")


@dataclass(frozen=True)
class OpSpec:
    body: type[_Body]
    mutating: bool
    needs_tokens: bool
    summary: str


OPS: dict[str, OpSpec] = {
    "lookup": OpSpec(LookupBody, False, True, "leading tokens held, per tier"),
    "clear": OpSpec(ClearBody, True, False, "drop chunks"),
    "pin": OpSpec(PinBody, True, True, "pin chunks"),
    "unpin": OpSpec(PinBody, True, True, "unpin chunks"),
    "move": OpSpec(MoveBody, True, True, "move chunks to a tier; returns bytes moved"),
    "compress": OpSpec(CompressBody, True, True, "re-encode chunks; returns bytes before and after"),
    "decompress": OpSpec(DecompressBody, True, True, "re-encode chunks as raw"),
    "health": OpSpec(HealthBody, False, False, "tier states, pool use, write-queue depth, trust warnings"),
    "check_finish": OpSpec(CheckFinishBody, False, False, "have the queued async writes landed"),
    "stats": OpSpec(StatsBody, False, False, "per-tier counters"),
    "held": OpSpec(HeldBody, False, False, "a page of the held chunks as KV events (router restart)"),
}


# -- controller bodies: the engine's plus a replica filter and prompt / messages -------------------
class _Targeted(_Body):
    replicas: list[str] | None = Field(None, description="only these replicas (default: all)")


class _Prompted(_Targeted):
    prompt: str | None = Field(None, description="text tokenized like /v1/completions (instead of tokens)")
    messages: list[dict[str, Any]] | None = Field(
        None, description="chat messages tokenized like /v1/chat/completions (instead of tokens)"
    )


class CtlLookupBody(LookupBody, _Prompted):
    pass


class CtlClearBody(ClearBody, _Prompted):
    pass


class CtlPinBody(PinBody, _Prompted):
    pass


class CtlMoveBody(MoveBody, _Prompted):
    pass


class CtlCompressBody(CompressBody, _Prompted):
    pass


class CtlDecompressBody(DecompressBody, _Prompted):
    pass


class CtlHealthBody(HealthBody, _Targeted):
    pass


class CtlCheckFinishBody(CheckFinishBody, _Targeted):
    pass


class CtlStatsBody(StatsBody, _Targeted):
    pass


class RegisterBody(_Body):
    """An engine's admin endpoint announcing itself (sent again as its heartbeat)."""

    name: str = Field(min_length=1, max_length=200)
    url: str = Field(min_length=1, max_length=500, description="base URL of the engine's admin API")
    heartbeat_s: float = Field(2.0, gt=0, le=3600)
    model_id: str | None = None
    shard: int = 0
    pid: int | None = None


class UnregisterBody(_Body):
    name: str = Field(min_length=1, max_length=200)


CONTROLLER_OPS: dict[str, OpSpec] = {
    "lookup": OpSpec(CtlLookupBody, False, True, "for each replica and tier, leading tokens held"),
    "clear": OpSpec(CtlClearBody, True, False, "drop chunks: everywhere, one replica or tier, or of tokens"),
    "pin": OpSpec(CtlPinBody, True, True, "pin the chunks of tokens (survive eviction and clear)"),
    "unpin": OpSpec(CtlPinBody, True, True, "unpin the chunks of tokens"),
    "move": OpSpec(CtlMoveBody, True, True, "move the chunks of tokens to a tier; bytes moved"),
    "compress": OpSpec(CtlCompressBody, True, True, "re-encode chunks with a codec; bytes before/after"),
    "decompress": OpSpec(CtlDecompressBody, True, True, "re-encode chunks as raw; bytes before/after"),
    "health": OpSpec(CtlHealthBody, False, False, "per replica: up/down, tier states, pool, queue"),
    "check_finish": OpSpec(CtlCheckFinishBody, False, False, "have async writes landed (wait=true blocks)"),
    "stats": OpSpec(CtlStatsBody, False, False, "per replica and tier: hits, misses, bytes, ..."),
    "register": OpSpec(RegisterBody, True, False, "an engine admin endpoint registers / heartbeats"),
    "unregister": OpSpec(UnregisterBody, True, False, "an engine admin endpoint leaves"),
}


# -- errors ------------------------------------------------------------------------------------------


def error_body(message: str, field: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message}
    if field is not None:
        err["field"] = field
    return {"error": err}


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Decode and validate a JSON body (empty = ``{}``); :class:`BodyError` names the field."""
    # msgspec, bounded in depth (a 1,000-deep body is a 400, not a RecursionError's 500); the
    # value count is bounded by the models (MAX_TOKENS), not here.
    data = decode_json(raw, max_values=None, invalid_status=422) if raw.strip() else {}
    if not isinstance(data, dict):
        raise BodyError("body", "must be a JSON object")
    return validate(model, data)


def validate(model: type[_Body], data: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            valid = ", ".join(model.model_fields)
            raise BodyError(where, f"unknown field (valid: {valid})") from None
        raise BodyError(where, str(err["msg"])) from None


# -- auth --------------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (constant-time compare)."""
    if not token or not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def allowed(mutating: bool, header: str | None, token: str | None, loopback: bool) -> bool:
    """Whenever a token is configured, every call needs it: on a shared host any local user
    reaches loopback, and a lookup tells whether another tenant's prompt is cached. With no
    token, read-only calls are open on loopback only and mutating calls are refused."""
    if token:
        return token_ok(header, token)
    return not mutating and loopback


# -- OpenAPI -----------------------------------------------------------------------------------------
def openapi_document(ops: Mapping[str, OpSpec], prefix: str, title: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document: one ``POST prefix+op`` per operation, bodies from the models."""
    models = list(dict.fromkeys(spec.body for spec in ops.values()))
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {"message": {"type": "string"}, "field": {"type": "string"}},
                "required": ["message"],
            }
        },
    }
    paths: dict[str, Any] = {}
    for name, spec in ops.items():
        responses: dict[str, Any] = {
            "200": {"description": "per-replica (or engine) result", "content": {"application/json": {}}},
            "401": {"description": "missing or wrong bearer token"},
            "422": {
                "description": "bad body; error.field names the field",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        }
        op: dict[str, Any] = {
            "operationId": name,
            "summary": spec.summary,
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{spec.body.__name__}"}}
                },
            },
            "responses": responses,
        }
        if spec.mutating:
            op["security"] = [{"bearer": []}]
        paths[prefix + name] = {"post": op}
        if not spec.mutating and not spec.needs_tokens:  # these answer GET too, with the defaults
            get = {k: v for k, v in op.items() if k != "requestBody"}
            paths[prefix + name]["get"] = {**get, "operationId": name + "_get"}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
