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
    assert modes(",".join(AUTO)) == AUTO and modes(",".join(MODES)) == MODES
    assert modes("auto") == ("obs",)  # the default since obs_allocation.json; AUTO is the one before
    def row(**losses) -> dict:
        return {"modes": {m: {"judge_loss": v} for m, v in losses.items()}}
    losses = row(layer=3.2, geometric=3.1, none=3.15)
    assert judged(losses, MODES) == "geometric" and judged(losses, AUTO) == "none"
    assert judged(row(layer=3.1, geometric=3.1, none=3.1), MODES) == "layer"  # a tie keeps the first


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


def test_a_judge_with_a_margin_keeps_the_first_mode_unless_another_wins_by_it():
    """The same prunes judged by rules that need a margin: a clear win (3 standard errors of the paired
    difference) changes the pick at 1 and 2 SE, a win within the noise does not; the margin table
    shows each rule's picks and geometric means."""
    from bench_allocation import judged, margin_table, render

    def mode(sums, news):
        return {"judge_loss": sum(sums) / 20, "judge_block_sums": sums, "removed_per_layer": [1, 2],
                "eval": {"news": {"ratio": news}}}
    clear = {"seed": 0, "fraction": 0.5, "heads_removed": 135, "auto": "none", "three": "none",
             "judge_block_weights": [10.0, 10.0],
             "modes": {"layer": mode([30.0, 30.0], 1.8), "geometric": mode([30.0, 30.2], 1.7),
                       "none": mode([29.0, 29.5], 1.5)}}
    noisy = {**clear, "seed": 1, "modes": {**clear["modes"], "none": mode([28.0, 31.5], 1.6)}}
    assert [judged(clear, ("layer", "none"), k) for k in (0, 1, 2, 3.5)] == \
        ["none", "none", "none", "layer"]  # -0.075 ± 0.025
    assert [judged(noisy, ("layer", "none"), k) for k in (0, 1)] == ["none", "layer"]  # -0.025 ± 0.175
    doc = {"order": ["news"], "domains": {"news": {"label": "news (Lee corpus)"}},
           "settings": {"fractions": [0.5], "modes": ["layer", "geometric", "none"]}, "rows": [clear, noisy]}
    table = margin_table(doc)
    assert "| 50% | layer,none | lowest loss (the default) | 1.549x | none, none |" in table  # sqrt(1.5 * 1.6)
    assert "| 50% | layer,none | `--allocation-margin 1` | 1.643x | none, layer |" in table  # sqrt(1.5 * 1.8)
    assert table in render(doc)
    assert "| 50% (135) | 0 | layer | 3.0000 (+0.0750 ± 0.0250) | 1.800x | 1, 2 |" in render(doc)


def test_the_obs_table_sets_each_sample_beside_what_the_scores_kept():
    """bench_obs_allocation: obs's judge loss with its paired difference from auto's pick (the same
    blocks), every sample beside auto's and the margin list's picks, geometric means and obs's wins."""
    from bench_obs_allocation import render

    def mode(sums, news):
        return {"judge_loss": sum(sums) / 20, "judge_block_sums": sums, "removed_per_layer": [0, 3],
                "eval": {"news": {"ratio": news}}}
    base, rows = {}, []
    for seed, obs_news in ((0, 1.5), (1, 1.7)):
        base[(seed, 0.5)] = {"auto": "layer", "judge_block_weights": [10.0, 10.0],
                             "modes": {"layer": mode([30.0, 32.0], 1.6), "geometric": mode([30.0, 32.2], 1.55),
                                       "none": mode([30.5, 32.5], 1.65)}}
        rows.append({"seed": seed, "fraction": 0.5, "heads_removed": 135, "judge_loss": 3.0,
                     "judge_block_sums": [29.0, 31.0], "removed_per_layer": [0, 6], "statistics_seconds": 43.0,
                     "prune_seconds": 80.0, "eval": {"news": {"ratio": obs_news}}})
    doc = {"order": ["news"], "domains": {"news": {"label": "news (Lee corpus)"}},
           "settings": {"fractions": [0.5]}, "rows": rows}
    table = render(doc, base)
    # obs 3.0 against auto's 3.1: -0.1, both blocks 1.0 lower, so no spread: standard error 0
    assert "| 50% (135) | 0 | `obs` | 3.0000 (-0.1000 ± 0.0000) | 1.500x | 0, 6 | 80 (43) |" in table
    assert "| 50% (135) | 0 | `auto` (kept layer) | 3.1000 | 1.600x | 0, 3 |  |" in table
    assert "| 50% (135) | 1 | `layer,geometric,none` margin 1 (kept layer) | 3.1000 | 1.600x | 0, 3 |  |" in table
    assert "geometric mean of 2 | `obs` (samples where obs beat auto: 1/2 news) | | **1.597x** |" in table
    assert "geometric mean of 2 | `auto` (layer,none) | | **1.600x** |" in table
    # obs,layer,none as prune would judge it: obs's judge loss 3.0 is the lowest in both samples
    assert "geometric mean of 2 | `obs,layer,none` (the judge's pick) | | **1.597x** |" in table


