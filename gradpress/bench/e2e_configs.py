"""What ``gradpress bench e2e`` runs: the PyTorch baselines and the gradpress
configurations, parsed from ``--baselines`` and ``--configs``.

Syntax (``docs/e2e.md``):

* ``--configs``: comma-separated gradpress configurations
  ``[ALGORITHM/]COMPRESSOR_SPEC[@STRATEGY][+ef|+noef][+lr=X]``, e.g.
  ``topk:ratio=0.01@allgather``, ``qsgd:levels=4,bucket=512@ring``,
  ``powersgd:rank=4,start_iter=2``, ``topk:ratio=0.001@allgather+noef``,
  ``localsgd:period=8/topk:ratio=0.01@allgather``, ``localsgd:period=8/``.
  ``ALGORITHM/`` is a training algorithm spec (``gradpress algorithms``; the
  same syntax as ``gradpress train --algorithm``) and the compressor is what
  it exchanges; with nothing after the slash, the algorithm's default
  compressor; without a slash, ``ddp`` (DDP with the gradpress hook).
  Commas inside a spec's parameter list stay with it (a token whose head has
  ``=`` but no ``:`` continues the previous spec); ``;`` also separates.
  ``@STRATEGY`` is one of :func:`gradpress.exchange.available` (default ``collective``:
  the compressor on every eligible tensor; ``auto`` plans per tensor);
  ``+ef`` / ``+noef`` force error feedback on / off (default: the
  compressor's own default, on for biased methods); ``+lr=X`` trains this
  configuration at learning rate X instead of ``--lr`` (the rate a
  ``gradpress compare --lr-sweep`` chose for it: ``sweep.json``). Options
  combine: ``topk:ratio=0.01@allgather+noef+lr=0.05``.
* ``--baselines``: comma-separated PyTorch baselines: ``ddp`` (plain DDP, no
  hook), ``fp16`` (``default_hooks.fp16_compress_hook``),
  ``powersgd:rank=R`` (``powerSGD_hook``; optional ``start=I``, the
  ``start_powerSGD_iter``, default 2). Plain ``ddp`` is the reference of every
  speed-up and always runs (first), listed or not. A baseline takes
  ``+lr=X`` as well (``ddp+lr=0.05`` sets the reference's own rate).

Invariant: every configuration is validated here, in the parent, before any
cluster is built; a bad one raises ``ValueError`` naming the option, the
value and what is allowed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RunConfig", "parse_configs", "parse_baselines", "DEFAULT_BASELINES", "TORCH_POWERSGD_START"]

DEFAULT_BASELINES = "ddp,fp16,powersgd:rank=1,powersgd:rank=4"
#: PyTorch's powerSGD_hook needs start_powerSGD_iter > 1 with error feedback / warm start
TORCH_POWERSGD_START = 2


@dataclass(frozen=True)
class RunConfig:
    """One configuration of the benchmark.

    ``kind``: ``ddp`` | ``torch-fp16`` | ``torch-powersgd`` | ``gradpress``.
    ``spec``/``strategy``: gradpress compressor spec and strategy;
    ``algorithm``: the gradpress training algorithm that carries them.
    ``rank``/``start``: PyTorch PowerSGD rank and ``start_powerSGD_iter``.
    ``start``: for every kind, the first step at which compression is active
    (the worker warms up at least that many steps).
    ``single_bucket``: run DDP with one bucket (PyTorch PowerSGD on gloo).
    ``lr``: this configuration's own learning rate (``+lr=X``; None: ``--lr``).
    """

    kind: str
    label: str
    spec: str = ""
    strategy: str = "collective"
    rank: int = 0
    start: int = 0
    single_bucket: bool = False
    error_feedback: bool | None = None
    algorithm: str = "ddp"
    lr: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RunConfig:
        return RunConfig(**d)


#: what each option's list holds, for the splitter's errors
_LISTS = {"--configs": "configurations [ALGORITHM/]SPEC[@STRATEGY][+ef|+noef][+lr=X]",
          "--baselines": "baselines ddp, fp16, powersgd:rank=R[,start=I], each [+lr=X],"}


def _split_specs(text: str, option: str) -> list[str]:
    """The configurations of a list separated by ``,`` or ``;``: a ``key=value`` token continues the
    parameter list of the piece before it (the compressor's, the algorithm's or the strategy's); a token
    whose first piece is a name, ``fp16+lr=0.03`` included, starts a configuration."""
    tokens: list[str] = []
    for part in text.split(";"):
        for token in part.split(","):
            token = token.strip()
            if not token:
                continue
            # the token's first piece, before an algorithm's '/', a strategy, a next stage or a +option
            # (fp16+lr=0.03 is a configuration with its rate, not a parameter)
            head = re.split(r"[/@>+]", token, maxsplit=1)[0]
            if tokens and "=" in head and ":" not in head:
                piece = re.split(r"[/@>]", tokens[-1])[-1]
                if "+" in piece:  # the options end a configuration: its parameters come before them
                    raise ValueError(f"{option}: {token!r} in {text!r} is a parameter written after the options of "
                                     f"{tokens[-1]!r}; allowed: NAME:key=value,key=value+option")
                if ":" not in piece:
                    raise ValueError(f"{option}: {token!r} in {text!r} is a parameter, but {piece or tokens[-1]!r} "
                                     "has no parameter list; allowed: NAME:key=value,key=value")
                tokens[-1] += "," + token  # continuation of the previous parameter list
            else:
                tokens.append(token)
    if not tokens:
        what = _LISTS.get(option, "configurations")
        raise ValueError(f"{option} got {text!r}; allowed: {what} separated by ',' or ';'")
    return tokens


def _options(token: str, option: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """Split ``BODY+opt+opt`` into BODY and its options: ``ef``/``noef`` (error
    feedback, when ``"ef"`` is allowed) and ``lr=X`` (a positive finite rate)."""
    body, *opts = token.split("+")
    out: dict[str, Any] = {}
    allowed_text = ", ".join(f"+{a}" for a in allowed)
    for opt in (o.strip() for o in opts):
        key, eq, value = opt.partition("=")
        if "ef" in allowed and opt in ("ef", "noef") and "error_feedback" not in out:
            out["error_feedback"] = opt == "ef"
        elif key == "lr" and eq and "lr" not in out:
            try:
                lr = float(value)
            except ValueError:
                lr = float("nan")
            if not math.isfinite(lr) or lr <= 0:
                raise ValueError(f"{option}: configuration {token!r}: +lr got {value!r}; allowed: a positive finite number")
            out["lr"] = lr
        else:
            raise ValueError(f"{option}: configuration {token!r}: unknown or repeated option '+{opt}'; "
                             f"allowed: {allowed_text}, each once")
    return body, out


def _lr_label(lr: float | None) -> str:
    return "" if lr is None else f"+lr={lr:g}"


def _start_iter(compressor: Any) -> int:
    """First step at which a compressor compresses (PowerSGD's ``start_iter``)."""
    starts = [getattr(c, "start_iter", 0) for c in (compressor, getattr(compressor, "first", None)) if c is not None]
    return max([int(s) for s in starts if isinstance(s, int)] + [0])


def _algorithm(token: str, option: str) -> tuple[str, str]:
    """``ALGORITHM/REST`` -> (checked algorithm spec, REST); no slash: ``ddp``.
    An empty compressor after the slash becomes the algorithm's default."""
    from gradpress.train import algorithm

    algo, slash, rest = token.partition("/")
    if not slash:
        return "ddp", token
    try:
        algo = algorithm.check_spec(algo.strip())
    except ValueError as exc:
        raise ValueError(f"{option}: configuration {token!r}: {exc}") from None
    if not rest.split("@", 1)[0].split("+", 1)[0].strip():
        rest = algorithm.default_compressor(algo) + rest
    return algo, rest


def parse_configs(text: str, option: str = "--configs") -> list[RunConfig]:
    """gradpress configurations ``[ALGORITHM/]SPEC[@STRATEGY][+ef|+noef][+lr=X]`` (see the module doc)."""
    from gradpress.compress import create
    from gradpress.exchange.base import check_strategy

    out: list[RunConfig] = []
    for token in _split_specs(text, option):
        algo, rest = _algorithm(token, option)
        token_body, opts = _options(rest, option, ("ef", "noef", "lr=X"))
        error_feedback: bool | None = opts.get("error_feedback")
        spec, _, strategy = token_body.partition("@")
        spec, strategy = spec.strip(), (strategy.strip() or "collective")
        if not spec:
            raise ValueError(f"{option}: configuration {token!r} has no compressor spec; "
                             "allowed: [ALGORITHM/]SPEC[@STRATEGY] (ALGORITHM/ alone: its default compressor)")
        try:
            compressor = create(spec)
        except ValueError as exc:
            raise ValueError(f"{option}: bad compressor spec {spec!r} in {token!r}: {exc}") from None
        try:
            check_strategy(strategy, compressor)
        except ValueError as exc:
            raise ValueError(f"{option}: configuration {token!r}: {exc}") from None
        if compressor.rounds > 1 and strategy.partition(":")[0] not in ("auto", "collective", "allreduce"):
            raise ValueError(f"{option}: configuration {token!r}: strategy {strategy!r} cannot carry "
                             f"{compressor.name!r} (a {compressor.rounds}-round allreduce protocol); allowed: collective, auto, allreduce")
        label = (f"gradpress {'' if algo == 'ddp' else algo + '/'}{spec}" + ("" if strategy == "collective" else f"@{strategy}")
                 + ("" if error_feedback is None else ("+ef" if error_feedback else "+noef")) + _lr_label(opts.get("lr")))
        # a multi-round protocol (PowerSGD) runs on the same single DDP bucket as PyTorch's PowerSGD
        # baseline, so the two compare on the same bucketing (one round pair per step, after backward)
        out.append(RunConfig("gradpress", label, spec=spec, strategy=strategy, start=_start_iter(compressor),
                             error_feedback=error_feedback, algorithm=algo, lr=opts.get("lr"),
                             single_bucket=compressor.rounds > 1 and algo == "ddp"))
    _check_unique(out, option)
    return out


_POWERSGD_RE = re.compile(r"^powersgd(?::(.*))?$")


def parse_baselines(text: str, option: str = "--baselines") -> list[RunConfig]:
    """PyTorch baselines (see the module doc); plain DDP always comes first."""
    out: list[RunConfig] = [RunConfig("ddp", "torch ddp")]
    if text.strip().lower() in ("", "ddp", "none"):
        return out
    allowed = "ddp, fp16, powersgd:rank=R[,start=I]"
    for token in _split_specs(text, option):
        body, opts = _options(token, option, ("lr=X",))
        name, lr = body.strip(), opts.get("lr")
        if name == "ddp":
            if lr is not None:
                out[0] = RunConfig("ddp", "torch ddp" + _lr_label(lr), lr=lr)
            continue
        if name == "fp16":
            out.append(RunConfig("torch-fp16", "torch fp16" + _lr_label(lr), lr=lr))
            continue
        m = _POWERSGD_RE.match(name)
        if not m:
            raise ValueError(f"{option}: unknown baseline {name!r}; allowed: {allowed}")
        params: dict[str, int] = {"rank": 1, "start": TORCH_POWERSGD_START}
        for item in filter(None, (m.group(1) or "").split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in params:
                raise ValueError(f"{option}: baseline {name!r}: unknown parameter {key!r}; allowed parameters: rank, start")
            try:
                params[key] = int(value)
            except ValueError:
                raise ValueError(f"{option}: baseline {name!r}: {key} got {value!r}; allowed: an integer") from None
        if params["rank"] < 1:
            raise ValueError(f"{option}: baseline {name!r}: rank got {params['rank']}; allowed: an integer >= 1")
        if params["start"] < 2:
            raise ValueError(f"{option}: baseline {name!r}: start got {params['start']}; allowed: an integer >= 2 "
                             "(PyTorch's powerSGD_hook with error feedback and warm start needs start_powerSGD_iter > 1)")
        out.append(RunConfig("torch-powersgd", f"torch powersgd r={params['rank']}" + _lr_label(lr), rank=params["rank"],
                             start=params["start"], single_bucket=True, lr=lr))
    _check_unique(out, option)
    return out


def _check_unique(configs: list[RunConfig], option: str) -> None:
    seen: set[str] = set()
    for c in configs:
        if c.label in seen:
            raise ValueError(f"{option}: configuration {c.label!r} is given twice; allowed: each configuration once")
        seen.add(c.label)
