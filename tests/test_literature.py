"""Method-specific invariants of the literature compressors (issue 3): DGC,
SIDCo and its threshold baselines (dgc_threshold, redsync, gaussiank),
AdaComp, (natural) dithering, minmax8, rangefloat and FFT sparsification.

What the density tests assert (see docs/methods.md):

* SIDCo, each distribution, adaptive stages (``stages=0``, the paper's
  configuration): after 10 calls (two adaptation windows) the mean
  achieved/target density of the next 5 calls is within +-25%, on Laplace,
  Gaussian and real MLP weight gradients, at 0.1, 0.01 and 0.001. Single-stage
  fits cannot do this on Gaussian data (exponential selects ~0 at 0.001, a
  single GP fit ~7x), which is why the adaptive configuration is asserted.
* dgc_threshold: the running ``quality`` within +-25% (a single call at
  delta = 0.001 rests on ~10 sampled order statistics and scatters by ~30%).
* redsync: its own contract, every call in [1, upper) (default upper = 2 as
  in the paper), and +-25% with ``upper=1.25``.
* gaussiank: +-25% on Gaussian data (its model); on heavy-tailed data the
  x0.5/x1.5 corrections are too coarse (real gradients at 0.001 give ~10x),
  so there we assert its own contract: the result is in [2k/3, 4k/3] or all
  3 corrections were spent.

These density tests pin ``correction=none``: they assert the published
estimators. The corrected defaults (``correction=adaptive``, issue 14) are
asserted against the issue's bounds in tests/test_estimators.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.compress import Context, create
from gradpress.compress.adacomp import auto_bin_size
from gradpress.compress.dgc import dgc_select, optimizer_for, warmup_ratio
from gradpress.compress.dithering import variance_bound
from gradpress.compress.fft import kept_coefficients
from gradpress.compress.rangefloat import relative_error_bound
from gradpress.compress.sidco import gamma_upper_inv, initial_stages, max_stages
from gradpress.compress.sparse import kept_count
from gradpress.transport import wire

RATIOS = (0.1, 0.01, 0.001)


# ----------------------------------------------------------------------------- data
_CACHE: dict[str, list[torch.Tensor]] = {}


def _synthetic(kind: str, ratio: float) -> list[torch.Tensor]:
    d = 1_000_000 if ratio < 0.005 else 100_000
    key = f"{kind}-{d}"
    if key not in _CACHE:
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(3):
            if kind == "gauss":
                out.append(torch.randn(d, generator=gen))
            else:
                u = torch.rand(d, generator=gen) - 0.5
                out.append(-torch.sign(u) * torch.log1p(-2 * u.abs()))  # Laplace(0, 1)
        _CACHE[key] = out
    return _CACHE[key]


def _model_gradients() -> list[torch.Tensor]:
    """Weight gradients of the 512x512 layer of a small MLP trained for a
    few steps on scikit-learn's bundled digits (no download)."""
    if "model" not in _CACHE:
        from sklearn.datasets import load_digits

        torch.manual_seed(0)
        x_np, y_np = load_digits(return_X_y=True)
        x = torch.tensor(x_np, dtype=torch.float32) / 16.0
        y = torch.tensor(y_np)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grads = []
        for step in range(8):
            idx = torch.randint(0, len(x), (64,))
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            if step >= 3:
                grads.append(model[2].weight.grad.detach().clone())
            opt.step()
        _CACHE["model"] = grads
    return _CACHE["model"]


def _data(kind: str, ratio: float) -> list[torch.Tensor]:
    return _model_gradients() if kind == "model" else _synthetic(kind, ratio)


def _run(spec: str, ratio: float, kind: str, calls: int) -> tuple[object, list[float]]:
    comp = create(spec, ratio=ratio)
    data = _data(kind, ratio)
    qs = []
    for i in range(calls):
        packet = comp.encode(data[i % len(data)], Context(key="w", step=i, seed=3))
        qs.append(comp.last_quality)
        # the quality figure is the kept count over the target count
        assert packet.tensors[1].numel() == pytest.approx(qs[-1] * kept_count(data[0].numel(), ratio))
    # the running figure is the mean of the per-call figures, also in state
    assert comp.quality == pytest.approx(sum(qs) / len(qs))
    assert comp.state_dict()["quality"]["mean"] == pytest.approx(comp.quality)
    assert comp.quality_calls == calls
    return comp, qs


