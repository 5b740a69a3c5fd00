"""README's Results are generated from benchmarks/results/*.json and must match them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_match_the_benchmark_json():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_results.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_result_names_the_command_that_wrote_it():
    """A result's recorded command, rerun as printed, must write that very file: a run that wrote
    elsewhere (/tmp) and was moved in afterwards, or whose empty argument lost its quotes, reads as
    a command that reproduces nothing."""
    import json
    import shlex

    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if not command:
            continue
        words = shlex.split(command)
        # as a shell reads it: an empty or ';'-holding argument quoted, as shlex.join writes it
        assert shlex.join(words) == command, (path.name, command)
        assert words[:2] == ["python", words[1]] and words[1].startswith("benchmarks/"), (path.name, command)
        if "--out" in words:
            assert words[words.index("--out") + 1] == f"benchmarks/results/{path.name}", (path.name, command)


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


def test_calibrations_render_a_column_and_mark_the_domain_matched_cell():
    """bench_mla with several --calibration sources: a calibration column, and the evaluation set a
    row was calibrated on is marked (it is in-domain for that row)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    def ev(news: float, legal: float) -> dict:
        return {"news": {"perplexity": 40.0 * news, "ratio": news}, "legal": {"perplexity": 20.0 * legal, "ratio": legal}}
    doc = {"command": "python benchmarks/bench_mla.py --calibration builtin:pydoc,news", "order": ["news", "legal"],
           "domains": {"news": {"label": "news"}, "legal": {"label": "legal"}},
           "settings": {"cal": 2, "seq_len": 32, "calibration": "builtin:pydoc,news", "held": 1, "context": 64,
                        "calibrations": ["builtin:pydoc", "news"], "budgets": [["1/3", None]]},
           "rows": [{"change": "none (original)", "eval": ev(1.0, 1.0), "kv_cache_bytes_per_token": 300},
                    {"change": "convert-mla, 1/3 of the cache, uniform", "calibration": "builtin:pydoc",
                     "kv_rank": [4, 4], "rope_dim": 2, "eval": ev(2.0, 3.0), "kv_cache_bytes_per_token": 100},
                    {"change": "convert-mla, 1/3 of the cache, uniform", "calibration": "news",
                     "kv_rank": [4, 4], "rope_dim": 2, "eval": ev(1.5, 4.0), "kv_cache_bytes_per_token": 100}]}
    text = render_results.mla_calibration_section(doc)
    assert "| change | calibration | kv_rank + rope_dim per layer | news | legal |" in text
    assert "| --- | --- | --- | ---: |" in text
    assert "| convert-mla, 1/3 of the cache, uniform | `builtin:pydoc` | 4 + 2 | 80.00 (2.00x) | 60.00 (3.00x) |" in text
    assert "| convert-mla, 1/3 of the cache, uniform | `news` | 4 + 2 | 60.00 (1.50x), calibrated on it | 80.00 (4.00x) |" \
        in text
    assert "| none (original) | - | - | 40.00 (1.00x) |" in text and "at 1/3 of the cache" in text and "(marked)" in text


