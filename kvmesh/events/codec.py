"""vLLM KV-event wire format: decode what any vLLM version publishes, encode the same shapes.

A payload is one msgpack array ``[ts, events, data_parallel_rank]`` (the rank may be missing
or nil). Each event is one of two shapes, depending on the vLLM version that sent it:

* vLLM ≤ 0.23 encodes events as tagged *arrays*, fields in declaration order::

      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]
      ["BlockRemoved", block_hashes, medium, ...]
      ["AllBlocksCleared"]

* vLLM 0.32 encodes them as tagged *maps*: ``{"type": "BlockStored", "block_hashes": ...}``,
  with fields whose value equals their default (``extra_keys``, ``group_idx`` …) left out.

The decoder is hand-written over msgspec's generic decode instead of typed structs because
one typed decoder cannot accept both shapes, and because a newer vLLM adding a field or an
event type must not make the router drop whole batches: unknown fields are ignored and
unknown event types are skipped (counted in ``EventBatch.skipped``). Anything that breaks
the known structure raises :class:`EventDecodeError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from kvmesh.errors import EventDecodeError

BlockHash: TypeAlias = int | bytes
"""An engine block hash: opaque. vLLM sends ints (builtin hash) or bytes (sha256 …)."""


# The events are msgspec Structs (frozen, hashable, not tracked by the cyclic GC), so that the
# fast decoder (see _fast) builds them straight from the wire: converting decoded structs
# into frozen dataclasses (an ``object.__setattr__`` per field, a tuple copy per sequence)
# took 23 of its 32 µs for a 16-event batch, more than the decode itself.
class BlockStored(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: Annotated[int, msgspec.Meta(ge=0)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    locality: str | None = None  # vLLM 0.32: LOCAL or REMOTE relative to the publisher
    ownership: str | None = None  # vLLM 0.32: the secondary offloading tier that published it
    # vLLM 0.32, hybrid models: the attention kind of the KV cache group ("full_attention",
    # "sliding_window", "mamba", ...) and its window: only full attention names a whole prefix.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False, tag=True, tag_field="type"):
    pass


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    skipped: int = field(default=0, compare=False)  # events of a type this version does not know


# Positional field order of the array shape (vLLM's declaration order); the map shape uses
# the same names. Fields after the ones listed here are ignored.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)
_STORED_REQUIRED = 4  # block_hashes … block_size; vLLM ≤ 0.9 had no medium, lora_name came later
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_REMOVED_REQUIRED = 1

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def _bad(msg: str) -> EventDecodeError:
    return EventDecodeError(f"malformed KV event payload: {msg}")


def _fields(raw: Any, names: tuple[str, ...], required: int, kind: str) -> dict[str, Any]:
    """Field values of one event in either shape, by name."""
    if isinstance(raw, dict):
        missing = [n for n in names[:required] if n not in raw]
        if missing:
            raise _bad(f"{kind} lacks {', '.join(missing)}")
        return {n: raw[n] for n in names if n in raw}
    values = raw[1:]
    if len(values) < required:
        raise _bad(f"{kind} has {len(values)} fields, needs at least {required}")
    return dict(zip(names, values, strict=False))


def _hashes(value: Any, kind: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise _bad(f"{kind}.block_hashes must be an array, got {type(value).__name__}")
    for h in value:
        if isinstance(h, bool) or not isinstance(h, (int, bytes)):
            raise _bad(f"{kind}.block_hashes holds a {type(h).__name__}; expected int or bytes")
    return tuple(value)


def _opt(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise _bad(f"{name} has type {type(value).__name__}")
    return value


def _stored(raw: Any) -> BlockStored:
    f = _fields(raw, _STORED_FIELDS, _STORED_REQUIRED, "BlockStored")
    hashes = _hashes(f["block_hashes"], "BlockStored")
    parent = f["parent_block_hash"]
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, (int, bytes))):
        raise _bad(f"BlockStored.parent_block_hash has type {type(parent).__name__}")
    tokens = f["token_ids"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise _bad("BlockStored.token_ids must be an array of ints")
    size = f["block_size"]
    # 0 is legal: vLLM's offloading connector sends token-less placeholder stores.
    if type(size) is not int or size < 0:
        raise _bad(f"BlockStored.block_size must be an int >= 0, got {size!r}")
    extra = f.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or not all(e is None or isinstance(e, list) for e in extra):
            raise _bad("BlockStored.extra_keys must be an array of arrays or nils")
        extra = tuple(None if e is None else _frozen(e) for e in extra)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=_opt(f.get("lora_id"), int, "BlockStored.lora_id"),
        medium=_opt(f.get("medium"), str, "BlockStored.medium"),
        lora_name=_opt(f.get("lora_name"), str, "BlockStored.lora_name"),
        extra_keys=extra,
        group_idx=_opt(f.get("group_idx"), int, "BlockStored.group_idx"),
        locality=_opt(f.get("locality"), str, "BlockStored.locality"),
        ownership=_opt(f.get("ownership"), str, "BlockStored.ownership"),
        kv_cache_spec_kind=_opt(f.get("kv_cache_spec_kind"), str, "BlockStored.kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt(
            f.get("kv_cache_spec_sliding_window"), int, "BlockStored.kv_cache_spec_sliding_window"
        ),
    )


# vLLM's extra keys nest two levels (a block's keys, a (mm_identifier, offset) pair). Deeper
# is hostile: a few hundred levels, well within msgspec's decoder, overflowed Python's stack
# in _frozen, and the RecursionError left the decoder (ending the event hub's thread).
MAX_KEY_DEPTH = 16


def _frozen(value: Sequence[Any], depth: int = 0) -> tuple[Any, ...]:
    # extra_keys hold nested arrays such as (mm_identifier, offset): tuples keep events hashable.
    if depth >= MAX_KEY_DEPTH:
        raise _bad(f"BlockStored.extra_keys nest deeper than {MAX_KEY_DEPTH} levels")
    return tuple(_frozen(v, depth + 1) if isinstance(v, list) else v for v in value)


def _removed(raw: Any) -> BlockRemoved:
    f = _fields(raw, _REMOVED_FIELDS, _REMOVED_REQUIRED, "BlockRemoved")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], "BlockRemoved"),
        medium=_opt(f.get("medium"), str, "BlockRemoved.medium"),
        group_idx=_opt(f.get("group_idx"), int, "BlockRemoved.group_idx"),
        locality=_opt(f.get("locality"), str, "BlockRemoved.locality"),
        ownership=_opt(f.get("ownership"), str, "BlockRemoved.ownership"),
    )


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise _bad(f"an event must be a tagged array or map, got {type(raw).__name__}")
    if not isinstance(tag, str):
        raise _bad(f"event tag must be a string, got {tag!r}")
    if tag == "BlockStored":
        return _stored(raw)
    if tag == "BlockRemoved":
        return _removed(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


# The fast path: vLLM 0.32's map shape decoded by msgspec, in C, straight into the event
# Structs above (their tags are vLLM's "type" field), with the same checks as the generic
# path (no bools for ints, block_size >= 0, unknown fields ignored).
# Anything it does not accept (the array shape, an unknown event type, a malformed payload)
# goes to the generic path, which decodes it or says what is wrong. ~4x less time per event.
class _FastBatch(msgspec.Struct, array_like=True):
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


_fast_decoder = msgspec.msgpack.Decoder(_FastBatch)


def _fast(payload: bytes) -> EventBatch | None:
    """vLLM 0.32's map shape with known event types only, decoded by msgspec straight into
    the events (types checked in C); None for anything else (then :func:`_generic` decides)."""
    try:
        raw = _fast_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, RecursionError):
        return None
    events = raw.events
    if any(type(e) is BlockStored and e.extra_keys is not None for e in events):
        events = tuple(_frozen_keys(e) for e in events)
    return EventBatch(raw.ts, events, raw.data_parallel_rank)


def _frozen_keys(ev: Event) -> Event:
    """``ev`` with the arrays inside its extra keys (decoded as lists: a block's keys are typed
    ``tuple[Any, ...]``) made tuples, as :func:`_generic` makes them, so that it stays
    hashable. Rare: only multimodal, LoRA and salted blocks carry extra keys."""
    if type(ev) is not BlockStored or ev.extra_keys is None:
        return ev
    extra = tuple(None if k is None else _frozen(k) for k in ev.extra_keys)
    return msgspec.structs.replace(ev, extra_keys=extra)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one published payload. Raises :class:`EventDecodeError` if it is malformed."""
    fast = _fast(payload)
    return fast if fast is not None else _generic(payload)


