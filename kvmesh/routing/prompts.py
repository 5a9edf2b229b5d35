"""The prompt's token ids for routing: tokenized here like the engine, or by a replica.

Local tokenizing (:class:`~kvmesh.routing.tokenize.PromptTokenizer`) is the default; with
``tokenizer: remote`` the least-loaded healthy replica's ``/tokenize`` answers. A prompt that
cannot be tokenized routes by load and session only: the replica gives the real error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import numpy as np

from kvmesh.errors import TokenizeError
from kvmesh.routing.config import RoutingConfig
from kvmesh.routing.pool import Pool
from kvmesh.routing.replies import json_capped
from kvmesh.routing.tokenize import PromptTokenizer, TokenArray, tokens_of

log = logging.getLogger(__name__)

# What vLLM's /tokenize needs to tokenize a request exactly as the request itself will be.
_TOKENIZE_KEYS = (
    "model", "add_special_tokens", "messages", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "tools",
)  # fmt: skip
# Bodies this large (~16k tokens and up) are tokenized on a worker thread: tokenizers releases
# the GIL, so the event loop keeps relaying other requests' streams meanwhile.
_OFFLOAD_BYTES = 64 << 10
NO_TOKENS = np.zeros(0, dtype=np.uint32)


class Prompts:
    """Token ids of request bodies; ``client()`` is the router's HTTP session (or None)."""

    def __init__(
        self,
        config: RoutingConfig,
        tokenizer: PromptTokenizer | None,
        pool: Pool,
        client: Callable[[], aiohttp.ClientSession | None],
        on_error: Callable[[], None],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._pool = pool
        self._client = client
        self._on_error = on_error
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvmesh-tokenize")
        # On a request's path: tokenize_timeout_s. Off it (the controller's lookups), the
        # router's own small calls' budget; never the generation timeout.
        own_calls = config.connect_timeout_s + config.health_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=config.tokenize_timeout_s or own_calls)
        self._lookup_timeout = aiohttp.ClientTimeout(total=own_calls)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def tokens(self, body: dict[str, Any], chat: bool, size: int) -> TokenArray:
        """The prompt's token ids, or none (then routing uses load and session only)."""
        try:
            if self.config.tokenizer == "remote":
                return await self.remote(body, chat)
            tok = self.tokenizer
            if tok is None:
                return NO_TOKENS
            encode = tok.chat if chat else tok.completion
            if size < _OFFLOAD_BYTES:
                return encode(body)
            return await asyncio.get_running_loop().run_in_executor(self._executor, encode, body)
        except TokenizeError as exc:
            # The replica gives the authoritative error (or accepts what we could not parse).
            log.debug("cannot tokenize request for routing: %s", exc)
            self._on_error()
            return NO_TOKENS

    async def lookup_tokens(self, body: dict[str, Any], chat: bool) -> TokenArray:
        """:meth:`remote` for a caller off the request path (the controller's lookups): the
        budget of the router's own calls, whatever ``tokenize_timeout_s`` says."""
        return await self.remote(body, chat, self._lookup_timeout)

    async def remote(
        self, body: dict[str, Any], chat: bool, timeout: aiohttp.ClientTimeout | None = None
    ) -> TokenArray:
        """Token ids from the least-loaded healthy replica's ``/tokenize`` (TokenizeError if not)."""
        client = self._client()
        if client is None or not self._pool.healthy():
            return NO_TOKENS
        replica = min(self._pool.healthy(), key=lambda r: r.state.load)
        payload = {k: body[k] for k in _TOKENIZE_KEYS if k in body}
        if not chat:
            prompt = body.get("prompt")
            payload["prompt"] = (
                prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else prompt
            )
        try:
            async with client.post(
                replica.url + "/tokenize", json=payload, timeout=timeout or self._timeout
            ) as resp:
                data = await json_capped(resp) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TokenizeError(f"{replica.name}/tokenize failed: {exc!r}") from exc
        ids = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(ids, list):
            raise TokenizeError(f"{replica.name}/tokenize gave no token list")
        return tokens_of(ids)
