"""The overflow rescue of the threshold estimators (``_rescaled``: an estimate above the work dtype's max is
taken again on the data times 2^-16) costs nothing on the normal path: no host read between the estimate
and the first selection. Its finiteness check read the estimate to the host on every call, before the
selection (on an accelerator a sync that stalls the launch of the selection, once per tensor per step),
although only a call whose count misses the band can need it (an infinite threshold keeps nothing but NaN)
and that path reads the threshold anyway (review17)."""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import Context, create
from gradpress.compress import _threshold_select as ts


@pytest.mark.parametrize("spec", ["gaussiank", "sidco", "dgc_threshold"])
def test_no_host_read_between_the_estimate_and_the_selection_on_the_normal_path(spec: str, monkeypatch) -> None:
    comp = create(f"{spec}:ratio=0.01")
    g = torch.Generator().manual_seed(3)
    for step in range(4):  # the per-key scale learns the model's shape error: later calls hit the band
        comp.encode(torch.randn(20000, generator=g), Context(key="w", step=step))
    x = torch.randn(20000, generator=g)
    events: list[str] = []
    estimating = type(comp)._threshold
    selecting = ts.select_above
    as_bool, as_float = torch.Tensor.__bool__, torch.Tensor.__float__

    def threshold(self, *args, **kwargs):
        out = estimating(self, *args, **kwargs)
        events.append("estimate")
        return out

    def select(*args, **kwargs):
        events.append("select")
        return selecting(*args, **kwargs)

    def read_bool(self):
        events.append("read")
        return as_bool(self)

    def read_float(self):
        events.append("read")
        return as_float(self)

    monkeypatch.setattr(type(comp), "_threshold", threshold)
    monkeypatch.setattr(ts, "select_above", select)
    monkeypatch.setattr(torch.Tensor, "__bool__", read_bool)
    monkeypatch.setattr(torch.Tensor, "__float__", read_float)
    packet = comp.encode(x, Context(key="w", step=4))
    monkeypatch.undo()
    k = 200
    assert 0.8 * k <= packet.tensors[1].numel() <= 1.25 * k and comp.last_passes == 0  # the normal path
    after = events[events.index("estimate") + 1:]
    assert after[0] == "select", events  # before: a read of the estimate (the rescue's isfinite) came first
    # the selection is what the threshold |x| >= scale * estimate keeps (one estimate, by the definition)
    kept = sorted(packet.tensors[1].tolist())
    assert torch.equal(packet.tensors[0], x[kept])
