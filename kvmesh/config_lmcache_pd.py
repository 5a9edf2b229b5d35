"""LMCache's prefill/decode (PD) keys, read with kvmesh's PD meaning.

LMCache 0.5.6's PD (``enable_pd``, ``pd_role``, ``pd_peer_*``, ``pd_proxy_*``,
``pd_buffer_*``, ``transfer_channel``, ``nixl_*``) and the NIXL keys of its older releases
(``enable_nixl``, ``nixl_receiver_host`` / ``_port``, ``nixl_enable_gc``) describe a sender
that *pushes* KV over NIXL into a receiver listening at ``pd_peer_host:pd_peer_init_port``,
and tells a proxy when it is done. kvmesh's PD is the other way round: the consumer *pulls*
the producer's chunks over kvmesh's own TCP transfer server (the producer listens on
``kv_ip`` and vLLM's ``kv_port``; transfers are signed with the fleet key), and learns the
producer's address from ``kv_transfer_params``, which the router carries; no proxy is
notified. So what carries over is the role: ``pd_role: sender`` is vLLM's
``kv_role: kv_producer`` and ``receiver`` is ``kv_consumer``; the connector warns when
vLLM's ``kv_role`` says otherwise. Addresses, ports and buffer sizes are read and reported
(``kvmesh config check``) with what kvmesh uses instead.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.errors import ConfigError

log = logging.getLogger("kvmesh.config")

ROLES = {"sender": "kv_producer", "receiver": "kv_consumer"}
TRANSPORT = (
    "kvmesh's consumer pulls the producer's chunks over kvmesh's own TCP transfer server "
    "(producer: kv_ip and vLLM's kv_port; signed with the fleet key), not NIXL/UCX"
)
_ADDRESS = (
    "in LMCache the receiver listens here and the sender pushes to it; in kvmesh the producer "
    "listens (kv_ip, vLLM's kv_port) and the consumer learns its address from kv_transfer_params"
)
_PROXY = "kvmesh's router reads kv_transfer_params from the prefill response; no proxy is notified"
_BUFFER = "kvmesh stages transfers through its CPU pool; there is no NIXL buffer to size"
_TUNING = "LMCache PD tuning; kvmesh's are pd_pin_timeout_s / pd_fetch_timeout_s (connector keys)"

# key -> (LMCache's default, what kvmesh does instead)
_NOTES: dict[str, tuple[Any, str]] = {
    "transfer_channel": (None, TRANSPORT),
    "nixl_backends": (None, TRANSPORT),
    "nixl_enable_gc": (False, TRANSPORT),
    "pd_buffer_size": (None, _BUFFER),
    "pd_buffer_device": (None, _BUFFER),
    "nixl_buffer_device": (None, _BUFFER),
    "pd_peer_host": (None, _ADDRESS),
    "pd_peer_init_port": (None, _ADDRESS),
    "pd_peer_alloc_port": (None, _ADDRESS),
    "pd_peer_query_port": (None, _ADDRESS),
    "nixl_receiver_host": (None, _ADDRESS),  # older releases
    "nixl_receiver_port": (None, _ADDRESS),
    "nixl_peer_port": (None, _ADDRESS),
    "pd_proxy_host": (None, _PROXY),
    "pd_proxy_port": (None, _PROXY),
    "pd_skip_proxy_notification": (False, _PROXY),
    "pd_allocation_timeout_sec": (float("inf"), _TUNING),
    "pd_shutdown_timeout_sec": (5.0, _TUNING),
    "pd_condition_poll_interval_sec": (0.005, _TUNING),
    "pd_backend_mode": ("async", _TUNING),
    "pd_max_prefill_len": (0, _TUNING),
}
_SWITCHES = ("enable_pd", "enable_nixl")
_UNSUPPORTED = {"pd_bidirectional": (False, "kvmesh's PD transfers one way, producer to consumer")}
PD_KEYS = frozenset(_NOTES) | frozenset(_SWITCHES) | frozenset(_UNSUPPORTED) | {"pd_role"}


def read(key: str, value: Any) -> tuple[str, str, str, str | None]:
    """``(action, target, note, expected vLLM kv_role or None)`` for one PD key."""
    if key in _SWITCHES:
        if value is None or value is False or str(value).lower() in ("false", "0", "no"):
            return "ignored", "", "PD off", None
        why = f"PD on: vLLM's kv_role chooses producer or consumer; {TRANSPORT}"
        return "mapped", "vLLM kv_role", why, None
    if key == "pd_role":
        if value is None:
            return "ignored", "", "no role", None
        role = ROLES.get(str(value).lower())
        if role is None:
            return "unsupported", "", f"pd_role={value!r}: LMCache's roles are sender and receiver", None
        return "mapped", f"kv_role={role}", "the connector checks vLLM's kv_role against it", role
    if key in _UNSUPPORTED:
        default, why = _UNSUPPORTED[key]
        if value is None or value == default:
            return "ignored", "", why, None
        return "unsupported", "", f"{key}={value!r}: {why}", None
    default, why = _NOTES[key]
    if value is None or value == default:
        return "ignored", "", why, None
    return "ignored", "", f"{key}={value!r} not used: {why}", None


def check_role(expected: str | None, kv_role: str | None, strict: bool) -> None:
    """Compare LMCache's ``pd_role`` (as vLLM's ``kv_role``) with vLLM's actual ``kv_role``:
    a warning when they differ (a :class:`ConfigError` with ``strict``); vLLM's wins."""
    if expected is None or kv_role is None or expected == kv_role:
        return
    msg = (
        f"LMCache's pd_role asks for vLLM kv_role={expected!r} but --kv-transfer-config has "
        f"kv_role={kv_role!r}; kvmesh follows vLLM's kv_role (set it to {expected!r} for LMCache's meaning)"
    )
    if strict:
        raise ConfigError(f"strict: true and {msg}")
    log.warning("kvmesh config: %s", msg)
