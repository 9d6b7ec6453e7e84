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


def test_register_signature_shown_is_the_code_s() -> None:
    """The README's `gradpress.ddp.register(...)` line lists every parameter,
    in order, with its default (it had left out process_group and coalesce)."""
    import inspect

    import gradpress.ddp

    shown = re.search(r"^`gradpress\.ddp\.register\((.*)\)`$", README, flags=re.M)
    assert shown, "README shows no register signature line"
    want = []
    for p in inspect.signature(gradpress.ddp.register).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            want.append("**compressor_params")
        elif p.kind is p.KEYWORD_ONLY and "*" not in want:
            want += ["*", f"{p.name}={p.default!r}".replace("'", '"')]
        elif p.default is p.empty:
            want.append(p.name)
        else:
            want.append(f"{p.name}={p.default!r}".replace("'", '"'))
    assert [a.strip() for a in shown.group(1).split(",")] == want
