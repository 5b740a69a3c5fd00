"""benchmarks/bench_anchor_power.py: its table sets every power beside the first, paired by sample."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _row(seed, power, news, legal, unit="head"):
    def ev(r):
        return {"ratio": r, "log_ratio_se": 0.005}
    return {"unit": unit, "seed": seed, "fraction": 0.25, "anchor_power": power, "eval": {"news": ev(news),
                                                                                     "legal": ev(legal)}}


def test_the_table_gives_each_sample_the_geometric_mean_and_the_cells_a_power_won():
    from bench_anchor_power import render

    doc = {"order": ["news", "legal"], "domains": {"news": {"label": "news"}, "legal": {"label": "legal"}},
           "settings": {"powers": [3.0, 6.0]},
           "rows": [_row(0, 3.0, 1.10, 1.13), _row(1, 3.0, 1.20, 1.10), _row(0, 6.0, 1.09, 1.14),
                    _row(1, 6.0, 1.15, 1.09), _row(2, 6.0, 1.5, 1.5), _row(0, 8.0, 1.0, 1.0, unit="query")]}
    table = render(doc)
    assert "| head | 25% | 6 | 0 | 1.0900x ± 0.0055 | 1.1400x ± 0.0057 | |" in table
    # sample 2 has no row at power 3: listed, but out of the means and the count
    assert "| head | 25% | 6 | 2 | 1.5000x ± 0.0075 |" in table
    mean6 = f"{(1.09 * 1.15) ** 0.5:.4f}x"
    assert f"| head | 25% | 6 | geometric mean of 0, 1 | **{mean6}** | **{(1.14 * 1.09) ** 0.5:.4f}x** | 3 of 4 |" \
        in table
    assert f"| head | 25% | 3 | geometric mean of 0, 1 | **{(1.10 * 1.20) ** 0.5:.4f}x** |" in table
    assert "| query | 25% | 8 | 0 | 1.0000x ± 0.0050 | 1.0000x ± 0.0050 | |" in table  # a unit of its own
    assert "| query | 25% | 8 | geometric mean" not in table  # one sample: its row is the mean


def test_the_readme_section_names_the_unit_the_settings_and_every_command_that_added_rows():
    from render_results import anchor_power_section

    doc = {"order": ["news"], "domains": {"news": {"label": "news"}},
           "settings": {"unit": "head", "cal": 256, "eval": 128, "powers": [3.0, 6.0], "damping": 0.001,
                        "default_anchor_power": 3.0, "calibration": "builtin:pydoc+self"},
           "command": "python b.py --powers 3,6,8",
           "commands": ["python b.py --powers 3,6", "python b.py --powers 3,6,8"],
           "rows": [{**_row(0, 3.0, 1.1, 1.1), "eval": {"news": {"ratio": 1.1, "log_ratio_se": 0.01}}}]}
    section = anchor_power_section(doc)
    assert section.startswith("### How strongly the refit holds on to the weights (`--anchor-power`), removing "
                              "single heads: SmolLM2-135M, no training, 256 calibration blocks, 128 evaluation")
    assert "`python b.py --powers 3,6`  \n`python b.py --powers 3,6,8`" in section
    assert "| head | 25% | 3 | 0 | 1.1000x ± 0.0110 | |" in section


def test_the_section_says_which_default_its_runs_had_and_which_prune_takes_now_on_that_calibration():
    from render_results import anchor_power_section

    from headtool.surgery.prune_defaults import (FEW_TOKENS_ANCHOR_POWER, MANY_CALIBRATION_TOKENS,
                                                 MANY_TOKENS_ANCHOR_POWER)

    def section(cal: int, then: float) -> str:
        return anchor_power_section({
            "order": ["news"], "domains": {"news": {"label": "news"}}, "command": "python b.py",
            "settings": {"unit": "head", "cal": cal, "eval": 128, "powers": [then], "damping": 0.001,
                         "default_anchor_power": then, "calibration": "builtin:pydoc+self"},
            "rows": [{**_row(0, then, 1.1, 1.1), "eval": {"news": {"ratio": 1.1, "log_ratio_se": 0.01}}}]})

    many, few = MANY_CALIBRATION_TOKENS // 128, MANY_CALIBRATION_TOKENS // 128 - 1
    assert (f"prune's default on {few} blocks of 128 tokens is P = {FEW_TOKENS_ANCHOR_POWER:g}. Here"
            in section(few, FEW_TOKENS_ANCHOR_POWER))
    assert (f"prune's default on {many} blocks of 128 tokens is P = {MANY_TOKENS_ANCHOR_POWER:g}. Here"
            in section(many, MANY_TOKENS_ANCHOR_POWER))
    assert (f"prune's default on {many} blocks of 128 tokens is P = {MANY_TOKENS_ANCHOR_POWER:g} since these "
            f"ran (P = {FEW_TOKENS_ANCHOR_POWER:g} then)" in section(many, FEW_TOKENS_ANCHOR_POWER))


def test_one_sample_carries_its_count_on_its_own_row():
    from bench_anchor_power import render

    doc = {"order": ["news"], "domains": {"news": {"label": "news"}}, "settings": {"powers": [3.0, 6.0]},
           "rows": [{**_row(0, 3.0, 1.1, 1.1), "eval": {"news": {"ratio": 1.1, "log_ratio_se": 0.01}}},
                    {**_row(0, 6.0, 1.0, 1.0), "eval": {"news": {"ratio": 1.0, "log_ratio_se": 0.01}}}]}
    table = render(doc)
    assert "| head | 25% | 6 | 0 | 1.0000x ± 0.0100 | 1 of 1 |" in table
    assert "| head | 25% | 3 | 0 | 1.1000x ± 0.0110 | |" in table and "geometric mean" not in table
