"""``powersgd``: rank-r power iteration (Vogels et al. 2019, "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization").

The gradient is viewed as an n x m matrix M (shape[0] x rest). With Q from
the previous step (warm start) or a Gaussian drawn from the *shared* seed:
P = M Q; allreduce P; orthogonalize P (Gram-Schmidt with an epsilon guard
against zero columns); Q = M^T P; allreduce Q and divide by N; the average is
approximated by P Q^T. Two allreduce rounds, both summable; the strategy
drives them through ``begin``/``advance``/``finish`` in a fixed order.

A tensor travels dense (plain average) before ``start_iter`` steps, when it
is not a matrix, or when low rank would not save enough:
(n + m) * r * min_compression_rate >= n * m. Error feedback (default on)
keeps M - P Q^T with the aggregated factors, as the reference code does.

Invariant: every rank computes P from the same summed P and Q from the same
summed Q, so P Q^T is bit-identical on every rank.

Extreme inputs: computed in fp32 (fp64 for fp64 inputs, never converted to
fp32). The warm-start Q (whose magnitude is the last gradient's) is scaled
by a power of two to unit maximum before P = M Q, so P has the gradient's
magnitude, not its square (which overflows beyond ~1e19 and flushes to zero
below ~1e-23 in fp32); every rank holds the same Q, so every rank scales
alike, and orthogonalization makes the result independent of the scale.
Orthogonalization divides each column by its norm computed without
overflow or underflow, guarding only exact zeros (PyTorch's hook default,
epsilon = 0): a fixed epsilon added to the norm would shrink the columns of
small gradients towards zero. Results an fp16 output cannot hold saturate
at 65504.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from gradpress.compress.base import Compressor, Context, Packet, Param, all_finite, generator_for, tensor_bytes
from gradpress.compress.numerics import compute_dtype, row_norms, saturate_, scale_pow2
from gradpress.compress.registry import register


def orthogonalize(p: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (in place); a loop over the r
    columns (r is small), never over elements. Each column is divided by its
    norm (computed without overflow or underflow) plus ``eps``; a zero
    column stays zero."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        n = row_norms(col.t()).reshape(())
        col.div_(torch.where(n > 0, n, torch.ones_like(n)) + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
    return p


class _Rounds:
    __slots__ = ("key", "matrix", "p", "q", "shape", "dtype")

    def __init__(self, key: str, matrix: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
        self.key = key
        self.matrix = matrix
        self.p: torch.Tensor | None = None
        self.q: torch.Tensor | None = None  # the averaged Q, once the second round is done
        self.shape = shape
        self.dtype = dtype


@register
class PowerSGD(Compressor):
    name = "powersgd"
    PARAMS = (
        Param("rank", int, 2, "integer >= 1", lambda v: v >= 1, "approximation rank r"),
        Param("start_iter", int, 10, "integer >= 0", lambda v: v >= 0, "plain averaging for the first steps"),
        Param("min_compression_rate", float, 2.0, ">= 1", lambda v: v >= 1, "compress only if n*m > (n+m)*r*rate"),
        Param("warm_start", bool, True, "true or false", None, "reuse last step's Q"),
    )
    summable = True
    stateful = True
    state_dict_copies = True  # state_dict clones Q
    matrix_state = ("q",)  # Q: one row per column of the shape[0] x m matrix
    rounds = 2
    summary = "rank-r PowerSGD (Vogels et al. 2019), two summable allreduce rounds, warm start"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.q: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ shape
    def _matrix_shape(self, shape: torch.Size) -> tuple[int, int] | None:
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape[1:])
        if n == 0 or m == 0:
            return None
        r = min(self.rank, n, m)
        if (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return n, m

    def compresses(self, shape: torch.Size, step: int) -> bool:
        return step >= self.start_iter and self._matrix_shape(shape) is not None

    # --------------------------------------------------------------- protocol
    def begin(self, x: torch.Tensor, ctx: Context) -> tuple[Any, torch.Tensor | None]:
        self._check_input(x)
        dims = self._matrix_shape(x.shape)
        if ctx.step < self.start_iter or dims is None:
            return None, None
        n, m = dims
        r = min(self.rank, n, m)
        cdt = compute_dtype(x.dtype)
        matrix = x.reshape(n, m).to(cdt)
        q = self.q.get(ctx.key) if self.warm_start else None
        if q is None or q.shape != (m, r) or q.device != x.device or q.dtype != cdt:
            gen = generator_for(x.device, ctx.shared_seed)
            q = torch.randn(m, r, generator=gen, device=x.device, dtype=cdt)
        else:
            # a step with a NaN/Inf somewhere leaves a non-finite Q behind: start afresh
            # then; a zero gradient (an unused parameter) leaves zero columns, from which
            # P = M Q would stay zero forever: those columns start afresh (every rank holds
            # the same Q, so every rank decides alike; no host sync)
            gen = generator_for(x.device, ctx.shared_seed)
            fresh = torch.randn(m, r, generator=gen, device=x.device, dtype=cdt)
            lo, hi = torch.aminmax(q)
            usable = all_finite(q) & (q != 0).any(dim=0, keepdim=True)
            q = torch.where(usable, q * scale_pow2(torch.maximum(-lo, hi), cdt), fresh)
        state = _Rounds(ctx.key, matrix, x.shape, x.dtype)
        return state, matrix @ q

    def advance(self, state: Any, reduced: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        if state.p is None:
            state.p = orthogonalize(reduced.clone())
            return state.matrix.t() @ state.p
        q = reduced / ctx.world_size
        self.q[state.key] = q
        state.q = q  # P Q^T is formed in finish, straight into the output when possible
        state.matrix = None
        return None

    def finish(self, state: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        q = state.q
        if out is not None and out.dtype == state.p.dtype and out.is_contiguous() and out.shape == state.shape:
            torch.mm(state.p, q.t(), out=out.view(state.p.shape[0], -1))
            return out
        return saturate_(state.p @ q.t(), state.dtype).reshape(state.shape).to(state.dtype)

    # ----------------------------------------------------- single-process use
    def _encode(self, x: torch.Tensor, ctx: Context) -> Packet:
        """Standalone (world of one): the factors [P, Q] of x, or x itself
        when it travels dense."""
        state, out = self.begin(x, dataclasses.replace(ctx, rank=0, world_size=1))
        if out is None:
            return Packet([x.reshape(-1).contiguous()], x.shape, x.dtype)
        q = self.advance(state, out, ctx)
        self.advance(state, q, dataclasses.replace(ctx, rank=0, world_size=1))
        return Packet([state.p.reshape(-1), self.q[ctx.key].reshape(-1)], x.shape, x.dtype)

    def decode(self, packet: Packet) -> torch.Tensor:
        if len(packet.tensors) == 1:
            return packet.tensors[0].reshape(packet.shape).to(packet.dtype)
        n = packet.shape[0]
        m = math.prod(packet.shape[1:])
        p = packet.tensors[0].reshape(n, -1)
        q = packet.tensors[1].reshape(m, -1)
        return saturate_(p @ q.t(), packet.dtype).reshape(packet.shape).to(packet.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * torch.empty(0, dtype=dtype).element_size()

    # ------------------------------------------------------------------ state
    def state_nbytes(self) -> int:
        return tensor_bytes(self.q)

    def state_dict(self) -> dict[str, Any]:
        return {"q": {k: v.clone() for k, v in self.q.items()}}

    def live_state(self) -> dict[str, Any]:
        return {"q": dict(self.q)}

    def state_shape(self, entry: str, shape: torch.Size) -> tuple[int, ...] | None:
        """Q of a tensor of ``shape``: ``(m, min(rank, n, m))`` for the ``n x m`` matrix it compresses;
        None for a shape it sends dense (no Q is kept for it, whatever the step)."""
        dims = self._matrix_shape(shape) if entry == "q" else None
        return None if dims is None else (dims[1], min(self.rank, *dims))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}
