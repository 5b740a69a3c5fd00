"""`headtool heal`: distillation lowers the loss, outputs load like their inputs, resume is exact."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from headtool.arch import adapter_for
from headtool.cli.app import app
from headtool.data.sources import DataSpec
from headtool.errors import UsageError
from headtool.model.loading import load_model
from headtool.model.placement import LoadOptions
from headtool.train.healing import (
    HealInterrupted,
    HealOptions,
    distill_terms,
    lr_lambda,
    state_folder,
)
from headtool.train.lowrank import LowRankLinear, add_lowrank, merge_lowrank
from headtool.workflows.heal import HealRequest, run_heal
from tiny_models import (
    checkpoint_tensors,
    logits_of,
    sample_ids,
    save_tiny,
    tiny_model,
    tokenizer_for,
)
from typer.testing import CliRunner

runner = CliRunner()


def heal_checkpoint(student: str, teacher: str, output, *, callback=None, **kw) -> dict:
    return run_heal(HealRequest(student, teacher, output, **kw), callback=callback)


SMALL = ["--seq-len", "16", "--batch-size", "2", "--eval-samples", "4"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    import pydoc_data.topics as t

    p = tmp_path_factory.mktemp("heal_data") / "text.txt"
    p.write_text("\n\n".join(list(t.topics.values())[:30]))
    return p


def damaged(model, seed: int = 0):
    """The same model with head 0 of every layer removed (o_proj columns zeroed) and K perturbed."""
    m = copy.deepcopy(model)
    a = adapter_for(m.config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, geo in enumerate(a.geometry(m.config)):
            w = a.o_proj_module(m, i).weight
            hd = geo.head_dim
            if a.conv1d:
                w[:hd, :] = 0
            else:
                w[:, :hd] = 0
            for name, p in a.attention_module(m, i).named_parameters():
                if p.dim() == 2 and "o_proj" not in name and "c_proj" not in name:
                    p.mul_(0.7).add_(0.1 * torch.randn(p.shape, generator=g))
    return m


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher folder, damaged student folder) of tiny llama."""
    root = tmp_path_factory.mktemp("heal_models")
    teacher = save_tiny("llama", root / "teacher")
    damaged(tiny_model("llama")).save_pretrained(root / "student")
    tokenizer_for("llama").save_pretrained(root / "student")
    return teacher, root / "student"


