"""DiLoCo's ``residual_decay`` (the compressed outer gradient's error-feedback
residual decayed by beta before each compression: DeMo / SparseLoCo's local
momentum before compression) and ``keep_residual`` (workers restart from
theta minus their own unsent residual), on 2 gloo workers against a float64
reference the test computes itself (its own top-k; no gradpress code in the
reference)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import checkpoint, restore, run_workers, value_errors
from references import topk
from test_algorithms import WORLD, make_model
from test_algorithms_outer import Workers, build, close, flat, resumed, train

import gradpress.algorithms as algorithms

STEPS = 12
RATIO = 0.1
MIN_NUMEL = 64


def ref_diloco_topk(steps: int, period: int, lr: float, mu: float, nesterov: bool,
                    beta: float, keep: bool = False) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    """DiLoCo with plain SGD inside and a top-k outer gradient with decayed
    error feedback: every H steps each worker i forms
    p_i = beta * e_i + (theta - x_i) for every 2-D tensor of at least
    MIN_NUMEL entries, keeps the ceil(RATIO * d) entries of largest magnitude
    q_i, sets e_i = p_i - q_i; the other tensors go uncompressed. Delta =
    mean_i q_i; theta <- theta - lr * (Delta + mu * v) (Nesterov; v <- mu v +
    Delta, v = Delta at the first outer step); workers restart from theta.
    ``keep``: no residual is fed back (p_i = theta - x_i) and worker i
    restarts from theta - e_i instead (its unsent change stays local).
    Returns the workers' flat parameters and their residuals per tensor."""
    w = Workers("sgd")
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    resid: list[list[torch.Tensor | None]] = [[None] * len(theta) for _ in range(WORLD)]
    for s in range(steps):
        w.grads(s)
        for o in w.opts:
            o.step()
        if (s + 1) % period:
            continue
        with torch.no_grad():
            for i, ps in enumerate(w.params()):
                compressed = theta[i].dim() > 1 and theta[i].numel() >= MIN_NUMEL
                sent = []
                for r, p in enumerate(ps):
                    delta = theta[i] - p.detach()
                    if not compressed:
                        sent.append(delta)
                        continue
                    e = resid[r][i]
                    acc = delta if e is None or keep else beta * e + delta
                    sent_part = topk(acc, RATIO)
                    resid[r][i] = acc - sent_part
                    sent.append(sent_part)
                d = sum(sent) / WORLD
                if mu:
                    buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                    step = d + mu * buf[i] if nesterov else buf[i]
                else:
                    step = d
                theta[i] = theta[i] - lr * step
                for r, p in enumerate(ps):
                    p.copy_(theta[i] - resid[r][i] if keep and resid[r][i] is not None else theta[i])
    return w.flats(), resid


