"""DiLoCo's ``keep_residual=true`` and ``residual_decay`` together with a
compressed synchronous start (``switch=N``, gradients through top-k with
their own error feedback), on 2 gloo workers against a float64 reference
the test computes itself (its own top-k and error feedback; no gradpress
code in the reference).

Both options act on the *outer* gradient's residual only (``keep_residual``:
it is not fed back, it stays in the worker's model; ``residual_decay``: it
is decayed before each compression); the synchronous phase's gradient
residuals (keys ``grad:<name>``) are ordinary error feedback, ``p = e + g``.
Before this test both options set the engine's residual decay for every
key (0 for ``keep_residual``), so with ``keep_residual`` the synchronous
phase ran top-k without error feedback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from references import topk as ref_topk  # the shared float64 top-k reference
from test_algorithms import WORLD
from test_algorithms_outer import Workers, build, close, resumed, train
from test_diloco_switch import MIN_NUMEL, RATIO

STEPS = 14
SWITCH = 5
PERIOD = 3


def _compressed(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t.numel() >= MIN_NUMEL


def ref_keep_switch(steps: int, switch: int, period: int, lr: float, mu: float, grad_feedback: bool = True,
                    keep: bool = True, beta: float = 1.0) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """Steps 1..switch: worker i sends C(e_i + g_i) of each compressed tensor
    and keeps e_i <- e_i + g_i - C(e_i + g_i) (``grad_feedback=False``: the
    old behaviour, C(g_i) and nothing fed back); everyone steps SGD with the
    mean. At ``switch``: theta = the common parameters. Then every H steps:
    Delta_i = theta - x_i (no residual added), sent q_i = C(Delta_i), kept
    r_i = Delta_i - q_i; theta <- theta - lr * (mean q + mu * v) (Nesterov,
    v = mean q at the first outer step); worker i restarts from theta - r_i.
    ``keep=False``: q_i = C(beta * r_i + Delta_i), r_i <- beta * r_i +
    Delta_i - q_i, and worker i restarts from theta.
    Returns the workers' flat parameters and their outer residuals."""
    w = Workers("sgd")
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    gres: dict[tuple[int, int], torch.Tensor] = {}
    kept: list[dict[int, torch.Tensor]] = [{} for _ in range(WORLD)]
    for s in range(steps):
        t = s + 1
        w.grads(s)
        if t <= switch:
            with torch.no_grad():
                for i, ps in enumerate(w.params()):
                    sent = []
                    for r, p in enumerate(ps):
                        g = p.grad.clone()
                        if not _compressed(g):
                            sent.append(g)
                            continue
                        acc = gres.get((r, i), torch.zeros_like(g)) + g if grad_feedback else g
                        q = ref_topk(acc, RATIO)
                        gres[(r, i)] = acc - q
                        sent.append(q)
                    mean = sum(sent) / WORLD
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
                sent = []
                for r, p in enumerate(ps):
                    delta = theta[i] - p.detach()
                    if not keep and i in kept[r]:
                        delta = beta * kept[r][i] + delta
                    if _compressed(delta):
                        q = ref_topk(delta, RATIO)
                        kept[r][i] = delta - q
                        sent.append(q)
                    else:
                        sent.append(delta)
                d = sum(sent) / WORLD
                buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                theta[i] = theta[i] - lr * (d + mu * buf[i])
                for r, p in enumerate(ps):
                    p.copy_(theta[i] - kept[r][i] if keep and i in kept[r] else theta[i])
    return w.flats(), kept


SPEC = f"diloco:period={PERIOD},outer_lr=0.7,outer_momentum=0.5,keep_residual=true,switch={SWITCH}"
DECAY = f"diloco:period={PERIOD},outer_lr=0.7,outer_momentum=0.5,residual_decay=0.8,switch={SWITCH}"


def _worker(rank: int, world: int) -> dict:
    kw = {"compressor": f"topk:ratio={RATIO}", "min_numel": MIN_NUMEL}
    out: dict = {}
    model, opt, algo = build(rank, SPEC, **kw)
    out["keep_switch"] = train(rank, model, opt, algo, 0, STEPS)
    out["names"] = [n for n, _ in model.named_parameters()]
    out["resid"] = {k: v.clone() for k, v in algo.state_dict()["exchange"]["feedback"]["residuals"].items()}
    out["beta"] = algo.engine.feedback.beta
    model, opt, algo = build(rank, DECAY, **kw)
    out["decay_switch"] = train(rank, model, opt, algo, 0, STEPS)
    out["decay_beta"] = algo.engine.feedback.beta
    out["resume_decay"] = resumed(rank, DECAY, 3, STEPS, **kw)
    # resume inside the synchronous phase, and after the switch (an outer residual in the store)
    out["resume_in"] = resumed(rank, SPEC, 3, STEPS, **kw)
    out["resume_after"] = resumed(rank, SPEC, 10, STEPS, **kw)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def test_keep_residual_with_a_compressed_start_matches_the_float64_reference(results) -> None:  # noqa: ANN001
    ref, kept = ref_keep_switch(STEPS, SWITCH, PERIOD, 0.7, 0.5)
    old, _ = ref_keep_switch(STEPS, SWITCH, PERIOD, 0.7, 0.5, grad_feedback=False)
    assert not close(ref[0], old[0])  # the reference tells the two behaviours apart
    for rank, res in enumerate(results):
        assert close(res["keep_switch"][-1], ref[rank]), (res["keep_switch"][-1] - ref[rank]).abs().max()
        names = res["names"]
        for i, r in kept[rank].items():  # the outer residual is what the worker kept out of its model
            assert close(res["resid"][names[i]].reshape(-1), r.reshape(-1)), names[i]
    # the synchronous phase: bit-identical replicas; right after it each worker holds theta - its residual
    for t in range(1, SWITCH + 1):
        assert torch.equal(results[0]["keep_switch"][t - 1], results[1]["keep_switch"][t - 1]), t
    assert not torch.equal(results[0]["keep_switch"][-1], results[1]["keep_switch"][-1])


def test_the_gradient_residuals_stay_plain_error_feedback(results) -> None:  # noqa: ANN001
    for res in results:
        assert res["beta"] == 1.0  # keep_residual touches only the outer keys' residuals
        assert any(k.startswith("grad:") for k in res["resid"])


def test_residual_decay_with_a_compressed_start_matches_the_float64_reference(results) -> None:  # noqa: ANN001
    ref, _ = ref_keep_switch(STEPS, SWITCH, PERIOD, 0.7, 0.5, keep=False, beta=0.8)
    old, _ = ref_keep_switch(STEPS, SWITCH, PERIOD, 0.7, 0.5, keep=False, beta=1.0)
    assert not close(ref[0], old[0])
    for rank, res in enumerate(results):
        assert close(res["decay_switch"][-1], ref[rank]), (res["decay_switch"][-1] - ref[rank]).abs().max()
        assert res["decay_beta"] == 0.8


@pytest.mark.parametrize("key", ["resume_in", "resume_after", "resume_decay"])
def test_resume_is_bit_identical(results, key) -> None:  # noqa: ANN001
    for res in results:
        r = res[key]
        assert len(r["again"]) == len(r["straight"]) > 0
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert r["stats"]["bytes_sent"] == r["stats_again"]["bytes_sent"]
