"""Decoding into a caller's buffer (``Compressor.decode_into``) and the
rank-order fold of packets decoded that way (``aggregate_packets``).

``decode_into`` must give ``decode``'s bits exactly, for every registered
compressor, dtype and size (the whole-chunk and short-tail paths, eager and
compiled); natural's decoder, rewritten as one kernel for it, is checked
against the code's definition computed here in float64. ``aggregate_packets``
must equal the fold of fresh decodes bit for bit and the float64 mean to
rounding. The allgather strategy writes the average into the engine's
output, which is the input gradient itself: a payload that *is* that
gradient (``none`` without error feedback) must not be overwritten before
it is read (3 gloo workers, against the float64 mean).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

from gradpress.compress import Context, create, names
from gradpress.compress.kit import compiler
from gradpress.exchange import get_strategy
from gradpress.exchange.base import aggregate, aggregate_packets

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZES = (0, 1, 7, 1000, 4099)
#: every registered name at its defaults, and the parameter settings that take another decode path
SPECS = [*names(), "efsignsgd:chunk=0", "efsignsgd:chunk=64", "qsgd:bucket=0", "qsgd:levels=1000",
         "minmax8:stochastic=true"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaN payloads and signed zeros compared too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _input(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + n)) * 3
    if n > 3:
        x[1] = 0.0
        x[2] = -0.0
    return x.to(dtype)


def _packet(spec: str, x: torch.Tensor, rank: int = 0):
    comp = create(spec)
    try:
        return comp, comp.encode(x, Context(key="w", step=2, rank=rank, world_size=3))
    except (ValueError, TypeError) as exc:  # a method that refuses this dtype or size says so
        pytest.skip(f"{spec} refuses {x.dtype} x {x.numel()}: {exc}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_decode_into_gives_decodes_bits(spec: str, dtype: torch.dtype) -> None:
    for n in SIZES:
        comp, pk = _packet(spec, _input(n, dtype), 0)
        want = comp.decode(pk)
        out = torch.full(pk.shape, float("nan"), dtype=pk.dtype)
        got = comp.decode_into(pk, out)
        assert got is out, spec
        assert torch.equal(_bits(out), _bits(want)), (spec, dtype, n)


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:bucket=0", "minmax8", "natural", "terngrad", "onebit", "fp16"])
def test_decode_into_compiled_whole_chunks_and_tail(spec: str) -> None:
    """Sizes above the compile threshold, with a short last chunk and without."""
    for n in (compiler.MIN_COMPILE_NUMEL * 4 + 3, compiler.MIN_COMPILE_NUMEL * 4):
        comp, pk = _packet(spec, _input(n, torch.float32), 1)
        out = torch.full((n,), float("nan"))
        with compiler.forced("on"):
            want = comp.decode(pk)
            comp.decode_into(pk, out)
        with compiler.forced("off"):
            eager = comp.decode(pk)
        assert torch.equal(_bits(out), _bits(want)), (spec, n)
        assert torch.equal(_bits(out), _bits(eager)), (spec, n)


@pytest.mark.parametrize("layout", ["words", "offset", "strided", "bytes"])
@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_natural_decode_is_the_signed_power_of_two_of_its_code(mode: str, dtype: torch.dtype, layout: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Code c, sign bit s (bit j of byte i for entry 8i + j): (-1)^s 2^(c - 127),
    code 0 a (signed) zero, 255 an infinity; computed here in float64. The
    sign field read as int64 words (``words``), from a received buffer at
    an odd byte offset (``offset``), and as bytes (``bytes``: the
    big-endian path, taken here by pretending)."""
    if layout == "bytes":
        monkeypatch.setattr("gradpress.compress.natural.sys.byteorder", "big")
    for n in (70001, 70016) if mode == "on" else (1003, 1024):  # 70016 and 1024: whole 8-byte sign words
        _check_natural(n, dtype, layout, mode)


def _check_natural(n: int, dtype: torch.dtype, layout: str, mode: str) -> None:
    x = _input(n, dtype, 5)
    x[5] = float("inf")
    comp, pk = _packet("natural", x)
    if layout == "offset":  # the payload inside a received buffer, 3 bytes in
        buf = torch.zeros(3 + pk.nbytes, dtype=torch.uint8)
        pos, tensors = 3, []
        for t in pk.tensors:
            buf[pos: pos + t.numel()] = t
            tensors.append(buf[pos: pos + t.numel()])
            pos += t.numel()
        pk.tensors = tensors
    if layout == "strided":  # outside the packet contract (1-D contiguous payloads), decoded all the same
        signs = pk.tensors[1]
        wide = torch.zeros(2 * signs.numel(), dtype=torch.uint8)
        wide[::2] = signs
        pk.tensors = [pk.tensors[0], wide[::2]]
    codes, signs = comp.fields(pk)["codes"], comp.fields(pk)["signs"]
    sign_bits = (signs.to(torch.int64).repeat_interleave(8) >> torch.arange(8).repeat(signs.numel())) & 1
    c = codes.to(torch.float64)
    mag = torch.where(codes == 255, torch.full_like(c, float("inf")), torch.exp2(c - 127))
    mag = torch.where(codes == 0, torch.zeros_like(c), mag)
    ref = torch.where(sign_bits[:n] == 1, -mag, mag).to(torch.float32).to(dtype)
    with compiler.forced(mode):
        got = comp.decode(pk)
        out = torch.empty(n, dtype=dtype)
        comp.decode_into(pk, out)
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("bad", ["size", "dtype", "strided"])
def test_decode_into_refuses_a_buffer_that_does_not_fit(bad: str) -> None:
    for spec in ("qsgd", "fp16", "topk:ratio=0.1"):
        comp, pk = _packet(spec, _input(64, torch.float32))
        out = {"size": torch.empty(63), "dtype": torch.empty(64, dtype=torch.float64),
               "strided": torch.empty(128)[::2]}[bad]
        with pytest.raises(ValueError, match="allowed: a contiguous tensor of 64 entries of torch.float32"):
            comp.decode_into(pk, out)


