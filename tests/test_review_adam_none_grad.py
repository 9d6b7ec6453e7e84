"""Review: compressed Adam (1-bit Adam, 0/1 Adam) and a parameter whose
``.grad`` is None.

torch's Adam skips such a parameter: the parameter, its ``m``, ``v`` and
its step count stay as they are, and its bias correction counts only the
steps it took. The compressed Adams decayed ``m`` and ``v`` of every
parameter and moved it. These are distributed optimizers, so the rule is
made on what every rank agrees on (DDP's own rule, which averages a missing
gradient as zeros and leaves a parameter no rank used untouched):

* None on every rank: skipped, exactly as torch's Adam (nothing exchanged
  for it, its residuals untouched);
* None on some ranks only: those ranks count it as a zero gradient, the
  parameter takes its step on every rank.

2 gloo workers; the float64 reference is Adam by its formula with a step
count per parameter, computed here."""

from __future__ import annotations

import pytest
import torch
from distributed import checkpoint, restore, run_workers
from test_algorithms import batch, make_model

import gradpress.algorithms as algorithms

WORLD = 2
LR = 0.01
B1, B2 = 0.9, 0.999
EPS = 1e-8
STEPS = 8
#: steps (0-based) on which the side head is used by no rank / by rank 0 only
NONE_EVERYWHERE = {1, 4}
NONE_ON_RANK1 = {2, 6}
NONE_EVERYWHERE_FIRST = min(NONE_EVERYWHERE)
#: a step of NONE_EVERYWHERE that exchanges compressed in both algorithms' runs below (t = 5)
NONE_STEP_COMPRESSED = 4


class Net(torch.nn.Module):
    """make_model() plus a side head that only some steps use (its weight:
    120 entries, compressed with min_numel=64)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        torch.manual_seed(11)
        self.side = torch.nn.Linear(40, 3).double()

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.body[1](self.body[0](x))
        out = self.body[2](h)
        return out + self.side(h) if use_side else out


def uses_side(rank: int, step: int) -> bool:
    return step not in NONE_EVERYWHERE and not (rank == 1 and step in NONE_ON_RANK1)


def local_grads(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor | None]:
    net = Net()
    with torch.no_grad():
        for p, q in zip(net.parameters(), params):
            p.copy_(q)
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(net(x, uses_side(rank, step)), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def reference(steps: int, v_step) -> list[torch.Tensor]:  # noqa: ANN001
    """torch's Adam on DDP's average, float64, by the formula: a gradient
    missing on some ranks counts as 0 there; a parameter whose gradient is
    missing on every rank is skipped (``p``, ``m``, ``v`` and its step
    counts unchanged). ``v_step(t)``: whether step t (from 1) updates the
    variance; ``s`` counts this parameter's variance updates."""
    params = [p.detach().clone() for p in Net().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    n = [0] * len(params)
    s = [0] * len(params)
    out = []
    for t in range(1, steps + 1):
        per_rank = [local_grads(params, r, t - 1) for r in range(WORLD)]
        for i, p in enumerate(params):
            got = [g[i] for g in per_rank if g[i] is not None]
            if not got:
                continue
            g = sum(got) / WORLD
            n[i] += 1
            m[i] = B1 * m[i] + (1 - B1) * g
            if v_step(t):
                s[i] += 1
                v[i] = B2 * v[i] + (1 - B2) * g * g
            bc2 = 1 - B2 ** s[i] if s[i] else 1.0
            p -= LR / (1 - B1 ** n[i]) * m[i] / ((v[i] / bc2).sqrt() + EPS)
        out.append(flat(params))
    return out


def _train(rank: int, net: Net, opt: torch.optim.Optimizer, algo: algorithms.Algorithm,
           steps: range) -> list[dict]:
    out = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x, uses_side(rank, step)), y).backward()
        algo.step()
        res = algo.engine.feedback.residuals  # type: ignore[union-attr]
        out.append({"params": flat(list(net.parameters())), "m": flat(algo.exp_avg),
                    "v": flat(algo.exp_avg_sq),
                    "side_res": {k: v.clone() for k, v in res.items() if "side" in k}})
    return out


