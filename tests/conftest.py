import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# The compressor kit compiles its kernels (torch.compile) only for tensors of
# >= 2^14 (16K) elements by default; the suite runs them eagerly (the same ops, bit
# for bit) unless GRADPRESS_COMPILE is set, so a cold Inductor cache costs
# only tests/test_kit_compile.py, which forces compilation on a few shapes.
os.environ.setdefault("GRADPRESS_COMPILE", "0")
