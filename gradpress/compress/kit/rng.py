"""The kit's counter-based random numbers: random bits from a hash of (seed,
element index), computed inside the kernel that uses them instead of a
separate draw pass (Salmon et al. 2011, "Parallel random numbers: as easy as
1, 2, 3", for the counter-based idea; the mixing function is Wellons'
``lowbias32``, a 32-bit integer hash with near-ideal avalanche).

For element i of a call with 63-bit seed S (``ctx.private_seed`` or
``ctx.shared_seed``, already a BLAKE2b digest of run seed, step and key), with
k0, k1 the low and high 32-bit words of S::

    bits(i) = lowbias32(lowbias32(i + k0) ^ k1)          (32 bits)
    uniform(i) = (bits(i) >> 8) / 2^24                  (fp32: 24 bits)
               = (bits(i) >> (32 - p)) / 2^p             (fp16: p = 11, bf16: p = 8)
               = bits(i) / 2^32                          (fp64: all 32 bits)

Invariants: a pure function of (S, i): identical on every rank, every device
and in eager and compiled code (integer ops only, two's complement int32
arithmetic; logical shifts are written as shift-and-mask); ``uniform`` lies
in [0, 1) on a grid of 2^-24 (fp32), 2^-32 (fp64), 2^-11 (fp16) or 2^-8
(bf16: the top bits, each value exact in the dtype), so a stochastic
rounding ``floor(y + u)`` is biased by less than one grid step (the same
granularity as ``torch.rand`` in fp32). Statistical quality is tested in
tests/test_kit_rng.py (chi-square uniformity of bytes and of the top bits,
serial pairs of neighbours, correlation between seeds).

The index i is the element's position plus the part's offset; a compiled
CPU kernel builds it from a lane table the key carries
(:func:`element_index`), which gives the same i as an iota, faster.
"""

from __future__ import annotations

import torch

__all__ = ["LANES", "seed_words", "offset_key", "element_index", "counter_bits", "counter_uniform", "uniform",
           "random_bits", "signed32"]

_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)  # the same 32-bit pattern as a signed int32 constant
MAX_NUMEL = (1 << 31) - 1


def signed32(v: int) -> int:
    """The low 32 bits of ``v`` as a signed int32 value."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


#: lanes of the index table a key carries (one AVX-512 vector of int32)
LANES = 16


def seed_words(seed: int, device: torch.device | str = "cpu", salt: int = 0) -> torch.Tensor:
    """The seed as an int32 tensor ``[k0, k1, offset = 0, 0, 1, ..., 15]``
    (a tensor, so a compiled kernel takes it as an input and never
    recompiles per step; the offset is the index of a chunk's first element;
    the last :data:`LANES` words are a lane table, which lets a compiled
    kernel build element indices from a vector load instead of an iota:
    Inductor's CPU iota cost 3.3 ms at 25M entries, one thread, more than
    both hash rounds, see :func:`element_index`); ``salt`` derives an
    independent second stream."""
    seed = int(seed) ^ (salt * 0x9E3779B97F4A7C15)
    return torch.tensor([signed32(seed), signed32(seed >> 32), 0, *range(LANES)], dtype=torch.int32, device=device)


def offset_key(key: torch.Tensor, start: int, lanes: bool = True) -> torch.Tensor:
    """``key`` for a part whose first element has index ``start``; without
    its lane table when ``lanes`` is False (:func:`element_index` then
    counts with an iota)."""
    return torch.cat([key[:2], key[2:3] + start] + ([key[3:]] if lanes else []))


def element_index(v: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """int32 index (offset ``key[2]`` + position) of every element of ``v``
    (contiguous), the counter of :func:`counter_bits`. The same values
    whichever way they are built.

    On CPU, when ``v``'s last dimension is a multiple of :data:`LANES` and
    ``key`` carries its lane table, the index is a block base plus the lane
    table, so a compiled kernel loads the lanes as one vector: Inductor
    turned an iota into a ``Vectorized::arange`` per vector, 3.3 ms at 25M
    entries on one thread, more than both hash rounds (natural's kernel 9.7
    -> 6.3 ms, docs/bench.md "Index lanes"). Otherwise (other widths, a key
    without lanes, accelerators, where an iota is free) an iota."""
    width = v.shape[-1] if v.dim() else 1
    if v.device.type != "cpu" or not v.numel() or width % LANES or key.numel() < 3 + LANES:
        return (torch.arange(v.numel(), dtype=torch.int32, device=v.device) + key[2]).view(v.shape)
    rows = v.numel() // width
    # (rows, width / LANES, LANES): the lane is the innermost position itself, never a modulo of a
    # symbolic row length (which made every load a gather: 5x slower)
    row = torch.arange(rows, dtype=torch.int32, device=v.device)[:, None, None] * width
    block = torch.arange(width // LANES, dtype=torch.int32, device=v.device)[None, :, None] * LANES
    return ((row + block + key[2]) + key[3: 3 + LANES][None, None, :]).view(v.shape)


def _lowbias32(h: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on int32 ``h``, in place (``h`` must be a fresh
    tensor: eager code then allocates one temporary, not eleven)."""
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF)).mul_(_M1)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF)).mul_(_M2)
    return h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))


