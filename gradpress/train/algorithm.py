"""What the training loop runs: an *algorithm*, built from a spec
``name[:key=value,...]``.

The loop talks to one small interface (:class:`Algorithm`): ``model`` (run
forward/backward on it), ``step()`` (after ``loss.backward()``: the
optimizer step and this algorithm's exchange), ``eval_model()``, ``stats``
(the keys of ``gradpress.ddp.STATS_KEYS``), ``state_dict()`` /
``load_state_dict()`` (this rank's state), ``close()`` and ``describe()``.

Two providers:

* ``ddp`` (the default): :class:`DDPAlgorithm`, DistributedDataParallel with
  the gradpress comm hook (``gradpress.ddp.register``); ``step()`` is
  ``optimizer.step()``, skipped when the hook dropped the step.
* every other name: ``gradpress.algorithms.create`` (local SGD, DiLoCo,
  gossip, ...), listed by ``gradpress algorithms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from gradpress.compress.spec import PLUGIN_HINT, spelled_as, without_defaults
from gradpress.torch_compat import ddp_kwargs

__all__ = ["Algorithm", "DDPAlgorithm", "create", "check_spec", "default_compressor", "names", "describe",
           "preflight", "split_spec", "strategy_names", "short_spec", "shown",
           "shown_compressor"]


class Algorithm(Protocol):
    """The interface the training loop uses (see the module doc)."""

    model: torch.nn.Module

    def step(self) -> None: ...
    def eval_model(self) -> torch.nn.Module: ...
    @property
    def stats(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


def split_spec(spec: Any) -> tuple[str, str]:
    """``"localsgd:period=8"`` -> ``("localsgd", "period=8")``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"algorithm must be a spec string like 'ddp' or 'localsgd:period=8', got {spec!r}")
    name, _, params = spec.strip().partition(":")
    return name.strip(), params.strip()


def _registry() -> Any:
    import gradpress.algorithms

    return gradpress.algorithms


def names() -> list[str]:
    """``ddp`` and every registered algorithm."""
    return ["ddp", *[n for n in _registry().names() if n != "ddp"]]


def check_spec(spec: Any) -> str:
    """Validate an algorithm spec (name and parameters) without building it;
    returns its canonical form, every parameter spelled out as the algorithm
    reports it (``localsgd`` -> ``localsgd:period=8,optimizer_state=auto``). Raises ValueError
    naming the algorithm or the parameter and what is allowed."""
    name, params = split_spec(spec)
    if name == "ddp":
        if params:
            raise ValueError(f"algorithm 'ddp' takes no parameters, got {params!r}; allowed: ddp")
        return "ddp"
    if name not in names():
        raise ValueError(f"unknown algorithm {name!r}{spelled_as(name, names())}; allowed: {', '.join(names())}"
                         + PLUGIN_HINT)
    cls, values = _registry().parse(spec.strip())  # checks the parameters
    full = {p.name: values.get(p.name, p.default) for p in cls.PARAMS}
    return cls.name + (":" + ",".join(f"{k}={v}" for k, v in full.items()) if full else "")


def short_spec(spec: Any) -> str:
    """:func:`check_spec`'s canonical form without the parameters at their defaults (``diloco:period=8,
    outer_lr=0.7,...,inner_state=keep`` -> ``diloco:period=8``, ``localsgd:period=8,optimizer_state=auto``
    -> ``localsgd``): what progress lines and tables show; :func:`check_spec` of it is the canonical form
    again (which summary.json, compare.json and checkpoints keep). ValueError as :func:`check_spec`."""
    canonical = check_spec(spec)
    name = split_spec(canonical)[0]
    if name == "ddp":
        return "ddp"
    cls, values = _registry().parse(canonical)
    return without_defaults(cls.name, {p.name: values.get(p.name, p.default) for p in cls.PARAMS},
                            {p.name: p.default for p in cls.PARAMS})


def shown(spec: Any) -> str:
    """:func:`short_spec` for people, or ``spec`` as it is where it does not parse here (a plugin's algorithm
    read back from an older run's files without the plugin loaded)."""
    try:
        return short_spec(spec)
    except ValueError:
        return str(spec)


def shown_compressor(spec: Any) -> str:
    """A compressor spec for people: :func:`gradpress.compress.registry.short_spec`, or ``spec`` as it is
    where it does not parse here."""
    from gradpress.compress.registry import short_spec as short_compressor

    try:
        return short_compressor(spec)
    except ValueError:
        return str(spec)


def preflight(spec: str, run: Any) -> None:
    """What the algorithm would refuse at construction knowing only ``run``
    (:class:`gradpress.algorithms.Preflight`), refused before any worker starts."""
    registry = _registry()
    if split_spec(spec)[0] != "ddp" and hasattr(registry, "preflight"):
        registry.preflight(spec.strip(), run)


