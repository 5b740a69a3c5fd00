"""Nothing the user owns is modified by a file output: score -o / --plot, inspect --plot and the demo's
folder never write into an input model or over an input file, write through symlinks and devices instead
of replacing them, and check what they can before the work (an audit found each of these broken)."""
from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from headtool.errors import UsageError
from headtool.io.files import check_output_path, write_text
from tiny_models import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    import pydoc_data.topics as t

    (root / "text.txt").write_text("\n\n".join(list(t.topics.values())[:20]))
    save_tiny("llama", root / "m")
    return root


def _data(root: Path) -> list[str]:
    return ["--data", str(root / "text.txt"), "--seq-len", "16", "--max-samples", "2", "--batch-size", "2"]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_score_never_writes_into_the_model_or_over_its_data(folder):
    before, text = _tree(folder / "m"), (folder / "text.txt").read_bytes()
    for out, needle in ((folder / "m" / "config.json", "inside the input model folder"),
                        (folder / "text.txt", "is an input of this command")):
        r = runner.invoke(app, ["score", str(folder / "m"), *_data(folder), "-o", str(out)])
        assert r.exit_code == 2 and needle in r.stderr, r.stderr
    r = runner.invoke(app, ["score", str(folder / "m"), *_data(folder), "-o", str(folder / "s.json"),
                            "--plot", str(folder / "m" / "heat.png")])
    assert r.exit_code == 2 and "inside the input model folder" in r.stderr
    assert _tree(folder / "m") == before and (folder / "text.txt").read_bytes() == text


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_scoring(folder):
    pytest.importorskip("matplotlib")
    out = folder / "fmt.json"
    r = runner.invoke(app, ["score", str(folder / "m"), *_data(folder), "-o", str(out), "--plot",
                            str(folder / "heat.xyz")])
    assert r.exit_code == 2 and "picture suffix" in r.stderr and "heat.png" in r.stderr
    assert not out.exists() and "baseline loss" not in r.stderr  # refused before the scoring pass


