"""benchmarks/bench_convert_anchor.py: its table sets every anchor beside the first, paired by sample, per
command, and its README section names the settings and the default it is set beside."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _row(kind, seed, anchor, news, legal):
    def ev(r):
        return {"ratio": r, "log_ratio_se": 0.01}
    return {"kind": kind, "seed": seed, "anchor": anchor, "eval": {"news": ev(news), "legal": ev(legal)}}


def _doc(rows, cal=64):
    return {"order": ["news", "legal"], "domains": {"news": {"label": "news"}, "legal": {"label": "legal"}},
            "settings": {"anchors": [1.0, 0.3], "cal": cal, "eval": 128, "calibration": "builtin:pydoc+self",
                         "default_anchor": 1.0},
            "command": "python benchmarks/bench_convert_anchor.py", "rows": rows}


def test_the_table_gives_each_command_the_geometric_mean_and_the_cells_an_anchor_won():
    from bench_convert_anchor import render

    table = render(_doc([_row("mla", 0, 1.0, 2.2, 3.3), _row("mla", 1, 1.0, 2.4, 3.1),
                         _row("mla", 0, 0.3, 2.1, 3.4), _row("mla", 1, 0.3, 2.3, 3.0),
                         _row("gqa", 0, 1.0, 4.0, 6.0), _row("gqa", 0, 0.3, 4.1, 6.5)]))
    mla, gqa = "`convert-mla --kv-cache 1/3`", "`convert-gqa --kv-heads 1 --merge fit`"
    assert f"| {mla} | 0.3 | 0 | 2.1000x ± 0.0210 | 3.4000x ± 0.0340 | |" in table
    assert (f"| {mla} | 0.3 | geometric mean of 0, 1 | **{(2.1 * 2.3) ** 0.5:.4f}x** | **{(3.4 * 3.0) ** 0.5:.4f}x** "
            "| 3 of 4 |") in table
    assert f"| {gqa} | 0.3 | 0 | 4.1000x ± 0.0410 | 6.5000x ± 0.0650 | 0 of 2 |" in table  # one sample
    assert table.index(mla) < table.index(gqa)


def test_the_readme_section_names_the_commands_and_the_default_it_is_set_beside():
    from render_results import convert_anchor_section

    section = convert_anchor_section(_doc([_row("mla", 0, 1.0, 2.2, 3.3), _row("gqa", 0, 1.0, 4.0, 6.0)], cal=64))
    assert section.startswith("### How freely the conversions' refit may move (`--anchor`): SmolLM2-135M, no "
                              "training, 64 calibration blocks, 128 evaluation blocks a set")
    assert "Here `convert-mla --kv-cache 1/3` and `convert-gqa --kv-heads 1 --merge fit` on 64 blocks" in section
    assert "an anchor beat the first (1, the default of both commands)" in section
    assert "`python benchmarks/bench_convert_anchor.py`" in section


def test_a_run_resumes_the_rows_and_commands_of_an_earlier_run_of_the_same_settings(tmp_path):
    """sample_runs.resume (both paired benchmarks): an earlier file of the same settings gives its rows and
    commands (this run's last); other settings stop the run before it writes anything."""
    import json

    import pytest
    from sample_runs import resume

    out = tmp_path / "r.json"
    assert resume(fresh := {"settings": {"cal": 64}, "command": "c1", "rows": []}, out, ("cal",)) is None
    assert fresh["commands"] == ["c1"]
    out.write_text(json.dumps({**fresh, "rows": [{"seed": 0}]}))
    doc = {"settings": {"cal": 64}, "command": "c2", "rows": []}
    assert resume(doc, out, ("cal",))["rows"] == [{"seed": 0}]
    assert doc["rows"] == [{"seed": 0}] and doc["commands"] == ["c1", "c2"]
    with pytest.raises(SystemExit, match="measured with other settings"):
        resume({"settings": {"cal": 128}, "command": "c3", "rows": []}, out, ("cal",))
