"""Review of the workloads: user data validation and standardization."""

from __future__ import annotations

import numpy as np
import pytest

from gradpress.workloads import userdata


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
