"""The framework integrations are optional: ``import gradpress`` (and the
DDP hook, the training command, the TensorBoard tag vocabulary, the
Accelerate helper module itself) imports none of Lightning, Accelerate,
Transformers or TensorBoard. Checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers", "tensorboard")
PROBE = f"""
import sys
import gradpress, gradpress.ddp, gradpress.train, gradpress.cli, gradpress.tensorboard, gradpress.accelerate
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})
print(','.join(loaded))
"""


def test_import_gradpress_loads_no_framework() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"imported at `import gradpress`: {out.stdout.strip()}"


def test_the_lightning_module_names_the_extra_when_lightning_is_missing() -> None:
    probe = ("import sys\nfor m in ('lightning', 'lightning.pytorch'):\n    sys.modules[m] = None\n"
             "try:\n    import gradpress.lightning\nexcept ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "pip install 'gradpress[lightning]'" in out.stdout, out.stdout + out.stderr[-2000:]
