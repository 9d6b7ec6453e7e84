"""One row of ``gradpress bench compressors``: a compressor (or a
``torch.topk``/``torch.kthvalue`` reference) measured on one input tensor.

For each compressor and input size it measures, on one tensor of fp32 data:

* encode and decode throughput, GB/s of fp32 input (``4 * numel`` bytes over
  the median time of ``--repeats`` runs after warm-up; CUDA synchronized);
* wire bytes (``packet.nbytes``, the declared exact wire size) and the
  compression ratio ``4 * numel / wire_bytes``;
* relative error ``||D(C(x)) - x|| / ||x||``;
* for selection methods (a ``ratio``/``density`` parameter): achieved density
  (non-zeros of the decoded tensor / numel) over target density, and the
  speed-up over exact ``torch.topk`` at the same density;
* peak extra memory of one encode + decode (packet and output included) over
  the input bytes (see :mod:`gradpress.bench.measure` for how);
* the copy roofline of the same run, and encode throughput as a fraction of it.

``torch.topk`` and ``torch.kthvalue`` on ``|x|`` at each selection density are
reference rows. Methods with several exchange rounds (PowerSGD) run their
``begin``/``advance``/``finish`` protocol as a world of one (the allreduce of
one rank is the identity); their wire bytes are the sum over rounds. Methods
that reject 1-D input run on a ``(rows, cols <= 1024)`` matrix view.

Invariant: every figure is measured in this run; nothing is estimated.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch

from gradpress.bench.data import matrix_shape
from gradpress.bench.measure import peak_extra_bytes, time_call
from gradpress.bench.specs import build, density_of
from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.handwritten import HANDWRITTEN, handwritten
from gradpress.compress.kit import compiler
from gradpress.compress.spec import parse_stage

__all__ = ["ROW_FIELDS", "VARIANTS", "bench_method", "bench_reference", "variant_applies"]

#: fields every JSON row carries
ROW_FIELDS = (
    "compressor", "name", "kind", "numel", "shape", "device", "data",
    "encode_s", "decode_s", "encode_gbps", "decode_gbps", "decode_into_s", "decode_into_gbps", "wire_bytes", "ratio",
    "rel_error",
    "roofline_gbps", "encode_roofline_fraction",
    "density_target", "density_achieved", "density_quality", "reported_quality", "speedup_vs_topk",
    "peak_temp_bytes", "peak_temp_ratio", "note", "variant", "threads",
)

#: implementations ``--variants`` can compare for a kit declaration: the
#: registered one compiled (torch.compile) or eager, and the frozen
#: hand-written version it replaced (gradpress/compress/handwritten/)
VARIANTS = ("default", "compiled", "eager", "hand")


class _Skip(Exception):
    """This method cannot run on this input; the message says why."""


class _Runner:
    """Uniform encode/decode over one-round compressors and multi-round
    protocols. A multi-round method with its own standalone ``encode``/
    ``decode`` (world of one) is timed through them, so that decode does the
    reconstruction; otherwise its ``begin``/``advance``/``finish`` protocol
    runs as a world of one."""

    def __init__(self, comp: Compressor, x: torch.Tensor) -> None:
        self.comp = comp
        self.x = x
        self.protocol = comp.rounds > 1 and type(comp).encode is Compressor.encode
        self._steps = itertools.count(1)

    def _ctx(self) -> Context:
        # the default context of a fresh compressor's first calls (key "", step 1, 2, ...)
        return Context(step=next(self._steps), seed=self.comp.seed)

    def encode(self) -> Any:
        c = self.comp
        if not self.protocol:
            return c.encode(self.x, self._ctx())
        ctx = self._ctx()
        state, out = c.begin(self.x, ctx)
        if out is None:
            raise _Skip("protocol declined this input (it would travel dense)")
        sent = [out.numel() * out.element_size()]
        while True:
            out = c.advance(state, out, ctx)  # allreduce-sum over one rank is the identity
            if out is None:
                break
            sent.append(out.numel() * out.element_size())
        return state, sum(sent)

    def decode(self, encoded: Any) -> torch.Tensor:
        if not self.protocol:
            return self.comp.decode(encoded)
        return self.comp.finish(encoded[0])

    def wire_bytes(self, encoded: Any) -> int:
        return encoded.nbytes if isinstance(encoded, Packet) else int(encoded[1])


def _rel_error(out: torch.Tensor, x: torch.Tensor) -> float:
    xd = x.double()
    denom = torch.linalg.vector_norm(xd)
    return float(torch.linalg.vector_norm(out.reshape(x.shape).double() - xd) / denom) if denom > 0 else 0.0


def variant_applies(spec: str, variant: str) -> bool:
    """Whether ``variant`` means something for ``spec``: ``default`` always;
    ``compiled``/``eager`` for kit declarations; ``hand`` where a frozen
    hand-written version exists (a single-stage spec)."""
    if variant == "default":
        return True
    if ">" in spec:
        return False
    name, _ = parse_stage(spec)
    if variant == "hand":
        return name in HANDWRITTEN
    from gradpress.compress.kit import KitCompressor
    from gradpress.compress.registry import get_class

    return issubclass(get_class(name), KitCompressor)


def _builder(variant: str) -> Any:
    if variant != "hand":
        return build

    def build_hand(spec: str) -> tuple[Compressor, str]:
        name, params = parse_stage(spec)
        return handwritten(name, **params), "hand-written reference"
    return build_hand


def _compile_mode(variant: str, x: torch.Tensor) -> str:
    """``compiled``: the default policy's compiled path (``auto``, which
    keeps the whole-tensor reductions eager off CPU), forced ``on`` where
    ``auto`` would not compile (a small size, an Inductor without the
    eager-numerics options); ``eager``: ``off``; otherwise the policy."""
    if variant == "compiled":
        auto_compiles = x.numel() >= compiler.MIN_COMPILE_NUMEL and compiler.keeps_eager_numerics(x.device.type)
        return "auto" if auto_compiles else "on"
    return {"eager": "off"}.get(variant, compiler.mode())


def _prepare(spec: str, x: torch.Tensor, builder: Any = build) -> tuple[_Runner, Any, torch.Tensor, str]:
    """``(runner, first encoded, first decoded, note)`` on ``x`` or, when the
    method rejects 1-D input (or, for a multi-round method, its protocol
    declines it), on its matrix view; raises _Skip with every reason when
    none runs. The first call is a fresh instance's ``encode(x)`` with the
    default context (``Context(step=1)``)."""
    errors = []
    candidates = [x]
    rows, cols = matrix_shape(x.numel())
    if rows > 1 and cols > 1:
        candidates.append(x.view(rows, cols))
    for cand in candidates:
        try:
            comp, note = builder(spec)
            if comp.rounds > 1:
                _, out = comp.begin(cand, Context(step=1, seed=comp.seed))
                if out is None:
                    raise _Skip("the multi-round protocol declines this shape (it would travel dense)")
                comp, note = builder(spec)  # fresh again: begin may have touched state
            runner = _Runner(comp, cand)
            encoded = runner.encode()
            out = runner.decode(encoded)
            if tuple(out.shape) != tuple(cand.shape) or out.dtype != cand.dtype:
                raise _Skip(f"decode returned {tuple(out.shape)} {out.dtype} for {tuple(cand.shape)} {cand.dtype}")
            return runner, encoded, out, note
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot run on this input"
            errors.append(f"shape {tuple(cand.shape)}: {exc if isinstance(exc, _Skip) else repr(exc)}")
    raise _Skip("; ".join(errors))


def _base_row(spec: str, name: str, kind: str, x: torch.Tensor, data: str, roof: float) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update(compressor=spec, name=name, kind=kind, numel=x.numel(), shape=list(x.shape),
               device=str(x.device), data=data, roofline_gbps=roof, note="", variant="default",
               threads=torch.get_num_threads())
    return row


def _finish_row(row: dict[str, Any], nbytes_in: int, t_enc: float, t_dec: float | None, wire: int) -> None:
    row["encode_s"] = t_enc
    row["decode_s"] = t_dec
    row["encode_gbps"] = nbytes_in / t_enc / 1e9 if t_enc > 0 else math.inf
    row["decode_gbps"] = (nbytes_in / t_dec / 1e9 if t_dec > 0 else math.inf) if t_dec is not None else None
    row["wire_bytes"] = int(wire)
    row["ratio"] = nbytes_in / wire if wire > 0 else math.inf
    row["encode_roofline_fraction"] = row["encode_gbps"] / row["roofline_gbps"]


def bench_method(spec: str, x: torch.Tensor, data: str, roof: float, repeats: int, warmup: int,
                 variant: str = "default") -> dict[str, Any]:
    """One row for compressor ``spec`` on ``x`` (``variant``: see
    :data:`VARIANTS`; compiled/eager force the kit's compile policy for
    every call of the row, warm-up and compilation excluded from the
    timing); raises _Skip."""
    with compiler.forced(_compile_mode(variant, x)):
        return _bench_method(spec, x, data, roof, repeats, warmup, variant)


def _bench_method(spec: str, x: torch.Tensor, data: str, roof: float, repeats: int, warmup: int,
                  variant: str) -> dict[str, Any]:
    runner, first, out, note = _prepare(spec, x, _builder(variant))
    comp = runner.comp
    label = spec if variant == "default" else f"{spec} [{variant}]"
    row = _base_row(label, comp.name, "method", runner.x, data, roof)
    row.update(note=note, variant=variant)
    # error, density and wire size of the fresh instance's first call: for
    # stateful methods (momentum, residual-like accumulators) later calls
    # compress accumulated state, not x
    wire = runner.wire_bytes(first)
    row["rel_error"] = _rel_error(out, runner.x)
    target = density_of(comp)
    if target is not None:
        achieved = float(torch.count_nonzero(out)) / out.numel()
        row.update(density_target=target, density_achieved=achieved, density_quality=achieved / target)
    del first, out
    device = x.device
    nbytes_in = x.numel() * 4
    t_enc, encoded = time_call(runner.encode, device, repeats, warmup)
    t_dec, out = time_call(functools.partial(runner.decode, encoded), device, repeats, warmup)
    _finish_row(row, nbytes_in, t_enc, t_dec, wire)
    if isinstance(encoded, Packet):  # decoding into a reused buffer: no fresh output's page faults
        buf = torch.empty(encoded.shape, dtype=encoded.dtype, device=device)
        t_into, _ = time_call(functools.partial(comp.decode_into, encoded, buf), device, repeats, warmup)
        row.update(decode_into_s=t_into, decode_into_gbps=nbytes_in / t_into / 1e9 if t_into > 0 else math.inf)
        del buf
    quality = getattr(comp, "quality", None)
    if isinstance(quality, (int, float)) and not isinstance(quality, bool):
        row["reported_quality"] = float(quality)
    del encoded, out

    def enc_dec() -> Any:
        enc = runner.encode()
        return enc, runner.decode(enc)

    peak = peak_extra_bytes(enc_dec, device)
    row.update(peak_temp_bytes=peak, peak_temp_ratio=peak / nbytes_in)
    return row


def bench_reference(kind: str, density: float, x: torch.Tensor, data: str, roof: float,
                    repeats: int, warmup: int) -> dict[str, Any]:
    """``torch.topk`` or ``torch.kthvalue`` selection of ``|x|`` at ``density``
    (wire size counted as fp32 values + int32 indices, as top-k sends)."""
    n = x.numel()
    k = min(n, max(1, math.ceil(density * n)))
    if kind == "topk":
        def fn() -> Any:
            return torch.topk(x.abs(), k, sorted=False)
    else:
        def fn() -> Any:
            return torch.kthvalue(x.abs(), n - k + 1)
    t, _ = time_call(fn, x.device, repeats, warmup)
    row = _base_row(f"ref:{kind}@{density:g}", kind, "reference", x, data, roof)
    _finish_row(row, n * 4, t, None, 8 * k)
    _, idx = torch.topk(x.abs(), k, sorted=False)
    kept = torch.zeros_like(x)
    kept[idx] = x[idx]
    row["rel_error"] = _rel_error(kept, x)
    row.update(density_target=density, density_achieved=k / n, density_quality=(k / n) / density)
    peak = peak_extra_bytes(fn, x.device)
    row.update(peak_temp_bytes=peak, peak_temp_ratio=peak / (n * 4))
    return row
