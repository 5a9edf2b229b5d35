"""Direct KV transfer between vLLM replicas (prefill/decode disaggregation).

A producer (``kv_role: kv_producer`` or ``kv_both``) runs a :class:`TransferServer` in its
vLLM worker process, next to its :class:`~kvmesh.CacheEngine`; a consumer's worker pulls a
request's chunks from it with :func:`pull` straight into its own pool slots, verifying each
like any chunk read from a tier (key, layout, tokens, checksums), then confirms so the
producer drops the pins (:class:`PinLedger`) that kept the chunks between the two halves.
Wire format: :mod:`kvmesh.transport.wire` (framed msgpack control messages and kvmesh's
chunk format, no pickle). With a fleet key both ends prove it (:mod:`kvmesh.transport.auth`)
and every chunk carries a MAC; the server runs on the bounded
:class:`~kvmesh.transport.listener.Listener` (connection caps, frame caps, deadlines).
"""

from kvmesh.transport.client import PullResult, confirm, pull
from kvmesh.transport.pins import PinLedger
from kvmesh.transport.server import TransferServer

__all__ = ["PinLedger", "PullResult", "TransferServer", "confirm", "pull"]
