"""gloo's point-to-point calls read host memory only (handed a CUDA tensor,
the process aborted on an H200: docs/results/cuda-h200.md), so on a gloo
group messages travel from and into host copies; NCCL takes device memory.
The multi-rank CUDA path itself is in tests/test_cuda.py (GPU machines);
here, the rule that picks the wire's device, which CI can check."""

from __future__ import annotations

import pytest
import torch

from gradpress.transport import p2p


@pytest.mark.parametrize(("backend", "device", "wire"), [
    ("gloo", "cuda:1", "cpu"), ("gloo", "cpu", "cpu"), ("nccl", "cuda:1", "cuda:1"), ("nccl", "cpu", "cpu"),
])
def test_wire_device(monkeypatch: pytest.MonkeyPatch, backend: str, device: str, wire: str) -> None:
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: backend)
    assert p2p.wire_device(None, torch.device(device)) == torch.device(wire)

