"""gradpress.torch_compat: each helper on a torch that has the feature and on
one that lacks it (the lack emulated here; the real one ran on torch 2.2.2,
docs/testing.md "Older torch releases")."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from gradpress import torch_compat


def test_ddp_kwargs_drops_only_init_sync_and_only_where_ddp_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"init_sync": False, "bucket_cap_mb": 4, "broadcast_buffers": False}
    monkeypatch.setattr(torch_compat, "_ddp_parameters", lambda: frozenset({"self", "module", "init_sync",
                                                                            "bucket_cap_mb", "broadcast_buffers"}))
    assert torch_compat.ddp_kwargs(options) == options
    monkeypatch.setattr(torch_compat, "_ddp_parameters", lambda: frozenset({"self", "module", "bucket_cap_mb",
                                                                            "broadcast_buffers"}))
    assert torch_compat.ddp_kwargs(options) == {"bucket_cap_mb": 4, "broadcast_buffers": False}
    # a keyword DDP does not know and that matters is kept: DDP itself names it
    assert torch_compat.ddp_kwargs({"bucket_cap_mbb": 4}) == {"bucket_cap_mbb": 4}
    assert torch_compat.ddp_kwargs(None) == {}
    assert torch_compat.ddp_kwargs({"bucket_cap_mb": None, "broadcast_buffers": False}) == {"broadcast_buffers": False}


def _ddp_of_one(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Linear(3, 2)
    ddp = DDP(model, **torch_compat.ddp_kwargs({"init_sync": False, "bucket_cap_mb": None,
                                                "broadcast_buffers": False}))
    ddp(torch.ones(4, 3)).sum().backward()
    return [n for n, p in model.named_parameters() if p.grad is not None]


def test_ddp_kwargs_build_a_ddp_on_this_torch() -> None:
    """What the bench and DDPAlgorithm pass builds a DDP that trains, on
    whichever torch runs the suite (2.2.2: no init_sync, no None cap)."""
    from distributed import run_workers

    assert run_workers(_ddp_of_one, 1) == [["weight", "bias"]]


def test_checkpoint_refusal_without_safe_globals_names_the_legacy_format(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch has no safe_globals, a gradpress-train/1 file (numpy RNG
    state) gets a message that says what to do; a foreign file holding
    another numpy class keeps the generic refusal."""
    from gradpress.train import checkpoint

    legacy, foreign = tmp_path / "legacy.pt", tmp_path / "foreign.pt"
    torch.save({"format": "gradpress-train/1", "rng": np.random.RandomState(0).get_state()[1]}, legacy)
    torch.save({"x": np.float64(1.5)}, foreign)
    monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)
    with pytest.raises(ValueError, match="holds numpy objects.*gradpress-train/1.*resume it with a newer torch"):
        checkpoint.load(legacy)
    with pytest.raises(ValueError, match="is not a gradpress training checkpoint") as err:
        checkpoint.load(foreign)
    assert "newer torch" not in str(err.value)


def test_event_start_ns_uses_microseconds_where_events_lack_ns() -> None:
    class New:
        def start_ns(self) -> int:
            return 1234567

    class Old:
        def start_us(self) -> int:
            return 1234

    assert torch_compat.event_start_ns(New()) == 1234567
    assert torch_compat.event_start_ns(Old()) == 1234000


def test_safe_globals_allows_listed_classes_or_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "np.pt"
    torch.save({"a": np.arange(3)}, path)
    if torch_compat.allows_globals():
        reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
        with torch_compat.safe_globals([reconstruct, np.ndarray, np.dtype, type(np.dtype(np.int64))]):
            assert torch.load(path, weights_only=True)["a"].tolist() == [0, 1, 2]
        monkeypatch.delattr(torch.serialization, "safe_globals")
    with torch_compat.safe_globals([np.ndarray]), pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # no safe_globals: nothing beyond weights_only's own types
