"""The strategy contract, the strategy registry, and the shared aggregation rule.

A strategy moves the compressed tensors of one call between the ranks of a
group and returns their average, bit-identical on every rank. It is given
the engine's error-feedback store (:class:`~gradpress.exchange.feedback.Feedback`,
None when error feedback is off): strategies that re-compress on the way
(ring hops, parameter-server roots) keep their residuals there, under their
own namespace, and every strategy returns the worker's residual
``p - estimate`` per input for the engine to stage. One store, one NaN rule,
one ``state_dict`` contract: a strategy's own ``state_dict`` holds only what
is not a residual (the PS root assignment).

Each strategy also predicts its own cost (:meth:`Strategy.predict`) from a
fitted :class:`~gradpress.exchange.costs.CostModel`; the planner compares
those predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context, Packet, declared_with
from gradpress.compress.spec import Registry, spelled_as
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback

__all__ = [
    "ExchangeResult", "Prelude", "Strategy", "aggregate", "aggregate_packets", "available", "bound_summand",
    "canonical_strategy", "check_strategy", "encode_local", "get_strategy", "parse_strategy", "register_strategy",
    "resolved_strategy", "same_strategy", "strategy_class", "strategy_key", "strategy_names",
]


@dataclass
class Prelude:
    """Plain tensors summed (allreduce) ahead of or together with the first
    collective of an exchange: the tensors that stay uncompressed and the
    NaN/Inf flags. ``on_summed`` receives their sums and returns True when the
    call must stop there (the engine drops the bucket on every rank alike)."""

    tensors: list[torch.Tensor]
    on_summed: Callable[[list[torch.Tensor]], bool]


@dataclass
class Encoded:
    """A call's packets encoded ahead of its exchange (a strategy's
    ``encode``, where it has one): packets, the residuals error feedback
    keeps (None when off), what goes on the wire (allgather: the packed byte
    buffer; allreduce: the payload tensors, summed as they are) and the
    encoding seconds."""

    packets: list[Packet]
    residuals: list[torch.Tensor] | None
    buffer: torch.Tensor | list[torch.Tensor]
    seconds: float
    #: the counted Context step it was encoded at (set by ``Synchronizer.prepare``; ``sync`` checks it)
    counted: int | None = None


@dataclass
class ExchangeResult:
    """What one exchange produced.

    ``tensors``: the average over ranks, in input order, bit-identical on
    every rank (a strategy may return the caller's ``out`` tensors, filled).
    ``bytes_sent``: bytes this rank handed to collectives (the prelude's
    included when the strategy carried it). ``residuals``: per input, what
    error feedback keeps on this rank (``p - estimate``); None when feedback
    is off. ``tensor_bytes``: payload bytes per input this rank originated.
    ``compress_s``: seconds spent encoding and decoding; ``comm_s``: seconds
    inside collectives. ``stopped``: the prelude's ``on_summed`` said stop.
    ``host_bytes``: the part of ``bytes_sent`` handed to collectives among
    the workers of one host (``hierarchical``'s dense reduce and broadcast),
    which never crosses a link between hosts. ``plain_bytes``: the part of
    ``bytes_sent`` handed to a plain fused allreduce of the prelude (one too
    large to ride inside the strategy's own collective), counted as
    ``uncompressed`` in the stats' ``strategy_bytes``.
    """

    tensors: list[torch.Tensor]
    bytes_sent: int
    residuals: list[torch.Tensor] | None = None
    tensor_bytes: list[int] = field(default_factory=list)
    compress_s: float = 0.0
    comm_s: float = 0.0
    stopped: bool = False
    host_bytes: int = 0
    plain_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.tensor_bytes:
            self.tensor_bytes = [0] * len(self.tensors)


def bound_summand(compressor: Compressor, x: torch.Tensor, summands: int, ctx: Context) -> torch.Tensor:
    """``compressor.bound_summand(x, summands)``, or ``x`` itself while a loss scaler is attached
    (``ctx.loss_scaler``): a sum beyond the payload dtype's range must then overflow to Inf, so that the
    scaler skips the step and lowers the scale (plain fp16 AMP's rule), not saturate unseen."""
    return x if ctx.loss_scaler else compressor.bound_summand(x, summands)


def encode_local(
    compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], scale: float, feedback: Feedback | None,
    summands: int = 1,
) -> tuple[list[Packet], list[torch.Tensor] | None]:
    """Encode ``scale * t`` for each tensor; with ``feedback`` (error feedback on) also
    return ``t - decode(packet) / scale`` (what error feedback keeps),
    computed by ``Compressor.residual`` (which may reuse ``t``'s storage:
    the tensors must be the caller's own, not gradient views).
    ``summands``: how many such packets the caller adds in their payload's
    dtype (:meth:`Compressor.bound_summand` keeps that sum finite, except under a loss scaler:
    :func:`bound_summand`)."""
    packets = []
    residuals: list[torch.Tensor] | None = [] if feedback is not None else None
    for t, c in zip(tensors, ctxs):
        x = t * scale if scale != 1.0 else t
        packet = compressor.encode(bound_summand(compressor, x, summands, c), c)
        packets.append(packet)
        if residuals is not None:
            r = compressor.residual(x, packet)
            residuals.append(r.div_(scale) if scale != 1.0 else r)
    return packets, residuals


def aggregate_packets(compressor: Compressor, packets_by_rank: list[Packet], world_size: int,
                      out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`aggregate` of the ranks' decoded packets, bit for bit, decoded
    into two buffers instead of one fresh tensor per rank
    (:meth:`~gradpress.compress.base.Compressor.decode_into`): the result
    (the mean, or the sign of the sum for a majority vote) in ``out`` (when
    it fits the packets: contiguous, their size and dtype; else a new
    tensor), every later rank's packet in ``scratch`` (the same size and
    dtype, reused; a new one where None). Neither may overlap a packet's
    payload: they are written while packets are still to be read. At 10M entries a fresh
    40 MB output cost more page faults than most decoders compute
    (docs/bench.md, "Decoding into a buffer")."""
    first = packets_by_rank[0]
    if out is None or out.numel() != first.numel or out.dtype != first.dtype or not out.is_contiguous():
        out = torch.empty(first.shape, dtype=first.dtype, device=first.tensors[0].device if first.tensors else None)
    total = compressor.decode_into(first, out)
    if len(packets_by_rank) > 1 and (scratch is None or scratch.numel() != first.numel or scratch.dtype != first.dtype
                                     or not scratch.is_contiguous()):
        scratch = torch.empty_like(total)
    flat = total.view(-1)  # the scratch buffer may be flat where the sum is shaped (or the other way round)
    for p in packets_by_rank[1:]:
        flat += compressor.decode_into(p, scratch).view(-1)
    if compressor.aggregation == "majority":
        return total.sign_()
    return total.div_(world_size)


def aggregate(compressor: Compressor, decoded_by_rank: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Fold the ranks' decoded tensors in rank order (fixed order: every rank
    computes bit-identical results). ``mean`` averages, ``majority`` takes the
    sign of the sum (signSGD's majority vote)."""
    total = decoded_by_rank[0].clone()
    for t in decoded_by_rank[1:]:
        total += t
    if compressor.aggregation == "majority":
        return torch.sign(total)
    return total.div_(world_size)


class Strategy:
    """Moves the compressed tensors of one call between ranks.

    Subclasses implement :meth:`exchange` and :meth:`predict`, and say in
    :meth:`supports` which compressors they cannot carry. ``carries_prelude``:
    the strategy sums the engine's :class:`Prelude` inside its own first
    collective (allreduce: one collective per bucket instead of two); for
    the others the engine sums it first.
    """

    name: ClassVar[str] = ""
    carries_prelude: ClassVar[bool] = False
    #: position in the fixed order in which a call's strategy groups are
    #: exchanged (every rank issues its collectives in this order)
    order: ClassVar[int] = 100
    #: a general strategy: ``collective`` (and ``auto``'s first candidate) is
    #: the first general strategy, in ``order``, that can carry the compressor
    general: ClassVar[bool] = False
    #: one of the planner's candidates with ``auto``
    planned: ClassVar[bool] = True
    #: carries only summable compressors (the planner checks candidates by it)
    summable_only: ClassVar[bool] = False
    #: ``state_dict()`` returns state the caller owns (fresh containers, no live tensor): the engine's per-step
    #: snapshot copies only its containers (otherwise it deep-copies it). A subclass overriding ``state_dict``
    #: gets False unless it sets the flag in its own body
    state_dict_copies: ClassVar[bool] = False
    #: resuming on another world size (:mod:`gradpress.exchange.reshard`): ``reshard_refusal``, why a checkpoint
    #: that ran this strategy cannot be (None: it folds by the generic rule, or by ``reshard_fold``);
    #: ``reshard_held(state)``, what in a saved rank's engine state the refusal is about (None: nothing, and a
    #: checkpoint whose every saved rank holds nothing folds; unset: always refused); ``reshard_fold(saved, at,
    #: key)``: (the N saved engine states less what the strategy, ``strategies[key]``, places itself, what it places)
    reshard_refusal: ClassVar[str | None] = None
    reshard_held: ClassVar[Callable[[Mapping[str, Any]], str | None] | None] = None
    reshard_fold: ClassVar[Callable[[list[Any], Any, str], tuple[list[Any], dict[str, Any]]] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared_with(cls, "state_dict_copies", "state_dict", False)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def supports(self, compressor: Compressor) -> str | None:
        """None if usable with ``compressor``, else the reason it is not."""
        return None

    def pipelines(self, compressor: Compressor) -> bool:
        """Whether a call with ``compressor`` is pipelined in pieces (the DDP
        hook then averages a step's buckets in one call, so the pipeline
        fills and drains once per step; otherwise each bucket is its own
        call and overlaps backward)."""
        return False

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        """Average ``tensors`` (this rank's error-compensated values, the
        caller's own: they may be reused in place, so after a failed call
        their contents are undefined) over the group.
        ``feedback``: the error-feedback store, None when it is off.
        ``prelude``: only given when ``carries_prelude``. ``out``: where the
        averages may be written (same shapes), when the method can."""
        raise NotImplementedError

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """Predicted seconds for one tensor of ``numel`` elements of
        ``elem_size`` bytes (its dtype: what a dense step moves; compressed
        sizes come from ``costs.wire``), and the number of partitions that
        achieves it."""
        raise NotImplementedError

    @classmethod
    def resolve_params(cls, values: dict[str, Any], world: int, local_world: int | None = None) -> dict[str, Any]:
        """``values`` (every declared parameter, coerced) with those this strategy takes from its
        environment written as a group of ``world`` ranks would resolve them (``local_world``: the
        ``LOCAL_WORLD_SIZE`` of workers about to start, in place of this process's). Default: as given."""
        return values

    def state_dict(self) -> dict[str, Any]:
        """What this strategy keeps besides residuals (those live in the
        engine's feedback store). Every strategy has this contract."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"strategy {self.name!r} keeps no state but was given {sorted(state)}")


#: every registered strategy; the modules of :mod:`gradpress.exchange.strategies`
#: register theirs when first looked up
_STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "gradpress.exchange.strategies")

#: pseudo-strategies accepted wherever a strategy is named
PSEUDO = ("auto", "collective")


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return _STRATEGIES.register(cls)

    return deco


def strategy_names() -> list[str]:
    """The registered strategies' names in their exchange ``order`` (no
    pseudo-strategies)."""
    return sorted(_STRATEGIES.names(), key=lambda n: (_STRATEGIES.classes[n].order, n))


def available() -> list[str]:
    """Every strategy name the engine accepts: the transports plus ``auto``
    (the planner) and ``collective`` (allreduce if summable, else allgather)."""
    return sorted({*PSEUDO, *strategy_names()})


def strategy_class(name: str) -> type[Strategy]:
    return _STRATEGIES.get(name)


def get_strategy(name: str, group: dist.ProcessGroup | None) -> Strategy:
    return strategy_class(name)(group)


def parse_strategy(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, parameters as given)`` of a strategy spec ``name[:key=value,...]``
    (``hierarchical:chunk=1048576,outer=ring``), the parameters checked
    against those the strategy declares. ValueError naming the field, the value
    and what is allowed: not a string, an unknown name, parameters for a
    strategy that takes none, an unknown parameter or a bad value."""
    from gradpress.compress.spec import coerce_params, parse_stage

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"strategy must be a name like 'allgather' or 'hierarchical:chunk=1048576', got {spec!r}")
    name, params = parse_stage(spec, "strategy")
    if name not in available():
        raise ValueError(f"unknown strategy {name!r}{spelled_as(name, available())}; allowed: {', '.join(available())}")
    declared = () if name in PSEUDO else getattr(strategy_class(name), "PARAMS", ())
    if params and not declared:
        raise ValueError(f"strategy {name!r} takes no parameters, got {', '.join(sorted(params))}")
    if params:
        coerce_params(declared, params, name, "strategy")
    return name, params


def canonical_strategy(spec: str) -> str:
    """The canonical form of a strategy spec: the name, then every parameter
    the strategy declares, in its declared order, with its default where not
    given (``hierarchical`` -> ``hierarchical:workers_per_host=0,outer=collective,chunk=262144``;
    ``ring:`` -> ``ring``). Two specs with the same canonical form run the same
    strategy. ValueError as :func:`parse_strategy`."""
    from gradpress.compress.spec import coerce_params

    name, params = parse_strategy(spec)
    declared = () if name in PSEUDO else getattr(strategy_class(name), "PARAMS", ())
    if not declared:
        return name
    values = coerce_params(declared, params, name, "strategy")
    return name + ":" + ",".join(f"{k}={v}" for k, v in values.items())


def strategy_key(spec: str) -> str:
    """The name an exchange engine goes by for a strategy spec, part of the
    configuration every rank and a resumed run must agree on: the name, then
    only the parameters that differ from their defaults, sorted by name, as
    their values coerce (``hierarchical:chunk=262144`` -> ``hierarchical``,
    ``hierarchical:outer=ring,chunk=0`` -> ``hierarchical:chunk=0,outer=ring``).
    Specs that run the same strategy have the same key. ValueError as
    :func:`parse_strategy`."""
    from gradpress.compress.spec import coerce_params

    name, params = parse_strategy(spec)
    if not params:
        return name
    declared = strategy_class(name).PARAMS  # type: ignore[attr-defined]  # parse_strategy: it declares them
    values = coerce_params(declared, params, name, "strategy")
    default = {p.name: p.default for p in declared}
    changed = sorted(k for k, v in values.items() if v != default[k])
    return name + (":" + ",".join(f"{k}={values[k]}" for k in changed) if changed else "")


def resolved_strategy(spec: str, world: int, local_world: int | None = None) -> str:
    """:func:`canonical_strategy` with the parameters a strategy takes from its environment written as a group
    of ``world`` ranks resolves them (:meth:`Strategy.resolve_params`): ``hierarchical`` under
    ``GRADPRESS_WORKERS_PER_HOST=2`` (or ``LOCAL_WORLD_SIZE=2``) on 4 ranks ->
    ``hierarchical:workers_per_host=2,outer=collective,chunk=262144``, as ``hierarchical:workers_per_host=2``.
    ``local_world``: the ``LOCAL_WORLD_SIZE`` of workers about to start (a launcher's check). ValueError as
    :func:`parse_strategy`, or for an environment that gives no layout."""
    from gradpress.compress.spec import coerce_params

    name, params = parse_strategy(spec)
    declared = () if name in PSEUDO else getattr(strategy_class(name), "PARAMS", ())
    if not declared:
        return name
    values = strategy_class(name).resolve_params(coerce_params(declared, params, name, "strategy"), world, local_world)
    return name + ":" + ",".join(f"{k}={v}" for k, v in values.items())


def same_strategy(theirs: Any, mine: Any, world: int | None = None, local_world: int | None = None) -> bool:
    """Whether two engine strategy names (:func:`strategy_key`, or a spec as
    an earlier version named it: parameters as given, defaults included) run
    the same strategy; given ``world``, also compared in their
    :func:`resolved_strategy` forms (one host layout given or from the environment)."""
    if theirs == mine:
        return True
    if not (isinstance(theirs, str) and isinstance(mine, str)):
        return False
    try:
        if strategy_key(theirs) == strategy_key(mine):
            return True
        return world is not None and resolved_strategy(theirs, world, local_world) == resolved_strategy(
            mine, world, local_world)
    except ValueError:
        return False


def check_strategy(spec: str, compressor: Compressor | None = None) -> str:
    """Check a strategy spec before any worker starts (:func:`parse_strategy`)
    and, given ``compressor``, that the strategy can carry it. Returns the
    spec, stripped."""
    name, params = parse_strategy(spec)
    if compressor is not None and name not in PSEUDO:
        reason = strategy_class(name)(None, **params).supports(compressor)  # type: ignore[call-arg]
        if reason:
            raise ValueError(f"strategy {spec!r}: {reason}")
    return spec.strip()
