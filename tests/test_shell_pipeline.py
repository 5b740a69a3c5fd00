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


def test_a_closed_stdout_is_refused_before_any_work(tmp_path):
    """`>&-` (or a service started without stdout) left Python's sys.stdout None: prune --json wrote its
    folder, then exited 1 with 'internal error: AttributeError ... please report it'; score computed
    everything first. Now one line, exit 2, before the work: nothing written."""
    model = save_tiny("qwen2", tmp_path / "m")
    ht = f"{shlex.quote(sys.executable)} -m headtool"
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "pruned"
    for cmd, says in ((f"{ht} prune {model} --heads '1:0,2' -o {out} --json", "--json"),
                      (f"{ht} info {model} --json", "--json"),
                      (f"{ht} score {model} --method magnitude", "-o FILE")):
        res = subprocess.run(["bash", "-c", cmd + " >&-"], capture_output=True, text=True, env=env, timeout=300)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, res.stderr[-2000:]
        assert lines[-1].startswith("error: stdout is closed") and says in lines[-1], lines
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr
        assert "head scores" not in res.stderr  # refused before scoring
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    res = subprocess.run(["bash", "-c", f"{ht} info {model} >&-"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]  # without --json nothing goes to stdout


def test_help_into_a_reader_that_stops_early_exits_0(tmp_path):
    """`headtool prune --help | head` ended 1 (rich's broken-pipe exit) where the commands themselves end
    0 when their reader stops: under `set -o pipefail` a script failed on reading the help."""
    ht = f"{shlex.quote(sys.executable)} -m headtool"
    env = {**os.environ, "NO_COLOR": "1"}
    for args in ("--help", "prune --help", "convert-mla --help"):
        # `true` reads nothing and is gone long before Python has started: every write meets a closed pipe
        res = subprocess.run(["bash", "-o", "pipefail", "-c", f"{ht} {args} | true"], capture_output=True,
                             text=True, env=env, timeout=120)
        assert res.returncode == 0, (args, res.returncode, res.stderr[-2000:])
        assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
