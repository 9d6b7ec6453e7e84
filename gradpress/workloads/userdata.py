"""A classifier on the user's own data: ``--data PATH.npz`` with arrays ``x``
(samples x features..., numeric) and ``y`` (one integer label per sample).

Features are flattened, standardized with the training split's mean and
standard deviation; labels are mapped to 0..C-1 in sorted order. The split
is 80/20 under a fixed permutation. Model: MLP features -> hidden (128) ->
hidden -> C.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.lib.format as npformat
import torch

from gradpress.workloads.base import Workload, mlp, positive_int, split_cap


def check_header(path: str) -> tuple[int, int]:
    """Validate ``path`` from its archive's directory and the two ``.npy``
    headers alone, without reading the arrays: ``(samples, features)``, or
    the ValueError :func:`read` gives for the same problem. What a header
    cannot show (NaN features, non-integer float labels, a single class, a
    damaged member's data) is left to :func:`read`. The training config's
    check uses this, so a huge file is not read before the launcher's own
    read (docs/train.md)."""
    def headers(f: Any) -> tuple[Any, Any]:
        names = set(f.zip.namelist())
        out = []
        for key in ("x", "y"):
            with f.zip.open(key if key in names else f"{key}.npy") as member:
                if member.read(len(npformat.MAGIC_PREFIX)) != npformat.MAGIC_PREFIX:
                    _not_npy(path, key)
                member.seek(0)
                version = npformat.read_magic(member)
                read_header = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
                shape, _, dtype = read_header(member)
            if dtype.hasobject:  # what numpy says when it refuses to unpickle one
                raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
            out.append(_Header(tuple(shape), dtype))
        return out[0], out[1]

    x, y = _open(path, headers, mmap_mode="r")
    _check(path, x, y)
    return x.shape[0], int(np.prod(x.shape[1:]))


def read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Load and validate ``path``; ValueError naming the problem otherwise."""
    def arrays(f: Any) -> tuple[Any, Any]:
        x, y = f["x"], f["y"]
        for key, arr in (("x", x), ("y", y)):
            if not isinstance(arr, np.ndarray):  # numpy hands back the raw bytes of a non-.npy member
                _not_npy(path, key)
        return x, y

    x, y = _open(path, arrays)
    _check(path, x, y)
    x = x.reshape(len(x), -1).astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"data file {str(path)!r}: x contains NaN or infinite values")
    if len(np.unique(y)) < 2:
        raise ValueError(f"data file {str(path)!r}: y must contain at least 2 classes, got {len(np.unique(y))}")
    return x, y


class _Header:
    """The shape and dtype of a ``.npy`` member, from its header."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.ndim, self.size = len(shape), int(np.prod(shape))

    def __len__(self) -> int:
        return self.shape[0]


def _not_npy(path: str, key: str) -> None:
    raise ValueError(f"data file {str(path)!r}: member '{key}' is not a .npy array; "
                     "save arrays 'x' and 'y' with numpy.savez")


def _open(path: str, members: Callable[[Any], tuple[Any, Any]], mmap_mode: str | None = None) -> tuple[Any, Any]:
    """``members(npz)`` of the archive at ``path`` (its ``x`` and ``y``),
    every failure to open or parse it as the ValueError naming the problem.
    ``mmap_mode``: a single ``.npy`` file (refused) is mapped, not read."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"data must be a path to a .npz file, got {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"data file {str(path)!r} does not exist")
    try:
        f = np.load(path, allow_pickle=False, mmap_mode=mmap_mode)
        if not hasattr(f, "files"):  # a plain array (numpy.save), not a context manager
            raise ValueError(f"data file {str(path)!r} is a single .npy array; expected a .npz with arrays 'x' and 'y'")
        with f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise ValueError(f"data file {str(path)!r} lacks array(s) {', '.join(missing)}; "
                                 f"it has {', '.join(f.files) or 'none'}; expected 'x' (samples x features) and 'y' (labels)")
            return members(f)
    except ValueError as exc:
        if "data file" in str(exc):
            raise
        if not zipfile.is_zipfile(path):
            raise ValueError(f"data file {str(path)!r} is not a .npz archive; expected one written by "
                             "numpy.savez with arrays 'x' (samples x features) and 'y' (integer labels)") from None
        if "allow_pickle" not in str(exc):  # e.g. a truncated or damaged member
            raise ValueError(f"data file {str(path)!r} is not a valid .npz archive: {exc}") from None
        raise ValueError(f"data file {str(path)!r} holds pickled objects, which are not loaded; save plain numeric "
                         "arrays 'x' and 'y' with numpy.savez") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"data file {str(path)!r} is not a valid .npz archive: {exc}") from None


def _check(path: str, x: Any, y: Any) -> None:
    """The checks of ``x`` and ``y`` (arrays, or :class:`_Header` where only
    the headers were read: then a float ``y``'s values are not checked)."""
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise ValueError(f"data file {str(path)!r}: x must be numeric, got dtype {x.dtype}")
    if np.issubdtype(x.dtype, np.complexfloating):
        raise ValueError(f"data file {str(path)!r}: x must be real-valued, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"data file {str(path)!r}: x must have shape (samples, features...), got shape {x.shape}")
    if y.ndim != 1:
        raise ValueError(f"data file {str(path)!r}: y must be 1-D (one label per sample), got shape {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"data file {str(path)!r}: x has {len(x)} samples but y has {len(y)}")
    if np.issubdtype(y.dtype, np.floating):
        if isinstance(y, np.ndarray) and (not np.all(np.isfinite(y)) or not np.all(y == np.round(y))):
            raise ValueError(f"data file {str(path)!r}: y must hold integer class labels, got non-integer values")
    elif not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"data file {str(path)!r}: y must hold integer class labels, got dtype {y.dtype}")
    if len(y) < 10:
        raise ValueError(f"data file {str(path)!r}: need at least 10 samples, got {len(y)}")
    if x.size == 0:
        raise ValueError(f"data file {str(path)!r}: x has no features (shape {x.shape}); "
                         "expected shape (samples, features...) with at least 1 feature")


def build(*, data: str | None = None, hidden: int | None = None, samples: int | None = None,
          **_: object) -> Workload:
    if data is None:
        raise ValueError("workload 'data-mlp' needs --data PATH.npz")
    x, y = read(data)
    classes, labels = np.unique(y, return_inverse=True)
    order = np.random.RandomState(0).permutation(len(labels))
    x, labels = x[order], labels[order].astype(np.int64)
    cut = max(1, int(0.8 * len(labels)))
    # in float64: float32 sums of large finite features overflow (NaN inputs or a feature zeroed)
    mean, std = x[:cut].mean(axis=0, dtype=np.float64), x[:cut].std(axis=0, dtype=np.float64)
    x = (x - mean) / np.where(std > 0, std, 1.0)
    xt, yt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(labels)
    train, test = split_cap((xt[:cut], yt[:cut]), (xt[cut:], yt[cut:]), samples)
    width = 128 if hidden is None else positive_int("hidden", hidden)
    return Workload("data-mlp", mlp([x.shape[1], width, width, len(classes)]), train, test,
                    info={"hidden": width, "classes": len(classes), "features": int(x.shape[1])})
