"""fp16/bf16: ``bound_summand`` notes (tensor, version) so that ``encode`` of that same unchanged tensor
skips its saturation; the version noted must be the one its overflow check read, not one read after it: a
write between the check and the note (another thread writing the tensor) left the written values
unchecked, and the cast sent inf where it must saturate at the format's maximum (review17)."""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import create
from gradpress.compress.halfprec import _Cast

MAX = {"fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}


@pytest.mark.parametrize("name", sorted(MAX))
def test_a_write_between_the_bound_check_and_the_note_is_still_saturated(name: str, monkeypatch) -> None:
    """A writer (the training thread, say) changes the summand after bound_summand's check read it and
    before it noted it as bounded: encode must still saturate what it sends (float64 reference:
    clamp(x, -max, max) per entry, the documented cast)."""
    comp = create(name)
    x = torch.ones(16, dtype=torch.float64)
    checked = _Cast._may_overflow

    def check_then_written(flat: torch.Tensor, limit: float) -> bool:
        answer = checked(flat, limit)
        x.fill_(1e300)  # written after the check: beyond both formats' maximum
        return answer

    monkeypatch.setattr(_Cast, "_may_overflow", staticmethod(check_then_written))
    bounded = comp.bound_summand(x, 4)
    monkeypatch.setattr(_Cast, "_may_overflow", staticmethod(checked))
    assert bounded is x  # within the bound when checked: returned as is
    expected = [min(max(v, -MAX[name]), MAX[name]) for v in x.tolist()]  # float64, by the definition
    got = comp.decode(comp.encode(bounded)).tolist()
    assert got == expected, got[:3]  # before: inf (the written values were taken as bounded)
