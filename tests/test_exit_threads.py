"""A script that ends with an exchange still running on a gradpress background thread exits cleanly.

README's Comprex snippet (``gradpress.algorithms.create("comprex:staleness=1", ...)``, the loop in a comment,
``algo.close()`` mentioned only there) run as a user's script by 2 gloo processes on 127.0.0.1 that train a few
steps and end without ``algo.close()``: staleness 1 leaves the last step's exchange in flight on the daemon
thread at exit, and the interpreter's teardown aborted ("terminate called without an active exception",
SIGABRT, exit -6) in 3 of 4 runs before gradpress waited for such threads at exit. Waiting was not enough:
the same abort came from torch's teardown of a second gloo group left alive (2-3 runs in 10, also with
``algo.close()`` and in a plain torch script with ``dist.new_group``), so the exit also destroys the groups
in a process where gradpress made one (``gradpress.transport.groups``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import sys
import torch
import torch.distributed as dist
import gradpress

dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()
exec(compile(sys.argv[1], "README.md", "exec"))  # the snippet: algo = gradpress.algorithms.create(...)
for step in range(6):  # the loop its comment describes
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    optimizer.zero_grad(); loss_fn(model(x), y).backward(); algo.step()
print(f"rank {dist.get_rank()} trained; in flight at exit: {algo.background.in_flight}", flush=True)
"""


def _readme_comprex_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "comprex:staleness=1" in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def _run_two(code: str, snippet: str, timeout: float = 240.0) -> list[tuple[int, str, str]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, snippet], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


def test_readme_comprex_snippet_without_close_exits_without_terminate() -> None:
    snippet = _readme_comprex_snippet()
    for attempt in range(2):  # it aborted in 3 of 4 runs: two runs miss it with probability about 1/16
        for rank, (code, stdout, stderr) in enumerate(_run_two(DRIVER, snippet)):
            assert f"rank {rank} trained; in flight at exit: 1" in stdout, (attempt, rank, stdout, stderr[-3000:])
            assert "terminate called" not in stderr, (attempt, rank, stderr[-3000:])
            assert code == 0, (attempt, rank, code, stderr[-3000:])


ORDER = """
import time
import torch.distributed as dist
import gradpress.torch_compat
from gradpress.exchange.background import Background
from gradpress.transport import groups

groups._CREATED = {created}
dist.is_initialized = lambda: True  # no real group: the handler's checks and calls, recorded
groups.destroy_all = lambda: print("groups destroyed", flush=True)
work = Background("exit-order")
work.submit("slow", lambda: (time.sleep(0.3), print("job in flight finished", flush=True)))
print("script ends", flush=True)
"""


def test_at_exit_the_jobs_in_flight_finish_before_gradpress_destroys_the_groups_it_made() -> None:
    """The exit's order (its steps, the background threads, first; then the groups) and the condition: groups
    are destroyed only in a process where gradpress made one (``own_group``)."""
    for created, want in ((True, ["script ends", "job in flight finished", "groups destroyed"]),
                          (False, ["script ends", "job in flight finished"])):
        run = subprocess.run([sys.executable, "-c", ORDER.format(created=created)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.splitlines() == want, (created, run.stdout, run.stderr[-2000:])


STUCK = """
import time
import torch.distributed as dist
import gradpress.torch_compat
import gradpress.exchange.background as background
from gradpress.transport import groups

background.EXIT_WAIT_S = 0.3  # the exit's wait, short: the job below outlasts it (a peer that stopped answering)
groups._CREATED = True
dist.is_initialized = lambda: True  # no real group: the handler's checks and calls, recorded
groups.destroy_all = lambda: print("groups destroyed", flush=True)
work = background.Background("exit-stuck")
work.submit("stuck", lambda: (time.sleep(30), print("job in flight finished", flush=True)))
print("script ends", flush=True)
"""


def test_at_exit_a_job_still_in_flight_after_the_wait_keeps_the_groups_undestroyed() -> None:
    """A job still in flight when the exit's wait (``EXIT_WAIT_S``) ends is a collective a peer never joined:
    destroying its group then waits for it (NCCL's destroy flushes the collectives in flight since torch 2.6,
    gloo's destructor on 2.2 joins the worker running it), which would hold the exit up to the group's timeout,
    past the bound the wait promises. The exit leaves such groups to the teardown, promptly."""
    run = subprocess.run([sys.executable, "-c", STUCK], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["script ends"], (run.stdout, run.stderr[-2000:])


def test_every_exit_step_runs_even_after_one_that_did_not_end(monkeypatch) -> None:  # noqa: ANN001
    """groups._at_exit runs "every EXIT_STEPS step" ("a list: every step runs"): a background thread whose job
    is still in flight must not keep the DDP hook's thread from being stopped (a generator in all() stopped at
    the first False); then, with a job in flight, no group is destroyed."""
    from gradpress.transport import groups

    ran: list[str] = []
    destroyed: list[bool] = []
    monkeypatch.setattr(groups, "EXIT_STEPS", [lambda: ran.append("first") or False,
                                               lambda: ran.append("second") or True])
    monkeypatch.setattr(groups, "_CREATED", True)
    monkeypatch.setattr(groups, "destroy_all", lambda *a, **k: destroyed.append(True))
    groups._at_exit()
    assert ran == ["first", "second"]
    assert destroyed == []
