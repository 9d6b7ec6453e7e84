"""The kit's compiled path (torch.compile, Inductor) against its eager path:
the same declaration gives byte-identical packets and decodes either way,
on a tensor of whole chunks and on a ragged one (a short last chunk run by
the same kernel), on the random methods' counter stream. Also the policy:
``GRADPRESS_COMPILE=0`` never compiles, and a kernel whose compilation fails
falls back to eager with one warning.

These are the suite's only compiles (tests/conftest.py sets
GRADPRESS_COMPILE=0 for everything else): a few kernels, with dynamic
shapes, so each compiles once. The methods compared are every registered
kit declaration that compiles a kernel (``kit_compare.kit_methods``, read
from the registry, so a new kit method is covered without editing a list;
the written-out list had left ``stosign`` and deterministic ``minmax8``
out) and two other parameterizations; the declarations that compile
nothing (``kit_compare.UNCOMPILED``: ``topk``) are checked to compile
nothing."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from kit_compare import UNCOMPILED, assert_compiled_matches_eager, kit_methods, same_bytes

from gradpress.compress import Context, create, kit
from gradpress.compress.kit import compiler

#: every kit method that compiles (from the registry) and the other parameterizations that compile other kernels
SPECS = kit_methods() + ["terngrad:clip=0", "minmax8:stochastic=true"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.skipif(not compiler.keeps_eager_numerics("cpu"),
                    reason="this torch's Inductor lacks emulate_precision_casts: 'auto' does not compile on CPU here")
def test_compiled_encode_and_decode_are_byte_identical_to_eager(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "_cache", {})  # whatever other tests compiled before
    before = compiler.compiled_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compile falls back to eager with one: not here
        warnings.simplefilter("error", UserWarning)  # nor a graph break (Dynamo warns where it cannot trace)
        _compare_compiled_with_eager(spec)
    # every kit kernel compiles once per process (dynamic shapes)
    assert compiler.compiled_count() > before, (spec, before)
    assert not compiler._failed


@pytest.mark.parametrize("name", UNCOMPILED)
def test_the_kit_methods_left_out_of_the_comparisons_compile_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kit_compare.UNCOMPILED`` (left out of ``SPECS`` and tests/test_cuda.py's list) holds kit
    declarations that compile no kernel, forced compiled, encode and decode alike."""
    monkeypatch.setattr(compiler, "_cache", {})
    comp = create(name)
    assert isinstance(comp, kit.KitCompressor), name
    x = torch.randn(8192 + 300, generator=torch.Generator().manual_seed(1))
    with compiler.forced("on"):
        comp.decode(comp.encode(x, Context(key="c", step=2, rank=1, world_size=2, seed=3)))
    assert compiler.compiled_count() == 0, name


def _compare_compiled_with_eager(spec: str) -> None:
    for d in (8192, 8192 + 300):  # whole chunks; a ragged tail
        x = torch.randn(d, generator=torch.Generator().manual_seed(d)) * 5
        x[7] = 0.0
        x[11] = -1e-41
        ctx = Context(key="c", step=2, rank=1, world_size=2, seed=3)
        with compiler.forced("off"):
            eager = create(spec)
            pe = eager.encode(x, ctx)
            de = eager.decode(pe)
        with compiler.forced("on"):
            comp = create(spec)
            pc = comp.encode(x, ctx)
            dc = comp.decode(pc)
        if spec == "onebit":  # compiled means: the exact means rounded once (tested below)
            assert same_bytes(pc.tensors[0], _onebit_means(x)), d
        if assert_compiled_matches_eager(spec, pe, pc, x.numel()):
            assert same_bytes(de, dc), (spec, d)


