"""Plugins: compressors and algorithms of your own, in modules outside gradpress.

A module that registers a compressor (``@gradpress.compress.register``) or an
algorithm (``@gradpress.algorithms.register``) is known only to the process
that imported it. Name it in ``GRADPRESS_PLUGINS`` (comma-separated module
names, e.g. ``GRADPRESS_PLUGINS=mypkg.codecs,mypkg.algos``), or give every
``gradpress`` command ``--plugin MODULE`` (repeatable; it adds the module to
``GRADPRESS_PLUGINS`` of this process, so every process started from it
inherits it): the compressor and algorithm registries import the named
modules when asked for their names or for a name they do not know yet, in
every process, training workers (forked, spawned or under torchrun)
included, so before a spec naming a plugin is parsed; every ``gradpress``
command imports them at its start (an error there: exit 2). The module must
be importable there: on ``sys.path``, e.g. through ``PYTHONPATH`` or an
installed package.

:func:`record` lists the plugin modules with their files and the SHA-256 of
each file's bytes as this process imported them: every run's
``summary.json`` and ``gradpress compare``'s ``compare.json`` and
``compare-stats.json`` keep it (``plugins``), so a run says what it ran, and
a plugin edited between two runs (or during a compare, whose runs each
import it afresh) shows as another digest.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable

__all__ = ["ENV", "add", "add_option", "load", "requested", "record"]

#: the environment variable naming the plugin modules
ENV = "GRADPRESS_PLUGINS"

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: modules imported (or being imported) by :func:`load` in this process
_LOADED: set[str] = set()
_SOURCE = "--plugin/GRADPRESS_PLUGINS"
#: the value of ``$GRADPRESS_PLUGINS`` whose modules are all imported (a lookup then costs one comparison)
_DONE: list[str | None] = [None]
#: the SHA-256 of each module's file as :func:`load` imported it (None: no file)
_DIGESTS: dict[str, str | None] = {}


def requested(value: str | None = None) -> list[str]:
    """The module names of ``value`` (default: ``$GRADPRESS_PLUGINS``), in
    order, blanks and repeats dropped; ValueError naming one that is not a
    module name."""
    text = os.environ.get(ENV, "") if value is None else value
    names: list[str] = []
    for piece in text.split(","):
        name = piece.strip()
        if not name or name in names:
            continue
        if not _MODULE.fullmatch(name):
            raise ValueError(f"plugin {name!r} ({_SOURCE}) is not a module name; allowed: a Python module name "
                             "importable here, e.g. mypkg.mymod (a file /path/to/mymod.py: put /path/to on "
                             "PYTHONPATH and name mymod)")
        names.append(name)
    return names


def load(modules: Iterable[str] | None = None) -> None:
    """Import each plugin module not yet imported by this function (default:
    those of ``$GRADPRESS_PLUGINS``). ValueError naming the module when it
    cannot be found or fails while importing (the original exception is
    chained)."""
    text = os.environ.get(ENV, "") if modules is None else None
    if text is not None and text == _DONE[0]:
        return
    for name in requested(text) if modules is None else requested(",".join(modules)):
        if name in _LOADED:
            continue
        _LOADED.add(name)  # also while importing: a registration inside it looks the registry up again
        try:
            digest = _digest(_file(name))  # the bytes about to be imported (an edit after this is not what ran)
            importlib.import_module(name)
            _DIGESTS[name] = digest
        except ModuleNotFoundError as exc:
            _LOADED.discard(name)
            missing = exc.name or ""
            if name == missing or name.startswith(missing + "."):
                raise ValueError(f"plugin {name!r} ({_SOURCE}): cannot import it: {exc}; allowed: a module on "
                                 "sys.path (put the directory holding it on PYTHONPATH, or install its "
                                 "package)") from exc
            raise ValueError(f"plugin {name!r} ({_SOURCE}) failed while importing: "
                             f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            _LOADED.discard(name)
            raise ValueError(f"plugin {name!r} ({_SOURCE}) failed while importing: "
                             f"{type(exc).__name__}: {exc}") from exc
    if text is not None:
        _DONE[0] = text


def _file(name: str) -> str | None:
    """The file module ``name`` was imported from, else where importing it would find it (None: nowhere, or
    not a file, e.g. a namespace package)."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if module is not None else None
    if path is None and module is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None and spec.has_location else None
    return os.path.abspath(path) if path else None


def _digest(path: str | None) -> str | None:
    """The SHA-256 (hex) of the file at ``path``; None without one or where it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def record() -> list[dict[str, str | None]]:
    """The plugin modules of this process: those of ``$GRADPRESS_PLUGINS`` (a
    name that is not a module name skipped: :func:`load` refuses it) and any
    other :func:`load` imported, in order, each ``{"module": name, "file": path,
    "sha256": hex}`` (``file`` and ``sha256`` None where it has no file; ``sha256``
    of the bytes :func:`load` imported, else of the file now). The module's own
    file only: what it imports in turn is not hashed."""
    try:
        names = requested()
    except ValueError:
        names = []
    names += sorted(m for m in _LOADED if m not in names)
    return [{"module": name, "file": _file(name),
             "sha256": _DIGESTS[name] if name in _LOADED and name in _DIGESTS else _digest(_file(name))}
            for name in names]


def add(modules: Iterable[str]) -> None:
    """``--plugin``: append ``modules`` to ``$GRADPRESS_PLUGINS`` of this
    process (inherited by every process it starts), then import every
    module named there; ValueError as :func:`load`."""
    new = requested(",".join(modules))
    if new:
        os.environ[ENV] = ",".join(requested() + [m for m in new if m not in requested()])
    load()


def add_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` on ``parser`` and on each command below it that
    takes options (``gradpress bench compressors``), unless it has one."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs:
        for child in action.choices.values():
            add_option(child)
    if subs or any("--plugin" in a.option_strings for a in parser._actions):
        return
    parser.add_argument("--plugin", action="append", dest="plugins", default=None, metavar="MODULE",
                        help="import MODULE (your own compressors/algorithms, registered with @register) here and "
                             "in every worker, before specs are read; repeatable; added to $GRADPRESS_PLUGINS "
                             "(docs/authoring.md, \"Plugins\")")
