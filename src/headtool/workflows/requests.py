"""The options and defaults of every step, once: one frozen request dataclass per command.

`headtool.cli` derives each command's options from these fields (flags, help, defaults) and
`recipe_schema` derives each recipe step's keys, types and allowed values from the same fields;
`headtool.optionspec` holds the metadata and the value checks both use. A recipe step and its
command therefore build the same request and run the same code (`workflows.*.…_loaded`).

Torch-free: the CLI imports this module at start-up.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from ..data.sources import AUTO_SOURCE, DataSpec
from ..model.placement import LoadOptions
from ..optionspec import CLI_ONLY, RECIPE, option, options_of
from ..surgery.prune_defaults import (BEAM_MAX_HEADS, DEFAULT_PRUNE_DAMPING, FEW_TOKENS_ANCHOR_POWER,
                                      MANY_CALIBRATION_TOKENS, MANY_TOKENS_ANCHOR_POWER)
from ..train.options import HealOptions

# the methods each step accepts (tests check these against the code that implements them)
SCORE_METHODS = ("gradient", "ablation", "taylor", "fisher", "magnitude", "random")
OBJECTIVES = ("auto", "lm", "mlm", "classification", "kl")
EVAL_OBJECTIVES = ("auto", "lm", "mlm", "classification")
NORMALIZE = ("auto", "layer", "geometric", "none")
MERGE_METHODS = ("mean", "aligned", "fit")
GROUPINGS = ("contiguous", "similarity")
PRUNE_UNITS = ("auto", "query", "group", "head")
RANK_ALLOCATIONS = ("uniform", "auto")

#: blocks of --data a calibration uses when neither --max-samples nor --num-tokens is given
CALIBRATION_BLOCKS = 64
#: prune --compensate's calibration: four times the others'. Five calibration samples of SmolLM2-135M at prune's
#: defaults, out of domain (benchmarks/results/obs_blocks_*.json, news / legal / wiki geometric means):
#: 64 -> 128 -> 256 blocks, 25% of the heads 1.142x / 1.125x / 1.122x -> 1.138x / 1.121x / 1.115x -> 1.126x /
#: 1.127x / 1.105x, 50% 1.485x / 1.592x / 1.461x -> 1.470x / 1.548x / 1.410x -> 1.441x / 1.528x / 1.383x, for
#: a prune 1.6x-1.9x as long per doubling (256 x 128 is still 32k tokens; SparseGPT-style calibrations read
#: 128 x 2048).
PRUNE_CALIBRATION_BLOCKS = 256

ANCHOR_HELP = ("how hard each refit is pulled toward the weights without a refit, relative to the mean diagonal "
               "of the Gram matrix: a number (0: the plain least-squares refit, inf: no refit; 1 held up best on "
               "text the calibration never saw) | a comma list of candidates, or auto (0, 0.01, 0.1, 1, 10, "
               "inf), chosen per layer on the held-out blocks")
#: the candidates of --anchor auto (tests check them against surgery.compensation.ANCHOR_GRID)
ANCHOR_GRID = (0.0, 0.01, 0.1, 1.0, 10.0, float("inf"))


def heldout_data_help(chosen: str = "each layer's refit and the merge are chosen") -> str:
    """--heldout-data's help, saying what the held-out blocks choose in this command."""
    return (f"held-out data of ANOTHER source on which {chosen} (what generalizes beyond --data); default: the "
            "blocks of --data after the calibration")


HELDOUT_DATA_HELP = heldout_data_help()
METHOD_HELP = ("gradient (default, Michel et al.) | ablation (exact loss increase) | taylor (TextPruner) | "
               "fisher (Kwon et al.) | magnitude (weights, no data) | random (seeded baseline)")
MODEL_HELP = ("a local Hugging Face folder, a .gguf file, a packaged model "
              "(smollm2-135m, all-minilm-l6-v2) or a hub id")
SEQUENTIAL_HELP = ("models larger than the device: keep the model on CPU and move one layer at a time to --device "
                   "for calibration (scoring, prune's obs statistics and --eval-data run on CPU)")
_SEQ = "a whole-recipe key: `sequential: true` at the top of the recipe"
_WRITE_ONCE = "a recipe writes its final model once: output, overwrite and shard_size are top-level keys"