def _make(rank: int, spec: str, compressor: str) -> tuple[Net, torch.optim.Optimizer, algorithms.Algorithm]:
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    return net, opt, algorithms.create(spec, net, opt, compressor=compressor, min_numel=64)


def _run(rank: int, spec: str, compressor: str) -> list[dict]:
    net, opt, algo = _make(rank, spec, compressor)
    return _train(rank, net, opt, algo, range(STEPS))


def _resume(rank: int, spec: str, compressor: str, first: int) -> dict:
    net, opt, algo = _make(rank, spec, compressor)
    _train(rank, net, opt, algo, range(first))
    saved = checkpoint(algo=algo, model=net)
    cont = _train(rank, net, opt, algo, range(first, STEPS))
    net2, opt2, algo2 = _make(rank, spec, compressor)
    restore(saved, model=net2, algo=algo2)
    return {"cont": [r["params"] for r in cont],
            "resumed": [r["params"] for r in _train(rank, net2, opt2, algo2, range(first, STEPS))]}


def _old_format(rank: int) -> dict:
    """A state saved before the per-parameter counts (one ``v_steps``
    integer, no ``steps``) loads as those counts for every parameter; a
    count list of another model is refused."""
    spec = "onebit_adam:freeze_step=3"
    net, opt, algo = _make(rank, spec, "efsignsgd")
    _train(rank, net, opt, algo, range(NONE_EVERYWHERE_FIRST))  # every parameter took every step so far
    saved = checkpoint(algo=algo, model=net)
    cont = _train(rank, net, opt, algo, range(NONE_EVERYWHERE_FIRST, STEPS))
    extra = saved["algo"]["extra"]
    assert extra["steps"] == [extra["t"]] * 6 and extra["v_steps"] == [extra["t"]] * 6
    del extra["steps"]
    extra["v_steps"] = extra["t"]
    net2, opt2, algo2 = _make(rank, spec, "efsignsgd")
    restore(saved, model=net2, algo=algo2)
    resumed = _train(rank, net2, opt2, algo2, range(NONE_EVERYWHERE_FIRST, STEPS))
    extra["v_steps"] = [1, 1]
    try:
        algo2.load_state_dict(saved["algo"])
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"cont": [r["params"] for r in cont], "resumed": [r["params"] for r in resumed], "error": error}


def _worker(rank: int, world: int) -> dict:
    out = {
        "old_format": _old_format(rank),
        # identity compressor: the warm-up (exact Adam) for t <= 3, then the frozen variance
        "onebit_none": _run(rank, "onebit_adam:freeze_step=3", "none"),
        # 0/1 Adam, variance phase only: v at T_v = 1, 2, 4, 8, the other steps' gradients exchanged
        "zo_none": _run(rank, "zeroone_adam:var_update_scaler=1,var_freeze_step=100", "none"),
        "onebit_ef": _run(rank, "onebit_adam:freeze_step=3", "efsignsgd"),
        "zo_ef": _run(rank, "zeroone_adam:var_update_scaler=1,var_freeze_step=100", "efsignsgd"),
        "zo_local": _run(rank, "zeroone_adam:var_update_scaler=1000,var_freeze_step=2,local_step_scaler=1,"
                               "local_step_clipper=2", "efsignsgd"),
        "resume_onebit": _resume(rank, "onebit_adam:freeze_step=3", "efsignsgd", 2),
        "resume_zo": _resume(rank, "zeroone_adam:var_update_scaler=1,var_freeze_step=100", "efsignsgd", 2),
    }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