# ----------------------------------------------------------------------------- SIDCo
def test_gamma_upper_inverse_matches_scipy() -> None:
    special = pytest.importorskip("scipy.special")
    shapes = torch.tensor([0.1, 0.5, 1.0, 3.0, 50.0], dtype=torch.float64)
    for q in (0.25, 1e-2, 1e-3, 1e-5):
        got = gamma_upper_inv(shapes, torch.full_like(shapes, q))
        want = torch.tensor([special.gammainccinv(float(a), q) for a in shapes], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-8), (q, got, want)


def test_sidco_closed_forms() -> None:
    # exponential data, exponential fit, one stage: the threshold is -mu ln(delta)
    x = torch.distributions.Exponential(torch.tensor(2.0)).sample((200_000,))
    comp = create("sidco:ratio=0.01,dist=exp,stages=1,correction=none")
    comp.encode(x, Context(key="e"))
    assert comp.last_quality == pytest.approx(1.0, abs=0.1)
    for dist in ("gpareto", "gamma"):
        comp = create(f"sidco:ratio=0.01,dist={dist},stages=1,correction=none")
        comp.encode(x, Context(key="e"))
        assert comp.last_quality == pytest.approx(1.0, abs=0.15), dist


@pytest.mark.parametrize("kind", ["laplace", "gauss", "model"])
@pytest.mark.parametrize("dist", ["exp", "gpareto", "gamma"])
def test_sidco_adaptive_density_within_25_percent(dist: str, kind: str) -> None:
    for ratio in RATIOS:
        comp, qs = _run(f"sidco:dist={dist},correction=none", ratio, kind, calls=10)
        late = sum(qs[5:]) / 5
        assert 0.75 <= late <= 1.25, (dist, kind, ratio, qs, comp.current_stages("w"))
        assert 1 <= comp.current_stages("w") <= max_stages(ratio)


def test_sidco_single_stage_exponential_misses_on_gaussian_data() -> None:
    # why the adaptive configuration is the one asserted above
    comp = create("sidco:ratio=0.001,dist=exp,stages=1,correction=none")
    comp.encode(_synthetic("gauss", 0.001)[0], Context(key="g"))
    assert comp.last_quality < 0.1


def test_sidco_stage_adaptation_rule() -> None:
    comp = create("sidco:ratio=0.001")
    start = initial_stages(0.001)
    assert comp.current_stages("k") == start == 5
    assert max_stages(0.001) == 10 and max_stages(0.3) == 1
    for _ in range(4):
        comp._adapt("k", 2.0)
    assert comp.current_stages("k") == start  # only every 5 calls
    comp._adapt("k", 2.0)
    assert comp.current_stages("k") == start - 1  # too many -> one stage less
    for _ in range(10):
        comp._adapt("k", 0.5)
    assert comp.current_stages("k") == start + 1  # too few -> one more, twice
    for _ in range(100):
        comp._adapt("k", 0.1)
    assert comp.current_stages("k") == max_stages(0.001)
    for _ in range(100):
        comp._adapt("k", 9.0)
    assert comp.current_stages("k") == 1
    for _ in range(5):
        comp._adapt("k", 1.0)  # within [0.8, 1.2]: unchanged
    assert comp.current_stages("k") == 1
    other = create("sidco:ratio=0.001")
    other.load_state_dict(comp.state_dict())
    assert other.current_stages("k") == 1 and other.current_stages("new") == start
    fixed = create("sidco:ratio=0.001,stages=3")
    fixed.encode(torch.randn(10_000), Context(key="k"))
    assert fixed.current_stages("k") == 3


def test_sidco_ignores_exact_zeros() -> None:
    x = torch.distributions.Laplace(0.0, 1.0).sample((200_000,))
    x[::2] = 0.0  # half the entries are exact zeros (dead units)
    comp = create("sidco:ratio=0.01,dist=exp,stages=1,correction=none")
    packet = comp.encode(x, Context(key="z"))
    assert 0.75 <= comp.last_quality <= 1.25
    assert bool((packet.tensors[0] != 0).all())


# ----------------------------------------------------------------------------- baselines
@pytest.mark.parametrize("kind", ["laplace", "gauss", "model"])
def test_dgc_threshold_running_quality(kind: str) -> None:
    for ratio in RATIOS:
        comp, _ = _run("dgc_threshold:correction=none", ratio, kind, calls=12)
        assert 0.75 <= comp.quality <= 1.25, (kind, ratio, comp.quality)


