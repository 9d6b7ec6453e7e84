"""Argument parsers shared by the ``gradpress bench`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= 1, naming ``name`` in errors."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} got {text!r}; allowed: an integer >= 1") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} got {value}; allowed: an integer >= 1")
        return value

    return parse