def _generic(payload: bytes) -> EventBatch:
    """Either shape, unknown types skipped, or an :class:`EventDecodeError` saying what is wrong."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        # RecursionError: a few KB of nested arrays; it would escape and end the subscriber.
        raise _bad(f"not msgpack ({exc})") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise _bad("top level must be the array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise _bad(f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise _bad(f"events must be an array, got {type(events).__name__}")
    rank = _opt(raw[2] if len(raw) == 3 else None, int, "data_parallel_rank")
    decoded = [_event(e) for e in events]
    known = tuple(e for e in decoded if e is not None)
    return EventBatch(float(ts), known, rank, skipped=len(decoded) - len(known))


def _map_event(ev: Event) -> dict[str, Any]:
    # Same key order and default-omission as msgspec's encoding of vLLM 0.32's tagged structs:
    # fields without a default are always written, defaulted ones only when not None.
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            out["extra_keys"] = [None if e is None else list(e) for e in ev.extra_keys]
        for name in (
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
        ):
            if getattr(ev, name) is not None:
                out[name] = getattr(ev, name)
        return out
    if isinstance(ev, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
        for name in ("group_idx", "locality", "ownership"):
            if getattr(ev, name) is not None:
                out[name] = getattr(ev, name)
        return out
    return {"type": "AllBlocksCleared"}


def _array_event(ev: Event) -> list[Any]:
    # The ≤ 0.23 shape: positional, trailing fields that hold their default are dropped.
    if isinstance(ev, BlockStored):
        values: list[Any] = [
            "BlockStored",
            list(ev.block_hashes),
            ev.parent_block_hash,
            list(ev.token_ids),
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            None if ev.extra_keys is None else [None if e is None else list(e) for e in ev.extra_keys],
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
            ev.locality,
            ev.ownership,
        ]
        keep = 1 + _STORED_REQUIRED + 2  # lora_id and medium were positional in every array version
    elif isinstance(ev, BlockRemoved):
        values = ["BlockRemoved", list(ev.block_hashes), ev.medium, ev.group_idx, ev.locality, ev.ownership]
        keep = 3
    else:
        return ["AllBlocksCleared"]
    while len(values) > keep and values[-1] is None:
        values.pop()
    return values


def encode_batch(batch: EventBatch | Sequence[Event], shape: Literal["map", "array"] = "map") -> bytes:
    """Encode events the way vLLM does: ``"map"`` like vLLM 0.32, ``"array"`` like vLLM ≤ 0.23."""
    if not isinstance(batch, EventBatch):
        batch = EventBatch(0.0, tuple(batch))
    if shape == "map":
        events: list[Any] = [_map_event(e) for e in batch.events]
    elif shape == "array":
        events = [_array_event(e) for e in batch.events]
    else:
        raise ValueError(f"shape must be 'map' or 'array', got {shape!r}")
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
