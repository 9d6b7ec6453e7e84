"""gradpress: communication-efficient data-parallel training for PyTorch.

``gradpress.compressor("topk:ratio=0.01")`` builds a compressor;
``gradpress.ddp.register(ddp_model, spec)`` makes DDP use it.
"""

from gradpress import compressors
from gradpress.compress import Compressor, Context, Packet
from gradpress.compress import create as compressor

__version__ = "0.1.0"

__all__ = ["Compressor", "Context", "Packet", "compressor", "compressors", "ddp", "__version__"]


#: subpackages reachable as ``gradpress.NAME`` after a plain ``import gradpress``
#: (the README's ``gradpress.algorithms.create(...)``, ``gradpress.accelerate.register(...)``),
#: imported on first use: importing gradpress pulls in neither torch.distributed
#: hooks nor an optional framework (``gradpress.accelerate`` imports Accelerate
#: only when one of its functions runs).
_LAZY = ("ddp", "algorithms", "train", "accelerate")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"gradpress.{name}")
    raise AttributeError(f"module 'gradpress' has no attribute {name!r}")
