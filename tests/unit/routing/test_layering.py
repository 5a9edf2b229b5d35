"""The routing core's layering, from the source (AST over every import, lazy ones included):

* ``router`` (the proxy), ``epp`` (ext_proc) and ``sim`` (the simulator) each drive
  ``kvmesh.routing`` and import nothing of the other two;
* ``routing`` imports no front end, nor the connector, the benchmarks or the harness;
* nothing ``routing``, ``router`` or ``epp`` imports, directly or through other kvmesh
  modules, imports torch or vllm (they must start fast and stay small). Their own lazy
  imports (in function bodies) count; in the modules they reach, only what runs on import
  does (a package's lazy ``__getattr__`` or a function they never call imports nothing).

Imports under ``if TYPE_CHECKING:`` are not run and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "kvmesh"

FORBIDDEN = {
    "router": ("kvmesh.epp", "kvmesh.sim"),
    "epp": ("kvmesh.router", "kvmesh.sim"),
    "sim": ("kvmesh.router", "kvmesh.epp"),
    "routing": (
        "kvmesh.router", "kvmesh.epp", "kvmesh.sim", "kvmesh.integrations", "kvmesh.bench", "kvmesh.harness",
    ),
}  # fmt: skip
LIGHT = ("routing", "router", "epp")  # never torch or vllm, however indirectly
HEAVY = ("torch", "vllm")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, lazy: bool = True) -> set[str]:
    """Every module ``path`` imports, as dotted names (``lazy``: function bodies included);
    ``from pkg import name`` counts as ``pkg.name`` too (it may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _light(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in LIGHT


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_of_the_layers_it_must_not_know(package: str) -> None:
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name in sorted(imports_of(path)):
            if name.startswith(FORBIDDEN[package]) and any(
                name == f or name.startswith(f + ".") for f in FORBIDDEN[package]
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_routing_router_and_epp_never_reach_torch_or_vllm() -> None:
    sources = _sources()
    graph = {name: imports_of(path, lazy=_light(name)) for name, path in sources.items()}
    bad = []
    for start in sorted(n for n in sources if _light(n)):
        seen: dict[str, str | None] = {start: None}
        todo = [start]
        while todo:
            mod = todo.pop()
            for dep in graph.get(mod, ()):
                if dep.split(".")[0] in HEAVY:
                    chain = [dep, mod]
                    while seen[chain[-1]] is not None:
                        chain.append(seen[chain[-1]])  # type: ignore[arg-type]
                    bad.append(" <- ".join(chain))
                    continue
                for m in _parents(dep):
                    if m in sources and m not in seen:
                        seen[m] = mod
                        todo.append(m)
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_checker_sees_imports() -> None:
    """The checks above can fail: lazy, relative and ``from`` imports are all seen."""
    got = imports_of(PKG / "epp" / "protocol.py")
    assert "kvmesh.routing.dispatcher" in got and "kvmesh.epp.scoring" in got
    assert "kvmesh.index.BlockIndex" in imports_of(PKG / "routing" / "core.py")