def ref_diloco_topk_model(steps: int, period: int, lr: float, mu: float, nesterov: bool,
                          keep: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """As :func:`ref_diloco_topk`, with the top-k taken over each worker's
    whole flattened outer gradient (every parameter, in order) at once."""
    w = Workers("sgd")
    theta = [p.detach().clone() for p in w.models[0].parameters()]
    sizes = [t.numel() for t in theta]
    buf: list[torch.Tensor | None] = [None] * len(theta)
    resid: list[torch.Tensor | None] = [None] * WORLD
    for s in range(steps):
        w.grads(s)
        for o in w.opts:
            o.step()
        if (s + 1) % period:
            continue
        with torch.no_grad():
            sent = []
            for r, m in enumerate(w.models):
                delta = torch.cat([(t - p.detach()).reshape(-1) for t, p in zip(theta, m.parameters())])
                acc = delta if resid[r] is None or keep else resid[r] + delta
                part = topk(acc, RATIO)
                resid[r] = acc - part
                sent.append(part)
            mean = (sum(sent) / WORLD).split(sizes)
            for i, d in enumerate(mean):
                d = d.view_as(theta[i])
                if mu:
                    buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                    step = d + mu * buf[i] if nesterov else buf[i]
                else:
                    step = d
                theta[i] = theta[i] - lr * step
            for r, m in enumerate(w.models):
                own = resid[r].split(sizes) if keep else [None] * len(theta)
                for i, p in enumerate(m.parameters()):
                    p.copy_(theta[i] - own[i].view_as(p) if own[i] is not None else theta[i])
    return w.flats(), resid


def _residuals(algo) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: r.clone() for n, r in algo.state_dict()["exchange"]["feedback"]["residuals"].items()}


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    kw = {"compressor": f"topk:ratio={RATIO}", "min_numel": MIN_NUMEL}
    for name, spec in (("decay", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,residual_decay=0.8"),
                       ("sparseloco", "diloco:period=4,outer_lr=1,outer_momentum=0,nesterov=false,residual_decay=0.95"),
                       ("plain", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5"),
                       ("keep", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,keep_residual=true"),
                       ("keep_local", "diloco:period=4,outer_lr=1,outer_momentum=0,nesterov=false,keep_residual=true"),
                       ("model", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,select=model"),
                       ("model_keep", "diloco:period=3,outer_lr=0.7,outer_momentum=0.5,select=model,keep_residual=true")):
        model, opt, algo = build(rank, spec, **kw)
        out[name] = train(rank, model, opt, algo, 0, STEPS)
        out[name + "_theta"] = torch.cat([a.reshape(-1) for a in algo.anchor])
        out[name + "_resid"] = _residuals(algo)
        out[name + "_names"] = [n for n, _ in model.named_parameters()]
        out[name + "_registered"] = [(k, shape) for k, shape, _ in algo.engine.params]
        out[name + "_shapes"] = [tuple(p.shape) for p in model.parameters()]
    out["resume"] = resumed(rank, "diloco:period=3,outer_momentum=0.5,residual_decay=0.8", 7, STEPS, **kw)
    # evaluate=average: the workers' average, training untouched
    model, opt, algo = build(rank, "diloco:period=3,outer_momentum=0.5,keep_residual=true,evaluate=average", **kw)
    train(rank, model, opt, algo, 0, 7)
    own = flat(model)
    out["eval_average"] = {"own": own, "eval": flat(algo.eval_model()), "own_after": flat(model)}
    out["eval_average"]["next"] = train(rank, model, opt, algo, 7, STEPS)
    model, opt, algo = build(rank, "diloco:period=3", **kw)
    out["eval_own_is_model"] = algo.eval_model() is model
    out["resume_model"] = resumed(rank, "diloco:period=3,outer_momentum=0.5,select=model,keep_residual=true", 7,
                                  STEPS, **kw)
    out["model_stats"] = resumed(rank, "diloco:period=3,select=model", 1, STEPS, **kw)["stats"]
    out["tensor_stats"] = resumed(rank, "diloco:period=3", 1, STEPS, **kw)["stats"]
    out["resume_keep"] = resumed(rank, "diloco:period=3,outer_momentum=0.5,keep_residual=true", 7, STEPS, **kw)
    # the decay is restored from the checkpoint onto a fresh algorithm
    model, opt, algo = build(rank, "diloco:period=3,outer_momentum=0.5,residual_decay=0.8", **kw)
    saved = checkpoint(algo=algo, model=model, opt=opt)
    model, opt, algo = build(rank, "diloco:period=3,outer_momentum=0.5,residual_decay=0.8", **kw)
    restore(saved, model=model, opt=opt, algo=algo)
    out["beta_after_restore"] = algo.engine.feedback.beta
    cases = (("diloco:residual_decay=0.9", {"compressor": "none"}),
             ("diloco:residual_decay=0.9", {"compressor": "topk:ratio=0.1", "error_feedback": False}),
             ("diloco:keep_residual=true", {"compressor": "none"}),
             ("diloco:keep_residual=true,residual_decay=0.9", {"compressor": "topk:ratio=0.1"}))
    out["errors"] = value_errors(lambda case: build(rank, case[0], **case[1]),
                                 {spec + str(extra): (spec, extra) for spec, extra in cases})
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


@pytest.mark.parametrize("name,period,lr,mu,nesterov,beta", [
    ("decay", 3, 0.7, 0.5, True, 0.8),
    ("sparseloco", 4, 1.0, 0.0, False, 0.95),
    ("plain", 3, 0.7, 0.5, True, 1.0),
])
def test_decayed_error_feedback_matches_the_float64_reference(results, name, period, lr, mu, nesterov,  # noqa: ANN001
                                                              beta) -> None:
    ref, resid = ref_diloco_topk(STEPS, period, lr, mu, nesterov, beta)
    for rank, res in enumerate(results):
        assert close(res[name][-1], ref[rank]), (res[name][-1] - ref[rank]).abs().max()
        got = res[name + "_resid"]
        names = res[name + "_names"]
        kept = [i for i in range(len(names)) if resid[rank][i] is not None]
        assert kept == [0, 2]  # the two weight matrices are compressed, the biases not
        for i in kept:
            assert close(got[names[i]].reshape(-1), resid[rank][i].reshape(-1)), names[i]
    for t in range(period, STEPS + 1, period):  # replicas agree right after every sync
        assert torch.equal(results[0][name][t - 1], results[1][name][t - 1])


def test_decay_changes_the_trajectory(results) -> None:  # noqa: ANN001
    assert not torch.equal(results[0]["decay"][-1], results[0]["plain"][-1])


def test_resume_with_decay_is_bit_identical_and_keeps_beta(results) -> None:  # noqa: ANN001
    for res in results:
        r = res["resume"]
        assert r["saved"]["exchange"]["feedback"]["beta"] == 0.8
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)
        assert res["beta_after_restore"] == 0.8


def test_decay_and_keep_need_error_feedback(results) -> None:  # noqa: ANN001
    for res in results:
        msgs = list(res["errors"].values())
        for msg in msgs[:2]:
            assert msg is not None and "'residual_decay' is 0.9 but error feedback is off" in msg
        assert "'keep_residual' is true but error feedback is off" in msgs[2]
        assert "'keep_residual' is true with 'residual_decay' 0.9" in msgs[3]


@pytest.mark.parametrize("name,period,lr,mu,nesterov", [
    ("keep", 3, 0.7, 0.5, True),
    ("keep_local", 4, 1.0, 0.0, False),
])
def test_keep_residual_matches_the_float64_reference(results, name, period, lr, mu, nesterov) -> None:  # noqa: ANN001
    ref, resid = ref_diloco_topk(STEPS, period, lr, mu, nesterov, 1.0, keep=True)
    for rank, res in enumerate(results):
        assert close(res[name][-1], ref[rank]), (res[name][-1] - ref[rank]).abs().max()
    # theta is bit-identical on every rank; right after the last sync each worker is theta - e_i
    assert torch.equal(results[0][name + "_theta"], results[1][name + "_theta"])
    assert not torch.equal(results[0][name][-1], results[1][name][-1])
    for rank, res in enumerate(results):
        e = torch.cat([(r if r is not None else torch.zeros_like(p)).reshape(-1)
                       for r, p in zip(resid[rank], make_model().parameters())])
        assert close(res[name][-1], res[name + "_theta"] - e)
    assert not torch.equal(results[0]["keep"][-1], results[0]["plain"][-1])


def test_evaluate_average_is_the_workers_average_and_leaves_training_alone(results) -> None:  # noqa: ANN001
    mean = sum(res["eval_average"]["own"] for res in results) / len(results)
    assert not torch.equal(results[0]["eval_average"]["own"], results[1]["eval_average"]["own"])
    for res in results:
        assert close(res["eval_average"]["eval"], mean)
        assert torch.equal(res["eval_average"]["own_after"], res["eval_average"]["own"])
        # the same spec without evaluate=average ("keep") trains identically
        for a, b in zip(res["eval_average"]["next"], res["keep"][7:]):
            assert torch.equal(a, b)
        assert res["eval_own_is_model"]


@pytest.mark.parametrize("name,keep", [("model", False), ("model_keep", True)])
def test_select_model_matches_the_float64_reference(results, name, keep) -> None:  # noqa: ANN001
    ref, resid = ref_diloco_topk_model(STEPS, 3, 0.7, 0.5, True, keep)
    for rank, res in enumerate(results):
        assert close(res[name][-1], ref[rank]), (res[name][-1] - ref[rank]).abs().max()
        got = res[name + "_resid"]
        assert list(got) == ["diloco%2Fmodel"]  # the engine key diloco/model, escaped (exchange/keys.py)
        assert close(got["diloco%2Fmodel"].reshape(-1), resid[rank])
    assert torch.equal(results[0][name + "_theta"], results[1][name + "_theta"])
    if not keep:
        for t in range(3, STEPS + 1, 3):
            assert torch.equal(results[0][name][t - 1], results[1][name][t - 1])
    assert not torch.equal(results[0]["model"][-1], results[0]["plain"][-1])
    for res in results:  # ceil(0.1 * 403) = 41 values + int32 indices per sync; nothing plain
        m, t = res["model_stats"], res["tensor_stats"]
        assert m["dense_bytes"] == t["dense_bytes"] and m["bytes_sent"] < t["bytes_sent"]
        for a, b in zip(res["resume_model"]["straight"], res["resume_model"]["again"]):
            assert torch.equal(a, b)


def test_resume_with_keep_residual_is_bit_identical(results) -> None:  # noqa: ANN001
    for res in results:
        r = res["resume_keep"]
        for a, b in zip(r["straight"], r["again"]):
            assert torch.equal(a, b)


def test_parameter_is_registered_and_validated() -> None:
    rows = {r["name"]: r for r in algorithms.describe()}
    params = {p["name"]: p for p in rows["diloco"]["params"]}
    assert params["residual_decay"]["default"] == 1.0
    assert "residual_decay" in {p["name"] for p in rows["streaming-diloco"]["params"]}
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ValueError, match="'residual_decay' got"):
            algorithms.parse(f"diloco:residual_decay={bad}")
    assert algorithms.parse("diloco:residual_decay=0.95")[1]["residual_decay"] == 0.95
    assert params["keep_residual"]["default"] is False
    assert "keep_residual" not in {p["name"] for p in rows["streaming-diloco"]["params"]}
    assert params["evaluate"]["default"] == "own"
    assert "evaluate" not in {p["name"] for p in rows["streaming-diloco"]["params"]}
    assert params["select"]["default"] == "tensor"
    assert "select" not in {p["name"] for p in rows["streaming-diloco"]["params"]}
    with pytest.raises(ValueError, match="'select' got"):
        algorithms.parse("diloco:select=chunk")
    with pytest.raises(ValueError, match="'evaluate' got"):
        algorithms.parse("diloco:evaluate=leader")
    with pytest.raises(ValueError, match="keep_residual"):
        algorithms.parse("streaming-diloco:keep_residual=true")


def test_the_engine_is_told_the_keys_diloco_exchanges(results: list[dict]) -> None:
    """``select=tensor`` registers each parameter under its name and shape,
    ``select=model`` one (1, n) key for the whole model (2-D, so the engine
    compresses it): what the engine plans, checks across ranks and saves."""
    for res in results:
        shapes = [list(s) for s in res["plain_shapes"]]
        assert res["plain_registered"] == list(zip(res["plain_names"], shapes))
        assert res["model_registered"] == [("diloco/model", [1, sum(math.prod(s) for s in shapes)])]