def default_compressor(spec: str) -> str:
    """The compressor an algorithm runs when ``--compressor`` is left out."""
    name, _ = split_spec(spec)
    if name == "ddp":
        return DDPAlgorithm.default_compressor
    return str(_registry().parse(spec.strip())[0].default_compressor)


def strategy_names() -> list[str]:
    """Every strategy name ``--strategy`` accepts."""
    from gradpress.exchange import available

    return list(available())


def describe() -> list[dict[str, Any]]:
    """One row per algorithm, as ``gradpress.compress.describe()``: name,
    summary, params (name, type, default, allowed, doc), default_compressor."""
    ddp = {"name": "ddp", "summary": DDPAlgorithm.summary, "params": [],
           "default_compressor": DDPAlgorithm.default_compressor}
    return [ddp, *[row for row in _registry().describe() if row["name"] != "ddp"]]


class DDPAlgorithm:
    """Synchronous data parallelism: DDP with the gradpress comm hook.
    Exactly what ``gradpress train`` ran before algorithms existed."""

    name = "ddp"
    summary = ("synchronous data parallel SGD: DistributedDataParallel with the gradpress comm hook "
               "(every step's gradient buckets compressed and averaged)")
    default_compressor = "none"
    #: every rank holds the same parameters and optimizer state after every step
    replicated = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, compressor: str | None = None, *,
                 error_feedback: bool | None = None, strategy: str = "collective", min_numel: int = 1024, seed: int = 0,
                 nonfinite: str = "propagate", ddp_options: Mapping[str, Any] | None = None,
                 plan_costs: str | None = None, timeout: float | None = None, scaler: Any = None) -> None:
        import gradpress.ddp

        device = next(model.parameters()).device
        self.module = model
        self.optimizer = optimizer
        self.compressor = compressor if compressor is not None else self.default_compressor
        #: fp16's ``torch.amp.GradScaler`` (None: none): the hook follows its scale; :meth:`step` steps through it
        self.scaler = scaler
        self.model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, **ddp_kwargs(ddp_options))
        self.hook = gradpress.ddp.register(self.model, self.compressor, error_feedback=error_feedback,
                                           strategy=strategy, min_numel=min_numel, seed=seed, nonfinite=nonfinite,
                                           plan_costs=plan_costs, timeout=timeout, scaler=scaler)

    def step(self) -> None:
        if self.scaler is not None:  # plain AMP's end of a step: skipped on an overflow (every rank's: propagate)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not self.hook.last_step_skipped:
            self.optimizer.step()

    def scaler_state(self) -> dict[str, Any] | None:
        """The scaler's own state (scale, growth tracker; the hook's state holds only the scale its residuals
        are kept in), which a checkpoint keeps beside :meth:`state_dict`; None without a scaler."""
        return None if self.scaler is None else dict(self.scaler.state_dict())

    def load_scaler_state(self, state: Mapping[str, Any]) -> None:
        assert self.scaler is not None
        self.scaler.load_state_dict(dict(state))

    def eval_model(self) -> torch.nn.Module:
        return self.module

    @property
    def stats(self) -> dict[str, Any]:
        return self.hook.stats

    def state_dict(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.hook.load_state_dict(state)

    def close(self) -> None:
        self.hook.close()

    def describe(self) -> dict[str, Any]:
        return {"algorithm": "ddp", "compressor": self.compressor, "strategy": self.hook.strategy_name,
                "plan": self.hook.plan.to_json(),
                "error_feedback": self.hook.error_feedback}


def create(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, compressor: str | None = None,
           error_feedback: bool | None = None, strategy: str = "collective", min_numel: int = 1024, seed: int = 0,
           nonfinite: str = "propagate", ddp_options: Mapping[str, Any] | None = None,
           plan_costs: str | None = None, timeout: float | None = None, scaler: Any = None) -> Algorithm:
    """Build the algorithm ``spec`` around ``model`` and ``optimizer`` (an
    optimizer over ``model.parameters()``). ``compressor`` None: the
    algorithm's default. ``ddp_options``: keywords for DistributedDataParallel
    (``ddp`` only). ``timeout``: seconds a collective of the exchange may wait
    (None: the process group's). ``scaler``: fp16's ``torch.amp.GradScaler`` (None: none;
    :mod:`gradpress.train.precision`)."""
    spec = check_spec(spec)
    common = {"error_feedback": error_feedback, "strategy": strategy, "min_numel": min_numel, "seed": seed,
              "nonfinite": nonfinite, "timeout": timeout}
    if spec == "ddp":
        return DDPAlgorithm(model, optimizer, compressor, ddp_options=ddp_options, plan_costs=plan_costs,
                            scaler=scaler, **common)
    if plan_costs is not None:
        raise ValueError(f"plan_costs applies to algorithm 'ddp' only, not {spec!r}")
    if ddp_options:
        raise ValueError(f"ddp_options apply to algorithm 'ddp' only, not {spec!r}")
    if scaler is not None:
        common["scaler"] = scaler
    return _registry().create(spec, model, optimizer, compressor=compressor, **common)