def _shift(v: torch.Tensor, s: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
    return (v * s + 1).to(torch.float16)


@pytest.mark.parametrize("d", [4096, 4096 + 77])
def test_whole_chunks_and_a_short_tail_land_in_one_buffer(d: int) -> None:
    """Compiled, a ragged call writes the whole chunks straight into the
    result (the kernel wrapped to store into a slice of it) and the tail
    after them: the same values and dtype as eager, the wrapper compiled
    only when there is a tail."""

    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    stats = torch.arange(1.0, -(-d // 512) + 1)
    with compiler.forced("off"):
        eager = kit.elementwise(_shift, x, 512, (stats,))
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = kit.elementwise(_shift, x, 512, (stats,))
    assert got.dtype == torch.float16 and same_bytes(got, eager)
    assert compiler.is_compiled(compiler.into(_shift)) is (d % 512 != 0)


def _flat_shift(v: torch.Tensor, s: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    return (v * s * scale).reshape(-1)  # a kernel may return its rows flattened


@pytest.mark.parametrize("mode", ["off", "on"])
def test_ragged_calls_take_any_callable_and_any_result_shape(mode: str) -> None:
    """A kernel given as a ``functools.partial`` (no ``__qualname__``) or
    returning a flat result works on a ragged call, compiled or not; every
    kernel's into-wrapper has a code object of its own (Dynamo's recompile
    limit is per code object)."""
    import functools


    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    stats = torch.arange(1.0, 7.0)
    want = torch.cat([r * s * 2.0 for r, s in zip(x.split(512), stats)])
    with compiler.forced(mode), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(kit.elementwise(functools.partial(_flat_shift, scale=2.0), x, 512, (stats,)), want)
        assert torch.equal(kit.elementwise(_flat_shift, x, 512, (stats,), scale=2.0), want)
    assert compiler.into(_flat_shift).__code__ is not compiler.into(_shift).__code__


def _onebit_means(x: torch.Tensor) -> torch.Tensor:
    """onebit's two means by definition: each side's exact sum (math.fsum
    over float64) over its count (0 for an empty side), rounded once to fp32."""
    v = x.reshape(-1).double()
    out = []
    for side, sign in ((v[v >= 0], 1.0), (v[~(v >= 0)], -1.0)):
        total = math.fsum(side.abs().tolist()) if not torch.isnan(v).any() else math.nan
        out.append(sign * total / max(side.numel(), 1))
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)


def _onebit_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    big = torch.full((20_000,), 3.0e38)
    big[::3] = -3.3e38  # every fp32 side sum overflows (eager rescales; fp64 does not need to)
    lopsided = torch.rand(20_000, generator=g)
    lopsided[17] = -1e30  # one side dominates: (sum +- L1) / 2 would cancel the positive side
    tiny = torch.randn(20_000, generator=g) * 1e-42  # subnormal
    return {"gaussian": torch.randn(50_000, generator=g) * 3, "big": big, "lopsided": lopsided, "tiny": tiny,
            "negative": -torch.rand(20_000, generator=g) - 0.5, "zeros": torch.zeros(20_000),
            "ones_tenth": torch.full((100_000,), 0.1), "fp16": (torch.randn(20_000, generator=g) * 100).half(),
            "bf16": (torch.randn(20_000, generator=g) * 1e30).bfloat16(),
            "odd": torch.randn(20_003, generator=g)}  # bits of the last 3 entries from the eager pack


@pytest.mark.parametrize("name", sorted(_onebit_inputs()))
def test_compiled_onebit_means_are_the_exact_means_rounded_once(name: str) -> None:
    """Compiled, onebit's side sums accumulate in fp64 in one pass: each mean
    is the exact mean rounded to fp32 on every finite input, including sums
    that overflow fp32 and subnormals; its bits and decode are eager's."""
    x = _onebit_inputs()[name]
    ctx = Context(key="w", step=0, rank=0, world_size=1)
    with compiler.forced("on"):
        packet = create("onebit").encode(x, ctx)
    with compiler.forced("off"):
        eager = create("onebit").encode(x, ctx)
    assert same_bytes(packet.tensors[0], _onebit_means(x.float())), (name, packet.tensors[0], _onebit_means(x.float()))
    assert same_bytes(packet.tensors[1], eager.tensors[1])
    decoded = create("onebit").decode(packet)
    assert decoded.dtype == x.dtype and torch.isfinite(decoded).all()
    means = _onebit_means(x.float()).to(x.dtype)
    assert torch.equal(decoded, torch.where(x >= 0, means[0], means[1]))


def test_compiled_onebit_on_nan_and_inf() -> None:
    """NaN (on neither side by comparison) makes both means NaN, as eager;
    an infinity makes its own side's mean infinite and leaves the other the
    exact mean of the rest (eager's other mean is NaN there, from inf - inf
    in its sums): the packet is non-finite either way, for the engine's
    non-finite policy to see."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(2))
    ctx = Context(key="w", step=0, rank=0, world_size=1)
    rest = _onebit_means(torch.cat([x[:123], x[124:]]))
    for bad, want in ((float("nan"), [math.nan, math.nan]), (float("inf"), [math.inf, float(rest[1])]),
                      (-float("inf"), [float(rest[0]), -math.inf])):
        y = x.clone()
        y[123] = bad
        with compiler.forced("on"):
            compiled = create("onebit").encode(y, ctx).tensors[0]
        assert torch.equal(compiled, torch.tensor(want)) or (math.isnan(want[0]) and torch.isnan(compiled).all()), (bad, compiled)


def test_onebit_falls_back_to_eager_sums_when_its_compile_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradpress.compress import onebit

    monkeypatch.setattr(torch, "compile", _broken_compile)
    monkeypatch.setattr(compiler, "_cache", {})
    monkeypatch.setattr(compiler, "_failed", set())
    x = torch.randn(30_000)
    ctx = Context(key="w", step=0, rank=0, world_size=1)
    with compiler.forced("on"), pytest.warns(RuntimeWarning) as seen:
        first = create("onebit").encode(x, ctx)  # the fp64 kernel, run eagerly once
    assert sorted(str(w.message).split("compiling ")[1].split(" ")[0] for w in seen) == ["_nonnegative_bytes", "_side_sums"]
    assert same_bytes(first.tensors[0], _onebit_means(x)) and onebit._side_sums in compiler._failed
    with compiler.forced("on"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # each kernel warned once
        again = create("onebit").encode(x, ctx)  # from now on eager's fp32 sums
    with compiler.forced("off"):
        assert same_bytes(again.tensors[0], create("onebit").encode(x, ctx).tensors[0])


def test_the_pinned_torch_compiles_by_default() -> None:
    """On the torch that `make setup` installs, ``auto`` compiles on CPU and
    CUDA: a renamed Inductor option would otherwise quietly turn the kit
    eager (and skip the identity tests above)."""
    pinned = re.search(r"^TORCH_VERSION \?= (\S+)", (Path(__file__).parents[1] / "Makefile").read_text(), re.M)
    if pinned is None or torch.__version__.split("+")[0] != pinned.group(1):
        pytest.skip(f"torch {torch.__version__} is not the pinned one (make compat runs older releases)")
    assert compiler.keeps_eager_numerics("cpu") and compiler.keeps_eager_numerics("cuda")


def _broken_compile(*a: object, **k: object) -> object:
    """A ``torch.compile`` whose compiled function fails when called (no C++ compiler)."""
    def fn(*x: object, **y: object) -> object:
        raise RuntimeError("no compiler here")
    return fn


def test_policy_off_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADPRESS_COMPILE", "0")
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or (lambda *x, **y: None))

    def k(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v + 1

    out = kit.elementwise(k, torch.zeros(1 << 20), 1 << 20)
    assert not calls and float(out.sum()) == 1 << 20
    monkeypatch.setenv("GRADPRESS_COMPILE", "maybe")
    with pytest.raises(ValueError, match="GRADPRESS_COMPILE got 'maybe'"):
        compiler.mode()


@pytest.mark.parametrize("given", ["Maybe", " YES ", "2"])
def test_a_bad_compile_mode_is_named_as_given_with_every_accepted_value(given: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The error shows the value exactly as set (not lower-cased, not
    stripped) and lists every value the parser accepts: the ones accepted
    here, in any case and with spaces around them."""
    accepted = {"auto": "auto", "": "auto", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off",
                "false": "off"}
    for value, want in accepted.items():
        for spelled in (value, f" {value.upper()} "):
            monkeypatch.setenv("GRADPRESS_COMPILE", spelled)
            assert compiler.mode() == want, spelled
    monkeypatch.setenv("GRADPRESS_COMPILE", given)
    with pytest.raises(ValueError) as info:
        compiler.mode()
    message = str(info.value)
    assert f"GRADPRESS_COMPILE got {given!r};" in message, message
    listed = message.split("allowed", 1)[1]
    for value in accepted:
        assert repr(value) in listed, (value, message)


def test_a_failing_compile_falls_back_to_eager_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", _broken_compile)

    def k2(v: torch.Tensor, *, key: torch.Tensor | None, drawn: torch.Tensor | None) -> torch.Tensor:
        return v * 2

    with compiler.forced("on"), pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = kit.elementwise(k2, torch.ones(10), 10)
    assert torch.equal(out, torch.full((10,), 2.0))
    with compiler.forced("on"):  # no second warning: the kernel stays eager
        assert torch.equal(kit.elementwise(k2, torch.ones(10), 10), torch.full((10,), 2.0))


def test_warns_once_when_inductor_lacks_the_eager_numerics_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel compiled without the options its device needs may differ
    from eager (CUDA: docs/results/cuda-h200.md; CPU on torch 2.2.2): under
    ``on`` the kit says so, once; with them it says nothing."""
    monkeypatch.setattr(compiler, "_warned_numerics", [])
    cpu_only = {"emulate_precision_casts": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiler._warn_missing_numerics(dict.fromkeys(compiler.EAGER_NUMERICS, True), "cuda")
        compiler._warn_missing_numerics(cpu_only, "cpu")
        assert not seen
        compiler._warn_missing_numerics(cpu_only, "cuda")
        compiler._warn_missing_numerics({}, "cpu")
    assert len(seen) == 1 and "eager_numerics.division_rounding" in str(seen[0].message)


def test_auto_compiles_only_where_inductor_keeps_eager_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` compiles a large kernel only where the device's options are
    known (CPU: emulate_precision_casts; CUDA: both); ``on`` still compiles
    (the user asked)."""
    monkeypatch.delenv("GRADPRESS_COMPILE", raising=False)
    big = 1 << 24
    monkeypatch.setattr(compiler, "_known_options", [{}])  # torch 2.2.2: neither
    assert not compiler.compiles(big, "cpu") and not compiler.compiles(big, "cuda")
    with compiler.forced("on"):
        assert compiler.compiles(big, "cpu") and compiler.compiles(big, "cuda")
    monkeypatch.setattr(compiler, "_known_options", [{"emulate_precision_casts": True}])  # torch 2.6.0
    assert compiler.compiles(big, "cpu") and not compiler.compiles(big, "cuda")
    assert not compiler.compiles(compiler.MIN_COMPILE_NUMEL - 1, "cpu")
    monkeypatch.setattr(compiler, "_known_options", [dict.fromkeys(compiler.EAGER_NUMERICS, True)])  # 2.11, 2.13
    assert compiler.compiles(big, "cpu") and compiler.compiles(big, "cuda")
    assert compiler._device_type((3, torch.zeros(1))) == "cpu" and compiler._device_type(()) == "cpu"
