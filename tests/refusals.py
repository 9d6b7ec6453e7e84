"""Tests that bad arguments are refused before anything expensive starts (workers, a run, an emulated
cluster, a benchmark): :func:`forbid` replaces what would start it with a stand-in that fails the test, so a
refusal that is removed (or comes too late) fails loudly instead of starting the real thing."""

from __future__ import annotations

from typing import Any

import pytest


def forbid(monkeypatch: pytest.MonkeyPatch, what: str, *targets: tuple[Any, str]) -> None:
    """Replace each ``(owner, name)`` of ``targets`` (a function or a class: whatever calling it would start)
    with one that raises ``AssertionError(f"{what} for arguments that should have been refused")``;
    ``monkeypatch`` undoes it after the test."""
    if not targets:
        raise ValueError("forbid: targets got none; allowed: one or more (owner, attribute name) pairs")

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} for arguments that should have been refused")

    for owner, name in targets:
        monkeypatch.setattr(owner, name, refused)  # raising=True: a renamed target fails here, not silently
