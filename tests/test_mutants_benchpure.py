"""The bench inputs, the compressor sweep and the shared argument parsers,
pinned where the other bench tests do not reach: written for survivors of
``make mutants`` (``benchpure`` group: bench/{data, compressors_sweep,
args}.py; the commands' parts, plan.py, strategies.py, e2e_jobs.py, are in
test_mutants_benchpure_commands.py). Every expected value is computed here
(float64, by the definition: the Laplace inverse CDF and the laws' moments,
the largest divisor by brute force, bytes read + written over the best time,
a topk reference's encode time over a method's) or is the documented target
or message, never the code's output. One process, the measurements faked: about 2 s.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.bench import args as bench_args
from gradpress.bench import compressors_sweep, data

pytestmark = pytest.mark.mutants


# ---------------------------------------------------------------- data.py

def test_laplace_is_the_inverse_cdf_of_its_uniform_and_finite_where_the_uniform_is_0(monkeypatch):
    """``laplace``: x = -sign(u) ln(1 - 2|u|), u = U[0, 1) - 1/2 (module docstring). ``torch.rand`` returns
    exactly 0 about once in 2^24 draws (a 100M-element input holds several): u = -1/2 there, whose inverse CDF
    is -inf; the draw must stay finite (clamped just inside the open interval)."""
    uniform = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0 - 2.0**-24], dtype=torch.float32)
    calls = []

    def rand(n, generator=None):
        calls.append((n, generator))
        return uniform.clone()

    monkeypatch.setattr(torch, "rand", rand)
    x = data.make_input("laplace", uniform.numel(), seed=5)
    assert calls and calls[0][0] == uniform.numel() and isinstance(calls[0][1], torch.Generator)
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all()), x
    # the ends of the uniform: moved inside the open interval by about 1e-7 (a float32 step either way),
    # so |x| = ln(1 / (1 - 2|u|)) stays near ln(1 / 2e-7) = 15.4 instead of reaching infinity
    for end, sign in ((0, -1.0), (-1, 1.0)):
        assert float(x[end]) * sign > 0 and 15.0 < abs(float(x[end])) < -math.log(2 * 2.0**-25) + 1e-3, x
    for u0, got in zip(uniform.tolist()[1:-1], x.tolist()[1:-1]):
        u = u0 - 0.5
        want = -math.copysign(1.0, u) * math.log(1.0 - 2.0 * abs(u)) if u != 0 else 0.0
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (u0, got, want)


def test_gaussian_and_laplace_follow_their_laws_and_each_seed_its_own_draws():
    """gaussian: N(0, 1) (variance 1, kurtosis 3); laplace: Laplace(0, 1) (variance 2, kurtosis 6); the same
    (kind, numel, seed) gives the same tensor, another seed another one."""
    n = 200_000

    def moments(t: torch.Tensor) -> tuple[float, float, float]:
        v = t.double()
        m = float(v.mean())
        var = float(((v - m) ** 2).mean())
        return m, var, float(((v - m) ** 4).mean()) / var**2

    for kind, variance, kurtosis in (("gaussian", 1.0, 3.0), ("laplace", 2.0, 6.0)):
        kind = "".join(list(kind))  # a string built at run time, as argparse hands it over: not the literal
        x = data.make_input(kind, n, seed=3)
        assert x.shape == (n,) and x.dtype == torch.float32
        m, var, kurt = moments(x)
        assert abs(m) < 5 * math.sqrt(variance / n), (kind, m)
        assert var == pytest.approx(variance, rel=0.03), (kind, var)
        assert kurt == pytest.approx(kurtosis, rel=0.1), (kind, kurt)
        assert torch.equal(x, data.make_input(kind, n, seed=3))
        assert not torch.equal(x, data.make_input(kind, n, seed=4))


@pytest.mark.parametrize("numel", [0, -1])
def test_make_input_refuses_an_empty_size_and_an_unknown_kind_naming_them(numel):
    with pytest.raises(ValueError, match=rf"^numel got {numel}; allowed: a positive integer$"):
        data.make_input("gaussian", numel)
    with pytest.raises(ValueError, match=r"^--data got 'uniform'; allowed: gaussian, laplace, captured$"):
        data.make_input("uniform", 10)
    assert data.make_input("gaussian", 1).shape == (1,)


def test_captured_input_shorter_than_the_capture_is_its_start_and_a_copy(monkeypatch):
    """Shorter than the capture: its first ``numel`` values; longer: the capture tiled. The returned
    tensor is the caller's: writing into it leaves the capture (kept for the next call) and the next input
    unchanged (the docstring's invariant that a test can rebuild exactly the tensor a row was measured
    on). The capture is a stand-in, one tensor handed out on every call as the cache does."""
    kept = torch.arange(5000, dtype=torch.float32)
    base = kept.clone()
    seeds = []
    monkeypatch.setattr(data, "captured_gradients", lambda seed=0: seeds.append(seed) or kept)
    a = data.make_input("captured", 1000, seed=4)
    assert torch.equal(a, base[:1000]) and seeds == [4]
    a.fill_(7.0)
    assert torch.equal(kept, base) and torch.equal(data.make_input("captured", 1000), base[:1000])
    whole = data.make_input("captured", 5000)
    whole.fill_(7.0)
    assert torch.equal(kept, base)
    for n in (10_000, 12_345):
        x = data.make_input("captured", n)
        want = torch.cat([base] * (n // 5000 + 1))[:n]
        assert torch.equal(x, want)
        x.fill_(7.0)
        assert torch.equal(kept, base)


def test_captured_gradients_hold_every_parameters_gradient_of_each_step():
    """64-512-512-10 MLP: 64 x 512 + 512 + 512 x 512 + 512 + 512 x 10 + 10 gradient values per step."""
    per_step = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    one = data.captured_gradients(steps=1, seed=1)
    assert one.numel() == per_step and one.dtype == torch.float32
    assert not torch.equal(one, data.captured_gradients(steps=1, seed=2)[:per_step])


def test_captured_gradients_are_three_sgd_momentum_steps_of_the_mlp_by_hand():
    """The documented capture: the MLP torch builds under ``manual_seed(seed)``, batches of 128 drawn
    from a generator seeded with ``seed``, pixels scaled to [0, 1] (/16), each step's cross-entropy
    gradient, then SGD with momentum 0.9 (v = 0.9 v + g) and lr 0.05 (p -= 0.05 v); recomputed here in
    float64 over three steps (the third is the first that the momentum reaches)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    xs = torch.tensor(digits.data, dtype=torch.float64) / 16.0
    ys = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
    params = [p.detach().double() for p in model.parameters()]
    velocity = [torch.zeros_like(p) for p in params]
    want = []
    for _ in range(3):
        batch = torch.randint(0, xs.shape[0], (128,), generator=gen)
        w = [p.clone().requires_grad_(True) for p in params]
        h = torch.relu(xs[batch] @ w[0].T + w[1])
        h = torch.relu(h @ w[2].T + w[3])
        loss = torch.nn.functional.cross_entropy(h @ w[4].T + w[5], ys[batch])
        grads = torch.autograd.grad(loss, w)
        want.append(torch.cat([g.reshape(-1) for g in grads]))
        for p, v, g in zip(params, velocity, grads):
            v.mul_(0.9).add_(g)
            p.sub_(0.05 * v)
    got = data.captured_gradients(steps=3, seed=2).double()
    per_step = want[0].numel()
    assert got.numel() == 3 * per_step
    for step in range(3):
        diff = (got[step * per_step:(step + 1) * per_step] - want[step]).abs().max()
        assert float(diff) <= 1e-4 * float(want[step].abs().max()), (step, float(diff))


