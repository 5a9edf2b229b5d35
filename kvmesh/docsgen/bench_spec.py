"""What the benchmark pages show, as data: ``docs/bench/pages.yaml`` read into typed models.

Per suite: the JSON files (and their plots) it wrote, each target (where its figure sits in
the JSON and the goal it is held to), and the tables drawn from the JSON. The page builder
(:mod:`kvmesh.docsgen.bench_pages`) reads values through *paths*: a list whose items are a
key (a string), an index (an int) or a filter (a mapping: the first list element whose
fields equal it), e.g. ``[results, {tier: cpu, op: store}, ratio]``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvmesh.errors import ConfigError

PathItem = str | int | dict[str, Any]
_GOAL = re.compile(r"^\s*(<=|>=|<|>|==)\s*(\S+)\s*$")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}
_SIGNS = {"<=": "≤", ">=": "≥", "<": "<", ">": ">", "==": "="}


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Figure(_Spec):
    json_file: str = Field(alias="json", description="a JSON under docs/bench/")
    plots: tuple[str, ...] = Field(default=(), description="its PNGs under docs/bench/")
    what: str = Field(default="", description="what this run is, in a few words")
    stands: str | None = Field(
        default=None, description="why this figure, measured on another commit than the round's, still stands"
    )


class Target(_Spec):
    what: str
    json_file: str = Field(alias="json")
    value: tuple[PathItem, ...]
    goal: str = Field(description="'<= 0.9', '>= 0.8', '== true', '== 0'")
    digits: int | None = None
    headline: str | None = Field(default=None, description="a label: this target is in the README's table")
    note: str = ""

    @field_validator("goal")
    @classmethod
    def _goal_ok(cls, v: str) -> str:
        parse_goal(v)
        return v


class Column(_Spec):
    head: str
    value: tuple[PathItem, ...] = Field(description="path within the row; [] is the row itself")
    digits: int | None = None
    scale: float = 1.0


class Table(_Spec):
    title: str
    json_file: str = Field(alias="json")
    rows: tuple[PathItem, ...] = Field(description="path of the list whose elements are the rows")
    where: dict[str, Any] = Field(default_factory=dict, description="keep rows whose fields equal these")
    one_row: bool = Field(default=False, description="`rows` is one object: one row of it")
    columns: tuple[Column, ...]


class Suite(_Spec):
    title: str
    page: str
    command: str = ""
    figures: tuple[Figure, ...] = ()
    targets: tuple[Target, ...] = ()
    tables: tuple[Table, ...] = ()


class Round(_Spec):
    commit: str | None = Field(default=None, description="the commit every figure should be measured on")
    note: str = ""


class Pages(_Spec):
    round: Round = Field(default_factory=Round)
    suites: dict[str, Suite]


def parse_goal(goal: str) -> tuple[str, Any]:
    m = _GOAL.match(goal)
    if not m:
        raise ValueError(f"goal {goal!r} must look like '<= 0.9', '>= 0.8' or '== true'")
    return m.group(1), yaml.safe_load(m.group(2))


def goal_text(goal: str) -> str:
    op, value = parse_goal(goal)
    return f"{_SIGNS[op]} {str(value).lower() if isinstance(value, bool) else value}"


def goal_met(goal: str, value: Any) -> bool:
    op, want = parse_goal(goal)
    return bool(_OPS[op](value, want))


def load(path: Path) -> Pages:
    try:
        data = yaml.safe_load(path.read_text())
        return Pages.model_validate(data)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None


class Missing(LookupError):
    """A path that leads nowhere in a JSON (its shape changed, or the run did not record it)."""


def resolve(data: Any, path: Sequence[PathItem]) -> Any:
    cur = data
    for step in path:
        if isinstance(step, Mapping):
            if not isinstance(cur, list):
                raise Missing(f"filter {dict(step)} applied to a {type(cur).__name__}")
            match = next((row for row in cur if isinstance(row, Mapping) and matches(row, step)), None)
            if match is None:
                raise Missing(f"no element with {dict(step)}")
            cur = match
        elif isinstance(step, int) and isinstance(cur, list):
            if not -len(cur) <= step < len(cur):
                raise Missing(f"index {step} out of range")
            cur = cur[step]
        elif isinstance(cur, Mapping) and str(step) in cur:
            cur = cur[str(step)]
        else:
            raise Missing(f"no key {step!r}")
    return cur


def matches(row: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in want.items())
