"""How to heal: the options of the distillation loop, declared once for `headtool heal` and recipes.

Torch-free, so that the CLI can derive its options at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UsageError
from ..optionspec import CLI_ONLY, check, option

TRAIN_MODES = ("attention", "all", "lora")
HIDDEN_LAYERS = ("last", "all")
_T, _L, _E = "Training", "Loss", "Evaluation and state"


@dataclass(frozen=True)
class HealOptions:
    """How to heal. Defaults suit a short heal of a few hundred steps."""

    train: str = option("attention", "what trains: attention (the attention projections) | all | lora (low-rank "
                        "updates of the attention projections, merged at the end)", choices=TRAIN_MODES, panel=_T)
    lora_rank: int = option(8, "rank of the low-rank updates (--train lora)", min=1, panel=_T)
    lora_alpha: float = option(16.0, "scale alpha (update = alpha/rank * B A)", panel=_T)
    temperature: float = option(1.0, "softmax temperature of the KL term", above=0, panel=_L)
    kl_weight: float = option(1.0, "weight of the distillation term (KL of logits; hidden states for headless "
                              "models)", min=0, panel=_L)
    lm_weight: float = option(0.0, "weight of the student's own LM / MLM loss", min=0, panel=_L)
    hidden_weight: float = option(0.0, "weight of hidden-state matching (normalized squared error)", min=0,
                                  panel=_L)
    hidden_layers: str = option("last", "hidden states that --hidden-weight matches: last (the final one) | all "
                                "(every layer's output, each normalized by the teacher's scale there)",
                                choices=HIDDEN_LAYERS, panel=_L)
    lr: float | None = option(None, "peak learning rate [default: 2e-4; 1e-3 for lora]", above=0, panel=_T)
    weight_decay: float = option(0.0, "AdamW weight decay", min=0, panel=_T)
    warmup_steps: int | None = option(None, "linear warmup steps [default: 5% of the steps]", min=0, panel=_T)
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr times this", min=0, panel=_T)
    max_steps: int | None = option(None, "optimizer steps [default: one pass over the data; --num-tokens caps "
                                   "the data]", min=1, panel=_T)
    grad_accum: int = option(1, "batches per optimizer step", min=1, panel=_T)
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)", min=0, panel=_T)
    seed: int = 0  # the data's --seed (not an option of its own)
    bf16: str = option("auto", "bf16 autocast: auto (on CUDA) | on | off", choices=("auto", "on", "off"), panel=_T)
    eval_every: int | None = option(None, "evaluate every N steps [default: 10 times a run]", min=1, panel=_E)
    save_every: int | None = option(None, "save the training state to OUT.heal-state/ every N steps [default: "
                                    "at every evaluation]", min=1, panel=_E, where=CLI_ONLY,
                                    why="a recipe heals in memory and keeps no resumable state")
    gradient_checkpointing: bool = option(False, "recompute activations in backward (less memory)", panel=_T)
    keep_best: bool = option(True, "write the weights of the best held-out evaluation (of the objective trained: "
                             "distill, or the weighted total with --lm-weight or --hidden-weight), or of the "
                             "last step",
                             flags=("--keep-best/--keep-last",), panel=_E)

    def validate(self) -> None:
        """The declared checks (types, choices, ranges, finite numbers: a nan or inf would only fail
        at the first step, after the models loaded), then what no single option can declare."""
        check(self)
        if self.kl_weight == self.lm_weight == self.hidden_weight == 0:
            raise UsageError("every loss weight is 0: nothing to train for (set --kl-weight, --lm-weight or "
                             "--hidden-weight)")
        if self.min_lr_ratio > 1:
            raise UsageError(f"--min-lr-ratio must be between 0 and 1 (got {self.min_lr_ratio})")
        self._check_unused()

    def _check_unused(self) -> None:
        """Options the loss or the training mode would silently ignore: --temperature without the KL
        term (--kl-weight 0), --hidden-layers all without --hidden-weight, --lora-rank and --lora-alpha
        without --train lora. Each is refused with what to do."""
        default = {f.name: f.default for f in dataclasses.fields(self)}
        if self.temperature != default["temperature"] and not self.kl_weight:
            raise UsageError(f"--temperature {self.temperature:g} softens the KL term, which --kl-weight 0 leaves out "
                             "of the loss; leave --temperature out, or give the KL term a weight")
        if self.hidden_layers != default["hidden_layers"] and not self.hidden_weight:
            raise UsageError(f"--hidden-layers {self.hidden_layers}: hidden states are matched only with a "
                             "--hidden-weight above 0 (it is 0); set --hidden-weight or leave --hidden-layers out")
        unused = [f"--{name.replace('_', '-')} {getattr(self, name):g}" for name in ("lora_rank", "lora_alpha")
                  if getattr(self, name) != default[name]]
        if unused and self.train != "lora":
            many = len(unused) > 1
            raise UsageError(f"{' and '.join(unused)} {'shape' if many else 'shapes'} the low-rank updates of --train "
                             f"lora, and --train is {self.train}; add --train lora or leave {'them' if many else 'it'} out")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.train == "lora" else 2e-4)


def best_figure(opts: HealOptions) -> str:
    """The held-out figure that keep-best chooses the kept step on: the objective trained. 'distill'
    where only the distillation term weighs (the total is that times --kl-weight: the same order),
    else 'total' (--kl-weight * distill + --lm-weight * loss + --hidden-weight * hidden)."""
    return "distill" if not opts.lm_weight and not opts.hidden_weight else "total"


def objective_text(options: dict) -> str:
    """What keep-best chose on, in words, from a heal's options (asdict of HealOptions, or the
    `options` a heal's result records): 'held-out distill', or e.g. 'held-out total (1*hidden)'."""
    if not options.get("lm_weight") and not options.get("hidden_weight"):
        return "held-out distill"
    parts = [f"{options.get(k) or 0:g}*{name}" for k, name in (("kl_weight", "distill"), ("lm_weight", "LM loss"),
                                                               ("hidden_weight", "hidden")) if options.get(k)]
    return f"held-out total ({' + '.join(parts)})"