def parse_anchor(text: str) -> float | tuple[float, ...]:
    """--anchor: a number, or a tuple of candidates chosen per layer (auto: ANCHOR_GRID)."""
    from ..errors import UsageError

    if str(text).strip() == "auto":
        return ANCHOR_GRID
    try:  # an empty item ('1,,2', '1,') is a typo, as in --normalize and --merge lists
        values = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        values = ()
    if not values or any(v != v or v < 0 for v in values):
        raise UsageError(f"--anchor {text!r}: use auto, a number >= 0, inf, or a comma list of them")
    return values[0] if len(values) == 1 else values


def _model(help: str = MODEL_HELP):
    return option(help=help, positional=True, where=RECIPE)


def _load():
    return field(default_factory=LoadOptions)


def _overwrite():
    return option(False, "replace an existing output folder", where=RECIPE, why=_WRITE_ONCE)


def _shard_size():
    from ..io.sizes import check_size

    return option("5GB", "largest safetensors shard", where=RECIPE, why=_WRITE_ONCE, parse=check_size)


def _conversion_eval_data():
    """convert-gqa's and convert-mla's --eval-data (prune and heal word theirs differently)."""
    return option(None, "data to measure loss before/after (blocks disjoint from calibration when it is the "
                  "same source)")


def _conversion_eval_samples():
    return option(32, "blocks of --eval-data", min=1)


#: the help of every --heldout-samples default: what data_plan does (max(4, calibration // 4))
HELDOUT_DEFAULT = "a quarter of the calibration blocks, at least 4"


def given(request, names: tuple[str, ...]) -> list[str]:
    """The flags of the options among `names` set to other than their declared defaults (a request
    holds values, not where they came from): which options a combination check must name."""
    declared = {o.name: o for o in options_of(type(request))}
    return [declared[n].flag for n in names if getattr(request, n) != declared[n].default]


def refuse_unused(flags: list[str], where: str) -> None:
    """One usage error naming every option in `flags` (when any): they only apply `where`, and a value
    that nothing reads would let a run look tuned when it was not."""
    from ..errors import UsageError

    if flags:
        raise UsageError(f"{', '.join(flags)} only appl{'ies' if len(flags) == 1 else 'y'} {where}")


def _check_eval_samples(request) -> None:
    """--eval-samples counts blocks of --eval-data (prune, convert-gqa, convert-mla): alone it does nothing."""
    if request.eval_data is None:
        refuse_unused(given(request, ("eval_samples",)), "with --eval-data (it counts its blocks)")


def _check_no_heldout(request) -> None:
    """--heldout-samples 0 takes no held-out blocks (convert-gqa, convert-mla): --heldout-data, the
    source they would come from, is then read by nothing (it was accepted and recorded as null)."""
    if request.heldout_samples == 0:
        refuse_unused(given(request, ("heldout_data",)), "with held-out blocks, which --heldout-samples 0 turns off")


def _check_anchor_choice(request) -> None:
    """Several --anchor candidates (auto or a list) are chosen between per layer on held-out blocks; with
    --heldout-samples 0 they were chosen on the calibration blocks the refits were fitted to, where the
    weakest anchor fits best (the choice said nothing about text beyond them, and nothing said so)."""
    anchors = parse_anchor(request.anchor)
    finite = {a for a in (anchors if isinstance(anchors, tuple) else (anchors,)) if a != float("inf")}
    if request.heldout_samples == 0 and len(finite) > 1:  # (inf, no refit, is a candidate anyway)
        from ..errors import UsageError

        none = ("prune takes none unless --heldout-samples or --heldout-data asks" if isinstance(request, PruneRequest)
                else "--heldout-samples 0 leaves none")
        raise UsageError(f"--anchor {request.anchor}: each layer's anchor is chosen on held-out blocks, and {none} "
                         "(on the calibration blocks the refit was fitted to, the weakest anchor would always win): "
                         "give one anchor, or held-out blocks")


def _check_streaming(request) -> None:
    """--streaming builds no model: it reads and writes tensors file to file, on this machine's CPU.
    Options that place a model (--device, --device-map, --max-memory, --sequential) would do nothing;
    --dtype does apply (the tensors are cast as they are written)."""
    if request.streaming:
        refuse_unused(given(request.load, ("device", "device_map", "max_memory")) + given(request, ("sequential",)),
                      "when a model is built: --streaming copies tensors file to file on the CPU")


def _check_method_pair(request) -> None:
    """A scoring method that cannot estimate an explicit --objective (taylor with kl), refused before the
    model loads (it was found after loading, and in a recipe after the steps before it)."""
    if request.objective != "auto":
        from ..measure.scoring import check_method

        check_method(request.method, request.objective)


