"""The package's layers: ``runtime/`` imports nothing from ``plan/``, and no two modules import each other
(directly or around a loop), counting imports inside functions and under ``TYPE_CHECKING``: an import
moved into a function to dodge a cycle is still a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import numatp

pytestmark = pytest.mark.unit   # reads the sources; the fresh-interpreter checks are also slow

SRC = Path(numatp.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """The numatp modules ``path`` imports anywhere in it (a name imported from a package: the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("numatp"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("numatp")}
    return found


def test_runtime_imports_nothing_from_plan():
    mods = _modules()
    runtime = {m: f for m, f in mods.items() if m.startswith("numatp.runtime")}
    assert len(runtime) >= 7
    for m, f in runtime.items():
        plan = sorted(i for i in _imports(f, mods) if i.startswith("numatp.plan"))
        assert not plan, f"{m} imports {plan}: the runtime runs step lists; graph work belongs to numatp.plan"
    # and at run time: every runtime module imported (the top package's own imports left out, since
    # numatp/__init__ imports the backend) loads no numatp.plan module
    code = (f"import sys, types; pkg = types.ModuleType('numatp'); pkg.__path__ = [{str(SRC)!r}]; "
            f"sys.modules['numatp'] = pkg; import " + ", ".join(sorted(runtime)) + "; "
            "print(sorted(m for m in sys.modules if m.startswith('numatp.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "numatp.runtime.executor" in loaded.stdout and "numatp.plan" not in loaded.stdout, loaded.stdout


def test_no_import_cycles():
    mods = _modules()
    edges = {m: {i for i in _imports(f, mods) if i in mods and i != m} for m, f in mods.items()}
    # Tarjan's strongly connected components: any of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(mods):
        if m not in index:
            visit(m)
    assert not cycles, f"modules that import each other (directly or around a loop): {cycles}"


# one end of each cycle there was (backend <-> generate, backend core <-> variants, runtime gemm <->
# native, bench report <-> plots), imported first in an interpreter of its own
@pytest.mark.slow   # a fresh interpreter per module: ~15 s each
@pytest.mark.parametrize("module", ["numatp.generate", "numatp.backend.variants", "numatp.runtime.native",
                                    "numatp.bench.report"])
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