def test_the_served_text_section_marks_the_matched_domain():
    """bench_cross_domain with a calibration that mixes in an evaluation set's own text: that set's
    cell is in-domain for the row and says so; the other set is not marked."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    def ev(news: float, legal: float) -> dict:
        return {"news": {"perplexity": 40.0 * news, "ratio": news}, "legal": {"perplexity": 20.0 * legal, "ratio": legal}}
    domains = {n: {"label": n, "eval": {"samples": 2, "seq_len": 32}, "blocks_available": 9} for n in ("news", "legal")}
    doc = {"command": "python benchmarks/bench_cross_domain.py --calibrations legal+builtin:pydoc+self",
           "order": ["news", "legal"], "domains": domains, "calibration": {}, "settings": {"cal": 32, "seq_len": 128},
           "rows": [{"change": "none (unpruned)", "kind": "unpruned", "calibration": None, "eval": ev(1.0, 1.0),
                     "seconds": 3},
                    {"change": "25% of query heads removed", "kind": "prune", "heads_removed": 66, "compensate": True,
                     "anchor": "1", "protect_layers": "0", "calibration": "legal+builtin:pydoc+self",
                     "calibrated_on": ["legal"], "eval": ev(1.1, 1.05), "seconds": 50},
                    {"change": "50% of query heads removed", "kind": "prune", "heads_removed": 135, "compensate": True,
                     "anchor": "1", "anchor_power": 3.0, "damping": 0.001, "protect_layers": "0", "calibration": "legal+builtin:pydoc+self",
                     "calibrated_on": ["legal"], "eval": ev(1.5, 1.25), "seconds": 50}]}
    text = render_results.served_section(doc)
    # a row written before --anchor-power and the damping's record says it ran at 0 and 0.01; a row at
    # today's defaults names neither
    assert ("| 25% of query heads removed (66), gradient, `--compensate --anchor 1 --anchor-power 0 --damping 0.01`, "
            "`--protect-layers 0` | `legal+builtin:pydoc+self` | 44.00 (1.10x) | 21.00 (1.05x), calibrated on it | "
            "50 |") in text
    assert ("| 50% of query heads removed (135), gradient, `--compensate --anchor 1`, `--protect-layers 0` | "
            "`legal+builtin:pydoc+self` | 60.00 (1.50x) | 25.00 (1.25x), calibrated on it | 50 |") in text
    assert "### Calibrating on the served text" in text
    # today's default power depends on the calibration's size: on 128 blocks P = 3 is no longer it
    doc["settings"]["cal"] = 128
    assert ("| 50% of query heads removed (135), gradient, `--compensate --anchor 1 --anchor-power 3`, "
            "`--protect-layers 0` |") in render_results.served_section(doc)


def test_a_heal_on_the_served_text_is_titled_and_marked_so():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    names = ("news", "legal")
    ppl = {n: {"perplexity": 20.0} for n in names}
    doc = {"command": "python benchmarks/bench_heal_cross_domain.py --heal-data legal+builtin:pydoc+self:320",
           "order": list(names), "domains": {n: {"label": n} for n in names}, "teacher": ppl, "before": ppl,
           "student": {"kind": "gqa", "made_by": "convert_loaded: --data legal+builtin:pydoc+self"},
           "settings": {"max_steps": 3, "batch_size": 1, "seq_len": 8},
           "rows": [{"heal_data": "legal+builtin:pydoc+self:320", "healed_on": ["legal"], "seconds": 5,
                     "after": ppl, "gap_closed": {"news": 0.25, "legal": 0.5}}]}
    text = render_results.heal_cross_domain_section(doc)
    assert text.startswith("### Healing with the served text mixed in: SmolLM2-135M 3 → 1 KV heads")
    assert "| `legal+builtin:pydoc+self:320` | 20.00 (25% closed) | 20.00 (50% closed; healed on it) | 5 |" in text


def test_heal_variants_parse_and_override_any_option():
    """bench_heal_cross_domain --variants: typed HealOptions overrides, the benchmark's own settings
    (train, max_steps) included, and a clear exit on a field that does not exist."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_heal_cross_domain import heal_options, parse_variant, variant_label

    v = parse_variant("train=lora, lr=1e-3,hidden_weight=1,hidden_layers=all,max_steps=7,keep_best=false")
    assert v == {"train": "lora", "lr": 1e-3, "hidden_weight": 1, "hidden_layers": "all", "max_steps": 7,
                 "keep_best": False}
    opts = heal_options(300, v)
    assert (opts.train, opts.max_steps, opts.lr, opts.keep_best) == ("lora", 7, 1e-3, False)
    assert heal_options(300, {}).train == "attention" and heal_options(300, {}).max_steps == 300
    assert variant_label({}) == "" and variant_label({"lr": 0.001}) == " (lr 0.001)"
    with pytest.raises(SystemExit, match="HealOptions field"):
        parse_variant("learning_rate=1")


