"""The integrations with a model whose branch is unused on some steps, as
their users set ``find_unused_parameters=True``: Lightning's
``GradpressStrategy(..., find_unused_parameters=True)`` (beside Lightning's
own ``strategy="ddp_find_unused_parameters_true"``), Accelerate's
``DistributedDataParallelKwargs(find_unused_parameters=True)`` with
``gradpress.accelerate.register``, and the Transformers ``Trainer``
(``ddp_find_unused_parameters=True``; also its default for a model that is
not a ``PreTrainedModel``) with ``attach_trainer``. 2 CPU processes under
``torchrun`` (gloo), one launch per framework, 4 steps.

The branch ``b`` is used on steps 0 and 3 by both ranks, on step 1 by none,
on step 2 by rank 0 only. Each launch trains the same model three times on
the same data: plain DDP of the framework, gradpress ``none`` and gradpress
top-k + error feedback. Checked against what the test computes itself:

* ``none``: every gradient after each backward (value, dtype, or None) and
  the final parameters equal plain DDP's, bit for bit;
* top-k: the float64 definition from each rank's own gradient (autograd on
  the bare module inside the step, where DDP's hooks do not fire), as in
  tests/test_ddp_models.py: ``p = fp32(e + g)``, ``e <- p - topk(p)``, the
  mean of the ranks' ``topk(p)``; at step 1 ``b``'s gradient is what plain
  DDP leaves (None) and its residual does not move, which needs the hook to
  see the DDP model's ``find_unused_parameters`` (without it ``b``'s
  residual is sent and DDP discards it); and no "got no gradient" warning.

This file is also the worker script (``torchrun ... this_file FRAMEWORK OUT``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings

import pytest

SPEC, RATIO, MIN_NUMEL = "topk:ratio=0.25", 0.25, 16
STEPS, BATCH = 4, 4
RUNS = ("plain", "none", "topk")


def _uses(step: int, rank: int) -> bool:
    return step != 1 and (step != 2 or rank == 0)


def _layers():  # noqa: ANN202
    import torch
    import torch.nn as nn

    torch.manual_seed(7)
    return nn.Linear(8, 12), nn.Linear(12, 12), nn.Linear(12, 4)


def _net(a, b, c, x, use: bool):  # noqa: ANN001,ANN202
    import torch

    h = torch.tanh(a(x))
    if use:
        h = h + b(h)
    return c(h)


def _data(rank: int):  # noqa: ANN202
    """This rank's STEPS x BATCH samples (x, y), in step order."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(STEPS * BATCH, 8, generator=g), torch.randn(STEPS * BATCH, 4, generator=g)


