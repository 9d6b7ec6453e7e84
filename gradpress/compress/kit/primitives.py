"""The kit's primitives over flat tensors, the vocabulary of a declaration.

* element-wise ``map``: :func:`elementwise` runs a *kernel* (a function of
  plain tensor ops, written once) over the tensor cut into chunks, compiled
  by :mod:`gradpress.compress.kit.compiler` or eager; per-chunk statistics
  broadcast along the chunk, random draws are fused in (:func:`uniform`,
  :func:`random_bits` inside a kernel);
* ``reduce`` per chunk: :func:`reduce` (``norm``, ``absmax``, ``minmax``,
  ``sum``), range-safe (:mod:`gradpress.compress.numerics`); over the
  whole tensor, :func:`std` and :func:`extremes` (all three in
  :mod:`gradpress.compress.kit.reductions`, re-exported here);
* ``select``/``filter``: :func:`select_topk`, :func:`select_mask`;
* ``scatter``/``gather``: :func:`scatter`, :func:`gather`;
* ``pack``/``unpack`` (``kit.pack``, :mod:`gradpress.compress.kit.streams`;
  inside a kernel :func:`pack_rows`, :mod:`gradpress.compress.kit.packing`) and the
  fields of a packet (``concat``/``extract``:
  :meth:`gradpress.compress.kit.declare.KitCompressor.fields`).

Invariants: no ``.item()`` and no Python loop over elements; a chunk loop
is over at most two views (the whole chunks and the short last one).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from gradpress.compress.bits import unpack_table
from gradpress.compress.kit import compiler, packing, rng, streams
from gradpress.compress.kit.reductions import (  # noqa: F401 - re-exported, and the compiled reductions' home
    _deviation_sums,
    _extremes_sum64,
    _row_extremes,
    _row_minmax,
    _sum64,
    extremes,
    reduce,
    std,
)
from gradpress.compress.kit.rng import random_bits, uniform
from gradpress.compress.numerics import chunks
from gradpress.compress.sparse import topk_magnitude

__all__ = ["FUSED_WIDTHS", "chunks", "reduce", "elementwise", "pack_rows", "pack_signs", "std", "extremes", "uniform", "random_bits", "select_topk", "select_mask",
           "scatter", "gather", "unpack_table"]


#: code widths a kernel packs itself (see :func:`elementwise`)
FUSED_WIDTHS = (1, 2, 4)


def elementwise(kernel: Callable[..., torch.Tensor], flat: torch.Tensor, chunk: int,
                per_chunk: tuple[torch.Tensor, ...] = (), key: torch.Tensor | None = None,
                drawn: torch.Tensor | None = None, pack: int | None = None, fuse_pack: bool | None = None,
                out: torch.Tensor | None = None, **static: Any) -> torch.Tensor:
    """Flat result of ``kernel(v, *stats, key=, drawn=, **static)``
    over ``flat`` cut into chunks (:func:`chunks`); ``v`` is a ``(rows,
    chunk)`` view and each ``per_chunk`` tensor (one entry per chunk) comes
    as a ``(rows, 1)`` column, so ``v * stat`` broadcasts along the chunk.

    Randomness: ``key`` (from :func:`gradpress.compress.kit.rng.seed_words`)
    makes counter-based draws inside the kernel, the element index counted
    over the whole flat tensor; ``drawn`` passes values drawn beforehand
    (one per element of ``flat``: the torch-generator stream). ``static``
    values are Python constants (a compile specializes on them).

    ``pack``: the kernel returns unsigned codes of ``pack`` bits and the
    result is their packed stream (the LSB-first stream of ``kit.pack``).
    The kernel then also takes ``bits`` (= ``pack``) and ``fuse`` and ends
    with ``return pack_rows(codes, bits, fuse)``. ``fuse`` is True when the
    kernel should pack each row itself: widths 1, 2 and 4 (a byte holds whole
    codes) on chunks of whole bytes; the packed rows concatenate to the
    stream. Otherwise (other widths, whose in-kernel packs were measured
    slower than a separate pass, and the short last chunk) it returns the
    codes, uint8 or int32, packed afterwards in one pass over the stream
    (:mod:`gradpress.compress.kit.streams`: compiled word-wide groups).
    ``fuse_pack=False`` takes that way for every width: whether a fused pack
    pays depends on the kernel (25M entries, one thread: QSGD's 2- and 4-bit
    codes 90-100 ms fused against 32-33 ms apart, docs/bench.md). The
    default, ``fuse_pack=None``, fuses off the CPU only: compiled on CPU
    (torch 2.13, one thread, 1M entries) every kernel measured packed faster
    apart (docs/authoring.md's TBQ 0.5 against 5.9 ms fused, a 1-bit sign
    with a per-chunk scale 1.5 against 22, TernGrad 1.9 against 4.9);
    ``True`` fuses on every device. A fused
    kernel's random index comes from an iota, since its packing groups cross
    the key's lane table (:func:`gradpress.compress.kit.rng.element_index`);
    apart, from the lane table (TernGrad's choice: gradpress/compress/terngrad.py).

    ``out`` (no ``pack``): a flat contiguous buffer of the result's size, dtype and device that the compiled
    kernel writes straight into (decoders: no fresh output, docs/bench.md "Decoding into a buffer"); the result
    is ``out``. Any other ``out`` is a ValueError naming both, on every path (never cast into).
    """
    if pack is not None:
        _check_packing_kernel(kernel, pack)
    parts = chunks(flat, max(chunk, 1))
    _check_per_chunk(per_chunk, sum(v.shape[0] for v in parts), max(chunk, 1), flat.numel())
    # GRADPRESS_KIT_CHECK: every code stream is packed apart (the same bytes), where its codes are checked
    if fuse_pack is None:  # the default: fused off the CPU only (on CPU the fused pack measured slower)
        fuse_pack = flat.device.type != "cpu"
    fuse = fuse_pack and pack in FUSED_WIDTHS and (chunk * pack) % 8 == 0 and not streams.checking()
    calls = []
    start = row = 0
    for v in parts:
        rows, n = v.shape[0], v.numel()
        stats = tuple(s[row: row + rows, None] if s.dim() else s for s in per_chunk)
        fused = fuse and v.shape[1] == chunk
        # a row-packing kernel reads its codes in groups that cross the key's index lanes (every lane
        # load became a gather: TernGrad 25 -> 235 ms at 25M entries), so it keeps the iota index
        part_key = None if key is None else rng.offset_key(key, start, lanes=not fused)
        part_drawn = None if drawn is None else drawn[start: start + n].view(v.shape)
        extra = {} if pack is None else {"bits": pack, "fuse": fused}
        calls.append((v, stats, {"key": part_key, "drawn": part_drawn, **extra, **static}, pack is None or fused))
        start += n
        row += rows
    # whole chunks and tail in one buffer: codes a kernel does not pack itself then go through one stream
    # pack; a kernel that packs its rows writes them packed, and the tail's codes are packed behind them
    _check_out(out, flat.numel(), None, flat.device, pack)
    if len(calls) == 2 and compiler.will_compile(kernel, calls[0][0].numel(), flat.device.type) \
            and compiler.will_compile(compiler.into(kernel), calls[0][0].numel(), flat.device.type):
        res = _whole_and_tail(kernel, calls, pack if fuse else None, out)
        return res if pack is None or fuse else streams.pack(res, pack)
    if out is not None and len(calls) == 1 \
            and compiler.will_compile(compiler.into(kernel), calls[0][0].numel(), flat.device.type):
        v, stats, kw, _ = calls[0]  # one view: the compiled kernel writes into out, once its dtype is known
        _check_out(out, flat.numel(), _probe(kernel, v, stats, kw).dtype, flat.device)
        compiler.run(compiler.into(kernel), v.numel(), out.view(v.shape), v, *stats, **kw)
        return out
    outs, codes = [], []
    for v, stats, kw, direct in calls:
        part = compiler.run(kernel, v.numel(), v, *stats, **kw).reshape(-1)
        (outs if direct else codes).append(part)
    if pack is not None:
        if codes:
            outs.append(streams.pack(torch.cat(codes) if len(codes) > 1 else codes[0], pack))
        if not outs:
            return streams.pack(flat.new_zeros(0, dtype=torch.uint8), pack)
    elif not outs:
        outs = [kernel(flat.view(0, 1), *(s[:0, None] if s.dim() else s for s in per_chunk), key=key,
                       drawn=None if drawn is None else drawn.view(0, 1), **static).reshape(-1)]
    if out is not None:  # eager: the result is known, and copied into out only where it is out's dtype
        _check_out(out, sum(o.numel() for o in outs), outs[0].dtype, flat.device)
        return torch.cat(outs, out=out) if len(outs) > 1 else out.copy_(outs[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _check_per_chunk(per_chunk: tuple[torch.Tensor, ...], rows: int, chunk: int, numel: int) -> None:
    """ValueError unless every ``per_chunk`` statistic is 0-dim or has one entry per chunk of ``flat`` (one
    reduced with another chunk was used silently, its first entries scaling the wrong chunks)."""
    for i, s in enumerate(per_chunk):
        if s.dim() and s.shape[0] != rows:
            raise ValueError(f"kit.elementwise: per_chunk[{i}] has {s.shape[0]} entries; flat has {rows} chunks of "
                             f"{chunk} ({numel} entries); allowed: one entry per chunk (kit.reduce(flat, op, {chunk}) "
                             "with the same chunk) or a 0-dim tensor")


def _check_packing_kernel(kernel: Callable[..., Any], pack: int) -> None:
    """ValueError unless ``kernel`` takes the ``bits`` and ``fuse`` keywords that ``pack=`` calls it with
    (written without them it failed inside the call, "unexpected keyword argument 'bits'")."""
    try:
        missing = _missing_keywords(kernel, ("bits", "fuse"))
    except TypeError:  # an unhashable callable: not checked (the call itself says what is wrong)
        return
    if missing:
        raise ValueError(f"kit.elementwise: pack={pack} calls the kernel with bits= and fuse=; "
                         f"{getattr(kernel, '__qualname__', kernel)!r} does not take {' or '.join(missing)}; "
                         "allowed: def kernel(v, *stats, key, drawn, bits, fuse) ending with "
                         "return kit.pack_rows(codes, bits, fuse)")


@functools.lru_cache(maxsize=256)
def _missing_keywords(kernel: Callable[..., Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``kernel`` cannot take as keywords (none where its signature is unknown)."""
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ()
    return tuple(n for n in names if n not in params or params[n].kind is inspect.Parameter.POSITIONAL_ONLY)


def _check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype | None, device: torch.device,
               pack: int | None = None) -> None:
    """ValueError unless ``out`` (if any) is a flat contiguous tensor of ``numel`` entries of ``dtype``
    (``None``: not known yet) on ``device``, and no ``pack``: the result is never cast into another dtype."""
    if out is None or (pack is None and out.shape == (numel,) and out.is_contiguous() and out.device == device
                       and dtype in (None, out.dtype)):
        return
    given = f"{tuple(out.shape)} x {out.dtype} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}"
    raise ValueError(f"kit.elementwise: out is {given}{'' if pack is None else f' with pack={pack}'}; the result is "
                     f"({numel},) x {dtype or 'its dtype'} on {device}; allowed: a flat contiguous tensor of that "
                     "size, dtype and device, and no pack")


