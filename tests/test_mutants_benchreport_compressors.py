"""The figures of ``bench compressors``, pinned for survivors of the
``benchreport`` group of ``make mutants`` (compressors_rows.py,
compressors_report.py; bench e2e: test_mutants_benchreport.py, bench
estimators: test_mutants_benchreport_estimators.py).

The timings are faked (a scripted ``time_call`` and peak memory); every
expected figure is computed here in float64 by the formula the table documents
(GB/s = 4 numel / seconds / 1e9, ratio = 4 numel / wire bytes, the kept top-k's
relative error), never taken from the code's output. One process: a few seconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.mutants


# ----------------------------------------------------------------------------- bench compressors: rows


def _topk_by_hand(x, k: int):
    """Indices of the k largest |x| (``references.topk_indices``: float64, ties to the lower index), ascending,
    and the relative error of keeping them."""
    from references import topk_indices

    xs = [float(v) for v in x.reshape(-1)]
    keep = topk_indices(x, k).tolist()
    dropped = math.fsum(xs[i] ** 2 for i in range(len(xs)) if i not in set(keep))
    return keep, math.sqrt(dropped / math.fsum(v * v for v in xs))


@pytest.fixture
def scripted(monkeypatch):
    """``time_call`` and ``peak_extra_bytes`` of compressors_rows replaced: each timed call gets the next
    scripted median (the function is still called once, its result returned); every peak is 777 bytes."""
    from gradpress.bench import compressors_rows

    calls: list = []
    medians: list[float] = []

    def time_call(fn, device, repeats, warmup=1):
        result = fn()
        calls.append(result)
        return medians.pop(0), result

    monkeypatch.setattr(compressors_rows, "time_call", time_call)
    monkeypatch.setattr(compressors_rows, "peak_extra_bytes", lambda fn, device: (fn(), 777)[1])
    return SimpleNamespace(calls=calls, medians=medians)


def test_reference_rows_keep_ceil_density_d_entries_at_8_bytes_each(scripted):
    import torch

    from gradpress.bench.compressors_rows import bench_reference

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for kind, density, k in (("topk", 0.0123, 13), ("kthvalue", 0.0123, 13), ("topk", 1e-9, 1), ("topk", 1.5, 1000)):
        scripted.medians.append(0.002)
        row = bench_reference(kind, density, x, "normal", 16.0, repeats=3, warmup=1)
        keep, rel = _topk_by_hand(x, k)
        assert (row["compressor"], row["name"], row["kind"]) == (f"ref:{kind}@{density:g}", kind, "reference")
        assert row["numel"] == 1000 and row["data"] == "normal" and row["roofline_gbps"] == 16.0
        assert row["wire_bytes"] == 8 * k and row["ratio"] == pytest.approx(4000 / (8 * k), rel=1e-12)
        assert row["encode_s"] == 0.002 and row["encode_gbps"] == pytest.approx(4000 / 0.002 / 1e9, rel=1e-12)
        assert row["encode_roofline_fraction"] == pytest.approx(4000 / 0.002 / 1e9 / 16.0, rel=1e-12)
        assert row["decode_s"] is None and row["decode_gbps"] is None
        assert row["rel_error"] == pytest.approx(rel, rel=1e-9, abs=1e-12)
        assert row["density_target"] == density and row["density_achieved"] == k / 1000
        assert row["density_quality"] == pytest.approx(k / 1000 / density, rel=1e-12)
        assert row["peak_temp_bytes"] == 777 and row["peak_temp_ratio"] == 777 / 4000
        timed = scripted.calls.pop()
        if kind == "topk":
            assert sorted(timed.indices.tolist()) == sorted(keep)
        else:  # the (n - k + 1)-th smallest |x|: the k-th largest
            assert float(timed.values) == pytest.approx(min(abs(float(x[i])) for i in keep), rel=1e-6)


def test_method_row_figures_from_the_first_call_and_the_timed_medians(scripted):
    import torch

    from gradpress.bench.compressors_rows import bench_method

    x = torch.randn(4000, generator=torch.Generator().manual_seed(5))
    scripted.medians.extend([0.004, 0.001, 0.0005])  # encode, decode, decode into a buffer
    row = bench_method("topk:ratio=0.01", x, "normal", 20.0, repeats=3, warmup=1)
    k = 40
    keep, rel = _topk_by_hand(x, k)
    assert (row["compressor"], row["name"], row["kind"], row["variant"]) == ("topk:ratio=0.01", "topk", "method",
                                                                             "default")
    assert row["shape"] == [4000] and row["numel"] == 4000 and row["threads"] == torch.get_num_threads()
    assert row["wire_bytes"] == 8 * k  # k fp32 values and k int32 indices
    assert row["ratio"] == pytest.approx(16000 / (8 * k), rel=1e-12)
    assert row["rel_error"] == pytest.approx(rel, rel=1e-9)
    assert row["density_target"] == 0.01 and row["density_achieved"] == k / 4000
    assert row["density_quality"] == pytest.approx(k / 4000 / 0.01, rel=1e-12)
    assert (row["encode_s"], row["decode_s"], row["decode_into_s"]) == (0.004, 0.001, 0.0005)
    assert row["encode_gbps"] == pytest.approx(16000 / 0.004 / 1e9, rel=1e-12)
    assert row["decode_gbps"] == pytest.approx(16000 / 0.001 / 1e9, rel=1e-12)
    assert row["decode_into_gbps"] == pytest.approx(16000 / 0.0005 / 1e9, rel=1e-12)
    assert row["encode_roofline_fraction"] == pytest.approx(16000 / 0.004 / 1e9 / 20.0, rel=1e-12)
    assert row["peak_temp_bytes"] == 777 and row["peak_temp_ratio"] == 777 / 16000
    assert row["reported_quality"] is None and row["speedup_vs_topk"] is None
    # a zero time is an infinite rate, never a division error; a method without a density has none
    scripted.medians.extend([0.0, 0.0, 0.0])
    row = bench_method("fp16", x, "normal", 20.0, repeats=1, warmup=0)
    assert row["encode_gbps"] == row["decode_gbps"] == row["decode_into_gbps"] == math.inf
    assert row["encode_roofline_fraction"] == math.inf and row["density_target"] is None
    assert row["wire_bytes"] == 2 * 4000 and row["ratio"] == 2.0


def test_a_numeric_quality_of_the_method_is_reported_a_boolean_not(monkeypatch, scripted):
    import torch

    from gradpress.bench import compressors_rows
    from gradpress.compress import create

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for quality, want in ((0.75, 0.75), (2, 2.0), (True, None), ("0.5", None)):
        def build(spec, quality=quality):
            comp = create("fp16")
            comp.quality = quality
            return comp, "stand-in"

        monkeypatch.setattr(compressors_rows, "build", build)
        scripted.medians.extend([0.001, 0.001, 0.001])
        row = compressors_rows.bench_method("fp16", x, "normal", 10.0, repeats=1, warmup=0)
        assert row["reported_quality"] == want and row["note"] == "stand-in", quality
        assert want is None or isinstance(row["reported_quality"], float)


def test_finish_row_ratios_and_rates_by_the_formula():
    from gradpress.bench.compressors_rows import _finish_row, _rel_error

    row = {"roofline_gbps": 8.0}
    _finish_row(row, 4_000_000, 0.5e-3, None, 0)
    assert row["encode_gbps"] == pytest.approx(4e6 / 0.5e-3 / 1e9, rel=1e-12) and row["decode_gbps"] is None
    assert row["ratio"] == math.inf and row["wire_bytes"] == 0 and row["decode_s"] is None
    assert row["encode_roofline_fraction"] == pytest.approx(4e6 / 0.5e-3 / 1e9 / 8.0, rel=1e-12)
    _finish_row(row, 4_000_000, 1.0, 2.0, 3)
    assert row["decode_gbps"] == pytest.approx(4e6 / 2.0 / 1e9, rel=1e-12) and row["ratio"] == pytest.approx(4e6 / 3)
    assert isinstance(row["wire_bytes"], int)
    import torch

    x = torch.tensor([3.0, 4.0])
    assert _rel_error(torch.tensor([3.0, 0.0]), x) == pytest.approx(4 / 5, rel=1e-12)
    assert _rel_error(torch.ones(2), torch.zeros(2)) == 0.0  # a zero input: no error figure, 0 by convention


@pytest.fixture()
def tbq():
    """docs/authoring.md's worked example: a kit declaration of the user's, with no hand-written version."""
    import re
    from pathlib import Path

    from gradpress.compress.registry import _REGISTRY

    doc = (Path(__file__).resolve().parents[1] / "docs" / "authoring.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc[doc.index("## Worked example"):], re.S).group(1)
    exec(compile(code, "authoring.md", "exec"), {})  # noqa: S102 - the documented example itself
    try:
        yield
    finally:
        _REGISTRY.classes.pop("tbq", None)


def test_eager_and_compiled_apply_to_every_kit_declaration_hand_only_to_the_frozen_ones(tbq):
    from gradpress.bench.compressors_rows import variant_applies

    default, eager, compiled, hand = "default,eager,compiled,hand".split(",")  # as --variants gives them
    assert variant_applies("tbq:tau=0.5", eager) and variant_applies("tbq:tau=0.5", compiled)
    assert variant_applies("tbq:tau=0.5", default) and not variant_applies("tbq:tau=0.5", hand)
    assert not variant_applies("tbq:tau=0.5", "hand") and variant_applies("tbq:tau=0.5", "eager")


def test_variants_apply_to_the_methods_the_docs_name(monkeypatch):
    from gradpress.bench import compressors_rows
    from gradpress.bench.compressors_rows import _compile_mode, variant_applies
    from gradpress.compress.kit import compiler

    assert variant_applies("fp16>topk:ratio=0.1", "default") and not variant_applies("qsgd>topk", "hand")
    assert variant_applies("qsgd:levels=4", "hand") and variant_applies("topk:ratio=0.1", "hand")
    assert not variant_applies("fp16", "hand")
    assert variant_applies("qsgd:levels=4", "eager") and variant_applies("qsgd:levels=4", "compiled")
    assert not variant_applies("qsgd>fp16", "eager")
    import torch

    monkeypatch.setattr(compiler, "keeps_eager_numerics", lambda device_type="cpu": True)
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL)) == "auto"
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL + 1)) == "auto"
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL - 1)) == "on"
    monkeypatch.setattr(compiler, "keeps_eager_numerics", lambda device_type="cpu": False)
    assert _compile_mode("compiled", torch.zeros(compiler.MIN_COMPILE_NUMEL)) == "on"
    assert _compile_mode("eager", torch.zeros(4)) == "off"
    monkeypatch.setattr(compiler, "mode", lambda: "policy")
    assert _compile_mode("default", torch.zeros(4)) == _compile_mode("hand", torch.zeros(4)) == "policy"
    assert compressors_rows._builder("default") is compressors_rows.build


# ----------------------------------------------------------------------------- bench compressors: the table


def _crow(name: str, numel: int, **v) -> dict:
    row = {"compressor": name, "numel": numel, "encode_gbps": 1.234, "decode_gbps": 5.678, "decode_into_gbps": None,
           "encode_roofline_fraction": 0.12345, "ratio": 32.04, "wire_bytes": 12_345, "rel_error": 0.123456,
           "density_quality": None, "speedup_vs_topk": 1.5, "peak_temp_ratio": 0.25}
    row.update(v)
    return row


def test_compressor_table_cells_rooflines_skips_and_targets():
    from gradpress.bench.compressors_report import format_table

    rows = [_crow("topk:ratio=0.01", 4000, density_quality=1.0, decode_into_gbps=9.0),
            _crow("a" * 40, 4000, ratio=math.inf, encode_gbps=math.inf, encode_roofline_fraction=0.5),
            _crow("fp16", 8000, speedup_vs_topk=None)]
    result = {"rows": rows, "roofline": {"4000": 12.345, "8000": 20.0},
              "rooflines": {"8000": {"1": 5.0, "all": 9.5, "run_threads": 2}},
              "skipped": [{"compressor": "powersgd", "numel": 4000, "reason": "not a matrix"}],
              "targets": [{"target": "t1", "compressor": "fp16", "numel": 8000, "value": 0.5, "threshold": 0.25,
                           "met": True},
                          {"target": "peak", "compressor": "qsgd", "numel": 1_000_000, "value": 3.14159,
                           "threshold": 3, "met": False}]}
    lines = format_table(result).splitlines()
    assert lines[0].split() == ["compressor", "numel", "enc", "GB/s", "dec", "GB/s", "into", "GB/s", "%roof", "ratio",
                                "wire", "bytes", "rel", "err", "dens", "q", "vs", "topk", "peak/in"]
    assert lines[1] == "-" * len(lines[0])
    assert lines[2].split() == ["topk:ratio=0.01", "4,000", "1.23", "5.68", "9.00", "12.3", "32.0", "12,345", "0.1235",
                                "1.000", "1.50", "0.25"]
    assert lines[3].split() == ["a" * 28, "4,000", "inf", "5.68", "-", "50.0", "inf", "12,345", "0.1235", "-", "1.50",
                                "0.25"]
    assert lines[4] == "" and lines[5].split()[:2] == ["fp16", "8,000"] and lines[5].split()[10] == "-"
    assert lines[6] == ""
    assert lines[7] == "copy roofline at 4,000 elements: 12.35 GB/s (bytes read + written)"
    assert lines[8] == ("copy roofline at 8,000 elements (bytes read + written, best of several runs): 1 thread "
                        "5.00 GB/s, all threads 9.50 GB/s; %roof uses 20.00 GB/s, measured at this run's 2 thread(s)")
    assert lines[9:] == ["skipped powersgd at 4,000: not a matrix", "targets: 1 of 2 met",
                         "  MISSED peak: qsgd at 1,000,000: 3.14 (needs 3)"]


def test_huge_page_line_only_above_32_mib_of_input():
    from gradpress.bench.compressors_report import format_table

    def table(numel: int) -> str:
        return format_table({"rows": [_crow("fp16", numel)], "roofline": {}, "skipped": [], "targets": [],
                             "env": {"transparent_hugepage": "", "thp_alloc": None}})

    assert "faulted in" not in table(8 * 2**20)  # exactly 32 MiB of fp32
    line = next(x for x in table(8 * 2**20 + 1).splitlines() if "faulted in" in x)
    assert "(transparent huge pages: unknown; THP_MEM_ALLOC_ENABLE=unset)" in line
    assert "faulted in" not in format_table({"rows": [_crow("fp16", 10**8)], "roofline": {}, "skipped": [],
                                             "targets": [], "env": {"transparent_hugepage": None}})


def test_json_safe_writes_infinities_as_strings_and_nan_as_null():
    from gradpress.bench.compressors_report import _json_safe

    got = _json_safe({"a": [1.5, math.inf, {"b": -math.inf}], "c": math.nan, "d": "inf", "e": 3})
    assert got == {"a": [1.5, "inf", {"b": "-inf"}], "c": None, "d": "inf", "e": 3}
