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


def test_the_mla_section_renders_a_bench_mla_document():
    """benchmarks/bench_mla.py's JSON (smoke-sized here) renders as a README section."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    ev = {"news": {"perplexity": 40.0, "ratio": 1.0}}
    doc = {"command": "python benchmarks/bench_mla.py", "order": ["news"], "domains": {"news": {"label": "news"}},
           "settings": {"cal": 2, "seq_len": 32, "calibration": "builtin:pydoc+self", "held": 1, "context": 64},
           "rows": [{"change": "none (original)", "eval": ev, "kv_cache_bytes_per_token": 300,
                     "speed": {"decode_tokens_per_s": 10.0, "ratio": {"decode_tokens_per_s": 1.0}}},
                    {"change": "convert-mla, 1/3 of the cache, auto", "kv_rank": [3, 5], "eval":
                     {"news": {"perplexity": 60.0, "ratio": 1.5}}, "kv_cache_bytes_per_token": 100}]}
    text = render_results.mla_section(doc)
    assert "| convert-mla, 1/3 of the cache, auto | 3..5 | 60.00 (1.50x) | 100 B (0.333x) | - |" in text
    assert "10.00 (1.00x)" in text and "### Latent attention" in text
