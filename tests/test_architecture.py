"""The layers of ARCHITECTURE.md, enforced: imports run one way (down), no package or module imports itself
back through others, an import inside a function is there only to defer a heavy dependency, and rooms stay
small (no module over `MAX_FILE_LINES` lines, no function over `MAX_FUNCTION_LINES`).

The contract is `LAYERS` below (bottom first). The checker reads the sources with `ast` (nothing is imported),
so it also sees imports inside functions; it is tested on made-up graphs that break each rule.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "reshard_cli"

# Bottom first. A module may import modules of its own layer or of layers below it, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("reshard_cli.errors", "reshard_cli.base")),
    ("layouts", ("reshard_cli.layouts",)),
    ("formats", ("reshard_cli.formats",)),
    ("plan", ("reshard_cli.plan",)),
    ("hw", ("reshard_cli.hw",)),
    ("io", ("reshard_cli.io",)),
    ("codecs", ("reshard_cli.codecs",)),
    ("transfer", ("reshard_cli.transfer",)),
    ("fleet", ("reshard_cli.engines.fleet",)),  # engine-neutral: what every engine's room builds on
    ("engines", ("reshard_cli.engines",)),
    ("bench", ("reshard_cli.bench",)),
    ("cli", ("reshard_cli.report", "reshard_cli.cli", "reshard_cli.__main__", "reshard_cli")),
]

# Third-party packages heavy enough to defer (import time, or optional extras): an import inside a function
# is allowed when it brings one of these in, directly or through the reshard module it imports.
HEAVY = ("torch", "vllm", "megatron", "mbridge", "transformers", "safetensors", "pynvml", "numpy", "matplotlib")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (for `from pkg import name`, pkg.name when that is a module)
    lazy: bool  # inside a function
    line: int
    typing_only: bool = False  # under `if TYPE_CHECKING:` (an annotation's name: never imported at run time)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_imports(root: Path = ROOT) -> tuple[set[str], list[Import]]:
    """Every module under `root` and every import in it (relative imports resolved)."""
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    found: list[Import] = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f)}
        typing_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and _is_type_checking(f.test)
                        for b in f.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` imports pkg.mod when that is a module of ours
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in dict.fromkeys(targets):
                found.append(Import(mod, t, id(node) in lazy_nodes, node.lineno, id(node) in typing_nodes))
    return modules, found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def layer_of(module: str, layers=LAYERS) -> int | None:
    best, best_len = None, -1
    for i, (_name, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward(imports: list[Import], layers=LAYERS) -> list[str]:
    out = []
    for im in imports:
        a, b = layer_of(im.module, layers), layer_of(im.target, layers)
        if b is not None and a is not None and b > a:
            out.append(f"{im.module}:{im.line} ({layers[a][0]}) imports {im.target} ({layers[b][0]}), a layer above")
    return out


def unplaced(modules: set[str], layers=LAYERS) -> list[str]:
    return sorted(m for m in modules if layer_of(m, layers) is None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def module_cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """Cycles between modules at run time (a name imported only for annotations, under `if TYPE_CHECKING:`,
    is never imported: it makes none; it still may not point a layer up)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for im in imports:
        if im.typing_only:
            continue
        if im.target in modules and im.target != im.module and not im.module.startswith(im.target + "."):
            edges[im.module].add(im.target)
    return cycles(edges)


