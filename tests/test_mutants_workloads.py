"""Contracts of the built-in workloads (``gradpress/workloads/{base, mnist1d,
wide, digits, charlm, userdata}.py``) that the other workload tests do not
pin. Written for survivors of ``make mutants`` (``workloads`` group); every
expected value is the test's own (the documented message, the smallest
accepted size, labels mapped to 0..C-1 in sorted order), never the code's
output. One process, no data generation: about 1 s.

* A ``--data`` archive whose member is not a ``.npy`` array gets the same
  message from the header check (``check_header``, what the training
  config runs) as from the full read, whatever the member's first bytes
  (below or above the ``.npy`` magic ``\\x93NUMPY`` in byte order).
* 10 samples is the smallest accepted data set (9 are refused, naming the
  count), by the header check, the read and the build (8 train, 2 test).
* Float labels holding integer values (``2.0``, ``5.0``) are accepted and
  mapped to 0..C-1 in sorted order, as integer labels are.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from gradpress import workloads
from gradpress.workloads import userdata

pytestmark = pytest.mark.mutants


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _zip(path, entries: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return str(path)


def _save(tmp_path, **arrays) -> str:
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("key", ["x", "y"])
@pytest.mark.parametrize("member", [b"1,2,3\n4,5,6\n", b"\xff\xfe not numpy at all", b"", b"\x93NUMP"])
def test_member_that_is_not_npy_gets_the_reads_message_from_the_header_check(tmp_path, key, member):
    """The header check named another problem (numpy's "magic string" error
    as a damaged archive) when the member's first bytes sort below the magic."""
    good = {"x": _npy(np.zeros((20, 3))), "y": _npy(np.arange(20) % 2)}
    good[key] = member
    path = _zip(tmp_path / "d.npz", {f"{k}.npy": v for k, v in good.items()})
    expected = (f"data file {path!r}: member '{key}' is not a .npy array; "
                "save arrays 'x' and 'y' with numpy.savez")
    with pytest.raises(ValueError) as full:
        userdata.read(path)
    with pytest.raises(ValueError) as header:
        userdata.check_header(path)
    assert str(full.value) == expected
    assert str(header.value) == expected


def test_ten_samples_are_the_smallest_data_set_accepted(tmp_path):
    rng = np.random.RandomState(1)
    x = rng.randn(10, 4)
    y = np.arange(10) % 2
    path = _save(tmp_path, x=x, y=y)
    assert userdata.check_header(path) == (10, 4)
    rx, ry = userdata.read(path)
    assert rx.shape == (10, 4) and ry.tolist() == y.tolist()
    w = workloads.build("data-mlp", data=path, hidden=4)
    assert tuple(w.train[0].shape) == (8, 4) and tuple(w.test[0].shape) == (2, 4)  # 80/20
    small = _save(tmp_path, x=x[:9], y=y[:9])
    for check in (userdata.check_header, userdata.read):
        with pytest.raises(ValueError, match=r"d\.npz.*need at least 10 samples, got 9$"):
            check(small)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_labels_with_integer_values_are_classes_in_sorted_order(tmp_path, dtype):
    values = np.array([5.0, 2.0, 9.0, -1.0])  # classes in sorted order: -1 -> 0, 2 -> 1, 5 -> 2, 9 -> 3
    y = np.tile(values, 5).astype(dtype)
    x = np.stack([y.astype(np.float64), np.arange(20.0)], axis=1)  # feature 0 is the raw label
    path = _save(tmp_path, x=x, y=y)
    assert userdata.check_header(path) == (20, 2)
    rx, ry = userdata.read(path)
    assert ry.tolist() == y.tolist()
    w = workloads.build("data-mlp", data=path, hidden=4)
    assert w.info["classes"] == 4 and w.model(w.test[0]).shape == (4, 4)
    feature = np.concatenate([w.train[0][:, 0].numpy(), w.test[0][:, 0].numpy()]).astype(np.float64)
    labels = np.concatenate([w.train[1].numpy(), w.test[1].numpy()])
    assert sorted(labels.tolist()) == sorted([0, 1, 2, 3] * 5)
    # standardizing is increasing, so class k's feature 0 lies between class k-1's and k+1's
    per_class = [np.unique(np.round(feature[labels == k], 5)) for k in range(4)]
    assert all(len(v) == 1 for v in per_class)
    assert per_class[0][0] < per_class[1][0] < per_class[2][0] < per_class[3][0]
    # and equals (raw - mean) / std of the training split's raw values, float64 by the definition: feature 1
    # (the sample's index, standardized: increasing) tells which samples the training split holds
    index = np.concatenate([w.train[0][:, 1].numpy(), w.test[0][:, 1].numpy()]).argsort().argsort()
    train_raw = y.astype(np.float64)[index[: len(w.train[1])]]
    expected = (np.sort(values) - train_raw.mean()) / train_raw.std()
    np.testing.assert_allclose([v[0] for v in per_class], expected, rtol=1e-5, atol=1e-5)
