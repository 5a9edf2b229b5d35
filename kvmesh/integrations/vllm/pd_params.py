"""The ``kv_transfer_params`` of a prefill/decode hand-over: built and signed by the producer,
checked by the consumer before it acts on them.

A finished prefill answers (vLLM carries it as the response's top-level
``kv_transfer_params``)::

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_host": H,
     "remote_port": P, "remote_engine_id": E,
     "kvmesh": {"v": 1, "transfer_id": T, "keys": [..], "num_tokens": N,
                "model_fingerprint": F, "ports": [one per tensor-parallel rank],
                "expires": <unix seconds>, "sig": <fleet key tag, hex>}}

``sig`` is :meth:`FleetKey.sign_value <kvmesh.core.fleetkey.FleetKey.sign_value>` (purpose
``TRANSFER_PARAMS``) over ``remote_host``, ``remote_port``, ``remote_engine_id`` and the
``kvmesh`` map without ``sig``: the address a consumer connects to, the transfer id, every
chunk key and the expiry are covered; what vLLM adds beside them
(``remote_prefill_cached_tokens``) is not used. A consumer holding the key acts only on
params whose signature verifies and whose expiry (the producer's pin timeout; clocks are
assumed NTP-close) has not passed, and connects only to the signed host and ports: anything
else is refused with a reason (``params_unsigned``, ``params_bad_signature``,
``params_expired``, ``params_malformed``) before any connection is made. Without a key
(``pd_allow_insecure``) params are unsigned and only their shape is checked.

The transfer id is ``secrets.token_urlsafe`` (192 bits), not vLLM's request id: the producer
serves a held chunk only to a fetch naming it.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.core.fleetkey import TRANSFER_PARAMS, FleetKey

PARAMS_KEY = "kvmesh"  # our part of kv_transfer_params, beside vLLM's / NIXL's names
VERSION = 1
MAX_KEYS = 1 << 16  # chunks of one prompt (16M tokens at 256 a chunk)
MAX_PORTS = 1024  # tensor-parallel ranks
REFUSALS = ("params_unsigned", "params_bad_signature", "params_expired", "params_malformed")


def new_transfer_id() -> str:
    return secrets.token_urlsafe(24)


def wants_export(request: Any) -> bool:
    """A prefill half: the router asked for the KV to be handed to a decode replica."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def remote_prefill(request: Any) -> Mapping[str, Any] | None:
    """The producer's parameters of a decode half, or ``None`` (not a PD decode, or the
    parameters are not kvmesh's). Not yet verified: see :func:`verify_params`."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return None
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping) or not params.get("remote_host"):
        return None
    return params


def _signed_part(params: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "remote_host": params.get("remote_host"),
        "remote_port": params.get("remote_port"),
        "remote_engine_id": params.get("remote_engine_id"),
        PARAMS_KEY: {k: v for k, v in ours.items() if k != "sig"},
    }


def response_params(
    engine_id: str,
    exports: list[Mapping[str, Any]],
    key: FleetKey | None = None,
    ttl_s: float = 60.0,
    now: float | None = None,
) -> dict[str, Any]:
    """``kv_transfer_params`` of a finished prefill from every rank's export answer (they
    share one transfer id), signed with ``key`` when there is one."""
    first = exports[0]
    ours: dict[str, Any] = {
        "v": VERSION,
        "transfer_id": first["transfer_id"],
        "keys": list(first["keys"]),
        "num_tokens": min(int(e["num_tokens"]) for e in exports),
        "model_fingerprint": first["model_fingerprint"],
        "ports": [int(e["port"]) for e in exports],
    }
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": first["host"],
        "remote_port": first["port"],
        "remote_engine_id": engine_id,
        PARAMS_KEY: ours,
    }
    if key is not None:
        ours["expires"] = math.ceil((time.time() if now is None else now) + ttl_s)
        ours["sig"] = key.sign_value(TRANSFER_PARAMS, _signed_part(out, ours))
    return out


@dataclass(frozen=True)
class Transfer:
    """Verified transfer parameters: all a consumer acts on."""

    host: str
    ports: tuple[int, ...]
    transfer_id: str
    keys: tuple[str, ...]
    num_tokens: int

    def port(self, rank: int) -> int:
        return self.ports[min(rank, len(self.ports) - 1)]


def verify_params(
    params: Mapping[str, Any], key: FleetKey | None, now: float | None = None
) -> Transfer | str:
    """The :class:`Transfer` ``params`` describe, or the reason (one of :data:`REFUSALS`)
    they are refused. With ``key`` the signature and expiry must hold; without one (the
    insecure opt-in) only the shape is checked."""
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, Mapping):
        return "params_malformed"
    if key is not None:
        sig = ours.get("sig")
        if sig is None:
            return "params_unsigned"
        if not key.verify_value(TRANSFER_PARAMS, _signed_part(params, ours), sig):
            return "params_bad_signature"
        expires = ours.get("expires")
        if not isinstance(expires, int | float) or (time.time() if now is None else now) > expires:
            return "params_expired"
    host, ports, tid = params.get("remote_host"), ours.get("ports"), ours.get("transfer_id")
    keys, n = ours.get("keys"), ours.get("num_tokens")
    if not (isinstance(host, str) and 0 < len(host) <= 255 and isinstance(tid, str) and 0 < len(tid) <= 128):
        return "params_malformed"
    if not (isinstance(ports, list) and 0 < len(ports) <= MAX_PORTS):
        return "params_malformed"
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        return "params_malformed"
    if not (isinstance(keys, list) and len(keys) <= MAX_KEYS and all(isinstance(k, str) for k in keys)):
        return "params_malformed"
    if not isinstance(n, int) or n < 0:
        return "params_malformed"
    return Transfer(host, tuple(ports), tid, tuple(keys), n)
