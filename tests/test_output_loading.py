"""Loading a MODEL and writing an output folder as a demanding user meets them: what the folder carries
from its input, how a failed write is told, and how a remote-code output survives transformers' own
save/reload cycle (an audit found each of these broken)."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from headtool.cli.app import app
from tiny_models import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def model_with_named_templates(tmp_path_factory) -> Path:
    """A tiny llama whose tokenizer has a default and a named ('tool_use') chat template."""
    from transformers import AutoTokenizer

    folder = save_tiny("llama", tmp_path_factory.mktemp("chat") / "m")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = {"default": "D {{ messages[0].content }}", "tool_use": "T {{ messages[0].content }}"}
    tok.save_pretrained(folder)
    assert (folder / "additional_chat_templates" / "tool_use.jinja").is_file()
    return folder


@pytest.mark.parametrize("streaming", [False, True])
def test_named_chat_templates_are_copied_to_the_output(model_with_named_templates, tmp_path, streaming):
    """transformers keeps a tokenizer's named chat templates (tool_use, rag, ...) in
    additional_chat_templates/; only the default one was copied, so the pruned model's tokenizer
    had lost its tool-use template."""
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    r = runner.invoke(app, ["prune", str(model_with_named_templates), "--heads", "1:0", "--unit", "head",
                            "-o", str(out), *(["--streaming"] if streaming else [])])
    assert r.exit_code == 0, r.output
    assert AutoTokenizer.from_pretrained(out).chat_template == \
        AutoTokenizer.from_pretrained(model_with_named_templates).chat_template


def test_a_disk_full_while_writing_the_weights_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """safetensors reports a full disk as SafetensorError ('... No space left on device (os error 28)'):
    the CLI told it as 'internal error: SafetensorError ... please report it' (a bug of headtool's, to a
    user whose disk was full), where the same failure under --streaming said 'no space left on device'."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    model = save_tiny("llama", tmp_path / "m")

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", full)
    out = tmp_path / "outs" / "out"
    r = runner.invoke(app, ["prune", str(model), "--heads", "1:0", "--unit", "head", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "no space left on device" in r.stderr and "internal error" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list((tmp_path / "outs").iterdir()) == []


@pytest.mark.parametrize("command", [["prune", "--heads", "1:0", "--unit", "head"],
                                     ["convert-mla", "--kv-rank", "6", "--rope-dim", "4", "--no-refit",
                                      "--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16"]])
def test_a_remote_code_output_reloaded_and_saved_again_reloads(tmp_path, command):
    """A remote-code folder loaded with trust_remote_code=True and saved again (after fine-tuning, before
    pushing) got auto_map 'modeling_headtool.LlamaForCausalLM': transformers names the class it saves,
    whose name is the family's, and the modeling file exported it only as HeadtoolLlamaForCausalLM, so
    the saved copy failed to load ('has no attribute LlamaForCausalLM')."""
    import torch
    from transformers import AutoModelForCausalLM

    src = save_tiny("llama", tmp_path / "src")
    out = tmp_path / "out"
    r = runner.invoke(app, [command[0], str(src), *command[1:], "-o", str(out)])
    assert r.exit_code == 0, r.output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("args", [["info"], ["prune", "--heads", "0:0", "--streaming", "-o", "never"]])
def test_a_mistyped_packaged_name_is_pointed_at_the_packaged_model(args):
    """'smollm2-13m' (or 'SmolLM2-135M') was taken for a hub id and answered 'the hub is offline; download
    it first or give a local path': advice for a model that does not exist, the typo never named."""
    for typo, meant in (("smollm2-13m", "smollm2-135m"), ("SmolLM2-135M", "smollm2-135m"),
                        ("all-minilm-l6", "all-minilm-l6-v2")):
        r = runner.invoke(app, [args[0], typo, *args[1:]])
        assert r.exit_code == 2, r.output
        assert f"did you mean the packaged model {meant}?" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = runner.invoke(app, [args[0], "gpt2-xl", *args[1:]])  # a hub id like any other: no guess
    assert r.exit_code == 2 and "did you mean" not in r.stderr, r.output
    assert not Path("never").exists()


def test_the_card_of_a_remote_code_folder_says_what_happens_without_trust_remote_code(tmp_path):
    """Loaded without trust_remote_code=True, such a folder builds the family's stock class, and
    transformers stops on a size mismatch whose report points at ignore_mismatched_sizes, which loads
    a model with random attention; the card (and the docs, which claimed transformers refuses the code)
    did not say so."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    r = runner.invoke(app, ["prune", str(save_tiny("llama", tmp_path / "src")), "--heads", "1:0", "--unit", "head",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    with pytest.raises(RuntimeError, match="mismatch"):
        AutoModelForCausalLM.from_pretrained(out)
    card = " ".join((out / "README.md").read_text().split())
    assert "stops on a size mismatch" in card and "never pass `ignore_mismatched_sizes=True`" in card
