"""The kit's fused paths against references computed here: ``kit.std``
(float64 ``math.fsum`` two-pass formula), ``kit.pack_signs`` (bits laid
out by hand), ``pack_rows``' fused widths (bytes built from the codes by
integer arithmetic), compiled and eager; and that every kit kernel
compiles as one graph (``compiler.run`` compiles with ``fullgraph``, so a
kernel Dynamo cannot trace whole falls back to eager with a warning: in
one session ``math.gcd`` in the packing split every fused pack into a
second, scalar loop, 3x slower, and nothing failed)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from kit_compare import std_reference
from test_compressors import spec_for

from gradpress.compress import Context, create, kit, registry
from gradpress.compress.kit import compiler, primitives


def _std_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    big = (torch.rand(30_000, generator=g) * 2 - 1) * 3e38  # squares overflow fp32: eager needs its scaling
    big[::7] = 3.3e38
    offset = 1000.0 + torch.randn(30_000, generator=g) * 1e-3  # a large mean, a small spread: one pass cancels
    mixed = torch.logspace(-40, 30, 30_000, dtype=torch.float64).float()  # every magnitude 1e-40..1e30
    mixed[::2] *= -1
    one_outlier = torch.zeros(30_000)
    one_outlier[123] = 1.0
    return {"gaussian": torch.randn(50_003, generator=g) * 3, "big": big, "offset": offset,
            "tiny": torch.randn(30_000, generator=g) * 1e-42, "one_outlier": one_outlier, "mixed": mixed,
            "fp16": (torch.randn(30_000, generator=g) * 300).half(), "bf16": (torch.randn(30_000, generator=g) * 1e30).bfloat16()}


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("name", sorted(_std_inputs()))
def test_std_is_the_exact_deviation(name: str, mode: str) -> None:
    """Compiled: the exact population deviation rounded once; eager: within
    a few units in the last place (scaled fp32 passes)."""
    x = _std_inputs()[name]
    lo, hi = torch.aminmax(x)
    with compiler.forced(mode):
        got = kit.std(x, lo, hi)
    want = std_reference(x)
    assert got.dtype == x.dtype and got.shape == ()
    if mode == "on":
        assert float(got) == float(torch.tensor(want, dtype=torch.float64).to(x.dtype)), (name, float(got), want)
    else:
        tiny = 4 * torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps  # a subnormal result's grid
        # fp32: the scaled fp32 passes' accumulation; fp16/bf16: computed in fp32, then rounded once
        tol = 64 * 2.0**-23 if x.dtype == torch.float32 else 2 * torch.finfo(x.dtype).eps
        assert math.isclose(float(got), want, rel_tol=tol, abs_tol=tiny), (name, float(got), want)


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("name", sorted(_std_inputs()))
def test_extremes_give_min_max_and_a_mean_the_exact_std_can_use(name: str, mode: str) -> None:
    """``kit.extremes``: the minimum and maximum (Python's min/max of the
    values), the fp64 mean when compiled (against ``math.fsum``), and
    ``std`` given that mean is still the exact deviation rounded once."""
    x = _std_inputs()[name]
    values = x.double().tolist()
    with compiler.forced(mode):
        lo, hi, mean = kit.extremes(x)
        got = kit.std(x, lo, hi, mean)
    assert lo.dtype == hi.dtype == x.dtype and float(lo) == min(values) and float(hi) == max(values)
    if mode == "off":
        assert mean is None
        return
    assert mean.dtype == torch.float64 and math.isclose(float(mean), math.fsum(values) / len(values), rel_tol=1e-12,
                                                        abs_tol=1e-300)
    assert float(got) == float(torch.tensor(std_reference(x), dtype=torch.float64).to(x.dtype)), (name, float(got))


@pytest.mark.parametrize("mode", ["on", "off"])
def test_extremes_propagate_nan_and_inf(mode: str) -> None:
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(1))
    with compiler.forced(mode):
        x[17] = float("inf")
        lo, hi, _ = kit.extremes(x)
        assert float(hi) == math.inf and math.isfinite(float(lo))
        x[40] = float("nan")
        lo, hi, mean = kit.extremes(x)
        assert math.isnan(float(lo)) and math.isnan(float(hi))
        assert mean is None or math.isnan(float(mean))


@pytest.mark.parametrize("mode", ["on", "off"])
def test_std_of_a_constant_is_zero_and_non_finite_input_stays_non_finite(mode: str) -> None:
    with compiler.forced(mode):
        const = torch.full((40_000,), 0.1)
        assert float(kit.std(const, *torch.aminmax(const))) == 0.0
        for bad in (float("nan"), float("inf")):
            x = torch.randn(40_000)
            x[5] = bad
            assert not torch.isfinite(kit.std(x, *torch.aminmax(x)))


def test_compiled_std_stays_exact_where_eager_drifts() -> None:
    """At 2M entries eager's fp32 accumulation drifts (measured 3.6e-5
    relative); the compiled fp64 passes still give the exact deviation
    rounded once, and eager stays within 1e-4."""
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(3)) * 2 + 5
    lo, hi = torch.aminmax(x)
    want = std_reference(x)
    with compiler.forced("on"):
        assert float(kit.std(x, lo, hi)) == float(torch.tensor(want, dtype=torch.float64).float())
    with compiler.forced("off"):
        assert math.isclose(float(kit.std(x, lo, hi)), want, rel_tol=1e-4)


def _bits_ref(mask: list[bool]) -> list[int]:
    out = [0] * ((len(mask) + 7) // 8)
    for i, m in enumerate(mask):
        out[i // 8] |= int(m) << (i % 8)
    return out


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize(("n", "dtype"), [(40_000, torch.float32), (40_005, torch.float32), (5, torch.float32),
                                          (4_003, torch.float64), (4_008, torch.float16), (4_001, torch.bfloat16)])
def test_pack_signs_lays_out_the_bits(n: int, dtype: torch.dtype, mode: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0], x[1] = -0.0, 0.0
    x[2] = float("nan")
    x[3] = -float("nan")
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    signbit = [b < 0 for b in x.view(as_int).tolist()]  # the sign bit itself, -0.0 and a negative NaN included
    nonneg = [v >= 0 for v in x.tolist()]  # NaN compares false
    with compiler.forced(mode):
        assert kit.pack_signs(x, "signbit").tolist() == _bits_ref(signbit)
        assert kit.pack_signs(x, "nonnegative").tolist() == _bits_ref(nonneg)
        strided = torch.stack([x, -x], dim=1).reshape(-1)[::2]  # x again, as a view of stride 2
        assert kit.pack_signs(strided, "signbit").tolist() == _bits_ref(signbit)
        with pytest.raises(ValueError, match="mask got 'positive'; allowed: signbit, nonnegative"):
            kit.pack_signs(x, "positive")


def _codes_kernel(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, bits: int,
                  fuse: bool) -> torch.Tensor:
    return kit.pack_rows((v * (1 << bits)).floor().to(torch.int32) & ((1 << bits) - 1), bits, fuse)


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("bits", [1, 2, 4, 6])
def test_packing_kernels_give_the_lsb_first_stream(bits: int, mode: str) -> None:
    """A kernel packing its own rows (fused for 1, 2, 4 bits) gives the
    stream built here by integer arithmetic, with a short last chunk."""
    x = torch.rand(64 * 512 + 40, generator=torch.Generator().manual_seed(bits))
    codes = ((x * (1 << bits)).floor().to(torch.int32) & ((1 << bits) - 1)).tolist()
    stream = 0
    for i, c in enumerate(codes):
        stream |= c << (i * bits)
    want = list(stream.to_bytes((len(codes) * bits + 7) // 8, "little"))
    with compiler.forced(mode), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no failed (or partial) compile
        got = kit.elementwise(_codes_kernel, x, 512, pack=bits, fuse_pack=True)  # fused on CPU too
    assert got.tolist() == want


def _kit_specs() -> list[str]:
    """Every registered kit declaration (its small spec), so a method added
    to gradpress/compress/ is compiled here too (this list was written out,
    and a new declaration was left out), and a few other parameterizations."""
    names = [n for n in registry.names() if isinstance(registry.create(spec_for(n)), kit.KitCompressor)]
    return [spec_for(n) for n in names] + ["qsgd", "qsgd:levels=7", "minmax8:stochastic=true"]


@pytest.mark.parametrize("spec", _kit_specs())
def test_every_kit_kernel_compiles_as_one_graph(spec: str) -> None:
    """fullgraph: a graph break is a failed compile, which warns and marks
    the kernel failed; neither may happen for the registered kit methods
    (``topk``, a declaration too, compiles nothing)."""
    x = torch.randn(40_000 + 3, generator=torch.Generator().manual_seed(1))
    ctx = Context(key="k", step=1, rank=0, world_size=2, seed=4)
    comp = create(spec)
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        comp.decode(comp.encode(x, ctx))
    assert not [k for k in compiler._failed if k.__module__.startswith("gradpress")]


def test_pack_rows_refuses_a_width_outside_1_to_24() -> None:
    for bits in (0, 25):
        with pytest.raises(ValueError, match=f"bits got {bits}; allowed: an int in 1..24"):
            kit.pack_rows(torch.zeros(2, 8, dtype=torch.int32), bits, True)


def _scaled(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, word: str) -> torch.Tensor:
    return v * len(word)  # a string: a static parameter Dynamo guards on (floats and ints it makes dynamic)


def test_each_signature_compiles_apart_and_past_its_recompile_limit_only_new_shapes_run_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (kernel, dtypes, static parameters) signature is compiled as a
    code object of its own, so a kernel called with many of them stays
    compiled for all (Dynamo's limit counts per code object); within one
    signature fullgraph makes the limit an exception: that call runs eagerly
    with one warning, the shapes compiled before stay compiled, and the
    kernel is not marked failed."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "recompile_limit", 2)
    torch._dynamo.reset()
    x = torch.randn(20_000)
    before = compiler.compiled_count()
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no signature reaches the limit
        for word in ("ab", "abc", "abcde", "abcdefg"):
            for dtype in (torch.float32, torch.float64):
                assert torch.equal(kit.elementwise(_scaled, x.to(dtype), 1000, word=word), x.to(dtype) * len(word))
    assert compiler.compiled_count() == before + 8 and compiler.is_compiled(_scaled)

    def plain(v: torch.Tensor) -> torch.Tensor:
        return v * 3.0

    shapes = [(20_000,), (200, 100), (20, 10, 100)]  # each rank a graph of its own within one signature
    with compiler.forced("on"):
        for shape in shapes[:2]:
            assert torch.equal(compiler.run(plain, 20_000, x.view(shape)), x.view(shape) * 3.0)
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            assert torch.equal(compiler.run(plain, 20_000, x.view(shapes[2])), x.view(shapes[2]) * 3.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # warned once per kernel
            assert torch.equal(compiler.run(plain, 20_000, x.view(shapes[2])), x.view(shapes[2]) * 3.0)
            assert torch.equal(compiler.run(plain, 20_000, x.view(shapes[0])), x.view(shapes[0]) * 3.0)
    assert plain not in compiler._failed and compiler.compiled_count() == before + 9
    torch._dynamo.reset()


def test_a_kernel_with_a_graph_break_falls_back_to_eager_with_a_warning() -> None:
    """What the check above relies on: a kernel calling something Dynamo
    cannot trace (here ``math.gcd`` on a Python int, as the packing once
    did) fails to compile instead of running as several graphs."""
    def split(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v * float(math.gcd(v.shape[1], 8))

    x = torch.randn(20_000)
    with compiler.forced("on"), pytest.warns(RuntimeWarning, match="compiling .*split failed"):
        out = kit.elementwise(split, x, 1000)
    assert torch.equal(out, x * 8.0) and split in compiler._failed
    compiler._failed.discard(split)
    compiler._INTO.pop(split, None)


def test_whole_tensor_reductions_compile_on_cpu_only_under_auto() -> None:
    """``auto`` keeps the marked whole-tensor reductions eager off CPU (on an
    H200 they ran ten times slower compiled); element-wise kernels compile
    on every device; ``on`` compiles both everywhere."""
    from gradpress.compress import natural, onebit

    n = 1 << 20
    reductions = [onebit._side_sums, primitives._sum64, primitives._deviation_sums, primitives._extremes_sum64,
                  primitives._signbit_bytes,
                  primitives._nonnegative_bytes]
    with compiler.forced("auto"):
        for device in ("cpu", "cuda"):
            elementwise_compiles = compiler.compiles(n, device)
            assert compiler.will_compile(natural._round32, n, device) == elementwise_compiles
            for kernel in reductions:
                assert compiler.will_compile(kernel, n, device) == (elementwise_compiles and device == "cpu"), kernel
    with compiler.forced("on"):
        assert all(compiler.will_compile(k, n, "cuda") for k in reductions)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_natural_fp64_coins_of_every_row_come_from_their_own_counters(mode: str) -> None:
    """``natural`` on fp64 runs in rows of ``TILE`` entries and draws each
    entry's 52 random bits from counters 2i and 2i + 1 of its index i over
    the whole tensor. For 1.25 (mantissa 2^50) the code is 128 when those
    bits are at least 3 * 2^50, else 127: computed here from the counters,
    for a length with a short last row (an offset counted twice collided
    the last row's coins with the middle's)."""
    from gradpress.compress.kit.rng import counter_bits
    from gradpress.compress.natural import TILE

    n = 2 * TILE + 1000
    comp = create("natural")
    ctx = Context(step=3, seed=comp.seed)
    x = torch.full((n,), 1.25, dtype=torch.float64)
    key = comp.randomness(x, ctx)["key"]
    index = torch.arange(n, dtype=torch.int32)
    hi = counter_bits(key, 2 * index).to(torch.int64) & 0xFFFFF
    lo = counter_bits(key, 2 * index + 1).to(torch.int64) & 0xFFFFFFFF
    want = torch.where((hi << 32 | lo) >= 3 << 50, 128, 127).to(torch.uint8)
    with compiler.forced(mode):
        got = comp.fields(comp.encode(x, ctx))["codes"]
    assert torch.equal(got, want)


def test_a_number_handed_to_a_kernel_every_call_does_not_compile_a_variant_per_value() -> None:
    """Numbers are left out of a kernel's signature (Dynamo keeps them
    symbolic): a kernel handed a new int and float on every call, like a
    step counter, stays one compiled variant."""
    def scaled(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None, step: int,
               gain: float) -> torch.Tensor:
        return v * step + gain

    x = torch.randn(20_000)
    before = compiler.compiled_count()
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for step in range(2, 7):
            assert torch.equal(kit.elementwise(scaled, x, 1000, step=step, gain=step / 4), x * step + step / 4)
    assert compiler.compiled_count() == before + 1
