"""The CUDA paths: every compressor, the kit's compiled kernels (Triton), the
counter-based generator, the DDP hook and the algorithms on CUDA tensors.

CI has no GPU, so this module is skipped there (the reason says so); it ran
on the lent H100/H200 machine (docs/results/cuda-h200.md says when, how and what it found).
References are computed here: the same call on CPU (the suite's reference
device), the float64 formula, and for the random methods the CPU run's own
error level (the random bits are identical on both devices, so only the
arithmetic's rounding may differ).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from distributed import run_workers
from kit_compare import assert_compiled_matches_eager, kit_methods, std_reference
from regression import fit, regression_data
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress import algorithms
from gradpress.compress import Context, create, kit, registry
from gradpress.compress.kit import compiler
from gradpress.compress.kit.rng import counter_bits, seed_words

# GRADPRESS_TEST_DEVICE=cpu runs the same module on CPU with gloo (a dry run of the plumbing where no GPU is)
DEVICE = os.environ.get("GRADPRESS_TEST_DEVICE", "cuda")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")

# specs that do real work on 10K elements (a selection at 0.001 keeps 10)
SPECS = {"topk": "topk:ratio=0.05", "randomk": "randomk:ratio=0.05", "dgc": "dgc:ratio=0.05",
         "dgc_threshold": "dgc_threshold:ratio=0.05", "sidco": "sidco:ratio=0.05", "gaussiank": "gaussiank:ratio=0.05",
         "redsync": "redsync:ratio=0.05", "threshold": "threshold:tau=0.5", "powersgd": "powersgd:rank=2,start_iter=0",
         "fft": "fft:theta=0.5"}
KIT = kit_methods() + ["terngrad:clip=0", "minmax8:stochastic=true"]  # from the registry, as test_kit_compile.py


def _spec(name: str) -> str:
    return SPECS.get(name, name)


def _ctx(seed: int = 3) -> Context:
    return Context(key="layer.weight", step=5, rank=1, world_size=4, seed=seed)


def _roundtrip(spec: str, x: torch.Tensor, seed: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    comp = create(spec)
    packet = comp.encode(x, _ctx(seed))
    return list(packet.tensors), comp.decode(packet)


def _input(n: int = 10_007) -> torch.Tensor:
    """Laplace-like heavy tails, as gradients have, with a zero and a denormal."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).log().neg()
    x[3], x[9] = 0.0, -1e-41
    return x.reshape(-1, 7) if n % 7 == 0 else x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------- compressors
@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_compressor_runs_on_cuda_like_on_cpu(name: str, dtype: torch.dtype) -> None:
    """Packets stay on the device, the decode has the input's shape, dtype and
    device and is finite; a method that is deterministic on CPU (two seeds,
    one result) gives the CPU result on CUDA up to rounding, and a random one
    loses no more than on CPU."""
    spec = _spec(name)
    x = _input().to(dtype)
    _, cpu = _roundtrip(spec, x)
    _, cpu_other_seed = _roundtrip(spec, x, seed=4)
    payload, dec = _roundtrip(spec, x.to(DEVICE))
    assert all(t.device.type == DEVICE for t in payload), [t.device for t in payload]
    assert dec.device.type == DEVICE and dec.dtype == dtype and dec.shape == x.shape
    assert bool(torch.isfinite(dec).all())
    dec = dec.cpu()
    if _same(cpu, cpu_other_seed):
        assert _rel(dec, cpu) <= 2e-3, (spec, _rel(dec, cpu))
    else:
        assert _rel(dec, x) <= 1.25 * _rel(cpu, x) + 0.02, (spec, _rel(dec, x), _rel(cpu, x))


def test_counter_bits_are_the_same_on_cuda_and_cpu() -> None:
    """The kit's shared randomness is a pure function of (seed, index): a rank
    on CUDA draws exactly the bits a rank on CPU draws (int32 wrap-around
    multiply on both)."""
    index = torch.arange(1 << 20, dtype=torch.int32)
    for seed in (0, 12345, (1 << 63) - 25):
        cpu = counter_bits(seed_words(seed), index)
        gpu = counter_bits(seed_words(seed, DEVICE), index.to(DEVICE))
        assert torch.equal(gpu.cpu(), cpu), seed