def _heal(student, teacher, out, text, *extra):
    res = runner.invoke(app, ["heal", str(student), "--teacher", str(teacher), "--data", str(text), *SMALL,
                              "-o", str(out), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# --------------------------------------------------------------------------- learning


def test_heal_lowers_distillation_loss_and_output_loads_like_input(pair, text, tmp_path):
    teacher, student = pair
    doc = _heal(student, teacher, tmp_path / "out", text, "--max-steps", "24", "--lr", "3e-3",
                "--eval-every", "8")
    assert doc["steps"] == 24 and doc["format"] == "headtool.heal/1"
    # lower on average: last quarter of steps vs first quarter, and on held-out data
    assert doc["distill_last_quarter"] < 0.95 * doc["distill_first_quarter"]
    assert doc["after"]["distill"] < 0.95 * doc["before"]["distill"]
    assert [e["step"] for e in doc["evals"]] == [0, 8, 16, 24]
    assert doc["best_step"] == 24 and doc["after"]["step"] == 24
    assert doc["memory"]["model_bytes_total"] > doc["memory"]["teacher_weights_bytes"] > 0

    # loads like the input: same stock config, same tensors, only attention projections changed
    src, out = json.loads((student / "config.json").read_text()), json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in out and out["num_key_value_heads"] == src["num_key_value_heads"]
    lm = load_model(str(tmp_path / "out"), dtype="float32", device="cpu")
    a, b = checkpoint_tensors(student), checkpoint_tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert json.loads((tmp_path / "out" / "headtool.json").read_text())["operation"] == "heal"
    assert not state_folder(tmp_path / "out").exists()  # removed after success

    # the healed model is closer to the teacher than the damaged one, on fresh tokens
    ids = sample_ids("llama", seq=16, seed=5)
    t = logits_of(load_model(str(teacher), dtype="float32", device="cpu").model, ids)
    s = logits_of(load_model(str(student), dtype="float32", device="cpu").model, ids)
    h = logits_of(lm.model, ids)
    assert (h - t).pow(2).mean() < (s - t).pow(2).mean()


@pytest.mark.parametrize("family,mode", [("gpt2", "lora"), ("bert", "attention")])
def test_heal_other_layouts(family, mode, text, tmp_path):
    """Conv1D with low-rank adapters (GPT-2) and a masked LM (BERT: KL over MLM logits)."""
    teacher = save_tiny(family, tmp_path / "t")
    damaged(tiny_model(family)).save_pretrained(tmp_path / "s")
    tokenizer_for(family).save_pretrained(tmp_path / "s")
    doc = _heal(tmp_path / "s", teacher, tmp_path / "o", text, "--max-steps", "16", "--train", mode,
                "--lr", "1e-2" if mode == "lora" else "3e-3")
    assert doc["after"]["distill"] < 0.97 * doc["before"]["distill"]
    assert doc["objective"] == ("mlm" if family == "bert" else "lm")
    a, b = checkpoint_tensors(tmp_path / "s"), checkpoint_tensors(tmp_path / "o")
    assert a.keys() == b.keys()  # low-rank factors merged away


def test_heal_headless_encoder_matches_hidden_states(text, tmp_path):
    tiny_model("bert").bert.save_pretrained(tmp_path / "t")
    damaged(tiny_model("bert").bert).save_pretrained(tmp_path / "s")
    for f in ("t", "s"):
        tokenizer_for("bert").save_pretrained(tmp_path / f)
    doc = _heal(tmp_path / "s", tmp_path / "t", tmp_path / "o", text, "--max-steps", "12", "--lr", "3e-3")
    assert doc["objective"] == "hidden" and doc["distill_kind"] == "hidden"
    assert "perplexity" not in doc["before"]
    assert doc["after"]["distill"] < 0.9 * doc["before"]["distill"]
    assert load_model(str(tmp_path / "o"), device="cpu").task == "base"


def test_heal_really_pruned_non_uniform_student(text, tmp_path):
    """A student with different heads per layer (headtool's own config + modeling file) stays so."""
    from headtool.arch.heads import keep_for_query_heads, prune_layer_tensors
    from headtool.io.output import write_output
    from headtool.model.resize import resize_attention

    teacher = save_tiny("llama", tmp_path / "t")
    lm = load_model(str(teacher), dtype="float32", device="cpu")
    geo = lm.adapter.geometry(lm.model.config)
    for layer, kept in ((0, [2, 3]), (1, [0, 2])):
        keep = keep_for_query_heads(geo[layer], kept)
        tensors = prune_layer_tensors(lm.model.state_dict(), lm.adapter, lm.adapter.layer_prefix(lm.model, layer),
                                      geo[layer], keep)
        resize_attention(lm.model, lm.adapter, layer, keep.geometry(geo[layer]), tensors)
    write_output(tmp_path / "s", model=lm.model, tokenizer=lm.tokenizer, source=lm, meta={"operation": "prune"})
    doc = _heal(tmp_path / "s", teacher, tmp_path / "o", text, "--max-steps", "12", "--lr", "3e-3")
    assert doc["after"]["distill"] < doc["before"]["distill"]
    assert doc["output"]["config_kind"] == json.loads((tmp_path / "s" / "headtool.json").read_text())["config_kind"]
    healed = load_model(str(tmp_path / "o"), dtype="float32", device="cpu")
    assert [g.num_heads for g in healed.geometry] == [2, 2, 4]
    assert json.loads((tmp_path / "o" / "headtool.json").read_text())["healed_from"]["operation"] == "prune"
    ids = sample_ids("llama", seq=12)
    assert torch.isfinite(logits_of(healed.model, ids)).all()


# --------------------------------------------------------------------------- resume


def _spec(text) -> DataSpec:
    return DataSpec(source=str(text), seq_len=16, batch_size=2, seed=3)


@pytest.mark.parametrize("mode", ["attention", "lora"])
def test_interrupt_and_resume_equals_uninterrupted(pair, text, tmp_path, mode):
    teacher, student = pair
    opts = HealOptions(train=mode, max_steps=9, lr=3e-3, save_every=2, eval_every=3, grad_accum=2, seed=3)
    kw = dict(data=_spec(text), opts=opts, eval_samples=4, load=LoadOptions(dtype="float32", device="cpu"))
    full = heal_checkpoint(str(student), str(teacher), tmp_path / "full", **kw)

    def crash(step, record):
        if step == 5:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        heal_checkpoint(str(student), str(teacher), tmp_path / "part", callback=crash, **kw)
    state = state_folder(tmp_path / "part")
    assert json.loads((state / "state.json").read_text())["step"] == 4  # the last save before the crash
    assert not (tmp_path / "part").exists()
    with pytest.raises(UsageError, match="--resume"):  # an unfinished state is never silently discarded
        heal_checkpoint(str(student), str(teacher), tmp_path / "part", **kw)
    resumed = heal_checkpoint(str(student), str(teacher), tmp_path / "part", resume=True, **kw)
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 9
    assert resumed["train_losses"] == pytest.approx(full["train_losses"], rel=1e-5, abs=1e-7)
    assert [e["step"] for e in resumed["evals"]] == [e["step"] for e in full["evals"]]
    a, b = checkpoint_tensors(tmp_path / "full"), checkpoint_tensors(tmp_path / "part")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert not state.exists()


def test_ctrl_c_saves_the_state_of_the_step_and_resumes(pair, text, tmp_path):
    teacher, student = pair
    opts = HealOptions(max_steps=6, lr=3e-3, save_every=100, seed=3)
    kw = dict(data=_spec(text), opts=opts, eval_samples=4, load=LoadOptions(dtype="float32", device="cpu"))

    def ctrl_c(step, record):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(HealInterrupted, match="--resume") as e:
        heal_checkpoint(str(student), str(teacher), tmp_path / "o", callback=ctrl_c, **kw)
    assert e.value.exit_code == 130
    assert json.loads((state_folder(tmp_path / "o") / "state.json").read_text())["step"] == 4
    res = runner.invoke(app, ["heal", str(student), "--teacher", str(teacher), "--data", str(text),
                              "--seq-len", "16", "--batch-size", "2", "--eval-samples", "4", "--seed", "3",
                              "--max-steps", "6", "--lr", "3e-3", "--save-every", "100", "--resume",
                              "-o", str(tmp_path / "o"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["resumed_from"] == 4


def test_resume_checks(pair, text, tmp_path):
    teacher, student = pair
    base = ["heal", str(student), "--teacher", str(teacher), "--data", str(text), *SMALL, "-o", str(tmp_path / "o")]
    res = runner.invoke(app, base + ["--resume"])
    assert res.exit_code == 2 and "no training state" in res.stderr
    opts = HealOptions(max_steps=4, save_every=1, lr=3e-3)

    def crash(step, record):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        heal_checkpoint(str(student), str(teacher), tmp_path / "o", data=DataSpec(str(text), seq_len=16, batch_size=2),
                        opts=opts, eval_samples=4, callback=crash)
    res = runner.invoke(app, base + ["--resume", "--max-steps", "4", "--save-every", "1", "--lr", "1e-3"])
    assert res.exit_code == 2 and "lr: saved 0.003, now 0.001" in res.stderr
    res = runner.invoke(app, base + ["--resume", "--max-steps", "4", "--lr", "3e-3", "--seq-len", "8"])
    assert res.exit_code == 2 and "differs" in res.stderr  # other data
    # the kept weights' rule may not change either (--keep-last saves no best weights to resume from)
    res = runner.invoke(app, base + ["--resume", "--max-steps", "4", "--save-every", "1", "--lr", "3e-3",
                                     "--keep-last"])
    assert res.exit_code == 2 and "keep_best" in res.stderr, res.stderr
    # nor the dtype: the teacher's logits and the written weights are in it (it was accepted silently)
    res = runner.invoke(app, base + ["--resume", "--max-steps", "4", "--save-every", "1", "--lr", "3e-3",
                                     "--dtype", "bfloat16"])
    assert res.exit_code == 2 and "dtype" in res.stderr and "bfloat16" in res.stderr, res.stderr
    res = runner.invoke(app, base + ["--max-steps", "4"])
    assert res.exit_code == 2 and "--resume" in res.stderr and "--overwrite" in res.stderr
    res = runner.invoke(app, base + ["--max-steps", "2", "--overwrite"])  # --overwrite starts over
    assert res.exit_code == 0, res.output


def test_bad_usage(pair, text, tmp_path):
    teacher, student = pair
    base = ["heal", str(student), "--teacher", str(teacher), "--data", str(text), *SMALL]
    for extra, msg in ((["--train", "mlp"], "--train"), (["--temperature", "0"], "--temperature"),
                       (["--kl-weight", "0"], "nothing to train"), (["--bf16", "on"], "CUDA")):
        res = runner.invoke(app, base + ["-o", str(tmp_path / "o"), "--max-steps", "1", *extra])
        assert res.exit_code == 2 and msg in res.stderr, (extra, res.output)
    res = runner.invoke(app, base + ["-o", str(student / "inside")])
    assert res.exit_code == 2 and "inside the input" in res.stderr
    other = save_tiny("bert", tmp_path / "bert")
    res = runner.invoke(app, ["heal", str(student), "--teacher", str(other), "--data", str(text), *SMALL,
                              "-o", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "tokenizer" in res.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def _rank_main(rank: int, port: int, args: tuple, kw: dict, result: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from headtool.distributed import World, finish_world

    try:
        doc = heal_checkpoint(*args, **kw)
        if rank == 0:
            Path(result).write_text(json.dumps(doc))
    finally:
        finish_world(World(rank, 2, rank))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_data_parallel_two_ranks_equal_one_process_with_accumulation(pair, text, tmp_path):
    """DDP (gloo on CPU), the code path torchrun takes: 2 ranks x 1 batch per step follow the run of
    1 process x 2 accumulated batches. Ranks are forked (no re-import); `torchrun -m headtool heal`
    runs the same function (see test_torchrun_cli)."""
    import multiprocessing as mp

    teacher, student = pair
    kw = dict(data=_spec(text), eval_samples=4, load=LoadOptions(dtype="float32", device="cpu"))
    one = heal_checkpoint(str(student), str(teacher), tmp_path / "one",
                          opts=HealOptions(max_steps=4, grad_accum=2, lr=3e-3, seed=3), **kw)
    ctx = mp.get_context("fork")
    port = _free_port()
    args = (str(student), str(teacher), str(tmp_path / "two"))
    kw2 = dict(kw, opts=HealOptions(max_steps=4, grad_accum=1, lr=3e-3, seed=3))
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, kw2, str(tmp_path / "two.json"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["tokens"] == one["tokens"]
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5)
    a, b = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_torchrun_cli(pair, text, tmp_path):
    """`torchrun -m headtool heal` with 2 gloo ranks writes the weights that one process reaches with
    the same batches accumulated 2 per step (fresh processes: the real launcher, the real CLI)."""
    teacher, student = pair
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1"}
    common = ["heal", str(student), "--teacher", str(teacher), "--data", str(text), *SMALL, "--seed", "3",
              "--max-steps", "4", "--lr", "3e-3", "--device", "cpu", "--json"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "headtool"]
    proc = subprocess.run([*launch, *common, "-o", str(tmp_path / "two")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout)  # only rank 0 prints
    assert two["world_size"] == 2 and two["steps"] == 4 and (tmp_path / "two" / "config.json").exists()
    proc = subprocess.run([sys.executable, "-m", "headtool", *common, "--grad-accum", "2", "-o", str(tmp_path / "one")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(proc.stdout)
    assert two["tokens"] == one["tokens"]
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5)
    a, b = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lowrank_merge_is_exact(family):
    model = tiny_model(family)
    a = adapter_for(model.config)
    roots = [a.attention_module(model, i) for i in range(3)]
    names = add_lowrank(model, roots, rank=4, alpha=8, seed=1)
    assert len(names) == 3 * (2 if family == "gpt2" else 4)
    ids = sample_ids(family)
    base = logits_of(model, ids)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LowRankLinear):
                m.lora_b.normal_()
    assert [n for n, p in model.named_parameters() if p.requires_grad] and \
        all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    adapted = logits_of(model, ids)
    assert (adapted - base).abs().max() > 1e-2
    assert merge_lowrank(model) == len(names)
    assert not any(isinstance(m, LowRankLinear) for m in model.modules())
    torch.testing.assert_close(logits_of(model, ids), adapted, rtol=1e-4, atol=1e-4)
    assert set(model.state_dict()) == set(tiny_model(family).state_dict())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lowrank_weight_is_the_effective_weight_and_trains_the_update(family):
    """Modeling code that reads `proj.weight` sees base + update and trains the update through it."""
    m = tiny_model(family)
    a = adapter_for(m.config)
    add_lowrank(m, [a.attention_module(m, 0)], rank=2, alpha=4.0, seed=0)
    wrapped = next(x for x in m.modules() if isinstance(x, LowRankLinear))
    with torch.no_grad():
        wrapped.lora_b.normal_()
    assert torch.allclose(wrapped.weight, wrapped.base.weight + wrapped.delta(), atol=0, rtol=0)
    assert wrapped.bias is wrapped.base.bias
    x = torch.randn(3, wrapped.lora_a.shape[1])
    via_weight = x @ (wrapped.weight if wrapped.conv1d else wrapped.weight.t())
    via_call = wrapped(x) - (0 if wrapped.bias is None else wrapped.bias)
    assert torch.allclose(via_weight, via_call, atol=1e-5)
    via_weight.sum().backward()
    assert wrapped.lora_a.grad is not None and wrapped.lora_b.grad is not None
    assert wrapped.base.weight.grad is None  # the base stays frozen


def test_a_lora_rank_beyond_every_projection_is_refused():
    """--lora-rank 100000 trained (and held in memory) factors of that rank, where B @ A of a projection
    spans nothing past the smaller side of its weight: refused above the largest projection's."""
    from headtool.errors import UsageError

    m = tiny_model("llama")
    a = adapter_for(m.config)
    most = max(min(p.weight.shape) for p in a.attention_module(m, 0).modules() if isinstance(p, torch.nn.Linear))
    with pytest.raises(UsageError, match=f"--lora-rank {most + 1} is more than .*at most {most}"):
        add_lowrank(m, [a.attention_module(m, 0)], rank=most + 1, alpha=4.0, seed=0)
    fresh = tiny_model("llama")
    assert add_lowrank(fresh, [a.attention_module(fresh, 0)], rank=most, alpha=4.0, seed=0)


def test_distill_terms_and_schedule():
    opts = HealOptions(temperature=2.0, lm_weight=0.5)
    logits = torch.randn(2, 5, 11)
    batch = {"input_ids": torch.randint(0, 11, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    same = distill_terms((logits, None), (logits, None), batch, opts, "lm")
    assert abs(float(same["distill"])) < 1e-6
    assert float(same["total"]) == pytest.approx(0.5 * float(same["lm"]))
    t1 = distill_terms((logits, None), (torch.randn(2, 5, 11), None), batch, replace(opts, temperature=1.0), None)
    assert float(t1["distill"]) > 0 and "lm" not in t1
    f = lr_lambda(total=100, warmup=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_hidden_match_every_layer_is_scale_free_and_needs_equal_depth():
    """`--hidden-layers all` averages each layer's error normalized by the teacher's scale there: a
    layer of huge activations weighs no more than a small one, and mismatched depth is a usage error."""
    opts = HealOptions(hidden_weight=2.0, hidden_layers="all", kl_weight=0.0)
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    g = torch.Generator().manual_seed(0)
    t = tuple(torch.randn(2, 5, 8, generator=g) * s for s in (1.0, 1000.0))
    same = distill_terms((torch.zeros(2, 5, 3), t), (torch.zeros(2, 5, 3), t), batch, opts, None)
    assert float(same["hidden"]) == 0.0
    # the same relative error (10%) in either layer gives the same loss, whatever the layer's scale
    off0 = (t[0] * 1.1, t[1])
    off1 = (t[0], t[1] * 1.1)
    e0 = distill_terms((torch.zeros(2, 5, 3), off0), (torch.zeros(2, 5, 3), t), batch, opts, None)
    e1 = distill_terms((torch.zeros(2, 5, 3), off1), (torch.zeros(2, 5, 3), t), batch, opts, None)
    assert float(e0["hidden"]) == pytest.approx(0.01 / 2, rel=1e-4)
    assert float(e1["hidden"]) == pytest.approx(float(e0["hidden"]), rel=1e-4)
    assert float(e0["total"]) == pytest.approx(2.0 * float(e0["hidden"]))
    with pytest.raises(UsageError, match="layers"):
        distill_terms((torch.zeros(2, 5, 3), t[:1]), (torch.zeros(2, 5, 3), t), batch, opts, None)
    with pytest.raises(UsageError, match="hidden-layers"):
        HealOptions(hidden_layers="some").validate()


def test_heal_matching_every_layer_trains_and_records_the_choice(pair, text, tmp_path):
    teacher, student = pair
    doc = _heal(student, teacher, tmp_path / "out", text, "--max-steps", "6", "--lr", "3e-3", "--kl-weight", "0",
                "--hidden-weight", "1", "--hidden-layers", "all")
    assert doc["steps"] == 6 and doc["distill_last_quarter"] is not None
    assert doc["after"]["distill"] < doc["before"]["distill"]  # matching every layer pulls the logits too
    recorded = json.loads((tmp_path / "out" / "headtool.json").read_text())
    assert recorded["options"]["hidden_layers"] == "all" and recorded["options"]["hidden_weight"] == 1.0
    assert "hidden" in recorded["after"]


def test_gradient_checkpointing_is_quiet_and_changes_no_weight(pair, text, tmp_path):
    """--gradient-checkpointing recomputes activations: the same weights as without it, and no
    transformers FutureWarning (with its source path) on stderr about the deprecated method name."""
    import warnings

    teacher, student = pair
    kw = dict(data=_spec(text), eval_samples=4, load=LoadOptions(dtype="float32", device="cpu"))
    heal_checkpoint(str(student), str(teacher), tmp_path / "plain", opts=HealOptions(max_steps=3, lr=3e-3, seed=3), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        heal_checkpoint(str(student), str(teacher), tmp_path / "gc",
                        opts=HealOptions(max_steps=3, lr=3e-3, seed=3, gradient_checkpointing=True), **kw)
    assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
    a, b = checkpoint_tensors(tmp_path / "plain"), checkpoint_tensors(tmp_path / "gc")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_a_bfloat16_student_reports_the_figures_of_the_weights_it_writes(pair, text, tmp_path):
    """A bfloat16 student trains in float32 and is written in bfloat16: the figures after the heal
    (table, JSON, headtool.json, card) are those of the rounded weights on disk, which `headtool eval
    --dtype float32` measures on the same blocks; they were the float32 weights' that nothing holds."""
    from headtool.data.batches import make_batches
    from headtool.measure.evaluation import evaluate

    teacher, student = pair
    bf = tmp_path / "student-bf16"
    m = load_model(str(student), dtype="float32", device="cpu").model
    m.to(torch.bfloat16).save_pretrained(bf)
    tokenizer_for("llama").save_pretrained(bf)
    doc = _heal(bf, teacher, tmp_path / "out", text, "--max-steps", "6", "--lr", "3e-2", "--keep-last")
    assert doc["after"]["weights_dtype"] == "bfloat16" and doc["after_unrounded"]["step"] == 6
    healed = load_model(str(tmp_path / "out"), dtype="float32", device="cpu")
    assert next(load_model(str(tmp_path / "out"), device="cpu").model.parameters()).dtype == torch.bfloat16
    held = make_batches(DataSpec(source=str(text), seq_len=16, batch_size=2, max_samples=4), healed.tokenizer, "lm")
    assert held.info["fingerprint"] == doc["eval_data"]["fingerprint"]
    measured = evaluate(healed.model, held.batches, "lm")
    assert doc["after"]["loss"] == pytest.approx(measured["loss"], rel=1e-6, abs=1e-6)
    assert json.loads((tmp_path / "out" / "headtool.json").read_text())["after"]["loss"] == doc["after"]["loss"]
    before = evaluate(load_model(str(bf), dtype="float32", device="cpu").model, held.batches, "lm")
    assert doc["before"]["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("before_distill,warned", [(0.0, True), (1e9, False)])
def test_rounding_that_leaves_the_kept_weights_worse_than_the_student_is_said(pair, text, monkeypatch,
                                                                                before_distill, warned):
    """Keep-best chooses on the float32 weights; rounded to bfloat16 they can end worse held-out than
    the student as it came, and only the table's arrow said so. A scripted training whose step 0 has
    the given held-out distill: the rounded weights' real figure (> 0) is worse than 0, better than 1e9."""
    import headtool.workflows.heal as heal_mod
    from headtool.data.batches import make_batches
    from headtool.train.healing import HealResult

    teacher, student = pair
    lm = load_model(str(student), dtype="float32", device="cpu")
    lm.model.to(torch.bfloat16)
    held = make_batches(DataSpec(source=str(text), seq_len=16, batch_size=2, max_samples=2), lm.tokenizer, "lm")
    said: list[str] = []
    monkeypatch.setattr(heal_mod, "warn", said.append)
    evals = [{"step": 0, "distill": before_distill, "total": before_distill},
             {"step": 1, "distill": -1.0, "total": -1.0}]
    scripted = HealResult(steps=1, total_steps=1, tokens=0, elapsed_s=0.0, losses=[0.0], distill_losses=[0.0],
                          evals=evals, best_step=1, final_step_weights=True, trainable_params=0, kind="logits")
    teacher_model = load_model(str(teacher), dtype="float32", device="cpu").model
    res = heal_mod.heal_in_float32(lm.model, teacher_model, held.batches, HealOptions(max_steps=1), "lm",
                                   lambda: scripted)
    assert res.extra["after"]["distill"] > 0 and next(lm.model.parameters()).dtype == torch.bfloat16
    assert bool(said) == warned, said
    if warned:
        assert "rounded to bfloat16, the kept weights (step 1) are worse held-out than the student as it came" \
            in said[0], said


def test_held_out_mlm_figures_are_what_eval_measures(text, tmp_path):
    """A masked LM's held-out loss weighed each batch by its tokens, not by its masked positions:
    with a last batch of one block (as many masked positions as a whole batch here), its perplexity
    was not `headtool eval`'s on the same blocks."""
    from headtool.data.batches import make_batches
    from headtool.measure.evaluation import evaluate

    teacher = save_tiny("bert", tmp_path / "t")
    damaged(tiny_model("bert")).save_pretrained(tmp_path / "s")
    tokenizer_for("bert").save_pretrained(tmp_path / "s")
    doc = _heal(tmp_path / "s", teacher, tmp_path / "o", text, "--max-steps", "2", "--eval-samples", "7")
    student = load_model(str(tmp_path / "s"), dtype="float32", device="cpu")
    held = make_batches(DataSpec(source=str(text), seq_len=16, batch_size=2, max_samples=7), student.tokenizer, "mlm")
    assert held.info["fingerprint"] == doc["eval_data"]["fingerprint"]
    masked = [int((b["labels"] != -100).sum()) for b in held.batches]
    assert masked[-1] / 16 != sum(masked[:-1]) / 96  # not in proportion to the tokens
    assert doc["before"]["loss"] == pytest.approx(evaluate(student.model, held.batches, "mlm")["loss"], rel=1e-6)


def test_a_recipe_heal_of_a_bfloat16_model_trains_float32_weights_as_the_command_does(pair, text, tmp_path):
    """A recipe's heal step trained a bfloat16 model in bfloat16, where most AdamW steps (about the
    learning rate) are below a weight's resolution and were lost; `headtool heal` trains float32
    master weights. The step now does too, and ends with the command's weights, in bfloat16."""
    from headtool.workflows.heal import heal_loaded

    teacher, student = pair
    bf = tmp_path / "student-bf16"
    load_model(str(student), dtype="float32", device="cpu").model.to(torch.bfloat16).save_pretrained(bf)
    tokenizer_for("llama").save_pretrained(bf)
    opts = HealOptions(max_steps=6, lr=3e-3, seed=3)
    kw = dict(data=_spec(text), opts=opts, eval_samples=4)
    heal_checkpoint(str(bf), str(teacher), tmp_path / "cli", load=LoadOptions(device="cpu"), **kw)
    lm = load_model(str(bf), device="cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    heal_loaded(lm, load_model(str(teacher), device="cpu"), HealRequest("", "", "", **kw))
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in lm.model.named_buffers() if "inv_freq" in n} == {torch.float32}
    written = checkpoint_tensors(tmp_path / "cli")
    state = lm.model.state_dict()
    assert any(not torch.equal(written[k], checkpoint_tensors(bf)[k]) for k in written)
    for k in written:
        assert torch.equal(state[k], written[k]), k
    # and the same figures after the heal: those of the rounded weights (they were the float32 ones'
    # in the step, which nothing holds, and the rounded ones' in the command)
    cli = json.loads((tmp_path / "cli" / "headtool.json").read_text())
    step = heal_loaded(load_model(str(bf), device="cpu"), load_model(str(teacher), device="cpu"),
                       HealRequest("", "", "", **kw)).to_json()
    assert step["after"] == cli["after"] and step["after"]["weights_dtype"] == "bfloat16"
    assert step["after_unrounded"] == cli["after_unrounded"] != step["after"]


def test_a_recipe_heal_step_on_a_bfloat16_model_reports_the_figures_of_the_weights_it_writes(pair, text, tmp_path):
    """A recipe's heal step on a bfloat16 model reported the held-out figures of its float32 master
    weights, which the written (rounded) model does not hold; `headtool heal` reports the rounded ones'.
    Its row's figures after are now those `headtool eval --dtype float32` measures on the output."""
    from headtool.data.batches import make_batches
    from headtool.measure.evaluation import evaluate

    teacher, _ = pair
    bf = tmp_path / "bf16"
    load_model(str(teacher), dtype="float32", device="cpu").model.to(torch.bfloat16).save_pretrained(bf)
    tokenizer_for("llama").save_pretrained(bf)
    r = tmp_path / "heal.yaml"
    r.write_text(f"model: {bf}\ndtype: bfloat16\ndevice: cpu\nseed: 0\n"
                 f"data: {{source: '{text}', seq_len: 16, batch_size: 2}}\n"
                 "steps:\n  - prune: {heads: '0:0,2;1:1,3'}\n"
                 "  - heal: {max_steps: 6, lr: 0.03, keep_best: false, eval_samples: 4}\n")
    res = runner.invoke(app, ["run", str(r), "-o", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)["steps"][2]
    assert row["best_step"] == 6 and row["best_by"] == "last"  # (keep_best: false)
    healed = load_model(str(tmp_path / "out"), dtype="float32", device="cpu")
    assert next(load_model(str(tmp_path / "out"), device="cpu").model.parameters()).dtype == torch.bfloat16
    held = make_batches(DataSpec(source=str(text), seq_len=16, batch_size=2, max_samples=4), healed.tokenizer, "lm")
    assert row["loss_after"] == pytest.approx(evaluate(healed.model, held.batches, "lm")["loss"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("flag,term,words", [("--hidden-weight", "hidden", "total (1*hidden)"),
                                             ("--lm-weight", "loss", "total (1*LM loss)")])
def test_keep_best_chooses_on_the_objective_trained(pair, text, tmp_path, monkeypatch, flag, term, words):
    """--kl-weight 0 with --hidden-weight 1 (or --lm-weight 1) trained another objective, yet keep-best
    kept the step of the lowest held-out KL, a term that weighed nothing. It chooses on the held-out
    total (the weighted objective) now, and the result and the summary say so."""
    from headtool.train import healing

    real = healing.evaluate_heal
    script = iter([(5.0, 5.0), (4.0, 4.0), (3.0, 1.0), (2.0, 3.0), (1.0, 2.0)])  # (distill, the trained term)

    def scripted(student, teacher, batches, opts, objective, *, bf16=False):
        out = real(student, teacher, batches, opts, objective, bf16=bf16)
        out["distill"], out[term] = next(script)
        out["total"] = opts.kl_weight * out["distill"] + (opts.hidden_weight if term == "hidden" else opts.lm_weight) * out[term]
        return out

    monkeypatch.setattr(healing, "evaluate_heal", scripted)
    teacher, student = pair
    res = runner.invoke(app, ["heal", str(student), "--teacher", str(teacher), "--data", str(text), *SMALL,
                              "-o", str(tmp_path / "o"), "--json", "--max-steps", "4", "--eval-every", "1",
                              "--kl-weight", "0", flag, "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["best_step"] == 2 and doc["after"]["step"] == 2 and doc["best_by"] == "total"
    assert not doc["final_step_weights"]
    assert f"kept the step of the lowest held-out {words}" in " ".join(res.stderr.split())
    assert f"kept the weights of the lowest held-out {words}" in (tmp_path / "o" / "README.md").read_text()


def test_the_held_out_total_is_the_weighted_objective(pair, text, tmp_path):
    """The held-out `total` that keep-best chooses on is the objective as weighed: --kl-weight times
    distill plus --lm-weight times the LM loss (per predicted token, as reported) plus --hidden-weight
    times hidden; the default (KL alone) still chooses on distill."""
    teacher, student = pair
    doc = _heal(student, teacher, tmp_path / "o", text, "--max-steps", "2", "--kl-weight", "0.5",
                "--lm-weight", "2", "--hidden-weight", "3")
    assert doc["best_by"] == "total"
    for e in doc["evals"]:
        assert e["total"] == pytest.approx(0.5 * e["distill"] + 2 * e["loss"] + 3 * e["hidden"], rel=1e-9)
    doc = _heal(student, teacher, tmp_path / "o2", text, "--max-steps", "2", "--keep-last")
    assert doc["best_by"] == "last"
    doc = _heal(student, teacher, tmp_path / "o3", text, "--max-steps", "2")
    assert doc["best_by"] == "distill" and all(e["total"] == e["distill"] for e in doc["evals"])


def test_held_out_blocks_are_recorded_as_evaluated_on_not_fitted(pair, text, tmp_path):
    """The held-out blocks (--eval-data, or the first --eval-samples of --data) were recorded in
    headtool.json's data_read as fitted on: `headtool eval` then skipped them and called a figure on
    --eval-data's text in-domain. They are recorded as evaluated on only; the training blocks stay
    fitted on, and eval still starts after them."""
    import pydoc_data.topics as t
    from headtool.io.provenance import folder_record

    teacher, student = pair
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(list(t.topics.values())[30:50]))
    _heal(student, teacher, tmp_path / "o", text, "--max-steps", "2", "--eval-data", str(other))
    record = [e for e in folder_record(tmp_path / "o") if not e.get("part")]
    assert {(Path(e["source"]).name, e["role"], e["blocks"]) for e in record} == {("text.txt", "fit", 4),
                                                                                  ("other.txt", "eval", 4)}
    res = runner.invoke(app, ["eval", str(tmp_path / "o"), "--data", str(other), "--max-samples", "2",
                              "--seq-len", "16", "--batch-size", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert not doc["data"].get("skip_samples") and doc["results"][0]["in_domain"] is False

    # held out of --data itself: its first 4 blocks are evaluated on, the 4 after them trained on
    _heal(student, teacher, tmp_path / "o2", text, "--max-steps", "2")
    record = [e for e in folder_record(tmp_path / "o2") if not e.get("part")]
    assert {(e["role"], e["blocks"]) for e in record} == {("fit", 8), ("eval", 4)}
    res = runner.invoke(app, ["eval", str(tmp_path / "o2"), "--data", str(text), "--max-samples", "2",
                              "--seq-len", "16", "--batch-size", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["data"]["skip_samples"] == 8
