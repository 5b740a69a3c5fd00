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
