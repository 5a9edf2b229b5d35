"""Finding 1 (producer side): any client that reaches a producer can send
``do_remote_decode`` requests, and each used to pin its prompt's chunks for
``pd_pin_timeout_s`` (60 s). A flood of such exports (the worker's export, as vLLM's
``request_finished`` calls it) must not pin more than ``pd_pin_max_fraction`` of the pool:
new prompts can still be stored, and the newest transfer is still served over the real
transfer server while the oldest flood holds are no longer reachable."""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.integrations.vllm.pd import response_params
from tests.security.pd_peers import CS, pair, prompt


def test_a_flood_of_exports_pins_a_bounded_share_of_the_pool(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, cons):
        eng = prod.engine
        slots = eng.cpu.pool.num_slots
        flood = []
        for i in range(slots):  # enough prompts, each exported, to pin the whole pool
            toks, kv = prompt(CS, seed=10 + i)
            eng.store(toks, kv)
            answer = prod.export(f"flood-{i}", toks)
            if answer is not None:
                flood.append(response_params("engine-p", [answer], key=prod.key, ttl_s=60))
        pinned = eng.cpu.pinned_count()
        assert pinned <= slots // 2, f"{pinned} of {slots} pool slots pinned by exports nobody pulls"
        # The pool still takes new prompts ...
        toks, kv = prompt(2 * CS, seed=5000)
        eng.store(toks, kv)
        assert eng.lookup(toks) == 2 * CS
        # ... the newest transfer is served, the oldest flood holds are gone.
        answer = prod.export("real", toks)
        assert answer is not None and len(answer["keys"]) == 2
        got = cons.pull("d-real", toks, response_params("engine-p", [answer], key=prod.key, ttl_s=60))
        assert got["reason"] is None and torch.equal(cons.engine.retrieve(toks)[1], kv)
        oldest = flood[0]
        first_toks, _ = prompt(CS, seed=10)
        assert cons.pull("d-old", first_toks, oldest)["reason"] == "missing_chunks"
        assert prod.stats()["pd_pins_evicted"] > 0
