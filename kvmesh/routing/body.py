"""What the router and the EPP accept of a client's OpenAI body, before routing it.

* Decoded and bounded by :mod:`kvmesh.bodylimits` (depth, value count, a prompt that cannot
  fit the model), large bodies checked in a worker process first (:mod:`kvmesh.bodyworker`)
  so that the event loop keeps serving.
* The model's ``max_model_len`` comes from ``RoutingConfig.max_model_len`` or, when that is
  unset, from the replicas' ``/v1/models`` (vLLM reports it per model; the largest a
  healthy replica serves counts, so that no prompt some replica could take is refused).
* ``kv_transfer_params`` is the replicas' own field: it tells a ``kv_both``/``kv_consumer``
  engine where to pull KV from. A client's is dropped in every mode (:func:`drop_transfer_params`);
  the router's PD path sets the producer's parameters itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.bodylimits import DEFAULT_CHARS_PER_TOKEN, MAX_VALUES, PromptLimits, check_token_count
from kvmesh.bodyworker import BodyChecker
from kvmesh.routing.config import RoutingConfig

if TYPE_CHECKING:
    from kvmesh.routing.pool import Pool
    from kvmesh.routing.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

TRANSFER_PARAMS = "kv_transfer_params"
# A normalizer (NFC, NFKC) may fold two characters into one token's worth: the character
# bound of a text prompt allows for it.
_NORMALIZER_SLACK = 2


def drop_transfer_params(body: dict[str, Any]) -> bool:
    """Remove a client's ``kv_transfer_params`` from ``body`` (top level, and inside
    ``vllm_xargs``, which vLLM hands to the engine beside them); True if anything was."""
    dropped = body.pop(TRANSFER_PARAMS, None) is not None
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and TRANSFER_PARAMS in xargs:
        del xargs[TRANSFER_PARAMS]
        dropped = True
    return dropped


class RequestBodies:
    """Decode and check the bodies of one router (or EPP): ``decode()``, ``check_tokens()``,
    ``close()``."""

    def __init__(self, config: RoutingConfig, tokenizer: PromptTokenizer | None, pool: Pool) -> None:
        self.config = config
        self.pool = pool
        chars = tokenizer.max_token_chars() if tokenizer is not None else DEFAULT_CHARS_PER_TOKEN
        self.chars_per_token = chars * _NORMALIZER_SLACK
        self._checker = BodyChecker()

    async def close(self) -> None:
        await self._checker.close()

    def limits(self) -> PromptLimits:
        max_len = self.config.max_model_len or self.pool.max_model_len()
        values = MAX_VALUES if max_len is None else max(MAX_VALUES, 2 * max_len)
        return PromptLimits(max_len, self.chars_per_token, max_values=values)

    async def decode(self, raw: bytes, chat: bool) -> dict[str, Any]:
        """The body as a dict; :class:`~kvmesh.errors.BodyError` says why not (a 4xx)."""
        return await self._checker.decode(raw, chat, self.limits())

    async def decode_parts(self, parts: Sequence[bytes], chat: bool) -> tuple[dict[str, Any], bytes]:
        """:meth:`decode` for a body received in ``parts``: the body and its bytes."""
        return await self._checker.decode_parts(parts, chat, self.limits())

    def check_tokens(self, n: int, chat: bool) -> None:
        """Refuse (:class:`~kvmesh.errors.BodyError`) a tokenized prompt over ``max_model_len``."""
        check_token_count(n, self.limits(), "messages" if chat else "prompt")
