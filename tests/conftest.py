import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# The compressor kit compiles its kernels (torch.compile) only for tensors of
# >= 2^14 (16K) elements by default; the suite runs them eagerly (the same ops, bit
# for bit) unless GRADPRESS_COMPILE is set, so a cold Inductor cache costs
# only tests/test_kit_compile.py, which forces compilation on a few shapes.
os.environ.setdefault("GRADPRESS_COMPILE", "0")

# digits-mlp, the workload of most `gradpress train` and `compare` runs here, loads its data with
# scikit-learn: importing sklearn.datasets costs a process about 1.3 s of CPU, about as much as torch
# and gradpress. The fork server that the workers of in-process runs and of tests/distributed.py are
# forked from (gradpress.train.launch._start_forkserver, once per session) imports it with them, so
# each such worker starts without importing it (suitespeed session). A `gradpress train` run in a
# subprocess starts its own fork server, with gradpress's list as it is.
from gradpress.train import launch as _launch  # noqa: E402

if "sklearn.datasets" not in _launch.FORKSERVER_PRELOAD:
    _launch.FORKSERVER_PRELOAD.append("sklearn.datasets")
