"""Specs for people: progress lines, the summary line and compare's tables show
an algorithm (and, in train's lines, a compressor) as its canonical spec
without the parameters at their defaults. That short form must build the same
thing: parsed back, it gives the same canonical spec, for every registered
algorithm and compressor and for each parameter moved off its default (values
built here from each ``Param``'s type and allowed values). The expected short
form is computed here from the canonical strings' text."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gradpress import compare
from gradpress.compress import registry as compressors
from gradpress.train import algorithm as algorithms
from gradpress.train.cli import summary_line


def _candidates(param: Any) -> list[Any]:
    """Values other than the default a parameter may take (some are refused: those are skipped)."""
    d = param.default
    if d is None:
        return []
    if param.type is bool:
        return [not d]
    if param.type is int:
        return [d + 1, d * 2, d - 1]
    if param.type is float:
        return [d / 2, d * 2, d + 0.25]
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_-]*", str(param.allowed or ""))
    return [w for w in dict.fromkeys(words) if w != d][:3]


def _expected_short(name: str, canonical: str, defaults: str) -> str:
    """``canonical`` with the ``key=value`` items that ``defaults`` (the name alone, canonical) also has
    dropped: text against text."""
    items = canonical.partition(":")[2].split(",") if ":" in canonical else []
    default_items = set(defaults.partition(":")[2].split(",")) if ":" in defaults else set()
    kept = [i for i in items if i not in default_items]
    return name + (":" + ",".join(kept) if kept else "")


def _cases(kind: str) -> list[tuple[str, str]]:
    """(name, spec) for every registered name alone and with each parameter it accepts off its default."""
    if kind == "algorithm":
        names = [n for n in algorithms.names() if n != "ddp"]
        classes = {n: algorithms._registry().get_class(n) for n in names}
    else:
        names = compressors.names()
        classes = {n: compressors.get_class(n) for n in names}
    out = [("ddp", "ddp")] if kind == "algorithm" else []
    for n in names:
        out.append((n, n))
        for p in classes[n].PARAMS:
            out += [(n, f"{n}:{p.name}={v}") for v in _candidates(p)]
    return out


def _canonical(kind: str, spec: str) -> str:
    return algorithms.check_spec(spec) if kind == "algorithm" else compressors.create(spec).spec()


def _short(kind: str, spec: str) -> str:
    return algorithms.short_spec(spec) if kind == "algorithm" else compressors.short_spec(spec)


@pytest.mark.parametrize("kind", ["algorithm", "compressor"])
def test_the_short_form_parses_back_to_the_same_canonical_spec(kind: str) -> None:
    tried = 0
    for name, spec in _cases(kind):
        try:
            canonical = _canonical(kind, spec)
        except ValueError:
            continue  # a value this parameter refuses (or needs another parameter to go with it)
        tried += 1
        short = _short(kind, spec)
        assert _canonical(kind, short) == canonical, (spec, short)
        assert short == _expected_short(name, canonical, _canonical(kind, name)), (spec, canonical, short)
        assert _short(kind, canonical) == short, spec  # the canonical spec itself shortens the same
        if spec == name:
            assert short == name, short  # every parameter at its default: the name alone
    registered = len(algorithms.names()) if kind == "algorithm" else len(compressors.names())
    assert tried > 2 * registered, tried  # most parameters were moved off their default and checked


def test_a_two_stage_compressor_shortens_stage_by_stage() -> None:
    spec = "topk:ratio=0.1>qsgd:levels=4,bucket=512"
    assert compressors.short_spec(spec) == "topk:ratio=0.1>qsgd:levels=4"
    assert compressors.create(compressors.short_spec(spec)).spec() == compressors.create(spec).spec()


DILOCO = algorithms.check_spec("diloco:period=2")


def test_lines_and_tables_for_people_show_the_short_form() -> None:
    assert DILOCO.count("=") == 11  # the canonical spec: every parameter
    s = {"workload": "digits-mlp", "algorithm": DILOCO, "compressor": "qsgd:levels=4,bucket=512", "world_size": 2,
         "steps": 4, "metric": "accuracy", "final_metric": 0.5, "bytes_per_step": 100.0,
         "dense_bytes_per_step": 200.0, "compression_ratio": 2.0, "median_step_s": 0.01}
    assert summary_line(s).startswith("digits-mlp / diloco:period=2 / qsgd:levels=4 on 2 worker(s)"), summary_line(s)
    assert compare.label(s) == "diloco:period=2/qsgd:levels=4,bucket=512"  # compare keeps the run's compressor
    assert compare.label({"algorithm": algorithms.check_spec("localsgd"), "compressor": "none"}) == "localsgd/none"


def test_a_spec_that_does_not_parse_here_is_shown_as_it_is() -> None:
    assert algorithms.shown("myplugin:x=1") == "myplugin:x=1"
    assert algorithms.shown_compressor("mine:k=2") == "mine:k=2"
