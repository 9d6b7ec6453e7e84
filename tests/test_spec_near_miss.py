"""An unknown parameter name in a compressor, algorithm or strategy spec gets
one "did you mean" guess when it is a near miss of a declared parameter (case,
``-`` for ``_``, or a close spelling), and none when nothing is close."""

from __future__ import annotations

import difflib

import pytest

from gradpress import algorithms
from gradpress.compress import registry as compressors
from gradpress.exchange.base import PSEUDO, available, parse_strategy, strategy_class


def _declared() -> list[tuple[str, str, list[str]]]:
    """(kind, name, parameter names) of every registered thing that declares parameters."""
    rows = [("compressor", n, [p.name for p in compressors.get_class(n).PARAMS]) for n in compressors.names()]
    rows += [("algorithm", n, [p.name for p in algorithms.get_class(n).PARAMS]) for n in algorithms.names()]
    rows += [("strategy", n, [p.name for p in getattr(strategy_class(n), "PARAMS", ())])
             for n in available() if n not in PSEUDO]
    return [r for r in rows if r[2]]


def _message(kind: str, spec: str) -> str:
    parse = {"compressor": compressors.create, "algorithm": algorithms.parse, "strategy": parse_strategy}[kind]
    with pytest.raises(ValueError) as exc:
        parse(spec)
    return str(exc.value)


def _respellings(param: str) -> list[str]:
    """Spellings of ``param`` that differ only by case and ``-``/``_``."""
    out = {param.upper(), param.capitalize(), param.replace("_", "-"), param.upper().replace("_", "-")}
    return sorted(out - {param})


DECLARED = _declared()


@pytest.mark.parametrize(("kind", "name", "params"), DECLARED, ids=[f"{k}-{n}" for k, n, _ in DECLARED])
def test_a_parameter_spelled_another_way_gets_the_declared_name(kind: str, name: str, params: list[str]) -> None:
    for param in params:
        for wrong in _respellings(param):
            message = _message(kind, f"{name}:{wrong}=1")
            assert (f"{kind} {name!r}: unknown parameter {wrong!r} (did you mean {param!r}?); "
                    f"allowed parameters: {', '.join(params)}") in message, message


# (kind, spec, the guess or None): misspellings a user makes, and names close to nothing
TABLE = [
    ("compressor", "topk:ration=0.01", "ratio"),
    ("compressor", "qsgd:level=4", "levels"),
    ("compressor", "qsgd:buckets=4", "bucket"),
    ("compressor", "qsgd:levles=4", "levels"),
    ("algorithm", "localsgd:perio=2", "period"),
    ("algorithm", "diloco:outer_lrr=0.7", "outer_lr"),
    ("algorithm", "diloco:outerlr=0.7", "outer_lr"),
    ("algorithm", "diloco:nesterv=true", "nesterov"),
    ("strategy", "hierarchical:chunks=4", "chunk"),
    ("strategy", "hierarchical:workers-per-host=2", "workers_per_host"),
    ("algorithm", "diloco:H=8", None),
    ("algorithm", "diloco:lr=0.7", None),
    ("algorithm", "localsgd:steps=2", None),
    ("compressor", "topk:k=10", None),
    ("compressor", "qsgd:bits=4", None),
    ("strategy", "hierarchical:hosts=2", None),
]


@pytest.mark.parametrize(("kind", "spec", "guess"), TABLE, ids=[s for _, s, _ in TABLE])
def test_a_misspelled_parameter_gets_its_near_miss_and_a_far_one_no_guess(kind: str, spec: str,
                                                                          guess: str | None) -> None:
    message = _message(kind, spec)
    wrong = spec.split(":", 1)[1].split("=", 1)[0]
    assert f"unknown parameter {wrong!r}" in message, message
    if guess is None:
        assert "did you mean" not in message, message
    else:
        assert f"unknown parameter {wrong!r} (did you mean {guess!r}?); allowed parameters: " in message, message
        assert message.count("did you mean") == 1, message


def test_the_cutoff_is_strict() -> None:
    """A guess is at least 0.8 alike (difflib's ratio, computed here): 'rat' for 'ratio' is 0.75, no guess."""
    assert difflib.SequenceMatcher(None, "rat", "ratio").ratio() < 0.8
    assert "did you mean" not in _message("compressor", "topk:rat=0.1")
