"""``nonfinite='skip'`` for the model-averaging algorithms must not leave a
dead run (2 gloo workers, one spawn, about 5 s).

Rank 0's gradient holds one Inf at one local step. That step puts the Inf
into rank 0's optimizer state (momentum, Adam's moments) and its parameters;
the next forward passes spread NaN into every parameter and the BatchNorm
statistics. The synchronization that follows is dropped on every rank. It
put the parameters back at the anchor but left the NaN momentum (and the
NaN buffers, which it even averaged into every rank): every later local step
gave NaN again and every later synchronization was dropped (the run was
dead while it looked alive). The documented rule (gradpress/algorithms/
restart.py): a dropped synchronization undoes the period on every rank,
parameters back to the agreed point, the optimizer state and buffers to
each rank's copy taken there; Streaming DiLoCo restarts every fragment from
``theta`` with each fragment's state as of its last merge. The references
below are written from that rule in float64 (autograd for the gradients and
BatchNorm's statistics, the optimizers by hand), compared after every step.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn as nn
from distributed import run_workers

import gradpress

F64 = torch.float64
WORLD = 2
LR_SGD, MU = 0.05, 0.9
LR_ADAM, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8

LOCALSGD, DILOCO = "localsgd:period=3", "diloco:period=3,outer_lr=0.7,outer_momentum=0.9"
STREAMING = "streaming-diloco:period=4,fragments=2,overlap=1,alpha=0.5"
# (spec, inner optimizer, steps, the step (0-based) of the fault on rank 0, the fault: FAULTS; or a tuple of steps
# and one of faults)
CASES = {
    "localsgd": (LOCALSGD, "momentum", 10, 4, "inf"),
    "diloco": (DILOCO, "adam", 10, 4, "inf"),
    "streaming": (STREAMING, "adam", 14, 4, "inf"),
    # the Inf one step earlier: the fragment in flight (launched finite) is merged after the NaN spread; its copy
    # was refreshed with NaN Adam moments, so every later exchange was dropped (4 in 14 steps, NaN at the end: a dead run)
    "streaming-early": (STREAMING, "adam", 14, 3, "inf"),
    # the parameters stay finite, the state does not (no synchronization was dropped: localsgd averaged the Inf
    # moment, or the Inf BatchNorm variance, into every rank; diloco and streaming kept rank 0's for good)
    "localsgd-overflow": (LOCALSGD, "adam", 10, 4, "overflow"),
    "localsgd-buffer": (LOCALSGD, "momentum", 10, 4, "buffer"),
    "diloco-overflow": (DILOCO, "adam", 10, 4, "overflow"),
    "diloco-buffer": (DILOCO, "adam", 10, 4, "buffer"),
    "streaming-overflow": (STREAMING, "adam", 14, 4, "overflow"),
    # step 5: a fault at step 4 is overwritten at once by the merge of the buffers launched at step 3
    "streaming-buffer": (STREAMING, "adam", 14, 5, "buffer"),
    # in the synchronous phase (DDP's step): an Inf buffer on rank 0 drops that step too, and every rank's buffers go
    # back to the last step's average (the step's own BatchNorm updates undone, as its optimizer step); it was
    # averaged into every rank (and so into every rank's copy at the switch), the step went through
    "postlocalsgd-buffer-early": ("postlocalsgd:period=3,switch=2", "momentum", 10, 0, "buffer"),
    "diloco-switch-buffer": (DILOCO + ",switch=2", "adam", 10, 1, "buffer"),
    # an Inf gradient in the synchronous phase: the step is dropped, the buffers too (they were averaged: the dropped
    # step's statistics reached every rank)
    "postlocalsgd-inf-early": ("postlocalsgd:period=3,switch=2", "momentum", 10, 1, "inf"),
    # in the synchronous phase a finite 1e200 gradient entry (averaged: finite) overflows Adam's exp_avg_sq to Inf on
    # every rank alike (the averaged step), so every rank's copy at the switch holds it: restoring it would not
    # help; nothing is dropped (every synchronization was: a dead run)
    "postlocalsgd-overflow-early": ("postlocalsgd:period=3,switch=2", "adam", 10, 0, "overflow"),
    # that Inf moment in every rank's copy, then an Inf BatchNorm variance on rank 0 in the first local period: a
    # fault the copy does not hold (the copy's Inf moment is another tensor), so that synchronization is dropped;
    # with the copy asked as a whole it went through (one non-finite tensor anywhere in the copy switched the check
    # off for every other one)
    "postlocalsgd-overflow-early-then-buffer": ("postlocalsgd:period=3,switch=2", "adam", 10, (0, 3),
                                                ("overflow", "buffer")),
}
#: the cases whose fault is already in the copy at the last agreed point: no synchronization dropped
IN_THE_COPY = ("postlocalsgd-overflow-early",)
#: a fault in the copy (an Inf moment, which stays), then a new one elsewhere: that one's synchronization dropped
IN_THE_COPY_AND_NEW = ("postlocalsgd-overflow-early-then-buffer",)
#: inf: one gradient entry is Inf (parameters and state go NaN); overflow: one gradient entry is 1e200, finite,
#: whose square overflows Adam's exp_avg_sq to Inf (that entry's update is then 0: the parameters stay finite);
#: buffer: one BatchNorm running_var entry becomes Inf (an overflowed activation under fp16/bf16 autocast; the
#: training forward pass uses the batch's statistics: the parameters stay finite)
FAULTS = ("inf", "overflow", "buffer")


def fault_at(case: str, rank: int, step: int) -> str | None:
    """The fault (FAULTS) rank ``rank`` gets at ``step`` in ``case`` (rank 0 only; a case may name several)."""
    _, _, _, bad, kind = CASES[case]
    faults = dict(zip(bad, kind)) if isinstance(bad, tuple) else {bad: kind}
    return faults.get(step) if rank == 0 else None


def fault(model: nn.Module, kind: str) -> None:
    """Rank 0's fault at its bad step, after the backward pass, before the optimizer step."""
    with torch.no_grad():
        if kind == "buffer":
            model.bn.running_var[0] = math.inf
        else:
            model.a.weight.grad[0, 0] = math.inf if kind == "inf" else 1e200
