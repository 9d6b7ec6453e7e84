"""Compiled against eager on the fuzzer's inputs at compiled sizes (`make
long`: about 5 minutes of compiles in a fresh Inductor cache, and 79 s more
for ``stosign`` since the methods come from the registry, tidy session).

tests/test_fuzz.py runs every compressor on small shapes, which the kit's
``auto`` policy never compiles; here the byte-identical kit declarations run
forced compiled and forced eager on every fuzz kind of value (zeros,
constants, denormals, huge magnitudes, a single non-zero, mixed scales,
tiny) in every dtype, at lengths with a short last row: the packets must be
equal byte for byte and the decoded values finite. TernGrad and onebit are
left out: their compiled scale is the exact fp64 one, which differs from
eager's fp32 passes by design (gradpress/compress/kit/compiler.py). A first
run of this check (13th session) found no difference; it did show the
recompile limit sending later dtypes to eager, fixed by per-signature
variants.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from kit_compare import FP64_SCALES, kit_methods
from test_fuzz import KINDS, make_values

import gradpress
from gradpress.compress import Context
from gradpress.compress.kit import compiler

#: every kit method that compiles (from the registry) but the fp64-scale ones, and a few other parameterizations
SPECS = [n for n in kit_methods() if n not in FP64_SCALES] + ["qsgd:levels=1", "qsgd:levels=300",
                                                             "minmax8:stochastic=true"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [16_384 + 3, 2 * 65_536 + 17]


@pytest.mark.long
@pytest.mark.parametrize("spec", SPECS)
def test_compiled_packets_equal_eager_on_every_fuzz_kind(spec: str) -> None:
    for dtype, kind, n in itertools.product(DTYPES, KINDS, SIZES):
        x = make_values(kind, (n,), dtype, n)
        packets = {}
        for mode in ("off", "on"):
            comp = gradpress.compressor(spec)
            with compiler.forced(mode), warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no failed compile, no recompile limit
                packet = comp.encode(x, Context(key="fuzz", step=5, seed=1))
                out = comp.decode(packet)
            assert out.shape == x.shape and out.dtype == x.dtype
            assert torch.isfinite(out).all(), (spec, dtype, kind, n, mode)
            packets[mode] = packet
        eager, compiled = packets["off"], packets["on"]
        assert len(eager.tensors) == len(compiled.tensors)
        for a, b in zip(eager.tensors, compiled.tensors, strict=True):
            assert torch.equal(a, b), (spec, dtype, kind, n)
