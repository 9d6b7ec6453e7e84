"""Wire layouts derived from a declaration: the fields of a packet, their
dtypes and bit widths, and the exact byte count for an input.

A :class:`Field` is one payload tensor. Its ``dtype`` is a torch dtype or one
of three words resolved per input dtype:

* ``"scale"``: a 4-byte scale (fp32; for fp64 inputs the int32 upper word
  of the fp64 value, :func:`gradpress.compress.numerics.pack_scale`);
* ``"input"``: the input's own dtype (sparse values);
* ``"compute"``: fp32, fp64 for fp64 inputs.

``count`` is the number of entries for an input of d elements: ``"numel"``,
``"chunks"`` (one per chunk, :meth:`KitCompressor.chunk_size`), an int, a
callable ``(compressor, d) -> int``, or None for a data-dependent size
(``variable_size``). ``bits`` (an int, or the name of an attribute of the
compressor) marks a field of unsigned codes packed LSB-first into
``ceil(count * bits / 8)`` uint8 bytes.

Invariant (tested for every declaration): ``packet.nbytes ==
layout.nbytes(d, dtype)`` for every fixed-size declaration and input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradpress.compress.kit.packing import packed_nbytes
from gradpress.compress.numerics import compute_dtype

__all__ = ["MAX_BITS", "Field", "FieldSize", "resolve_dtype", "sizes", "nbytes"]

#: widest packed code (``kit.pack``)
MAX_BITS = 24


@dataclass(frozen=True)
class Field:
    """One payload tensor of a declared packet (see the module doc)."""

    name: str
    dtype: torch.dtype | str
    count: str | int | Callable[[Any, int], int] | None = "numel"
    bits: int | str | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"kit.Field: name got {self.name!r}; allowed: a non-empty str")
        if not isinstance(self.dtype, (str, torch.dtype)) or (
                isinstance(self.dtype, str) and self.dtype not in ("scale", "input", "compute")):
            raise ValueError(f"kit.Field {self.name!r}: dtype got {self.dtype!r}; "
                             "allowed: a torch dtype, 'scale', 'input', 'compute'")
        c = self.count
        if (isinstance(c, str) and c not in ("numel", "chunks")) or isinstance(c, bool) or (
                isinstance(c, int) and c < 0) or not (c is None or isinstance(c, (str, int)) or callable(c)):
            raise ValueError(f"kit.Field {self.name!r}: count got {c!r}; "
                             "allowed: 'numel', 'chunks', an int >= 0, a callable (comp, d) -> int or None")
        b = self.bits
        if b is None:
            return
        if not (isinstance(b, str) and b) and not (isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BITS):
            raise ValueError(f"kit.Field {self.name!r}: bits got {b!r}; allowed: an int 1..{MAX_BITS}, "
                             "the name of a parameter or attribute holding one, or None")
        if self.dtype != torch.uint8:
            raise ValueError(f"kit.Field {self.name!r}: bits={b!r} packs codes into uint8 bytes, but dtype is "
                             f"{self.dtype!r}; allowed: dtype=torch.uint8")


@dataclass(frozen=True)
class FieldSize:
    """A field resolved for one input: wire dtype, entries, bits, bytes."""

    name: str
    dtype: torch.dtype
    count: int | None
    bits: int | None
    nbytes: int | None


def resolve_dtype(field: Field, dtype: torch.dtype) -> torch.dtype:
    """The wire dtype of ``field`` for an input of ``dtype``."""
    if field.bits is not None:
        return torch.uint8
    if field.dtype == "scale":
        return torch.int32 if dtype == torch.float64 else torch.float32
    if field.dtype == "input":
        return dtype
    if field.dtype == "compute":
        return compute_dtype(dtype)
    assert isinstance(field.dtype, torch.dtype)
    return field.dtype


def _count(field: Field, comp: Any, d: int) -> int | None:
    c = field.count
    if c is None:
        return None
    if c == "numel":
        return d
    if c == "chunks":
        size = comp.chunk_size(d)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"compressor {comp.name!r}: chunk_size({d}) got {size!r}; allowed: an int >= 1")
        return -(-d // size)
    if isinstance(c, int):
        return c
    n = c(comp, d)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"compressor {comp.name!r}: field {field.name!r} count for {d} elements got {n!r}; "
                         "allowed: an int >= 0")
    return n


def _bits(field: Field, comp: Any) -> int | None:
    b = field.bits
    if not isinstance(b, str):
        return b
    value = getattr(comp, b)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BITS:
        raise ValueError(f"compressor {comp.name!r}: field {field.name!r} has bits = {b} = {value!r}; "
                         f"allowed: an int 1..{MAX_BITS}")
    return value


def sizes(fields: tuple[Field, ...], comp: Any, d: int, dtype: torch.dtype) -> list[FieldSize]:
    """Every field resolved for an input of ``d`` elements of ``dtype``."""
    out = []
    for f in fields:
        count = _count(f, comp, d)
        bits = _bits(f, comp)
        wire = resolve_dtype(f, dtype)
        if count is None:
            n = None
        elif bits is not None:
            n = packed_nbytes(count, bits)
        else:
            n = count * torch.empty((), dtype=wire).element_size()
        out.append(FieldSize(f.name, wire, count, bits, n))
    return out


def nbytes(fields: tuple[Field, ...], comp: Any, d: int, dtype: torch.dtype) -> int | None:
    """Exact payload bytes for ``d`` elements of ``dtype``; None when a
    field's size depends on the data."""
    total = 0
    for s in sizes(fields, comp, d, dtype):
        if s.nbytes is None:
            return None
        total += s.nbytes
    return total