def _check_with_anchor(request) -> None:
    """The declared checks of a request with an --anchor, and the anchor parsed."""
    from ..optionspec import check

    check(request)
    parse_anchor(request.anchor)


def calibration_data() -> DataSpec:
    """The data of the steps that calibrate (score, prune, convert-gqa, convert-mla, heal) when none
    is given: `auto`, i.e. builtin:pydoc mixed with self-generated text on causal LMs (it held up
    best on text the calibration never saw: README, Results), builtin:pydoc on other models.
    eval and inspect keep builtin:pydoc: a measurement on the model's own text means little."""
    return DataSpec(source=AUTO_SOURCE)


@dataclass(frozen=True)
class ScoreRequest:
    """What to score and how; `data` is used by the data-driven methods only (all of it unless
    --max-samples / --num-tokens cap it)."""

    model: str = _model()
    method: str = option("gradient", METHOD_HELP, flags=("--method", "-m"), choices=SCORE_METHODS)
    objective: str = option("auto", "auto | lm | mlm | classification | kl (divergence from the model's own "
                            "outputs; any model, headless encoders too)", choices=OBJECTIVES)
    normalize: str = option("auto", "auto | layer (per-layer L2, Michel) | geometric (over the square root of "
                            "that norm: between the two) | none; auto = layer for gradient, taylor and fisher, none "
                            "otherwise. raw_scores are always kept", choices=NORMALIZE)
    iterative: int = option(0, "K rounds of: score, gate off the weakest heads, re-score (Michel); records "
                            "removal_order", min=0)
    fraction: float | None = option(None, "with --iterative: fraction of all heads gated off over the K rounds "
                                    "(default 0.5, spread evenly)", above=0, below=1)
    iterative_fraction: float | None = option(None, "with --iterative: fraction of all heads gated off after "
                                              "each round (instead of --fraction)", above=0, below=1)
    ablation_batch: int | None = option(None, "heads evaluated together in one batched ablation pass (default: "
                                        "as many as fit in about 1 GiB of activations)", min=1)
    output: str | None = option(None, "write the score document here (atomically); default: stdout",
                                flags=("--output", "-o"))
    data: DataSpec = field(default_factory=calibration_data)
    load: LoadOptions = _load()

    default_blocks: ClassVar[int | None] = None  # all of --data

    def validate(self) -> None:
        """Problems visible before any model is loaded."""
        from ..errors import UsageError
        from ..optionspec import check

        if self.method not in SCORE_METHODS:
            raise UsageError(f"unknown --method {self.method!r}; use one of {', '.join(SCORE_METHODS)}")
        check(self)
        _check_method_pair(self)
        if (self.fraction is not None or self.iterative_fraction is not None) and not self.iterative:
            raise UsageError("--fraction and --iterative-fraction go with --iterative K (prune takes the final "
                             "fraction)")
        if self.fraction is not None and self.iterative_fraction is not None:  # (--fraction was ignored)
            raise UsageError(f"--fraction {self.fraction} spreads over the rounds and --iterative-fraction "
                             f"{self.iterative_fraction} is taken after each round: give one of them")
        if self.iterative_fraction is not None and self.iterative * self.iterative_fraction >= 1:
            # (the rounds past the point where one head per layer was left ran and gated off nothing)
            raise UsageError(f"--iterative {self.iterative} rounds of --iterative-fraction {self.iterative_fraction} "
                             f"would gate off {self.iterative * self.iterative_fraction:.0%} of the heads: keep "
                             "their product below 1 (one head per layer always stays)")
        if self.method != "ablation":  # (it was ignored: only the ablation passes batch heads)
            refuse_unused(given(self, ("ablation_batch",)), "with --method ablation")


_H, _T, _C, _E = "Heads", "Target", "Compensation", "Evaluation"
NORMALIZATIONS = ("auto", "layer", "geometric", "none", "obs")
NORMALIZE_HELP = ("how scores compare across layers, which sets how many heads each layer loses: layer (per-layer "
                  "L2, Michel) | none (the raw loss estimates) | geometric (between the two: their geometric mean) "
                  "| obs (not from scores: each layer's count from the error the --compensate refit leaves, "
                  "weighted by the layer's loss sensitivity E||dL/dy||^2, split over the layers exactly; "
                  "one forward and backward pass over the calibration, the scoring pass's when prune scores with a gradient "
                  "method) "
                  "| a comma list, each pruned (all but the last on a copy "
                  "of the attention weights) and the lowest loss on held-out blocks kept (--heldout-data's when "
                  "given, else 8,192 tokens of text sampled from the model (64 blocks of 128) that the calibration "
                  "did not read, else the calibration's source after it) | auto: obs with --compensate (the lowest "
                  "loss on text the calibration never saw at 25% and 50%, measured), layer,none where obs cannot "
                  "run (--anchor inf, --scope layer), else as scored")