def test_the_calibration_size_runs_render_as_one_table_in_block_order():
    """Runs of bench_cross_domain that differ only in --cal (and --seed) become one table (what more
    calibration text buys, what another sample moves), rows by block count then seed whatever order
    the files come in, each figure from its run, '-' where a run has no such column."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    paths = sorted((ROOT / "benchmarks" / "results").glob("cross_domain_blocks_*.json"))
    assert len(paths) >= 2
    docs = [json.loads(p.read_text()) for p in paths]
    text = render_results.calibration_size_section(list(reversed(docs)))
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    keys = [(int(line.split("|")[1]), int(line.split("|")[2])) for line in rows]
    assert keys == sorted(keys)
    assert set(keys) == {(d["settings"]["cal"], d["settings"].get("seed", 0)) for d in docs}
    for doc in docs:
        k = (doc["settings"]["cal"], doc["settings"].get("seed", 0))
        ours = [line for line, kk in zip(rows, keys) if kk == k]
        prunes = [r for r in doc["rows"] if r["kind"] == "prune"]
        assert len(ours) == len(prunes)
        for line, r in zip(ours, prunes):
            assert f"| {r['eval']['legal']['ratio']:.2f}x |" in line
            assert ("in-domain" in r["eval"]) == ("x | - |" not in line)
        assert f"`{doc['command']}`" in text
    assert text.count("### ") == 1


def test_rows_where_auto_compared_layer_and_none_are_marked_as_before_obs():
    """Since --normalize auto is obs with --compensate, a refit row whose auto compared layer,none
    (measured before) is marked in the tables and the note says so; an obs row, an explicit
    layer,none row and a row without a refit (auto as scored) are not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cross_domain import BEFORE_OBS, BEFORE_OBS_NOTE, chosen_allocation, render

    cands = [{"normalize": "layer", "heldout_loss": 3.1}, {"normalize": "none", "heldout_loss": 3.2}]
    seen = {"compared_on": {"source": "self"}}
    old = {"normalize": "auto", "compensate": True, "anchor": "1",
           "allocation": {"normalize": "layer", "candidates": cands, **seen}}
    assert chosen_allocation(old) == "layer" + BEFORE_OBS
    assert chosen_allocation({**old, "normalize": "layer,none"}) == "layer"
    assert chosen_allocation({**old, "anchor": "inf"}) == "layer"  # auto still compares without a refit
    assert chosen_allocation({**old, "allocation": {"normalize": "obs", "candidates": [{"normalize": "obs"}]}}) == "obs"
    assert chosen_allocation({}) is None
    ev = {"news": {"perplexity": 2.0, "ratio": 1.0}}
    doc = {"order": ["news"], "domains": {"news": {"eval": {"samples": 1, "seq_len": 8}, "blocks_available": 2}},
           "calibration": {}, "command": "python benchmarks/bench_cross_domain.py", "settings": {"cal": 32},
           "rows": [{"kind": "prune", "change": "25% of query heads removed", "heads_removed": 66,
                     "calibration": "self", "eval": ev, "seconds": 1.0, **old}]}
    table = render(doc)
    assert f"`--normalize auto` (chose layer{BEFORE_OBS})" in table and BEFORE_OBS_NOTE in table
    doc["rows"][0]["allocation"] = {"normalize": "obs", "candidates": [{"normalize": "obs"}]}
    assert BEFORE_OBS not in render(doc)


