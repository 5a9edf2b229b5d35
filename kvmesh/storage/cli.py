"""``kvmesh ftl``: validate the FTL simulator, or replay a disk-tier I/O trace through it.

The simulator (numba) is imported when one of these commands runs, not when the parser is
built: every kvmesh command builds it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.storage.trace import GC_POLICIES, compact, load_trace
from kvmesh.tiers.placement import LIFETIME_CLASSES, Placement


def _validate(args: argparse.Namespace) -> int:
    from kvmesh.storage import ftl

    rows = ftl.validate(logical_pages=args.logical_pages)
    for r in rows:
        print(
            f"{r['workload']:15s} op={r['op']:.2f}  dlwa={r['dlwa']:.3f}  "
            f"closed form={r['closed_form']:.3f}  error={100 * r['error']:+.2f}%  "
            f"{r['sim_pages_per_s'] / 1e6:.1f}M pages/s"
        )
    ok = all(abs(r["error"]) <= 0.05 for r in rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "within_5pct": ok}, f, indent=2)
    return 0 if ok else 1


def _replay(args: argparse.Namespace) -> int:
    from kvmesh.storage import ftl

    # FDP: one reclaim-unit handle per lifetime level, as the disk tier's placement groups them.
    placement = Placement(
        "segments", class_map=json.loads(args.placement_map) if args.placement_map else None
    )
    stream_of = {c: placement.stream(c) for c in LIFETIME_CLASSES} if args.fdp else None
    trace = load_trace(args.trace, page_bytes=args.page_bytes, stream_of=stream_of, trims=not args.no_trims)
    if not len(trace.ops):
        raise ConfigError(f"trace {args.trace} has no writes or trims with extents; was disk_io_trace set?")
    if args.compact:
        trace, pages = compact(trace)
    else:
        pages = trace.max_page
    if args.device_bytes:
        want = args.device_bytes // args.page_bytes
        if want < pages:
            raise ConfigError(
                f"--device-bytes {args.device_bytes} is smaller than the {pages * args.page_bytes} bytes "
                "the trace addresses; pass a larger size or --compact"
            )
        pages = want
    cfg = ftl.FTLConfig(
        logical_pages=pages,
        overprovisioning=args.op,
        pages_per_block=args.pages_per_block,
        blocks_per_ru=args.blocks_per_ru,
        streams=len(placement.levels) if args.fdp else 1,
        gc=args.gc,
        page_bytes=args.page_bytes,
    )
    res = ftl.simulate(cfg, trace.ops, trace.lpns, trace.npages, trace.streams, trace.arrival_s)
    out: dict[str, Any] = {"config": ftl.config_dict(cfg), **res.summary(trace.ops)}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("ftl", help="flash-translation-layer simulator: DLWA, GC copies, write latency")
    fsub = p.add_subparsers(dest="ftl", required=True)
    v = fsub.add_parser("validate", help="greedy GC vs its closed form, and a sequential workload")
    v.add_argument("--logical-pages", type=int, default=1 << 18)
    v.add_argument("--json", help="write the rows here")
    v.set_defaults(func=_validate)
    r = fsub.add_parser("replay", help="replay a disk-tier I/O trace (disk_io_trace) through the FTL")
    r.add_argument("trace", help="JSON-lines trace written by the disk tier")
    r.add_argument(
        "--device-bytes", type=int, help="logical size of the drive (default: what the trace spans)"
    )
    r.add_argument("--compact", action="store_true", help="renumber addresses densely (file-per-chunk)")
    r.add_argument("--op", type=float, default=0.07, help="over-provisioning (default 0.07)")
    r.add_argument("--page-bytes", type=int, default=4096)
    r.add_argument("--pages-per-block", type=int, default=64)
    r.add_argument("--blocks-per-ru", type=int, default=1)
    r.add_argument("--gc", choices=sorted(GC_POLICIES), default="greedy")
    r.add_argument("--fdp", action="store_true", help="one reclaim-unit handle per lifetime level")
    r.add_argument(
        "--placement-map", help='JSON class -> level, as disk_placement_map (e.g. {"evict":"short"})'
    )
    r.add_argument("--no-trims", action="store_true", help="ignore deletes (a filesystem without discard)")
    r.add_argument("--json", help="write the summary here")
    r.set_defaults(func=_replay)