@dataclass(frozen=True)
class PruneRequest:
    """prune's options and defaults. Heads come from `scores` (a document or '-'), `heads` (an
    explicit list) or, with `data` and neither, from scoring now with `method`."""

    model: str = _model()
    output: str | None = option(None, "output folder (written atomically)", flags=("--output", "-o"),
                                where=RECIPE)
    scores: str | None = option(None, "score document from `headtool score` (a file, or - for stdin)", panel=_H)
    heads: str | None = option(None, 'explicit heads to remove: LAYER:HEAD,HEAD;LAYER:HEAD, e.g. "3:0,5;7:2" '
                               '(layer 3 heads 0 and 5, layer 7 head 2); "3:1,5:0" works too (an item with ":" '
                               'starts a new layer); "" removes none', panel=_H)
    method: str = option("gradient", "with --data and no --scores: scoring method (gradient, ablation, taylor, "
                         "fisher, magnitude, random)", choices=SCORE_METHODS, panel=_H)
    objective: str = option("auto", "auto | lm | mlm | classification | kl (scoring and --eval-data)",
                            choices=OBJECTIVES, panel=_H)
    normalize: str = option("auto", NORMALIZE_HELP, choices=NORMALIZATIONS, multiple=True, panel=_H)
    allocation_margin: float = option(0.0, "when --normalize compares modes: keep the first unless a later one's "
                                      "held-out loss is lower than the one kept so far by more than this many "
                                      "standard errors of their paired per-block difference (0: the lowest loss)",
                                      min=0, panel=_H)
    fraction: float | None = option(None, "fraction of query heads to remove, in (0, 1)", above=0, below=1,
                                    panel=_T)
    num_heads: int | None = option(None, "number of query heads to remove", min=1, panel=_T)
    threshold: float | None = option(None, "remove heads scoring below this", panel=_T)
    scope: str = option("global", "global (rank all heads together) | layer (same number from every layer)",
                        choices=("global", "layer"), panel=_T)
    min_heads_per_layer: int = option(1, "query heads every layer keeps at least", min=1, panel=_T)
    unit: str = option("auto", "GQA: query (query heads inside KV groups, groups stay equal) | group (whole KV "
                       "groups) | head (any single query head: the KV groups may end up different in size, "
                       "which only headtool's remote code expresses) | auto: head with --compensate and --scope "
                       f"global on layers of at most {BEAM_MAX_HEADS} query heads (at the refit's defaults better "
                       "than query on every unseen text measured), and on a model whose groups already differ; "
                       "query otherwise", choices=PRUNE_UNITS, panel=_T)
    protect_layers: str = option("auto", "layers that lose no heads when heads are chosen from scores: "
                                 "layer indices, comma-separated (negative from the end), none, or auto: the first "
                                 "layer with --scope global (removing its heads cost far more than their "
                                 "normalized scores said, measured), none with --scope layer", panel=_T)
    compensate: bool = option(False, "refit each pruned layer's output projection by least squares on --data "
                              f"(sequential calibration; {PRUNE_CALIBRATION_BLOCKS} blocks unless --max-samples, "
                              f"{CALIBRATION_BLOCKS} without --compensate)",
                              panel=_C)
    choose_in_layer: str = option("auto", "auto | scores | refit: which heads go inside a layer (refit: the "
                                  "least error after the refit; auto = refit with --compensate)",
                                  choices=("auto", "scores", "refit"), panel=_C)
    refit_layers: str = option("pruned", "pruned | all (also refit unpruned layers to undo earlier layers' "
                               "drift)", choices=("pruned", "all"), panel=_C)
    damping: float = option(DEFAULT_PRUNE_DAMPING, "ridge damping (toward zero), relative to the mean diagonal "
                            "of the Gram matrix; the --anchor already regularizes the refit", min=0, panel=_C)
    anchor: str = option("1", ANCHOR_HELP, panel=_C)
    anchor_power: float | None = option(None, "each pruned layer's --anchor times (kept heads / heads) ^ P: the "
                                        "more heads a layer loses, the freer its refit (0: one anchor for every "
                                        f"layer; default with --compensate: {MANY_TOKENS_ANCHOR_POWER:g} on "
                                        f"{MANY_CALIBRATION_TOKENS:,} calibration tokens or more, "
                                        f"{FEW_TOKENS_ANCHOR_POWER:g} on fewer; the default calibration is "
                                        f"{PRUNE_CALIBRATION_BLOCKS} blocks of 128)",
                                        min=0, panel=_C)
    heldout_samples: int = option(0, "held-out blocks on which each layer's refit is chosen (its anchor, or "
                                  f"none); 0: no check, unless --heldout-data (then {HELDOUT_DEFAULT})",
                                  min=0, panel=_C)
    heldout_data: str | DataSpec | None = option(None, heldout_data_help(
        "each layer's refit (and the --normalize mode, when several are compared) is chosen"), panel=_C)
    eval_data: str | DataSpec | None = option(None, "measure loss / perplexity before and after on this data "
                                              "(held out from --data when it is the same source)", panel=_E)
    eval_samples: int = option(32, "blocks for --eval-data", min=1, panel=_E)
    dry_run: bool = option(False, "plan and summary; nothing written", where=CLI_ONLY,
                           why="a recipe's steps always run: `headtool run --dry-run` writes nothing")
    overwrite: bool = _overwrite()
    shard_size: str = _shard_size()
    streaming: bool = option(False, "work shard by shard on the safetensors files, never building the model "
                             "(checkpoints larger than memory; needs --scores or --heads, no --compensate)",
                             where=CLI_ONLY, why="a recipe keeps the model in memory between steps")
    sequential: bool = option(False, SEQUENTIAL_HELP, panel="Model", where=RECIPE, why=_SEQ)
    data: DataSpec | None = None
    load: LoadOptions = _load()

    @property
    def default_blocks(self) -> int:
        """Blocks of --data read when --max-samples / --num-tokens say none: the refit's calibration with
        --compensate (more text held up better out of domain, measured), the scoring's otherwise."""
        return PRUNE_CALIBRATION_BLOCKS if self.compensate else CALIBRATION_BLOCKS

    @property
    def reads_data(self) -> bool:
        """Whether this prune reads --data: to refit (--compensate), to score now, to compare a --normalize
        list, or where --eval-data is cut (held out from it, in its block length). Else (listed heads or a
        score document, and none of those) the data options are read by nothing."""
        return (self.compensate or (self.scores is None and self.heads is None) or "," in self.normalize
                or self.eval_data is not None)

    @property
    def refits(self) -> bool:
        """Whether --anchor leaves a refit to make: some candidate strength is finite (inf alone: none)."""
        anchors = parse_anchor(self.anchor)
        return any(a != float("inf") for a in (anchors if isinstance(anchors, tuple) else (anchors,)))

    @property
    def auto_is_obs(self) -> bool:
        """Whether --normalize auto splits the heads by what the refit cannot repair (obs): with a refit
        to ask (--compensate and a finite --anchor), a number of heads and --scope global (the model's
        loss, lm or mlm, is checked where the objective is known)."""
        return self.compensate and self.threshold is None and self.scope != "layer" and self.refits

    def refit_options_given(self) -> list[str]:
        """The refit's options set to other than their defaults; without --compensate nothing reads
        them (--heldout-data also picks where a --normalize list is compared: then it is read)."""
        names = ("refit_layers", "damping", "anchor", "anchor_power", "heldout_samples")
        flags = given(self, names + (() if "," in self.normalize else ("heldout_data",)))
        return flags + (["--choose-in-layer refit"] if self.choose_in_layer == "refit" else [])

    def validate(self) -> None:
        _check_with_anchor(self)
        from ..errors import UsageError

        if self.scores is None and self.heads is None:
            _check_method_pair(self)  # (it scores now)
        if self.scores is not None and self.heads is not None:  # (the listed heads were removed, the scores unread)
            raise UsageError("give either --scores or --heads, not both")
        if self.scores is not None or self.heads is not None:  # (it was ignored: the heads came from elsewhere)
            refuse_unused(given(self, ("method",)), "when prune scores the heads itself (no --scores or --heads)")
        if self.heads is not None:  # (they were ignored: a listed layer lost its heads, protected or not)
            refuse_unused(given(self, ("scope", "protect_layers", "normalize", "allocation_margin")),
                          "when heads are chosen from scores (--heads lists them)")
        if self.heads is not None and self.choose_in_layer == "refit":  # (it removed other heads than listed)
            raise UsageError("--choose-in-layer refit picks which heads a layer loses; --heads lists them: "
                             "leave --choose-in-layer out (listed heads are removed as listed)")
        if not self.compensate:
            flags = self.refit_options_given()
            also = "; --heldout-data also to a --normalize list's comparison" if "--heldout-data" in flags else ""
            refuse_unused(flags, "to the refit, which needs --compensate" + also)
        if self.compensate and self.heldout_data is None:
            _check_anchor_choice(self)
        _check_eval_samples(self)
        _check_streaming(self)
        compares = "," in self.normalize or (self.normalize == "auto" and self.compensate and not self.auto_is_obs)
        if self.allocation_margin and not compares:
            raise UsageError("--allocation-margin weighs a comparison of normalizations: give --normalize with "
                             "several modes, e.g. obs,layer,none")
        if "obs" in [m.strip() for m in self.normalize.split(",")]:
            why = ("needs --compensate (it allocates by what the refit repairs)" if not self.compensate else
                   "splits a number of heads: give --fraction or --num-heads, not --threshold"
                   if self.threshold is not None else
                   "splits heads over the layers: it does not go with --scope layer" if self.scope == "layer" else
                   "needs a refit: an --anchor other than inf" if not self.refits else None)
            if why:
                raise UsageError(f"--normalize obs {why}")


