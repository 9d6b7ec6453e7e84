"""The launcher's rendezvous port: free, drawn below the kernel's ephemeral
range (where gloo's and other runs' port-0 sockets take theirs), and chosen
after the slow preload, just before the store binds it."""

from __future__ import annotations


def test_rendezvous_port_is_free_and_outside_the_ephemeral_range() -> None:
    import socket

    from gradpress.train import launch

    lo, hi = launch._ephemeral_range()
    assert 1024 < lo < hi
    ports = {launch.free_port() for _ in range(20)}
    assert all(10_000 <= p < lo for p in ports) and len(ports) > 1  # random, not the kernel's next one
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when returned


def test_rendezvous_port_falls_back_to_the_kernel_when_the_range_is_tiny(monkeypatch) -> None:
    from gradpress.train import launch

    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (10_100, 60_999))
    port = launch.free_port()
    assert port >= 1024 and not 10_000 <= port < 10_100


def test_port_is_chosen_after_the_slow_preload(monkeypatch, tmp_path) -> None:
    """The window between choosing the port and the store binding it must
    not include building the data (seconds on a busy machine)."""
    import torch.distributed.launcher.api as api

    from gradpress.train import launch

    calls: list[str] = []
    monkeypatch.setattr(launch, "_start_forkserver", lambda: calls.append("forkserver"))
    monkeypatch.setattr(launch, "_preload", lambda cfg: calls.append("preload"))
    monkeypatch.setattr(launch, "free_port", lambda: calls.append("port") or 12345)

    def fake_launch(config, entry):  # noqa: ANN001, ANN202
        calls.append(f"launch {config.rdzv_endpoint}")
        return lambda cfg, env=None: {0: {"ok": {"done": True}}}

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    out = launch.run(nproc=2, samples=96, batch_size=16, out=str(tmp_path / "o"), progress=False)
    assert out == {"done": True}
    # the fork server (Linux CPU) starts first, so that its imports overlap the preload
    server = ["forkserver"] if launch._start_method("cpu") == "forkserver" else []
    assert calls == [*server, "preload", "port", "launch 127.0.0.1:12345"]


def test_launch_config_passes_the_shutdown_grace_only_where_torch_has_it() -> None:
    """torch 2.11's LaunchConfig has no ``shutdown_timeout`` (passing it made
    ``gradpress train`` fail with a TypeError there); torch 2.13's has."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from gradpress.train import launch
    from gradpress.train.config import TrainConfig

    names = {f.name for f in dataclasses.fields(LaunchConfig)} - {"shutdown_timeout"}
    old = dataclasses.make_dataclass("OldLaunchConfig", [(n, object, dataclasses.field(default=None)) for n in names])
    new = dataclasses.make_dataclass("NewLaunchConfig", [(n, object, dataclasses.field(default=None))
                                                         for n in [*names, "shutdown_timeout"]])
    cfg = TrainConfig(nproc=3)
    built = launch.launch_config(cfg, old)
    assert built.nproc_per_node == 3 and built.max_restarts == 0 and not hasattr(built, "shutdown_timeout")
    assert launch.launch_config(cfg, new).shutdown_timeout == 5