class _Recorder:
    """Per step: this rank's own gradient (float64, autograd on the bare
    module), the gradients after the synced backward, the residuals."""

    def __init__(self) -> None:
        self.local: list[dict] = []
        self.grads: list[dict] = []
        self.residuals: list[dict] = []

    def own(self, module, x, y, use: bool) -> None:  # noqa: ANN001
        import torch
        import torch.nn.functional as F

        named = [(n, p) for n, p in module.named_parameters()]
        loss = F.mse_loss(_net(module.a, module.b, module.c, x, use), y)
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        self.local.append({n: None if g is None else g.double() for (n, _), g in zip(named, grads)})

    def synced(self, module, hook) -> None:  # noqa: ANN001
        self.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()})
        self.residuals.append({} if hook is None else {k: v.double().clone() for k, v in hook.memory.residuals.items()})

    def result(self, module) -> dict:  # noqa: ANN001
        return {"local": self.local, "grads": self.grads, "residuals": self.residuals,
                "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


# --------------------------------------------------------------------------- workers
def _lightning(out: str) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from gradpress.lightning import GradpressStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = _layers()
            self.rec = _Recorder()

        def training_step(self, batch, batch_idx):  # noqa: ANN001,ANN201
            x, y = batch
            use = _uses(batch_idx, self.global_rank)
            self.rec.own(self, x, y, use)
            return F.mse_loss(_net(self.a, self.b, self.c, x, use), y)

        def on_after_backward(self) -> None:
            self.rec.synced(self, getattr(self.trainer.strategy, "gradpress_state", None))

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rank = int(os.environ["RANK"])
    x, y = _data(rank)
    # each rank's own samples, in order (Lightning's DistributedSampler would split one data set)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    result = {}
    for run in RUNS:
        strategy = ("ddp_find_unused_parameters_true" if run == "plain" else
                    GradpressStrategy(SPEC if run == "topk" else "none", options={"min_numel": MIN_NUMEL, "timeout": 60},
                                      find_unused_parameters=True))
        trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=STEPS, logger=False,
                            use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        net = Net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(net, loader)
        result[run] = {**net.rec.result(net), "warnings": [str(w.message) for w in caught]}
    torch.save(result, os.path.join(out, f"lightning-rank{rank}.pt"))


def _accelerate(out: str) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from accelerate import Accelerator, DistributedDataParallelKwargs

    import gradpress.accelerate

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = _layers()

        def forward(self, x, use: bool):  # noqa: ANN001,ANN201
            return _net(self.a, self.b, self.c, x, use)

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    rank = accelerator.process_index
    x, y = _data(rank)
    result = {}
    for run in RUNS:
        module = Net()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        model, opt = accelerator.prepare(module, opt)
        hook = None if run == "plain" else gradpress.accelerate.register(
            accelerator, model, SPEC if run == "topk" else "none", min_numel=MIN_NUMEL, timeout=60)
        rec = _Recorder()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
                use = _uses(step, rank)
                rec.own(module, xb, yb, use)
                accelerator.backward(F.mse_loss(model(xb, use), yb))
                rec.synced(module, hook)
                opt.step()
                opt.zero_grad()
        result[run] = {**rec.result(module), "warnings": [str(w.message) for w in caught]}
        if hook is not None:
            hook.close()
    torch.save(result, os.path.join(out, f"accelerate-rank{rank}.pt"))


def _trainer(out: str) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import gradpress.accelerate

    rank = int(os.environ["RANK"])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = _layers()
            self.calls = 0
            self.rec = _Recorder()

        def forward(self, x, labels):  # noqa: ANN001,ANN201
            use = _uses(self.calls, rank)
            self.calls += 1
            self.rec.own(self, x, labels, use)
            return {"loss": F.mse_loss(_net(self.a, self.b, self.c, x, use), labels)}

    class Synced(TrainerCallback):
        def __init__(self, net: Net, gp) -> None:  # noqa: ANN001
            self.net, self.gp = net, gp

        def on_pre_optimizer_step(self, args, state, control, **kw):  # noqa: ANN001,ANN201
            self.net.rec.synced(self.net, None if self.gp is None else self.gp.hook)

    x, y = _data(rank)
    # both ranks see the same samples list; the Trainer's sampler gives each its own in a seeded order
    data = [{"x": a, "labels": b} for a, b in zip(x, y)]
    result = {}
    for run in RUNS:
        net = Net()
        args = TrainingArguments(output_dir=os.path.join(out, run), use_cpu=True, ddp_backend="gloo",
                                 ddp_find_unused_parameters=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
                                 learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0,
                                 weight_decay=0.0, save_strategy="no", logging_strategy="no", report_to=[],
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=net, args=args, train_dataset=data)
        gp = None if run == "plain" else gradpress.accelerate.attach_trainer(
            trainer, SPEC if run == "topk" else "none", min_numel=MIN_NUMEL, timeout=60)
        trainer.add_callback(Synced(net, gp))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        result[run] = {**net.rec.result(net), "warnings": [str(w.message) for w in caught],
                       "find_unused": bool(trainer.model_wrapped.find_unused_parameters)}
        if gp is not None:
            gp.hook.close()
    torch.save(result, os.path.join(out, f"trainer-rank{rank}.pt"))


# --------------------------------------------------------------------------- the tests
HAVE = {"lightning": ("lightning",), "accelerate": ("accelerate",), "trainer": ("accelerate", "transformers")}
pytestmark = pytest.mark.slow
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None


def _launch(framework: str, out) -> list[dict]:  # noqa: ANN001
    import torch
    from distributed import free_port
    from integration_helpers import run_command

    missing = [m for m in HAVE[framework] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install 'gradpress[lightning,accelerate]')")
    run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), __file__, framework, str(out)], timeout=150)
    return [torch.load(out / f"{framework}-rank{r}.pt", weights_only=True) for r in range(2)]


