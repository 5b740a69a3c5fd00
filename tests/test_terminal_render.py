"""The tables people read on stderr: every figure shown whole, whatever the terminal's width."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from rich.console import Console

from tiny_models import save_tiny


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1", **extra}


def _column_text(rendered: str, k: int) -> str:
    """Column k of a boxed table, its folded lines joined (what the cells say, in order)."""
    rows = [line.split("│") for line in rendered.splitlines() if line.startswith("│")]
    return "".join(r[k + 1].strip() for r in rows if len(r) > k + 1)


def test_a_32_head_score_heatmap_shows_every_value(tmp_path):
    """Squeezed into one table, a model of 32 heads in 120 columns (the width of a log or a pipe) showed
    every score as '0…': the heads are now shown in slices, each value whole."""
    model = save_tiny("llama", tmp_path / "m", num_attention_heads=32, num_key_value_heads=4)
    res = subprocess.run([sys.executable, "-m", "headtool", "score", str(model), "--method", "magnitude"],
                         capture_output=True, text=True, env=_env(COLUMNS="120"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    scores = json.loads(res.stdout)["scores"]
    assert "…" not in res.stderr
    assert max(len(line) for line in res.stderr.splitlines()) <= 120
    shown = re.findall(r"[-\d.]+", res.stderr)
    for row in scores:
        for v in row:
            assert f"{v:.3f}" in shown, v
    for j in range(32):
        assert f"h{j}" in res.stderr


def test_a_narrow_terminal_folds_figures_instead_of_cutting_them():
    """At COLUMNS=40 eval's table showed '7…' for a loss of 7.3841: cells now fold onto more lines."""
    from headtool.cli.render import eval_table

    rows = [{"model": name, "loss": loss, "perplexity": ppl, "params": 53664, "total_heads": 12, "total_kv_heads": 6,
             "kv_cache_bytes_per_token": 384} for name, loss, ppl in (("m", 7.3841, 1610.2154),
                                                                          ("p1", 7.5525, 1905.4722))]
    rows[1]["loss_delta_se"] = 0.1522
    result = {"objective": "lm", "data": {"samples": 4, "tokens": 64, "source": "builtin:pydoc"}, "results": rows}
    con = Console(width=40, no_color=True, record=True, file=open(os.devnull, "w"))
    con.print(eval_table(result))
    out = con.export_text()
    assert "…" not in out
    assert _column_text(out, 1) == "7.38417.5525"
    assert _column_text(out, 3) == "1610.21541905.4722"
    assert _column_text(out, 2) == "+0.1684±0.1522"