@pytest.mark.parametrize("spec", KIT)
def test_kit_compiled_triton_is_byte_identical_to_eager_on_cuda(spec: str) -> None:
    """Triton's fused kernel against the eager ops on the same device: every
    packet byte and every decoded bit (a whole-chunk and a ragged size)."""
    for d in (1 << 16, (1 << 16) + 300):
        x = (torch.randn(d, generator=torch.Generator().manual_seed(d)) * 5).to(DEVICE)
        x[7], x[11] = 0.0, -1e-41
        with compiler.forced("off"):
            eager = create(spec)
            pe = eager.encode(x, _ctx())
            de = eager.decode(pe)
        with compiler.forced("on"):
            comp = create(spec)
            pc = comp.encode(x, _ctx())
            dc = comp.decode(pc)
        if assert_compiled_matches_eager(spec, pe, pc, x.numel()):
            assert _same(de, dc), (spec, d)


@pytest.mark.parametrize("spec", KIT)
def test_kit_codes_on_cuda_match_cpu(spec: str) -> None:
    """Same random bits on both devices, so the codes (the packet's largest
    field, compared byte by byte) agree except where a scale's last-bit
    rounding moves ``y + u`` across an integer (about 1e-6 per element): at
    least 99.9% of the bytes; the scale fields agree to float32 rounding.
    (The decoded values are not compared exactly: a scale that differs in
    its last bit changes every nonzero value by that much.)"""
    x = _input(1 << 16)
    with compiler.forced("on"):
        cpu = create(spec).encode(x, _ctx()).tensors
        gpu = [t.cpu() for t in create(spec).encode(x.to(DEVICE), _ctx()).tensors]
    sizes = [t.numel() * t.element_size() for t in cpu]
    codes = sizes.index(max(sizes))
    same = (gpu[codes].reshape(-1).view(torch.uint8) == cpu[codes].reshape(-1).view(torch.uint8)).double().mean()
    assert same.item() >= 0.999, (spec, same.item())
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        if i != codes:
            assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=0), (spec, i)


def test_kit_fused_reductions_on_cuda_match_the_references() -> None:
    """Compiled on the device: ``kit.std`` (fp64 sums) is the exact
    deviation rounded once (float64 ``math.fsum`` reference), and
    ``kit.pack_signs`` gives the CPU eager pack's bytes for both masks,
    with a ragged tail, -0.0 and NaN."""
    x = _input((1 << 16) + 5).reshape(-1)
    x[20], x[21] = float("nan"), -float("nan")
    y = x.clone()
    y[20:22] = 0.0
    want = std_reference(y)
    with compiler.forced("on"):
        got = kit.std(y.to(DEVICE), *torch.aminmax(y.to(DEVICE)))
        packed = {mask: kit.pack_signs(x.to(DEVICE), mask).cpu() for mask in ("signbit", "nonnegative")}
    assert float(got) == float(torch.tensor(want, dtype=torch.float64).float()), (float(got), want)
    with compiler.forced("off"):
        for mask, gpu in packed.items():
            assert torch.equal(gpu, kit.pack_signs(x, mask)), mask


# ---------------------------------------------------------------- DDP hook and algorithms
def _device_ids() -> list[int] | None:
    return [torch.cuda.current_device()] if DEVICE == "cuda" else None


def _set_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)


def _model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).to(DEVICE)


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_data(rank, DEVICE)