def test_score_writes_through_a_symlink_and_keeps_the_files_mode(folder):
    target, link = folder / "target.json", folder / "link.json"
    target.write_text("{}")
    os.chmod(target, 0o640)
    link.symlink_to(target.name)
    r = runner.invoke(app, ["score", str(folder / "m"), *_data(folder), "-o", str(link)])
    assert r.exit_code == 0, r.stderr
    assert link.is_symlink() and json.loads(target.read_text())["format"].startswith("headtool.scores")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_pipe_is_written_into_not_replaced(tmp_path):
    """-o /dev/stdout or a FIFO: a rename over it replaced the device node (as root, /dev/null too)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_text(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == ["through the pipe\n"] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_new_file_gets_the_umask_mode_not_a_private_one(tmp_path):
    mask = os.umask(0o022)
    try:
        write_text(tmp_path / "new.json", "{}")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644


def test_output_paths_under_a_file_or_in_a_missing_folder_are_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="is not a folder"):
        check_output_path(tmp_path / "afile" / "x.json", "-o")
    with pytest.raises(UsageError, match="does not exist"):
        check_output_path(tmp_path / "nope" / "x.json", "-o")
    with pytest.raises(UsageError, match="is a folder"):
        check_output_path(tmp_path, "-o")


def test_inspect_plots_never_go_into_the_model_and_an_empty_text_is_refused_first(folder):
    pytest.importorskip("matplotlib")
    before = _tree(folder / "m")
    r = runner.invoke(app, ["inspect", str(folder / "m"), *_data(folder), "--plot", str(folder / "m")])
    assert r.exit_code == 2 and "inside the input model folder" in r.stderr
    plots = folder / "plots"
    r = runner.invoke(app, ["inspect", str(folder / "m"), *_data(folder), "--plot", str(plots), "--heads", "0:0",
                            "--text", " "])
    assert r.exit_code == 2 and "--text is empty" in r.stderr
    assert not plots.exists() and "entropy" not in r.stderr  # before the work, and no half folder
    assert _tree(folder / "m") == before


def test_the_demo_replaces_only_an_earlier_demos_outputs(tmp_path):
    from headtool.cli.commands.demo import check_demo_folder

    check_demo_folder(tmp_path / "new", True)  # nothing there yet
    earlier = tmp_path / "earlier"
    (earlier / "model").mkdir(parents=True)
    (earlier / "model" / "headtool.json").write_text(json.dumps({"recipe": {"name": "demo"}}))
    (earlier / "scores.json").write_text(json.dumps({"format": "headtool.scores/1"}))
    check_demo_folder(earlier, True)
    with pytest.raises(UsageError, match="leave out --no-overwrite"):
        check_demo_folder(earlier, False)
    (earlier / "MYNOTES.txt").write_text("mine")
    with pytest.raises(UsageError, match="MYNOTES.txt"):
        check_demo_folder(earlier, True)
    mine = tmp_path / "mine"
    save_tiny("llama", mine / "model")  # someone's model where the demo would put its own
    with pytest.raises(UsageError, match="not a demo's model"):
        check_demo_folder(mine, True)
    (tmp_path / "scores_only").mkdir()
    (tmp_path / "scores_only" / "scores.json").write_text('{"my": 1}')
    with pytest.raises(UsageError, match="not a score document"):
        check_demo_folder(tmp_path / "scores_only", True)
    r = runner.invoke(app, ["demo", "-o", str(mine)])  # the command refuses it before loading anything
    assert r.exit_code == 2 and "no earlier demo wrote" in r.stderr
    assert (mine / "model" / "config.json").exists()


def test_labels_need_a_classification_model(tmp_path):
    """--label-column on a causal LM made the objective 'classification' and crashed on the LM's token
    logits (internal error: 'Expected target size [4, 400], got [4]'); a sequence-classification model
    scores with it, and a column that is not there is named."""
    from transformers import AutoModelForSequenceClassification

    from tiny_models import tiny_config, tokenizer_for

    rows = "\n".join(f"sentence number {i} is here and long enough,{i % 2}" for i in range(40))
    data = tmp_path / "lab.csv"
    data.write_text("text,label\n" + rows + "\n")
    causal = save_tiny("llama", tmp_path / "causal")
    args = ["--data", str(data), "--label-column", "label", "--seq-len", "16", "--max-samples", "4"]
    for cmd in (["score", str(causal)], ["eval", str(causal)]):
        r = runner.invoke(app, [*cmd, *args])
        assert r.exit_code == 2 and "classification model" in r.stderr and "internal" not in r.stderr, r.stderr
    classifier = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_config(tiny_config("bert", num_labels=2)).save_pretrained(classifier)
    tokenizer_for("bert").save_pretrained(classifier)
    r = runner.invoke(app, ["score", str(classifier), *args])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["objective"] == "classification"
    r = runner.invoke(app, ["score", str(classifier), *args[:2], "--label-column", "zz", *args[4:]])
    assert r.exit_code == 2 and "zz" in r.stderr


def test_a_score_document_where_nothing_can_be_written_is_refused_before_scoring(folder):
    """As root os.access passes on /proc; the write failed after the scoring pass."""
    r = runner.invoke(app, ["score", str(folder / "m"), *_data(folder), "-o", "/proc/headtool-scores.json"])
    assert r.exit_code == 2 and "cannot write into /proc" in r.stderr and "baseline loss" not in r.stderr


@pytest.mark.parametrize("streaming", [False, True])
def test_an_output_folder_has_the_modes_the_umask_gives(folder, tmp_path, streaming):
    """Written into a private temporary folder and renamed into place, a model folder stayed 0700 and
    its weights 0600: another user of the machine could not load the checkpoint."""
    out = tmp_path / "pruned"
    mask = os.umask(0o022)
    try:
        r = runner.invoke(app, ["prune", str(folder / "m"), "--heads", "1:0", "--unit", "head", "-o", str(out),
                                *(["--streaming"] if streaming else [])])
    finally:
        os.umask(mask)
    assert r.exit_code == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_bracketed_text_in_option_help_is_shown_not_read_as_markup():
    """heal's own defaults ('[default: 2e-4; 1e-3 for lora]', ...) were eaten as rich markup."""
    r = runner.invoke(app, ["heal", "--help"], env={"COLUMNS": "220"})
    text = " ".join(r.stdout.split())
    for shown in ("[default: 2e-4; 1e-3 for lora]", "[default: 5% of the steps]", "[default: 10 times a run]"):
        assert shown in text, shown
    for command in ("score", "prune", "convert-gqa", "convert-mla", "eval", "inspect", "heal", "run"):
        assert "\\[" not in runner.invoke(app, [command, "--help"], env={"COLUMNS": "220"}).stdout, command


