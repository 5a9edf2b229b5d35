"""Finding 3 (issue #23): a decompression bomb in a shared tier.

A hostile writer puts a 25 KB zstd frame that declares 768 MiB where a chunk of a victim's
prompt should be, in a real ``fs://`` directory, with a header whose checksums are right
(no fleet key: the drop-in case, where only the bounds stand between the bomb and the
worker's memory). python-zstandard's ``decompress`` allocates what a frame declares, so
before the fix every read cost +768 MiB and seconds. Variants: the frame declares more than
the header's raw length (``frame``); the header itself claims a layout 12,288 times the
engine's, consistent with the frame (``layout``); and a victim holding a fleet key
(``keyed``: the MAC refuses the chunk before anything is parsed).

Done when: the bomb is a miss in under 50 ms and under 10 MiB of extra memory. Memory is
the peak RSS (``ru_maxrss``) of a fresh process around the read: zstd allocates in C, where
tracemalloc sees nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.core.fleetkey import FleetKey

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh process: its peak RSS before and after the read is the bomb's cost.
_VICTIM = r"""
import json, os, resource, struct, sys, time
import numpy as np, torch, xxhash, zstandard
from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.core import serde

url, variant, key_file = sys.argv[1], sys.argv[2], sys.argv[3] or None
LAYOUT, CHUNK, BOMB = KVLayout(2, 2, 16, "bfloat16"), 256, 768 << 20
cfg = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.01, "remote_url": url,
       "remote_serde": "zstd", "fleet_key_file": key_file}
eng = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")

# Warm up the whole read path with an honest chunk (imports, pool, codec).
honest = list(range(1000, 1000 + CHUNK))
kv = torch.randn(LAYOUT.shape(CHUNK)).to(torch.bfloat16)
eng.store(honest, kv)
assert eng.wait_for_writes(20)
assert eng.retrieve(honest)[0] == CHUNK

# The bomb: 768 MiB of zeros in one frame that declares its size (~25 KB).
c = zstandard.ZstdCompressor(level=1).compressobj(size=BOMB)
frame = b"".join([c.compress(bytes(1 << 20)) for _ in range(BOMB >> 20)] + [c.flush()])

# A well-formed header without a fleet key (checksums are public), built by kvmesh's own
# encoder for the victim's key and tokens, then pointed at the bomb.
victim = list(range(5000, 5000 + CHUNK))
key = eng.keys.keys(victim)[0]
zeros = bytes(CHUNK * LAYOUT.bytes_per_token)
head, _ = serde.encode(key, LAYOUT, np.asarray(victim, dtype=np.uint32), zeros, "zstd")
magic, version, mode, hlen, _plen = struct.unpack_from("<4sHHIQ", head)
meta = json.loads(head[20:20 + hlen])
if variant == "layout":  # 3 MiB a token: 256 tokens make exactly what the frame declares
    meta["layout"] = {"num_layers": 96, "num_kv_heads": 8, "head_size": 1024, "dtype": "bfloat16"}
    meta["raw_len"] = BOMB
    if "shape" in meta:
        meta["shape"] = [96, 2, CHUNK, 8, 1024]
meta["checksum"] = xxhash.xxh3_128_hexdigest(frame)
hjson = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
new = struct.pack("<4sHHIQ", magic, version, mode, len(hjson), len(frame)) + hjson
new += struct.pack("<Q", xxhash.xxh3_64_intdigest(new))
path = eng.lower["remote"].path(key)
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path + ".tmp", "wb") as f:
    f.write(new + frame)
os.replace(path + ".tmp", path)

rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
got, _ = eng.retrieve(victim)
dt = time.perf_counter() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stats = eng.stats()["remote"]
print(json.dumps({"tokens": got, "seconds": dt, "extra_mib": (rss1 - rss0) / 1024,
                  "rejected": stats["corrupt"] + stats.get("unauthenticated", 0)}))
eng.close()
"""


@pytest.mark.parametrize("variant", ["frame", "layout", "keyed"])
def test_a_decompression_bomb_is_a_fast_cheap_miss(
    variant: str, tmp_path: Path, key_file: Callable[..., str]
) -> None:
    key = key_file(FleetKey.generate()) if variant == "keyed" else ""
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_FLEET_KEY_FILE"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _VICTIM, f"fs://{tmp_path / 'shared'}", variant, key],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 0, "the bomb's chunk was served"
    assert result["rejected"] >= 1, "the bomb was not counted"
    assert result["seconds"] < 0.05, result
    assert result["extra_mib"] < 10, result