@pytest.mark.parametrize(("numel", "max_cols"), [(64000, 1024), (1021, 1024), (2053, 1024), (12, 1024),
                                                 (4096, 1024), (1_000_000, 1024), (360, 7), (17, 16), (1, 1024)])
def test_matrix_shape_takes_the_largest_divisor_up_to_max_cols(numel, max_cols):
    want = max(c for c in range(1, min(numel, max_cols) + 1) if numel % c == 0)  # by brute force
    assert data.matrix_shape(numel, max_cols) == (numel // want, want)


# ---------------------------------------------------------------- compressors_sweep.py

class _Clock:
    """A stand-in ``time`` module: each timed copy takes the next duration; records the thread count."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.now = 100.0
        self.calls = 0
        self.threads: list[int] = []
        self.started = False

    def perf_counter(self) -> float:
        self.calls += 1
        self.threads.append(torch.get_num_threads())
        if self.started:
            self.now += self.durations.pop(0)
        else:
            self.now += 1000.0  # time between two runs: never counted
        self.started = not self.started
        return self.now


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_roofline_is_bytes_read_and_written_over_the_best_run(monkeypatch, dtype):
    durations = [0.004, 0.002, 0.003, 0.0025]
    clock = _Clock(durations)
    monkeypatch.setattr(compressors_sweep, "time", clock)
    x = torch.ones(1000, dtype=dtype)
    before = torch.get_num_threads()
    gbps = compressors_sweep.best_copy_gbps(x, runs=len(durations), threads=1)
    size = torch.tensor([], dtype=dtype).element_size()
    assert gbps == pytest.approx(2.0 * 1000 * size / min(durations) / 1e9, rel=1e-12)
    assert clock.calls == 2 * len(durations) and clock.durations == []
    assert set(clock.threads) == {1} and torch.get_num_threads() == before


def _fake_row(spec, numel, encode_s, density=None, name=None, kind="method", variant="default"):
    return {"compressor": spec if variant == "default" else f"{spec} [{variant}]", "name": name or spec.split(":")[0],
            "kind": kind, "numel": numel, "variant": variant, "density_target": density, "encode_s": encode_s,
            "encode_gbps": 4.0 * numel / encode_s / 1e9 if encode_s else math.inf, "speedup_vs_topk": None, "ratio": 2.0,
            "roofline_gbps": 10.0, "encode_roofline_fraction": 0.5, "peak_temp_ratio": 1.0}


def test_sweep_gives_each_method_its_speedup_over_topk_at_its_density_and_skips_what_fails(monkeypatch):
    """Per size: the method rows, then a ``topk`` and a ``kthvalue`` reference per selection density;
    a method's ``speedup_vs_topk`` is the topk reference's encode time over its own (the references get
    none); a method that cannot run (``_Skip``) or fails is listed as skipped with the reason."""
    from gradpress.bench.compressors_rows import _Skip

    encode = {"dgc:ratio=0.01": 0.002, "sidco:ratio=0.1": 0.0, "fp16": 0.001}
    ref_s = {("topk", 0.01): 0.008, ("kthvalue", 0.01): 0.004, ("topk", 0.1): 0.003, ("kthvalue", 0.1): 0.005}
    density = {"dgc:ratio=0.01": 0.01, "sidco:ratio=0.1": 0.1, "fp16": None}

    def method(spec, x, data_kind, roof, repeats, warmup, variant):
        if spec == "nope":
            raise _Skip("needs a matrix")
        if spec == "broken":
            raise RuntimeError("boom")
        return _fake_row(spec, x.numel(), encode[spec], density[spec])

    def reference(kind, d, x, data_kind, roof, repeats, warmup):
        return _fake_row(f"ref:{kind}@{d:g}", x.numel(), ref_s[(kind, d)], d, name=kind, kind="reference")

    monkeypatch.setattr(compressors_sweep, "bench_method", method)
    monkeypatch.setattr(compressors_sweep, "bench_reference", reference)
    monkeypatch.setattr(compressors_sweep, "best_copy_gbps", lambda x, runs, threads=None: 10.0)
    logged = []
    result = compressors_sweep.run_benchmark(["dgc:ratio=0.01", "nope", "sidco:ratio=0.1", "broken", "fp16"], [300],
                                             log=logged.append)
    rows = result["rows"]
    assert [r["compressor"] for r in rows] == ["dgc:ratio=0.01", "sidco:ratio=0.1", "fp16", "ref:topk@0.01",
                                               "ref:kthvalue@0.01", "ref:topk@0.1", "ref:kthvalue@0.1"]
    got = {r["compressor"]: r["speedup_vs_topk"] for r in rows}
    assert got["dgc:ratio=0.01"] == pytest.approx(0.008 / 0.002)
    assert got["sidco:ratio=0.1"] == math.inf  # an encode too fast to time
    assert got["fp16"] is None  # no density: nothing to compare with
    assert all(got[r["compressor"]] is None for r in rows if r["kind"] == "reference")
    assert result["skipped"] == [
        {"compressor": "nope", "numel": 300, "reason": "needs a matrix", "variant": "default"},
        {"compressor": "broken", "numel": 300, "reason": "RuntimeError: boom", "variant": "default"}]
    assert any("skip nope [default]: needs a matrix" in line for line in logged)
    assert any("skip broken [default]: RuntimeError: boom" in line for line in logged)
    assert result["env"]["threads"] == torch.get_num_threads()


def test_sweep_rooflines_are_the_best_of_max_10_or_twice_the_repeats_runs_at_1_all_and_the_rows_threads(monkeypatch):
    """Per size, four copy rooflines (docstring): one thread, ``all_threads``, and the rows' thread count
    (None: the current setting) before and after the rows, each the best of max(10, 2 x repeats) runs.
    Without ``repeats``/``warmup`` the methods get the command's documented defaults: 5 timed runs after 1."""
    measured, methods = [], []
    monkeypatch.setattr(compressors_sweep, "best_copy_gbps",
                        lambda x, runs, threads=None: measured.append((x.numel(), runs, threads)) or 10.0)
    monkeypatch.setattr(compressors_sweep, "bench_method",
                        lambda spec, x, d, roof, repeats, warmup, variant: methods.append((repeats, warmup))
                        or _fake_row(spec, x.numel(), 0.001))
    for repeats, runs in ((3, 10), (5, 10), (6, 12), (8, 16)):
        measured.clear()
        compressors_sweep.run_benchmark(["fp16"], [100, 200], repeats=repeats, all_threads=3)
        assert measured == [(n, runs, t) for n in (100, 200) for t in (1, 3, None, None)], (repeats, measured)
    methods.clear()
    compressors_sweep.run_benchmark(["fp16"], [100])
    assert methods == [(5, 1)]


def test_targets_are_checked_on_the_rows_they_apply_to():
    """The documented targets: a quantizer's encode >= 25% of the copy roofline, a threshold selector
    >= 3x faster than exact top-k, peak temporaries <= 3x the input (every method row), and a kit
    declaration's encode not slower than its hand-written version. The references and the ``hand`` and
    ``eager`` variants are not held to the first three."""
    rows = [
        {**_fake_row("qsgd:levels=4", 10, 1.0, variant="hand"), "encode_gbps": 8.0, "encode_roofline_fraction": 0.2,
         "peak_temp_ratio": 9.0},
        {**_fake_row("qsgd:levels=4", 10, 1.0), "encode_gbps": 6.0, "encode_roofline_fraction": 0.25,
         "peak_temp_ratio": 3.0},
        {**_fake_row("qsgd:levels=4", 10, 1.0, variant="compiled"), "encode_gbps": 10.0,
         "encode_roofline_fraction": 0.3, "peak_temp_ratio": 3.5},
        {**_fake_row("dgc:ratio=0.01", 10, 1.0), "speedup_vs_topk": 4.0, "peak_temp_ratio": 0.5},
        {**_fake_row("sidco:ratio=0.01", 10, 1.0), "speedup_vs_topk": 3.0},
        {**_fake_row("dgc_threshold:ratio=0.01", 10, 1.0), "speedup_vs_topk": 2.9},
        {**_fake_row("gaussiank:ratio=0.01", 10, 1.0), "speedup_vs_topk": 0.5},
        _fake_row("ref:topk@0.01", 10, 1.0, name="topk", kind="reference"),
    ]
    targets = compressors_sweep.evaluate_targets(rows)
    got = {(t["compressor"], t["target"]): (t["value"], t["threshold"], t["met"]) for t in targets}
    kit = "kit encode not slower than the hand-written version"
    quant, select, peak = ("quantizer encode >= 25% of copy roofline",
                           "threshold selection >= 3x faster than exact top-k", "peak temporaries <= 3x input")
    assert got == {
        ("qsgd:levels=4", kit): (6.0 / 8.0, 1.0, False),
        ("qsgd:levels=4", quant): (0.25, 0.25, True),
        ("qsgd:levels=4", peak): (3.0, 3.0, True),
        ("qsgd:levels=4 [compiled]", kit): (10.0 / 8.0, 1.0, True),
        ("qsgd:levels=4 [compiled]", quant): (0.3, 0.25, True),
        ("qsgd:levels=4 [compiled]", peak): (3.5, 3.0, False),
        ("dgc:ratio=0.01", select): (4.0, 3.0, True),
        ("dgc:ratio=0.01", peak): (0.5, 3.0, True),
        ("sidco:ratio=0.01", select): (3.0, 3.0, True),
        ("sidco:ratio=0.01", peak): (1.0, 3.0, True),
        ("dgc_threshold:ratio=0.01", select): (2.9, 3.0, False),
        ("dgc_threshold:ratio=0.01", peak): (1.0, 3.0, True),
        ("gaussiank:ratio=0.01", peak): (1.0, 3.0, True),
    }
    assert all(isinstance(t["met"], bool) for t in targets)


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                            ("always madvise [never]", "never"), ("never\n", "never"), (None, "")])
def test_transparent_hugepage_is_the_bracketed_mode(monkeypatch, text, mode):
    opened = []

    def fake_open(path, *a, **k):
        opened.append(path)
        if text is None:
            raise PermissionError(path)
        import io
        return io.StringIO(text)

    monkeypatch.setattr(compressors_sweep, "open", fake_open, raising=False)
    assert compressors_sweep.transparent_hugepage() == mode
    assert opened == ["/sys/kernel/mm/transparent_hugepage/enabled"]


