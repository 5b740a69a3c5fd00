"""`headtool heal`: distil the original model back into a pruned or converted one."""
from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ...console import err_console, print_json
from ..options import MODEL_HELP, JsonOpt, LoadOptions, data_options, model_options

_T = "Training"
_L = "Loss"
_E = "Evaluation and state"


def heal(
    student: Annotated[str, typer.Argument(help="the pruned or converted model to heal; " + MODEL_HELP)],
    teacher: Annotated[str, typer.Option("--teacher", help="the original model it was made from")],
    output: Annotated[str, typer.Option("-o", "--output", help="output folder (written whole or not at all)")],
    train: Annotated[str, typer.Option("--train", help="what trains: attention (the attention projections) | "
                                       "all | lora (low-rank updates of the attention projections, merged at the end)",
                                       rich_help_panel=_T)] = "attention",
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="rank of the low-rank updates (--train lora)",
                                           rich_help_panel=_T)] = 8,
    lora_alpha: Annotated[float, typer.Option("--lora-alpha", help="scale alpha (update = alpha/rank * B A)",
                                              rich_help_panel=_T)] = 16.0,
    lr: Annotated[Optional[float], typer.Option("--lr", help="peak learning rate [default: 2e-4; 1e-3 for lora]",
                                                rich_help_panel=_T)] = None,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="AdamW weight decay",
                                                rich_help_panel=_T)] = 0.0,
    warmup_steps: Annotated[Optional[int], typer.Option("--warmup-steps", help="linear warmup steps "
                                                        "[default: 5% of the steps]", rich_help_panel=_T)] = None,
    min_lr_ratio: Annotated[float, typer.Option("--min-lr-ratio", help="cosine decay ends at lr times this",
                                                rich_help_panel=_T)] = 0.1,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="optimizer steps [default: one pass over "
                                                     "the data; --num-tokens caps the data]", rich_help_panel=_T)] = None,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="batches per optimizer step",
                                            rich_help_panel=_T)] = 1,
    max_grad_norm: Annotated[float, typer.Option("--max-grad-norm", help="gradient clipping (0 = off)",
                                                 rich_help_panel=_T)] = 1.0,
    bf16: Annotated[str, typer.Option("--bf16", help="bf16 autocast: auto (on CUDA) | on | off",
                                      rich_help_panel=_T)] = "auto",
    gradient_checkpointing: Annotated[bool, typer.Option("--gradient-checkpointing",
                                                         help="recompute activations in backward (less memory)",
                                                         rich_help_panel=_T)] = False,
    temperature: Annotated[float, typer.Option("--temperature", help="softmax temperature of the KL term",
                                               rich_help_panel=_L)] = 1.0,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="weight of the distillation term (KL of "
                                             "logits; hidden states for headless models)", rich_help_panel=_L)] = 1.0,
    lm_weight: Annotated[float, typer.Option("--lm-weight", help="weight of the student's own LM / MLM loss",
                                             rich_help_panel=_L)] = 0.0,
    hidden_weight: Annotated[float, typer.Option("--hidden-weight", help="weight of final hidden-state matching",
                                                 rich_help_panel=_L)] = 0.0,
    eval_data: Annotated[Optional[str], typer.Option("--eval-data", help="held-out data [default: the first "
                                                     "--eval-samples blocks of --data, which training skips]",
                                                     rich_help_panel=_E)] = None,
    eval_samples: Annotated[int, typer.Option("--eval-samples", help="held-out blocks", rich_help_panel=_E)] = 16,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="evaluate every N steps [default: "
                                                      "10 times a run]", rich_help_panel=_E)] = None,
    keep_best: Annotated[bool, typer.Option("--keep-best/--keep-last", help="write the weights of the best "
                                            "held-out evaluation, or of the last step", rich_help_panel=_E)] = True,
    save_every: Annotated[Optional[int], typer.Option("--save-every", help="save the training state to "
                                                      "OUT.heal-state/ every N steps [default: at every evaluation]",
                                                      rich_help_panel=_E)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue from OUT.heal-state/ after an interruption",
                                         rich_help_panel=_E)] = False,
    keep_state: Annotated[bool, typer.Option("--keep-state", help="keep OUT.heal-state/ after success",
                                             rich_help_panel=_E)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder (and "
                                            "discard an unfinished training state)")] = False,
    json_out: JsonOpt = False,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Distil TEACHER (the original) into STUDENT (pruned / converted) and write the healed model.

    KL between the two next-token distributions (hidden states for headless encoders), AdamW with
    warmup + cosine, held-out evaluation that keeps the best weights, resumable after Ctrl-C.
    Runs under torchrun for data parallelism.

    Example: headtool heal pruned/ --teacher smollm2-135m --data builtin:pydoc --max-steps 200 -o healed/
    """
    from ...data.sources import DataSpec
    from ...distributed import finish_world, world_from_env
    from ...train.healing import HealOptions
    from ...workflows.heal import HealRequest, run_heal

    spec = data_spec or DataSpec()
    opts = HealOptions(train=train, lora_rank=lora_rank, lora_alpha=lora_alpha, temperature=temperature,
                       kl_weight=kl_weight, lm_weight=lm_weight, hidden_weight=hidden_weight, lr=lr,
                       weight_decay=weight_decay, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                       max_steps=max_steps, grad_accum=grad_accum, max_grad_norm=max_grad_norm, seed=spec.seed,
                       bf16=bf16, eval_every=eval_every, save_every=save_every,
                       gradient_checkpointing=gradient_checkpointing, keep_best=keep_best)
    world = world_from_env(load.device)
    try:
        doc = run_heal(HealRequest(student, teacher, output, opts=opts, data=spec, eval_data=eval_data,
                                   eval_samples=eval_samples, load=load, overwrite=overwrite, resume=resume,
                                   keep_state=keep_state))
    finally:
        finish_world(world)
    if not world.main:
        return
    err_console().print(heal_table(doc))
    if json_out:
        print_json(doc)


def heal_table(doc: dict[str, Any]):
    """Before / after held-out figures of a heal, for stderr."""
    from rich.table import Table

    from ..render import human_bytes, human_int

    before, after = doc.get("before") or {}, doc.get("after") or {}
    ppl = "perplexity" in before
    t = Table(title=f"heal {doc['student']['ref']} <- {doc['teacher']['ref']}", title_justify="left")
    t.add_column("")
    t.add_column("held-out distill", justify="right")
    if ppl:
        t.add_column("perplexity", justify="right")
    for name, e in (("before", before), (f"after (step {doc['best_step']})", after)):
        if e:
            t.add_row(name, f"{e['distill']:.5f}", *([f"{e['perplexity']:.3f}"] if ppl else []))
    mem = doc.get("memory", {})
    t.caption = (f"{doc['steps']} steps, {human_int(doc['tokens'])} tokens, {doc['elapsed_s'] / 60:.1f} min, "
                 f"--train {doc['options']['train']} ({human_int(doc['trainable_params'])} parameters); "
                 f"teacher + student weights and training state {human_bytes(mem.get('model_bytes_total', 0))}"
                 + (f"; written to {doc['output']['path']}" if doc.get("output") else ""))
    return t


def register(app: typer.Typer) -> None:
    app.command("heal")(model_options(data_options()(heal)))
