"""Every JSON under ``docs/bench/`` carries the provenance the code wrote (the runner's:
commit and dirty flag read from git when the run started), or is listed in
``docs/bench/STALE``, which the generated pages mark stale. The lead empties the list as he
reruns; a listed JSON that has its provenance must leave the list."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.docsgen import bench_pages, bench_spec

BENCH = Path(__file__).resolve().parents[3] / "docs" / "bench"
RUNNER_KEYS = {"suite", "commit", "dirty", "date", "host", "loadavg_before", "loadavg_after", "argv"}


def code_written(data: object) -> bool:
    """The runner's ``Provenance.record()``: every key, a commit, a boolean dirty flag."""
    prov = data.get("provenance") if isinstance(data, dict) else None
    return (
        isinstance(prov, dict)
        and set(prov) >= RUNNER_KEYS
        and isinstance(prov["commit"], str)
        and bool(prov["commit"])
        and isinstance(prov["dirty"], bool)
    )


def test_every_json_has_code_written_provenance_or_is_listed_stale() -> None:
    stale = bench_pages.stale_list(BENCH)
    names = {p.name for p in BENCH.glob("*.json")}
    unlisted = sorted(
        n for n in names if n not in stale and not code_written(json.loads((BENCH / n).read_text()))
    )
    assert not unlisted, f"no provenance written by the code, and not in docs/bench/STALE: {unlisted}"
    assert set(stale) <= names, (
        f"docs/bench/STALE lists JSONs that are not there: {sorted(set(stale) - names)}"
    )
    rerun = sorted(n for n in stale if code_written(json.loads((BENCH / n).read_text())))
    assert not rerun, f"rerun with provenance: take them out of docs/bench/STALE: {rerun}"
    assert all(stale.values()), "every line of docs/bench/STALE says why"


def test_the_pages_mark_every_listed_json_stale(tmp_path: Path) -> None:
    # On a copy whose STALE lists one more JSON: the recorded list may be empty (every JSON rerun).
    import shutil

    bench = tmp_path / "bench"
    shutil.copytree(BENCH, bench)
    with open(bench / "STALE", "a") as f:
        f.write("tiers.json                    listed by this test\n")
    data = bench_pages.BenchData(bench, bench_spec.load(bench / "pages.yaml"))
    stale = bench_pages.stale_list(bench)
    figures = [f for suite in data.pages.suites.values() for f in suite.figures if f.json_file in stale]
    assert "tiers.json" in {f.json_file for f in figures}
    for fig in figures:
        assert data.status(fig).startswith("**stale** (listed in `docs/bench/STALE`"), fig.json_file


def test_code_written_is_the_runners_record(tmp_path: Path) -> None:
    from kvmesh.bench.runner import provenance, write_json

    write_json(str(tmp_path / "x.json"), {"rows": []}, provenance("x"))
    assert code_written(json.loads((tmp_path / "x.json").read_text()))
    assert not code_written({"commit": "abc1234"}) and not code_written({"env": {"git_commit": "abc1234"}})
    assert not code_written({"provenance": {"commit": "abc1234"}})  # typed by hand: no host, no dirty flag