@pytest.mark.parametrize("kind", ["laplace", "gauss", "model"])
def test_redsync_window(kind: str) -> None:
    for ratio in RATIOS:
        _, qs = _run("redsync:correction=none", ratio, kind, calls=3)
        assert all(1.0 <= q < 2.0 for q in qs), (kind, ratio, qs)
        _, qs = _run("redsync:upper=1.25,correction=none", ratio, kind, calls=3)
        assert all(1.0 <= q < 1.25 for q in qs), (kind, ratio, qs)


@pytest.mark.parametrize("kind", ["laplace", "gauss", "model"])
def test_gaussiank(kind: str) -> None:
    for ratio in RATIOS:
        comp, qs = _run("gaussiank:correction=none", ratio, kind, calls=3)
        if kind == "gauss":
            assert all(0.75 <= q <= 1.25 for q in qs), (ratio, qs)
        else:
            # the method's own contract: in its band, or all corrections spent
            assert 2 / 3 <= qs[-1] <= 4 / 3 or comp.last_adjustments == 3, (kind, ratio, qs)


def test_threshold_packets_and_edge_cases() -> None:
    for spec in ("sidco:dist=gamma", "dgc_threshold", "redsync", "gaussiank", "dgc"):
        comp = create(spec, ratio=0.01)
        x = torch.randn(5000)
        packet = comp.encode(x, Context(key="p"))
        values, idx = packet.tensors
        assert idx.dtype == torch.int32 and values.dtype == x.dtype
        assert torch.equal(values, x[idx.long()])
        out = comp.decode(packet)
        assert torch.equal(out[idx.long()], values)
        # everything sent is at least as large as everything not sent
        rest = torch.ones(5000, dtype=torch.bool)
        rest[idx.long()] = False
        if spec != "dgc":
            assert values.abs().min() >= x[rest].abs().max()
        for edge in (torch.zeros(0), torch.tensor(2.5), torch.zeros(100), torch.tensor([1.0])):
            y = comp.decode(comp.encode(edge, Context(key="edge" + str(edge.numel()))))
            assert y.shape == edge.shape
            if edge.numel() == 1 and spec != "dgc":
                assert torch.equal(y, edge)


# ----------------------------------------------------------------------------- DGC
def test_dgc_warmup_schedule() -> None:
    expected = [0.001 ** ((e + 1) / 5) for e in range(4)] + [0.001, 0.001]
    assert [warmup_ratio(0.001, 4, e) for e in range(6)] == pytest.approx(expected)
    assert expected[:5] == pytest.approx([0.25, 0.0625, 0.015625, 0.0039, 0.001], rel=0.05)
    comp = create("dgc:ratio=0.001,warmup_epochs=4,steps_per_epoch=10")
    x = torch.randn(100_000)
    for epoch, ratio in enumerate(expected):
        comp.encode(x, Context(key=f"w{epoch}", step=10 * epoch + 3))
        assert comp.last_info["ratio"] == pytest.approx(ratio)
        assert comp.last_info["k"] == kept_count(100_000, ratio)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        create("dgc:warmup_epochs=2")


def test_dgc_sampled_selection_lands_in_band() -> None:
    paths = []
    for kind in ("laplace", "gauss"):
        for x in _synthetic(kind, 0.01):
            for seed in range(4):
                a = x.abs()
                k = kept_count(x.numel(), 0.01)
                idx, info = dgc_select(a, k, 0.01, 0.01, seed)
                paths.append(info["path"])
                if info["path"] == "sampled":
                    assert 0.8 * k <= info["pre_fallback_count"] <= 1.3 * k
                    assert idx.numel() == info["pre_fallback_count"]
                else:
                    assert idx.numel() == k
                assert 0.8 * k <= idx.numel() <= 1.3 * k
    # the sampled estimate alone is good enough in most calls
    assert paths.count("sampled") >= 0.7 * len(paths), paths


def test_dgc_exact_paths() -> None:
    k = 1000
    # ties everywhere: the sampled threshold keeps everything -> exact top-k among them
    idx, info = dgc_select(torch.ones(100_000), k, 0.01, 0.01, 0)
    assert info["path"] == "exact_among_selected" and info["pre_fallback_count"] == 100_000
    assert idx.numel() == k
    # 500 nonzeros the sample can't see: lowering never helps -> exact fallback
    a = torch.zeros(100_000)
    a[torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:500]] = 1.0
    idx, info = dgc_select(a, k, 0.01, 0.01, 0)
    assert info["path"] == "fallback" and info["pre_fallback_count"] == 500 and info["passes"] == 10
    assert idx.numel() == k and float(a[idx].sum()) == 500


