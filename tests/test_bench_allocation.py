"""benchmarks/bench_allocation.py: it keeps what prune keeps for a list of modes, and its table says so."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_bench_judges_as_prune_does():
    from bench_allocation import AUTO, MODES, judged

    from headtool.data.sources import DataSpec
    from headtool.workflows.prune import Scored, normalizations
    from headtool.workflows.requests import PruneRequest

    spec = DataSpec(source="builtin:pydoc", max_samples=8)
    raw = [[0.5, 0.1], [0.2, 0.3]]
    scored = Scored(raw, raw, "layer", "gradient")

    def modes(normalize: str) -> tuple:
        req = PruneRequest(model="m", fraction=0.25, compensate=True, data=spec, normalize=normalize)
        return tuple(normalizations(req, scored, spec, "causal-lm"))
    assert modes("auto") == AUTO and modes(",".join(MODES)) == MODES
    losses = {"layer": 3.2, "geometric": 3.1, "none": 3.15}
    assert judged(losses, MODES) == "geometric" and judged(losses, AUTO) == "none"
    assert judged({"layer": 3.1, "geometric": 3.1, "none": 3.1}, MODES) == "layer"  # a tie keeps the first


def test_the_table_marks_what_each_list_keeps_and_averages_them():
    from bench_allocation import render

    def mode(judge, news, per):
        return {"judge_loss": judge, "removed_per_layer": per, "eval": {"news": {"ratio": news}}}
    rows = [{"seed": s, "fraction": 0.5, "heads_removed": 135, "auto": "none", "three": three,
             "modes": {"layer": mode(3.5, 1.8, [0, 3]), "geometric": mode(g_judge, g, [0, 6]),
                       "none": mode(3.45, n, [3, 6])}}
            for s, three, g_judge, g, n in ((0, "geometric", 3.4, 1.5, 1.6), (1, "none", 3.6, 1.9, 1.44))]
    doc = {"order": ["news"], "domains": {"news": {"label": "news (Lee corpus)"}},
           "settings": {"fractions": [0.5], "modes": ["layer", "geometric", "none"]}, "rows": rows}
    table = render(doc)
    assert "| 50% (135) | 0 | geometric | 3.4000 | **1.500x** | 0, 6 |" in table
    assert "| 50% (135) | 0 | none (auto) | 3.4500 | 1.600x | 3, 6 |" in table
    assert "| 50% (135) | 1 | none (auto) | 3.4500 | **1.440x** | 3, 6 |" in table
    assert "| 50% | geometric mean of 2 | auto (layer,none) | | **1.518x** | |" in table  # sqrt(1.6 * 1.44)
    assert "| 50% | geometric mean of 2 | layer,geometric,none | | **1.470x** | |" in table  # sqrt(1.5 * 1.44)
    assert "| 50% | geometric mean of 2 | layer alone | | **1.800x** | |" in table
