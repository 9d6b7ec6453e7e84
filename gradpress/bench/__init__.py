"""Benchmarks: ``gradpress bench SUBCOMMAND``.

Every module in this package that defines ``register_bench(subparsers)`` adds
one ``gradpress bench`` subcommand (``compressors.py`` adds
``gradpress bench compressors``); ``gradpress/commands/bench.py`` discovers
them, so a new benchmark is one new file. Other modules here are helpers
(input data, timing and memory measurement, plotting) and define no
``register_bench``.

Invariant: discovery imports only this package's modules; modules keep heavy
imports (matplotlib, scikit-learn) inside functions so that building the CLI
parser stays cheap.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["bench_modules"]


def bench_modules() -> list[tuple[str, ModuleType | None, str]]:
    """``(module name, module or None, import error text)`` for every module
    of this package, sorted by name; only modules exposing ``register_bench``
    (or failing to import) are listed."""
    import gradpress.bench as pkg

    found: list[tuple[str, ModuleType | None, str]] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        except ImportError as exc:
            found.append((info.name, None, f"{type(exc).__name__}: {exc}"))
            continue
        if callable(getattr(module, "register_bench", None)):
            found.append((info.name, module, ""))
    return found
