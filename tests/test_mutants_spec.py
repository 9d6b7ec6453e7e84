"""``coerce_params`` (``compress/spec.py``), the spec parser's parameter step
for compressors (``defaults=True``) and algorithms (``defaults=False``).

Its contract (docstring): every given parameter is coerced and validated;
with ``defaults`` every parameter not given is filled with its default, and
without it only the given ones are returned, whatever their position among
the declared ones. Expected values are the test's own. Written for a
survivor of ``make mutants`` (``spec`` group: the loop stopped at the first
parameter not given, dropping every later one).
"""

from __future__ import annotations

import pytest

from gradpress.compress.base import Param
from gradpress.compress.spec import coerce_params

pytestmark = pytest.mark.mutants

DECLARED = [Param("a", int, 1), Param("b", float, 0.5), Param("c", bool, False), Param("d", int, 7)]


@pytest.mark.parametrize("given", [{}, {"a": "3"}, {"c": "true"}, {"d": "9"}, {"b": "0.25", "d": "2"},
                                   {"a": "4", "b": "1.5", "c": "no", "d": "0"}])
def test_only_the_given_parameters_without_defaults(given: dict[str, str]) -> None:
    """``defaults=False``: exactly the given names come back, coerced, wherever
    they are declared (after parameters not given, too)."""
    want = {"a": int, "b": float, "c": lambda v: v == "true", "d": int}
    out = coerce_params(DECLARED, given, "thing", "algorithm", defaults=False)
    assert out == {k: want[k](v) for k, v in given.items()}


@pytest.mark.parametrize("given", [{}, {"c": "yes"}, {"d": "9"}])
def test_every_parameter_with_defaults(given: dict[str, str]) -> None:
    """``defaults=True``: every declared parameter, the given ones coerced."""
    out = coerce_params(DECLARED, given, "thing", "compressor")
    want = {"a": 1, "b": 0.5, "c": False, "d": 7}
    want.update({k: (v == "yes") if k == "c" else int(v) for k, v in given.items()})
    assert out == want
