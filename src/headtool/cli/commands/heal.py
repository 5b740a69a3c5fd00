"""`headtool heal`: distil the original model back into a pruned or converted one."""
from __future__ import annotations

from typing import Any

import typer

from ...console import err_console, print_json
from ...data.sources import AUTO_SOURCE
from ...train.options import HealOptions
from ...workflows.requests import HealRequest, calibration_data
from ..options import JsonOpt, LoadOptions, command_options, data_options, model_options


@command_options(HealRequest, nested={"opts": HealOptions})
def heal(json_out: JsonOpt = False, fields=None, load: LoadOptions = LoadOptions(), data_spec=None) -> None:
    """Distil TEACHER (the original) into STUDENT (pruned / converted) and write the healed model.

    KL between the two next-token distributions (hidden states for headless encoders), AdamW with
    warmup + cosine, held-out evaluation that keeps the best weights, resumable after Ctrl-C.
    Runs under torchrun for data parallelism.

    Example: headtool heal pruned/ --teacher smollm2-135m --data builtin:pydoc --max-steps 200 -o healed/
    """
    from ...distributed import finish_world, world_from_env
    from ...workflows.heal import run_heal

    spec = data_spec or calibration_data()
    opts = HealOptions(**fields.pop("opts"), seed=spec.seed)
    world = world_from_env(load.device)
    try:
        doc = run_heal(HealRequest(**fields, opts=opts, data=spec, load=load))
    finally:
        finish_world(world)
    if not world.main:
        return
    err_console().print(heal_table(doc))
    if json_out:
        print_json(doc)


def heal_table(doc: dict[str, Any]):
    """Before / after held-out figures of a heal, for stderr."""
    from ..render import Table

    from ..render import human_bytes, human_int

    before, after = doc.get("before") or {}, doc.get("after") or {}
    ppl = "perplexity" in before
    total = doc.get("best_by") == "total"  # keep-best chose on the weighted objective: show it
    t = Table(title=f"heal {doc['student']['ref']} <- {doc['teacher']['ref']}", title_justify="left")
    t.add_column("")
    t.add_column("held-out distill", justify="right")
    if total:
        t.add_column("held-out total", justify="right")
    if ppl:
        t.add_column("perplexity", justify="right")
    for name, e in (("before", before), (f"after (step {doc['best_step']})", after)):
        if e:
            t.add_row(name, f"{e['distill']:.5f}", *([f"{e['total']:.5f}"] if total else []),
                      *([f"{e['perplexity']:.3f}"] if ppl else []))
    mem = doc.get("memory", {})
    t.caption = (f"{doc['steps']} steps, {human_int(doc['tokens'])} tokens, {doc['elapsed_s'] / 60:.1f} min, "
                 f"--train {doc['options']['train']} ({human_int(doc['trainable_params'])} parameters); "
                 f"teacher + student weights and training state {human_bytes(mem.get('model_bytes_total', 0))}"
                 + kept_text(doc)
                 + (f"; written to {doc['output']['path']}" if doc.get("output") else ""))
    return t


def kept_text(doc: dict[str, Any]) -> str:
    """Which step's weights a heal kept, and on what figure it chose them ('' for older results)."""
    from ...train.options import objective_text

    if doc.get("best_by") == "last":
        return "; kept the last step's weights (--keep-last)"
    if doc.get("best_by"):
        return f"; kept the step of the lowest {objective_text(doc.get('options') or {})}"
    return ""


def register(app: typer.Typer) -> None:
    app.command("heal")(model_options(data_options(default=AUTO_SOURCE)(heal)))