@dataclass(frozen=True)
class ConvertRequest:
    """convert-gqa's options and defaults. `merge` is one method or a comma list to compare;
    `refit` None means on for fit; `heldout_samples` None means a quarter of the calibration blocks,
    at least 4."""

    model: str = _model()
    kv_heads: int = option(help="KV heads per layer after merging (1 = MQA)", min=1)
    output: str | None = option(None, "output folder", flags=("-o", "--output"), where=RECIPE)
    grouping: str = option("contiguous", "contiguous | similarity (needs --data)", choices=GROUPINGS)
    merge: str = option("fit", "mean | aligned | fit, or a comma list to compare (the one with the lowest "
                        "held-out loss is written)", choices=MERGE_METHODS, multiple=True)
    refit: bool | None = option(None, "sequential output-projection refit (default: on for fit)",
                                flags=("--refit/--no-refit",))
    damping: float = option(1e-2, "ridge damping of the refit, relative", min=0)
    anchor: str = option("1", ANCHOR_HELP)
    heldout_samples: int | None = option(None, "held-out blocks on which each refit (its anchor, or none) and the "
                                         f"merge are chosen (default: {HELDOUT_DEFAULT})", min=0)
    heldout_data: str | DataSpec | None = option(None, HELDOUT_DATA_HELP)
    eval_data: str | DataSpec | None = _conversion_eval_data()
    eval_samples: int = _conversion_eval_samples()
    overwrite: bool = _overwrite()
    shard_size: str = _shard_size()
    streaming: bool = option(False, "work shard by shard on the safetensors files, never building the model "
                             "(checkpoints larger than memory; --merge mean with contiguous grouping)",
                             where=CLI_ONLY, why="a recipe keeps the model in memory between steps")
    sequential: bool = option(False, SEQUENTIAL_HELP, panel="Model", where=RECIPE, why=_SEQ)
    data: DataSpec = field(default_factory=calibration_data)
    load: LoadOptions = _load()

    default_blocks: ClassVar[int | None] = CALIBRATION_BLOCKS

    @property
    def methods(self) -> list[str]:
        """The --merge methods, in order, once each."""
        return list(dict.fromkeys(m.strip() for m in self.merge.split(",") if m.strip()))

    @property
    def refits(self) -> bool:
        """Whether some merge is followed by the output-projection refit (--refit, or fit's default)."""
        return self.refit if self.refit is not None else "fit" in self.methods

    @property
    def reads_data(self) -> bool:
        """Whether the conversion calibrates: a merge or grouping that reads activations, or a refit."""
        return self.grouping == "similarity" or self.methods != ["mean"] or self.refits

    def validate(self) -> None:
        _check_with_anchor(self)
        if not self.refits:
            why = ("--no-refit turns off" if self.refit is False else
                   f"--merge {self.merge} does not make (--merge fit does, or add --refit)")
            refuse_unused(given(self, ("damping", "anchor")), f"to the output-projection refit, which {why}")
        if not self.reads_data:
            refuse_unused(given(self, ("heldout_samples", "heldout_data")),
                           f"to a conversion that calibrates: {reads_no_data(recipe=False)}")
        _check_no_heldout(self)
        if self.refits:
            _check_anchor_choice(self)
        if len(self.methods) > 1 and self.heldout_samples == 0 and self.eval_data is None:
            from ..errors import UsageError

            raise UsageError(f"--merge {','.join(self.methods)}: the merges are compared on held-out blocks (or "
                             "--eval-data), and --heldout-samples 0 leaves none: give one method, held-out blocks "
                             "or --eval-data")
        _check_eval_samples(self)
        _check_streaming(self)


