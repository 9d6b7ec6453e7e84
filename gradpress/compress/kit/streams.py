"""The kit's standalone ``pack``/``unpack`` of a whole code stream.

Codes that a kernel does not pack itself (widths other than 1, 2 and 4,
every width of a kernel run with ``fuse_pack=False``, and the short last
chunk: :func:`gradpress.compress.kit.primitives.elementwise`) and packets
decoded outside a kernel go through here. The stream is cut
into whole word groups (C = 32 / gcd(bits, 32) codes filling W int32
words) and a tail shorter than one group. Compiled (CPU under ``auto``,
little-endian, the widths below), the groups go through
:func:`gradpress.compress.kit.packing.pack_words` /
:func:`~gradpress.compress.kit.packing.unpack_words` written straight into
the result buffer; the tail, and everything when the policy does not
compile (small tensors, ``GRADPRESS_COMPILE=0``, an accelerator under
``auto``), through
the eager :func:`gradpress.compress.bits.pack_bits` /
:func:`~gradpress.compress.bits.unpack_bits`.

Invariant: the same bytes (and codes) as the eager functions for every
width 1..24 and length, for codes below ``2**bits`` (the contract of a
pack; a larger or negative code may spill into its neighbours
differently, unless ``GRADPRESS_KIT_CHECK=1`` refuses it: :func:`checking`);
a group ends on a byte boundary (C * bits is a multiple of 32), so the
tail's bytes simply follow. At 25M codes, one
thread, compiled against eager (docs/bench.md, "Word-wide packs"): packing
3, 5, 6 and 7 bits 5.5-6.5 ms against 31-48 ms, 12 bits 7.8 against 180;
unpacking 12 bits 54 ms against 203.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from gradpress.compress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compress.kit import compiler, packing

__all__ = ["CHECK_ENV", "CodeWidthError", "checking", "check_codes", "pack", "unpack"]


#: widths whose word groups are compiled (25M codes, one thread, docs/bench.md): packing every width but 1
#: (eager's multiply trick, as fast or faster) and 8 (a cast), measured faster at 3-7, 12 and 16 bits (the
#: other wide widths run the same kernel shape); 2 bits is about as fast as eager alone (3.7 against 2.7 ms
#: on one thread, 1.8 against 1.8 on two) but faster inside an encode, where eager's temporaries are fresh
#: pages (TernGrad 23 against 33 ms, `qsgd:levels=1` 16.4 against 17.2); unpacking only widths above 8,
#: measured faster at 12 and 16 (the narrow ones' compiled column gathers ran at 0.26-0.63x eager's speed)
_COMPILED_PACK_WIDTHS = frozenset(range(1, 25)) - {1, 8}
_COMPILED_UNPACK_WIDTHS = frozenset(range(9, 25))

_KERNELS: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]] = {}


def _kernel(kind: str, bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The word-group kernel ``kind`` ("pack": codes to bytes, "unpack":
    int32 words to codes) for one width, a function of its own (the width a
    constant the compile specializes on; :func:`compiler.run` compiles each
    on a code object of its own, so the widths do not share Dynamo's
    recompile limit)."""
    fn = _KERNELS.get((kind, bits))
    if fn is None:
        per, words = packing.word_group(bits)
        if kind == "pack":
            def fn(codes: torch.Tensor) -> torch.Tensor:
                return packing.pack_words(codes.view(-1, per), bits)
        else:
            def fn(data: torch.Tensor) -> torch.Tensor:
                return packing.unpack_words(data.view(-1, words), bits)
        fn.__qualname__ = f"kit.streams.{kind}[{bits} bits]"
        fn = _KERNELS.setdefault((kind, bits), compiler.cpu_only(fn))
    return fn


def _whole(numel: int, bits: int, device: torch.device, kind: str) -> int:
    """Codes in whole word groups when the ``kind`` kernel compiles for
    them, else 0 (every code then goes the eager way)."""
    if not isinstance(bits, int) or bits not in (_COMPILED_PACK_WIDTHS if kind == "pack" else _COMPILED_UNPACK_WIDTHS) \
            or sys.byteorder != "little":
        return 0
    whole = numel // packing.WORD_GROUP[bits] * packing.WORD_GROUP[bits]
    return whole if whole and compiler.will_compile(_kernel(kind, bits), whole, device.type) else 0


#: the opt-in debug mode: every pack checks that its codes fit their width (one more pass over the codes)
CHECK_ENV = "GRADPRESS_KIT_CHECK"


class CodeWidthError(ValueError):
    """A code that does not fit the width it is packed at (under :data:`CHECK_ENV`)."""

    def __init__(self, code: int, bits: int, what: str | None = None) -> None:
        what = what or f"kit.pack: a code of {code} does not fit {bits} bits"
        super().__init__(f"{what}; allowed: codes 0..{2 ** bits - 1} (checked by {CHECK_ENV}=1)")
        self.code, self.bits = code, bits


def checking() -> bool:
    """Whether ``GRADPRESS_KIT_CHECK=1``: packs check their codes (off by default: a check is a pass over the
    codes); ValueError naming the variable for a value other than 0, 1 or unset."""
    given = os.environ.get(CHECK_ENV, "")
    if given.strip() not in ("", "0", "1"):
        raise ValueError(f"{CHECK_ENV} got {given!r}; allowed: 0, 1 (or unset)")
    return given.strip() == "1"


def check_codes(codes: torch.Tensor, bits: int) -> None:
    """CodeWidthError naming the largest code above ``2**bits - 1`` (or the most negative one)."""
    if not codes.numel():
        return
    hi, lo = int(codes.max()), int(codes.min())
    if hi >= 1 << bits:
        raise CodeWidthError(hi, bits)
    if lo < 0:
        raise CodeWidthError(lo, bits)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 LSB-first stream of the flat unsigned ``codes`` (each < 2**bits,
    ``bits`` in 1..24): ``ceil(n * bits / 8)`` bytes. A wider code spills into
    its neighbours unless ``GRADPRESS_KIT_CHECK=1`` (:func:`checking`), which
    refuses it (:class:`CodeWidthError`)."""
    codes = codes.reshape(-1)
    if checking():
        check_codes(codes, bits)
    n = codes.numel()
    whole = _whole(n, bits, codes.device, "pack")
    if not whole:
        return pack_bits(codes, bits)
    kernel = _kernel("pack", bits)
    if whole == n:
        return compiler.run(kernel, whole, codes)
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=codes.device)
    head = whole * bits // 8
    compiler.run(compiler.into(kernel), whole, out[:head], codes[:whole])
    out[head:] = pack_bits(codes[whole:], bits)
    return out


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``numel`` codes, uint8 for bits <= 8, int32
    wider; ValueError for a buffer of the wrong size."""
    data = data.reshape(-1)
    whole = _whole(numel, bits, data.device, "unpack")
    if not whole or data.numel() != packed_nbytes(numel, bits):
        return unpack_bits(data, bits, numel)  # also raises the size error
    head = whole * bits // 8
    words = data[:head]
    if not words.is_contiguous() or words.data_ptr() % 4:  # a packet inside a received buffer starts at any byte
        words = words.clone(memory_format=torch.contiguous_format)
    words = words.view(torch.int32)
    kernel = _kernel("unpack", bits)
    if whole == numel:
        return compiler.run(kernel, whole, words)
    out = torch.empty(numel, dtype=torch.uint8 if bits <= 8 else torch.int32, device=data.device)
    compiler.run(compiler.into(kernel), whole, out[:whole], words)
    out[whole:] = unpack_bits(data[head:], bits, numel - whole)
    return out