#: nonfinite='raise' on a case of CASES: (the step (0-based) whose ``algo.step()`` raises on every rank, the tensor
#: the message names); the parameters stay finite, so the engine alone raised nothing (the Inf was averaged in)
RAISES = {
    "localsgd-buffer": (5, "buffer 'bn.running_var'"),
    "localsgd-overflow": (5, "optimizer state of 'a.weight'"),
    "diloco-buffer": (5, "buffer 'bn.running_var'"),
    "diloco-overflow": (5, "optimizer state of 'a.weight'"),
    # launched at step 5 (a.weight's fragment) and 7 (the one that carries the buffers), merged a step later
    "streaming-overflow": (6, "optimizer state of 'a.weight'"),
    "streaming-buffer": (8, "buffer 'bn.running_var'"),
    "postlocalsgd-buffer-early": (0, "buffer 'bn.running_var'"),  # the synchronous phase: before it is averaged
    "postlocalsgd-overflow-early": (4, "optimizer state of 'a.weight'"),  # Inf on every rank: the first average
}


#: resumed from a checkpoint written at this step (a synchronization) without the copy (before 2026-12)
RESUME_AT = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.bn, self.b = nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Linear(4, 2)
        self.to(F64)  # no bias before BatchNorm: its gradient is rounding noise, which Adam normalizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(100 * step + rank))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build(case: str, nonfinite: str = "skip") -> tuple[nn.Module, torch.optim.Optimizer,
                                                         gradpress.algorithms.Algorithm]:
    spec, inner, _, _, _ = CASES[case]
    model = Net()
    opt = (torch.optim.SGD(model.parameters(), lr=LR_SGD, momentum=MU) if inner == "momentum"
           else torch.optim.Adam(model.parameters(), lr=LR_ADAM, betas=(B1, B2), eps=EPS))
    return model, opt, gradpress.algorithms.create(spec, model, opt, nonfinite=nonfinite)


