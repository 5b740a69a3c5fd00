"""Data-parallel scoring: torchrun with 2 gloo processes equals one process on the same batches."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tiny_models import save_tiny


@pytest.mark.parametrize("method", ["gradient", "ablation"])
def test_two_gloo_ranks_equal_one_process(method, tmp_path):
    if shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")):
        pytest.skip("torchrun not installed")
    model = save_tiny("llama", tmp_path / "m")
    common = ["score", str(model), "--method", method, "--max-samples", "6", "--seq-len", "16", "--batch-size", "1",
              "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HEADTOOL_NO_PROGRESS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "headtool"]
    dist = subprocess.run([*torchrun, *common, "-o", str(tmp_path / "dist.json")], capture_output=True, text=True,
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
