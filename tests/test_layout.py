"""The package's shape: which modules may import which (docs/architecture.md), read from the source alone.

Nothing outside ``lightning_gh/demo`` imports the demo (the command line entry point ``__main__`` aside), no two
modules import each other in a cycle, and the machine is probed in ``hardware.py`` only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lightning_gh"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every ``lightning_gh`` module each module imports, at any depth of the file (lazy imports count too)."""
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        # Imports under `if TYPE_CHECKING:` never run, so they cannot form a cycle or load the demo.
        skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != "lightning_gh":
                    continue
                while t and t not in mods:  # `import lightning_gh.x.y` names a module or one of its parents
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        out[name] = found
    return out




def test_nothing_outside_demo_imports_the_demo():
    mods = _modules()
    graph = _imports(mods)
    offenders = sorted(
        f"{src} imports {dst}"
        for src, dsts in graph.items() for dst in dsts
        if dst.startswith("lightning_gh.demo") and not src.startswith("lightning_gh.demo")
        and src != "lightning_gh.__main__"
    )
    assert not offenders, "library code must not import the demo:\n" + "\n".join(offenders)


def test_no_import_cycles():
    """A cycle through a package's ``__init__`` re-exports counts only when the modules themselves form it."""
    mods = _modules()
    graph = _imports(mods)
    pkgs = {m for m, p in mods.items() if p.name == "__init__.py"}
    # A package __init__ that only re-exports is an edge to its contents, not a participant.
    edges = {m: {d for d in ds if d not in pkgs} for m, ds in graph.items() if m not in pkgs}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(edges.get(n, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


_PROBES = re.compile(r"open\(['\"]/proc/|os\.cpu_count\(|sched_getaffinity\(|mem_get_info\(|get_device_properties\(")


def test_only_hardware_probes_the_machine():
    allowed = {"lightning_gh.hardware"}
    offenders = []
    for name, path in _modules().items():
        if name in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PROBES.search(code) and not code.lstrip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    assert not offenders, "machine probes outside hardware.py:\n" + "\n".join(offenders)


@pytest.mark.parametrize("walker", ["demo", "cycle"])
def test_the_walker_sees_what_it_must(tmp_path, monkeypatch, walker):
    """The walker itself: a planted demo import and a planted cycle are found (so the tests above can fail)."""
    pkg = tmp_path / "lightning_gh"
    (pkg / "demo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "demo" / "__init__.py").write_text("")
    (pkg / "demo" / "model.py").write_text("X = 1\n")
    if walker == "demo":
        (pkg / "part.py").write_text("def f():\n    from lightning_gh.demo.model import X\n    return X\n")
    else:
        (pkg / "a.py").write_text("from lightning_gh import b\n")
        (pkg / "b.py").write_text("from lightning_gh.a import *\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    with pytest.raises(AssertionError, match="library code must not" if walker == "demo" else "import cycles"):
        (test_nothing_outside_demo_imports_the_demo if walker == "demo" else test_no_import_cycles)()