def _raised(rank: int, case: str) -> dict:
    """``nonfinite='raise'``: the step whose ``algo.step()`` raised FloatingPointError and its message (None:
    every step went through)."""
    model, opt, algo = _build(case, "raise")
    try:
        for step in range(CASES[case][2]):
            opt.zero_grad()
            model(batch(rank, step)).square().mean().backward()
            kind = fault_at(case, rank, step)
            if kind is not None:
                fault(model, kind)
            try:
                algo.step()
            except FloatingPointError as exc:
                return {"step": step, "error": str(exc)}
        return {"step": None, "error": None}
    finally:
        algo.close()


def _run(rank: int, case: str, start: int = 0, built: tuple | None = None) -> dict:
    steps = CASES[case][2]
    model, opt, algo = built if built is not None else _build(case)
    out: dict = {"steps": []}
    for step in range(start, steps):
        opt.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        kind = fault_at(case, rank, step)
        if kind is not None:
            fault(model, kind)
        algo.step()
        out["steps"].append(snapshot(model))
    algo.close()
    out["skipped_steps"] = algo.stats["skipped_steps"]
    out["state"] = {f"{k} of {n}": v.clone() for n, p in model.named_parameters()
                    for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}
    return out


def _resumed_from_an_old_checkpoint(rank: int, case: str) -> dict:
    """Steps from RESUME_AT on, resumed (weights_only) from a checkpoint written there without the copy."""
    model, opt, algo = _build(case)
    for step in range(RESUME_AT):
        opt.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        algo.step()
    state = algo.state_dict()
    assert "restart" in state["extra"]
    del state["extra"]["restart"]  # as written before 2026-12
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "algorithm": state}, buf)
    algo.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, opt, algo = _build(case)  # as gradpress train resumes: model, optimizer, then the algorithm
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    algo.load_state_dict(saved["algorithm"])
    return _run(rank, case, RESUME_AT, (model, opt, algo))


def _worker(rank: int, world: int) -> dict:
    out = {case: _run(rank, case) for case in CASES}
    for case in ("localsgd", "diloco"):
        out[f"resumed/{case}"] = _resumed_from_an_old_checkpoint(rank, case)
    for case in RAISES:
        out[f"raise/{case}"] = _raised(rank, case)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD)