# ---------------------------------------------------------------- args.py

def test_positive_int_accepts_integers_from_1_and_names_the_flag_otherwise():
    import argparse

    parse = bench_args.positive_int("--steps")
    assert parse("1") == 1 and parse("12") == 12 and parse(" 3 ") == 3
    for text, shown in (("0", "0"), ("-2", "-2"), ("x", "'x'"), ("1.5", "'1.5'"), ("", "''")):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            parse(text)
        assert str(err.value) == f"--steps got {shown}; allowed: an integer >= 1"


def test_check_threads_returns_the_usable_cores_and_refuses_more(monkeypatch):
    monkeypatch.setattr(bench_args, "usable_cpus", lambda: 4)
    assert bench_args.check_threads(None) == 4 and bench_args.check_threads(4) == 4 and bench_args.check_threads(1) == 4
    with pytest.raises(ValueError) as err:
        bench_args.check_threads(5, "--threads-per-worker")
    assert str(err.value) == ("--threads-per-worker got 5; allowed: an integer >= 1 and <= 4 "
                              "(the cores this process may use)")


def test_check_file_path_accepts_a_new_file_in_a_writable_directory_and_creates_nothing(tmp_path):
    bench_args.check_file_path(tmp_path / "out.json", "--json")
    bench_args.check_file_path(str(tmp_path / "out.json"), "--json")
    (tmp_path / "old.json").write_text("x")
    bench_args.check_file_path(tmp_path / "old.json", "--json")  # an existing file is overwritten later
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    with pytest.raises(ValueError, match=r"^--json got '.*', which is a directory; allowed: a file path$"):
        bench_args.check_file_path(tmp_path, "--json")
    with pytest.raises(ValueError, match=r"^--json: directory '.*missing' does not exist$"):
        bench_args.check_file_path(tmp_path / "missing" / "o.json", "--json")
    with pytest.raises(ValueError, match=r"^--json got '.*old.json.o.json': '.*old.json' is a file, not a directory$"):
        bench_args.check_file_path(tmp_path / "old.json" / "o.json", "--json")
