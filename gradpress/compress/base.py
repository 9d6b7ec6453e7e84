"""The compressor contract shared by every method.

A compressor turns a tensor into a :class:`Packet` (the payload tensors that
travel on the wire, plus the metadata every rank already knows: shape, dtype)
and back. It declares the traits the strategies rely on:

* ``summable``: packets of different ranks can be added payload-by-payload
  before decoding (and ``decode(sum) == sum(decode)``), so allreduce works.
* ``unbiased``: E[decode(encode(x))] == x.
* ``variable_size``: the payload size depends on the data (threshold methods);
  the wire then carries a small header of element counts.
* ``stateful``: keeps per-tensor state (momentum, factors, counters) that goes
  into ``state_dict``; ``element_state`` names its entries that map a tensor's
  key to a buffer of that tensor's elements in ``x.reshape(-1)`` order (DGC's
  momentum: a checkpoint's re-indexing must move them with the elements), and
  ``matrix_state`` those that map it to a factor with one row per column of
  ``x`` seen as a ``shape[0] x m`` matrix (PowerSGD's warm-start Q).
* ``identity``: decode(encode(x)) == x exactly and the packet is x itself:
  nothing to compress (``none``). Policy asks this trait, never the name.
* ``scale_degree``: decode(encode(s x)) == s**degree decode(encode(x)), s a
  power of two, same random stream, ``ctx.loss_scale`` times s: 1 (the
  default), 0 (scale-free: signs; the DDP hook multiplies such averages by
  the loss scale) or None (neither).

Invariant: ``decode(encode(x))`` has the shape and dtype of ``x`` and
``packet.nbytes`` is exactly the number of bytes the payload occupies on the
wire (bit-packed where the method packs bits).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, ClassVar, final

import torch

from gradpress.compress.context import Context, derive_seed
from gradpress.compress.packet import Packet, check_decode_out
from gradpress.compress.param import Param
from gradpress.compress.sparse import check_indexable
from gradpress.compress.spec import coerce_params

__all__ = ["Compressor", "Context", "Packet", "Param", "all_finite", "check_decode_out", "declared_with",
           "derive_seed", "generator_for", "tensor_bytes"]


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: every element of ``t`` is finite. One read pass
    (``aminmax``; NaN and Inf reach the min or max), no host sync."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return torch.isfinite(lo) & torch.isfinite(hi)


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Compressor:
    """Base class. Subclasses set ``name``, ``PARAMS`` and the traits, and
    implement ``_encode``/``decode``.

    ``encode`` is final (a template method): it checks the input
    (``_check_input``), resolves the context (``_context``: a fresh default
    step per standalone call) and calls the subclass hook
    ``_encode(x, ctx)``. A method whose encoding is a pure function of ``x``
    sets ``uses_context = False``: a standalone call then gets a fixed
    ``Context(seed=self.seed)`` and does not advance the call counter.

    Parameters are passed as keywords, validated against ``PARAMS`` and stored
    as attributes. ``seed`` (the run seed) is set by the integration layer.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    summable: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    variable_size: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    #: ``state_dict`` entries {tensor key: buffer of its elements, flat in x.reshape(-1) order}
    element_state: ClassVar[tuple[str, ...]] = ()
    #: ``state_dict`` entries {tensor key: m x r factor, one row per column of x seen as a shape[0] x m matrix}
    matrix_state: ClassVar[tuple[str, ...]] = ()
    #: decode(encode(x)) == x exactly and the packet is x itself: nothing to
    #: compress (``none``); decide dense/identity policy with this, not the name
    identity: ClassVar[bool] = False
    #: decode(encode(s * x)) == s**scale_degree * decode(encode(x)), s a power of two (ctx.loss_scale times s)
    scale_degree: ClassVar[int | None] = 1
    #: aggregation of decoded tensors across ranks: "mean" or "majority"
    aggregation: ClassVar[str] = "mean"
    #: index of the floating "values" payload a second-stage quantizer may
    #: compress in a composition ("topk>natural"); None when there is none.
    values_index: ClassVar[int | None] = None
    #: one-line description with the paper.
    summary: ClassVar[str] = ""
    #: the compressor keeps its own error memory (DGC's momentum correction, AdaComp's residue): the generic
    #: residual is off by default, and a strategy must not apply that memory again to partial sums
    own_error_memory: ClassVar[bool] = False
    #: decode(encode(x)) is x at the kept indices (payload tensor 1) and zero elsewhere: the residual is then x
    #: with those entries zeroed (k writes).
    exact_values: ClassVar[bool] = False
    #: the packet carries int32 flat indices: :meth:`encode` refuses a tensor they cannot address
    #: (:func:`gradpress.compress.sparse.check_indexable`)
    int32_indices: ClassVar[bool] = False
    #: number of exchange rounds; > 1: the strategy drives ``begin``/``advance``/``finish`` (PowerSGD: P then Q)
    rounds: ClassVar[int] = 1
    #: ``_encode`` reads its Context (key, step, seeds); False for pure functions of x, whose standalone calls
    #: then leave the counter alone
    uses_context: ClassVar[bool] = True
    #: biased but contractive by definition, E||Q(v) - v||^2 <= (1 - delta)||v||^2 with delta > 0 (Koloskova
    #: et al. 2019, Assumption 1): what compressed gossip needs. Sparsifiers with ``exact_values`` are too.
    contractive: ClassVar[bool] = False
    #: ``state_dict()`` returns state the caller owns (every tensor a fresh copy, never a live buffer nor a view
    #: of one that a later call changes in place): the engine's per-step snapshot then copies no tensor again.
    #: It holds for the ``state_dict`` of the class that sets it: a subclass overriding ``state_dict`` gets False
    #: unless it sets the flag in its own body (:func:`declared_with`); so does ``state_nbytes``'s override.
    state_dict_copies: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "encode" in cls.__dict__:
            raise TypeError(f"{cls.__name__} overrides Compressor.encode, which is final; implement _encode instead")
        declared_with(cls, "state_dict_copies", "state_dict", False)
        declared_with(cls, "state_nbytes", "state_dict", Compressor.state_nbytes)
        declared_with(cls, "live_state", "state_dict", Compressor.live_state)

    def __init__(self, **params: Any) -> None:
        for key, value in coerce_params(self.PARAMS, params, self.name, "compressor").items():
            setattr(self, key, value)
        self.seed = 0
        self._calls = 0
        self._validate()

    # ----- hooks for subclasses -------------------------------------------------
    def _validate(self) -> None:
        """Cross-parameter checks; raise ValueError naming the field."""

    @property
    def default_error_feedback(self) -> bool:
        """Error feedback is on by default for biased compressors without
        their own error memory."""
        return not self.is_unbiased and not self.own_error_memory

    @property
    def is_unbiased(self) -> bool:
        """Unbiasedness for this instance (may depend on parameters)."""
        return type(self).unbiased

    @property
    def is_contractive(self) -> bool:
        """Contraction for this instance (may depend on parameters): the
        class trait, or exact kept values (the error is the dropped part)."""
        return type(self).contractive or type(self).exact_values

    def variance_factor(self, numel: int) -> float | None:
        """An upper bound omega on E||Q(v) - v||^2 / ||v||^2 for an unbiased
        compressor on ``numel`` entries, or None when none is known (then
        compressed gossip refuses it; Koloskova et al. 2019, Sec. 3)."""
        return None

    @property
    def is_summable(self) -> bool:
        return type(self).summable

    @final
    def encode(self, x: torch.Tensor, ctx: Context | None = None) -> Packet:
        """Encode ``x``: check it, resolve ``ctx`` (a default one for
        standalone use when None), then :meth:`_encode`."""
        self._check_input(x)
        if ctx is None and not self.uses_context:
            ctx = Context(seed=self.seed)
        return self._encode(x, self._context(ctx))

    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        """The method itself: ``x`` is a checked tensor, ``ctx`` resolved."""
        raise NotImplementedError

    def decode(self, packet: Packet) -> torch.Tensor:
        raise NotImplementedError

    def decode_into(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` written into ``out`` (returned): a contiguous
        tensor of ``packet.numel`` entries of ``packet.dtype``, any shape.
        Bit-identical to ``decode(packet)``. Aggregation decodes every
        rank's packet into the same buffers with it: a fresh output of tens
        of MB costs its page faults on every call, more than many decoders
        themselves (docs/bench.md, "Decoding into a buffer"). Methods that
        can write straight into ``out`` override it; this default copies."""
        check_decode_out(packet, out)
        out.view(-1).copy_(self.decode(packet).reshape(-1))
        return out

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Payload bytes for an input of ``numel`` elements (fixed-size
        methods; variable-size methods return their expected size)."""
        x = torch.zeros(numel, dtype=dtype)
        if numel:
            x[0] = 1.0
        probe = copy.deepcopy(self) if self.stateful else self  # never touch real state
        return probe.encode(x, Context(key="__wire_bytes__")).nbytes

    def bound_summand(self, x: torch.Tensor, summands: int) -> torch.Tensor:
        """``x`` as it may be encoded when ``summands`` packets like its own
        are added in their payload's dtype (allreduce, a ring's hops, a PS
        root): limited so that the sum cannot overflow that dtype. The
        strategies encode this and keep ``x - decode`` as the residual, so
        error feedback sees what the limit cut. Summable methods whose payload
        is narrower than their input (fp16, bf16) override it; the default
        returns ``x``."""
        return x

    def residual(self, p: torch.Tensor, packet: Packet) -> torch.Tensor:
        """``p - decode(packet)``, what error feedback keeps. May reuse the
        storage of ``p`` (the caller gives ``p`` up): sparsifiers that keep
        exact values (``exact_values``) only zero the kept entries."""
        if self.exact_values and len(packet.tensors) >= 2 and p.is_contiguous():
            p.view(-1).index_fill_(0, packet.tensors[1].long(), 0)
            return p
        if p.dtype == packet.dtype and p.is_contiguous() and p.numel() == packet.numel and not packet.aliases(p) \
                and not p.requires_grad:
            # in place: one fresh buffer (the decode) instead of two, the same bits as p - decode(packet)
            return p.sub_(self.decode_into(packet, torch.empty_like(p)).view(p.shape))
        return p - self.decode(packet).to(p.dtype)

    def values_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the floating values payload (``values_index``) for an
        input of ``dtype``: the input's own by default (a second stage of a
        composition decodes its values in it)."""
        return dtype

    def values_count(self, rest: list[torch.Tensor], shape: torch.Size, meta: dict[str, Any]) -> int:
        """Number of values in a packet whose values tensor was replaced by a
        second stage (composition); ``rest`` are the other payload tensors.
        Default: one index per value, in ``rest[0]``."""
        return rest[0].numel()

    # ----- multi-round protocol (rounds > 1) -----------------------------------
    def begin(self, x: torch.Tensor, ctx: Context) -> tuple[Any, torch.Tensor | None]:
        """Start the protocol for ``x``: ``(state, first tensor to allreduce-sum)``;
        ``(None, None)`` when ``x`` should travel dense instead."""
        raise NotImplementedError

    def advance(self, state: Any, reduced: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """Given the sum over ranks of the last outgoing tensor, the next one
        to allreduce-sum, or None when done."""
        raise NotImplementedError

    def finish(self, state: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """The averaged approximation, with the shape and dtype of ``x``;
        written into ``out`` (and ``out`` returned) when the method can."""
        raise NotImplementedError

    # ----- state ---------------------------------------------------------------
    def gradient_state(self) -> list[torch.Tensor]:
        """The live state buffers in the gradient's units (DGC's momentum and velocity, AdaComp's residue,
        Signum's momentum), which a loss-scale change multiplies in place; state that is scale-free
        (PowerSGD's Q, a threshold's scale, counters) is not listed."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The compressor's own state (``stateful``). Set ``state_dict_copies`` when its tensors are copies the
        caller owns; otherwise ``nonfinite='skip'``'s per-step snapshot deep-copies it."""
        return {}

    def live_state(self) -> dict[str, Any] | None:
        """:meth:`state_dict` with its live tensors, uncopied (the per-step snapshot copies them into buffers it
        keeps); None, the default and a subclass's that overrides ``state_dict`` only: ``state_dict`` is copied."""
        return None

    def state_nbytes(self) -> int:
        """Bytes of the tensors of :meth:`state_dict`, counted without copying them (``memory_bytes``). This
        default counts what ``state_dict`` returns; a class whose ``state_dict`` clones sums its live buffers."""
        return tensor_bytes(self.state_dict())

    def state_shape(self, entry: str, shape: torch.Size) -> tuple[int, ...] | None:
        """The shape of the per-tensor buffer of ``entry`` (an ``element_state`` or ``matrix_state`` name) that
        this compressor keeps for a tensor of ``shape`` encoded whole; None when the shape alone does not fix
        it. Element buffers are flat, ``(numel,)``; a ``matrix_state`` factor is the subclass's to give
        (PowerSGD's Q). A state load refuses a buffer of another shape (the method would drop or reject it)."""
        return (math.prod(shape),) if entry in self.element_state else None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"compressor {self.name!r} keeps no state but was given {sorted(state)}")

    # ----- helpers ---------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """Canonical parameter mapping (used in digests and specs)."""
        return {p.name: getattr(self, p.name) for p in self.PARAMS}

    def spec(self) -> str:
        """A spec string that rebuilds this compressor."""
        cfg = self.config()
        if not cfg:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in cfg.items())

    def __repr__(self) -> str:
        return f"<compressor {self.spec()}>"

    def _context(self, ctx: Context | None) -> Context:
        """Default context for standalone use: a fresh step per call (repeated calls draw fresh randomness)."""
        if ctx is not None:
            return ctx
        self._calls += 1
        return Context(step=self._calls, seed=self.seed)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"compressor {self.name!r}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise ValueError(
                f"compressor {self.name!r}: dtype {str(x.dtype).replace('torch.', '')} is not supported; allowed: {allowed}"
            )
        if self.int32_indices:
            check_indexable(x.numel(), self.name)


def declared_with(cls: type, attr: str, method: str, default: Any) -> None:
    """Set ``cls.<attr>`` to ``default`` when the class that declares it comes after the one defining
    ``method`` in ``cls``'s MRO: a declaration about a method (``state_dict_copies`` about ``state_dict``)
    holds for that method only, so a subclass (or a mixin) with its own ``state_dict`` does not inherit it."""
    def where(name: str) -> int:
        return next((i for i, k in enumerate(cls.__mro__) if name in vars(k)), len(cls.__mro__))

    if where(attr) > where(method):
        setattr(cls, attr, default)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
