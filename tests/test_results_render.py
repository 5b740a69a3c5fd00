"""README's Results are generated from benchmarks/results/*.json and must match them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_match_the_benchmark_json():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_results.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_render_fills_only_the_marked_block(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    text = "# x\nbefore\n<!-- results:begin -->\nstale\n<!-- results:end -->\nafter\n"
    new = render_results.updated_readme(text)
    assert new.startswith("# x\nbefore\n<!-- results:begin -->\n") and new.endswith("<!-- results:end -->\nafter\n")
    assert "stale" not in new and "### Quality" in new
