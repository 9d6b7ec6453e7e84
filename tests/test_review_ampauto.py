"""The Lightning and Accelerate integrations follow the framework's own loss scaler (2 gloo workers, one launch).

A user of fp16 autocast who did not hand the framework's ``GradScaler`` to the hook got residuals fed back off
by new/old at every scale change, silently. Now ``GradpressStrategy`` attaches its precision plugin's
``scaler`` (``MixedPrecision("16-mixed", ...)``) and ``gradpress.accelerate.register`` the accelerator's
(``accelerator.scaler``) when the user gives none; an explicit scaler is kept (a warning when it is not the
framework's: the framework scales the loss with its own).

On CPU neither framework makes a scaler by itself in the installed versions (Lightning turns
``precision="16-mixed"`` on CPU into ``bf16-mixed``; Accelerate leaves ``accelerator.scaler`` None for fp16 on
CPU), so the workers build them as a GPU run has them: ``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))``
and ``accelerator.scaler = GradScaler("cpu")`` before ``prepare`` (which hands it to the optimizer).

Every gradient is a fixed G times the loss scale (``w.grad`` of ``sum(w * G)``; the scales are powers of two),
rank 1's holding an Inf at step 4: the scale grows x2 twice and backs off x0.5 once (``growth_interval=2``),
as in tests/test_review_ampscale.py. Checked: the unscaled averages of top-k with error feedback equal its
float64 definition without loss scaling (computed here), and ``hook.loss_scale`` is the scale of the last
backward. The refusals (no training): ``nonfinite="skip"`` with the framework's scaler fails before training
starts naming both (Lightning at ``Trainer(...)``, Accelerate at ``register``). ``attach_trainer``'s callback, on a
stand-in Trainer with a real DDP model, follows ``trainer.accelerator.scaler`` and refuses ``skip`` with it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
from amp_helpers import check_unscaled_averages, grown_and_backed_off
from distributed import run_workers
from references import error_feedback_topk_run

SHAPE = (16, 32)
MIN_NUMEL = 64
STEPS = 8
OVERFLOW = 4
RATIO = 0.05
TOPK = f"topk:ratio={RATIO}"
INIT_SCALE = 2.0**10
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="no torch.amp.GradScaler for CPU")]


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank))
    if rank == 1 and step == OVERFLOW:
        g[3, 5] = math.inf
    return g


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def _lightning(rank: int, explicit: bool) -> dict:
    """A Lightning fit of STEPS steps; the plugin's scaler is the hook's only through the strategy
    (``explicit``: also given as ``options={"scaler": ...}``, the documented way before)."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from gradpress.lightning import GradpressStrategy

    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning launches nothing
    scaler = _scaler()
    out: dict = {"grads": [], "scales": []}

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(SHAPE))
            self.calls = 0

        def training_step(self, batch, batch_idx):  # noqa: ANN001,ANN201
            g = _grad(rank, self.calls)
            self.calls += 1
            return (self.w * g).sum()

        def on_after_backward(self) -> None:  # averaged, still scaled; the scale of this backward
            out["grads"].append(self.w.grad.double().clone())
            out["scales"].append(scaler.get_scale())

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.0)

    options = {"min_numel": MIN_NUMEL, **({"scaler": scaler} if explicit else {})}
    strategy = GradpressStrategy(TOPK, options=options)
    trainer = L.Trainer(strategy=strategy, plugins=[MixedPrecision("16-mixed", "cpu", scaler)], devices=2,
                        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Probe(), DataLoader(list(range(2 * STEPS)), batch_size=1))
    out["loss_scale"] = strategy.gradpress_state.loss_scale
    strategy.gradpress_state.close()
    return out


def _accelerate(rank: int) -> dict:
    """An Accelerate loop of STEPS steps; the hook is registered without a scaler."""
    from accelerate import Accelerator

    import gradpress.accelerate

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = _scaler()  # what Accelerate makes for mixed_precision="fp16" on a GPU
    w = nn.Parameter(torch.zeros(SHAPE))
    module = nn.Module()
    module.w = w
    module.forward = lambda g: (module.w * g).sum()
    opt = torch.optim.SGD([w], lr=0.0)
    model, opt = accelerator.prepare(module, opt)
    hook = gradpress.accelerate.register(accelerator, model, TOPK, min_numel=MIN_NUMEL)
    out: dict = {"grads": [], "scales": []}
    for step in range(STEPS):
        accelerator.backward(model(_grad(rank, step)))
        out["grads"].append(module.w.grad.double().clone())
        out["scales"].append(accelerator.scaler.get_scale())
        opt.step()
        opt.zero_grad()
    out["loss_scale"] = hook.loss_scale
    hook.close()
    return out