def reads_no_data(*, recipe: bool, remedy: str | None = None) -> str:
    """Why a conversion with --merge mean, contiguous groups and no refit takes no data options, in the
    words of the CLI's flags or of a recipe step's keys (one wording for every place that refuses them);
    `remedy` ends it with what to do instead."""
    if recipe:
        why = "merge mean with contiguous grouping reads no data"
        fix = "a data merge, grouping: similarity or refit: true"
    else:
        why = "--merge mean with contiguous grouping reads no data"
        fix = "a data merge, --grouping similarity or --refit"
    return f"{why} (add {fix}, or {remedy})" if remedy else why


def parse_budget(value: float | int | str) -> float:
    """A fraction in (0, 1] given as a number or as text: a decimal ("0.5") or a ratio ("1/3", exact,
    where 0.3333 falls short of a third). ValueError, saying what is allowed, for anything else."""
    from fractions import Fraction

    try:
        if isinstance(value, bool):
            raise TypeError
        frac = float(Fraction(value.strip()) if isinstance(value, str) else value)
    except (ValueError, ZeroDivisionError, TypeError, OverflowError):
        raise ValueError("give a fraction in (0, 1] of today's KV cache, e.g. 1/3 or 0.5") from None
    if not 0 < frac <= 1:
        raise ValueError("must be a fraction in (0, 1] of today's KV cache")
    return frac