def test_dgc_momentum_correction_and_masking() -> None:
    gen = torch.Generator().manual_seed(1)
    m = 0.9
    comp = create(f"dgc:ratio=0.01,momentum={m}")
    u = torch.zeros(2000)
    v = torch.zeros(2000)
    sent_total = torch.zeros(2000)
    grads_total = torch.zeros(2000)
    for step in range(6):
        g = torch.randn(2000, generator=gen)
        packet = comp.encode(g, Context(key="m", step=step))
        u = m * u + g
        v = v + u
        idx = packet.tensors[1].long()
        assert torch.allclose(packet.tensors[0], v[idx])
        # the largest |v| is always sent
        assert int(v.abs().argmax()) in set(idx.tolist())
        u[idx] = 0.0
        v[idx] = 0.0
        assert torch.allclose(comp.momentums["m"], u) and torch.allclose(comp.velocities["m"], v)
        sent_total += comp.decode(packet)
        grads_total += g
    # with momentum 0 nothing is lost: sent + velocity == sum of gradients
    plain = create("dgc:ratio=0.01,momentum=0")
    sent = torch.zeros(2000)
    total = torch.zeros(2000)
    for step in range(5):
        g = torch.randn(2000, generator=gen)
        total += g
        sent += plain.decode(plain.encode(g, Context(key="p", step=step)))
    assert torch.allclose(sent + plain.velocities["p"], total, atol=1e-5)
    assert comp.default_error_feedback is False
    opt = optimizer_for([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0


def test_dgc_clipping_nan_and_state() -> None:
    g = torch.full((400,), 0.5)  # norm 10
    comp = create("dgc:ratio=0.0025,momentum=0,clip=1.0")
    comp.encode(g, Context(key="c", world_size=4))
    # clipped to 1 * sqrt(4) before accumulation (the mean of 4 such is bounded by 1); one entry sent, the rest kept
    assert float(torch.linalg.vector_norm(comp.velocities["c"])) == pytest.approx(2.0 * math.sqrt(399 / 400), rel=1e-4)
    before = {k: v.clone() for k, v in comp.state_dict()["velocities"].items()}
    bad = g.clone()
    bad[3] = float("nan")
    out = comp.decode(comp.encode(bad, Context(key="c", world_size=4)))
    assert torch.isnan(out).any()  # the caller sees the bad value
    assert torch.equal(comp.velocities["c"], before["c"])  # memory untouched
    # checkpoint: a restored copy continues identically
    twin = create("dgc:ratio=0.0025,momentum=0,clip=1.0")
    twin.load_state_dict(comp.state_dict())
    x = torch.randn(400)
    assert torch.equal(comp.decode(comp.encode(x, Context(key="c", step=5))), twin.decode(twin.encode(x, Context(key="c", step=5))))
    assert twin.quality == comp.quality


# ----------------------------------------------------------------------------- AdaComp
def test_adacomp_sends_what_the_rule_says() -> None:
    gen = torch.Generator().manual_seed(2)
    comp = create("adacomp:bin_size=10")
    residue = torch.zeros(95)
    for step in range(4):
        dw = torch.randn(95, generator=gen)
        packet = comp.encode(dw, Context(key="a", step=step))
        g = residue + dw
        h = g + dw
        padded = torch.cat([g.abs(), torch.zeros(5)]).view(10, 10).amax(1).repeat_interleave(10)[:95]
        want = torch.nonzero((h.abs() >= padded) & (g != 0)).reshape(-1)
        idx = packet.tensors[2].long()
        assert torch.equal(torch.sort(idx).values, want)
        scale = g[want].abs().mean()
        assert float(packet.tensors[0]) == pytest.approx(float(scale))
        out = comp.decode(packet)
        assert torch.allclose(out[want], torch.sign(g[want]) * scale)
        assert int((out != 0).sum()) == want.numel()
        residue = g.clone()
        residue[want] -= out[want]
        assert torch.allclose(comp.residues["a"], residue, atol=1e-6)
    assert packet.nbytes == 4 + (want.numel() + 7) // 8 + 4 * want.numel()
    assert auto_bin_size(torch.Size([8, 3, 3, 3])) == 50 and auto_bin_size(torch.Size([64, 64])) == 500
    # auto bins: every nonzero bin of a conv tensor sends its maximum on the first call
    conv = torch.randn(4, 5, 5, 4)  # 400 elements = 8 bins of 50
    sent = create("adacomp").encode(conv, Context(key="c")).tensors[2].long()
    assert set((sent // 50).tolist()) == set(range(8))
    assert create("adacomp").default_error_feedback is False


# ----------------------------------------------------------------------------- dithering
def _draws(spec: str, x: torch.Tensor, n: int) -> torch.Tensor:
    comp = create(spec)
    return torch.stack([comp.decode(comp.encode(x, Context(key="d", step=i, seed=5))) for i in range(n)])


def _assert_mean_close(draws: torch.Tensor, x: torch.Tensor) -> None:
    """Mean over draws within 5 standard errors of x (plus float rounding,
    for entries that are deterministic: the p = inf maximum, a chunk's min)."""
    se = draws.std(0) / math.sqrt(draws.shape[0])
    excess = (draws.mean(0) - x).abs() - 5 * se - 1e-5 * (1 + x.abs())
    assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("spec", ["dithering:levels=4", "dithering:levels=4,natural=true", "dithering:levels=3,p=inf,natural=true"])
def test_dithering_unbiased(spec: str) -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    draws = _draws(spec, x, 3000)
    _assert_mean_close(draws, x)
    assert not torch.equal(draws[0], draws[1])  # fresh randomness per step
    assert create(spec).is_unbiased


def test_natural_dithering_variance_bound() -> None:
    # Horvath et al. 2019: omega = 1/8 + min(sqrt(d)/2^(s-1), d/2^(2(s-1))) for p = 2
    d, s = 64, 8
    omega = variance_bound(d, s, 2.0, natural=True)
    assert omega == pytest.approx(1 / 8 + min(math.sqrt(d) / 2 ** (s - 1), d / 2 ** (2 * (s - 1))))
    x = torch.randn(d, generator=torch.Generator().manual_seed(4))
    draws = _draws(f"dithering:levels={s},natural=true", x, 1000)
    ratio = float(((draws - x) ** 2).sum(1).mean() / (x**2).sum())
    assert 0 < ratio <= omega, (ratio, omega)
    std = _draws("dithering:levels=4", x, 1000)
    ratio_std = float(((std - x) ** 2).sum(1).mean() / (x**2).sum())
    assert ratio_std <= variance_bound(d, 4, 2.0, natural=False)


def test_dithering_levels_and_wire() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0 / 128])  # p = inf: y are exact natural levels
    comp = create("dithering:levels=8,p=inf,natural=true")
    assert torch.equal(comp.decode(comp.encode(x)), x)
    packet = create("dithering:levels=8").encode(torch.randn(1000))
    assert packet.nbytes == 4 + 125 + 500  # norm + 1 sign bit + 4 level bits each
    assert str(create("dithering:p=inf").p) == "inf"
    with pytest.raises(ValueError, match="'p'"):
        create("dithering:p=0.5")
    # second stage of a composition, also across the wire
    comp = create("topk:ratio=0.01>dithering")
    x = torch.randn(10_000)
    packet = comp.encode(x, Context(key="t"))
    remote = wire.unpack_packets(wire.pack_packets([packet], comp.variable_size), [packet], comp.variable_size)[0]
    assert torch.equal(comp.decode(remote), comp.decode(packet))
    assert int((comp.decode(packet) != 0).sum()) <= 100


# ----------------------------------------------------------------------------- minmax8
def test_minmax8() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6))
    comp = create("minmax8:chunk=512")
    packet = comp.encode(x)
    assert packet.nbytes == 5000 + 8 * 10
    out = comp.decode(packet)
    lo, hi = packet.tensors[0], packet.tensors[1]
    step = ((hi - lo) / 255).repeat_interleave(512)[:5000]
    assert bool(((out - x).abs() <= step / 2 + 1e-6).all())
    assert not comp.is_unbiased and comp.default_error_feedback
    const = torch.full((700,), 3.25)
    assert torch.equal(comp.decode(comp.encode(const)), const)
    stoch = create("minmax8:chunk=64,stochastic=true")
    assert stoch.is_unbiased and not stoch.default_error_feedback
    small = x[:64]
    draws = _draws("minmax8:chunk=64,stochastic=true", small, 2000)
    _assert_mean_close(draws, small)


