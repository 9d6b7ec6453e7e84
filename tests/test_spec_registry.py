"""The compressor registry and spec parsing: what the mutation run of
``compress/registry.py`` and ``compress/spec.py`` found untested (docs/testing.md)."""

from __future__ import annotations

import pytest

from gradpress.compress import Compressor
from gradpress.compress.registry import create, describe, names, register

pytestmark = pytest.mark.mutants


def test_a_second_class_cannot_take_a_registered_name() -> None:
    topk = type(create("topk"))
    assert register(topk) is topk  # registering the same class again (a re-import) is harmless

    class Impostor(Compressor):
        name = "topk"

    with pytest.raises(ValueError, match="compressor name 'topk' is already registered by TopK"):
        register(Impostor)
    assert type(create("topk")) is topk


def test_keywords_apply_to_the_first_stage_only() -> None:
    comp = create("topk>natural", ratio=0.2)
    assert comp.first.ratio == 0.2 and comp.spec() == "topk:ratio=0.2>natural"


def test_a_keyword_given_twice_names_the_first_such_parameter() -> None:
    with pytest.raises(ValueError, match="compressor 'qsgd': parameter 'bucket' given in the spec and as a keyword"):
        create("qsgd:levels=4,bucket=8", levels=2, bucket=4)


def test_describe_has_one_row_per_registered_name() -> None:
    rows = describe()
    assert [r["name"] for r in rows] == names() and len(rows) > 20
    qsgd = {r["name"]: r for r in rows}["qsgd"]
    assert [p["name"] for p in qsgd["params"]] == ["levels", "bucket"]
