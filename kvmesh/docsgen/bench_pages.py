"""The generated parts of the benchmark pages, from ``docs/bench/*.json`` and
``docs/bench/pages.yaml``: where each figure was measured (commit, date, stale or not), every
target with its figure and met / missed, and the results tables. A rerun that rewrites a JSON
changes these blocks the next time ``python -m kvmesh.docsgen`` runs.

A figure is *current* when its JSON records the benchmark round's commit (``round.commit`` in
``pages.yaml``) and no uncommitted change; otherwise it is marked **stale**, unless
``stands`` says why the older figure still holds. A JSON listed in ``docs/bench/STALE`` (no
provenance written by the code) is always stale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvmesh.docsgen.bench_spec import (
    Figure,
    Missing,
    Pages,
    Suite,
    Target,
    goal_met,
    goal_text,
    matches,
    resolve,
)
from kvmesh.docsgen.markdown import code, table


@dataclass(frozen=True)
class Provenance:
    commit: str | None
    dirty: bool | None
    date: str | None


STALE_FILE = "STALE"


def stale_list(bench_dir: Path) -> dict[str, str]:
    """``docs/bench/STALE``: JSON name -> why it has no provenance the code wrote (``#``
    starts a comment line; a missing file lists none)."""
    try:
        lines = (bench_dir / STALE_FILE).read_text().splitlines()
    except FileNotFoundError:
        return {}
    out = {}
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, why = line.strip().partition(" ")
            out[name] = why.strip()
    return out


def provenance(data: Any) -> Provenance:
    """The commit and date a JSON records, in any of the shapes the suites have written:
    the shared runner's ``provenance``, an older top-level ``commit``, or ``env`` /
    ``environment`` with ``git_commit`` and ``timestamp``."""
    if not isinstance(data, dict):
        return Provenance(None, None, None)
    prov = data.get("provenance")
    if isinstance(prov, dict):
        return Provenance(prov.get("commit"), prov.get("dirty"), prov.get("date"))
    for key in ("env", "environment"):
        env = data.get(key)
        if isinstance(env, dict) and env.get("git_commit"):
            label = str(env["git_commit"])
            return Provenance(label.removesuffix("+dirty"), label.endswith("+dirty"), env.get("timestamp"))
    top = data.get("commit")
    if isinstance(top, str):
        return Provenance(top.removesuffix("+dirty"), top.endswith("+dirty"), data.get("date"))
    return Provenance(None, None, None)


class BenchData:
    """The JSONs of ``docs/bench``, read once each."""

    def __init__(self, bench_dir: Path, pages: Pages) -> None:
        self.dir = bench_dir
        self.pages = pages

    @cache  # noqa: B019 -- one BenchData per generator run
    def json(self, name: str) -> Any:
        path = self.dir / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def link(self, name: str) -> str:
        """A link to a file beside the pages, or its bare name while it does not exist."""
        return f"[{name}]({name})" if (self.dir / name).exists() else f"{name} (none yet)"

    def prov(self, name: str) -> Provenance:
        return provenance(self.json(name))

    @property
    def stale(self) -> dict[str, str]:
        return stale_list(self.dir)

    def status(self, fig: Figure) -> str:
        if self.json(fig.json_file) is None:
            return "**missing**: no such JSON"
        if fig.json_file in self.stale:
            return f"**stale** (listed in `docs/bench/STALE`: {self.stale[fig.json_file]})"
        prov = self.prov(fig.json_file)
        round_commit = self.pages.round.commit
        current = (
            prov.commit is not None
            and round_commit is not None
            and not prov.dirty
            and (prov.commit.startswith(round_commit) or round_commit.startswith(prov.commit))
        )
        if current:
            return "current"
        if prov.commit is None:
            why = "its JSON records no commit"
        elif prov.dirty:
            why = "measured on uncommitted code"
        elif round_commit is None:
            why = "no benchmark round stated yet"
        else:
            why = f"not the round's `{round_commit}`"
        if fig.stands and prov.commit is not None:
            return f"another commit, stands: {fig.stands}"
        return f"**stale** ({why})"

    def figure(self, name: str) -> Figure | None:
        for suite in self.pages.suites.values():
            for fig in suite.figures:
                if fig.json_file == name:
                    return fig
        return None


def fmt(value: Any, digits: int | None = None, scale: float = 1.0) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    if isinstance(value, int | float):
        v = float(value) * scale
        if digits is None:
            a = abs(v)
            digits = 0 if a >= 1000 else 1 if a >= 100 else 2 if a >= 1 else 3
        return f"{v:,.{digits}f}"
    if value is None:
        return "—"
    return str(value)


def target_row(data: BenchData, t: Target) -> tuple[str, str, str]:
    """``(measured, result, commit)`` of one target."""
    prov = data.prov(t.json_file)
    commit = code(prov.commit) if prov.commit else "not recorded"
    if data.json(t.json_file) is None:
        return f"no `{t.json_file}` yet", "**to fill**", "—"
    try:
        value = resolve(data.json(t.json_file), t.value)
    except Missing as exc:
        return f"not in `{t.json_file}` ({exc})", "**to fill**", commit
    if value is None:
        return "not measured", "**to fill**", commit
    try:
        met = goal_met(t.goal, value)
    except TypeError:
        return fmt(value), f"**unreadable** (a {type(value).__name__})", commit
    return fmt(value, t.digits), "met" if met else "**missed**", commit


def _measured_on(data: BenchData, suite: Suite) -> str:
    rows = []
    for fig in suite.figures:
        prov = data.prov(fig.json_file)
        plots = ", ".join(data.link(p) for p in fig.plots) or "—"
        commit = code(prov.commit + ("+dirty" if prov.dirty else "")) if prov.commit else "not recorded"
        rows.append(
            [data.link(fig.json_file), fig.what, plots, commit, prov.date or "not recorded", data.status(fig)]
        )
    return table(["JSON", "run", "plots", "commit", "date", "status"], rows)


def _targets(data: BenchData, suite: Suite) -> str:
    rows = []
    for t in suite.targets:
        measured, result, commit = target_row(data, t)
        rows.append(
            [t.what + (f" ({t.note})" if t.note else ""), measured, goal_text(t.goal), result, commit]
        )
    return table(["target", "measured", "goal", "result", "commit"], rows)


def _table(data: BenchData, spec: Any) -> str:
    try:
        rows = resolve(data.json(spec.json_file), spec.rows)
    except Missing as exc:
        return f"*Not in `{spec.json_file}`: {exc}.*\n"
    if spec.one_row:
        rows = [rows]
    elif isinstance(rows, dict):
        rows = [{"key": k, **v} for k, v in rows.items() if isinstance(v, dict)]
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and not matches(row, spec.where):
            continue
        cells = []
        for col in spec.columns:
            try:
                cells.append(fmt(resolve(row, col.value), col.digits, col.scale))
            except Missing:
                cells.append("—")
        out.append(cells)
    return table([c.head for c in spec.columns], out)


def suite_block(data: BenchData, name: str) -> str:
    suite = data.pages.suites[name]
    parts = []
    if suite.command:
        parts.append(f"```\n{suite.command}\n```\n")
    parts.append("**Where these figures come from.** " + _round_sentence(data) + "\n")
    parts.append(_measured_on(data, suite))
    if suite.targets:
        parts.append("**Targets.** Met / missed is computed from the JSON against the goal.\n")
        parts.append(_targets(data, suite))
    for spec in suite.tables:
        prov = data.prov(spec.json_file)
        on = f" (`{spec.json_file}`, commit {code(prov.commit) if prov.commit else 'not recorded'})"
        parts.append(f"**{spec.title}**{on}\n")
        parts.append(_table(data, spec))
    for fig in suite.figures:
        prov = data.prov(fig.json_file)
        for plot in fig.plots:
            if not (data.dir / plot).exists():
                continue
            commit = code(prov.commit) if prov.commit else "commit not recorded"
            parts.append(
                f"![{plot}]({plot})\n\n*{plot}: {commit}, {prov.date or 'date not recorded'}; "
                f"{data.status(fig)}.*\n"
            )
    return "\n".join(parts)


def _round_sentence(data: BenchData) -> str:
    r = data.pages.round
    if r.commit is None:
        head = "No benchmark round has been stated yet: every figure below is from an earlier commit."
    else:
        head = f"The benchmark round is commit {code(r.commit)}; a figure from any other commit is marked."
    return head + (" " + r.note if r.note else "")


def overview_block(data: BenchData) -> str:
    """Every target of every suite in one table, with totals."""
    rows, met, missed, fill = [], 0, 0, 0
    for suite in data.pages.suites.values():
        for t in suite.targets:
            measured, result, commit = target_row(data, t)
            met += result == "met"
            missed += result == "**missed**"
            fill += result not in ("met", "**missed**")
            rows.append(
                [f"[{suite.title}]({suite.page})", t.what, measured, goal_text(t.goal), result, commit]
            )
        if not suite.targets:
            rows.append([f"[{suite.title}]({suite.page})", "no target", "—", "—", "—", "—"])
    head = (
        f"{_round_sentence(data)} **{met} met, {missed} missed, {fill} not measured** "
        f"(of {met + missed + fill} targets).\n"
    )
    return head + "\n" + table(["suite", "target", "measured", "goal", "result", "commit"], rows)


def headline_block(data: BenchData, link_prefix: str) -> str:
    """The README's table: the targets marked ``headline``, each linking to its page."""
    rows = []
    for suite in data.pages.suites.values():
        for t in suite.targets:
            if t.headline:
                measured, result, commit = target_row(data, t)
                page = link_prefix + suite.page
                rows.append([f"[{t.headline}]({page})", measured, goal_text(t.goal), result, commit])
    return table(["figure", "measured", "goal", "result", "commit"], rows)
