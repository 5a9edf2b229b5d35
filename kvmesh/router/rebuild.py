"""Refill a (re)started router's index from what the replicas already hold.

A router that restarts comes back with an empty index and, until new KV events arrive,
routes every request by load alone: the prefixes the replicas hold earn nothing (llm-d's
users saw "a restarted router produced zero pulls"). Two sources refill it:

* the replica's vLLM KV-event replay socket (``ReplicaConfig.replay``): the event
  subscriber asks it for the whole buffer as soon as it starts (GPU and kvmesh media);
* the replica's kvmesh admin API (``ReplicaConfig.admin``, or an engine that registers
  with the controller under the replica's name): its ``held`` operation pages through the
  chunks its kvmesh tiers (CPU, disk, remote) hold, as the ``BlockStored`` events that
  announced them. A few bounded pages per replica, once per start, never per request.

Stale answers cost little: an entry for a chunk evicted meanwhile is a miss after a failed
load, the same as any other stale entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvmesh.admin.schema import ENGINE_PREFIX, MAX_HELD_PAGE
from kvmesh.events.codec import BlockHash, BlockStored, EventBatch
from kvmesh.router.config import ControllerConfig
from kvmesh.routing.replies import json_capped

log = logging.getLogger(__name__)

Apply = Callable[[str, EventBatch], None]


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bool):
        raise ValueError(f"a block hash is an int or 'hex:...', not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.startswith("hex:"):
        return bytes.fromhex(value[4:])
    raise ValueError(f"a block hash is an int or 'hex:...', not {value!r}")


def events_of(page: Any) -> list[BlockStored]:
    """The ``BlockStored`` events of one ``held`` answer (``ValueError`` if it is not one)."""
    if not isinstance(page, dict) or not isinstance(page.get("events"), list):
        raise ValueError("a held answer is an object with an 'events' list")
    out = []
    for ev in page["events"]:
        if not isinstance(ev, dict):
            raise ValueError("a held event is an object")
        tokens, bs = ev.get("token_ids"), ev.get("block_size")
        hashes = ev.get("block_hashes")
        if not isinstance(tokens, list) or not isinstance(bs, int) or not isinstance(hashes, list):
            raise ValueError("a held event needs token_ids, block_size and block_hashes")
        parent = ev.get("parent_block_hash")
        medium, group, kind = ev.get("medium"), ev.get("group_idx"), ev.get("kv_cache_spec_kind")
        lora_name, lora_id = ev.get("lora_name"), ev.get("lora_id")
        out.append(
            BlockStored(
                block_hashes=tuple(_hash(h) for h in hashes),
                parent_block_hash=None if parent is None else _hash(parent),
                token_ids=tuple(tokens),
                block_size=bs,
                medium=medium if isinstance(medium, str) else None,
                # a LoRA adapter's chunk: matched only by requests for that adapter
                lora_name=lora_name if isinstance(lora_name, str) else None,
                lora_id=lora_id if type(lora_id) is int else None,
                # a hybrid model's full-attention group (tracker.py): indexed under that group
                group_idx=group if type(group) is int else None,
                kv_cache_spec_kind=kind if isinstance(kind, str) else None,
            )
        )
    return out


async def rebuild_from_admin(
    client: aiohttp.ClientSession,
    replica: str,
    admin_url: str,
    apply: Apply,
    *,
    token: str | None,
    max_chunks: int,
    timeout_s: float,
) -> int:
    """Page through ``admin_url``'s ``held`` chunks (at most ``max_chunks``) into ``apply``;
    the number of events applied. Errors are logged: a rebuild is best effort."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    cursor: int | None = 0
    asked = applied = 0
    url = admin_url.rstrip("/") + ENGINE_PREFIX + "held"
    t0 = time.monotonic()
    while cursor is not None and asked < max_chunks:
        limit = min(MAX_HELD_PAGE, max_chunks - asked)
        try:
            async with client.post(
                url,
                json={"cursor": cursor, "limit": limit},
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status != 200:
                    log.warning("index rebuild: %s answered %d to held; skipped", replica, resp.status)
                    break
                page = await json_capped(resp)
            events = events_of(page)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("index rebuild from %s (%s) stopped: %r", replica, admin_url, exc)
            break
        if events:
            # Hashing a page's blocks takes a while: off the loop that relays streams.
            await asyncio.to_thread(apply, replica, EventBatch(time.time(), tuple(events)))
            applied += len(events)
        asked += limit
        nxt = page.get("next")
        cursor = nxt if isinstance(nxt, int) and not isinstance(nxt, bool) and nxt > cursor else None
    if applied:
        log.info(
            "index rebuild: %d held-chunk events from %s in %.2fs", applied, replica, time.monotonic() - t0
        )
    return applied


class Rebuilder:
    """Runs :func:`rebuild_from_admin` as background tasks of the router's loop, once per
    replica and start (``ControllerConfig.rebuild`` turns it off)."""

    def __init__(self, apply: Apply, config: ControllerConfig) -> None:
        self._apply = apply
        self._config = config
        self._tasks: set[asyncio.Task[int]] = set()
        self.done: dict[str, int] = {}  # replica -> events applied

    def start(self, client: aiohttp.ClientSession, replica: str, admin_url: str) -> None:
        if not self._config.rebuild or replica in self.done:
            return
        self.done[replica] = 0
        task = asyncio.get_running_loop().create_task(self._run(client, replica, admin_url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, client: aiohttp.ClientSession, replica: str, admin_url: str) -> int:
        n = await rebuild_from_admin(
            client,
            replica,
            admin_url,
            self._apply,
            token=self._config.token,
            max_chunks=self._config.rebuild_max_chunks,
            timeout_s=self._config.call_timeout_s,
        )
        self.done[replica] = n
        return n

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
