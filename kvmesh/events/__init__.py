"""vLLM KV events: wire codec, ZMQ publisher with replay, subscriber with gap repair."""

from kvmesh.errors import EventDecodeError
from kvmesh.events.codec import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.events.publisher import EventPublisher
from kvmesh.events.subscriber import EventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventDecodeError",
    "EventPublisher",
    "EventSubscriber",
    "decode_batch",
    "encode_batch",
]
