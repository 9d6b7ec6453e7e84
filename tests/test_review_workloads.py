"""Review of the workloads: user data validation and standardization, --params parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradpress import workloads
from gradpress.workloads import userdata, wide


def _save(tmp_path, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("shape", [(20, 0), (20, 3, 0)])
def test_userdata_rejects_zero_features(tmp_path, shape):
    # x with no feature at all would train a constant model on nothing
    path = _save(tmp_path, x=np.zeros(shape, dtype=np.float32), y=np.arange(20) % 2)
    with pytest.raises(ValueError, match=r"d\.npz.*x.*feature"):
        userdata.read(path)


@pytest.mark.parametrize("scale", [1e20, 1e37])
def test_userdata_standardizes_large_finite_features(tmp_path, scale):
    # finite values (within float32) must stay finite and keep their information
    rng = np.random.RandomState(0)
    x = rng.randn(50, 3)
    x[:, 0] *= scale
    y = (x[:, 0] > 0).astype(np.int64)
    w = workloads.build("data-mlp", data=_save(tmp_path, x=x, y=y), hidden=8)
    xt = torch.cat([w.train[0], w.test[0]])
    assert torch.isfinite(xt).all()
    train0 = w.train[0][:, 0].double()
    assert abs(train0.mean().item()) < 1e-4 and abs(train0.std(unbiased=False).item() - 1.0) < 1e-4
    # the feature still separates the classes as the raw column did
    yt = torch.cat([w.train[1], w.test[1]])
    pos = xt[:, 0][yt == 1]
    neg = xt[:, 0][yt == 0]
    assert pos.min() > neg.max()


@pytest.mark.parametrize("text, expected", [("1.005K", 1005), ("2.01M", 2_010_000), ("0.3M", 300_000),
                                            ("4.35K", 4350)])
def test_parse_count_decimal(text, expected):
    assert wide.parse_count(text) == expected


@pytest.mark.parametrize("name", ["a.npy", "a.npz"])
def test_userdata_single_npy_array_clear_error(tmp_path, name):
    # a file written by numpy.save (one array, not an archive), whatever its suffix
    path = tmp_path / name
    with open(path, "wb") as f:
        np.save(f, np.zeros((20, 3)))
    with pytest.raises(ValueError, match=rf"{name}.*single \.npy array.*'x' and 'y'"):
        userdata.read(str(path))


def _zip(path, entries):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return str(path)


def _npy(array):
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_userdata_member_not_npy_clear_error(tmp_path):
    # a zip whose x.npy is no .npy array: numpy hands back raw bytes
    path = _zip(tmp_path / "d.npz", {"x.npy": b"1,2,3\n4,5,6\n", "y.npy": _npy(np.arange(20) % 2)})
    with pytest.raises(ValueError, match=r"d\.npz.*'x'.*not a \.npy array"):
        userdata.read(path)


def test_userdata_truncated_member_not_called_pickled(tmp_path):
    x = _npy(np.zeros((20, 3)))
    path = _zip(tmp_path / "d.npz", {"x.npy": x[:60], "y.npy": _npy(np.arange(20) % 2)})
    with pytest.raises(ValueError, match=r"d\.npz.*not a valid \.npz") as info:
        userdata.read(path)
    assert "pickled" not in str(info.value)