def counter_bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int32, any sign) for every int32 ``index``."""
    return _lowbias32(_lowbias32(index + key[0]).bitwise_xor_(key[1]))


#: significand bits of the narrow float dtypes: their uniforms take that many top bits, so every value is exact
#: (24 bits cast to fp16 overflowed to inf, and rounded up to 1.0 in bf16)
_NARROW = {torch.float16: 11, torch.bfloat16: 8}


def counter_uniform(key: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform [0, 1) of ``dtype`` (fp32: 24-bit grid; fp64: 32-bit grid;
    fp16: 11-bit, bf16: 8-bit, the top bits of the fp32 grid)."""
    h = counter_bits(key, index)
    if dtype in _NARROW:
        p = _NARROW[dtype]
        return ((h >> (32 - p)) & ((1 << p) - 1)).to(dtype) * (2.0 ** -p)
    hi = ((h >> 8) & 0xFFFFFF).to(dtype) * (2.0 ** -24)
    if dtype == torch.float64:
        return hi + (h & 0xFF).to(dtype) * (2.0 ** -32)
    return hi


def _stream_key(key: torch.Tensor | None, drawn: torch.Tensor | None, stream: int, what: str) -> torch.Tensor:
    """``key`` for independent stream ``stream`` (0: ``key`` itself): its
    seed words xor'ed with those of ``stream * 0x9E3779B97F4A7C15``, which is
    the key :func:`gradpress.compress.kit.rng.seed_words` gives for
    ``salt=stream``; chunk offset and lane table kept."""
    if stream and drawn is not None:
        raise ValueError(f"kit.{what}: stream={stream} needs the counter stream; random_stream='torch' pre-draws "
                         "one stream only (allowed there: stream=0)")
    if key is None:
        raise ValueError(f"kit.{what}: the kernel was given neither a key nor drawn values; allowed: pass "
                         "**self.randomness(flat, ctx) (key=, drawn=) to kit.elementwise, in a declaration with "
                         "RANDOM = 'private' or 'shared'")
    if not stream:
        return key
    salt = (stream * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return torch.cat([key[:1] ^ signed32(salt), key[1:2] ^ signed32(salt >> 32), key[2:]])


def uniform(v: torch.Tensor, key: torch.Tensor | None, drawn: torch.Tensor | None, stream: int = 0) -> torch.Tensor:
    """Inside a kernel: uniform [0, 1) draws shaped like ``v`` in its dtype,
    counter-based from ``key`` or the pre-drawn ``drawn``. ``stream``: an
    independent stream of the same key (the draws ``salt=stream`` gives),
    e.g. a random sign and a rounding in one kernel; counter stream only."""
    if drawn is not None and not stream:
        return drawn
    key = _stream_key(key, drawn, stream, "uniform")
    return counter_uniform(key, element_index(v, key), v.dtype)


def random_bits(v: torch.Tensor, key: torch.Tensor | None, drawn: torch.Tensor | None, bits: int,
                stream: int = 0) -> torch.Tensor:
    """Inside a kernel: uniform integers in [0, 2^bits) (int32, bits <= 31)
    shaped like ``v``, counter-based from ``key`` or the pre-drawn ``drawn``;
    ``stream`` as in :func:`uniform`."""
    if drawn is not None and not stream:
        return drawn
    key = _stream_key(key, drawn, stream, "random_bits")
    return (counter_bits(key, element_index(v, key)) >> (32 - bits)) & ((1 << bits) - 1)