def _close(got: list[dict], want: list[torch.Tensor]) -> None:
    for t, (a, b) in enumerate(zip([r["params"] for r in got], want)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"step {t + 1}: max diff {(a - b).abs().max():.3g}"


def test_onebit_adam_skips_a_parameter_without_gradient_on_every_rank(results: list[dict]) -> None:
    """Warm-up (t <= 3: t = 2 misses the gradient everywhere, t = 3 on rank
    1) and the frozen-variance stage (t = 5 everywhere, t = 7 on rank 1),
    identity compressor: torch's Adam on
    DDP's average with a step count per parameter."""
    want = reference(STEPS, lambda t: t <= 3)
    for res in results:
        _close(res["onebit_none"], want)


def test_zeroone_adam_skips_a_parameter_without_gradient_on_every_rank(results: list[dict]) -> None:
    """0/1 Adam's variance phase: exact steps (T_v = 1, 2, 4, 8) and the
    exchanged-gradient steps between them (3, 5, 6, 7); the gradient is
    missing everywhere at t = 2 (exact) and t = 5 (exchanged)."""
    want = reference(STEPS, lambda t: t in (1, 2, 4, 8))
    for res in results:
        _close(res["zo_none"], want)


def _side_slice() -> slice:
    """The side head's entries in the flat parameters (it comes after the body)."""
    n_body = sum(p.numel() for p in make_model().parameters())
    return slice(n_body, None)


@pytest.mark.parametrize("key", ["onebit_ef", "zo_ef"])
def test_compressed_exchange_leaves_a_skipped_parameter_and_its_residuals_alone(results: list[dict],
                                                                              key: str) -> None:
    """With a compressor (efsignsgd: worker and owner residuals), a step on
    which no rank has the side head's gradient leaves its parameters, m, v
    and every residual of it bit-identical; the replicas stay identical."""
    side = _side_slice()
    for res in results:
        run = res[key]
        assert run[NONE_STEP_COMPRESSED - 1]["side_res"]  # the side head has residuals to leave alone
        for step in sorted(NONE_EVERYWHERE):
            before, after = run[step - 1], run[step]
            assert torch.equal(after["params"][side], before["params"][side]), step
            assert torch.equal(after["m"][side], before["m"][side]), step
            assert torch.equal(after["v"][side], before["v"][side]), step
            assert after["side_res"].keys() == before["side_res"].keys()
            for k in before["side_res"]:
                assert torch.equal(after["side_res"][k], before["side_res"][k]), (step, k)
            assert not torch.equal(after["params"][:side.start], before["params"][:side.start])  # the rest moved
        for step in sorted(NONE_ON_RANK1):  # a zero gradient on rank 1 only: the step happens everywhere
            assert not torch.equal(run[step]["params"][side], run[step - 1]["params"][side]), step
    for a, b in zip(results[0][key], results[1][key]):
        assert torch.equal(a["params"], b["params"]) and torch.equal(a["m"], b["m"])


def test_zeroone_local_steps_skip_a_parameter_without_local_gradient(results: list[dict]) -> None:
    """After the freeze (t > 2) every worker steps alone (H = 1 at t = 3,
    then 2: synchronizations at t = 3, 4, 6, 8): on a local step a worker
    without the side head's gradient leaves that parameter and its m as they
    are, as its own torch Adam would (t = 5: no rank has it; t = 7: rank 1
    has not, rank 0 steps it)."""
    side = _side_slice()
    run0, run1 = results[0]["zo_local"], results[1]["zo_local"]
    for run in (run0, run1):  # t = 5 (0-based 4)
        assert torch.equal(run[4]["params"][side], run[3]["params"][side])
        assert torch.equal(run[4]["m"][side], run[3]["m"][side])
    assert torch.equal(run1[6]["params"][side], run1[5]["params"][side])  # t = 7 (0-based 6)
    assert torch.equal(run1[6]["m"][side], run1[5]["m"][side])
    assert not torch.equal(run0[6]["params"][side], run0[5]["params"][side])
    for t in (3, 4, 6, 8):  # synchronized steps: replicas identical
        assert torch.equal(run0[t - 1]["params"], run1[t - 1]["params"]), t
        assert torch.equal(run0[t - 1]["m"], run1[t - 1]["m"]), t


@pytest.mark.parametrize("key", ["resume_onebit", "resume_zo"])
def test_resume_keeps_the_per_parameter_step_counts(results: list[dict], key: str) -> None:
    """Saved after a step the side head skipped (its own step count is then
    behind the algorithm's), loaded into fresh objects: bit-identical."""
    for res in results:
        for a, b in zip(res[key]["cont"], res[key]["resumed"]):
            assert torch.equal(a, b)


def test_state_without_per_parameter_counts_still_loads(results: list[dict]) -> None:
    for res in results:
        r = res["old_format"]
        for a, b in zip(r["cont"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["error"] is not None and "'v_steps' has 2 counts, the model has 6 parameters" in r["error"]