def test_the_anchor_power_table_sets_each_sample_beside_obs_without_it():
    """bench_obs_allocation --anchor-power P: each sample beside the obs row without the power (the same
    judge blocks: the paired difference), geometric means and the samples where the power helped; a
    results file with a power is no baseline for another."""
    from bench_obs_allocation import compared_power, obs_rows, render_power

    def row(seed, sums, news, removed):
        return {"seed": seed, "fraction": 0.5, "heads_removed": 135, "judge_loss": sum(sums) / 20,
                "judge_block_sums": sums, "judge_block_weights": [10.0, 10.0], "removed_per_layer": removed,
                "prune_seconds": 70.0, "eval": {"news": {"ratio": news}}}
    plain = {(s, 0.5): row(s, [30.0, 32.0], news, [0, 6]) for s, news in ((0, 1.6), (1, 1.5))}
    doc = {"order": ["news"], "domains": {"news": {"label": "news"}},
           "settings": {"fractions": [0.5], "anchor_power": 2.0},
           "rows": [row(0, [29.0, 31.5], 1.5, [0, 3, 6]), row(1, [30.0, 32.4], 1.56, [0, 6])]}
    table = render_power(doc, plain)
    assert "| 50% (135) | 0 | 2 | 3.0250 (-0.0750 ± 0.0250) | 1.500x | 0, 3, 6 | 70 |" in table
    assert "| 50% (135) | 0 | 0 | 3.1000 | 1.600x | 0, 6 | 70 |" in table
    assert "| 50% | geometric mean of 2 | 2 (samples better than power 0: 1/2 news) | | **1.530x** |" in table
    assert "| 50% | geometric mean of 2 | 0 | | **1.549x** |" in table

    import json
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        for name, power, rows in (("obs_allocation.json", 0.0, [plain[(0, 0.5)]]),
                                  ("obs_allocation_power2.json", 2.0, doc["rows"])):
            (Path(d) / name).write_text(json.dumps({"settings": {"anchor_power": power}, "rows": rows}))
        assert obs_rows(Path(d)) == {(0, 0.5): plain[(0, 0.5)]}
        # a run that also changes the damping is set beside the same power at 0.01: what the damping changes
        (Path(d) / "obs_allocation_power2_damping.json").write_text(json.dumps(
            {"settings": {"anchor_power": 2.0, "damping": 0.001}, "rows": [plain[(1, 0.5)]]}))
        damped = {**doc, "settings": {**doc["settings"], "damping": 0.001}}
        assert compared_power(damped) == 2.0 and compared_power(doc) == 0.0
        assert obs_rows(Path(d), compared_power(damped)) == {(0, 0.5): doc["rows"][0], (1, 0.5): doc["rows"][1]}
        table = render_power(damped, obs_rows(Path(d), 2.0))
        assert "| 50% (135) | 0 | 2 `--damping 0.001` | 3.0250 (+0.0000 ± 0.0000) | 1.500x |" in table
        assert "samples better than power 2: 0/2 news" in table


def test_a_larger_evaluation_is_set_beside_the_same_prunes_on_the_default_blocks(tmp_path):
    """bench_obs_allocation --eval 128: each sample's ratio (± its standard error, scaled from the log) beside
    the same prune's ratio on 16 blocks (same calibration size, power and damping; a run at another size or
    evaluation is not it), geometric means of both; and a calibration-size table never mixes evaluations."""
    import json

    from bench_obs_allocation import blocks_rows, fewer_eval_rows, render_eval

    def doc(cal: int, news: list[float], eval_blocks: int = 16, se: float | None = None) -> dict:
        rows = [{"seed": s, "fraction": 0.25, "heads_removed": 66, "removed_per_layer": [0, 3], "prune_seconds": 9.0,
                 "eval": {"news": {"perplexity": 50.0, "ratio": n, **({} if se is None else {"log_ratio_se": se})}}}
                for s, n in enumerate(news)]
        return {"settings": {"seeds": list(range(len(news))), "fractions": [0.25], "cal": cal, "eval": eval_blocks,
                             "anchor_power": 3.0, "damping": 0.001}, "order": ["news"],
                "domains": {"news": {"label": "news"}}, "rows": rows}
    (tmp_path / "obs_blocks_256.json").write_text(json.dumps(doc(256, [1.10, 1.20])))
    (tmp_path / "obs_blocks_128.json").write_text(json.dumps(doc(128, [7.0, 7.0])))
    (tmp_path / "obs_blocks_256_wide.json").write_text(json.dumps(doc(128, [8.0, 8.0], eval_blocks=128)))
    big = doc(256, [1.12, 1.25], eval_blocks=128, se=0.01)
    fewer = fewer_eval_rows(big, tmp_path)
    assert sorted(fewer) == [(0, 0.25), (1, 0.25)] and fewer[(0, 0.25)]["eval"]["news"]["ratio"] == 1.10
    table = render_eval(big, fewer)
    assert "| 25% (66) | 0 | 128 | 1.120x ± 0.011 |\n| | | 16 | 1.100x |" in table
    assert "| 25% (66) | 1 | 128 | 1.250x ± 0.013 |" in table
    assert "| 25% | geometric mean of 2 | 128 | **1.183x** |" in table
    assert "| 25% | geometric mean of 2 | 16 | **1.149x** |" in table
    assert "7.000x" not in table and "8.000x" not in table
    # the 128-block-evaluation run at 128 calibration blocks is not a smaller calibration of the 16-block runs
    assert {k: v[(0, 0.25)]["eval"]["news"]["ratio"] for k, v in blocks_rows(doc(256, [1.1]), tmp_path).items()} \
        == {128: 7.0}
    assert {k: v[(0, 0.25)]["eval"]["news"]["ratio"] for k, v in blocks_rows(big, tmp_path).items()} == {128: 8.0}
