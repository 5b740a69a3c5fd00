"""`headtool heal` guards: -o never replaces the teacher, non-finite float options exit 2 before
anything is written, and a teacher other than the student's recorded source gets a warning."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()
SMALL = ["--seq-len", "16", "--batch-size", "2", "--eval-samples", "2", "--max-steps", "1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama, a student pruned from it with headtool, an unrelated llama, and some text."""
    root = tmp_path_factory.mktemp("heal_guards")
    text = root / "text.txt"
    import pydoc_data.topics as t

    text.write_text("\n\n".join(list(t.topics.values())[:10]))
    teacher = save_tiny("llama", root / "teacher")
    other = save_tiny("llama", root / "other", seed=7)
    res = runner.invoke(app, ["prune", str(teacher), "--heads", "0:0,1", "-o", str(root / "student")])
    assert res.exit_code == 0, res.output
    return SimpleNamespace(root=root, text=text, teacher=teacher, other=other, student=root / "student")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _heal(m, out, *extra, teacher=None):
    return runner.invoke(app, ["heal", str(m.student), "--teacher", str(teacher or m.teacher), "--data", str(m.text),
                               *SMALL, "-o", str(out), *extra])


def _one_line_error(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "internal error" not in lines[0] and "Traceback" not in res.output
    return lines[0]


# --------------------------------------------------------------------------- -o and the teacher


@pytest.mark.parametrize("where", ["teacher", "inside", "parent"])
def test_output_may_not_be_inside_or_hold_the_teacher(models, where, tmp_path):
    """The teacher is the user's original model: -o on it, inside it or around it is refused."""
    teacher = tmp_path / "models" / "teacher"
    teacher.parent.mkdir()
    teacher.mkdir()
    for name, data in _snapshot(models.teacher).items():
        (teacher / name).write_bytes(data)
    (teacher.parent / "config.json").write_bytes((teacher / "config.json").read_bytes())  # looks like a model
    before = _snapshot(teacher.parent)
    out = {"teacher": teacher, "inside": teacher / "healed", "parent": teacher.parent}[where]
    res = _heal(models, out, "--overwrite", teacher=teacher)
    line = _one_line_error(res)
    assert str(teacher) in line or "input model folder" in line, line
    assert _snapshot(teacher.parent) == before
    assert not Path(f"{out}.heal-state").exists()


# --------------------------------------------------------------------------- float options


@pytest.mark.parametrize("extra", [
    ["--lr", "nan"], ["--lr", "inf"], ["--weight-decay", "nan"], ["--temperature", "nan"],
    ["--temperature", "inf"], ["--kl-weight", "nan"], ["--lm-weight", "nan"], ["--hidden-weight", "nan"],
    ["--max-grad-norm", "nan"], ["--max-grad-norm", "inf"], ["--lora-alpha", "nan", "--train", "lora"],
    ["--self-temperature", "nan"], ["--self-top-p", "inf"], ["--self-top-p", "2"], ["--self-top-p", "0"],
], ids=lambda e: " ".join(e))
def test_non_finite_float_options_exit_2_up_front(models, extra, tmp_path):
    """Every float option of heal is checked before any model loads: one line naming it, nothing written
    (--self-top-p 2 was refused only once the models had loaded, as 'self-calibration top_p')."""
    res = _heal(models, tmp_path / "out", *extra)
    line = _one_line_error(res)
    assert extra[0] in line, line
    assert list(tmp_path.iterdir()) == []  # neither OUT nor OUT.heal-state/


@pytest.mark.parametrize("flag,args", [
    ("--damping", ["prune", "{m}", "--heads", "0:0,1", "--damping", "inf", "-o", "{o}"]),
    ("--damping", ["convert-gqa", "{m}", "--kv-heads", "1", "--damping", "inf", "-o", "{o}"]),
    ("--key-weight", ["convert-mla", "{m}", "--kv-rank", "8", "--key-weight", "inf", "-o", "{o}"]),
    ("--self-temperature", ["eval", "{m}", "--self-temperature", "nan"]),
    ("--self-top-p", ["score", "{m}", "--method", "magnitude", "--self-top-p", "nan"]),
], ids=lambda a: a if isinstance(a, str) else a[0])
def test_other_commands_reject_non_finite_floats(models, flag, args, tmp_path):
    """The same declared check covers every command's float options (and the data options)."""
    res = runner.invoke(app, [a.format(m=models.teacher, o=tmp_path / "out") for a in args])
    assert flag in _one_line_error(res)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- teacher identity


def test_teacher_other_than_the_recorded_source_is_warned_and_recorded(models, tmp_path):
    """A different teacher can be deliberate (a larger model): heal warns once and records it."""
    res = _heal(models, tmp_path / "o1", teacher=models.other)
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if "warning" in ln and "teacher" in ln]
    assert len(warnings) == 1, res.stderr  # (its one step may also leave the student unchanged: another warning)
    meta = json.loads((tmp_path / "o1" / "headtool.json").read_text())
    assert meta["teacher"]["matches_student_source"] is False

    res = _heal(models, tmp_path / "o2")  # the model it was pruned from: no word
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr, res.stderr
    meta = json.loads((tmp_path / "o2" / "headtool.json").read_text())
    assert meta["teacher"]["matches_student_source"] is True

    # healing the healed model again towards the same original: still its source, no warning
    res = runner.invoke(app, ["heal", str(tmp_path / "o2"), "--teacher", str(models.teacher), "--data",
                              str(models.text), *SMALL, "-o", str(tmp_path / "o3")])
    assert res.exit_code == 0 and "warning" not in res.stderr, res.output


