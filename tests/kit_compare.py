"""One rule for comparing a kit method's compiled packet with its eager one
(tests/test_kit_compile.py on CPU, tests/test_cuda.py on CUDA): byte for
byte, except the scales that the compiled path computes in fp64 and rounds
once: ``onebit``'s side means differ from eager's fp32 sums in the last bit
at most; ``terngrad``'s clipping sigma differs from eager's fp32 passes by
their accumulation drift, which grows with the size (3 units in the last
place at 20K entries, 135 at 1M; the compiled one is the exact value
rounded once, tests/test_kit_fused.py)."""

from __future__ import annotations

import math

import torch

from gradpress.compress.base import Packet

#: specs whose compiled scale field (packet tensor 0) may differ from eager's in the last bit
FP64_SCALES = ("onebit", "terngrad")
#: kit declarations that compile no kernel (``topk``: a selection, ``kit.select_topk``, and a scatter):
#: left out of the compiled-against-eager comparisons; tests/test_kit_compile.py checks they compile nothing
UNCOMPILED = ("topk",)


def kit_methods() -> list[str]:
    """Every registered kit declaration that compiles a kernel, by name (its
    default parameters), read from the registry: a kit method added to
    gradpress/compress/ is compared compiled against eager without editing a
    list (these lists were written out, and ``stosign`` was left out)."""
    from gradpress.compress import kit, registry

    return [n for n in registry.names()
            if n not in UNCOMPILED and isinstance(registry.create(n), kit.KitCompressor)]


def std_reference(x: torch.Tensor) -> float:
    """Population standard deviation of ``x`` by the float64 two-pass
    formula with ``math.fsum`` (the reference for ``kit.std``)."""
    v = x.reshape(-1).double().tolist()
    mean = math.fsum(v) / len(v)
    return math.sqrt(math.fsum((a - mean) ** 2 for a in v) / len(v))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_compiled_matches_eager(spec: str, eager: Packet, compiled: Packet, numel: int) -> bool:
    """Asserts the rule for an input of ``numel`` entries; True when the
    packets are byte-identical (then the caller also compares the decodes)."""
    name, where = spec.split(":")[0], (spec, numel)
    if name not in FP64_SCALES:
        assert all(same_bytes(a, b) for a, b in zip(eager.tensors, compiled.tensors)), where
        return True
    (scale_e, codes_e), (scale_c, codes_c) = eager.tensors, compiled.tensors
    drift = 2**-22 if name == "onebit" else 2**-23 * max(8, numel / 512)
    assert torch.allclose(scale_e, scale_c, rtol=drift, atol=0), (where, scale_e, scale_c)
    if name == "onebit" or same_bytes(scale_e, scale_c):  # onebit's signs never depend on the means
        assert same_bytes(codes_e, codes_c), where
        return same_bytes(scale_e, scale_c)
    # terngrad with another scale: only coins near the boundary u * s = |g| can turn
    assert (codes_e != codes_c).double().mean() < 1e-3, where
    return False
