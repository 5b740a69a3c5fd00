"""Data-parallel scoring: torchrun or accelerate launch with 2 gloo processes equals one process on the
same batches."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiny_models import save_tiny


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    # --multi_gpu picks accelerate's torch.distributed launcher; on a CPU-only machine it runs gloo
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
}


@pytest.mark.parametrize("method, launcher", [("gradient", "torchrun"), ("ablation", "torchrun"),
                                              ("gradient", "accelerate")])
def test_two_gloo_ranks_equal_one_process(method, launcher, tmp_path):
    if launcher == "accelerate":
        pytest.importorskip("accelerate")
    model = save_tiny("llama", tmp_path / "m")
    common = ["score", str(model), "--method", method, "--max-samples", "6", "--seq-len", "16", "--batch-size", "1",
              "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HEADTOOL_NO_PROGRESS": "1"}
    dist = subprocess.run([*LAUNCHERS[launcher], "-m", "headtool", *common, "-o", str(tmp_path / "dist.json")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert dist.returncode == 0, dist.stderr[-2000:]
    single = subprocess.run([sys.executable, "-m", "headtool", *common, "-o", str(tmp_path / "one.json")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    a = json.loads((tmp_path / "dist.json").read_text())
    b = json.loads((tmp_path / "one.json").read_text())
    assert a["options"]["world_size"] == 2
    for ra, rb in zip(a["raw_scores"], b["raw_scores"]):
        for x, y in zip(ra, rb):
            assert abs(x - y) <= 1e-6 * max(abs(y), 1e-12)
    assert abs(a["baseline_loss"] - b["baseline_loss"]) <= 1e-9 * abs(b["baseline_loss"])
    assert a["data"]["samples"] == b["data"]["samples"] == 6


def test_the_backend_follows_the_device_not_the_machine(monkeypatch):
    """--device cpu on a machine with CUDA runs gloo (nccl cannot reduce CPU tensors)."""
    import torch

    from headtool.distributed import backend_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [backend_for(d) for d in ("cpu", torch.device("cpu"), "mps", "cuda", "cuda:1", torch.device("cuda", 0),
                                     "auto", None)] == ["gloo"] * 3 + ["nccl"] * 5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_for("auto") == backend_for(None) == "gloo"


@pytest.fixture()
def fake_group(monkeypatch):
    """A launched 2-process job whose process group is recorded instead of joined; CUDA 'exists'."""
    import torch
    import torch.distributed as dist

    joined: list[str] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    return joined


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("auto", "nccl")])
def test_world_from_env_joins_with_the_backend_of_the_device(fake_group, device, backend):
    from headtool.distributed import World, world_from_env

    assert world_from_env(device) == World(1, 2, 1)
    assert fake_group == [backend]


def test_heal_on_cpu_joins_gloo_where_cuda_exists(fake_group, tmp_path):
    """The command passes its --device on: the process group it joins is gloo."""
    from typer.testing import CliRunner

    from headtool.cli.app import app

    r = CliRunner().invoke(app, ["heal", str(tmp_path / "no-student"), "--teacher", str(tmp_path / "no-teacher"),
                                 "-o", str(tmp_path / "out"), "--device", "cpu"])
    assert r.exit_code == 2 and "not found" in r.stderr, r.stderr  # stopped at the missing student
    assert fake_group == ["gloo"]