def _check(ranks: list[dict]) -> None:
    import torch
    from references import error_feedback_topk_mean  # float64, top-k ties to the lower index

    for r, res in enumerate(ranks):
        plain, none = res["plain"], res["none"]
        assert len(plain["grads"]) == len(none["grads"]) == STEPS, f"rank {r}: {len(none['grads'])} steps"
        for step, (want, got) in enumerate(zip(plain["grads"], none["grads"])):
            for n, g in want.items():
                assert (got[n] is None) == (g is None), f"rank {r} step {step} {n}: None differs from plain DDP"
                assert g is None or (got[n].dtype == g.dtype and torch.equal(got[n], g)), f"rank {r} step {step} {n}"
        for n, p in plain["params"].items():
            assert torch.equal(none["params"][n], p), f"rank {r} {n}"
        for run in ("none", "topk"):
            assert not [w for w in res[run]["warnings"] if "got no gradient" in w], res[run]["warnings"]
    assert ranks[0]["plain"]["grads"][1]["b.weight"] is None  # DDP's rule at the step no rank used b

    runs = [res["topk"] for res in ranks]
    names = list(runs[0]["local"][0])
    shapes = {n: p.shape for n, p in runs[0]["params"].items()}
    residual = [{n: torch.zeros(shapes[n], dtype=torch.float64) for n in names} for _ in runs]
    for step in range(STEPS):
        for n in names:
            local = [run["local"][step][n] for run in runs]
            got = [run["grads"][step][n] for run in runs]
            where = f"step {step} {n}"
            assert (got[0] is None) == (got[1] is None) and (got[0] is None or torch.equal(got[0], got[1])), where
            compressed = len(shapes[n]) > 1 and math.prod(shapes[n]) >= MIN_NUMEL
            if all(g is None for g in local):  # no rank used it: plain DDP leaves it (None here)
                assert got[0] is None, where
            else:
                g = [x if x is not None else torch.zeros(shapes[n], dtype=torch.float64) for x in local]
                want = error_feedback_topk_mean(residual, g, n, RATIO) if compressed else sum(g) / len(g)
                err = (got[0].double() - want).abs().max().item()
                assert err <= 4 * 2.0**-23 * want.abs().max().item(), f"{where}: {err} from the reference"
            if compressed:
                for rank, run in enumerate(runs):
                    assert torch.equal(run["residuals"][step][n], residual[rank][n]), f"{where} rank {rank}: residual"
    assert residual[0]["b.weight"].abs().sum() > 0  # step 1 had a residual of b to lose


@pytest.mark.long  # 16 s on 2 busy cores (Lightning's import, 3 fits); the next test covers its binding in 1 process
def test_lightning_strategy_with_find_unused_parameters(tmp_path) -> None:
    _check(_launch("lightning", tmp_path))


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="needs PyTorch Lightning")
def test_lightning_strategy_binds_to_the_ddp_model_it_builds(tmp_path) -> None:
    """``GradpressStrategy.configure_ddp`` on a 1-rank group: the state sees
    ``find_unused_parameters`` of the DDP model Lightning built, so at the step
    where ``b`` is unused its gradient stays None, its residual does not move,
    and nothing warns."""
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch import LightningModule
    from lightning.pytorch.accelerators import CPUAccelerator

    from gradpress import torch_compat
    from gradpress.lightning import GradpressStrategy

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = _layers()

        def forward(self, x, use: bool):  # noqa: ANN001,ANN201
            return _net(self.a, self.b, self.c, x, use)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    strategy = GradpressStrategy(SPEC, options={"min_numel": MIN_NUMEL}, find_unused_parameters=True,
                                 accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")],
                                 cluster_environment=LightningEnvironment())
    try:
        strategy.model = net = Net()
        strategy.configure_ddp()
        assert isinstance(strategy.model, torch.nn.parallel.DistributedDataParallel)
        residuals = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, use in enumerate((True, False)):
                net.zero_grad()
                x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(step))
                strategy.model(x, use).square().mean().backward()
                residuals.append(strategy.gradpress_state.memory.residuals["b.weight"].clone())
        assert net.b.weight.grad is None
        assert residuals[0].abs().sum() > 0 and torch.equal(residuals[1], residuals[0])
        assert not [w for w in caught if "got no gradient" in str(w.message)]
    finally:
        strategy.gradpress_state.close()
        torch_compat.destroy_process_group()


def test_accelerate_with_find_unused_parameters(tmp_path) -> None:
    _check(_launch("accelerate", tmp_path))


@pytest.mark.long  # 11 s on 2 busy cores; gradpress.ddp.register on the DDP model as the previous test (10 s)
def test_trainer_with_find_unused_parameters(tmp_path) -> None:
    ranks = _launch("trainer", tmp_path)
    assert all(res[run]["find_unused"] for res in ranks for run in RUNS)
    _check(ranks)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    {"lightning": _lightning, "accelerate": _accelerate, "trainer": _trainer}[sys.argv[1]](sys.argv[2])
    from integration_helpers import leave

    leave()