def package_cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """Cycles between packages (reshard_cli.layouts -> reshard_cli.formats -> reshard_cli.layouts)."""
    def pkg(m: str) -> str:
        return ".".join(m.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for im in imports:
        if im.target in modules and not im.typing_only:
            a, b = pkg(im.module), pkg(im.target)
            if a != b and a != "reshard_cli" and b != "reshard_cli":
                edges.setdefault(a, set()).add(b)
    return cycles(edges)


def heavy_modules(modules: set[str], imports: list[Import]) -> set[str]:
    """Our modules that bring in a heavy third-party package at import time (directly or through ours)."""
    top: dict[str, set[str]] = {m: set() for m in modules}
    heavy = set()
    for im in imports:
        if im.lazy:
            continue
        if im.target.split(".")[0] in HEAVY:
            heavy.add(im.module)
        elif im.target in modules:
            top[im.module].add(im.target)
    changed = True
    while changed:
        changed = False
        for m, deps in top.items():
            if m not in heavy and deps & heavy:
                heavy.add(m)
                changed = True
    return heavy


def needless_lazy(modules: set[str], imports: list[Import]) -> list[str]:
    heavy = heavy_modules(modules, imports)
    return [f"{im.module}:{im.line} imports {im.target} inside a function, but it brings in no heavy dependency"
            for im in imports if im.lazy and im.target in modules and im.target not in heavy]


# ---------------------------------------------------------------------------------------------------- the tree


def test_every_module_has_a_layer():
    modules, _ = read_imports()
    assert unplaced(modules) == []


def test_imports_run_down_the_layers():
    _, imports = read_imports()
    assert upward(imports) == []


def test_no_import_cycles():
    modules, imports = read_imports()
    assert module_cycles(modules, imports) == []
    assert package_cycles(modules, imports) == []


def test_imports_inside_functions_only_defer_heavy_dependencies():
    modules, imports = read_imports()
    assert needless_lazy(modules, imports) == []


def test_planning_stays_torch_free():
    modules, imports = read_imports()
    heavy = heavy_modules(modules, imports)
    for m in ("reshard_cli.layouts.layout", "reshard_cli.plan.planner", "reshard_cli.plan.cost",
              "reshard_cli.plan.schedule", "reshard_cli.formats", "reshard_cli.cli"):
        assert m not in heavy, m


# ------------------------------------------------------------------------------- the checker on broken trees


MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 60


def oversized(root: Path = ROOT) -> list[str]:
    """Modules over MAX_FILE_LINES lines and functions (methods, nested ones) over MAX_FUNCTION_LINES, from
    `def` to their last line, decorators and docstring included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name, lines = module_name(path, root), text.count("\n")
        if lines > MAX_FILE_LINES:
            out.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    out.append(f"{name}.{node.name} (line {node.lineno}): {size} lines")
    return out


def test_rooms_stay_small():
    """A module that outgrows MAX_FILE_LINES is two rooms, a function over MAX_FUNCTION_LINES two steps: split
    them along their seams."""
    assert oversized() == []


FORMAT_WORDS = re.compile(r"fp8|float8|e4m3|mxfp|nvfp", re.IGNORECASE)


def format_names(root: Path = ROOT) -> list[str]:
    """Lines of the transfer core that name a wire format: what travels is the codec's (`reshard_cli.codecs`)."""
    out = []
    for path in sorted((root / "transfer").rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if FORMAT_WORDS.search(line):
                out.append(f"{path.relative_to(root.parent)}:{i}: {line.strip()}")
    return out


def backend_calls(root: Path = ROOT) -> list[str]:
    """torch.distributed in the transfer engine: every message goes through its comm (the transport)."""
    path = root / "transfer" / "engine.py"
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.startswith("torch.distributed") for n in names):
                out.append(f"{path.name}:{node.lineno}: imports torch.distributed")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dist":
            out.append(f"{path.name}:{node.lineno}: dist.{node.attr}")
    return out


def test_the_transfer_core_names_no_format_and_calls_no_backend():
    """A second wire format is a codec and a second transport a comm: neither touches the transfer core."""
    assert format_names() == []
    assert backend_calls() == []


def test_format_and_backend_checkers_find_them(tmp_path):
    root = _tree(tmp_path, {"transfer/__init__.py": "", "transfer/engine.py": "import torch.distributed as dist\n"
                            "def f(t):\n    return dist.isend(t, 1)\n", "transfer/x.py": "# an FP8 item\n"})
    assert format_names(root) == ["reshard_cli/transfer/x.py:1: # an FP8 item"]
    assert backend_calls(root) == ["engine.py:1: imports torch.distributed", "engine.py:3: dist.isend"]


def test_size_checker_finds_a_long_function_and_a_long_module(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    root = _tree(tmp_path, {"long.py": f"def f():\n{body}\n", "short.py": "def g():\n    return 1\n",
                            "big.py": "x = 1\n" * (MAX_FILE_LINES + 1)})
    assert oversized(root) == ["reshard_cli.big: 801 lines", "reshard_cli.long.f (line 1): 61 lines"]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "reshard_cli"
    for name, text in {"__init__.py": "", **files}.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


LOW_HIGH = [("low", ("reshard_cli.low",)), ("high", ("reshard_cli.high",))]


def test_checker_finds_an_upward_import(tmp_path):
    root = _tree(tmp_path, {"low/__init__.py": "", "low/a.py": "from reshard_cli.high import b\n",
                            "high/__init__.py": "", "high/b.py": "x = 1\n"})
    modules, imports = read_imports(root)
    assert upward(imports, LOW_HIGH) == ["reshard_cli.low.a:1 (low) imports reshard_cli.high.b (high), "
                                         "a layer above"]


def test_checker_finds_an_upward_import_inside_a_function(tmp_path):
    root = _tree(tmp_path, {"low/__init__.py": "", "low/a.py": "def f():\n    from ..high.b import x\n",
                            "high/__init__.py": "", "high/b.py": "x = 1\n"})
    _, imports = read_imports(root)
    assert len(upward(imports, LOW_HIGH)) == 1


def test_checker_finds_cycles(tmp_path):
    root = _tree(tmp_path, {"low/__init__.py": "", "low/a.py": "from reshard_cli.low import b\n",
                            "low/b.py": "def f():\n    from reshard_cli.low import c\n",
                            "low/c.py": "import reshard_cli.low.a\n",
                            "high/__init__.py": "from reshard_cli.low import a\n", "high/d.py": ""})
    modules, imports = read_imports(root)
    assert module_cycles(modules, imports) == [["reshard_cli.low.a", "reshard_cli.low.b", "reshard_cli.low.c"]]
    assert package_cycles(modules, imports) == []
    root2 = _tree(tmp_path / "two", {"low/__init__.py": "", "low/a.py": "from reshard_cli.high import d\n",
                                     "high/__init__.py": "", "high/d.py": "x = 1\n",
                                     "high/e.py": "from reshard_cli.low import a\n"})
    modules, imports = read_imports(root2)
    assert module_cycles(modules, imports) == []
    assert package_cycles(modules, imports) == [["reshard_cli.high", "reshard_cli.low"]]
    root3 = _tree(tmp_path / "three", {"low/__init__.py": "", "low/a.py": "from reshard_cli.low import b\n",
                                       "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                   "    from reshard_cli.low.a import A\n",
                                       "high/__init__.py": "", "high/d.py": "x = 1\n"})
    modules, imports = read_imports(root3)
    assert module_cycles(modules, imports) == []  # an annotation's import is no run-time cycle
    assert [im.typing_only for im in imports if im.module == "reshard_cli.low.b"] == [False, True]


def test_checker_finds_a_needless_lazy_import(tmp_path):
    root = _tree(tmp_path, {"low/__init__.py": "", "low/light.py": "x = 1\n", "low/heavy.py": "import torch\n",
                            "high/__init__.py": "",
                            "high/b.py": "def f():\n    from reshard_cli.low import light, heavy\n"})
    modules, imports = read_imports(root)
    assert needless_lazy(modules, imports) == ["reshard_cli.high.b:2 imports reshard_cli.low.light inside a "
                                               "function, but it brings in no heavy dependency"]


def test_checker_places_every_module(tmp_path):
    root = _tree(tmp_path, {"low/__init__.py": "", "stray.py": ""})
    modules, _ = read_imports(root)
    assert unplaced(modules, LOW_HIGH) == ["reshard_cli", "reshard_cli.stray"]


if __name__ == "__main__":  # print the current violations, one per line
    mods, ims = read_imports()
    for line in unplaced(mods) + upward(ims) + needless_lazy(mods, ims):
        print(line)
    for c in module_cycles(mods, ims) + package_cycles(mods, ims):
        print("cycle:", " <-> ".join(c))

