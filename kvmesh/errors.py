"""The kvmesh exception tree.

::

    KVMeshError
    ├── ConfigError            (also ValueError) bad or unknown configuration key/value
    │   └── DirectoryLockedError   a disk tier directory is owned by another live process
    ├── ClosedError            (also RuntimeError) an object used after close() / before start()
    ├── TierError              a tier failed; the engine turns it into a miss and a metric
    │   └── TierUnavailableError   the backing service is down, unreachable or too slow
    ├── CorruptChunkError      a stored chunk failed its header, token or checksum check
    │   └── UnauthenticatedChunkError  its fleet-key MAC/AEAD tag fails (or cannot be checked)
    ├── EventDecodeError       (also ValueError) a KV-event payload is not vLLM's wire shape
    ├── TokenizeError          (also ValueError) a request cannot be tokenized (client's fault)
    ├── BodyError              (also ValueError) a request body is wrong: carries field + status
    ├── UpstreamError          a replica's answer could not be had or read to its end
    │   └── UpstreamConnectError   nothing came back; the request may go to another replica
    ├── WireError              (also ConnectionError) a peer of a kvmesh socket protocol closed,
    │   │                      broke a limit or sent something that is not the protocol
    │   └── PeerAuthError          the peer did not prove it holds the fleet key
    └── ProcessError           a child process (vLLM, redis-server, a peer) failed to start or died

Input validation errors of the Python API are the built-in ``TypeError`` / ``ValueError``
(wrong token type, wrong KV shape or dtype), because callers already expect those.
Errors from a lower tier never reach ``CacheEngine.store`` / ``retrieve`` callers: a failing
tier degrades to a miss. A full tier is not an error: ``Tier.put`` returns ``False``, and an
exhausted pool makes ``MemoryPool.allocate`` return ``None`` (the engine evicts or skips).
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class ConfigError(KVMeshError, ValueError):
    """A configuration key is unknown or its value is invalid."""


class DirectoryLockedError(ConfigError):
    """Another live process holds the disk tier directory's lock (``holder_pid``)."""

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class ClosedError(KVMeshError, RuntimeError):
    """An object was used after ``close()`` (or before ``start()``): create or start a new one."""


class TierError(KVMeshError):
    """A storage tier could not complete an operation."""


class TierUnavailableError(TierError):
    """The service behind a tier (Redis, a mount) cannot be reached, or missed its deadline."""


class CorruptChunkError(KVMeshError):
    """A stored chunk failed verification: it must be treated as a miss."""


class UnauthenticatedChunkError(CorruptChunkError):
    """A stored chunk's fleet-key tag does not verify, or a keyed reader found an unkeyed
    chunk: a miss, counted as ``unauthenticated``. ``discard``: the reader holds a fleet key,
    so the chunk is not the fleet's and may be deleted; a reader without a key cannot judge a
    keyed chunk and leaves it to the fleet."""

    def __init__(self, message: str, discard: bool = True) -> None:
        super().__init__(message)
        self.discard = discard


class EventDecodeError(KVMeshError, ValueError):
    """A KV-event payload does not have the vLLM wire shape; the batch is dropped."""


class TokenizeError(KVMeshError, ValueError):
    """The request cannot be tokenized (bad messages, template error); the client's fault."""


class BodyError(KVMeshError, ValueError):
    """A request the client got wrong: answered with ``status`` and the offending field."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


class UpstreamError(KVMeshError):
    """The replica's answer could not be had or read to its end."""


class UpstreamConnectError(UpstreamError):
    """Nothing came back: no connection, or it closed before the answer began.

    The replica did not answer, so the request may go to another one.
    """


class UpstreamBrokenError(UpstreamError):
    """The answer began, then its connection closed or broke before the answer's end.

    The replica most likely died mid-answer. Nothing of the answer has been relayed while its
    head is still being read, so the request may go to another replica then.
    """


class ReplicaDownError(UpstreamBrokenError):
    """The router's health checks took the replica out while it owed this answer: a hung
    replica (a stopped process, a wedged GPU) breaks nothing, so its connection was cut."""


class ProcessError(KVMeshError):
    """A child process kvmesh started (vLLM, redis-server, a peer) failed to start or exited."""


class WireError(KVMeshError, ConnectionError):
    """A peer of a kvmesh socket protocol (PD transfer, TP lookup RPC) closed the connection,
    broke a limit (frame size, deadline) or sent something that is not the protocol."""


class PeerAuthError(WireError):
    """The peer did not prove it holds the fleet key (or asked for a key this side lacks)."""
