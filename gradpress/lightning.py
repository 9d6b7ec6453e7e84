"""gradpress from PyTorch Lightning (``pip install gradpress[lightning]``).

Two lines::

    from gradpress.lightning import GradpressCallback, GradpressStrategy
    trainer = L.Trainer(strategy=GradpressStrategy("topk:ratio=0.01"), callbacks=[GradpressCallback()],
                        devices=2, accelerator="cpu")

:class:`GradpressStrategy` is Lightning's ``DDPStrategy`` with the gradpress
comm hook registered on the DDP model it builds, on CPU (gloo) as on GPU
(Lightning's own ``ddp_comm_hook`` argument is applied on CUDA only). The
hook state binds to the LightningModule's parameters (keys are their names).
Under fp16 mixed precision it follows the precision plugin's loss scaler
(``MixedPrecision("16-mixed", ...).scaler``, which scales the loss) unless
the hook was given a scaler: the plugin is the Trainer's, set on the
strategy when the Trainer is made (after the hook state), so the scaler is
checked there (``nonfinite`` other than ``propagate`` is refused at once)
and attached in ``configure_ddp``, before the state binds.

:class:`GradpressCallback` checkpoints the compression state inside
Lightning's checkpoint (``on_save_checkpoint``: every rank's state, gathered,
under ``checkpoint["gradpress"]``; ``on_load_checkpoint``: each rank takes its
own back, so residuals survive a resume) and logs ``hook.stats`` through
Lightning's logger (tags of :data:`gradpress.tensorboard.STATS_TAGS`).

Lightning is imported by this module only, never at ``import gradpress``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradpress.lightning needs PyTorch Lightning: pip install 'gradpress[lightning]'") from exc

from gradpress.compress import Compressor
from gradpress.ddp import GradpressHook, make_hook
from gradpress.ddp.hook import gradpress_hook
from gradpress.ddp.loss_scale import framework_scaler
from gradpress.ddp.ranks import gather_states, load_rank_state
from gradpress.tensorboard import stats_scalars

__all__ = ["GradpressStrategy", "GradpressCallback", "CHECKPOINT_KEY"]

#: where the compression state (:func:`gradpress.ddp.ranks.gather_states`) lives in a Lightning checkpoint
CHECKPOINT_KEY = "gradpress"


class GradpressStrategy(DDPStrategy):
    """``DDPStrategy`` that compresses gradients with gradpress.

    ``compressor``: a spec (``"topk:ratio=0.01"``), a compressor, or a state
    from :func:`gradpress.ddp.make_hook` (unbound, or bound to this model).
    ``options``: keywords of :func:`gradpress.ddp.make_hook` (``strategy``,
    ``error_feedback``, ``min_numel``, ``seed``, ``nonfinite``, ``timeout``,
    ...; ``scaler`` defaults to the precision plugin's). Other keywords go to ``DDPStrategy``.
    ``gradpress_state`` is the hook state (its ``stats``, ``state_dict``)."""

    strategy_name = "gradpress"

    def __init__(self, compressor: str | Compressor | GradpressHook = "none", *,
                 options: Mapping[str, Any] | None = None, **ddp_kwargs: Any) -> None:
        for reserved in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if reserved in ddp_kwargs:
                raise ValueError(f"GradpressStrategy: {reserved} is set by gradpress; pass the compressor instead")
        self.gradpress_state: GradpressHook | None = None  # the precision_plugin setter reads it
        super().__init__(**ddp_kwargs)
        if isinstance(compressor, GradpressHook):
            if options:
                raise ValueError("GradpressStrategy: options apply to a spec, not to a ready hook state")
            self.gradpress_state = compressor
        else:
            self.gradpress_state, _ = make_hook(compressor, **dict(options or {}))
        self._plugin_scaler(warn=True)  # a precision_plugin= among ddp_kwargs

    @property
    def precision_plugin(self) -> Any:
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        """Lightning's (the Trainer sets the plugin here as it is made): a loss scaler it has is checked at once."""
        DDPStrategy.precision_plugin.fset(self, plugin)
        self._plugin_scaler(warn=True)

    def _plugin_scaler(self, warn: bool = False) -> Any:
        """The scaler the hook follows: its own if it was given one, else the precision plugin's (None
        without); ``ValueError`` when the plugin has one and ``nonfinite`` is not ``propagate``."""
        state = self.gradpress_state
        if state is None:
            return None
        plugin = self._precision_plugin
        source = (f"the precision plugin's loss scaler ({type(plugin).__name__}(precision="
                  f"{getattr(plugin, 'precision', '?')!r}).scaler)")
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("ignore")
            return framework_scaler(state.scaler, getattr(plugin, "scaler", None), state.nonfinite,
                                    "GradpressStrategy", source)

    def configure_ddp(self) -> None:
        """Wrap in DDP (Lightning), attach the precision plugin's loss scaler to the hook state unless it
        has one, bind the state to the module (collective: the ranks agree on the scaler too) and register it."""
        super().configure_ddp()
        scaler = self._plugin_scaler()
        if scaler is not None and scaler is not self.gradpress_state.scaler:
            self.gradpress_state.attach_scaler(scaler)
        self.gradpress_state.bind(self.model)
        self.model.register_comm_hook(self.gradpress_state, gradpress_hook)


class GradpressCallback(Callback):
    """Checkpoints the gradpress state with Lightning's checkpoints and logs
    its stats. ``state``: the hook state (default: the trainer's
    :class:`GradpressStrategy`'s). ``log_stats``: log the stats each training step
    (Lightning's ``log_every_n_steps`` decides what reaches the logger).
    ``reshard``: a checkpoint written on another number of processes is loaded
    with the saved ranks' states folded into this run's
    (:mod:`gradpress.exchange.reshard`); refused otherwise."""

    def __init__(self, state: GradpressHook | None = None, *, log_stats: bool = True, reshard: bool = False) -> None:
        self.state = state
        self.log_stats = log_stats
        self.reshard = bool(reshard)

    def _state(self, trainer: Any) -> GradpressHook:
        if self.state is not None:
            return self.state
        state = getattr(trainer.strategy, "gradpress_state", None)
        if not isinstance(state, GradpressHook):
            raise ValueError(f"GradpressCallback: the trainer's strategy is {type(trainer.strategy).__name__}, "
                             "not GradpressStrategy; use strategy=GradpressStrategy(...) or pass state=")
        return state

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state = self._state(trainer)
        if self.log_stats and state.bound:
            pl_module.log_dict(stats_scalars(state.stats), on_step=True, on_epoch=False, sync_dist=False)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Every rank's state (residuals differ between ranks), gathered on
        gradpress's own group: Lightning calls this on every rank and writes
        rank 0's dictionary."""
        state = self._state(trainer)
        if state.bound:  # else nothing has been exchanged: nothing to keep
            checkpoint[CHECKPOINT_KEY] = gather_states(state)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """This rank's state back into the hook (kept until the hook binds
        when Lightning restores before wrapping the model)."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:  # e.g. a plain-DDP checkpoint: there is no compression state to lose
            warnings.warn(f"GradpressCallback: the checkpoint has no {CHECKPOINT_KEY!r} entry (written without "
                          "GradpressCallback); compression starts with empty residuals", stacklevel=2)
            return
        load_rank_state(self._state(trainer), saved, trainer.global_rank, trainer.world_size,
                        where=f"Lightning checkpoint[{CHECKPOINT_KEY!r}]", reshard=self.reshard,
                        option="GradpressCallback(reshard=True)")
