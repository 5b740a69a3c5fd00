"""A real shell pipeline: `headtool score ... | headtool prune ... --scores -`, and JSON-only stdout."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from tiny_models import save_tiny


def test_score_piped_into_prune(tmp_path):
    model = save_tiny("qwen2", tmp_path / "m")
    ht = f"{shlex.quote(sys.executable)} -m headtool"
    out = tmp_path / "pruned"
    cmd = (f"{ht} score {model} --max-samples 4 --seq-len 16 --batch-size 2 | "
           f"{ht} prune {model} --scores - --num-heads 4 -o {out} --json")
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)  # stdout is the JSON document alone: no colour, no progress codes
    assert "\x1b[" not in res.stdout
    assert summary["heads_removed"] == 4  # from layers 1 and 2: the first layer is protected
    assert summary["layers"][0]["heads_after"] == 4
    info = subprocess.run([sys.executable, "-m", "headtool", "info", str(out), "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert json.loads(info.stdout)["total_heads"] == 8
    assert json.loads((out / "headtool.json").read_text())["scores"]["from"] == "-"
