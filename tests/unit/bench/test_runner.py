"""The shared runner: provenance read from git (commit and dirty flag) in every JSON,
interleaving, paired ratios."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest

from kvmesh.bench import runner


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_names_this_checkout() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=runner.REPO_ROOT, capture_output=True, text=True
    )
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    got = runner.git_commit()
    assert got is not None and re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", got), got
    assert got.split("+")[0] == head.stdout.strip()


def test_git_commit_is_none_outside_a_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(runner, "REPO_ROOT", tmp_path)
    assert runner.git_commit() is None


def test_repo_root_is_the_checkout_for_every_module_that_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suites moved a level down: a path taken from their own __file__ pointed into kvmesh/.
    from kvmesh.bench.common import peers
    from kvmesh.bench.ttft import bench as ttft

    assert (runner.REPO_ROOT / "pyproject.toml").is_file()
    monkeypatch.delenv(peers.PEERS_DIR_ENV, raising=False)
    assert peers.peers_dir() == runner.REPO_ROOT / ".cache" / "peers"
    assert ttft.default_model_dir().startswith(str(runner.REPO_ROOT / ".cache"))


def test_interleaved_reverses_every_other_step() -> None:
    assert [runner.interleaved("abc", s) for s in range(3)] == [list("abc"), list("cba"), list("abc")]
    order = [x for s in range(4) for x in runner.interleaved([1, 2], s)]
    assert order == [1, 2, 2, 1, 1, 2, 2, 1]  # each side as often first as second


def test_paired_ratios_pair_repeat_k_with_repeat_k_and_skip_missing_sides() -> None:
    assert runner.paired_ratios([2.0, None, 3.0, 4.0], [1.0, 1.0, 0.0, 2.0, 9.0]) == [2.0, 2.0]
    summary = runner.ratio_summary([1.0, 2.0, 3.0])
    assert summary == {"pairs": 3, "ratios": [1.0, 2.0, 3.0], "median": 2.0, "p90": 2.8}
    assert runner.ratio_summary([]) == {"pairs": 0, "ratios": [], "median": None, "p90": None}
    # A median of ratios, not a ratio of medians: the two differ when the machine drifts.
    num, den = [1.0, 10.0, 10.0], [2.0, 4.0, 40.0]
    assert runner.median_ratio(num, den) == 0.5 != statistics.median(num) / statistics.median(den)


def test_write_json_records_the_provenance_read_at_the_start(tmp_path: Path) -> None:
    prov = runner.provenance("tiers")
    head, dirty = runner.git_state()
    assert (prov.commit, prov.dirty) == (head, dirty)
    assert prov.label == (None if head is None else head + ("+dirty" if dirty else ""))
    runner.write_json(str(tmp_path / "a.json"), {"results": [1]}, prov)
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["results"] == [1]
    rec = data["provenance"]
    assert {k: rec[k] for k in ("suite", "commit", "dirty", "date")} == {
        "suite": "tiers", "commit": head, "dirty": dirty, "date": prov.date}  # fmt: skip
    assert rec["host"]["cpus"] == os.cpu_count() and len(rec["loadavg_after"]) == 3
    # A summary recomputed from that JSON keeps the measurement's provenance.
    runner.write_json(str(tmp_path / "b.json"), data, runner.provenance("tiers --from-json"))
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["provenance"] == rec and again["recomputed"]["suite"] == "tiers --from-json"


def test_the_dirty_flag_reads_uncommitted_changes_under_kvmesh(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "kvmesh").mkdir()
    (tmp_path / "kvmesh" / "x.py").write_text("a = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(runner, "REPO_ROOT", tmp_path)
    head, dirty = runner.git_state()
    assert head is not None and dirty is False and runner.git_commit() == head
    (tmp_path / "kvmesh" / "x.py").write_text("a = 2\n")
    assert runner.git_state() == (head, True) and runner.git_commit() == head + "+dirty"


def test_a_shipped_tree_names_its_commit_in_kvmesh_commit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A tree sent to a GPU machine arrives with a .git that need not match it (seen: the
    session's starting commit, so every file read as dirty): KVMESH_COMMIT, when set, is the
    commit, with the dirty flag unknown rather than claimed; outside a checkout and with no
    KVMESH_COMMIT there is no commit."""
    monkeypatch.setattr(runner, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("KVMESH_COMMIT", raising=False)
    assert runner.git_state() == (None, None)
    monkeypatch.setenv("KVMESH_COMMIT", "abc1234")
    assert runner.git_state() == ("abc1234", None) and runner.git_commit() == "abc1234"
    monkeypatch.setattr(runner, "REPO_ROOT", Path(__file__).resolve().parents[3])  # a real checkout
    assert runner.git_state() == ("abc1234", None)
