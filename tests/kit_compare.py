"""One rule for comparing a kit method's compiled packet with its eager one
(tests/test_kit_compile.py on CPU, tests/test_cuda.py on CUDA): byte for
byte, except the scales that the compiled path computes in fp64 and rounds
once (``onebit``'s side means, ``terngrad``'s clipping sigma), which may
differ from eager's fp32 passes in the last bit."""

from __future__ import annotations

import torch

from gradpress.compress.base import Packet

#: specs whose compiled scale field (packet tensor 0) may differ from eager's in the last bit
FP64_SCALES = ("onebit", "terngrad")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_compiled_matches_eager(spec: str, eager: Packet, compiled: Packet, where: object) -> bool:
    """Asserts the rule; True when the packets are byte-identical (then the
    caller also compares the decodes)."""
    if spec not in FP64_SCALES:
        assert all(same_bytes(a, b) for a, b in zip(eager.tensors, compiled.tensors)), (spec, where)
        return True
    (scale_e, codes_e), (scale_c, codes_c) = eager.tensors, compiled.tensors
    assert torch.allclose(scale_e, scale_c, rtol=2**-22, atol=0), (spec, where, scale_e, scale_c)
    if spec == "onebit" or same_bytes(scale_e, scale_c):  # onebit's signs never depend on the means
        assert same_bytes(codes_e, codes_c), (spec, where)
        return same_bytes(scale_e, scale_c)
    # terngrad with another scale in its last bit: only a coin on the boundary u * s = |g| can turn
    assert (codes_e != codes_c).double().mean() < 1e-3, (spec, where)
    return False
