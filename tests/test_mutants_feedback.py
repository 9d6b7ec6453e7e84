"""``Feedback.nbytes``: the bytes of error-feedback memory, as
``Synchronizer.memory_bytes`` reports them (worker residuals, and ring hop /
PS root residuals as the strategies' share).

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) keeps one
residual per compressed tensor: the memory is the sum over residuals of
``numel * element size``, per namespace. The expected byte counts are
computed here from the shapes and dtypes the test chose. Written for a
survivor of ``make mutants`` (``feedback`` group: ``numel / element_size``).
"""

from __future__ import annotations

import pytest
import torch

from gradpress.exchange.feedback import WORKER, Feedback, namespace

pytestmark = pytest.mark.mutants

RING = namespace("ring")
ROOT = namespace("root")
#: (namespace, key, shape, dtype, bytes per element)
HELD = [
    (WORKER, "w", (7, 9), torch.float64, 8),
    (WORKER, "v", (5,), torch.float16, 2),
    (WORKER, "u", (3, 4), torch.float32, 4),
    (RING, "w", (7, 9), torch.float32, 4),
    (ROOT, "w#1", (11,), torch.bfloat16, 2),
]


def test_nbytes_counts_numel_times_element_size_per_namespace() -> None:
    """Invariant: ``nbytes(ns)`` = sum of ``numel * bytes per element`` over
    the residuals of ``ns``; ``nbytes()`` over all of them."""
    fb = Feedback()
    for ns, key, shape, dtype, _ in HELD:
        fb.stage(Feedback.key(ns, key), torch.ones(shape, dtype=dtype))
    fb.commit()

    def want(ns: str | None) -> int:
        total = 0
        for n, _, shape, _, size in HELD:
            if ns is None or n == ns:
                count = 1
                for s in shape:
                    count *= s
                total += count * size
        return total

    assert fb.nbytes() == want(None)
    assert fb.nbytes(WORKER) == want(WORKER)
    assert fb.nbytes(RING) == want(RING)
    assert fb.nbytes(ROOT) == want(ROOT)
