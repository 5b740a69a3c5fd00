"""Scores + a target -> the heads to keep in every layer (pure functions, no model).

A layer loses heads in *steps*: with `--unit query` on a GQA layer one step removes one
query head from every KV group (the groups stay equal in size, so the layer keeps all its
KV heads); with `--unit group` one step removes a whole KV group with its query heads; a
layer whose groups hold one query head each (multi-head attention) loses single heads either
way. Steps are ordered weakest first (mean score of the heads they remove), and the global
scope takes the weakest steps over all layers, so how many heads each layer loses follows
the scores. Protected layers (`Target.protect`; prune's default: the first layer in the global
ranking) lose no heads.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..arch import LayerHeads
from ..arch.heads import LayerKeep, keep_for_query_heads
from ..errors import UsageError
from .prune_defaults import BEAM_MAX_HEADS

SCOPES = ("global", "layer")
UNITS = ("query", "group", "head")
# exhaustive search over removal sets inside a layer up to this many candidates (where it is no dearer
# than the beam), else a beam search keeping this many sets a round (see choose_removals)
EXHAUSTIVE_LIMIT = 4096
BEAM_WIDTH = 8


@dataclass(frozen=True)
class Target:
    """How many heads to remove: exactly one of fraction / num_heads / threshold."""

    fraction: float | None = None
    num_heads: int | None = None  # query heads to remove in total
    threshold: float | None = None  # remove heads (steps) whose mean score is below this
    scope: str = "global"
    min_heads_per_layer: int = 1
    unit: str = "query"
    protect: tuple[int, ...] = ()  # layers that keep every head (indices; negative from the end)

    def describe(self) -> dict:
        return {"fraction": self.fraction, "num_heads": self.num_heads, "threshold": self.threshold,
                "scope": self.scope, "min_heads_per_layer": self.min_heads_per_layer, "unit": self.unit,
                "protect_layers": list(self.protect)}

    def protected(self, num_layers: int) -> set[int]:
        """The protected layers as indices 0..num_layers-1."""
        return {i % num_layers for i in self.protect}


@dataclass(frozen=True)
class Selection:
    """Kept query heads per layer (original indices) and what that means for the KV heads."""

    kept: tuple[tuple[int, ...], ...]
    keeps: tuple[LayerKeep, ...]

    @classmethod
    def from_kept(cls, geometry: Sequence[LayerHeads], kept: Sequence[Sequence[int]],
                  uneven: bool = False) -> "Selection":
        """The selection keeping `kept` query heads per layer; `uneven` lets a layer's KV groups
        end up different in size (--unit head), else they must stay equal."""
        keeps = []
        for i, (g, k) in enumerate(zip(geometry, kept)):
            try:
                keeps.append(keep_for_query_heads(g, k, uneven))
            except UsageError as e:
                raise UsageError(f"layer {i}: {e}") from None
        return cls(tuple(ks.q for ks in keeps), tuple(keeps))

    def removed(self, geometry: Sequence[LayerHeads]) -> list[list[int]]:
        return [sorted(set(range(g.num_heads)) - set(k)) for g, k in zip(geometry, self.kept)]

    def num_removed(self, geometry: Sequence[LayerHeads]) -> int:
        return sum(g.num_heads - len(k) for g, k in zip(geometry, self.kept))

    def geometry(self, geometry: Sequence[LayerHeads]) -> list[LayerHeads]:
        return [k.geometry(g) for k, g in zip(self.keeps, geometry)]

    def mask(self, geometry: Sequence[LayerHeads]) -> list[list[float]]:
        """Gate values (1 kept, 0 removed) per layer: what the pruned model must equal."""
        return [[1.0 if h in set(k) else 0.0 for h in range(g.num_heads)] for g, k in zip(geometry, self.kept)]


# ----------------------------------------------------------------------------- validation
def check_target(target: Target, geometry: Sequence[LayerHeads]) -> None:
    """UsageError (one line) for a target that cannot be met, before any work is done."""
    given = [n for n, v in (("--fraction", target.fraction), ("--num-heads", target.num_heads),
                            ("--threshold", target.threshold)) if v is not None]
    if len(given) != 1:
        raise UsageError("give exactly one target: --fraction, --num-heads or --threshold"
                         + (f" (got {', '.join(given)})" if given else ""))
    if target.scope not in SCOPES:
        raise UsageError(f"--scope must be one of {', '.join(SCOPES)} (got {target.scope!r})")
    if target.unit not in UNITS:
        raise UsageError(f"--unit must be one of {', '.join(UNITS)} (got {target.unit!r})")
    total = sum(g.num_heads for g in geometry)
    if target.fraction is not None and not (0.0 < target.fraction < 1.0):
        raise UsageError(f"--fraction must lie strictly between 0 and 1 (got {target.fraction})")
    if target.num_heads is not None:
        if target.num_heads < 1:
            raise UsageError(f"--num-heads must be at least 1 (got {target.num_heads})")
        if target.num_heads >= total:
            raise UsageError(f"--num-heads {target.num_heads}: the model has only {total} query heads "
                             "and every layer must keep at least one")
    if target.threshold is not None and (not math.isfinite(target.threshold)):
        raise UsageError(f"--threshold must be a finite number (got {target.threshold})")
    if target.threshold is not None and target.scope == "layer":
        raise UsageError("--threshold removes heads by value; it does not combine with --scope layer "
                         "(use --fraction or --num-heads)")
    check_min_heads(target.min_heads_per_layer, geometry)
    check_unit(target.unit, geometry)
    bad = [i for i in target.protect if not -len(geometry) <= i < len(geometry)]
    if bad:
        raise UsageError(f"--protect-layers: layer {bad[0]} does not exist (the model has layers "
                         f"0..{len(geometry) - 1})")


# `--protect-layers auto` (prune's default, requests.PruneRequest): the first layer in the global
# ranking of a model with more than one layer; none with --scope layer, which removes the same
# number everywhere as asked. Measured on SmolLM2-135M (gradient scores, per-layer normalized;
# --compensate; calibrated on builtin:pydoc+self; perplexity ratio on news / legal text the
# calibration never saw; benchmarks/results/cross_domain_protect*.json): 25% of query heads at
# 128 calibration blocks 1.27x / 2.17x with layer 0 in the ranking, 1.12x / 1.21x protected; 50% at
# 64 blocks 1.94x / 2.72x against 1.82x / 2.00x. Per-layer normalization ranks layer 0's weakest
# heads with the others although its raw importance is the largest of all layers, and removing any
# of them costs more than the refit can undo (the pruning literature keeps the first layers too).
PROTECT_GRAMMAR = 'a comma list of layer indices (negative counts from the end, e.g. "0,-1"), "none" or "auto"'


def parse_protect(text: str | None, scope: str = "global", num_layers: int | None = None) -> tuple[int, ...]:
    """`--protect-layers` text -> layer indices (range-checked later, against the model); `auto`
    is the first layer in the global ranking (none where there is no ranking across layers:
    --scope layer, or a model of one layer)."""
    if text is not None and text.strip().lower() == "auto":
        return (0,) if scope == "global" and (num_layers is None or num_layers > 1) else ()
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    out: list[int] = []
    for item in (i.strip() for i in text.split(",")):
        if not re.fullmatch(r"-?\d+", item):
            raise UsageError(f"--protect-layers: cannot read {item!r}; write {PROTECT_GRAMMAR}")
        if int(item) in out:
            raise UsageError(f"--protect-layers: layer {item} is listed twice")
        out.append(int(item))
    return tuple(out)


def check_unit(unit: str, geometry: Sequence[LayerHeads]) -> None:
    """--unit query and group step through equal KV groups: a layer whose groups already differ
    (an earlier --unit head prune) can only lose single heads."""
    uneven = [i for i, g in enumerate(geometry) if g.uneven]
    if uneven and unit != "head":
        raise UsageError(f"layer {uneven[0]} has KV groups of different sizes (pruned with --unit head); "
                         f"prune it again with --unit head, not --unit {unit}")


def resolve_unit(unit: str, geometry: Sequence[LayerHeads], compensate: bool = False, scope: str = "global") -> str:
    """--unit auto as a unit: `head` on a model whose KV groups already differ (nothing else can prune
    it) and, where some layer has several KV groups of several heads, for a compensated prune over all
    layers (at the refit's defaults, obs allocation, --anchor-power 3, --damping 0.001, better than
    `query` on SmolLM2 on every unseen set in every calibration sample; at the older one-anchor refit
    it was not: README "Heads removed in whole GQA steps or one at a time"); `query` otherwise:
    without a refit (not measured), with --scope layer, whose point is layers alike (a stock
    config), and on layers of more than BEAM_MAX_HEADS query heads, where single heads are chosen
    greedily (about 4x query's search on a synthetic 32-head layer) and were not measured for quality."""
    if unit != "auto":
        return unit
    if any(g.uneven for g in geometry):
        return "head"
    grouped = any(1 < g.num_kv_heads < g.num_heads for g in geometry)
    searchable = all(g.num_heads <= BEAM_MAX_HEADS for g in geometry)
    return "head" if grouped and searchable and compensate and scope == "global" else "query"


def check_min_heads(min_heads: int, geometry: Sequence[LayerHeads]) -> None:
    if min_heads < 1:
        raise UsageError(f"--min-heads-per-layer must be at least 1 (got {min_heads})")
    smallest = min(range(len(geometry)), key=lambda i: geometry[i].num_heads)
    if min_heads > geometry[smallest].num_heads:
        raise UsageError(f"--min-heads-per-layer {min_heads} is impossible: layer {smallest} has only "
                         f"{geometry[smallest].num_heads} query heads")


def check_scores(scores: Sequence[Sequence[float]], geometry: Sequence[LayerHeads]) -> list[list[float]]:
    """Scores as float lists, shaped like the model (layers x query heads), finite."""
    if len(scores) != len(geometry):
        raise UsageError(f"the scores have {len(scores)} layers, the model has {len(geometry)}")
    out = []
    for i, (row, g) in enumerate(zip(scores, geometry)):
        if len(row) != g.num_heads:
            raise UsageError(f"the scores have {len(row)} heads in layer {i}, the model has {g.num_heads}")
        vals = [float(v) for v in row]
        if not all(math.isfinite(v) for v in vals):
            raise UsageError(f"the scores of layer {i} are not all finite numbers")
        out.append(vals)
    return out


# ----------------------------------------------------------------------------- steps
def removal_steps(scores: Sequence[float], geo: LayerHeads, unit: str) -> list[list[int]]:
    """The order in which a layer loses heads, weakest first; each step a list of query heads.

    A layer is never emptied: the steps stop one unit short of removing every head. With
    `unit` head any single head is a step (the KV groups may end up different in size).
    """
    if unit == "head" or geo.num_heads == geo.num_kv_heads:
        # one by one (a KV head goes with the last query head that reads it)
        order = sorted(range(geo.num_heads), key=lambda h: (scores[h], h))
        return [[h] for h in order[:-1]]
    g = geo.group_size
    groups = [geo.query_heads_of(k) for k in range(geo.num_kv_heads)]
    if unit == "group":
        order = sorted(range(geo.num_kv_heads),
                       key=lambda k: (sum(scores[h] for h in groups[k]) / g, k))
        return [groups[k] for k in order[:-1]]
    ranked = [sorted(grp, key=lambda h: (scores[h], h)) for grp in groups]
    return [[r[j] for r in ranked] for j in range(g - 1)]


def _step_mean(step: Sequence[int], scores: Sequence[float]) -> float:
    return sum(scores[h] for h in step) / len(step)


def _allowed_steps(steps: list[list[int]], geo: LayerHeads, min_heads: int) -> list[list[int]]:
    out, left = [], geo.num_heads
    for s in steps:
        if left - len(s) < min_heads:
            break
        out.append(s)
        left -= len(s)
    return out


def _closest_prefix(sizes: Sequence[int], want: float) -> int:
    """How many steps (in order) bring the removed count closest to `want` (ties: fewer)."""
    best, best_n, total = abs(want), 0, 0
    for n, s in enumerate(sizes, 1):
        total += s
        if abs(total - want) < best - 1e-9:
            best, best_n = abs(total - want), n
    return best_n


def _unit_name(unit: str) -> str:
    return "whole KV groups" if unit == "group" else "one query head per KV group at a time"


def layer_steps(scores: Sequence[Sequence[float]], geometry: Sequence[LayerHeads], target: Target) -> list[list[list[int]]]:
    """Every layer's removal steps as `select_heads` may take them (weakest first by `scores`, within
    --min-heads-per-layer; none for protected layers): what an allocation that is not by scores splits."""
    scores = check_scores(scores, geometry)
    protected = target.protected(len(geometry))
    return [[] if i in protected else _allowed_steps(removal_steps(s, g, target.unit), g, target.min_heads_per_layer)
            for i, (s, g) in enumerate(zip(scores, geometry))]


def select_heads(scores: Sequence[Sequence[float]], geometry: Sequence[LayerHeads], target: Target) -> Selection:
    """The heads to keep per layer for `target`, from scores (higher = more important)."""
    geometry = list(geometry)
    check_target(target, geometry)
    scores = check_scores(scores, geometry)
    total = sum(g.num_heads for g in geometry)
    protected = target.protected(len(geometry))
    allowed = layer_steps(scores, geometry, target)
    removable = sum(len(st) for steps in allowed for st in steps)
    taken = [0] * len(geometry)  # steps taken per layer

    if target.scope == "layer":
        if target.num_heads is not None:
            if target.num_heads % len(geometry):
                raise UsageError(f"--scope layer removes the same number from every layer: --num-heads "
                                 f"{target.num_heads} is not a multiple of the {len(geometry)} layers")
            per_layer = [target.num_heads // len(geometry)] * len(geometry)
        else:
            per_layer = [target.fraction * g.num_heads for g in geometry]
        for i, (steps, want) in enumerate(zip(allowed, per_layer)):
            if i in protected:
                continue
            n = _closest_prefix([len(s) for s in steps], want)
            got = sum(len(s) for s in steps[:n])
            if target.num_heads is not None and got != want:
                raise UsageError(f"layer {i} cannot lose exactly {int(want)} query heads with --unit "
                                 f"{target.unit} ({_unit_name(target.unit)}) and --min-heads-per-layer "
                                 f"{target.min_heads_per_layer}")
            taken[i] = n
    else:
        ranked = sorted(((_step_mean(st, scores[i]), i, j, len(st))
                         for i, steps in enumerate(allowed) for j, st in enumerate(steps)))
        if target.threshold is not None:
            chosen = [r for r in ranked if r[0] < target.threshold]
        else:
            want = target.num_heads if target.num_heads is not None else target.fraction * total
            if round(want) > removable:
                raise UsageError(f"cannot remove {round(want)} query heads: at most {removable} of {total} can "
                                 f"go with --min-heads-per-layer {target.min_heads_per_layer}, --unit "
                                 f"{target.unit}" + (f" and --protect-layers {','.join(map(str, target.protect))}"
                                                     if target.protect else ""))
            chosen = ranked[:_closest_prefix([r[3] for r in ranked], want)]
        for _, i, j, _ in chosen:
            taken[i] = max(taken[i], j + 1)  # step order inside a layer is weakest first
    return selection_from_steps(geometry, allowed, taken)


def selection_from_steps(geometry: Sequence[LayerHeads], steps: Sequence[Sequence[Sequence[int]]],
                         taken: Sequence[int]) -> Selection:
    """The heads every layer keeps once its first taken[i] removal steps (`layer_steps`) are gone."""
    kept = []
    for g, st, n in zip(geometry, steps, taken):
        gone = {h for step in st[:n] for h in step}
        kept.append([h for h in range(g.num_heads) if h not in gone])
    # the steps obey their unit: groups differ only where single heads (--unit head) were steps
    return Selection.from_kept(geometry, kept, uneven=True)


# ----------------------------------------------------------------------------- explicit lists
# One grammar for `--heads` everywhere (prune, prune --streaming, recipes, inspect): layers
# separated by ';', each `LAYER:HEAD,HEAD...`. A comma-separated item that has a ':' starts a new
# layer, so the older pair list "3:1,5:0" (layer 3 head 1, layer 5 head 0) reads the same way.
HEADS_GRAMMAR = 'LAYER:HEAD,HEAD;LAYER:HEAD, e.g. "3:0,5;7:2" (layer 3 heads 0 and 5, layer 7 head 2)'
_ITEM = re.compile(r"^(?:(\d+)\s*:\s*)?(\d+)$")


def parse_heads(text: str, geometry: Sequence[LayerHeads], option: str = "--heads") -> dict[int, list[int]]:
    """Query heads per layer from a head list: `"3:0,5;7:2"` -> {3: [0, 5], 7: [2]}.

    Layers are separated by ';' and a comma-separated item with a ':' starts a new layer, so
    `"3:1,5:0"` -> {3: [1], 5: [0]} and `"3:0,5;7:2"` mean what they look like. A blank string
    lists nothing ({}: prune then reproduces the model); empty items between separators are
    skipped, but a list of separators only (";;") is a typo. Unknown layers, heads out of range,
    a head listed twice and anything else are a UsageError of one line.
    """
    if not text.strip():
        return {}
    found: dict[int, list[int]] = {}
    for seg in text.split(";"):
        layer: int | None = None
        for item in (i.strip() for i in seg.split(",")):
            if not item:
                continue
            m = _ITEM.match(item)
            if not m:
                raise UsageError(f"{option}: cannot read {item!r}; write {HEADS_GRAMMAR}")
            if m.group(1) is not None:
                layer = int(m.group(1))
            elif layer is None:
                raise UsageError(f"{option}: head {item} has no layer before it; write {HEADS_GRAMMAR}")
            head = int(m.group(2))
            if layer >= len(geometry):
                raise UsageError(f"{option}: layer {layer} does not exist (the model has layers "
                                 f"0..{len(geometry) - 1})")
            if head >= geometry[layer].num_heads:
                raise UsageError(f"{option}: layer {layer} has query heads 0..{geometry[layer].num_heads - 1}, "
                                 f"not {head}")
            if head in found.get(layer, ()):
                raise UsageError(f"{option}: layer {layer} head {head} is listed twice")
            found.setdefault(layer, []).append(head)
    if not found:
        raise UsageError(f"{option} {text!r} lists no heads; write {HEADS_GRAMMAR}")
    return {layer: sorted(h) for layer, h in sorted(found.items())}


def head_pairs(heads: dict[int, Sequence[int]]) -> list[tuple[int, int]]:
    """{3: [0, 5], 7: [2]} -> [(3, 0), (3, 5), (7, 2)]."""
    return [(layer, h) for layer, hs in sorted(heads.items()) for h in hs]


def selection_from_removed(removed: dict[int, Sequence[int]], geometry: Sequence[LayerHeads],
                           min_heads: int = 1, unit: str = "query") -> Selection:
    """A Selection that removes exactly the listed heads (checked against the GQA rules: equal KV
    groups unless `unit` is head, which a model with uneven groups needs)."""
    check_min_heads(min_heads, geometry)
    check_unit(unit, geometry)
    kept = []
    for i, g in enumerate(geometry):
        gone = set(removed.get(i, ()))
        k = [h for h in range(g.num_heads) if h not in gone]
        if len(k) < min_heads:
            raise UsageError(f"layer {i} would keep {len(k)} query heads, fewer than --min-heads-per-layer "
                             f"{min_heads}")
        if unit == "group":
            _check_whole_groups(i, g, gone)
        kept.append(k)
    return Selection.from_kept(geometry, kept, unit == "head")


def _check_whole_groups(layer: int, geo: LayerHeads, gone: set[int]) -> None:
    """--unit group removes whole KV groups: a listed set that splits a group is a UsageError naming the
    layer's groups (it was accepted and pruned as --unit query would)."""
    groups = [geo.query_heads_of(k) for k in range(geo.num_kv_heads)]
    split = [grp for grp in groups if gone & set(grp) and not set(grp) <= gone]
    if split:
        shown = " | ".join(",".join(map(str, grp)) for grp in groups)
        raise UsageError(f"--unit group removes whole KV groups: layer {layer} loses "
                         f"{', '.join(map(str, sorted(gone)))}, which splits the group {','.join(map(str, split[0]))} "
                         f"(its groups: {shown}); list whole groups, or use --unit query or head")


# ----------------------------------------------------------------------------- inside one layer
def _single_heads(geo: LayerHeads, unit: str) -> bool:
    """Whether `unit`'s steps in this layer are single query heads: --unit head, multi-head
    attention, or --unit query over one KV head."""
    return unit == "head" or geo.num_heads == geo.num_kv_heads or (unit == "query" and geo.num_kv_heads == 1)


def candidate_sets(geo: LayerHeads, n_remove: int, unit: str) -> list[list[int]] | None:
    """Every removal set of `n_remove` query heads obeying `unit`, or None when too many."""
    if n_remove == 0:
        return [[]]
    if _single_heads(geo, unit):
        pools, per = [list(range(geo.num_heads))], [n_remove]
    elif unit == "group":
        g = geo.group_size
        if n_remove % g:
            raise ValueError(f"{n_remove} is not a whole number of groups of {g}")
        n_groups = n_remove // g
        if math.comb(geo.num_kv_heads, n_groups) > EXHAUSTIVE_LIMIT:
            return None
        return [[h for k in ks for h in geo.query_heads_of(k)]
                for ks in itertools.combinations(range(geo.num_kv_heads), n_groups)]
    else:
        if n_remove % geo.num_kv_heads:
            raise ValueError(f"{n_remove} query heads cannot come equally from {geo.num_kv_heads} groups")
        pools = [geo.query_heads_of(k) for k in range(geo.num_kv_heads)]
        per = [n_remove // geo.num_kv_heads] * geo.num_kv_heads
    count = math.prod(math.comb(len(p), n) for p, n in zip(pools, per))
    if count > EXHAUSTIVE_LIMIT:
        return None
    per_pool = [list(itertools.combinations(p, n)) for p, n in zip(pools, per)]
    return [sorted(h for part in combo for h in part) for combo in itertools.product(*per_pool)]


def _rounds(geo: LayerHeads, n_remove: int, unit: str) -> list[list[list[int]]]:
    """The search's rounds for removing `n_remove` query heads under `unit`: each round adds one of
    its options (a unit) to the removal set."""
    if _single_heads(geo, unit):
        return [[[h] for h in range(geo.num_heads)]] * n_remove
    if unit == "group":
        return [[geo.query_heads_of(k) for k in range(geo.num_kv_heads)]] * (n_remove // geo.group_size)
    # one head from each group per round, group by group
    return [[[h] for h in geo.query_heads_of(k)] for _ in range(n_remove // geo.num_kv_heads)
            for k in range(geo.num_kv_heads)]


def _beam_evaluations(rounds: Sequence[Sequence[Sequence[int]]], width: int) -> int:
    """At most how many sets a beam of `width` costs over `rounds`: each kept set tries the options
    of the round that it does not hold yet (a round whose options an earlier round offered too has
    one fewer free option per such round)."""
    total, frontier = 0, 1
    for r, options in enumerate(rounds):
        free = len(options) - sum(1 for earlier in rounds[:r] if earlier == options)
        total += frontier * free
        frontier = min(width, frontier * free)
    return total


@runtime_checkable
class IncrementalCost(Protocol):
    """A removal cost that the beam can grow set by set instead of costing each from scratch
    (compensation.RemovalCost): `start()` is the empty set's state, `extensions(state, units)` the
    cost of the state's set plus each unit, `extend(state, unit)` the state of that larger set."""

    def __call__(self, heads: list[int]) -> float: ...

    def start(self) -> Any: ...

    def extensions(self, state: Any, units: Sequence[Sequence[int]]) -> list[float]: ...

    def extend(self, state: Any, unit: Sequence[int]) -> Any: ...


class _FromScratch:
    """A plain cost(heads) seen as an IncrementalCost: the state is the set, every set costed anew."""

    def __init__(self, cost: Callable[[list[int]], float]):
        self.cost = cost

    def __call__(self, heads: list[int]) -> float:
        return self.cost(heads)

    def start(self) -> list[int]:
        return []

    def extensions(self, state: list[int], units: Sequence[Sequence[int]]) -> list[float]:
        return [self.cost(sorted(state + list(u))) for u in units]

    def extend(self, state: list[int], unit: Sequence[int]) -> list[int]:
        return state + list(unit)


def choose_removals(geo: LayerHeads, counts: Sequence[int], unit: str,
                    cost: Callable[[list[int]], float]) -> dict[int, list[int]]:
    """For every count in `counts`, the removal set of that many query heads (obeying `unit`) with
    the lowest `cost` that the search finds.

    Exhaustive where that tries no more sets than the beam would (then exact); else a beam search of
    BEAM_WIDTH over the unit's rounds: each round extends every kept set by one unit and keeps the
    BEAM_WIDTH cheapest (ties: the lower heads), and one pass serves every count. On SmolLM2's
    layers (9 query heads, --unit head, the costs of `prune --normalize obs` for every count 1-8, two
    calibrations: 32 blocks of builtin:pydoc, 64 of builtin:pydoc+self) a beam of 8 found the
    exhaustive optimum in all 464 layer-counts at a third of its time; 5 missed 3 of them (by 2-8% of
    the layer's cost), one set a round (greedy) 7 of 232, by up to 36%. Layers of more than
    BEAM_MAX_HEADS query heads keep one set a round (greedy, as before the beam: there the beam costs
    8x greedy, for a gain not measured). An IncrementalCost grows each kept set's state by the round's
    units (one batched step a set) instead of costing every set from scratch.
    """
    wanted = sorted({n for n in counts if n})
    out: dict[int, list[int]] = {0: []} if 0 in counts else {}
    if not wanted:
        return out
    rounds = _rounds(geo, wanted[-1], unit)
    width = BEAM_WIDTH if geo.num_heads <= BEAM_MAX_HEADS else 1
    exhaustive = [candidate_sets(geo, n, unit) for n in wanted]
    if all(sets is not None for sets in exhaustive) and \
            sum(map(len, exhaustive)) <= _beam_evaluations(rounds, width):
        for n, sets in zip(wanted, exhaustive):
            out[n] = min(sets, key=lambda s: (cost(s), s))
        return out
    grow = cost if isinstance(cost, IncrementalCost) else _FromScratch(cost)
    # the kept sets: (cost, heads, the state they grew from, the unit they added); a kept set's own
    # state is made only when a next round extends it
    frontier: list[tuple[float, list[int], Any, list[int] | None]] = [(0.0, [], grow.start(), None)]
    for options in rounds:
        tried: dict[tuple[int, ...], tuple[float, int, list[int]]] = {}
        states = [parent if added is None else grow.extend(parent, added) for _, _, parent, added in frontier]
        for p, (_, removed, _, _) in enumerate(frontier):
            taken = set(removed)
            fresh = {tuple(sorted(removed + u)): u for u in options if not taken & set(u)}
            fresh = {k: u for k, u in fresh.items() if k not in tried}
            for (key, u), c in zip(fresh.items(), grow.extensions(states[p], list(fresh.values()))):
                tried[key] = (c, p, u)
        best = sorted(tried.items(), key=lambda kv: (kv[1][0], kv[0]))[:width]
        frontier = [(c, list(key), states[p], u) for key, (c, p, u) in best]
        n = len(frontier[0][1])
        if n in wanted:
            out[n] = frontier[0][1]
    return out


def choose_removal(geo: LayerHeads, n_remove: int, unit: str,
                   cost: Callable[[list[int]], float]) -> list[int]:
    """The removal set of `n_remove` query heads (obeying `unit`) with the lowest `cost` found
    (`choose_removals`)."""
    return choose_removals(geo, [n_remove], unit, cost)[n_remove]
