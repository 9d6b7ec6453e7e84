"""docs/authoring-algorithms.md's worked example (SCAFFOLD's core) runs as
written: the block is executed, the class registers and builds from a spec
string, and on 3 gloo workers with non-IID data it matches the float64
reference of tests/test_scaffold.py (the paper's formulas, computed there
without gradpress code), gives the shipped ``scaffold:control=displacement``
bit for bit, and resumes bit-identically through ``weights_only=True``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from test_scaffold import WORLD, build, close, reference, straight_and_resumed, train

import gradpress.algorithms as algorithms
from gradpress.algorithms.registry import _REGISTRY

DOC = Path(__file__).resolve().parents[1] / "docs" / "authoring-algorithms.md"


def _example() -> str:
    text = DOC.read_text()
    section = text[text.index("## Worked example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def register_example() -> type:
    """Execute the page's block (it registers ``my-scaffold``); the class."""
    namespace: dict = {}
    exec(compile(_example(), str(DOC), "exec"), namespace)  # noqa: S102 - the documented example itself
    return namespace["MyScaffold"]


@pytest.fixture()
def my_scaffold():  # noqa: ANN201
    try:
        yield register_example()
    finally:
        _REGISTRY.classes.pop("my-scaffold", None)


def _worker(rank: int, world: int) -> dict:
    register_example()
    out: dict = {}
    for spec in ("my-scaffold:period=3", "scaffold:period=3,control=displacement"):
        model, opt, algo = build(rank, spec)
        out[spec] = train(rank, model, opt, algo, 0, 9)
        out[spec + "/stats"] = algo.stats
    out["straight"], out["resumed"], _ = straight_and_resumed(rank, "my-scaffold:period=3")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_the_example_matches_the_papers_formulas(results: list[dict]) -> None:
    want = reference(3, 9)
    for rank, res in enumerate(results):
        got = res["my-scaffold:period=3"]
        assert [s["step"] for s in got] == [2, 5, 8]
        for n, (g, w) in enumerate(zip(got, want)):
            close(g["x"], w["x"], f"rank {rank} sync {n} x")
            close(g["c"], w["c"], f"rank {rank} sync {n} c")
            close(g["ci"], w["ci"][rank], f"rank {rank} sync {n} c_i")


def test_the_example_is_the_shipped_scaffold_bit_for_bit(results: list[dict]) -> None:
    for res in results:
        ours, shipped = res["my-scaffold:period=3"], res["scaffold:period=3,control=displacement"]
        for a, b in zip(ours, shipped):
            for key in ("x", "c", "ci"):
                assert all(torch.equal(u, v) for u, v in zip(a[key], b[key])), key
        assert res["my-scaffold:period=3/stats"]["bytes_sent"] == res["scaffold:period=3,control=displacement/stats"][
            "bytes_sent"]


def test_the_example_resumes_bit_identically(results: list[dict]) -> None:
    for res in results:
        assert len(res["straight"]) == 2
        for a, b in zip(res["straight"], res["resumed"]):
            for key in ("x", "c", "ci"):
                assert all(torch.equal(u, v) for u, v in zip(a[key], b[key])), key


def test_the_example_registers_and_validates(my_scaffold) -> None:  # noqa: ANN001
    assert algorithms.get_class("my-scaffold") is my_scaffold
    row = {r["name"]: r for r in algorithms.describe()}["my-scaffold"]
    assert [p["name"] for p in row["params"]] == ["period"]
    with pytest.raises(ValueError, match="algorithm 'my-scaffold': parameter 'period' got 0; allowed: integer >= 1"):
        algorithms.parse("my-scaffold:period=0")


def test_the_core_is_about_seventy_lines() -> None:
    lines = [ln for ln in _example().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 80, len(lines)
