"""Which compressors compressed gossip may use, and the per-tensor codec
that turns a list of tensors into one wire buffer and back.

Soundness (CHOCO-SGD, Koloskova et al. 2019, Assumption 1; the same holds
for SGP's per-edge public copies, :mod:`gradpress.algorithms.sgp`): gossip
compresses the difference between a node's model and its *public copy*
x^, and the copy moves by what was sent, x^ <- x^ + Q(x - x^). The copies
converge to the models only if Q is *contractive*,
E||Q(v) - v||^2 <= (1 - delta)||v||^2 with delta > 0. Read from the
compressor's declared traits and parameters, never from its name:

* ``identity`` (``none``): exact gossip, no copies at all;
* a sparsifier whose kept values are exact (trait ``exact_values``: topk,
  threshold, gaussiank, redsync, sidco, dgc_threshold): ||Q(v) - v||^2 is the
  dropped part's energy, delta >= kept fraction;
* known contractive quantizers: unscaled random-k (delta = k/d in
  expectation), scaled sign (efsignsgd: delta = ||v||_1^2 / (d ||v||^2)),
  onebit (two group means: the least-squares fit of the sign pattern),
  fp16/bf16 and rangefloat (relative rounding error < 1), fft (drops the
  smallest orthonormal coefficients: a projection);
* an unbiased compressor with a known variance factor omega
  (E||Q(v) - v||^2 <= omega ||v||^2; qsgd, natural, dithering,
  randomk:scale=true) is used as Q/(1 + omega), which is contractive with
  delta = 1/(1 + omega) (Koloskova et al. 2019, Sec. 3); both ends scale the
  decoded message the same way;
* a composition ``first>second``: contractive ``first`` and unbiased
  ``second`` with omega < 1 (``topk>natural``: delta' = delta (1 - omega)).

Refused, with the reason: majority-vote compressors (signsgd, signum: a
message is a vote, not a value), multi-round allreduce protocols
(powersgd: gossip sends one message per edge), compressors with their own
error memory (dgc, adacomp: the copies already are the error feedback) and
anything else without a contraction or variance bound (minmax8, terngrad).
Every fact comes from the compressor's own traits: ``contractive`` /
``is_contractive`` (or ``exact_values``) and ``variance_factor(numel)``
(:class:`~gradpress.compress.base.Compressor`), so a compressor written
outside gradpress, or re-expressed in another implementation, is classified
by what it declares.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gradpress.compress import Compressor, Context, Packet, create
from gradpress.compress import registry as compressor_registry
from gradpress.compress.compose import Composed
from gradpress.exchange.keys import escape
from gradpress.transport.wire import pack_packets, unpack_packets

__all__ = ["gossip_scale", "accepted_compressors", "Codec"]


def _omega(comp: Compressor, numel: int) -> float | None:
    """The compressor's declared variance factor omega on ``numel`` entries."""
    omega = comp.variance_factor(numel) if hasattr(comp, "variance_factor") else None
    return None if omega is None else float(omega)


def _contractive(comp: Compressor) -> bool:
    return bool(getattr(comp, "is_contractive", False) or getattr(comp, "contractive", False) is True)


def _classify(comp: Compressor, numel: int) -> tuple[float, str | None]:
    """(scale, None) for an accepted compressor, (0, why) for a refused one."""
    if comp.identity:
        return 1.0, None
    if type(comp).rounds > 1:
        return 0.0, "it is a multi-round allreduce protocol; gossip sends one message per edge"
    if type(comp).aggregation != "mean":
        return 0.0, f"its messages are {type(comp).aggregation} votes, not values that can be added to a copy"
    if comp.own_error_memory:
        return 0.0, "it keeps its own error memory; the public copies x^ already are the error feedback"
    if isinstance(comp, Composed):
        first, second = comp.first, comp.second
        w2 = _omega(second, numel) if second.is_unbiased else None
        if comp.is_unbiased:
            w1 = _omega(first, numel)
            if w1 is not None and w2 is not None:
                return 1.0 / ((1.0 + w1) * (1.0 + w2)), None
            return 0.0, "no variance factor is known for its stages"
        if _contractive(first) and w2 is not None and w2 < 1.0:
            return 1.0, None
        return 0.0, "a composition must be a contractive sparsifier followed by an unbiased quantizer with omega < 1"
    if comp.is_unbiased:
        omega = _omega(comp, numel)
        if omega is not None:
            return 1.0 / (1.0 + omega), None
        return 0.0, "it is unbiased but declares no variance factor omega (so Q/(1 + omega) cannot be formed)"
    if _contractive(comp):
        return 1.0, None
    return 0.0, "it is neither contractive (||Q(x) - x||^2 <= (1 - delta)||x||^2) nor unbiased with a known variance"