@dataclass(frozen=True)
class LatentRequest:
    """convert-mla's options and defaults. `rope_dim` None means one KV head's rotary dims (as
    DeepSeek and TransMLA); the calibration (`data`) chooses the rotations and the latent."""

    model: str = _model()
    kv_rank: int | None = option(None, "latent dims per token and layer; the cache holds these plus --rope-dim "
                                 "(full rank: 2 x KV heads x head_dim - --rope-dim, exact when --rope-dim is KV "
                                 "heads x rotary dims); or --kv-cache", min=1)
    kv_cache: float | str | None = option(None, "instead of --kv-rank: the cache budget, a fraction in (0, 1] of "
                                          "today's KV-cache bytes per token, as a ratio or a decimal (1/3: the MQA "
                                          "cache of a 3-KV-head model; the budget is never exceeded, so 0.33 is a "
                                          "little less; 1 with the default --rope-dim: exact, no compression, where the layers have as many KV "
                                          "heads)",
                                          parse=parse_budget)
    rank_allocation: str = option("uniform", "uniform (the same kv_rank in every layer, or a layer's full rank "
                                  "where that is less) | auto (the same total, "
                                  "a different kv_rank per layer: each latent dim goes to the layer whose weighted "
                                  "error it lowers most, from the calibration spectra)", choices=RANK_ALLOCATIONS)
    rope_dim: int | None = option(None, "dims of the rotary key shared by all query heads (even); default with "
                                  "--kv-cache 3/8 of the per-layer budget (measured best on SmolLM2; at "
                                  "--kv-cache 1 every rotary dim, exact), with "
                                  "--kv-rank one head's rotary dims; KV heads x rotary dims keeps RoPE exact; 0 "
                                  "(the only value) without RoPE (GPT-2, OPT)", min=0)
    output: str | None = option(None, "output folder", flags=("-o", "--output"), where=RECIPE)
    damping: float = option(1e-2, "ridge on the calibration Gram of the latent factorization and of the refit, "
                            "relative to its mean diagonal", min=0)
    key_weight: float = option(0.25, "weight of key errors against value errors in the latent (each relative to "
                               "its total; values lose more than keys)", min=0)
    refit: bool = option(True, "sequential output-projection refit after the conversion, kept per layer only "
                         "where it lowers the held-out error", flags=("--refit/--no-refit",))
    anchor: str = option("1", ANCHOR_HELP)
    heldout_samples: int | None = option(None, "held-out blocks on which each refit (its anchor, or none) is chosen "
                                         f"(default: {HELDOUT_DEFAULT})", min=0)
    heldout_data: str | DataSpec | None = option(None, heldout_data_help("each layer's refit is chosen"))
    eval_data: str | DataSpec | None = _conversion_eval_data()
    eval_samples: int = _conversion_eval_samples()
    overwrite: bool = _overwrite()
    shard_size: str = _shard_size()
    data: DataSpec = field(default_factory=calibration_data)
    load: LoadOptions = _load()

    default_blocks: ClassVar[int | None] = CALIBRATION_BLOCKS

    def __post_init__(self) -> None:
        # "1/3" from the command line or a recipe becomes the float every step computes with
        if self.kv_cache is not None:
            from ..errors import UsageError

            try:
                object.__setattr__(self, "kv_cache", parse_budget(self.kv_cache))
            except ValueError as e:
                raise UsageError(f"--kv-cache {self.kv_cache}: {e}") from None

    def validate(self) -> None:
        from ..errors import UsageError

        _check_with_anchor(self)
        if not self.refit:
            refuse_unused(given(self, ("anchor", "heldout_samples", "heldout_data")),
                           "to the output-projection refit, which --no-refit turns off")
        _check_no_heldout(self)
        _check_anchor_choice(self)
        _check_eval_samples(self)
        if self.rope_dim is not None and self.rope_dim % 2:
            raise UsageError(f"--rope-dim {self.rope_dim}: must be even (rotary dims come in pairs)")
        if (self.kv_rank is None) == (self.kv_cache is None):
            raise UsageError("convert-mla: give exactly one of --kv-rank R (latent dims per layer) or --kv-cache "
                             "FRACTION (of today's KV-cache bytes per token)")


