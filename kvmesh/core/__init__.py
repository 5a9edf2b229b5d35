"""Core: keys, memory, serialization, eviction policy, offload and the engine."""
