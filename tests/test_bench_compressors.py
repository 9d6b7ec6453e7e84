"""``gradpress bench compressors``: the command runs on small sizes, writes
JSON with every field, its wire sizes and ratios equal what the compressors
declare, memory is really measured, and bad arguments fail clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from refusals import forbid

from gradpress.bench import bench_modules
from gradpress.bench.compressors import ROW_FIELDS
from gradpress.bench.data import make_input, matrix_shape
from gradpress.bench.measure import peak_extra_bytes
from gradpress.bench.specs import BENCH_SPECS, parse_compressors, parse_sizes
from gradpress.cli import main
from gradpress.compress import create, names

NUMERIC = ("encode_s", "decode_s", "encode_gbps", "decode_gbps", "ratio", "rel_error", "roofline_gbps",
           "encode_roofline_fraction", "peak_temp_ratio")


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, *extra: str) -> dict:
    path = tmp_path / "bench.json"
    rc = main(["bench", "compressors", "--repeats", "2", "--threads", "1", "--json", str(path),
               "--out", str(tmp_path / "out"), *extra])
    assert rc == 0
    return json.loads(path.read_text())


def _input_of(row: dict) -> torch.Tensor:
    return make_input(row["data"], row["numel"], "cpu", 0).view(row["shape"])


def test_small_run_writes_every_field_and_declared_wire_sizes(tmp_path, capsys):
    specs = "none,fp16,topk:ratio=0.01,qsgd:levels=4,bucket=64"
    result = _run(tmp_path, "--compressors", specs, "--sizes", "4K,3000", "--data", "laplace")
    out = capsys.readouterr().out
    assert "enc GB/s" in out and "copy roofline" in out
    rows = result["rows"]
    methods = [r for r in rows if r["kind"] == "method"]
    assert [(r["compressor"], r["numel"]) for r in methods] == [
        (s, n) for n in (4000, 3000) for s in ("none", "fp16", "topk:ratio=0.01", "qsgd:levels=4,bucket=64")
    ]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        for f in NUMERIC:
            if r[f] is not None:
                assert isinstance(r[f], (int, float)) and math.isfinite(r[f]) and r[f] >= 0, (r["compressor"], f)
        assert r["encode_gbps"] > 0 and r["roofline_gbps"] > 0 and r["wire_bytes"] > 0
        assert r["ratio"] == pytest.approx(4 * r["numel"] / r["wire_bytes"])
        assert r["encode_roofline_fraction"] == pytest.approx(r["encode_gbps"] / r["roofline_gbps"])
        assert r["roofline_gbps"] == pytest.approx(result["roofline"][str(r["numel"])])
    for r in methods:
        x = _input_of(r)
        assert r["wire_bytes"] == create(r["compressor"]).encode(x).nbytes
        assert r["decode_gbps"] > 0 and r["peak_temp_bytes"] >= 0
        assert r["peak_temp_ratio"] == pytest.approx(r["peak_temp_bytes"] / (4 * r["numel"]))
    by = {(r["compressor"], r["numel"]): r for r in rows}
    # identity: exact, and it allocates nothing (the packet is a view)
    assert by[("none", 4000)]["rel_error"] == 0.0 and by[("none", 4000)]["peak_temp_bytes"] == 0
    # fp16: allocates at least its packet (2 B/elem) and the decoded fp32 output (4 B/elem)
    fp16 = by[("fp16", 4000)]
    assert 6 * 4000 <= fp16["peak_temp_bytes"] <= 4 * 4 * 4000
    assert 0 < fp16["rel_error"] < 1e-3
    # top-k keeps exactly k = ceil(0.01 d) entries; reference rows at its density
    topk = by[("topk:ratio=0.01", 4000)]
    assert topk["density_quality"] == pytest.approx(1.0) and topk["speedup_vs_topk"] > 0
    for ref in ("ref:topk@0.01", "ref:kthvalue@0.01"):
        assert by[(ref, 4000)]["kind"] == "reference" and by[(ref, 4000)]["wire_bytes"] == 8 * 40
    assert by[("ref:topk@0.01", 4000)]["rel_error"] == pytest.approx(topk["rel_error"])
    assert by[("fp16", 4000)]["density_quality"] is None
    png = tmp_path / "out" / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {t["target"] for t in result["targets"]} >= {"peak temporaries <= 3x input",
                                                         "quantizer encode >= 25% of copy roofline"}


def test_all_covers_every_registered_name(tmp_path, capsys):
    result = _run(tmp_path, "--compressors", "all", "--sizes", "2048", "--repeats", "1")
    seen = {r["name"] for r in result["rows"] if r["kind"] == "method"}
    skipped = {s["compressor"].split(":")[0] for s in result["skipped"]}
    assert set(names()) <= seen | skipped
    for s in result["skipped"]:
        assert s["reason"]
    for r in result["rows"]:
        if r["kind"] != "method":
            continue
        assert r["compressor"] == BENCH_SPECS.get(r["name"], r["name"])
        assert r["wire_bytes"] == create(r["compressor"]).encode(_input_of(r)).nbytes, r["compressor"]
        if r["wire_bytes"]:
            assert r["ratio"] == pytest.approx(4 * r["numel"] / r["wire_bytes"])
        else:  # a threshold method that selected nothing
            assert r["ratio"] == "inf"


def test_matrix_methods_run_on_a_matrix_view(tmp_path):
    if "powersgd" not in names():
        pytest.fail("powersgd is not registered")  # the matrix path needs a low-rank method
    result = _run(tmp_path, "--compressors", "powersgd:rank=1,start_iter=0", "--sizes", "64K")
    (row,) = [r for r in result["rows"] if r["kind"] == "method"]
    assert row["shape"] == list(matrix_shape(64000)) == [64, 1000]
    assert row["wire_bytes"] == 4 * (64 + 1000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "0"], "--sizes"),
        (["--sizes", "12Q"], "--sizes"),
        (["--sizes", ","], "--sizes"),
        (["--compressors", "nosuch"], "unknown compressor 'nosuch'"),
        (["--compressors", "topk:ratio=2"], "'ratio' got 2.0"),
        (["--compressors", ""], "--compressors"),
        (["--variants", "fast"], "--variants got 'fast'; allowed: comma-separated default, compiled, eager, hand"),
    ],
)
def test_bad_values_give_clear_errors(tmp_path, capsys, argv, message):
    rc = main(["bench", "compressors", "--out", str(tmp_path), *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats got 0"),
        (["--data", "images"], "invalid choice: 'images'"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bad_flags_are_rejected_by_the_parser(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "compressors", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def no_benchmark(monkeypatch):
    """Running the benchmark fails the test: the arguments must be refused before."""
    import gradpress.bench.compressors as cmd

    forbid(monkeypatch, "the benchmark ran", (cmd, "run_benchmark"))


def test_outputs_it_cannot_write_are_refused_before_measuring(tmp_path, capsys, no_benchmark):
    """An --out or --json that could not be written raised (FileNotFoundError, FileExistsError) after the
    whole benchmark; an empty --json or --compressors list ran and exited 0."""
    (tmp_path / "file").write_text("x")
    base = ["bench", "compressors", "--sizes", "1K", "--compressors", "none"]
    cases = [(["--json", str(tmp_path / "file" / "b.json")], "--json got", "is a file, not a directory"),
             (["--json", str(tmp_path / "missing" / "b.json")], "--json: directory", "does not exist"),
             (["--json", ""], "--json got ''", "a file path"),
             (["--out", str(tmp_path / "file" / "out")], "--out: cannot create", "is a file, not a directory"),
             (["--compressors", ","], "--compressors got ','", "at least one")]
    if __import__("os").path.isdir("/proc/self"):
        cases += [(["--json", "/proc/self/b.json"], "--json: cannot write", "/proc/self"),
                  (["--out", "/proc/self/out"], "--out: cannot write", "/proc/self")]
    for argv, first, then in cases:
        rc = main([*base, "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"gradpress bench compressors: error: {first}") and then in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_threads_beyond_the_cores_are_refused(tmp_path, capsys, no_benchmark):
    """--threads 100000 reached torch.set_num_threads and the process died of SIGSEGV."""
    import os

    rc = main(["bench", "compressors", "--out", str(tmp_path), "--threads", str(100 * len(os.sched_getaffinity(0)))])
    err = capsys.readouterr().err
    assert rc == 2 and "--threads got" in err and f"<= {len(os.sched_getaffinity(0))}" in err, err


def test_cuda_request_without_cuda(tmp_path, capsys):
    rc = main(["bench", "compressors", "--device", "cuda", "--sizes", "1K", "--compressors", "none",
               "--out", str(tmp_path)])
    if torch.cuda.is_available():
        assert rc == 0
    else:
        assert rc == 2 and "CUDA is not available" in capsys.readouterr().err


def test_bench_command_discovers_registrars(capsys):
    found = {name: mod for name, mod, _ in bench_modules()}
    assert found["compressors"] is not None
    assert "data" not in found and "measure" not in found  # helpers register nothing
    assert main(["bench"]) == 2
    assert "compressors" in capsys.readouterr().out


def test_argument_parsing():
    assert parse_sizes("4K, 1M,25M,1000,2.5e3") == [4000, 1_000_000, 25_000_000, 1000, 2500]
    assert parse_compressors("qsgd:levels=4,bucket=512,topk:ratio=0.01>qsgd:levels=2;fp16") == [
        "qsgd:levels=4,bucket=512", "topk:ratio=0.01>qsgd:levels=2", "fp16"]
    assert parse_compressors("all") == [BENCH_SPECS.get(n, n) for n in names()]
    with pytest.raises(ValueError, match="--sizes"):
        parse_sizes("1.5")


def test_captured_gradients_are_real_and_reproducible():
    from gradpress.bench.data import captured_gradients

    base = captured_gradients()
    n = base.numel() + 1000
    a = make_input("captured", n)
    assert torch.equal(a, make_input("captured", n)) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a[: base.numel()], base) and torch.equal(a[base.numel():], base[:1000])  # tiled
    # real gradients are heavy-tailed: excess kurtosis far above a Gaussian's 0
    z = (base - base.mean()) / base.std()
    assert float((z**4).mean()) - 3 > 3 and float(base.std()) > 0
    # and they change from step to step (not one step repeated)
    per_step = base.numel() // 8
    assert not torch.equal(base[:per_step], base[per_step : 2 * per_step])


def test_peak_memory_is_measured_on_cpu():
    n = 1 << 20
    peak = peak_extra_bytes(lambda: torch.ones(n), torch.device("cpu"))
    assert 4 * n <= peak < 4 * n + 65536

    def two_temporaries():
        a = torch.ones(n)
        b = a * 2  # a and b live together: 8 MiB
        del a
        return b.sum()

    assert 8 * n <= peak_extra_bytes(two_temporaries, torch.device("cpu")) < 8 * n + 65536


def test_variants_put_kit_and_hand_written_side_by_side(tmp_path, capsys):
    """--variants: each kit declaration runs as registered, eager, and as the
    frozen hand-written version it replaced (same wire size); other methods
    only as registered. Two copy rooflines (1 thread, all threads) per size,
    and the table says which one the fractions use."""
    result = _run(tmp_path, "--compressors", "qsgd:levels=4,bucket=64,fp16", "--sizes", "3000",
                  "--variants", "default,eager,hand")
    out = capsys.readouterr().out
    rows = {r["compressor"]: r for r in result["rows"] if r["kind"] == "method"}
    assert set(rows) == {"qsgd:levels=4,bucket=64", "qsgd:levels=4,bucket=64 [eager]",
                         "qsgd:levels=4,bucket=64 [hand]", "fp16"}
    assert rows["qsgd:levels=4,bucket=64 [hand]"]["variant"] == "hand"
    assert rows["qsgd:levels=4,bucket=64 [hand]"]["note"] == "hand-written reference"
    assert len({r["wire_bytes"] for n, r in rows.items() if n.startswith("qsgd")}) == 1
    assert all(r["threads"] == 1 for r in rows.values())
    pair = result["rooflines"]["3000"]
    assert pair["1"] > 0 and pair["all"] > 0 and pair["run_threads"] == 1
    assert result["roofline"]["3000"] == pair["run"]
    assert "1 thread" in out and "all threads" in out and "this run's 1 thread(s)" in out
    kinds = {(t["compressor"], t["target"]) for t in result["targets"]}
    assert ("qsgd:levels=4,bucket=64", "kit encode not slower than the hand-written version") in kinds
    assert not any(c.endswith("[hand]") and "roofline" in t for c, t in kinds)
    assert "--variants default,eager,hand" in result["command"]


def test_the_report_says_when_decodes_pay_for_fresh_pages(monkeypatch):
    """Above ~32 MB a decode's fresh output is faulted in on every call, so
    the report names the huge-page settings the decode column depends on;
    below that size it says nothing."""
    from gradpress.bench import compressors_sweep
    from gradpress.bench.compressors_report import format_table

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    result = compressors_sweep.run_benchmark(["fp16"], [20_000], repeats=1)
    assert result["env"]["thp_alloc"] == "1"
    mode = compressors_sweep.transparent_hugepage()
    assert result["env"]["transparent_hugepage"] == mode and mode in ("", "always", "madvise", "never")
    assert "faulted in" not in format_table(result)
    big = {**result, "rows": [{**r, "numel": 25_000_000} for r in result["rows"]]}
    line = next(x for x in format_table(big).splitlines() if "faulted in" in x)
    assert "THP_MEM_ALLOC_ENABLE=1" in line and f"transparent huge pages: {mode or 'unknown'}" in line


@pytest.mark.parametrize(("before", "after"), [(30.0, 60.0), (50.0, 40.0)])
def test_fractions_use_the_better_roofline_before_or_after_the_rows(monkeypatch, before, after):
    """The copy roofline at the rows' thread count is measured before a
    size's rows and again after them; every fraction (and the 25% target)
    uses the faster of the two, and the report shows both."""
    from gradpress.bench import compressors_sweep
    from gradpress.bench.compressors_report import format_table

    measured = iter([10.0, 20.0, before, after])  # 1 thread, all threads, before the rows, after them
    monkeypatch.setattr(compressors_sweep, "best_copy_gbps", lambda x, runs, threads=None: next(measured))
    result = compressors_sweep.run_benchmark(["qsgd:levels=4,bucket=64", "fp16"], [5_000], repeats=1)
    best = max(before, after)
    assert result["roofline"]["5000"] == best
    assert result["rooflines"]["5000"] == {"1": 10.0, "all": 20.0, "run": best, "run_before": before,
                                         "run_after": after, "run_threads": torch.get_num_threads()}
    rows = [r for r in result["rows"] if r["kind"] == "method"]
    assert len(rows) == 2
    for r in rows:
        assert r["roofline_gbps"] == best and r["encode_roofline_fraction"] == r["encode_gbps"] / best
    target = next(t for t in result["targets"] if t["compressor"] == "qsgd:levels=4,bucket=64"
                  and "roofline" in t["target"])
    assert target["value"] == rows[0]["encode_gbps"] / best
    assert f"%roof uses {best:.2f} GB/s" in format_table(result)
    assert f"the better of {before:.2f} before the rows and {after:.2f} after" in format_table(result)


@pytest.mark.parametrize("bench,runner", [("compressors", "gradpress.bench.compressors.run_benchmark"),
                                          ("estimators", "gradpress.bench.estimators.run_estimators"),
                                          ("e2e", "gradpress.bench.e2e.run_e2e")])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_every_bench_seed_follows_trains_rule(tmp_path, capsys, monkeypatch, bench, runner, seed):
    """`bench compressors --seed -1` (and estimators') ran with it; train refuses it. Every bench --seed is
    checked by train's own rule (gradpress.train.config.check_seed), with its message, before any work."""
    module, name = runner.rsplit(".", 1)

    def refused(*args, **kwargs):
        raise AssertionError(f"bench {bench} ran with --seed {seed}")

    monkeypatch.setattr(__import__(module, fromlist=[name]), name, refused)
    rc = main(["bench", bench, "--seed", seed, "--out" if bench != "estimators" else "--json",
               str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == f"gradpress bench {bench}: error: --seed must be an integer from 0 to 4294967295, got {seed}\n"
    train_rc = main(["train", "--seed", seed, "--out", str(tmp_path / "train")])
    assert train_rc == 2
    assert f"seed must be an integer from 0 to 4294967295, got {seed}" in capsys.readouterr().err