def gossip_scale(comp: Compressor, numel: int, method: str) -> float:
    """The factor both ends apply to a decoded message of ``numel`` entries:
    1.0 for a contractive compressor, 1/(1 + omega) for an unbiased one;
    raises ValueError naming the compressor and why it is refused."""
    scale, why = _classify(comp, numel)
    if why is None:
        return scale
    raise ValueError(f"algorithm {method!r}: compressor {comp.spec()!r} is refused: {why}. Compressed gossip "
                     f"needs a contractive Q; accepted: {', '.join(accepted_compressors())} (see "
                     "gradpress/algorithms/gossip_codec.py)")


def accepted_compressors() -> list[str]:
    """The registered compressors (default parameters) gossip accepts."""
    out = []
    for name in compressor_registry.names():
        try:
            comp = create(name)
        except ValueError:
            continue
        if _classify(comp, 4096)[1] is None:
            out.append(name + ("" if not comp.is_unbiased or comp.identity else " (unbiased: /(1+omega))"))
    return out


class Codec:
    """Per tensor: the compressor (its decoded output times
    :func:`gossip_scale`) or, for tensors the plan leaves uncompressed (1-D,
    below ``min_numel``) and for the identity, the tensor itself. One wire
    buffer per message (:func:`~gradpress.transport.wire.pack_packets`),
    optionally with extra float64 scalars (SGP's PushSum weight). ``context``
    builds each encode's Context from the key and the caller's step: the
    algorithm's engine's :meth:`~gradpress.exchange.Synchronizer.context`, the
    one every exchange path uses (seed, rank, world and the counted step:
    a dropped step does not count), never a copy of it."""

    def __init__(self, compressor: Compressor, keys: list[str], shapes: list[torch.Size], compressed: list[bool],
                 method: str, context: Callable[[str, int], Context]) -> None:
        self.compressor = compressor
        self.plain = create("none")
        self.keys = keys
        self.ctx_keys = [escape(k) for k in keys]  # the compressor's state keys: every path's (exchange/keys.py)
        self.shapes = shapes
        self.compressed = [c and not compressor.identity for c in compressed]
        self.scales = [gossip_scale(compressor, math.prod(s), method) if c else 1.0
                       for s, c in zip(shapes, self.compressed)]
        self.variable = bool(compressor.variable_size) and any(self.compressed)
        self.context = context

    @property
    def any_compressed(self) -> bool:
        return any(self.compressed)

    def _ctx(self, i: int, step: int) -> Context:
        return self.context(self.ctx_keys[i], step)

    def encode(self, tensors: list[torch.Tensor], step: int, scalars: list[torch.Tensor] = ()  # type: ignore[assignment]
               ) -> tuple[torch.Tensor, list[Packet]]:
        """One buffer for ``tensors`` (compressed where planned) and the
        float64 ``scalars``; also the packets (templates for decoding)."""
        packets = [(self.compressor if c else self.plain).encode(t, self._ctx(i, step))
                   for i, (t, c) in enumerate(zip(tensors, self.compressed))]
        dev = tensors[0].device if tensors else None
        packets += [Packet([s.reshape(1).to(dtype=torch.float64, device=dev)], torch.Size([1]), torch.float64)
                    for s in scalars]
        return pack_packets(packets, self.variable, device=tensors[0].device if tensors else None), packets

    def decode_one(self, i: int, packet: Packet) -> torch.Tensor:
        """The value tensor ``i`` stands for (scaled), shaped like it."""
        if not self.compressed[i]:
            return packet.tensors[0].reshape(self.shapes[i])
        out = self.compressor.decode(packet).reshape(self.shapes[i])
        return out * self.scales[i] if self.scales[i] != 1.0 else out

    def decode(self, buffer: torch.Tensor, templates: list[Packet]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(values per tensor, scalars) of a buffer from :meth:`encode` on
        another rank; ``templates``: this rank's packets of the same round."""
        packets = unpack_packets(buffer, templates, self.variable)
        n = len(self.shapes)
        return [self.decode_one(i, packets[i]) for i in range(n)], [p.tensors[0][0] for p in packets[n:]]

    @staticmethod
    def light(packets: list[Packet]) -> list[Packet]:
        """Templates without payload memory (dtype, element count and meta
        are all decoding needs)."""
        return [Packet([torch.zeros((), dtype=t.dtype, device=t.device).expand(t.numel()) for t in p.tensors],
                       p.shape, p.dtype, dict(p.meta)) for p in packets]
