"""DiLoCo's ``switch`` (a synchronous start: the first N steps are DDP's,
gradients averaged through the configured compressor, then DiLoCo from the
synchronized model with a fresh outer optimizer) and ``inner_state=reset``
(the inner optimizer's moments zeroed at every outer step), on 2 gloo
workers against float64 references the test computes itself (its own
top-k and error feedback; no gradpress code in the references)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers, value_errors
from references import topk as ref_topk
from test_algorithms import WORLD, make_model
from test_algorithms_outer import Workers, build, close, resumed, train

STEPS = 14
RATIO = 0.1
MIN_NUMEL = 64


def ref_switch(steps: int, switch: int, period: int, lr: float, mu: float, kind: str = "sgd",
               topk: bool = False, reset: bool = False, dense_start: bool = False) -> list[torch.Tensor]:
    """Steps 1..switch: every worker's gradient g_i (top-k with error
    feedback when ``topk``: p_i = e_i + g_i, send C(p_i), e_i = p_i - C(p_i),
    for 2-D tensors of at least MIN_NUMEL entries) is averaged and every
    worker steps its inner optimizer with the mean. At step ``switch``
    theta = the (common) parameters. Then DiLoCo: outer steps at
    (t - switch) % H == 0 with Delta = mean_i C(theta - x_i) (own residuals),
    theta <- theta - lr * (Delta + mu * v) (Nesterov; v = Delta at the first
    outer step after the switch); workers restart from theta. ``reset``: the
    inner optimizer's moments are zeroed after every outer step.
    ``dense_start``: the gradients of the first ``switch`` steps are
    averaged uncompressed (the outer gradients still top-k)."""
    w = Workers(kind)
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    gres: dict[tuple[int, int], torch.Tensor] = {}
    dres: dict[tuple[int, int], torch.Tensor] = {}

    def squeeze(store: dict, r: int, i: int, t: torch.Tensor) -> torch.Tensor:
        if not topk or (dense_start and store is gres) or t.dim() < 2 or t.numel() < MIN_NUMEL:
            return t
        acc = store.get((r, i), torch.zeros_like(t)) + t
        sent = ref_topk(acc, RATIO)
        store[(r, i)] = acc - sent
        return sent

    for s in range(steps):
        t = s + 1
        w.grads(s)
        if t <= switch:
            with torch.no_grad():
                for i, ps in enumerate(w.params()):
                    mean = sum(squeeze(gres, r, i, p.grad.clone()) for r, p in enumerate(ps)) / WORLD
                    for p in ps:
                        p.grad.copy_(mean)
        for o in w.opts:
            o.step()
        if t == switch:
            theta = [p.detach().clone() for p in w.models[0].parameters()]
        if t <= switch or (t - switch) % period:
            continue
        with torch.no_grad():
            for i, ps in enumerate(w.params()):
                d = sum(squeeze(dres, r, i, theta[i] - p.detach()) for r, p in enumerate(ps)) / WORLD
                buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                theta[i] = theta[i] - lr * (d + mu * buf[i])
                for p in ps:
                    p.copy_(theta[i])
            if reset:
                for o in w.opts:
                    for st in o.state.values():
                        st["exp_avg"].zero_()
                        st["exp_avg_sq"].zero_()
    return w.flats()


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    topk = {"compressor": f"topk:ratio={RATIO}", "min_numel": MIN_NUMEL}
    for name, spec, kind, kw in (
            ("switch", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,switch=5", "sgd", {"compressor": "none"}),
            ("switch_topk", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,switch=5", "sgd", topk),
            ("switch_adam", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,switch=4", "adam", topk),
            ("switch_dense", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,switch=5,switch_exchange=dense", "sgd",
             topk),
            ("reset", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,inner_state=reset", "adam",
             {"compressor": "none"}),
            ("reset_switch", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,switch=4,inner_state=reset", "adam",
             topk)):
        model, opt, algo = build(rank, spec, kind, **kw)
        out[name] = train(rank, model, opt, algo, 0, STEPS)
        out[name + "_stats"] = algo.stats
    out["resume"] = resumed(rank, "diloco:period=3,outer_momentum=0.5,keep_residual=true,switch=5", 3, STEPS,
                            **topk)
    out["resume_after"] = resumed(rank, "diloco:period=3,outer_momentum=0.5,switch=4,inner_state=reset", 9, STEPS,
                                  "adam", **topk)
    out["errors"] = value_errors(lambda spec: build(rank, spec),
                                 {s: s for s in ("diloco:switch=-1", "diloco:inner_state=drop",
                                                        "diloco:switch=2,switch_exchange=sparse")})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("name,switch,kind,topk,reset", [
    ("switch", 5, "sgd", False, False),
    ("switch_topk", 5, "sgd", True, False),
    ("switch_adam", 4, "adam", True, False),
    ("switch_dense", 5, "sgd", True, False),
    ("reset", 0, "adam", False, True),
    ("reset_switch", 4, "adam", True, True),
])
def test_matches_the_float64_reference(results, name, switch, kind, topk, reset) -> None:  # noqa: ANN001
    ref = ref_switch(STEPS, switch, 3, 0.7, 0.5, kind, topk, reset, dense_start=name == "switch_dense")
    for rank, res in enumerate(results):
        assert close(res[name][-1], ref[rank]), (res[name][-1] - ref[rank]).abs().max()
    # synchronous phase (DDP's invariant) and right after every outer step: replicas agree
    for t in [*range(1, switch + 1), *range(switch + 3, STEPS + 1, 3)]:
        assert torch.equal(results[0][name][t - 1], results[1][name][t - 1]), t
    assert not torch.equal(results[0][name][switch], results[1][name][switch])  # local steps differ


def test_options_change_the_trajectory(results) -> None:  # noqa: ANN001
    assert not torch.equal(results[0]["switch_adam"][-1], results[0]["reset_switch"][-1])
    plain = ref_switch(STEPS, 0, 3, 0.7, 0.5, "adam")
    assert not close(results[0]["reset"][-1], plain[0])


def test_bytes_count_the_synchronous_phase(results) -> None:  # noqa: ANN001
    dense = sum(p.numel() * 8 for p in make_model().parameters())
    for res in results:
        s, c = res["switch_stats"], res["switch_topk_stats"]
        assert s["steps"] == STEPS and s["dense_bytes"] == STEPS * dense
        # 5 gradient averages + 3 outer steps ((14 - 5) // 3), each a model-sized exchange uncompressed
        assert s["exchanges"] == 8
        assert c["exchanges"] == 8 and c["bytes_sent"] < s["bytes_sent"]
        # dense start: the 5 gradient averages cost what uncompressed ones do, the outer steps what top-k's do
        d = res["switch_dense_stats"]
        assert c["bytes_sent"] < d["bytes_sent"] < s["bytes_sent"]
    assert not torch.equal(results[0]["switch_dense"][-1], results[0]["switch_topk"][-1])


@pytest.mark.parametrize("key", ["resume", "resume_after"])
def test_resume_is_bit_identical(results, key) -> None:  # noqa: ANN001
    for res in results:
        r = res[key]
        assert len(r["again"]) == len(r["straight"])
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert r["stats"]["bytes_sent"] == r["stats_again"]["bytes_sent"]
    grads = [k for k in results[0]["resume"]["saved"]["exchange"]["feedback"]["residuals"] if k.startswith("grad:")]
    assert grads  # the synchronous phase's residuals are checkpointed


def test_bad_values_name_the_field(results) -> None:  # noqa: ANN001
    for res in results:
        a, b, c = res["errors"].values()
        assert a is not None and "switch" in a and "-1" in a
        assert b is not None and "inner_state" in b and "drop" in b and "keep or reset" in b
        assert c is not None and "switch_exchange" in c and "sparse" in c and "compressed or dense" in c
