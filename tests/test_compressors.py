"""The compressor contract, for every registered compressor, plus the
method-specific invariants of the foundation compressors.

The generic part is parametrized over ``gradpress.compressors.names()`` so a
method added later is covered automatically; ``SMALL_SPECS`` gives specs that
are meaningful on tiny tensors where the defaults are not.
"""

from __future__ import annotations

import math

import pytest
import torch
from references import kept, topk_support

from gradpress.compress import Compressor, Context, Packet, Param
from gradpress.compress.spec import parse_stage
from gradpress.compressors import create, get_class, names
from gradpress.transport import wire

NAMES = names()

#: specs meaningful on tiny inputs; any other name is used bare
SMALL_SPECS = {
    "topk": "topk:ratio=0.3",
    "randomk": "randomk:ratio=0.3",
    "threshold": "threshold:tau=0.5",
    "qsgd": "qsgd:levels=4,bucket=8",
    "powersgd": "powersgd:rank=1,start_iter=0",
}

#: the methods whose exact wire size this file knows (issue 2 and the core)
FOUNDATION = {
    "none", "fp16", "bf16", "topk", "randomk", "threshold", "qsgd", "terngrad",
    "signsgd", "signum", "efsignsgd", "onebit", "natural",
}

SHAPES = [(), (0,), (1,), (7,), (3, 5), (64, 33)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def spec_for(name: str) -> str:
    return SMALL_SPECS.get(name, name)


def make(name: str) -> Compressor:
    comp = create(spec_for(name))
    comp.seed = 1234
    return comp


def ctx_for(key: str, step: int = 3, rank: int = 0, world_size: int = 1) -> Context:
    return Context(key=key, step=step, rank=rank, world_size=world_size, seed=1234)


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def expected_nbytes(comp: Compressor, x: torch.Tensor) -> int | None:
    """The wire size each foundation method documents, written independently."""
    d, es = x.numel(), x.element_size()
    name = comp.name
    if name == "none":
        return d * es
    if name in ("fp16", "bf16"):
        return 2 * d
    if name == "topk":
        return kept(d, comp.ratio) * (es + 4)
    if name == "randomk":
        return kept(d, comp.ratio) * es
    if name == "threshold":
        return int((x.to(torch.float64).abs() > comp.tau).sum()) * (es + 4)
    if name == "qsgd":
        b = comp.bucket if comp.bucket > 0 else max(d, 1)
        bits = math.ceil(math.log2(comp.levels + 1)) + 1
        return 4 * math.ceil(d / b) + math.ceil(d * bits / 8)
    if name == "terngrad":
        return 4 + math.ceil(d / 4)
    if name in ("signsgd", "signum"):
        return math.ceil(d / 8)
    if name == "efsignsgd":
        return 4 + math.ceil(d / 8)
    if name == "onebit":
        return 8 + math.ceil(d / 8)
    if name == "natural":
        return d + math.ceil(d / 8)
    return None


def through_wire(comp: Compressor, packet: Packet, template: Packet) -> Packet:
    """``packet`` as another rank rebuilds it from one flat buffer, using its
    own ``template`` packet for the same tensor (meta copied from it)."""
    variable = bool(comp.variable_size)
    buf = wire.pack_packets([packet], variable)
    header = 4 * len(packet.tensors) if variable else 0
    assert buf.numel() == packet.nbytes + header
    rebuilt = wire.unpack_packets(buf, [template], variable)[0]
    rebuilt.meta = dict(template.meta)
    return rebuilt


# --------------------------------------------------------------------------- generic contract


def test_foundation_methods_registered() -> None:
    assert FOUNDATION <= set(NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_shape_dtype_bytes(name: str, dtype: torch.dtype) -> None:
    comp = make(name)
    for i, shape in enumerate(SHAPES):
        x = sample(shape, dtype, seed=i)
        ctx = ctx_for(f"t{i}")
        packet = comp.encode(x, ctx)
        assert packet.shape == x.shape and packet.dtype == x.dtype
        for t in packet.tensors:
            assert t.dim() == 1 and t.is_contiguous(), (name, shape, t.shape)
        assert packet.nbytes == sum(t.numel() * t.element_size() for t in packet.tensors)
        want = expected_nbytes(comp, x)
        if name in FOUNDATION:
            assert packet.nbytes == want, (name, shape, dtype, packet.nbytes, want)
            if not comp.variable_size:
                assert comp.wire_bytes(x.numel(), x.dtype) == want, (name, shape, dtype)
        out = comp.decode(packet)
        assert out.shape == x.shape and out.dtype == x.dtype, (name, shape)
        assert torch.isfinite(out.double()).all(), (name, shape)
        assert torch.equal(comp.decode(packet), out), "decode must be deterministic"


@pytest.mark.parametrize("name", [n for n in NAMES if not get_class(n).variable_size])
def test_fixed_size_does_not_depend_on_data(name: str) -> None:
    comp = make(name)
    a = comp.encode(sample((64, 33), torch.float32, 1), ctx_for("a"))
    b = comp.encode(sample((64, 33), torch.float32, 2) * 100, ctx_for("b"))
    assert [t.numel() for t in a.tensors] == [t.numel() for t in b.tensors]
    assert a.nbytes == b.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_packets_survive_the_wire(name: str, dtype: torch.dtype) -> None:
    for i, shape in enumerate(SHAPES):
        comp = make(name)
        key = f"w{i}"
        x = sample(shape, dtype, seed=10 + i)
        packet = comp.encode(x, ctx_for(key, rank=1))
        # this rank's own packet for the same tensor (other data, same step and key)
        mine = make(name)
        template = mine.encode(sample(shape, dtype, seed=20 + i), ctx_for(key, rank=0))
        rebuilt = through_wire(comp, packet, template)
        assert torch.equal(comp.decode(rebuilt), comp.decode(packet)), (name, shape)


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input(name: str) -> None:
    cases = [
        sample((5, 3), torch.float32, 3).t(),  # 2-D transposed
        sample((14,), torch.float32, 4)[::2],  # 1-D strided: reshape(-1) keeps the stride
        sample((6, 8), torch.float16, 5)[:, 1::3],
    ]
    for i, x in enumerate(cases):
        assert not x.is_contiguous()
        ctx = ctx_for(f"nc{i}")
        a, b = make(name), make(name)
        pa = a.encode(x, ctx)
        pb = b.encode(x.contiguous(), ctx)
        for t in pa.tensors:
            assert t.dim() == 1 and t.is_contiguous(), (name, i)
        assert torch.equal(a.decode(pa), b.decode(pb)), (name, i)


@pytest.mark.parametrize("name", NAMES)
def test_rejects_unsupported_dtype(name: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        make(name).encode(torch.ones(8, dtype=torch.int32), ctx_for("bad"))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name: str) -> None:
    """Resuming from ``state_dict()`` gives the same next step as not stopping."""
    comp = make(name)
    xs = [sample((16, 12), torch.float32, s) for s in range(4)]
    for step in range(3):
        comp.encode(xs[step], ctx_for("p", step=step))
    state = comp.state_dict()
    if comp.stateful:
        assert state, "a stateful compressor must put its state in state_dict()"
    resumed = make(name)
    resumed.load_state_dict(state)
    out_a = comp.decode(comp.encode(xs[3], ctx_for("p", step=3)))
    out_b = resumed.decode(resumed.encode(xs[3], ctx_for("p", step=3)))
    assert torch.equal(out_a, out_b)
    # the snapshot is a copy: advancing the original did not change it
    again = make(name)
    again.load_state_dict(state)
    assert torch.equal(again.decode(again.encode(xs[3], ctx_for("p", step=3))), out_b)


def test_state_dict_rejects_foreign_entries() -> None:
    with pytest.raises(ValueError):
        create("topk").load_state_dict({"bogus": 1})
    with pytest.raises(ValueError, match="momentum"):
        create("signum").load_state_dict({"bogus": {}})


@pytest.mark.parametrize("name", [n for n in NAMES if get_class(n).summable and get_class(n).rounds == 1])
def test_summable_packets_add_before_decoding(name: str) -> None:
    comp = make(name)
    shape = (64, 33)
    packets = [comp.encode(sample(shape, torch.float32, 30 + r), ctx_for("s", rank=r, world_size=3)) for r in range(3)]
    summed = Packet([sum(ts) for ts in zip(*(p.tensors for p in packets))], packets[0].shape, packets[0].dtype,
                    dict(packets[0].meta))
    want = sum(comp.decode(p) for p in packets)
    torch.testing.assert_close(comp.decode(summed), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", [n for n in NAMES if get_class(n).rounds > 1])
def test_multi_round_protocol_world_of_one(name: str) -> None:
    """Drive ``begin``/``advance``/``finish`` as a strategy does for one rank
    (the allreduce sum of one rank is its own tensor)."""
    comp = make(name)
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            x = sample(shape, dtype, seed=40 + i)
            ctx = ctx_for(f"r{i}")
            state, out = comp.begin(x, ctx)
            if out is None:
                continue
            rounds = 1
            while out is not None:
                out = comp.advance(state, out, ctx)
                rounds += 1 if out is not None else 0
            assert rounds == comp.rounds
            y = comp.finish(state)
            assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y.double()).all()


# --------------------------------------------------------------------------- specs and errors


def test_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError) as err:
        create("topkk:ratio=0.1")
    msg = str(err.value)
    assert "topkk" in msg and "topk" in msg.replace("topkk", "") and "natural" in msg


@pytest.mark.parametrize("name", NAMES)
def test_unknown_parameter_lists_allowed(name: str) -> None:
    with pytest.raises(ValueError) as err:
        create(f"{name}:bogus=1")
    msg = str(err.value)
    assert "bogus" in msg and "allowed" in msg
    for p in get_class(name).PARAMS:
        assert p.name in msg


_CANDIDATES = ["-1", "0", "-0.5", "0.5", "1.5", "2", "1000000000", "nonsense"]


@pytest.mark.parametrize("name", NAMES)
def test_bad_values_name_the_field(name: str) -> None:
    """Every value a parameter refuses fails at construction with a
    ValueError naming the parameter, the value and what is allowed."""
    for p in get_class(name).PARAMS:
        if p.type in (int, float):
            with pytest.raises(ValueError) as err:
                create(f"{name}:{p.name}=abc")
            assert p.name in str(err.value) and "abc" in str(err.value)
        rejected = 0
        for token in _CANDIDATES:
            try:
                create(f"{name}:{p.name}={token}")
            except ValueError as err:
                msg = str(err)
                assert p.name in msg, (name, p.name, token, msg)
                assert "allowed" in msg or "expected" in msg, (name, p.name, token, msg)
                rejected += 1
        if name in FOUNDATION and p.check is not None:
            assert rejected, f"no out-of-range candidate found for {name}.{p.name}"


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("topk:ratio", "ratio"),
        ("topk:ratio=", "ratio"),
        ("topk:ratio=2", "0 < ratio <= 1"),
        ("topk:ratio=0", "ratio"),
        ("qsgd:levels=0", "levels"),
        ("qsgd:levels=2.5", "levels"),
        ("qsgd:bucket=-1", "bucket"),
        ("terngrad:clip=-1", "clip"),
        ("signum:momentum=1", "momentum"),
        ("threshold:tau=-0.1", "tau"),
        ("randomk:scale=maybe", "scale"),
        ("topk:ratio=0.1,ratio=0.2", "ratio"),
        ("topk:ratio=0.1>", "empty"),
        ("", "empty"),
    ],
)
def test_malformed_specs(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        create(spec)


def test_spec_round_trip() -> None:
    for spec in ["qsgd:levels=4,bucket=8", "randomk:ratio=0.25,scale=True", "topk:ratio=0.1>natural"]:
        comp = create(spec)
        assert create(comp.spec()).config() == comp.config()


def test_spec_grammar_and_params_name_their_kind() -> None:
    """The stage grammar and the typed parameters serve other registries
    (algorithms: "localsgd:period=8"): errors name the kind given, and say
    "compressor" by default."""
    assert parse_stage(" localsgd : period = 8 ,warmup=2 ", kind="algorithm") == ("localsgd", {"period": "8", "warmup": "2"})
    assert parse_stage("none") == ("none", {})
    with pytest.raises(ValueError, match=r"^algorithm 'a': malformed parameter 'b'; expected key=value$"):
        parse_stage("a:b", kind="algorithm")
    with pytest.raises(ValueError, match=r"^compressor 'a': malformed parameter 'b'; expected key=value$"):
        parse_stage("a:b")
    with pytest.raises(ValueError, match=r"^algorithm 'a': parameter 'k' given twice$"):
        parse_stage("a:k=1,k=2", kind="algorithm")
    with pytest.raises(ValueError, match=r"^empty algorithm spec stage"):
        parse_stage("  ", kind="algorithm")
    period = Param("period", int, 8, "integer >= 1", lambda v: v >= 1, "steps between averages")
    assert period.coerce("16", "localsgd", kind="algorithm") == 16
    with pytest.raises(ValueError, match=r"^algorithm 'localsgd': parameter 'period' got 0; allowed: integer >= 1$"):
        period.coerce("0", "localsgd", kind="algorithm")
    with pytest.raises(ValueError, match=r"^algorithm 'localsgd': parameter 'period' got 'x'; expected int"):
        period.coerce("x", "localsgd", kind="algorithm")
    with pytest.raises(ValueError, match=r"^compressor 'localsgd': parameter 'period' got 0; allowed"):
        period.coerce(0, "localsgd")


def test_ratio_is_declared_alike() -> None:
    """Every ``ratio`` parameter is the shared one: a float in (0, 1]."""
    ratios = [p for n in NAMES for p in get_class(n).PARAMS if p.name == "ratio"]
    assert len(ratios) >= 7
    for p in ratios:
        assert p.type is float and p.allowed == "0 < ratio <= 1" and p.check is not None
        assert p.check(1.0) and p.check(1e-9) and not p.check(0.0) and not p.check(1.5)


# --------------------------------------------------------------------------- traits


def test_traits() -> None:
    assert create("randomk").is_summable and not create("randomk").is_unbiased
    assert create("randomk:scale=true").is_unbiased
    assert not create("randomk:scale=true").default_error_feedback
    assert create("randomk").default_error_feedback
    assert create("terngrad:clip=0").is_unbiased and not create("terngrad").is_unbiased
    assert create("terngrad").default_error_feedback
    for name in ("qsgd", "natural"):
        assert create(name).is_unbiased and not create(name).default_error_feedback
    for name in ("signsgd", "signum"):
        comp = create(name)
        assert comp.aggregation == "majority" and not comp.default_error_feedback
    for name in ("efsignsgd", "onebit", "topk", "threshold"):
        assert create(name).default_error_feedback and create(name).aggregation == "mean"
    assert create("threshold").variable_size and create("threshold").values_index == 0
    assert create("natural").values_index is None
    assert create("signum").stateful


def test_only_none_is_the_identity() -> None:
    """``identity``: the packet is x itself and decodes to x exactly."""
    assert [n for n in NAMES if get_class(n).identity] == ["none"]
    assert not create("topk:ratio=0.1>natural").identity
    x = sample((5, 3), torch.float32)
    comp = create("none")
    packet = comp.encode(x, ctx_for("id"))
    assert len(packet.tensors) == 1 and torch.equal(packet.tensors[0], x.reshape(-1))
    assert torch.equal(comp.decode(packet), x)


def test_encode_is_a_final_template() -> None:
    """Subclasses implement ``_encode``; ``encode`` checks the input first."""
    with pytest.raises(TypeError, match="_encode"):
        type("Bad", (Compressor,), {"encode": lambda self, x, ctx=None: None})
    seen: list[Context] = []

    class Probe(Compressor):
        name = "probe"

        def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
            seen.append(ctx)
            return Packet([x.reshape(-1)], x.shape, x.dtype)

    probe = Probe()
    probe.seed = 9
    with pytest.raises(TypeError, match="probe"):
        probe.encode([1.0])  # type: ignore[arg-type]
    probe.encode(torch.ones(2))
    probe.encode(torch.ones(2))
    given = ctx_for("k", step=40)
    probe.encode(torch.ones(2), given)
    assert [c.step for c in seen] == [1, 2, 40] and seen[0].seed == 9 and seen[2] is given


# --------------------------------------------------------------------------- composition


@pytest.mark.parametrize("spec", ["topk:ratio=0.1>natural", "topk:ratio=0.1>qsgd", "topk:ratio=0.1>qsgd:levels=4,bucket=8"])
def test_composition_round_trip(spec: str) -> None:
    comp = create(spec)
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            x = sample(shape, dtype, seed=50 + i)
            ctx = ctx_for(f"c{i}")
            packet = comp.encode(x, ctx)
            out = comp.decode(packet)
            assert out.shape == x.shape and out.dtype == x.dtype
            template = create(spec).encode(sample(shape, dtype, seed=60 + i), ctx)
            assert torch.equal(comp.decode(through_wire(comp, packet, template)), out)
            # only top-k positions can be non-zero
            flat = x.reshape(-1).float()
            support = torch.zeros(flat.numel(), dtype=torch.bool)
            support[topk_support(flat, 0.1)] = True
            assert not out.reshape(-1)[~support].any()
    # cheaper than top-k alone: the values are quantized
    x = sample((64, 33), torch.float32, 7)
    assert comp.encode(x, ctx_for("z")).nbytes < create("topk:ratio=0.1").encode(x).nbytes


# --------------------------------------------------------------------------- method-specific


def test_topk_keeps_exactly_the_k_largest() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randperm(1000, generator=gen).float().sub(500).reshape(10, 100)  # distinct magnitudes but +-
    x[x == 0] = 0.25
    for ratio in (0.001, 0.013, 0.5, 0.999):
        comp = create("topk", ratio=ratio)
        out = comp.decode(comp.encode(x))
        k = kept(x.numel(), ratio)
        kept_mask = out != 0
        assert int(kept_mask.sum()) == k
        assert torch.equal(out[kept_mask], x[kept_mask])  # values exact
        assert x.abs()[kept_mask].min() >= x.abs()[~kept_mask].max()


def test_threshold_keeps_exactly_above_tau() -> None:
    x = sample((40, 25), torch.float32, 8)
    for tau in (0.0, 0.7, 10.0):
        out = create("threshold", tau=tau).decode(create("threshold", tau=tau).encode(x))
        assert torch.equal(out, torch.where(x.abs() > tau, x, torch.zeros_like(x)))


def test_randomk_shared_indices() -> None:
    x = sample((1000,), torch.float32, 9)
    comp = create("randomk:ratio=0.01")

    def support(c: Compressor, ctx: Context, data: torch.Tensor = x) -> torch.Tensor:
        return c.decode(c.encode(data, ctx)) != 0

    base = support(comp, ctx_for("w", step=4))
    assert int(base.sum()) == 10
    # same (seed, step, key): same indices, on another instance and another rank
    assert torch.equal(base, support(create("randomk:ratio=0.01"), ctx_for("w", step=4, rank=3)))
    # other step, other key, other run seed: other indices
    assert not torch.equal(base, support(comp, ctx_for("w", step=5)))
    assert not torch.equal(base, support(comp, ctx_for("v", step=4)))
    assert not torch.equal(base, support(comp, Context(key="w", step=4, seed=99)))
    # kept values are exact without scale, times d/k with it
    out = comp.decode(comp.encode(x, ctx_for("w", step=4)))
    assert torch.equal(out[base], x[base])
    scaled = create("randomk:ratio=0.01,scale=true")
    out = scaled.decode(scaled.encode(x, ctx_for("w", step=4)))
    torch.testing.assert_close(out[base], x[base] * 100)


def test_randomk_decode_needs_the_seed() -> None:
    comp = create("randomk:ratio=0.1")
    packet = comp.encode(torch.randn(50), ctx_for("m"))
    with pytest.raises(ValueError, match="seed"):
        comp.decode(Packet(packet.tensors, packet.shape, packet.dtype))


def test_natural_keeps_powers_of_two_and_zero() -> None:
    exps = torch.arange(-126, 128, dtype=torch.float64)
    powers = torch.cat([2.0**exps, -(2.0**exps), torch.zeros(1)]).float()
    comp = create("natural")
    for step in range(3):
        out = comp.decode(comp.encode(powers, ctx_for("n", step=step)))
        assert torch.equal(out, powers)
    # fp16 / bf16 powers of two survive too
    for dtype, lo, hi in ((torch.float16, -14, 16), (torch.bfloat16, -126, 128)):
        p = (2.0 ** torch.arange(lo, hi, dtype=torch.float64)).to(dtype)
        p = torch.cat([p, -p])
        assert torch.equal(comp.decode(comp.encode(p, ctx_for("h"))), p)


def test_natural_rounds_to_a_neighbouring_power() -> None:
    x = sample((5000,), torch.float32, 11) * 1e3
    comp = create("natural")
    out = comp.decode(comp.encode(x, ctx_for("nb")))
    assert torch.equal(torch.sign(out), torch.sign(x))
    mag = out.abs().double()
    low = 2.0 ** torch.floor(torch.log2(x.abs().double()))
    assert torch.all((mag == low) | (mag == 2 * low))
    assert torch.equal(torch.frexp(mag).mantissa, torch.full_like(mag, 0.5))  # exact powers of two
    # both neighbours occur (stochastic, not always down)
    assert (mag == low).any() and (mag == 2 * low).any()


def test_natural_subnormals_and_saturation() -> None:
    tiny = torch.full((4000,), 2.0**-130, dtype=torch.float32)  # a subnormal: 1/16 of 2^-126
    out = create("natural").decode(create("natural").encode(tiny, ctx_for("sub")))
    assert set(out.unique().tolist()) <= {0.0, 2.0**-126}
    frac = (out > 0).double().mean().item()
    assert abs(frac - 1 / 16) < 5 * math.sqrt(1 / 16 * 15 / 16 / 4000)
    # fp16: never rounds up past the largest finite power of two
    big = torch.full((64,), 60000.0, dtype=torch.float16)
    out = create("natural").decode(create("natural").encode(big, ctx_for("sat")))
    assert torch.isfinite(out).all() and torch.all(out == 32768)
    nat = create("natural")
    assert torch.isinf(nat.decode(nat.encode(torch.tensor([float("inf"), -float("inf")])))).all()


def test_qsgd_levels_and_signs() -> None:
    x = sample((1000,), torch.float32, 12)
    for levels, bucket in ((1, 0), (4, 8), (16, 512), (255, 100), (1000, 64)):
        comp = create("qsgd", levels=levels, bucket=bucket)
        packet = comp.encode(x, ctx_for("q"))
        out = comp.decode(packet)
        b = bucket or x.numel()
        norms = packet.tensors[0].repeat_interleave(b)[: x.numel()]
        torch.testing.assert_close(norms[:b], torch.linalg.vector_norm(x[:b]).expand(b))
        level = out.abs() / norms * levels
        torch.testing.assert_close(level, level.round(), rtol=0, atol=1e-3)
        assert level.max() <= levels + 1e-3
        nz = out != 0
        assert torch.equal(torch.sign(out[nz]), torch.sign(x[nz]))
        # the level is one of the two neighbours of s|x|/n
        y = x.abs() / norms * levels
        assert torch.all((level.round() - torch.floor(y)).abs() <= 1 + 1e-4)


def test_terngrad_values() -> None:
    x = sample((2000,), torch.float32, 13)
    x[0] = 40.0  # an outlier that clipping cuts
    for clip in (0.0, 2.5):
        comp = create("terngrad", clip=clip)
        out = comp.decode(comp.encode(x, ctx_for("t")))
        s = x.abs().max() if clip == 0 else clip * x.std(correction=0)
        torch.testing.assert_close(out.abs().max(), s)
        assert set(torch.unique(out / s).round().tolist()) <= {-1.0, 0.0, 1.0}
        nz = out != 0
        assert torch.equal(torch.sign(out[nz]), torch.sign(x[nz]))


def test_sign_methods_decode() -> None:
    x = sample((77,), torch.float32, 14)
    x[3] = 0.0
    signs = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(create("signsgd").decode(create("signsgd").encode(x)), signs)
    ef = create("efsignsgd")
    torch.testing.assert_close(ef.decode(ef.encode(x)), x.abs().mean() * signs)
    ob = create("onebit")
    want = torch.where(x >= 0, x[x >= 0].mean(), x[x < 0].mean())
    torch.testing.assert_close(ob.decode(ob.encode(x)), want)
    # one side empty: the other mean is unused and finite
    pos = x.abs() + 0.1
    torch.testing.assert_close(ob.decode(ob.encode(pos)), pos.mean().expand_as(pos))


def test_signum_follows_momentum() -> None:
    beta = 0.75
    comp = create("signum", momentum=beta)
    plain = create("signum", momentum=0.0)
    m = torch.zeros(50, dtype=torch.float64)
    for step in range(6):
        g = sample((50,), torch.float32, 100 + step)
        m = beta * m + (1 - beta) * g.double()
        out = comp.decode(comp.encode(g, ctx_for("m", step=step)))
        assert torch.equal(out, torch.where(m >= 0, 1.0, -1.0))
        # the buffer is the EMA itself, m <- beta m + (1 - beta) g (its signs alone cannot tell it from the
        # sum m <- beta m + g, (1 - beta) times smaller from zero on: a planted bug, docs/testing.md "plants2")
        torch.testing.assert_close(comp.state_dict()["momentum"]["m"].double(), m, rtol=1e-5, atol=1e-6)
        assert torch.equal(plain.decode(plain.encode(g, ctx_for("m", step=step))), torch.where(g >= 0, 1.0, -1.0))
    assert comp.wire_bytes(50) == 7 and set(comp.state_dict()["momentum"]) == {"m"}
    # a non-finite gradient does not poison the momentum
    before = comp.state_dict()["momentum"]["m"].clone()
    comp.encode(torch.full((50,), float("nan")), ctx_for("m", step=7))
    assert torch.equal(comp.state_dict()["momentum"]["m"], before)
    with pytest.raises(ValueError, match="key"):
        comp.encode(torch.ones(7), ctx_for("m", step=8))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_equals_input_minus_decoded(name: str, dtype: torch.dtype) -> None:
    """``Compressor.residual`` (in place for exact-value sparsifiers) is
    exactly ``p - decode(encode(p))``: what error feedback keeps."""
    comp = make(name)
    p = sample((64, 33), dtype, seed=5)
    packet = comp.encode(p, ctx_for("resid", step=40))
    expected = p - comp.decode(packet).to(dtype)
    got = comp.residual(p.clone(), packet)
    assert got.shape == p.shape and got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk:ratio=0.1>topk", "cannot be a second stage"),
        ("topk:ratio=0.1>randomk", "cannot be a second stage"),
        ("topk:ratio=0.1>natural>fp16", "more than two stages"),
        ("natural>qsgd", "keeps no separate values"),
        ("topk:ratio=0.1>none", "cannot be a second stage"),
    ],
)
def test_bad_compositions_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create(spec)


def test_powersgd_recovers_from_a_non_finite_warm_start() -> None:
    """A step with a NaN leaves a non-finite averaged Q; the next step must
    start from a fresh Q instead of carrying the NaN forever."""
    comp = make("powersgd")
    comp.start_iter = 0
    x = sample((64, 33), torch.float32, seed=1)
    comp.q["w"] = torch.full((33, 2), float("nan"))
    state, p = comp.begin(x, ctx_for("w", step=5))
    assert torch.isfinite(p).all()
    q = comp.advance(state, p, ctx_for("w", step=5))
    comp.advance(state, q, ctx_for("w", step=5))
    assert torch.isfinite(comp.finish(state)).all() and torch.isfinite(comp.q["w"]).all()