def test_a_chain_typed_with_relative_paths_is_followed_from_any_folder(models, tmp_path, monkeypatch):
    """headtool.json records the folder a relative MODEL resolved to as an absolute path: a prune ->
    convert-gqa chain typed as `student`, `merged` stays traceable to its teacher from another folder
    (the recorded `student` named nothing there, so the original teacher was warned as a stranger)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["prune", str(models.teacher), "--heads", "0:0,1", "-o", "student"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["convert-gqa", "student", "--kv-heads", "1", "--merge", "mean", "-o", "merged"])
    assert res.exit_code == 0, res.output
    source = json.loads((work / "merged" / "headtool.json").read_text())["source"]
    assert (source["ref"], source["path"]) == ("student", str(work / "student"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = runner.invoke(app, ["heal", str(work / "merged"), "--teacher", str(models.teacher), "--data",
                              str(models.text), *SMALL, "-o", str(tmp_path / "healed")])
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr, res.stderr


# --------------------------------------------------------------------------- held-out data


def test_eval_data_that_is_the_training_source_is_held_out_from_training(models, tmp_path):
    """`--eval-data` naming --data itself evaluated (and chose the kept weights) on the very blocks
    training read: its blocks start after them, as for a source of a mixture; uncapped, it is refused."""
    res = runner.invoke(app, ["heal", str(models.student), "--teacher", str(models.teacher), "--data",
                              str(models.text), "--eval-data", str(models.text), *SMALL, "-o", str(tmp_path / "o"),
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    train, held = doc["data"], doc["eval_data"]
    assert held["source"] == train["source"] and train["skip_samples"] == 0
    assert held["skip_samples"] == train["samples"] == 2  # 1 step of 2 blocks, then the 2 held-out blocks
    res = runner.invoke(app, ["heal", str(models.student), "--teacher", str(models.teacher), "--data",
                              str(models.text), "--eval-data", str(models.text), *SMALL[:-2], "-o", str(tmp_path / "o2")])
    line = _one_line_error(res)
    assert "same source" in line and "--max-steps" in line, line
    assert not (tmp_path / "o2").exists()


def test_a_recipe_eval_block_of_the_training_source_is_held_out_from_training():
    """The recipe's form (a data block: the recipe's source unless it names one) is cut the same way."""
    from headtool.data.sources import DataSpec
    from headtool.distributed import World
    from headtool.train.options import HealOptions
    from headtool.workflows.heal import _data_specs

    data = DataSpec(source="notes.txt", seq_len=16, batch_size=2)
    train, held = _data_specs(data, DataSpec(source="notes.txt", seq_len=16), 4, HealOptions(max_steps=3), World())
    assert (train.skip_samples, train.max_samples) == (0, 6)
    assert (held.skip_samples, held.max_samples) == (6, 4)


# --------------------------------------------------------------------------- student and teacher


def test_a_student_that_is_the_teacher_is_refused(models, tmp_path):
    """heal MODEL --teacher MODEL (a slip for the original) trained from a zero loss, on noise that
    AdamW scales to full steps, then wrote a copy: refused, unless --lm-weight gives it something to
    learn (distillation towards itself is then a regularizer)."""
    res = runner.invoke(app, ["heal", str(models.teacher), "--teacher", str(models.teacher), "--data",
                              str(models.text), *SMALL, "-o", str(tmp_path / "o")])
    line = _one_line_error(res)
    assert "same model" in line, line
    assert list(tmp_path.iterdir()) == []
    res = runner.invoke(app, ["heal", str(models.teacher), "--teacher", str(models.teacher), "--data",
                              str(models.text), *SMALL, "--lm-weight", "1", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output


def test_a_heal_that_keeps_the_student_unchanged_says_so(models, tmp_path):
    """When no evaluation beats step 0, --keep-best writes the student's own weights: the table's
    'after (step 0)' was the only hint that the output is an unchanged copy."""
    res = _heal(models, tmp_path / "o", "--lr", "0.5", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["best_step"] == 0 and doc["after"] == doc["before"]
    assert res.stderr.count("warning") == 1 and "unchanged" in " ".join(res.stderr.split()), res.stderr
    res = _heal(models, tmp_path / "o2", "--lr", "0.5", "--keep-last")
    assert res.exit_code == 0 and "warning" not in res.stderr, res.output


def test_text_too_short_for_the_held_out_blocks_names_eval_samples(models, tmp_path):
    """A file of fewer blocks than --eval-samples (16 by default) was refused as '--skip-samples 16
    leaves no data ... lower --skip-samples', an option the user never gave: the line names the
    held-out blocks and what to change."""
    short = tmp_path / "short.txt"
    short.write_text(models.text.read_text()[:200])
    res = runner.invoke(app, ["heal", str(models.student), "--teacher", str(models.teacher), "--data", str(short),
                              "--seq-len", "16", "-o", str(tmp_path / "o")])
    line = _one_line_error(res)
    assert "--eval-samples" in line and "--skip-samples" not in line, line
    assert not (tmp_path / "o").exists()
    # self:N with N below --eval-samples: the same (the text runs out within the held-out blocks)
    res = runner.invoke(app, ["heal", str(models.student), "--teacher", str(models.teacher), "--data", "self:4",
                              "--seq-len", "16", "--eval-samples", "6", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--eval-samples" in res.stderr and "--skip-samples" not in res.stderr, res.output


def test_held_out_blocks_that_take_the_whole_text_are_refused_like_too_few(models, tmp_path):
    """--eval-samples equal to the blocks the text gives is not 'short', but the held-out blocks read
    all of it: the same line as too short (training would start past the end)."""
    short = tmp_path / "short.txt"
    short.write_text(models.text.read_text()[:200])
    args = ["heal", str(models.student), "--teacher", str(models.teacher), "--data", str(short), "--seq-len", "16",
            "-o", str(tmp_path / "o")]
    line = _one_line_error(runner.invoke(app, args))
    blocks = int(line.split(" gives ")[1].split()[0])
    line = _one_line_error(runner.invoke(app, args + ["--eval-samples", str(blocks)]))
    assert f"gives {blocks} blocks" in line and "--eval-samples" in line and "--skip-samples" not in line, line
    res = runner.invoke(app, args + ["--eval-samples", str(blocks - 1), "--max-steps", "1", "--batch-size", "1"])
    assert res.exit_code == 0, res.output


def test_overwrite_never_deletes_a_folder_of_the_user_named_like_the_training_state(models, tmp_path):
    """--overwrite discards an unfinished training state, OUT.heal-state/: a folder of the user's that
    bears that name (here a model) was deleted with it, whatever it held."""
    keep = tmp_path / "o.heal-state"
    keep.mkdir()
    for name, data in _snapshot(models.teacher).items():
        (keep / name).write_bytes(data)
    before = _snapshot(keep)
    res = _heal(models, tmp_path / "o", "--overwrite")
    line = _one_line_error(res)
    assert str(keep) in line, line
    assert _snapshot(keep) == before and not (tmp_path / "o").exists()
    # a real (unfinished) state is still discarded by --overwrite
    res = _heal(models, tmp_path / "o2", "--keep-state")
    assert res.exit_code == 0, res.output
    (tmp_path / "o2.heal-state").rename(tmp_path / "o3.heal-state")
    # without --overwrite the kept state of a finished run is refused, and not called unfinished
    line = _one_line_error(_heal(models, tmp_path / "o3"))
    assert "kept by --keep-state" in line and "--resume" in line, line
    res = _heal(models, tmp_path / "o3", "--overwrite")
    assert res.exit_code == 0 and not (tmp_path / "o3.heal-state").exists(), res.output


def test_options_heal_would_ignore_are_refused(models, tmp_path):
    """--lm-weight on a student without a language-model head (a headless encoder), --hidden-weight and
    --temperature on a headless one (its distillation is the hidden-state match already, no softmax)
    and --label-column (heal reads no labels) were accepted and did nothing."""
    from tiny_models import tiny_model, tokenizer_for

    for seed, name in ((0, "t"), (1, "s")):
        tiny_model("bert", seed=seed).bert.save_pretrained(tmp_path / name)
        tokenizer_for("bert").save_pretrained(tmp_path / name)
    res = runner.invoke(app, ["heal", str(tmp_path / "s"), "--teacher", str(tmp_path / "t"), "--data",
                              str(models.text), *SMALL, "--lm-weight", "1", "-o", str(tmp_path / "o")])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]  # (beside warnings of a pooler)
    assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert "--lm-weight" in errors[0] and "head" in " ".join(res.stderr.split()), res.stderr
    res = runner.invoke(app, ["heal", str(tmp_path / "s"), "--teacher", str(tmp_path / "t"), "--data",
                              str(models.text), *SMALL, "--hidden-weight", "1", "--hidden-layers", "all",
                              "-o", str(tmp_path / "o")])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert res.exit_code == 2 and len(errors) == 1 and "--hidden-weight" in errors[0], res.output
    res = runner.invoke(app, ["heal", str(tmp_path / "s"), "--teacher", str(tmp_path / "t"), "--data",
                              str(models.text), *SMALL, "--temperature", "2", "-o", str(tmp_path / "o")])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert res.exit_code == 2 and len(errors) == 1 and "--temperature" in errors[0], res.output
    res = _heal(models, tmp_path / "o", "--label-column", "label")
    line = _one_line_error(res)
    assert "--label-column" in line, line
    assert not (tmp_path / "o").exists()


def test_a_lora_rank_past_the_projections_is_one_line(models, tmp_path):
    """heal --train lora --lora-rank 100000 ran (about 1 GiB of factors on a tiny model) where no
    update of a projection can use a rank past its smaller side."""
    line = _one_line_error(_heal(models, tmp_path / "o", "--train", "lora", "--lora-rank", "100000"))
    assert "--lora-rank 100000" in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra,names", [
    (["--kl-weight", "0", "--lm-weight", "1", "--temperature", "2"], ["--temperature 2", "--kl-weight 0"]),
    (["--hidden-layers", "all"], ["--hidden-layers all", "--hidden-weight"]),
    (["--lora-rank", "4"], ["--lora-rank 4", "--train lora"]),
    (["--lora-alpha", "32", "--lora-rank", "2", "--train", "all"], ["--lora-rank 2 and --lora-alpha 32", "--train lora"]),
], ids=["temperature", "hidden-layers", "lora-rank", "lora-rank-and-alpha"])
def test_options_the_run_would_ignore_are_refused_up_front(models, extra, names, tmp_path):
    """--temperature with --kl-weight 0 (no KL term to soften), --hidden-layers all without
    --hidden-weight (no hidden states matched), --lora-rank / --lora-alpha without --train lora: each
    trained as if it had not been given, without a word. Refused before any model loads now."""
    line = _one_line_error(_heal(models, tmp_path / "out", *extra))
    assert all(n in line for n in names), line
    assert list(tmp_path.iterdir()) == []


def test_a_recipe_heal_step_with_an_option_it_would_ignore_is_refused(models, tmp_path):
    """The same check in a recipe (its request validation): before the model loads."""
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {models.student}\ndata: {{source: '{models.text}', seq_len: 16}}\n"
                 "steps:\n  - prune: {heads: '0:0'}\n  - heal: {max_steps: 1, lora_rank: 4}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--lora-rank 4" in res.output and "--train lora" in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_warmup_as_long_as_the_run_is_said(models, tmp_path):
    """--warmup-steps at or above the run's steps was taken without a word: the learning rate rose for
    the whole run and never reached --lr (nor decayed)."""
    res = _heal(models, tmp_path / "o", "--warmup-steps", "5")  # SMALL: --max-steps 1
    assert res.exit_code == 0, res.output
    line = " ".join(res.stderr.split())
    assert "warning: --warmup-steps 5 is not below the run's 1 step:" in line and "0.2 of --lr" in line, line
    res = _heal(models, tmp_path / "o2", "--warmup-steps", "0")
    assert res.exit_code == 0 and "--warmup-steps" not in res.stderr, res.output