def _probe(kernel: Callable[..., torch.Tensor], v: torch.Tensor, stats: tuple, kw: dict) -> torch.Tensor:
    """``kernel`` run eagerly on the first row of ``v``: its result's dtype and row width."""
    one = {**kw, "drawn": None if kw["drawn"] is None else kw["drawn"][:1]}
    return kernel(v[:1], *(s[:1] if s.dim() else s for s in stats), **one)


def _whole_and_tail(kernel: Callable[..., torch.Tensor], calls: list, pack: int | None = None,
                    buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The result of the whole chunks and the short last chunk in one buffer (``buffer`` where given, its
    size, dtype and device the result's): the whole chunks' shape and dtype from the kernel run eagerly on one
    row, the tail (small), then the compiled kernel writes the whole chunks straight into the buffer.
    Concatenating the two results instead (a fresh copy of the whole output) cost three times the kernel at 25M
    entries (23.6 ms against 7.5 ms, one thread). ``pack``: the whole rows pack themselves (fused widths) and
    the tail's codes are packed here."""
    (v, stats, kw, _), (tv, tstats, tkw, _) = calls
    probe = _probe(kernel, v, stats, kw)
    _check_out(buffer, 0 if buffer is None else buffer.numel(), probe.dtype, v.device)  # before anything compiled
    tail = compiler.run(kernel, tv.numel(), tv, *tstats, **tkw).reshape(-1)
    if pack is not None:  # the whole rows packed themselves; the short tail returned its codes
        tail = streams.pack(tail, pack)
    width = probe.numel()
    size = v.shape[0] * width + tail.numel()
    _check_out(buffer, size, probe.dtype, v.device)
    out = torch.empty(size, dtype=probe.dtype, device=v.device) if buffer is None else buffer
    compiler.run(compiler.into(kernel), v.numel(), out[: v.shape[0] * width].view(v.shape[0], width), v, *stats, **kw)
    out[v.shape[0] * width:] = tail
    return out


def pack_rows(codes: torch.Tensor, bits: int, fuse: bool) -> torch.Tensor:
    """Inside a kernel: with ``fuse``, the ``(rows, c)`` codes packed row by
    row, ``(rows, c * bits / 8)`` uint8 (the same LSB-first stream as
    :func:`gradpress.compress.kit.packing.pack` of the flattened codes);
    without, the codes as uint8 (``bits <= 8``) or int32, unpacked.

    Fused widths (1, 2, 4: a byte holds whole codes) pack as a shifted sum
    over a ``(rows, c / L, L)`` view: the codes of a byte never overlap, so
    the sum is their or. Inductor then folds the pack into the loop that
    computes the codes; ors of strided columns, or a ``(-1, L)`` view of the
    2-D codes, made it write the int32 codes out and pack them in a second,
    scalar loop (terngrad's kernel at 25M entries, one thread: 117 ms, against
    26 ms for the shifted sum over the 3-D view)."""
    if not fuse:
        return codes.to(torch.uint8 if bits <= 8 else torch.int32)
    per, nb = packing.group(bits)  # a table, not math.gcd: Dynamo breaks the graph there
    if nb != 1:
        return packing.pack_groups(codes.reshape(-1, per), bits).view(codes.shape[0], -1)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    grouped = codes.to(torch.int32).view(codes.shape[0], -1, per)
    return (grouped << shifts).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


@compiler.cpu_reduction
def _signbit_bytes(v: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if sys.byteorder != "little":  # the bit weights serve this branch only
        return torch.where(torch.signbit(v.view(-1, 8)), weights, 0).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    # the top bit of each entry's last byte, or'ed into place: 5.0 against 6.1 ms for the weighted row sum at
    # 25M fp32 entries, one thread (2.6-2.8 against 3.1 on two; docs/bench.md "Index lanes")
    size = v.element_size()
    rows = v.contiguous().view(torch.uint8).view(-1, 8 * size)  # a strided view cannot be reinterpreted
    out = rows[:, size - 1] >> 7
    for j in range(1, 8):  # unrolled at trace time
        out = out | ((rows[:, size * j + size - 1] >> 7) << j)
    return out


@compiler.cpu_reduction
def _nonnegative_bytes(v: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.where(v.view(-1, 8) >= 0, weights, 0).sum(dim=1, dtype=torch.int32).to(torch.uint8)


#: the masks :func:`pack_signs` packs: (eager predicate, compiled byte kernel)
_SIGN_MASKS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]] = {
    "signbit": (torch.signbit, _signbit_bytes),
    "nonnegative": (lambda v: v >= 0, _nonnegative_bytes),
}


def pack_signs(flat: torch.Tensor, mask: str = "signbit") -> torch.Tensor:
    """One bit per entry of ``flat``, packed LSB first (the stream of
    ``pack(mask(flat), 1)``): ``signbit`` (1 for a set sign bit: -0.0 and
    a negative NaN too) or ``nonnegative`` (1 for ``v >= 0``; NaN gives 0).

    Compiled, each byte is built straight from the input (no bool mask
    written out): ``nonnegative`` as a selection of the bit weights 1..128
    summed over a row of 8 entries, ``signbit`` (little-endian) as an or of
    the top bits of the 8 entries' last bytes; the last ``n mod 8`` entries
    are packed eagerly. At 25M entries, one thread: 5-10 ms against 30 ms for
    the eager mask and pack (docs/bench.md)."""
    if mask not in _SIGN_MASKS:
        raise ValueError(f"kit.pack_signs: mask got {mask!r}; allowed: {', '.join(_SIGN_MASKS)}")
    predicate, kernel = _SIGN_MASKS[mask]
    n = flat.numel()
    whole = n // 8 * 8
    if not whole or not compiler.will_compile(kernel, whole, flat.device.type):
        return streams.pack(predicate(flat), 1)
    weights = torch.ones(8, dtype=torch.int32, device=flat.device).bitwise_left_shift_(
        torch.arange(8, dtype=torch.int32, device=flat.device))  # 1, 2, ..., 128 (no host-to-device copy)
    bits = compiler.run(kernel, whole, flat[:whole], weights)
    return torch.cat([bits, streams.pack(predicate(flat[whole:]), 1)]) if whole < n else bits


def select_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, int32 indices)`` of the ``k`` entries of largest magnitude,
    indices ascending; NaN ranks above every number and ties at the k-th
    magnitude go to the lowest indices
    (:func:`gradpress.compress.sparse.topk_magnitude`: a sampled candidate
    filter, then an exact top-k among the candidates)."""
    idx = topk_magnitude(flat, k)
    return flat[idx], idx.to(torch.int32)


def select_mask(flat: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, int32 indices)`` where ``mask`` holds (a threshold filter:
    ``select_mask(x, x.abs() >= tau)``); variable size."""
    idx = torch.nonzero(mask.reshape(-1)).reshape(-1)
    return flat[idx], idx.to(torch.int32)


def scatter(values: torch.Tensor, indices: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Flat tensor of ``numel`` zeros of ``dtype`` with ``values`` at ``indices``."""
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    return out.index_put_((indices.long(),), values.to(dtype))


def gather(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]``: decode codes through a small value table."""
    return table[codes.long()]