@pytest.mark.parametrize("spec", ["qsgd", "natural", "terngrad", "onebit", "minmax8", "fp16", "signsgd",
                                  "topk:ratio=0.1", "randomk:ratio=0.2"])
def test_aggregate_packets_is_the_rank_order_fold(spec: str) -> None:
    n, world = 5003, 3
    comp = create(spec)
    packets = [comp.encode(_input(n, torch.float32, 11 * r), Context(key="w", step=1, rank=r, world_size=world))
               for r in range(world)]
    decoded = [comp.decode(p) for p in packets]
    fold = aggregate(comp, [d.clone() for d in decoded], world)
    out, scratch = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    got = aggregate_packets(comp, packets, world, out, scratch)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(_bits(got), _bits(fold))
    assert torch.equal(_bits(aggregate_packets(comp, packets, world)), _bits(fold))  # its own buffers
    ref = torch.stack([d.to(torch.float64) for d in decoded]).sum(0)
    ref = torch.sign(ref) if comp.aggregation == "majority" else ref / world
    torch.testing.assert_close(got.to(torch.float64), ref, rtol=1e-6, atol=1e-6)


def _allgather_into_inputs(rank: int, world: int) -> dict:
    """The engine hands the strategy its input gradients as ``out``."""
    strat = get_strategy("allgather", None)
    results = {}
    for spec in ("none", "fp16", "qsgd"):
        comp = create(spec)
        ts = [_input(n, torch.float32, 100 * r + n) for r, n in ((rank, 1000), (rank, 37))]
        ts.append(_input(96, torch.float32, 100 * rank + 5).view(8, 12))  # shaped: the scratch buffer is flat
        ts.append(_input(24, torch.float32, 100 * rank + 6).view(2, 12)[:, ::2])  # not contiguous: no output
        mine = [t.clone() for t in ts]
        ctxs = [Context(key=f"t{i}", step=1, rank=rank, world_size=world) for i in range(len(ts))]
        res = strat.exchange(comp, ts, ctxs, None, out=ts)
        results[spec] = {"avg": [t.clone() for t in res.tensors], "mine": mine,
                         "into_out": [a.data_ptr() == t.data_ptr() for a, t in zip(res.tensors[:3], ts)]}
    return results


def test_allgather_average_written_into_the_inputs_is_exact() -> None:
    world = 3
    res = run_workers(_allgather_into_inputs, world)
    for spec in ("none", "fp16", "qsgd"):
        for i in range(4):
            avg0 = res[0][spec]["avg"][i]
            for r in range(world):
                assert torch.equal(_bits(res[r][spec]["avg"][i]), _bits(avg0)), (spec, r)  # replicas identical
        assert all(all(r[spec]["into_out"]) for r in res) == (spec != "none"), spec
    for i in range(4):  # none is lossless: the float64 mean of the ranks' own tensors
        exact = torch.stack([res[r]["none"]["mine"][i].to(torch.float64) for r in range(world)]).mean(0)
        torch.testing.assert_close(res[0]["none"]["avg"][i].to(torch.float64), exact, rtol=1e-6, atol=1e-6)
        fp16 = torch.stack([res[r]["fp16"]["mine"][i].half().to(torch.float64) for r in range(world)]).mean(0)
        torch.testing.assert_close(res[0]["fp16"]["avg"][i].to(torch.float64), fp16, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_residual_is_the_input_minus_its_decode(spec: str, dtype: torch.dtype) -> None:
    """What error feedback keeps, ``p - decode(packet)``, computed in float64
    here (exact for these dtypes' differences up to one rounding); the
    packet is unchanged by it, even where it is the input itself (``none``)."""
    for n in (1, 1000):
        x = _input(n, dtype, 3)
        comp, pk = _packet(spec, x)
        sent = [t.clone() for t in pk.tensors]
        want = (x.to(torch.float64) - comp.decode(pk).to(torch.float64)).to(dtype)
        got = comp.residual(x.clone() if spec != "none" else x, pk)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(want)) or torch.equal(got, want), (spec, dtype, n)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(pk.tensors, sent)), (spec, "packet changed")


def test_residual_of_a_tensor_that_requires_grad_is_not_taken_in_place() -> None:
    """A leaf that requires grad cannot be changed in place: the residual is then a new tensor."""
    x = _input(1000, torch.float32, 9).requires_grad_()
    comp, pk = _packet("qsgd", x.detach())
    got = comp.residual(x, pk)
    want = x.detach().to(torch.float64) - comp.decode(pk).to(torch.float64)
    torch.testing.assert_close(got.detach().to(torch.float64), want, rtol=0, atol=1e-6)