def test_a_larger_calibration_run_is_set_beside_the_64_block_rows_and_never_mixed_into_them(tmp_path):
    """bench_obs_allocation --cal 128: its rows are compared with the 64-block rows at the same power and
    damping, and a 64-block lookup (the power tables) never picks them up, whatever the file is called."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_obs_allocation import blocks_rows, obs_rows, render_blocks

    def doc(cal: int, news: float) -> dict:
        row = {"seed": 0, "fraction": 0.5, "heads_removed": 135, "removed_per_layer": [0, 3, 6],
               "prune_seconds": 60.0, "eval": {"news": {"perplexity": 50.0, "ratio": news}}}
        return {"settings": {"seeds": [0], "fractions": [0.5], "cal": cal, "anchor_power": 3.0, "damping": 0.001},
                "order": ["news"], "domains": {"news": {"label": "news"}}, "rows": [row, {**row, "seed": 1}]}
    (tmp_path / "obs_allocation_power3_damping.json").write_text(json.dumps(doc(64, 1.5)))
    (tmp_path / "obs_allocation_more.json").write_text(json.dumps(doc(128, 1.4)))
    at64 = obs_rows(tmp_path, 3.0, 0.001)
    assert {r["eval"]["news"]["ratio"] for r in at64.values()} == {1.5}
    assert obs_rows(tmp_path, 3.0, 0.001, cal=128)[(0, 0.5)]["eval"]["news"]["ratio"] == 1.4
    table = render_blocks(doc(128, 1.4), blocks_rows(doc(128, 1.4), tmp_path))
    assert "| 50% (135) | 0 | 128 | 1.400x |" in table and "| 50% (135) | 0 | 64 | 1.500x |" in table
    assert "128 blocks (samples better than 64 blocks: 2/2 news) | | **1.400x**" in table


def test_a_calibration_run_is_set_beside_every_smaller_one_and_only_samples_all_of_them_ran(tmp_path):
    """bench_obs_allocation --cal 256: beside the 128- and the 64-block runs (largest first), each mean counted
    against the next smaller calibration; a sample missing from one of them is left out of the table."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_obs_allocation import blocks_rows, render_blocks

    def doc(cal: int, news: list[float], seeds=(0, 1)) -> dict:
        rows = [{"seed": s, "fraction": 0.25, "heads_removed": 66, "removed_per_layer": [0, 3],
                 "prune_seconds": 60.0, "eval": {"news": {"perplexity": 50.0, "ratio": n}}}
                for s, n in zip(seeds, news)]
        return {"settings": {"seeds": list(seeds), "fractions": [0.25], "cal": cal, "anchor_power": 3.0,
                             "damping": 0.001}, "order": ["news"], "domains": {"news": {"label": "news"}},
                "rows": rows}
    (tmp_path / "obs_allocation_power3_damping.json").write_text(json.dumps(doc(64, [1.2, 1.2, 1.2], (0, 1, 2))))
    (tmp_path / "obs_blocks_128.json").write_text(json.dumps(doc(128, [1.1, 1.3])))
    other = doc(64, [9.0, 9.0])
    other["settings"]["damping"] = 0.01  # another refit: never compared
    (tmp_path / "obs_allocation.json").write_text(json.dumps(other))
    big = doc(256, [1.0, 1.2, 1.0], (0, 1, 2))
    smaller = blocks_rows(big, tmp_path)
    assert list(smaller) == [128, 64]
    table = render_blocks(big, smaller)
    lines = [line for line in table.splitlines() if line.startswith("| 25% (66) |")]
    assert [line.split(" | ")[1:3] for line in lines] == [["0", "256"], ["0", "128"], ["0", "64"],
                                                          ["1", "256"], ["1", "128"], ["1", "64"]]
    assert "256 blocks (samples better than 128 blocks: 2/2 news)" in table
    assert "128 blocks (samples better than 64 blocks: 1/2 news)" in table
    assert "| 64 blocks | | **1.200x** |" in table and "9.000x" not in table


