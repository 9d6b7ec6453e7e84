"""Checks that what README.md and docs/*.md show a user runs as written."""

from __future__ import annotations

import subprocess
import sys

# README "Algorithms that talk less" / "Asynchronous exchange (Comprex)" and
# "Use it from ... Accelerate" call gradpress.algorithms.create(...) and
# gradpress.accelerate.register(...) after a plain `import gradpress`.
PROBE = """
import sys
import gradpress
print(callable(gradpress.algorithms.create), callable(gradpress.accelerate.register),
      callable(gradpress.train.run), callable(gradpress.ddp.register))
print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'transformers', 'lightning'))))
try:
    gradpress.no_such_thing
except AttributeError as exc:
    print(exc)
"""


def test_readme_subpackages_reachable_after_import_gradpress() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "True True True True", out.stdout
    assert lines[1] == "", f"an optional framework was imported: {lines[1]}"
    assert lines[2] == "module 'gradpress' has no attribute 'no_such_thing'"
