"""LGC (Abrahamyan et al. 2021) on 3 gloo workers: the phase schedule, the
bytes of each phase (formulas computed here), bit-identical gradients in the
PS and ring variants, the error-feedback identity (the average is the mean of
what each rank took out of its accumulator, float64 here), the phase-2
average against a float64 reference, state round trips, clear errors."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from distributed import run_workers
from references import topk_support

import gradpress.algorithms as algorithms

WORLD = 3
DENSE, AE = 2, 3
STEPS = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :4]))


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _run(rank: int, world: int, spec: str, steps: int) -> dict:
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algo = algorithms.create(spec, model, opt)
    out: dict = {"phase": [], "bytes": [], "grad": [], "raw": [], "acc": [], "residual": [], "leader": []}
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        out["phase"].append(algo.phase)
        out["leader"].append(algo.leader_at(step))
        raw = flat_grad(model).clone()
        out["raw"].append(raw)
        out["acc"].append(raw + algo.residual)
        algo.step()
        out["grad"].append(flat_grad(model).clone())
        out["residual"].append(algo.residual.clone())
        out["bytes"].append(algo.stats["last_step_bytes"])
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["stats"] = algo.stats
    out["k"], out["latent"], out["k_inn"] = algo.k, algo.ae.latent, algo.k_inn
    out["ae_numel"] = sum(p.numel() for p in algo.ae.parameters())
    out["losses"] = algo.ae_loss_history()
    return out


def sizes() -> list[int]:
    return [p.numel() for p in make_model().parameters()]


def top_per_tensor(acc: torch.Tensor, ratio: float = 0.05) -> torch.Tensor:
    """The reference selection: the ceil(ratio * n) largest |acc| of each parameter tensor."""
    out, offset = [], 0
    for n in sizes():
        out.append(topk_support(acc[offset:offset + n], ratio) + offset)
        offset += n
    return torch.cat(out)


def spec(variant: str, **kw: object) -> str:
    extra = "".join(f",{k}={v}" for k, v in kw.items())
    return f"lgc:dense_steps={DENSE},ae_steps={AE},ratio=0.05,innovation=0.01,variant={variant}{extra}"


@pytest.fixture(scope="module")
def ps() -> list[dict]:
    return run_workers(_run, WORLD, spec("ps"), STEPS)


@pytest.fixture(scope="module")
def ring() -> list[dict]:
    return run_workers(_run, WORLD, spec("ring", master=1), STEPS)


def test_phase_schedule_switches_at_the_right_steps_on_every_rank(ps: list[dict]) -> None:
    expected = [1] * DENSE + [2] * AE + [3] * (STEPS - DENSE - AE)
    for r in ps:
        assert r["phase"] == expected
        assert r["leader"] == [s % WORLD for s in range(STEPS)]
        assert r["stats"]["lgc_phase"] == 3 and r["stats"]["steps"] == STEPS


def test_bytes_of_each_phase_are_counted_exactly(ps: list[dict], ring: list[dict]) -> None:
    d = ps[0]["raw"][0].numel()
    k = sum(math.ceil(0.05 * n) for n in sizes())
    latent, k_inn = math.ceil(k / 4), math.ceil(0.01 * d)
    assert (ps[0]["k"], ps[0]["latent"], ps[0]["k_inn"]) == (k, latent, k_inn)
    ae_bytes = 4 * ps[0]["ae_numel"]
    flags = 4 * len(sizes())  # one float32 presence flag per parameter in every step's exchange (DDP's rule)
    phase1, phase2 = 4 * d + flags, 4 * k + 4 * k + flags  # dense allreduce; broadcast indices + allgather values
    ps3 = (4 * k + 4 * latent + 4) + 8 * k_inn + flags  # broadcast indices, latent, scale; allgather innovation
    ring3 = (4 * k + 4) + 4 * latent + flags  # broadcast indices, scale; allreduce latent
    for r in ps:
        assert r["bytes"] == [phase1] * DENSE + [phase2] * AE + [ps3 + ae_bytes] + [ps3] * (STEPS - DENSE - AE - 1)
        assert r["stats"]["ae_bytes"] == ae_bytes
        assert r["stats"]["bytes_sent"] == sum(r["bytes"])
    ring_ae = 4 * ring[0]["ae_numel"]
    for r in ring:
        assert r["bytes"] == [phase1] * DENSE + [phase2] * AE + [ring3 + ring_ae] + [ring3] * (STEPS - DENSE - AE - 1)
    assert ps3 < 8 * k  # fewer bytes than the top-k of phase 2


@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_gradients_and_parameters_bit_identical_on_every_rank(variant: str, ps: list[dict], ring: list[dict]) -> None:
    results = ps if variant == "ps" else ring
    for r in results[1:]:
        for a, b in zip(results[0]["grad"], r["grad"]):
            assert torch.equal(a, b)
        assert torch.equal(results[0]["params"], r["params"])


def test_phase2_average_against_float64_reference(ps: list[dict]) -> None:
    for step in range(DENSE, DENSE + AE):
        leader = step % WORLD
        accs = [r["acc"][step].double() for r in ps]
        idx = top_per_tensor(accs[leader])
        expected = torch.zeros_like(accs[0])
        expected[idx] = sum(a[idx] for a in accs) / WORLD
        assert torch.allclose(ps[0]["grad"][step].double(), expected, rtol=1e-6, atol=1e-9)
        for r, a in zip(ps, accs):  # error feedback: what was not sent stays, what was sent leaves
            kept = a.clone()
            kept[idx] = 0
            assert torch.allclose(r["residual"][step].double(), kept, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_nothing_lost_in_phase3(variant: str, ps: list[dict], ring: list[dict]) -> None:
    """PS: the average is exactly the mean over ranks of acc - residual
    (each rank's decoded estimate plus its innovation). Ring: the latents are
    averaged before decoding, so the identity holds only approximately, and
    the average lives on the leader's top-k indices."""
    results = ps if variant == "ps" else ring
    for step in range(DENSE + AE, STEPS):
        sent = sum(r["acc"][step].double() - r["residual"][step].double() for r in results) / WORLD
        avg = results[0]["grad"][step].double()
        if variant == "ps":
            assert torch.allclose(avg, sent, rtol=1e-5, atol=1e-7)
        else:
            leader = 1
            idx = top_per_tensor(results[leader]["acc"][step].double())
            outside = torch.ones_like(avg, dtype=torch.bool)
            outside[idx] = False
            assert torch.count_nonzero(avg[outside]) == 0
            assert (avg - sent).norm() < 0.5 * sent.norm()


def test_ps_without_innovation_sends_only_the_masters_message() -> None:
    """innovation=0: no innovation collective at all (no empty collective):
    the master's message and the presence flags' allreduce (one float32
    per parameter: DDP's rule for a missing gradient); replicas still agree."""
    results = run_workers(_run, 2, "lgc:dense_steps=0,ae_steps=2,ratio=0.05,innovation=0,variant=ps", 4)
    k, latent = results[0]["k"], results[0]["latent"]
    assert results[0]["k_inn"] == 0
    assert results[0]["bytes"][3] == 4 * k + 4 * latent + 4 + 4 * len(sizes())
    for a, b in zip(results[0]["grad"], results[1]["grad"]):
        assert torch.equal(a, b)


def test_autoencoder_trained_in_phase2_only(ps: list[dict]) -> None:
    for r in ps:
        assert len(r["losses"]) == AE
        assert r["losses"] == ps[0]["losses"]  # the same training on every rank


def _resume(rank: int, world: int, spec_: str, stop: int, total: int) -> dict:
    torch.set_num_threads(1)
    model, model2 = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algo = algorithms.create(spec_, model, opt)
    for step in range(stop):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        algo.step()
    buf = io.BytesIO()
    torch.save(algo.state_dict(), buf)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may share the buffers
    algo2 = algorithms.create(spec_, model2, opt2)
    buf.seek(0)
    algo2.load_state_dict(torch.load(buf, weights_only=True))
    for m, o, a in ((model, opt, algo), (model2, opt2, algo2)):
        for step in range(stop, total):
            o.zero_grad()
            loss_of(m, rank, step).backward()
            a.step()
    return {"a": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "b": torch.cat([p.detach().reshape(-1) for p in model2.parameters()]),
            "stats_a": algo.stats["bytes_sent"], "stats_b": algo2.stats["bytes_sent"]}


@pytest.mark.parametrize("stop", [DENSE + 1, DENSE + AE + 1])
def test_state_dict_round_trip_continues_identically(stop: int) -> None:
    for r in run_workers(_resume, 2, spec("ps"), stop, STEPS):
        assert torch.equal(r["a"], r["b"])
        assert r["stats_a"] == r["stats_b"]


BAD = {
    "lgc:master=5": ["master=5", "0..1"],
    "lgc:ratio=0.0001,per_tensor=false": ["ratio=0.0001", "keeps k=1 of 836 values", "k >= 4",
                                          f"allowed ratio >= {4 / 836:.3g} for this model"],
    "lgc:variant=tree": ["variant", "ps or ring"],
}


def _errors(rank: int, world: int) -> list[str]:
    out = []
    for bad in BAD:
        try:
            algorithms.create(bad, make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
            out.append("")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_clear_errors_name_the_field_the_value_and_what_is_allowed() -> None:
    assert sum(p.numel() for p in make_model().parameters()) == 836  # BAD's ratio message
    for messages in run_workers(_errors, 2):
        for msg, words in zip(messages, BAD.values()):
            for w in words:
                assert w in msg, msg