def test_calibration_size_runs_render_as_one_table_per_refit_the_largest_with_the_others_commands(tmp_path, monkeypatch):
    """obs_blocks_128.json and obs_blocks_256.json at one refit: a single section, the 256-block table (which
    holds the 128- and 64-block rows) with the 128-block run's command under it; it says prune's default
    calibration, and claims to be it only where it is."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results
    from headtool.workflows.requests import PRUNE_CALIBRATION_BLOCKS

    def doc(cal: int) -> dict:
        row = {"seed": 0, "fraction": 0.25, "heads_removed": 66, "removed_per_layer": [0, 3], "prune_seconds": 9.0,
               "eval": {"news": {"perplexity": 50.0, "ratio": 1.0 + cal / 1000}}}
        return {"command": f"python benchmarks/bench_obs_allocation.py --cal {cal}", "order": ["news"],
                "domains": {"news": {"label": "news"}}, "rows": [row, {**row, "seed": 1}],
                "settings": {"seeds": [0, 1], "fractions": [0.25], "cal": cal, "anchor_power": 3.0, "damping": 0.001,
                             "calibration": "builtin:pydoc+self"}}
    docs = {cal: doc(cal) for cal in (64, 128, 256)}
    (tmp_path / "obs_allocation_power3_damping.json").write_text(json.dumps(docs[64]))
    for cal in (128, 256):
        (tmp_path / f"obs_blocks_{cal}.json").write_text(json.dumps(docs[cal]))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.obs_blocks_sections([docs[128], docs[256]])
    assert text.count("### More calibration text") == 1 and "(`--max-samples 256`)" in text
    assert "instead of 128 and 64" in text and "| 25% (66) | 1 | 128 | 1.128x |" in text
    assert text.endswith("The 128-block rows: `python benchmarks/bench_obs_allocation.py --cal 128`")
    assert ("From this run `prune --compensate` reads 256 blocks" in text) == (PRUNE_CALIBRATION_BLOCKS == 256)
    assert f"`prune --compensate` reads {PRUNE_CALIBRATION_BLOCKS} blocks" in text


def test_the_larger_evaluation_section_names_both_evaluations_and_sets_the_prunes_side_by_side(tmp_path, monkeypatch):
    """obs_eval_*.json: one section whose table holds the run's ratios with their errors beside the
    16-block run of the same prunes, with the run's command; its prose states both evaluations' sizes."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    def doc(eval_blocks: int, ratio: float) -> dict:
        ev = {"news": {"perplexity": 50.0, "ratio": ratio, "log_ratio_se": 0.02}}
        rows = [{"seed": s, "fraction": 0.5, "heads_removed": 135, "removed_per_layer": [3], "prune_seconds": 9.0,
                 "eval": ev} for s in (0, 1)]
        return {"command": f"python benchmarks/bench_obs_allocation.py --eval {eval_blocks}", "order": ["news"],
                "domains": {"news": {"label": "news"}}, "rows": rows,
                "settings": {"seeds": [0, 1], "fractions": [0.5], "cal": 256, "eval": eval_blocks,
                             "anchor_power": 3.0, "damping": 0.001, "calibration": "builtin:pydoc+self"}}
    (tmp_path / "obs_blocks_256.json").write_text(json.dumps(doc(16, 1.4)))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.obs_eval_section(doc(128, 1.5))
    assert text.startswith("### The same prunes judged on more text (128 evaluation blocks a set)")
    assert "16 blocks of 128 tokens a set (2,048 tokens)" in text and "(16,384 tokens;" in text
    assert "| 50% (135) | 0 | 128 | 1.500x ± 0.030 |\n| | | 16 | 1.400x |" in text
    assert "| 50% | geometric mean of 2 | 16 | **1.400x** |" in text
    assert text.endswith("`python benchmarks/bench_obs_allocation.py --eval 128`")


def test_a_calibration_run_on_other_evaluation_blocks_gets_its_own_table(tmp_path, monkeypatch):
    """obs_blocks runs group by refit and by evaluation, as blocks_rows compares them: a larger calibration judged
    on 128 blocks a set does not take the place of the 16-block table's largest run."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results

    def doc(cal: int, eval_blocks: int) -> dict:
        row = {"seed": 0, "fraction": 0.25, "heads_removed": 66, "removed_per_layer": [0, 3], "prune_seconds": 9.0,
               "eval": {"news": {"perplexity": 50.0, "ratio": 1.0 + cal / 1000}}}
        return {"command": f"python benchmarks/bench_obs_allocation.py --cal {cal} --eval {eval_blocks}",
                "order": ["news"], "domains": {"news": {"label": "news"}}, "rows": [row],
                "settings": {"seeds": [0], "fractions": [0.25], "cal": cal, "eval": eval_blocks, "anchor_power": 3.0,
                             "damping": 0.001, "calibration": "builtin:pydoc+self"}}
    docs = [doc(128, 16), doc(256, 16), doc(512, 128)]
    for d in docs:
        (tmp_path / f"obs_blocks_{d['settings']['cal']}.json").write_text(json.dumps(d))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.obs_blocks_sections(docs)
    assert text.count("### More calibration text") == 2
    assert "(`--max-samples 256`)" in text and "| 25% (66) | 0 | 128 | 1.128x |" in text
    assert "The 128-block rows: `python benchmarks/bench_obs_allocation.py --cal 128 --eval 16`" in text
