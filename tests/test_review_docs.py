"""Checks that what README.md and docs/*.md show a user runs as written."""

from __future__ import annotations

import doctest
import re
import subprocess
import sys
from pathlib import Path

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


ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks() -> list[tuple[str, int, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            out.append((path.name, text[:m.start()].count("\n") + 1, m.group(1)))
    return out


def test_every_python_block_in_the_docs_is_python() -> None:
    """A user pastes these: each ```python block compiles (a `>>>` session: each
    example). docs/strategies.md's planner block had `..., .parts`, not Python."""
    blocks = _python_blocks()
    assert len(blocks) >= 15, len(blocks)
    bad = []
    for name, line, src in blocks:
        sources = ([ex.source for ex in doctest.DocTestParser().get_examples(src)]
                   if src.lstrip().startswith(">>>") else [src])
        for code in sources:
            try:
                compile(code, f"{name}:{line}", "exec")
            except SyntaxError as exc:
                bad.append(f"{name}:{line}: {exc}")
    assert not bad, "\n".join(bad)


def test_accelerate_and_trainer_snippets_say_how_to_run_on_cpu() -> None:
    """Under torchrun on a machine without GPUs, Accelerate 1.x and the Trainer
    stay single-process unless told to use the CPU: the documented Accelerator
    is created with cpu=True, and the Trainer's switch is named."""
    integrations = (ROOT / "docs" / "integrations.md").read_text()
    block = integrations[integrations.index("### Accelerate"):integrations.index("### Transformers Trainer")]
    calls = re.findall(r"Accelerator\(([^)]*)\)", re.search(r"```python\n(.*?)```", block, re.S).group(1))
    assert calls and all("cpu=True" in c for c in calls), calls
    trainer = integrations[integrations.index("### Transformers Trainer"):integrations.index("### TensorBoard")]
    assert "use_cpu=True" in trainer
    readme = (ROOT / "README.md").read_text()
    assert "Accelerator(cpu=True)" in readme and "TrainingArguments(use_cpu=True)" in readme


def test_cluster_help_gives_the_environment_of_several_workers_per_node() -> None:
    """`gradpress cluster --help` said every rank runs with LOCAL_RANK=0,
    LOCAL_WORLD_SIZE=1, which --workers-per-node K changes (docs/cluster.md:
    rank r in node r // K, LOCAL_RANK r % K, LOCAL_WORLD_SIZE K)."""
    from gradpress.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    text = " ".join(sub.choices["cluster"].format_help().split())
    assert "LOCAL_RANK=r % K, LOCAL_WORLD_SIZE=K" in text, text
    assert "LOCAL_RANK=0, LOCAL_WORLD_SIZE=1" not in text.replace("(default K=1: LOCAL_RANK=0, LOCAL_WORLD_SIZE=1)", "")
