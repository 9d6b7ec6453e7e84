"""A few gradpress DDP training steps, to check an emulated cluster end to end.

Run one copy per node (``gradpress cluster --nodes 2 --bandwidth 50mbit --
python3 -m gradpress.cluster.selftest``): every rank builds the same tiny MLP,
trains ``--steps`` steps on its own synthetic data with
``gradpress.ddp.register(ddp, SPEC)`` over gloo (``env://``: the cluster sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME``), then checks the DESIGN invariant "replicas agree":
the parameters are bit-identical on every rank (compared by all-gathering
them). Each rank writes ``rank<r>.json`` (parameter SHA-256, hook stats,
interface) into ``--out`` when given; rank 0 prints a one-line summary.
Exit status 0 iff parameters agree and the compressor was really used.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="gradpress training steps inside an emulated cluster")
    p.add_argument("--spec", default="topk:ratio=0.1", help="compressor spec (default: topk:ratio=0.1)")
    p.add_argument("--strategy", default="collective", help="gradpress strategy (default: collective)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    p.add_argument("--width", type=int, default=128, help="hidden width of the MLP (default: 128)")
    p.add_argument("--out", default=None, help="directory for rank<r>.json")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradpress.ddp
    from gradpress import torch_compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, 10))
    ddp = DistributedDataParallel(model)
    hook = gradpress.ddp.register(ddp, a.spec, strategy=a.strategy)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(a.steps):
        x = torch.randn(64, 32, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g.view(torch.int32), flat.view(torch.int32)) for g in gathered)
    stats = {k: v for k, v in hook.stats.items() if isinstance(v, (int, float))}
    hook.close()
    torch_compat.destroy_process_group()
    report = {
        "rank": rank, "world_size": world, "spec": a.spec, "steps": a.steps,
        "param_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "identical": identical, "losses": losses, "stats": stats,
        "interface": os.environ.get("GLOO_SOCKET_IFNAME"), "master": os.environ.get("MASTER_ADDR"),
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    ok = identical and stats.get("compressed_tensors", 0) > 0
    if rank == 0:
        print(f"selftest: world={world} spec={a.spec} strategy={a.strategy} steps={a.steps} identical={identical} "
              f"bytes_sent={stats.get('bytes_sent')} dense_bytes={stats.get('dense_bytes')} "
              f"compressed_tensors={stats.get('compressed_tensors')} -> {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    from gradpress.transport.groups import leave

    leave(main())  # the report is on disk: no interpreter teardown, which occasionally aborts (see leave)
