"""The package's layout keeps its promises: every module imports on its own, no import cycle,
no import runs upward through the floors, no normscope import hidden in a function (but the
optional-dependency ones), no private name imported across modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "normscope"

#: the floors, lowest first: a module imports from its own floor or lower ones only
FLOORS = [
    ("normscope._common", "normscope.runs"),
    ("normscope.functional",),
    ("normscope.taps",),
    ("normscope.alerts",),
    ("normscope.families",),
    ("normscope.engine",),
    ("normscope.adapters",),
    ("normscope.cli", "normscope.__main__"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _floor(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return -1  # the package root: lazy names only


def _imports(path: Path, module: str) -> list[tuple[str, list[str], bool]]:
    """``(imported module, names, inside a function)`` for every normscope import."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module.startswith("normscope"):
                    found.append((child.module, [a.name for a in child.names], in_function))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("normscope"):
                        found.append((alias.name, [], in_function))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue  # annotations only
            visit(child, inner)

    visit(tree, False)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _target(imported: str, name: str, modules: dict[str, Path]) -> str:
    """The module an import names: ``from a.b import c`` is module ``a.b.c`` when that exists."""
    sub = f"{imported}.{name}"
    return sub if sub in modules else imported


def test_every_module_imports_on_its_own():
    """Each module imported first, with no normscope module loaded before it (one fresh
    interpreter; torch and the other dependencies stay loaded between modules): an import
    cycle fails here whichever module comes first."""
    modules = [m for m in _modules() if m != "normscope.__main__"]
    code = (
        "import importlib, sys, traceback\n"
        "for m in sys.argv[1:]:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] == 'normscope']:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as err:\n"
        "        print(f'{m}: {type(err).__name__}: {err}')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", run.stdout


def test_no_cycle_no_upward_import_no_hidden_import_no_private_name():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    upward, hidden, private = [], [], []
    for module, path in modules.items():
        for imported, names, in_function in _imports(path, module):
            targets = {_target(imported, n, modules) for n in names} or {imported}
            for target in targets:
                if target == module or target not in modules:
                    continue
                graph[module].add(target)
                if _floor(module) >= 0 and _floor(target) > _floor(module):
                    upward.append(f"{module} -> {target}")
            if in_function:
                hidden.append(f"{module} imports {imported} inside a function")
            for name in names:
                same_package = imported.rsplit(".", 1)[0] == module.rsplit(".", 1)[0]
                if name.startswith("_") and not same_package and not name.startswith("__"):
                    private.append(f"{module} imports {imported}.{name}")
    cycles = _cycles(graph)
    assert not upward, upward
    assert not cycles, cycles
    assert not hidden, hidden
    assert not private, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


@pytest.mark.parametrize("floor", [p for prefixes in FLOORS for p in prefixes])
def test_each_floor_exists(floor):
    assert floor in _modules(), f"{floor} is named in FLOORS but is not a module"


def test_the_engine_and_the_floors_below_it_import_no_trainer():
    """A plain loop uses the engine without Lightning or W&B being imported, and no normscope
    module imports transformers: where it is installed, torchmetrics (the accumulators' base
    class) imports it from its text metrics, and that is the only importer allowed."""
    code = (
        "import sys, traceback\n"
        "importers = []\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers':\n"
        "            frames = [f.filename for f in traceback.extract_stack()]\n"
        "            importers.append(next(f for f in reversed(frames) if 'importlib' not in f\n"
        "                                  and not f.startswith('<')))\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "import normscope.engine, normscope.families, normscope.taps, normscope.alerts\n"
        "print(sorted(m for m in ('lightning', 'wandb') if m in sys.modules))\n"
        "print([f for f in importers if 'torchmetrics' not in f])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    trainers, importers = run.stdout.strip().splitlines()
    assert trainers == "[]", run.stdout
    assert importers == "[]", run.stdout  # transformers only ever imported by torchmetrics
