"""`headtool score` on the command line and the score document: reproducible JSON, -o, --plot,
read_scores validation, bad input -> exit 2 with one line."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.model.loading import load_model
from headtool.measure.scores_doc import FORMAT, read_scores
from tiny_models import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    text = root / "text.txt"
    import pydoc_data.topics as t

    text.write_text("\n\n".join(list(t.topics.values())[:30]))
    return SimpleNamespace(llama=save_tiny("llama", root / "llama"), other=save_tiny("llama", root / "other", seed=5),
                           gpt2=save_tiny("gpt2", root / "gpt2"), text=text, root=root)


def _score(folders, *extra, model=None):
    data = ["--data", str(folders.text), "--seq-len", "16", "--max-samples", "4", "--batch-size", "2"]
    if {"magnitude", "random"} & set(extra):  # they read no data (refused)
        data = []
    args = ["score", str(model or folders.llama), *data, *extra]
    return runner.invoke(app, args)


def _numbers_only(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if '"elapsed_s"' not in line)


def test_score_json_on_stdout_is_complete_and_byte_identical_across_runs(folders):
    a = _score(folders, "--seed", "3")
    assert a.exit_code == 0, a.output
    doc = json.loads(a.stdout)
    for key in ("format", "model", "method", "objective", "normalize", "data", "baseline_loss", "scores",
                "raw_scores", "kv_group_scores", "elapsed_s", "headtool_version"):
        assert key in doc, key
    assert doc["format"] == FORMAT and doc["method"] == "gradient" and doc["objective"] == "lm"
    assert doc["model"]["fingerprint"].startswith("sha256:") and doc["model"]["path"] == str(folders.llama)
    assert doc["model"]["num_kv_heads"] == 2 and doc["data"]["seed"] == 3 and doc["data"]["samples"] == 4
    assert [len(r) for r in doc["scores"]] == [4, 4, 4] and [len(r) for r in doc["kv_group_scores"]] == [2, 2, 2]
    assert "objective: lm (auto" in a.stderr and "layer" in a.stderr  # said which, and the heatmap
    b = _score(folders, "--seed", "3")
    assert _numbers_only(a.stdout) == _numbers_only(b.stdout)
    c = _score(folders, "--seed", "4")
    assert json.loads(c.stdout)["scores"] != doc["scores"]


def test_ablation_to_file_with_plot_and_reading_it_back(folders, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    res = _score(folders, "--method", "ablation", "-o", str(out), "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert res.stdout == "" and out.exists() and not list(tmp_path.glob(".s.json.*"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    lm = load_model(str(folders.llama), dtype="float32", device="cpu")
    doc = read_scores(str(out), lm)
    assert doc["method"] == "ablation" and doc["normalize"] == "none" and doc["scores"] == doc["raw_scores"]
    # the same through a pipe
    import sys as _sys

    old = _sys.stdin
    try:
        _sys.stdin = io.StringIO(out.read_text())
        assert read_scores("-", lm)["scores"] == doc["scores"]
    finally:
        _sys.stdin = old
    other = load_model(str(folders.other), dtype="float32", device="cpu")
    with pytest.raises(UsageError, match="scores were made for another model"):
        read_scores(str(out), other)


def test_iterative_and_baselines_on_the_cli(folders):
    res = _score(folders, "--method", "ablation", "--iterative", "2", "--fraction", "0.25")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert len(doc["removal_order"]) == 3 and len(doc["rounds"]) == 2
    mag = _score(folders, "--method", "magnitude")
    d = json.loads(mag.stdout)
    assert d["objective"] is None and d["data"] is None and d["baseline_loss"] is None
    rnd1 = json.loads(_score(folders, "--method", "random", "--seed", "1").stdout)
    rnd2 = json.loads(_score(folders, "--method", "random", "--seed", "1").stdout)
    assert rnd1["scores"] == rnd2["scores"]


@pytest.mark.parametrize("args,flags", [
    (["--method", "magnitude", "--data", "builtin:licenses", "--max-samples", "4"], "--data, --max-samples"),
    (["--method", "magnitude", "--objective", "kl"], "--objective"),
    (["--method", "random", "--seed", "3", "--seq-len", "16"], "--seq-len"),
])
def test_data_options_with_a_method_that_reads_no_data_are_refused(folders, args, flags):
    """They were ignored (--objective with a note): the document looked calibrated on text it never read."""
    res = runner.invoke(app, ["score", str(folders.llama), *args])
    assert res.exit_code == 2 and res.stdout == "", res.output
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {flags} only appl"), line


def _doc(folders) -> dict:
    return json.loads(_score(folders, "--method", "magnitude").stdout)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(format="headtool.scores/2"), "format"),
    (lambda d: d.update(format="something"), "not a headtool score document"),
    (lambda d: d["scores"].pop(), "has 2 layers"),
    (lambda d: d["scores"][1].append(0.5), "layer 1 has 5 values"),
    (lambda d: d["scores"][0].__setitem__(0, "x"), "not a finite number"),
    (lambda d: d.pop("scores"), "no 'scores'"),
    (lambda d: d.update(removal_order=[[7, 0]]), "removal_order"),
])
def test_read_scores_rejects_bad_documents_in_one_line(folders, tmp_path, mutate, message):
    doc = _doc(folders)
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    fake = SimpleNamespace(geometry=load_model(str(folders.llama)).geometry, fingerprint=doc["model"]["fingerprint"],
                           ref="m")
    with pytest.raises(UsageError, match=message) as e:
        read_scores(str(p), fake)
    assert "\n" not in str(e.value)


def test_read_scores_file_problems(tmp_path, folders):
    with pytest.raises(UsageError, match="not found"):
        read_scores(str(tmp_path / "missing.json"))
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(UsageError, match="is not JSON"):
        read_scores(str(p))
    p.write_text("")
    with pytest.raises(UsageError, match="empty"):
        read_scores(str(p))
    doc = _doc(folders)
    p.write_text(json.dumps(doc).replace(str(doc["scores"][0][0]), "NaN", 1))
    with pytest.raises(UsageError, match="non-finite"):
        read_scores(str(p))
    # without a model: only the document itself is checked (ragged layers are fine)
    doc["scores"] = [[1.0, 2.0], [3.0]]
    doc["raw_scores"] = [[1.0, 2.0], [3.0]]
    p.write_text(json.dumps(doc))
    assert read_scores(str(p))["scores"] == [[1.0, 2.0], [3.0]]


@pytest.mark.parametrize("args,message", [
    (["--method", "nope"], "unknown --method"),
    (["--normalize", "rows"], "--normalize must be one of auto, layer, geometric, none"),
    (["--objective", "mlm"], "needs a masked-lm model"),
    (["--objective", "kl", "--method", "taylor"], "first-order"),
    (["--method", "random", "--iterative", "2"], "--iterative needs a data-driven method"),
    (["--fraction", "0.3"], "go with --iterative"),
    (["--iterative", "2", "--fraction", "1.5"], "--fraction must be a number in (0, 1)"),
    # --fraction was ignored beside --iterative-fraction; rounds past all heads ran and gated off nothing
    (["--iterative", "2", "--fraction", "0.2", "--iterative-fraction", "0.1"], "give one of them"),
    (["--iterative", "5", "--iterative-fraction", "0.5"], "keep their product below 1"),
    # 12 heads, half of them over 100 rounds: 94 rounds re-scored the model and gated off nothing
    (["--iterative", "100"], "gates off 6 of the 12 heads, fewer than one a round: give --iterative 6 or fewer, "
                             "or a higher --fraction"),
    (["--iterative", "10", "--fraction", "0.75"], "gates off 9 of the 12 heads, fewer than one a round: give "
                                                 "--iterative 9 or fewer (one head"),
    (["-o", "/nonexistent/dir/s.json"], "does not exist"),
    (["--plot", "/nonexistent/dir/s.png"], "does not exist"),
])
def test_bad_input_exits_2_with_one_line(folders, args, message):
    res = _score(folders, *args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_the_heatmap_and_the_document_in_one_file_are_refused(folders, tmp_path, monkeypatch):
    """-o same.png --plot ./same.png saved the heatmap, then wrote the document over it, reporting both."""
    monkeypatch.chdir(tmp_path)
    res = _score(folders, "--method", "magnitude", "-o", "same.png", "--plot", str(tmp_path / "same.png"))
    assert res.exit_code == 2 and "are the same file" in res.stderr, res.output
    assert not (tmp_path / "same.png").exists()


def test_missing_matplotlib_is_a_usage_error_naming_pip(monkeypatch):
    from headtool.cli import plotting

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match="pip install matplotlib"):
        plotting._pyplot()


def test_plot_is_written_for_ragged_scores_with_marks(tmp_path):
    from headtool.cli.plotting import plot_heatmap

    p = plot_heatmap([[0.1, 0.5, 0.2], [0.9]], str(tmp_path / "r.png"), title="ragged", marked=[[0, 1]])
    assert Path(p).read_bytes()[:4] == b"\x89PNG"


def test_subprocess_score_to_stdout_parses(folders):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1"}
    out = subprocess.run([sys.executable, "-m", "headtool", "score", str(folders.gpt2), "--data", str(folders.text),
                          "--seq-len", "16", "--max-samples", "2", "--method", "ablation"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"]["family"] == "gpt2" and len(doc["scores"]) == 3
    assert "head scores" in out.stderr


def test_the_heatmap_label_names_the_normalization():
    from headtool.cli.commands.score import _cbar_label

    assert _cbar_label("gradient", "none") == "mean |dL/dg|"
    assert _cbar_label("gradient", "layer") == "mean |dL/dg| / layer L2 norm"
    assert _cbar_label("gradient", "geometric") == "mean |dL/dg| / sqrt(layer L2 norm)"


@pytest.mark.parametrize("command", [["score"], ["prune", "--fraction", "0.25", "-o", "out"]])
def test_taylor_with_kl_is_refused_before_the_model_loads(tmp_path, command):
    """It was refused after loading (a recipe: after the steps before it); the missing model shows it is
    now found first."""
    res = runner.invoke(app, [command[0], str(tmp_path / "no-such-model"), *command[1:], "--method", "taylor",
                              "--objective", "kl", "--data", "builtin:pydoc"])
    assert res.exit_code == 2 and "taylor" in res.stderr and "no-such-model" not in res.stderr, res.output


def test_taylor_with_kl_in_a_recipe_is_a_located_problem(tmp_path):
    recipe = tmp_path / "r.yaml"
    src = save_tiny("llama", tmp_path / "src")
    recipe.write_text(f"model: {src}\nsteps:\n  - score: {{method: taylor, objective: kl}}\n")
    res = runner.invoke(app, ["run", str(recipe), "--check"])
    assert res.exit_code == 2 and "r.yaml:3" in res.stderr and "taylor" in res.stderr, res.output


def test_json_flag_prints_the_document_as_the_other_commands_do(folders, tmp_path):
    """`score --json` was 'No such option' where every other command takes it: it prints the score
    document on stdout (what score does without -o); beside -o FILE it is one line, exit 2."""
    plain, flagged = _score(folders, "--method", "magnitude"), _score(folders, "--method", "magnitude", "--json")
    assert plain.exit_code == 0 and flagged.exit_code == 0, flagged.output
    a, b = json.loads(plain.stdout), json.loads(flagged.stdout)
    assert a["scores"] == b["scores"] and a["format"] == b["format"] == FORMAT
    res = _score(folders, "--method", "magnitude", "--json", "-o", str(tmp_path / "s.json"))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "--json" in lines[0] and "-o" in lines[0], res.output
    assert not (tmp_path / "s.json").exists()