@pytest.fixture
def gguf_in_a_model_folder(tmp_path, monkeypatch):
    """A .gguf file inside the user's model folder (where llama.cpp's converter writes it by default),
    read as a tiny llama: transformers' GGUF loading stands in for the real file (the cache is the test's)."""
    import transformers

    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    tiny = save_tiny("llama", tmp_path / "tiny")
    owner = save_tiny("llama", tmp_path / "owner")
    (owner / "owner-F16.gguf").write_bytes(b"GGUF stands in for weights")
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        load = cls.from_pretrained

        def from_pretrained(folder, *args, gguf_file=None, _load=load, **kwargs):
            return _load(tiny if gguf_file else folder, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)
    return owner


@pytest.mark.parametrize("command", [["prune", "--heads", "0:0,1"], ["prune", "--heads", "0:0,1", "--streaming"],
                                     ["convert-gqa", "--kv-heads", "1", "--merge", "mean"]])
def test_an_output_never_replaces_the_folder_that_holds_an_input_gguf(gguf_in_a_model_folder, command):
    """-o over the folder that holds the .gguf MODEL (with --overwrite) is refused: replacing it would
    delete the input, whose converted copy in the cache was all the check protected."""
    owner = gguf_in_a_model_folder
    before = _tree(owner)
    r = runner.invoke(app, [command[0], str(owner / "owner-F16.gguf"), *command[1:], "-o", str(owner),
                            "--overwrite"])
    assert r.exit_code == 2 and "would delete the input" in r.stderr, r.output
    assert _tree(owner) == before


def test_a_gguf_is_converted_without_tqdm_bars_and_says_so_once(gguf_in_a_model_folder):
    """The first use of a .gguf converts it into the cache: one line says so, and transformers' progress
    bars (dequantizing, loading, writing shards) stay off stderr, as for every other load and write."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as in a fresh process (an earlier load in this one turned them off)
    gguf = str(gguf_in_a_model_folder / "owner-F16.gguf")
    first = runner.invoke(app, ["info", gguf, "--json"])
    assert first.exit_code == 0, first.output
    assert "it/s" not in first.stderr and "%|" not in first.stderr, first.stderr
    assert "converting" in first.stderr and "once" in first.stderr, first.stderr
    again = runner.invoke(app, ["info", gguf, "--json"])
    assert again.exit_code == 0 and "converting" not in again.stderr, again.output
    assert json.loads(again.stdout)["path"] == json.loads(first.stdout)["path"]


def test_the_card_names_kept_heads_only_where_the_operation_chose_heads():
    """The card closed with 'headtool.json records ... the query heads kept in every layer' for every
    operation: a heal or convert-mla record has no kept_heads."""
    from headtool.io.output import STANDARD, model_card

    pruned = model_card({"operation": "prune", "kept_heads": [[0, 2]]}, STANDARD, "", "AutoModelForCausalLM")
    healed = model_card({"operation": "heal"}, STANDARD, "", "AutoModelForCausalLM")
    assert "query heads kept in every layer (`kept_heads`" in pruned
    assert "kept" not in healed.split("`headtool.json` records")[1]
