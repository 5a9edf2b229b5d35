"""Coverage-guided fuzz targets (atheris / libFuzzer) for the decoders of outside bytes.

Run one directly, e.g. ``python tests/property/atheris_targets.py events -runs=100000``
(``events``, ``serde``, ``held``, ``prompt``, ``wire``); ``tests/property/test_atheris.py``
runs each briefly. A target raises on anything but the decoder's one documented error, which libFuzzer
reports as a crash with the input that caused it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import atheris
import msgspec

# Third-party packages first, uninstrumented (instrumenting torch takes most of a minute);
# then kvmesh's own modules, instrumented for coverage feedback.
for _heavy in ("torch", "numpy", "zstandard", "xxhash", "pydantic", "yaml", "zmq", "tokenizers", "jinja2"):
    __import__(_heavy)

# The block index's numba kernels, uninstrumented too: numba compiles a kernel from its
# bytecode, which atheris's instrumentation changes beyond what numba can type.
import kvmesh.index.table  # noqa: E402, F401

with atheris.instrument_imports(include=["kvmesh"]):
    from kvmesh.core import serde
    from kvmesh.errors import CorruptChunkError, EventDecodeError, TokenizeError, WireError
    from kvmesh.events.codec import decode_batch
    from kvmesh.index import BlockIndex
    from kvmesh.integrations.vllm.pd_params import verify_params
    from kvmesh.router.rebuild import events_of
    from kvmesh.transport.wire import FrameReader


def events(data: bytes) -> None:
    payloads = [data]
    # JSON-shaped inputs reach the event structure, which random msgpack rarely does.
    with contextlib.suppress(ValueError, RecursionError, OverflowError, TypeError):
        payloads.append(msgspec.msgpack.encode(json.loads(data)))
    for payload in payloads:
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            continue
        BlockIndex(max_blocks=32).apply("r", batch)


def chunk(data: bytes) -> None:
    try:
        serde.decode(data)
    except CorruptChunkError:
        return


def held(data: bytes) -> None:
    try:
        page = json.loads(data)
    except (ValueError, RecursionError):
        return
    try:
        events_of(page)
    except ValueError:
        return


_TOKENIZER = None


def prompt(data: bytes) -> None:
    global _TOKENIZER
    if _TOKENIZER is None:
        from kvmesh.router.testing import write_test_tokenizer
        from kvmesh.routing.tokenize import PromptTokenizer

        _TOKENIZER = PromptTokenizer.from_dir(write_test_tokenizer(Path(sys.argv[0]).parent / ".atheris-tok"))
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return
    if not isinstance(body, dict):
        return
    for fn in (_TOKENIZER.completion, _TOKENIZER.chat):
        with contextlib.suppress(TokenizeError):
            fn(body)


_WIRE_KEY = None


def wire(data: bytes) -> None:
    """The PD transfer's framing and handshake (what a peer on the network sends a transfer
    server or the TP lookup RPC), and kv_transfer_params (what a client can put in a
    request): messages or the one documented error / refusal, never anything else."""
    global _WIRE_KEY
    from kvmesh.core.fleetkey import TRANSFER_AUTH, FleetKey
    from kvmesh.transport.auth import ServerAuth

    if _WIRE_KEY is None:
        _WIRE_KEY = FleetKey([b"atheris fleet key of 32 bytes or more"])
    cut = data[0] if data else 0
    reader = FrameReader(limit=64 + 4 * cut)
    msgs: list[dict[str, object]] = []
    try:
        for piece in (data[1 : 1 + cut], data[1 + cut :]):
            msgs += reader.feed(piece)
    except WireError:
        pass
    auth = ServerAuth(_WIRE_KEY, TRANSFER_AUTH)
    for i, msg in enumerate(msgs):
        try:
            auth.challenge(msg) if i == 0 else auth.verify(msg)
        except WireError:
            break
        got = verify_params(msg, _WIRE_KEY)
        assert isinstance(got, str), "unsigned fuzz input passed the signature check"
        verify_params(msg, None)
    with contextlib.suppress(ValueError, RecursionError):
        params = json.loads(data)
        if isinstance(params, dict):
            assert isinstance(verify_params(params, _WIRE_KEY), str)
            verify_params(params, None)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "events": events,
    "serde": chunk,
    "held": held,
    "prompt": prompt,
    "wire": wire,
}

if __name__ == "__main__":
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()
