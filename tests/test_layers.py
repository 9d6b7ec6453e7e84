"""The package's layering rules (docs/architecture.md), enforced by parsing
the imports of every module.

Layers, each importing only the ones above it: compress -> transport ->
exchange -> {ddp, algorithms} (siblings: never each other) -> training and
tools. Also: no import cycles among module-level imports, and no module
above ~400 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "gradpress"

#: layer -> the gradpress packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "compress": set(),
    "transport": {"compress"},
    "exchange": {"compress", "transport"},
    "ddp": {"compress", "transport", "exchange"},
    "algorithms": {"compress", "transport", "exchange"},
}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    """Absolute gradpress module names imported by ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gradpress"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("gradpress"):
                found.add(name)
                found.update(f"{name}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_layer_imports_only_the_layers_above_it() -> None:
    modules = _modules()
    bad = []
    for name, path in modules.items():
        layer = _layer(name)
        if layer is None:
            continue
        for imported in _imports(path, name):
            other = _layer(imported)
            target = imported.split(".")[1] if imported.count(".") >= 1 else ""
            if other == layer:
                continue
            if other is None and imported != "gradpress" and target not in ALLOWED:
                bad.append(f"{name} imports {imported} (the training/tools layer, below {layer})")
            elif other is not None and other not in ALLOWED[layer]:
                bad.append(f"{name} imports {imported} ({other} is not above {layer})")
            elif imported == "gradpress":
                bad.append(f"{name} imports the gradpress facade")
    assert not bad, "\n".join(bad)


def test_ddp_and_algorithms_never_import_each_other() -> None:
    for name, path in _modules().items():
        layer = _layer(name)
        sibling = {"ddp": "algorithms", "algorithms": "ddp"}.get(layer or "")
        if sibling:
            assert not any(_layer(i) == sibling for i in _imports(path, name)), f"{name} imports gradpress.{sibling}"


def test_no_import_cycles() -> None:
    modules = _modules()
    # a module importing its own package's __init__ at top level is the normal package pattern, not a cycle: such
    # edges are left out, so whichever path the search takes, a cycle found is a real one
    graph = {name: {i for i in _imports(path, name, top_level_only=True)
                    if i in modules and i != name and not name.startswith(i + ".")}
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):  # sorted: the same verdict whatever the hash seed
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                if not all(n == nxt or n.startswith(nxt + ".") or nxt.startswith(n + ".") for n in cycle):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_above_the_size_limit(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {lines} lines (limit {MAX_LINES}): split it by job"


def test_the_checker_sees_a_planted_violation(tmp_path: Path) -> None:
    """The rule test must fail when a layer imports below itself."""
    planted = tmp_path / "gradpress" / "exchange" / "bad.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from gradpress.ddp import register\nfrom ..algorithms import base\n")
    found = _imports(planted, "gradpress.exchange.bad")
    assert "gradpress.ddp" in found and "gradpress.algorithms.base" in found
    assert all(_layer(i) not in ALLOWED["exchange"] | {"exchange"} for i in found)


def _method_modules(modules: dict[str, Path]) -> set[str]:
    """Compressor files: modules of gradpress.compress with a line that is
    ``@register`` (the kit, a library, only mentions it in prose)."""
    return {name for name, path in modules.items()
            if name.startswith("gradpress.compress.") and re.search(r"^@register\b", path.read_text(), re.M)}


def test_method_files_import_no_other_method_file() -> None:
    """Shared kernels (sparse scatter, sign packing, kept counts, sampling,
    the authoring kit) live in their own modules: a compressor file never
    imports another compressor's file."""
    modules = _modules()
    methods = _method_modules(modules)
    bad = [f"{name} imports {imported}" for name in methods for imported in _imports(modules[name], name)
           if imported in methods and imported != name]
    assert not bad, "\n".join(bad)


def test_the_kit_is_a_library_that_imports_no_compressor() -> None:
    """gradpress/compress/kit/ is a library of the compress layer, like
    bits.py or sparse.py: compressor files import it, it imports no
    compressor file and registers nothing. The frozen hand-written
    references (gradpress/compress/handwritten/) register nothing either,
    and no compressor file imports them (only tests and the benchmark)."""
    modules = _modules()
    methods = _method_modules(modules)
    assert {"gradpress.compress.qsgd", "gradpress.compress.topk"} <= methods
    for name, path in modules.items():
        if name.startswith(("gradpress.compress.kit", "gradpress.compress.handwritten")):
            assert name not in methods, f"{name} registers a compressor"
            assert not _imports(path, name) & methods, f"{name} imports a compressor file"
    users = [f"{name} imports the hand-written references" for name in methods
             if any(i.startswith("gradpress.compress.handwritten") for i in _imports(modules[name], name))]
    assert not users, "\n".join(users)
