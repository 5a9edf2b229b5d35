"""Large request bodies checked in a worker process, so that the event loop keeps serving.

msgspec holds the GIL for a whole decode, so a thread would not help: a 14 MiB token-id
prompt holds it for ~0.1 s (more on a busy machine), and every request and ``/health`` on
the loop would wait that long. A body of ``offload_bytes`` and more is therefore first
checked by :func:`kvmesh.bodylimits.decode_request` in a worker process (``python -m
kvmesh.bodyworker``: it imports msgspec and nothing of the caller, unlike a
multiprocessing "spawn" child, which would re-run the caller's ``__main__``). The loop only
streams the bytes down a pipe and reads back a verdict; the body is decoded in the caller
only once it passed, and then it holds at most ``max_values`` values (a few ms to decode).

The body stays in the pieces it arrived in (:meth:`BodyChecker.decode_parts`) until it
passed: one 14 MiB copy costs the loop ~5-10 ms on a busy 2-core machine, and joining the
pieces, copying them into a bytearray and that into bytes (what ``aiohttp``'s
``request.read()`` does) held ``/health`` for 30 ms.

The pipe protocol (the worker's stdin and stdout, little-endian lengths, msgpack, no
pickle): request ``u32 meta length, u64 body length, meta, body`` where meta is ``[chat,
max_tokens, chars_per_token, max_depth, max_values]``; answer ``u32 length`` and the
msgpack of ``None`` (accepted) or ``[status, field, message]``.

One worker serves one body at a time; it is started with the first large body (most
routers never see one) and replaced when it dies or misses ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from kvmesh.bodylimits import PromptLimits, decode_request
from kvmesh.errors import BodyError

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 256 << 10  # smaller bodies take ~2 ms at most to check inline
_HEAD = struct.Struct("<IQ")
_LEN = struct.Struct("<I")
_MAX_ANSWER = 1 << 16
_PIECE = 256 << 10  # written to the pipe at a time


class BodyChecker:
    """:meth:`decode` a request body: inline when small, checked by the worker first when large."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES, timeout_s: float = 30.0) -> None:
        self.offload_bytes = offload_bytes
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False

    async def decode(self, raw: bytes, chat: bool, limits: PromptLimits) -> dict[str, Any]:
        """The checked body; :class:`BodyError` (a 4xx, or 503 if the worker failed) if not."""
        return (await self.decode_parts([raw], chat, limits))[0]

    async def decode_parts(
        self, parts: Sequence[bytes], chat: bool, limits: PromptLimits
    ) -> tuple[dict[str, Any], bytes]:
        """The checked body of a body received in ``parts``, and its bytes (joined only once
        it passed); :class:`BodyError` (a 4xx, or 503 if the worker failed) if not."""
        size = sum(len(p) for p in parts)
        if size >= self.offload_bytes and not self._closed:
            verdict = await self._ask(parts, size, chat, limits)
            if verdict is not None:
                status, field, message = verdict
                raise BodyError(str(field), str(message), status=int(status))
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        return decode_request(raw, chat, limits), raw

    async def _ask(
        self, parts: Sequence[bytes], size: int, chat: bool, limits: PromptLimits
    ) -> list[Any] | None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        meta = msgspec.msgpack.encode(
            [chat, limits.max_tokens, limits.chars_per_token, limits.max_depth, limits.max_values]
        )
        async with self._lock:
            try:
                proc = await self._worker()
                stdin, stdout = proc.stdin, proc.stdout
                if stdin is None or stdout is None:
                    raise OSError("the worker has no pipes")
                async with asyncio.timeout(self.timeout_s):
                    stdin.write(_HEAD.pack(len(meta), size) + meta)
                    for part in parts:  # a piece at a time: the transport's buffer stays small
                        view = memoryview(part)
                        for at in range(0, len(view), _PIECE):
                            stdin.write(view[at : at + _PIECE])
                            await stdin.drain()
                    (n,) = _LEN.unpack(await stdout.readexactly(_LEN.size))
                    if n > _MAX_ANSWER:
                        raise ValueError(f"answer of {n} bytes")
                    answer = msgspec.msgpack.decode(await stdout.readexactly(n))
            except (OSError, EOFError, TimeoutError, ValueError, msgspec.DecodeError) as exc:
                # Died (killed, out of memory), hung or garbled: the next body gets a new one.
                log.warning("the body checker's worker process failed (%r); starting another", exc)
                await self._stop()
                raise BodyError("body", "request body could not be checked; retry", status=503) from None
        return answer if isinstance(answer, list) else None

    async def _worker(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvmesh.bodyworker",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        return self._proc

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        self._closed = True
        await self._stop()


def serve(stdin: Any, stdout: Any) -> None:
    """The worker's loop: one request in, one verdict out, until stdin closes."""
    while True:
        head = stdin.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return
        meta_len, body_len = _HEAD.unpack(head)
        chat, max_tokens, chars, depth, values = msgspec.msgpack.decode(stdin.read(meta_len))
        raw = stdin.read(body_len)
        limits = PromptLimits(max_tokens, chars, depth, values)
        try:
            decode_request(raw, chat, limits)
            verdict: list[Any] | None = None
        except BodyError as exc:
            verdict = [exc.status, exc.field, exc.message]
        out = msgspec.msgpack.encode(verdict)
        stdout.write(_LEN.pack(len(out)) + out)
        stdout.flush()


if __name__ == "__main__":
    # Checking a hostile body is background work: the loop that serves everyone else goes first
    # when the two want the same core.
    os.nice(10)
    serve(sys.stdin.buffer, sys.stdout.buffer)