@dataclass(frozen=True)
class EvalRequest:
    """Models to compare (deltas are against the first) and the data they are compared on (all of
    it unless --max-samples / --num-tokens cap it)."""

    models: tuple[str, ...] = option((), "one or more models; deltas are against the first", positional=True,
                                     where=RECIPE)
    objective: str = option("auto", "auto | lm | mlm | classification", choices=EVAL_OBJECTIVES)
    data: DataSpec = field(default_factory=DataSpec)
    load: LoadOptions = _load()

    default_blocks: ClassVar[int | None] = None

    def validate(self) -> None:
        from ..optionspec import check

        check(self)


@dataclass(frozen=True)
class HealRequest:
    """STUDENT healed towards TEACHER on `data`, written to `output`.

    eval_data: None (held-out blocks of `data`, which training skips), a source string or a DataSpec.
    The training state goes to OUTPUT.heal-state/ and is removed after OUTPUT is written (unless
    keep_state).
    """

    student: str = option(help="the pruned or converted model to heal; " + MODEL_HELP, positional=True,
                          where=RECIPE)
    teacher: str = option(help="the original model it was made from", where=RECIPE)
    output: str | os.PathLike = option(help="output folder (written whole or not at all)", flags=("-o", "--output"),
                                       where=RECIPE)
    opts: HealOptions = field(default_factory=HealOptions)
    data: DataSpec = field(default_factory=calibration_data)
    eval_data: str | DataSpec | None = option(None, "held-out data [default: the first --eval-samples blocks of "
                                              "--data, which training skips]", panel="Evaluation and state")
    eval_samples: int = option(16, "held-out blocks", min=1, panel="Evaluation and state")
    load: LoadOptions = _load()
    overwrite: bool = option(False, "replace an existing output folder (and discard an unfinished training "
                             "state)", where=RECIPE, why=_WRITE_ONCE)
    resume: bool = option(False, "continue from OUT.heal-state/ after an interruption",
                          panel="Evaluation and state", where=CLI_ONLY,
                          why="a recipe heals in memory and keeps no resumable state")
    keep_state: bool = option(False, "keep OUT.heal-state/ after success", panel="Evaluation and state",
                              where=CLI_ONLY, why="a recipe heals in memory and keeps no resumable state")

    default_blocks: ClassVar[int | None] = None  # one pass over --data (or what --max-steps reads)

    def validate(self) -> None:
        from ..optionspec import check

        check(self)
        self.opts.validate()