def _ddp_train(rank: int, spec: str, strategy: str, steps: int = 15) -> dict:
    model = _model()
    ddp = DDP(model, device_ids=_device_ids(), bucket_cap_mb=0.01)
    hook = gradpress.ddp.register(ddp, spec, strategy=strategy, min_numel=64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = _data(rank)
    losses = fit(ddp, opt, x, y, steps)
    hook.close()
    return {"losses": losses, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()}


def _one_backward(rank: int, world: int, spec: str | None) -> dict:
    model = _model()
    ddp = DDP(model, device_ids=_device_ids())
    hook = gradpress.ddp.register(ddp, spec, strategy="collective", min_numel=0) if spec else None
    x, y = _data(rank)
    ((ddp(x) - y) ** 2).mean().backward()
    if hook is not None:
        hook.close()
    return {"grads": [p.grad.detach().cpu() for p in model.parameters()]}


HOOK_CASES = [("topk:ratio=0.05", "collective"), ("qsgd", "collective"), ("powersgd:rank=2,start_iter=2", "collective"),
              ("fp16", "ring"), ("topk:ratio=0.05", "ps"), ("qsgd", "hierarchical"), ("terngrad", "allgather"),
              ("topk:ratio=0.05", "cyclic"), ("topk:ratio=0.05", "union")]


def _nccl_hook_worker(rank: int, world: int) -> dict:
    plain = _one_backward(rank, world, None)["grads"]
    exact = {spec: _one_backward(rank, world, spec)["grads"] for spec in ("none", "fp16", "bf16")}
    trained = {case: _ddp_train(rank, *case) for case in [*HOOK_CASES, ("none", "collective")]}
    return {"plain": plain, "exact": exact, "trained": trained}


@pytest.fixture(scope="module")
def nccl_results() -> dict:
    return run_workers(_nccl_hook_worker, 1, backend=BACKEND)[0]


def test_hook_on_nccl_gives_the_formula(nccl_results: dict) -> None:
    """World of one on NCCL: ``none`` is the plain gradient bit for bit,
    ``fp16``/``bf16`` its rounding to that format (computed here) on every
    matrix; 1-D tensors (biases) are never compressed."""
    plain = nccl_results["plain"]
    assert all(torch.equal(a, b) for a, b in zip(nccl_results["exact"]["none"], plain))
    for spec, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        want = [g.to(dtype).float() if g.dim() > 1 else g for g in plain]
        assert all(torch.equal(a, b) for a, b in zip(nccl_results["exact"][spec], want)), spec


@pytest.mark.parametrize("case", HOOK_CASES, ids=lambda c: f"{c[0]}@{c[1]}")
def test_hook_trains_on_nccl(nccl_results: dict, case: tuple[str, str]) -> None:
    """The loss falls at least half as far as uncompressed training's does."""
    losses = nccl_results["trained"][case]["losses"]
    plain = nccl_results["trained"][("none", "collective")]["losses"]
    assert plain[0] == losses[0] and plain[-1] < 0.8 * plain[0], plain
    assert losses[-1] < losses[0] - 0.5 * (plain[0] - plain[-1]), (losses, plain)


def _gloo_cuda_worker(rank: int, world: int) -> dict:
    """Two ranks sharing one GPU over gloo (NCCL refuses two ranks on one
    device): the hook's collectives on CUDA tensors."""
    _set_device()
    return {case: _ddp_train(rank, *case, steps=8) for case in HOOK_CASES}


def test_hook_two_ranks_gloo_on_cuda_tensors_keeps_replicas_identical() -> None:
    r0, r1 = run_workers(_gloo_cuda_worker, 2)
    for case in HOOK_CASES:
        assert torch.equal(r0[case]["params"], r1[case]["params"]), case
        assert r0[case]["losses"][-1] < r0[case]["losses"][0], (case, r0[case]["losses"])


TWO_HOSTS = [("qsgd", "hierarchical:workers_per_host=2"), ("fp16", "hierarchical:workers_per_host=2,outer=ring")]


def _two_hosts_worker(rank: int, world: int) -> dict:
    """Four ranks as two hosts of two (gloo, one GPU): the intra-host dense
    reduce and broadcast and the leaders' exchange on CUDA tensors."""
    _set_device()
    return {case: _ddp_train(rank, *case, steps=8) for case in TWO_HOSTS}


def test_hierarchical_two_hosts_on_cuda_tensors_keeps_replicas_identical() -> None:
    results = run_workers(_two_hosts_worker, 4)
    for case in TWO_HOSTS:
        assert all(torch.equal(r[case]["params"], results[0][case]["params"]) for r in results), case
        assert results[0][case]["losses"][-1] < results[0][case]["losses"][0], (case, results[0][case]["losses"])


ALGORITHMS = ["localsgd:period=2", "diloco:period=3", "streaming-diloco:period=4,fragments=2", "sgp", "choco", "lsgd",
              "onebit_adam:freeze_step=3", "scaffold:period=3"]


def _algorithm_worker(rank: int, world: int) -> dict:
    _set_device()
    out = {}
    for spec in ALGORITHMS:
        model = _model()
        if rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)  # the algorithm must start every rank from rank 0's weights
        opt = (torch.optim.Adam(model.parameters(), lr=0.01) if "adam" in spec
               else torch.optim.SGD(model.parameters(), lr=0.05))
        algo = algorithms.create(spec, model, opt, compressor="topk:ratio=0.1" if "diloco" in spec else None,
                                 min_numel=64)
        x, y = _data(rank)
        losses = fit(model, opt, x, y, 12, algo.step)
        out[spec] = {"losses": losses, "device": {p.device.type for p in model.parameters()}}
    return out


def test_algorithms_run_on_cuda_tensors() -> None:
    """Each algorithm family on CUDA parameters (two ranks, gloo on one GPU):
    parameters stay on the device and the loss falls."""
    for res in run_workers(_algorithm_worker, 2):
        for spec in ALGORITHMS:
            assert res[spec]["device"] == {DEVICE}, spec
            losses = res[spec]["losses"]
            assert losses[-1] < losses[0], (spec, losses)