# ------------------------------------------------------------------ reference
class Replica:
    """One rank's model, with its optimizer written out by hand."""

    def __init__(self, rank: int, inner: str) -> None:
        self.rank, self.inner, self.model = rank, inner, Net()
        self.names = [n for n, _ in self.model.named_parameters()]
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_buffers())

    @torch.no_grad()
    def local_step(self, step: int, bad: str | None) -> None:
        self.backward(step, bad)
        self.apply()

    def backward(self, step: int, bad: str | None) -> None:
        with torch.enable_grad():
            self.model.zero_grad()
            self.model(batch(self.rank, step)).square().mean().backward()
        if bad is not None:
            fault(self.model, bad)

    @torch.no_grad()
    def apply(self) -> None:
        for n, p in self.params().items():
            g, s = p.grad, self.state.setdefault(n, {})
            if self.inner == "momentum":
                s["m"] = g.clone() if "m" not in s else MU * s["m"] + g
                p -= LR_SGD * s["m"]
            else:
                t = s["t"] = s.get("t", 0) + 1
                s["m"] = B1 * s.get("m", torch.zeros_like(p)) + (1 - B1) * g
                s["v"] = B2 * s.get("v", torch.zeros_like(p)) + (1 - B2) * g * g
                p -= LR_ADAM / (1 - B1 ** t) * s["m"] / ((s["v"] / (1 - B2 ** t)).sqrt() + EPS)

    def copy_state(self, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        return {n: {k: v if isinstance(v, int) else v.clone() for k, v in self.state[n].items()}
                for n in names if n in self.state}

    def put_state(self, names: list[str], saved: dict[str, dict[str, torch.Tensor]]) -> None:
        for n in names:
            self.state.pop(n, None)
            if n in saved:
                self.state[n] = {k: v if isinstance(v, int) else v.clone() for k, v in saved[n].items()}


def finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def newly_not_finite(reps: list[Replica], saved: list[tuple], names: list[str]) -> bool:
    """Whether some rank holds an optimizer state tensor or a floating buffer that is not finite while its own
    copy of that same tensor, taken at the last agreed point, is finite (or was not there)."""
    for r, (states, buffers) in zip(reps, saved):
        for n in names:
            for k, v in r.state.get(n, {}).items():
                copy = states.get(n, {}).get(k)
                if torch.is_tensor(v) and not finite([v]) and (not torch.is_tensor(copy) or finite([copy])):
                    return True
        for k, b in r.buffers().items():
            if b.is_floating_point() and not finite([b]) and finite([buffers[k]]):
                return True
    return False


class OuterSGD:
    """torch's SGD with Nesterov momentum, by hand."""

    def __init__(self, lr: float = 0.7, mu: float = 0.9) -> None:
        self.lr, self.mu, self.buf = lr, mu, {}

    def step(self, theta: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        for n, g in grads.items():
            self.buf[n] = g.clone() if n not in self.buf else self.mu * self.buf[n] + g
            theta[n] = theta[n] - self.lr * (g + self.mu * self.buf[n])


@torch.no_grad()
def reference(case: str) -> list[list[dict[str, torch.Tensor]]]:
    """Per step, per rank, the model's state (parameters and buffers)."""
    spec, inner, steps, _, _ = CASES[case]
    algo = spec.split(":")[0]
    reps = [Replica(r, inner) for r in range(WORLD)]
    names = reps[0].names
    anchor = {n: p.clone() for n, p in reps[0].params().items()}
    saved = [(r.copy_state(names), {k: b.clone() for k, b in r.buffers().items()}) for r in reps]
    outer = OuterSGD()
    out = []

    def restart(r: Replica, keep: tuple) -> None:  # the period never happened on r
        for n, p in r.params().items():
            p.copy_(anchor[n])
        r.put_state(names, keep[0])
        for k, b in r.buffers().items():
            b.copy_(keep[1][k])

    def average_buffers() -> None:
        for k, b in reps[0].buffers().items():
            if b.is_floating_point():
                mean = sum(r.buffers()[k] for r in reps) / WORLD
                for r in reps:
                    r.buffers()[k].copy_(mean)

    def local_state(names_: list[str], buffers: bool) -> list[torch.Tensor]:
        """Every rank's optimizer state of ``names_`` (and, with ``buffers``, floating buffers)."""
        ts = [v for r in reps for n in names_ for v in r.state.get(n, {}).values() if torch.is_tensor(v)]
        return ts + [b for r in reps for b in r.buffers().values() if buffers and b.is_floating_point()]

    if algo in ("localsgd", "postlocalsgd", "diloco"):
        period, switch = 3, int(spec.partition("switch=")[2] or 0)
        for step in range(steps):
            for r in reps:
                r.backward(step, fault_at(case, r.rank, step))
            if step < switch:  # DDP's step: the gradients and the buffers averaged, the same optimizer step
                # dropped when some rank's gradient is not finite, or one of its floating buffers is while that
                # buffer's copy (the last step's average) is finite: every rank's buffers back to that copy
                if not finite([p.grad for r in reps for p in r.params().values()]) or newly_not_finite(
                        reps, [({}, keep[1]) for keep in saved], []):
                    for r, keep in zip(reps, saved):
                        for k, b in r.buffers().items():
                            b.copy_(keep[1][k])
                else:
                    for n in names:
                        mean_grad = sum(r.params()[n].grad for r in reps) / WORLD
                        for r in reps:
                            r.params()[n].grad = mean_grad.clone()
                    for r in reps:
                        r.apply()
                    average_buffers()
                    saved = [(keep[0], {k: b.clone() for k, b in r.buffers().items()}) for r, keep in zip(reps, saved)]
                if step + 1 == switch:
                    anchor = {n: p.clone() for n, p in reps[0].params().items()}
                    saved = [(r.copy_state(names), {k: b.clone() for k, b in r.buffers().items()}) for r in reps]
            for r in reps:
                if step >= switch:
                    r.apply()
            if step >= switch and (step + 1 - switch) % period == 0:
                deltas = [{n: p - anchor[n] for n, p in r.params().items()} for r in reps]
                # the rule: dropped when some rank's delta is not finite, or one of its optimizer state tensors
                # or floating buffers is while that tensor's copy (at the last agreed point) is finite (or absent)
                if not finite([d for ds in deltas for d in ds.values()]) or newly_not_finite(reps, saved, names):
                    for r, keep in zip(reps, saved):
                        restart(r, keep)
                else:
                    mean = {n: sum(d[n] for d in deltas) / WORLD for n in names}
                    if algo != "diloco":
                        anchor = {n: anchor[n] + mean[n] for n in names}
                        for n in names:  # optimizer_state=auto with no compressor: momenta (Adam: m, v) averaged
                            for k in ("m", "v") if inner == "adam" else ("m",):
                                m = sum(r.state[n][k] for r in reps) / WORLD
                                for r in reps:
                                    r.state[n][k] = m.clone()
                    else:
                        outer.step(anchor, {n: -mean[n] for n in names})
                    for r in reps:
                        for n, p in r.params().items():
                            p.copy_(anchor[n])
                    average_buffers()
                    saved = [(r.copy_state(names), {k: b.clone() for k, b in r.buffers().items()}) for r in reps]
            out.append([{**{n: p.clone() for n, p in r.params().items()},
                         **{k: b.clone() for k, b in r.buffers().items()}} for r in reps])
        return out

    # Streaming DiLoCo (both cases): H = 4, F = 2, T = 1, alpha = 0.5
    period, overlap, alpha = 4, 1, 0.5
    sizes = [p.numel() for p in reps[0].params().values()]
    frags: list[list[int]] = [[], []]
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):  # largest first into the lightest
        frags[min(range(2), key=lambda f: (sum(sizes[j] for j in frags[f]), f))].append(i)
    frags = [[names[i] for i in sorted(f)] for f in frags]
    launch_at = {((f + 1) * period // 2) % period: f for f in range(2)}
    with_buffers = launch_at[0]
    states = [{n: None for n in names} for _ in reps]  # per rank, per parameter: its state at its last merge
    bufs = [{k: b.clone() for k, b in r.buffers().items()} for r in reps]
    pending: list[dict] = []
    for step in range(steps):
        t = step + 1
        for r in reps:
            r.local_step(step, fault_at(case, r.rank, step))
        f = launch_at.get(t % period)
        if f is not None:
            pending.append({"f": f, "due": t + overlap,
                            "deltas": [{n: anchor[n] - r.params()[n] for n in frags[f]} for r in reps],
                            "buffers": [{k: b.clone() for k, b in r.buffers().items()} for r in reps]
                            if f == with_buffers else None,
                            # the rule: some rank's optimizer state of the fragment, or the buffers it carries,
                            # not finite at its launch: the exchange is dropped (at its merge)
                            "state_ok": finite(local_state(frags[f], f == with_buffers))})
        while pending and pending[0]["due"] <= t:
            item = pending.pop(0)
            f = item["f"]
            if not item["state_ok"] or not finite([d for ds in item["deltas"] for d in ds.values()]):
                # every fragment from theta
                for r, st, bf in zip(reps, states, bufs):
                    for n, p in r.params().items():
                        p.copy_(anchor[n])
                    r.put_state(names, {n: s for n, s in st.items() if s is not None})
                    for k, b in r.buffers().items():
                        b.copy_(bf[k])
                continue
            outer.step(anchor, {n: sum(d[n] for d in item["deltas"]) / WORLD for n in frags[f]})
            for r, st in zip(reps, states):
                for n in frags[f]:
                    p = r.params()[n]
                    p.copy_(torch.lerp(p, anchor[n], 1 - alpha))
                mine = r.copy_state(frags[f])  # refreshed only where this rank's fragment is finite
                if finite([r.params()[n] for n in frags[f]] + [v for s in mine.values() for v in s.values()
                                                               if torch.is_tensor(v)]):
                    st.update({n: mine.get(n) for n in frags[f]})
            if item["buffers"] is not None:
                for k, b in reps[0].buffers().items():
                    mean = sum(ib[k] for ib in item["buffers"]) / WORLD if b.is_floating_point() else None
                    for r in reps:
                        if mean is not None:
                            r.buffers()[k].copy_(mean)
                for r, bf in zip(reps, bufs):
                    if finite([b for b in r.buffers().values() if b.is_floating_point()]):
                        bf.update({k: b.clone() for k, b in r.buffers().items()})
        out.append([{**{n: p.clone() for n, p in r.params().items()},
                     **{k: b.clone() for k, b in r.buffers().items()}} for r in reps])
    return out


def _check(got_steps: list[dict], want: list[list[dict]], rank: int, what: str, start: int = 0) -> None:
    for step, got_step in enumerate(got_steps, start):
        for k, w in want[step][rank].items():
            got = got_step[k]
            if not w.is_floating_point():
                assert torch.equal(got, w), f"{what} rank {rank} step {step} {k}: {got} vs {w}"
                continue
            ok = torch.isfinite(w)
            assert torch.equal(torch.isfinite(got), ok), f"{what} rank {rank} step {step} {k}: {got} vs {w}"
            tol = 1e-10 * max(1.0, w[ok].abs().max().item() if ok.any() else 1.0)
            err = (got[ok] - w[ok]).abs().max().item() if ok.any() else 0.0
            assert err <= tol, f"{what} rank {rank} step {step} {k}: {got} vs {w}"


@pytest.mark.parametrize("case", [c for c in CASES if c not in IN_THE_COPY + IN_THE_COPY_AND_NEW])
def test_a_skipped_synchronization_undoes_the_period_and_the_run_recovers(results: list[dict], case: str) -> None:
    want = reference(case)
    for rank in range(WORLD):
        run = results[rank][case]
        _check(run["steps"], want, rank, case)
        assert run["skipped_steps"] == 1, f"{case} rank {rank}: {run['skipped_steps']} synchronizations dropped"
    final = [results[r][case]["steps"][-1] for r in range(WORLD)]
    for rank in range(WORLD):  # the run is alive: finite everywhere at the end, the optimizer state included
        for k, v in {**final[rank], **results[rank][case]["state"]}.items():
            assert torch.isfinite(v.double()).all(), f"{case} rank {rank}: {k} not finite at the end: {v}"


@pytest.mark.parametrize("case", IN_THE_COPY)
def test_a_fault_already_in_the_copy_drops_nothing(results: list[dict], case: str) -> None:
    """An Inf Adam moment from the synchronous phase (a finite 1e200 gradient, averaged: the same step on every
    rank) is in every rank's copy taken at the switch: restoring it cannot help, so nothing is dropped (the first
    version of the check dropped every later synchronization: the replicas never met again)."""
    want = reference(case)
    for rank in range(WORLD):
        run = results[rank][case]
        _check(run["steps"], want, rank, case)
        assert run["skipped_steps"] == 0, f"{case} rank {rank}: {run['skipped_steps']} synchronizations dropped"


@pytest.mark.parametrize("case", IN_THE_COPY_AND_NEW)
def test_a_fault_in_the_copy_does_not_hide_a_new_one_in_another_tensor(results: list[dict], case: str) -> None:
    """The Inf Adam moment of the synchronous phase is in every rank's copy (it stays, nothing to undo); then rank
    0's BatchNorm running variance goes Inf (finite parameters): its synchronization is dropped and undone, since
    that tensor's copy is finite. With the copy asked as a whole it went through (local SGD averaged the Inf
    buffer, or in the first version of this case an Inf moment, into both ranks for good)."""
    want = reference(case)
    for rank in range(WORLD):
        run = results[rank][case]
        _check(run["steps"], want, rank, case)
        assert run["skipped_steps"] == 1, f"{case} rank {rank}: {run['skipped_steps']} synchronizations dropped"
        for k, v in run["steps"][-1].items():  # the buffers recovered (the Inf moment stays, as in the copy)
            assert torch.isfinite(v.double()).all(), f"{case} rank {rank}: {k} not finite at the end: {v}"


@pytest.mark.parametrize("case", RAISES)
def test_raise_fails_on_every_rank_naming_a_non_finite_optimizer_state_or_buffer(results: list[dict],
                                                                                 case: str) -> None:
    """``nonfinite='raise'`` with finite parameters but rank 0's Adam moment or BatchNorm variance Inf: every rank
    raises the same FloatingPointError at the synchronization that would carry it (or, with the state kept local,
    leave it in that rank for good), naming the tensor; every rank leaves its collectives (the spawn goes on to
    the next case). It went through: the raise mode looked at the exchanged values only."""
    step, named = RAISES[case]
    got = [results[rank][f"raise/{case}"] for rank in range(WORLD)]
    for rank, run in enumerate(got):
        assert run["error"] is not None, f"{case} rank {rank}: nothing raised"
        assert run["step"] == step, f"{case} rank {rank}: raised at step {run['step']}, want {step}: {run['error']}"
        assert named in run["error"] and "nonfinite='raise'" in run["error"], f"{case} rank {rank}: {run['error']}"
    assert got[0]["error"] == got[1]["error"], got


@pytest.mark.parametrize("case", ["localsgd", "diloco"])
def test_a_checkpoint_without_the_copy_resumes_with_the_loaded_state_as_the_copy(results: list[dict],
                                                                                  case: str) -> None:
    """A checkpoint written before 2026-12 (no copy) at a synchronization, resumed; the Inf comes in the first
    period after it. The copy used to be the one taken at construction (a fresh optimizer's empty state and
    the new model's buffers): the dropped synchronization reset Adam/momentum and BatchNorm statistics. The
    loaded state is the copy (exact at a synchronization): the run goes on as the uninterrupted one."""
    want = reference(case)
    for rank in range(WORLD):
        resumed, whole = results[rank][f"resumed/{case}"], results[rank][case]
        _check(resumed["steps"], want, rank, f"resumed {case}", RESUME_AT)
        for step, (got, ref) in enumerate(zip(resumed["steps"], whole["steps"][RESUME_AT:]), RESUME_AT):
            for k in ref:  # bit for bit (the NaN of the diverged step included)
                torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, equal_nan=True,
                                           msg=f"resumed {case} rank {rank} step {step} {k}: not bit for bit")


@pytest.mark.parametrize("optimizer", ["adam", "adam-capturable", "adagrad", "rprop"])
def test_a_loaded_copy_is_placed_as_the_optimizers_own_load_state_dict_places_its_state(optimizer: str) -> None:
    """``gradpress train`` loads checkpoints with ``map_location='cpu'``: the copy's tensors came back on the CPU
    and a dropped synchronization put them into the optimizer of a CUDA model (its next step failed on mixed
    devices). They go where ``Optimizer.load_state_dict`` puts the same values: the parameter's device and
    dtype (float32 moments of a float64 parameter become float64), a step count on the CPU unless
    ``capturable``/``fused`` (Adagrad's groups have no ``capturable``: not capturable; Rprop's ``step_size`` is a
    per-element tensor, not a step count). (``meta`` stands for the accelerator.)"""
    from gradpress.algorithms.restart import LocalCopy

    def make() -> torch.optim.Optimizer:
        if optimizer in ("adagrad", "rprop"):
            return torch.optim.Adagrad([p]) if optimizer == "adagrad" else torch.optim.Rprop([p])
        return torch.optim.Adam([p], capturable=optimizer == "adam-capturable")

    p = nn.Parameter(torch.empty(3, dtype=torch.float64, device="meta"))
    buf = torch.zeros(2, device="meta")
    moments = {"adagrad": ("sum",), "rprop": ("prev", "step_size")}.get(optimizer, ("exp_avg", "exp_avg_sq"))
    saved = {"step": torch.tensor(3.0), **{k: torch.ones(3, dtype=torch.float32) for k in moments}}
    opt = make()
    copy = LocalCopy(opt, [p], [buf])
    copy.load_state_dict({"states": [saved], "buffers": [torch.zeros(2)]}, "diloco")
    copy.restore()
    want = make()  # the reference: torch's own placement
    want.load_state_dict({"state": {0: saved}, "param_groups": want.state_dict()["param_groups"]})
    assert set(opt.state[p]) == set(want.state[p])
    for k, w in want.state[p].items():
        got = opt.state[p][k]
        assert (got.device, got.dtype) == (w.device, w.dtype), f"{k}: on {got.device} {got.dtype}, want {w.device} {w.dtype}"


def test_a_saved_copy_loads_into_a_model_of_many_tensors_and_one_of_another_model_is_refused() -> None:
    """The copy's ``state_dict`` round-trips for a model of 300 parameter tensors (its check compared the counts,
    not their identity: beyond 256 two equal counts are distinct ints), and one of another model (a tensor
    fewer, or other buffer shapes) is refused with an error naming the algorithm."""
    from gradpress.algorithms.restart import LocalCopy

    params = [nn.Parameter(torch.full((2,), float(i), dtype=F64)) for i in range(300)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    copy = LocalCopy(opt, params, [torch.zeros(3, dtype=F64)])
    copy.take()
    state = copy.state_dict()
    other = LocalCopy(opt, params, [torch.ones(3, dtype=F64)])
    other.load_state_dict(state, "localsgd")
    assert all(torch.equal(a["momentum_buffer"], b["momentum_buffer"]) for a, b in zip(other.states, copy.states))
    assert torch.equal(other.saved_buffers[0], torch.zeros(3, dtype=F64))
    for bad in ({**state, "states": state["states"][:-1]}, {**state, "buffers": [torch.zeros(4, dtype=F64)]}):
        with pytest.raises(ValueError, match="localsgd state: the copy of the optimizer state and buffers"):
            other.load_state_dict(bad, "localsgd")


@pytest.mark.parametrize("mode", ["propagate", "raise", "skip"])
def test_only_skip_keeps_a_copy(mode: str) -> None:
    """The copy (and its cost) exists with ``nonfinite='skip'`` only, the alarm with ``raise`` only; without an
    engine (one process) neither."""
    from types import SimpleNamespace

    from gradpress.algorithms.alarm import StateAlarm
    from gradpress.algorithms.restart import LocalCopy

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = SimpleNamespace(engine=SimpleNamespace(nonfinite=mode), optimizer=opt, model=model,
                           named=list(model.named_parameters()))
    copy = LocalCopy.for_skip(algo)  # type: ignore[arg-type]
    assert (copy is not None) == (mode == "skip"), f"{mode}: {copy}"
    assert LocalCopy.for_skip(SimpleNamespace(engine=None)) is None  # type: ignore[arg-type]
    alarm = StateAlarm.for_raise(algo)  # type: ignore[arg-type]  # and the raise mode's check with raise only
    assert (alarm is not None) == (mode == "raise"), f"{mode}: {alarm}"
    assert StateAlarm.for_raise(SimpleNamespace(engine=None)) is None  # type: ignore[arg-type]