def _refusals(rank: int) -> dict:
    """``nonfinite='skip'`` with the framework's scaler: refused before training, naming both."""
    out: dict = {}
    if HAVE_LIGHTNING:
        import lightning as L
        from lightning.pytorch.plugins.precision import MixedPrecision

        from gradpress.lightning import GradpressStrategy

        try:
            L.Trainer(strategy=GradpressStrategy(TOPK, options={"nonfinite": "skip"}),
                      plugins=[MixedPrecision("16-mixed", "cpu", _scaler())], devices=2, accelerator="cpu",
                      logger=False)
            out["lightning"] = "accepted"
        except ValueError as exc:
            out["lightning"] = str(exc)
    if HAVE_ACCELERATE:
        from accelerate import Accelerator

        import gradpress.accelerate

        accelerator = Accelerator(cpu=True)
        accelerator.scaler = _scaler()
        model = accelerator.prepare(nn.Linear(16, 16))
        try:
            gradpress.accelerate.register(accelerator, model, TOPK, nonfinite="skip").close()
            out["accelerate"] = "accepted"
        except ValueError as exc:
            out["accelerate"] = str(exc)
        accelerator.scaler = None  # a run without a framework scaler keeps skip
        gradpress.accelerate.register(accelerator, accelerator.prepare(nn.Linear(16, 16)), TOPK,
                                      nonfinite="skip").close()
    return out


def _trainer_callback(rank: int) -> dict:
    """``attach_trainer``'s callback on a stand-in Trainer (the attributes gradpress reads): the hook it registers
    follows ``trainer.accelerator.scaler``; with ``nonfinite='skip'`` it is refused naming that scaler."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpress.accelerate

    out: dict = {}
    for label, options in (("follows", {}), ("skip", {"nonfinite": "skip"})):
        scaler = _scaler()
        trainer = SimpleNamespace(model_wrapped=DDP(nn.Linear(16, 16)), accelerator=SimpleNamespace(scaler=scaler),
                                  callback_handler=SimpleNamespace(callbacks=[]))
        callback = gradpress.accelerate.attach_trainer(trainer, TOPK, **options)
        args = SimpleNamespace(parallel_mode="ParallelMode.DISTRIBUTED", output_dir="unused")
        try:
            callback.on_train_begin(args, SimpleNamespace(global_step=0), None)
            out[label] = callback.hook.scaler is scaler
            callback.hook.close()
        except ValueError as exc:
            out[label] = str(exc)
    return out


def _workers(rank: int, world: int) -> dict:
    out: dict = {"refusals": _refusals(rank)}
    if importlib.util.find_spec("transformers") is not None:
        out["trainer"] = _trainer_callback(rank)
    if HAVE_LIGHTNING:
        out["lightning"] = _lightning(rank, explicit=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["lightning_explicit"] = _lightning(rank, explicit=True)
        out["explicit_warnings"] = [str(w.message) for w in caught if "scaler" in str(w.message)]
    if HAVE_ACCELERATE:
        out["accelerate"] = _accelerate(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    if not (HAVE_LIGHTNING or HAVE_ACCELERATE):
        pytest.skip("neither PyTorch Lightning nor Accelerate is installed")
    return run_workers(_workers, 2)


def _reference(world: int) -> list[torch.Tensor | None]:
    """Error-feedback top-k by the definition, in float64, without any loss scale (None at the overflow step,
    which leaves every residual as it was)."""
    return error_feedback_topk_run(_grad, world, STEPS, RATIO)


def _check_follows(run: dict, rank: int, what: str) -> None:
    assert run["scales"] == grown_and_backed_off(INIT_SCALE), (what, run["scales"])
    check_unscaled_averages(run, _reference(2), f"{what} rank {rank}")
    assert run["loss_scale"] == run["scales"][-1], (what, run["loss_scale"], run["scales"][-1])


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="PyTorch Lightning is not installed")
@pytest.mark.parametrize("run", ["lightning", "lightning_explicit"])
def test_lightning_strategy_follows_the_precision_plugins_scaler(results: list[dict], run: str) -> None:
    for rank, res in enumerate(results):
        _check_follows(res[run], rank, run)
        assert res["explicit_warnings"] == [], res["explicit_warnings"]  # the same scaler: nothing to say


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="Accelerate is not installed")
def test_accelerate_register_follows_the_accelerators_scaler(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        _check_follows(res["accelerate"], rank, "accelerate")


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_skip_with_the_frameworks_scaler_is_refused_naming_both(results: list[dict], framework: str) -> None:
    if framework not in results[0]["refusals"]:
        pytest.skip(f"{framework} is not installed")
    where = {"lightning": "precision plugin", "accelerate": "accelerator.scaler"}[framework]
    for res in results:
        msg = res["refusals"][framework]
        assert "nonfinite='skip'" in msg and where in msg and "propagate" in msg, msg


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="PyTorch Lightning is not installed")
def test_lightning_explicit_scaler_other_than_the_plugins_is_kept_with_a_warning() -> None:
    """No process starts: the Trainer sets its plugin on the strategy as it is made."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from gradpress.lightning import GradpressStrategy

    mine, plugins = _scaler(), _scaler()
    strategy = GradpressStrategy(TOPK, options={"scaler": mine})
    with pytest.warns(UserWarning, match=r"not the precision plugin's loss scaler \(MixedPrecision"):
        L.Trainer(strategy=strategy, plugins=[MixedPrecision("16-mixed", "cpu", plugins)], devices=2,
                  accelerator="cpu", logger=False)
    assert strategy.gradpress_state.scaler is mine and strategy._plugin_scaler() is mine
    strategy.gradpress_state.close()


def test_trainer_callback_follows_the_trainers_scaler_and_refuses_skip(results: list[dict]) -> None:
    if "trainer" not in results[0]:
        pytest.skip("Transformers is not installed")
    for res in results:
        assert res["trainer"]["follows"] is True, res["trainer"]
        msg = res["trainer"]["skip"]
        assert "nonfinite='skip'" in msg and "trainer.accelerator.scaler" in msg, msg
