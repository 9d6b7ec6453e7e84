"""How ``gradpress bench e2e`` runs one configuration on the cluster: the job
file for the workers, their command, the run of every rank with the link
counters read before and after, their result files, and what a failure was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gradpress.bench.e2e_configs import RunConfig


class _Runner:
    def __init__(self, cluster: Any, settings: dict[str, Any], args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.s = settings
        self.args = args
        self.raw = settings["out"] / "raw"
        self.raw.mkdir(parents=True, exist_ok=True)
        self.env = {"OMP_NUM_THREADS": str(settings["threads"]), "MKL_NUM_THREADS": str(settings["threads"]),
                    "PYTHONUNBUFFERED": "1", "PYTHONPATH": _package_root()
                    + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}

    def job(self, tag: str, mode: str, config: RunConfig | None, **extra: Any) -> Path:
        s = self.s
        job = {
            "mode": mode, "tag": tag, "result_dir": str(self.raw.resolve()), "workload": s["workload"],
            "params": s["params"], "hidden": s["hidden"], "batch_size": s["batch_size"],
            "lr": config.lr if config is not None and config.lr is not None else s["lr"],
            "optimizer": s["optimizer"], "schedule": s["schedule"], "epochs": s["epochs"], "seed": self.args.seed,
            "threads": s["threads"], "warmup": self.args.warmup, "steps": self.args.steps,
            "n_batches": 8,  # distinct batches per rank, drawn once; the steps cycle through them
            "config": config.to_dict() if config is not None else None, **extra,
        }
        path = self.raw / f"{tag}.job.json"
        path.write_text(json.dumps(job, indent=1))
        for old in self.raw.glob(f"{tag}-rank*.json"):
            old.unlink()
        return path

    def argv(self, job: Path) -> list[str]:
        return [sys.executable, "-m", "gradpress.bench.e2e_worker", "--job", str(job.resolve())]

    def results(self, tag: str, ranks: range) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for r in ranks:
            p = self.raw / f"{tag}-rank{r}.json"
            out.append(json.loads(p.read_text()) if p.exists() else None)
        return out

    def run_all(self, tag: str, job: Path) -> tuple[Any, list[dict[str, Any] | None], list[dict[str, int]]]:
        before = [self.cluster.link_stats(i) for i in range(self.cluster.nodes)]
        res = self.cluster.run(self.argv(job), env=self.env, timeout=self.args.timeout, stream_rank0=False)
        after = [self.cluster.link_stats(i) for i in range(self.cluster.nodes)]
        tbf = [{k: after[i][k] - before[i][k] for k in ("tx_bytes", "rx_bytes", "tx_drops", "rx_drops")}
               for i in range(self.cluster.nodes)]
        return res, self.results(tag, range(self.cluster.world)), tbf

    def failure(self, res: Any, tag: str) -> str:
        if res.timed_out:
            return f"timed out after {self.args.timeout:.0f} s"
        tail = ""
        for r, code in enumerate(res.codes):
            if code != 0 and res.log(r) is not None:
                lines = [ln for ln in res.log(r).read_text(errors="replace").splitlines() if ln.strip()]
                tail = lines[-1] if lines else ""
                break
        return f"exit code {res.exit_code}" + (f": {tail}" if tail else "") + f" (logs: {res.log_dir})"


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])
