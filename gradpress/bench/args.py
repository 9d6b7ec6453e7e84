"""Argument parsers shared by the ``gradpress bench`` subcommands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from gradpress.train.config import probe_writable, usable_cpus


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= 1, naming ``name`` in errors."""
    return int_at_least(name, 1)


def int_at_least(name: str, minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum``, naming ``name`` in errors."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} got {text!r}; allowed: an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} got {value}; allowed: an integer >= {minimum}")
        return value

    return parse


def check_threads(threads: int | None, flag: str = "--threads") -> int:
    """The usable cores (:func:`gradpress.train.config.usable_cpus`), after refusing (ValueError naming
    ``flag``) a thread count above them: more threads than cores only time the machine's contention."""
    cpus = usable_cpus()
    if threads is not None and threads > cpus:
        raise ValueError(f"{flag} got {threads}; allowed: an integer >= 1 and <= {cpus} (the cores this process may use)")
    return cpus


def check_file_path(path: str | os.PathLike, flag: str) -> None:
    """Refuse (ValueError naming ``flag``) a path the command could not write its file to: a directory, a
    parent that is missing or a file, a parent this process cannot write in. For checks before any work:
    nothing is created (a probe file is written and removed in the parent)."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise ValueError(f"{flag} got {str(out)!r}, which is a directory; allowed: a file path")
    if not parent.exists():
        raise ValueError(f"{flag}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{flag} got {str(out)!r}: {str(parent)!r} is a file, not a directory")
    probe_writable(str(parent), flag, repr(str(out)))
