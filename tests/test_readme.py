"""The README stays true: its compressor table is the registry's, every stats
key is documented, and every command it shows exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradpress.cli import build_parser
from gradpress.commands.compressors import markdown_table
from gradpress.compress import describe
from gradpress.ddp import STATS_KEYS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_compressor_table_is_generated_from_registry() -> None:
    table = markdown_table(describe())
    assert table in README, "README compressor table is stale: paste `gradpress compressors --markdown`"


@pytest.mark.parametrize("key", sorted(STATS_KEYS))
def test_every_stats_key_is_documented(key: str) -> None:
    assert f"`{key}`" in README


def test_commands_shown_in_readme_exist() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    shown = set(re.findall(r"^\s*(?:\$ )?gradpress ([a-z][a-z0-9-]*)", README, flags=re.M))
    assert shown, "README shows no gradpress command"
    missing = shown - set(sub.choices)
    assert not missing, f"README shows commands that do not exist: {sorted(missing)}"
