"""The benchmarks use other modules through their public names only: a private attribute
(``x._name``) is read on ``self`` or ``cls`` alone, and no ``_name`` is imported from another
module. A reach into another module's private state is how ``kvmesh bench disk --quick``
broke unnoticed when the disk tier renamed ``DiskTier._file``. Checked on the source (AST),
across ``kvmesh/bench/`` and the storage replay the disk suite runs."""

from __future__ import annotations

import ast
from pathlib import Path

KVMESH = Path(__file__).resolve().parents[3] / "kvmesh"
CHECKED = [*sorted((KVMESH / "bench").rglob("*.py")), KVMESH / "storage" / "replay.py", KVMESH / "demo.py"]
# Underscored names that are public API: the standard library's documented ones used here,
# and namedtuple's methods.
PUBLIC = {"os._exit", "argparse._SubParsersAction"}
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE


def reaches(source: str) -> list[str]:
    """Every private attribute read on something other than ``self``/``cls``, and every
    private name imported from a module, as ``line: code``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if ast.unparse(node) in PUBLIC:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if _private(a.name)]
            found += [f"{node.lineno}: from {node.module} import {name}" for name in names]
    return found


def test_the_check_finds_a_reach() -> None:
    code = (
        "from m import _x\ndef f(disk, self):\n    self._ok\n    return disk._file(), os._exit, t._asdict()\n"
    )
    assert sorted(reaches(code)) == ["1: from m import _x", "4: disk._file"]


def test_no_benchmark_reaches_into_another_modules_private_state() -> None:
    found = {str(p.relative_to(KVMESH.parent)): r for p in CHECKED if (r := reaches(p.read_text()))}
    assert found == {}
