"""Algorithms: optimizer-level methods that communicate less, over the same
exchange engine as the DDP hook (its sibling; neither imports the other).

``gradpress.algorithms.create("localsgd:period=8", model, optimizer,
compressor="topk:ratio=0.01")``; ``names()``, ``describe()`` list them
(``gradpress algorithms`` on the command line). A new algorithm is one file
here with a class decorated by :func:`register`.
"""

from gradpress.algorithms.base import Algorithm, Preflight
from gradpress.algorithms.registry import create, describe, get_class, names, parse, preflight, register

__all__ = ["Algorithm", "Preflight", "create", "describe", "get_class", "names", "parse", "preflight", "register"]