# ----------------------------------------------------------------------------- rangefloat
@pytest.mark.parametrize("bits", [4, 8, 12])
def test_rangefloat_relative_error(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    comp = create(f"rangefloat:bits={bits}")
    for octaves in (1, 3, 6):
        mags = torch.exp2(torch.rand(4000, generator=gen) * octaves - 5)
        x = torch.where(torch.rand(4000, generator=gen) < 0.5, -mags, mags)
        for with_zeros in (False, True):
            y = x.clone()
            if with_zeros:
                y[::9] = 0.0
            packet = comp.encode(y)
            e_max, e, z = packet.tensors[0].tolist()
            nz = y != 0
            ex = torch.frexp(y[nz].abs())[1] - 1
            span = int(ex.max() - ex.min()) + 1
            want_e = math.ceil(math.log2(span + int(with_zeros))) if span + int(with_zeros) > 1 else 0
            if want_e <= bits - 1:
                assert e == want_e and e_max == int(ex.max()) and z == int(with_zeros)
                out = comp.decode(packet)
                assert torch.equal(out[~nz], y[~nz])
                err = ((out - y).abs()[nz] / y.abs()[nz]).max()
                assert float(err) <= relative_error_bound(bits, e), (bits, octaves, float(err))
                assert torch.equal(torch.sign(out), torch.sign(y))
            assert packet.nbytes == 12 + math.ceil(4000 * bits / 8)


def test_rangefloat_wide_range_flushes_small_values() -> None:
    comp = create("rangefloat:bits=4")
    x = torch.tensor([1.0, 2.0**-20, 3.0, -0.75])
    packet = comp.encode(x)
    assert packet.tensors[0].tolist()[1:] == [3, 1]  # capped at bits-1 exponent bits, zero code in use
    out = comp.decode(packet)
    assert float(out[1]) == 0.0
    assert float(out[0]) == 1.0 and float(out[3]) == pytest.approx(-0.75, rel=0.5)


# ----------------------------------------------------------------------------- FFT
def test_fft_theta_zero_reconstructs_and_energy_monotone() -> None:
    x = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(8))
    out = create("fft:theta=0").decode(create("fft:theta=0").encode(x))
    assert torch.allclose(out, x, atol=1e-5)
    energies = []
    for theta in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
        comp = create(f"fft:theta={theta}")
        packet = comp.encode(x)
        assert packet.tensors[1].numel() == 2 * kept_coefficients(231 // 2 + 1, theta)
        energies.append(float((comp.decode(packet) ** 2).sum()))
    assert all(a >= b - 1e-6 for a, b in zip(energies, energies[1:]))
    assert energies[0] == pytest.approx(float((x**2).sum()), rel=1e-5) and energies[-1] < energies[0]


def test_fft_schedule_and_composition() -> None:
    comp = create("fft:theta=0.9,schedule=linear,theta_end=0.5,decay_steps=100")
    assert [comp.theta_at(s) for s in (0, 50, 100, 1000)] == pytest.approx([0.9, 0.7, 0.5, 0.5])
    x = torch.randn(1000)
    sizes = [comp.encode(x, Context(key="f", step=s)).tensors[1].numel() for s in (0, 50, 100)]
    assert sizes == [2 * kept_coefficients(501, t) for t in (0.9, 0.7, 0.5)]
    with pytest.raises(ValueError, match="theta_end"):
        create("fft:theta=0.5,schedule=linear,theta_end=0.6")
    # fft>rangefloat: the paper's pipeline, also across the wire
    plain = create("fft:theta=0.5")
    piped = create("fft:theta=0.5>rangefloat:bits=12")
    packet = piped.encode(x, Context(key="f"))
    remote = wire.unpack_packets(wire.pack_packets([packet], piped.variable_size), [packet], piped.variable_size)[0]
    ref = plain.decode(plain.encode(x))
    got = piped.decode(remote)
    assert float((got - ref).norm() / ref.norm()) < 0.05
    assert packet.nbytes < plain.encode(x).nbytes
    for dtype in (torch.float16, torch.bfloat16):
        y = piped.decode(piped.encode(x.to(dtype)))
        assert y.dtype == dtype and y.shape == x.shape


def _fit64(dist: str, y: torch.Tensor, r: float) -> float:
    """eta with P(Y > eta) = r for ``dist`` fitted to y by the paper's
    moment (exp, gpareto) and log-moment (gamma, Minka's shape) estimates."""
    special = pytest.importorskip("scipy.special")
    mu = float(y.mean())
    var = max(float((y * y).mean()) - mu * mu, 0.0)
    if dist == "exp" or (dist == "gpareto" and var == 0.0):
        return -mu * math.log(r)
    if dist == "gpareto":
        ratio = mu * mu / var
        xi, alpha = 0.5 * (1.0 - ratio), 0.5 * mu * (ratio + 1.0)
        return -alpha * math.log(r) if abs(xi) < 1e-8 else alpha * (r ** -xi - 1.0) / xi
    s = max(math.log(mu) - float(torch.log(y).mean()), 1e-12)
    shape = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    return mu / shape * float(special.gammainccinv(shape, r))


def _sidco64(x: torch.Tensor, ratio: float, dist: str, stages: int) -> tuple[float, list[int]]:
    """SIDCo's multi-stage threshold in float64 (Abdelmoniem et al. 2021,
    Alg. 1): stage 1 fits the nonzero |x| at density 0.25 (rescaled to the
    nonzero count), every later stage the exceedances over the running
    threshold, shifted by it, at density (ratio / 0.25)^(1/(M-1)); a gamma
    fit's later stages fit the generalized Pareto law (peaks over a
    threshold). Returns the threshold and each stage's sample size."""
    a = x.double().abs()
    m = min(stages, 1 if ratio >= 0.25 else math.ceil(math.log(ratio) / math.log(0.5)))
    per = (ratio / 0.25) ** (1.0 / (m - 1)) if m > 1 else ratio
    thr, rest, sizes = 0.0, a, []
    for i in range(m):
        if i == 0:
            y = a[a != 0]
            r = min(1.0, (0.25 if m > 1 else ratio) * a.numel() / max(y.numel(), 1))
            law = dist
        else:
            rest = rest[rest > thr]
            y = (rest - thr)[rest - thr != 0]
            r, law = per, ("gpareto" if dist == "gamma" else dist)
        sizes.append(y.numel())
        eta = _fit64(law, y, r) if y.numel() else 0.0
        thr += max(eta, 0.0) if math.isfinite(eta) else 0.0
    return thr, sizes


@pytest.mark.parametrize("dist", ["exp", "gpareto", "gamma"])
@pytest.mark.parametrize("d, ratio, stages", [(20_000, 0.01, 3), (20_000, 0.001, 10), (40, 0.01, 7)])
def test_sidco_threshold_is_the_multistage_fit(dist: str, d: int, ratio: float, stages: int) -> None:
    """Every stage of ``sidco_threshold`` against the float64 reference above,
    on Laplace data (small enough that the strided sample is all of |x|);
    the 40-entry case reaches stages with a single exceedance."""
    from gradpress.compress.sidco import sidco_threshold

    u = torch.rand(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.5
    x = (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()  # Laplace(0, 1) by its inverse CDF
    want, sizes = _sidco64(x, ratio, dist, stages)
    if d == 40:
        assert 1 in sizes, sizes  # the one-exceedance stage is exercised
    got = sidco_threshold(x.abs(), ratio, dist, stages, x)
    assert float(got) == pytest.approx(want, rel=1e-4), (sizes, float(got), want)
    if dist != "gamma":  # fitted on the sample of x alone
        assert float(sidco_threshold(None, ratio, dist, stages, x)) == pytest.approx(want, rel=1e-4)


def test_redsync_warm_start_finds_the_band_in_one_probe_on_the_same_data() -> None:
    """RedSync remembers where in [mean, max] the threshold landed (relative
    to the mean); on the same data again its warm start probes there first
    and is in the band at once, where a cold bisection needs several."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4)) ** 3  # heavy-tailed
    comp = create("redsync:ratio=0.001")
    comp.encode(x, Context(key="w"))
    cold = comp.last_steps
    comp.encode(x, Context(key="w"))
    assert cold > 1 and comp.last_steps == 1, (cold, comp.last_steps)
    fresh = create("redsync:ratio=0.001,correction=none")
    fresh.encode(x, Context(key="w"))
    fresh.encode(x, Context(key="w"))
    assert fresh.last_steps > 1  # without the adaptive correction nothing is remembered: it bisects again
