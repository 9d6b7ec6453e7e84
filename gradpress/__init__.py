"""gradpress: communication-efficient data-parallel training for PyTorch.

``gradpress.compressor("topk:ratio=0.01")`` builds a compressor;
``gradpress.ddp.register(ddp_model, spec)`` makes DDP use it.
"""

from gradpress import compressors
from gradpress.compress import Compressor, Context, Packet
from gradpress.compress import create as compressor

__version__ = "0.1.0"

__all__ = ["Compressor", "Context", "Packet", "compressor", "compressors", "ddp", "__version__"]


def __getattr__(name: str):  # lazy: importing gradpress does not pull in torch.distributed hooks
    if name == "ddp":
        import importlib

        return importlib.import_module("gradpress.ddp")
    raise AttributeError(f"module 'gradpress' has no attribute {name!r}")
