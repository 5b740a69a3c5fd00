"""Head importance scores: how much each attention head matters, measured through its gate.

Every data-driven method works on the per-head gates of `headtool.measure.gates` (a head's slice of
the output-projection input times g_h), so one implementation serves every family and
attention kernel:

- `gradient` (Michel et al. 2019): I_h = mean over tokens of |dL_x/dg_h| at g = 1, with L_x the
  loss of example x. Gates with a batch dimension give every example's gradient in one
  backward; parameters are frozen, so no weight gradient is ever computed or stored.
- `fisher` (Kwon et al. 2022): (1 / 2N) * sum over examples of (dS_x/dg_h)^2, S_x the summed
  loss of example x and N the number of loss positions. `gradient` switches to this form for
  `kl`, whose gradient at g = 1 is exactly zero; targets are then drawn from the model's own
  predictions (see `objectives.fisher_sample_losses`), and the score is the second-order
  estimate of the kl increase when the head is gated off.
- `ablation`: the exact increase of the mean loss when head h alone is gated to 0. The hidden
  states entering layer l are computed once per batch; each replay runs only layers l..L-1
  (earlier layers return the cached states) for several heads at once, the batch repeated with
  per-example gates.
- `taylor` (as TextPruner): |sum over head h's output-projection slice of W * dL/dW| per
  batch. That sum equals dL_batch/dg_h exactly, so it comes from the same single backward.
- `magnitude`: the L2 norm of the head's q, k, v, o weights and biases (no data).
- `random`: seeded uniform numbers (a baseline).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..arch import Adapter, LayerHeads
from ..arch.heads import extract_heads, layer_tensor_names
from ..console import progress
from ..data.batches import to_device
from ..distributed import combine_means, rank_and_world, shard
from ..errors import HeadtoolError, UsageError
from ..model.placement import input_device, readable_weights
from .gates import head_gates
from .layerwise import patched_forwards
from .objectives import (
    divergence,
    fisher_sample_losses,
    forward_output,
    objective_losses,
)

METHODS = ("gradient", "ablation", "taylor", "fisher", "magnitude", "random")
DATA_METHODS = ("gradient", "ablation", "taylor", "fisher")
NORMALIZE = ("auto", "layer", "geometric", "none")
#: the power of a layer's L2 norm that its scores are divided by: 1 puts every layer on one scale (Michel),
#: 0 leaves the loss estimates as they are, 0.5 is the geometric mean of the two
NORM_POWER = {"layer": 1.0, "geometric": 0.5, "none": 0.0}

# What each method's raw number is (recorded in the score document as `estimator`).
ESTIMATORS = {
    "gradient": "mean |dL/dg| over tokens",
    "fisher": "Fisher: sum of squared per-example dS/dg over 2N",
    "ablation": "loss increase when gated to 0",
    "taylor": "|sum W*dL/dW| over the output-projection slice, per batch",
    "magnitude": "L2 norm of the head's q,k,v,o weights",
    "random": "uniform [0, 1), seeded",
}

# Memory that the outputs of one batched ablation pass may take (the batch is repeated once
# per head evaluated together); override with `ablation_chunk`.
ABLATION_MEMORY_BYTES = 1 << 30

Matrix = list[list[float]]


@dataclass
class ScoreResult:
    """Scores of one run; `scores` is what selection uses (higher = more important)."""

    method: str  # the method asked for
    estimator: str  # "gradient", "fisher", "ablation", ... (what was computed)
    objective: str | None
    normalize: str
    scores: Matrix
    raw_scores: Matrix
    baseline_loss: float | None
    loss_positions: int = 0
    passes: int = 0  # forward passes (a forward + backward counts once)
    removal_order: list[list[int]] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0


# --------------------------------------------------------------------------- small pure helpers


def resolve_normalize(normalize: str, method: str) -> str:
    """'auto': per-layer L2 for gradient-type scores (Michel), none for loss increases and baselines."""
    if normalize not in NORMALIZE:
        raise UsageError(f"unknown --normalize {normalize!r}; use one of {', '.join(NORMALIZE)}")
    if normalize == "auto":
        return "layer" if method in ("gradient", "taylor", "fisher") else "none"
    return normalize


def normalize_scores(raw: Matrix, mode: str, alive: Sequence[Sequence[bool]] | None = None) -> Matrix:
    """Scores divided by their layer's L2 norm over the heads still alive (others left as they are) to
    the power NORM_POWER[mode]: 1 (layer) ranks every layer's heads on one scale, so each layer loses
    about as many; 0 (none) keeps the loss estimates, which take the most from the late layers;
    geometric, between them, helped at 50% of SmolLM2-135M's heads (measured, see prune --normalize)."""
    power = NORM_POWER[mode]
    if not power:
        return [list(r) for r in raw]
    out = []
    for i, row in enumerate(raw):
        live = [v for j, v in enumerate(row) if alive is None or alive[i][j]]
        scale = math.sqrt(math.fsum(v * v for v in live)) ** power
        out.append([v / scale if scale > 0 and (alive is None or alive[i][j]) else v for j, v in enumerate(row)])
    return out


def kv_group_scores(scores: Matrix, geometry: Sequence[LayerHeads]) -> Matrix:
    """Sum over each KV group's query heads (equals `scores` for multi-head attention)."""
    return [[math.fsum(row[h] for h in g.query_heads_of(k)) for k in range(g.num_kv_heads)]
            for row, g in zip(scores, geometry)]


def random_scores(geometry: Sequence[LayerHeads], seed: int) -> Matrix:
    gen = torch.Generator().manual_seed(int(seed))
    flat = torch.rand(sum(g.num_heads for g in geometry), generator=gen, dtype=torch.float64).tolist()
    out, k = [], 0
    for g in geometry:
        out.append(flat[k:k + g.num_heads])
        k += g.num_heads
    return out


def magnitude_scores(model: nn.Module, adapter: Adapter, geometry: Sequence[LayerHeads]) -> Matrix:
    """sqrt(|q_h|^2 + |o_h|^2 + (|k_g|^2 + |v_g|^2) / group size) over weights and biases.

    A KV head's weights are shared by its group, so each member carries an equal share.
    """
    from ..model.latent import latent_spec

    if latent_spec(model.config):  # it failed naming a missing k_proj weight
        raise UsageError("--method magnitude reads each head's K/V weights, which latent attention (a convert-mla "
                         "output) keeps in one shared latent: score it with a data method (gradient, ablation, ...)")
    sd = readable_weights(model)  # offloaded weights too, read one at a time
    out = []
    for i, geo in enumerate(geometry):
        total = torch.zeros(geo.num_heads, dtype=torch.float64)
        prefix = adapter.layer_prefix(model, i)
        for key, ht in layer_tensor_names(adapter, prefix, sd.keys()):
            for kind in ht.kinds:
                sq = extract_heads(sd[key], ht, geo, kind).detach().double().pow(2).flatten(1).sum(1).cpu()
                if kind in ("q", "o"):
                    total += sq
                else:  # a KV head's weight shared among the query heads that read it
                    sizes = torch.tensor(geo.sizes())
                    total += (sq / sizes).repeat_interleave(sizes)
        out.append(total.sqrt().tolist())
    return out


def removal_counts(total_heads: int, rounds: int, fraction: float | None, per_round: float | None) -> list[int]:
    """Heads to gate off after each round: `per_round` of all heads each time, or `fraction`
    of all heads spread evenly over the rounds (default fraction 0.5)."""
    if rounds < 1:
        raise UsageError(f"--iterative must be at least 1, got {rounds}")
    if per_round is not None:
        if not 0 < per_round < 1:
            raise UsageError(f"--iterative-fraction must be in (0, 1), got {per_round}")
        return [max(1, round(per_round * total_heads))] * rounds
    f = 0.5 if fraction is None else fraction
    if not 0 < f < 1:
        raise UsageError(f"--fraction must be in (0, 1), got {f}")
    target = round(f * total_heads)
    return [(r + 1) * target // rounds - r * target // rounds for r in range(rounds)]


def weakest_heads(scores: Matrix, alive: list[list[bool]], count: int) -> list[list[int]]:
    """The `count` lowest-scoring live heads (ties by position), keeping one head per layer."""
    left = [sum(r) for r in alive]
    cands = sorted(((v, i, j) for i, r in enumerate(scores) for j, v in enumerate(r) if alive[i][j]))
    out = []
    for _, i, j in cands:
        if len(out) == count:
            break
        if left[i] > 1:
            left[i] -= 1
            out.append([i, j])
    return out


def order_consistent_scores(last: Matrix, alive_last: list[list[bool]], order_before: list[list[int]]) -> Matrix:
    """Scores for iterative runs: the last round's scores for heads still scored in it, and
    below the lowest of those, heads removed earlier, the first removed lowest (evenly spaced).

    Selecting the k lowest then always agrees with the order in which heads fell.
    """
    live = [v for i, r in enumerate(last) for j, v in enumerate(r) if alive_last[i][j]]
    lo, hi = min(live), max(live)
    step = (hi - lo) / max(len(live), 1) or (abs(lo) or 1.0) / max(len(live), 1)
    out = [list(r) for r in last]
    m = len(order_before)
    for k, (i, j) in enumerate(order_before):
        out[i][j] = lo - (m - k) * step
    return out


# --------------------------------------------------------------------------- model plumbing


@contextmanager
def scoring_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode with frozen parameters (only gates get gradients); restored on exit."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)


def _repeat(x: Any, k: int, batch: int) -> Any:
    """`x` with its batch dimension repeated k times (copy i at rows i*B:(i+1)*B)."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
        return x.repeat(k, *([1] * (x.dim() - 1)))
    if isinstance(x, tuple):
        return tuple(_repeat(t, k, batch) for t in x)
    return x


class _LayerCache:
    """Records, during one forward, the hidden states entering and leaving every layer."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = layers
        self.inputs: list[torch.Tensor | None] = [None] * len(layers)
        self.outputs: list[Any] = [None] * len(layers)

    @contextmanager
    def recording(self) -> Iterator["_LayerCache"]:
        handles = []
        for i, layer in enumerate(self.layers):
            def pre(mod, args, kwargs, i=i):
                self.inputs[i] = args[0] if args else kwargs["hidden_states"]

            def post(mod, args, kwargs, out, i=i):
                self.outputs[i] = out

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


@contextmanager
def _start_at_layer(layers: Sequence[nn.Module], start: int, hidden: torch.Tensor, placeholder: Any) -> Iterator[None]:
    """Run a forward from layer `start` on: earlier layers return `placeholder` without
    computing, and layer `start` receives `hidden` as its input hidden states.

    Embeddings, masks and position embeddings are still built by the model itself from the
    (repeated) inputs, so this works for every family without knowing its forward.
    """
    def skip(*args, **kwargs):
        return placeholder

    def replace(mod, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    with patched_forwards(layers[:start], lambda i, real: skip):
        handle = layers[start].register_forward_pre_hook(replace, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def _gate_dtype(model: nn.Module) -> torch.dtype:
    dt = next(model.parameters()).dtype
    return torch.float64 if dt == torch.float64 else torch.float32


def _mask_tensors(alive: list[list[bool]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [torch.tensor([1.0 if a else 0.0 for a in row], dtype=dtype, device=device) for row in alive]


def _check_finite(value: float, label: str, batch: int, what: str = "") -> None:
    if not math.isfinite(value):
        raise HeadtoolError(f"{label}: the loss is not finite on batch {batch}{what}; "
                            "try --dtype float32 or check the data")


def _tokens(batch: dict) -> int:
    return int(batch["input_ids"].numel())


# --------------------------------------------------------------------------- gradient-type methods


def _gradient_round(model, adapter, geometry, batches, objective, estimator, alive, seed, bar, task, label,
                    probe=None):
    """One forward + backward per batch for all heads; accumulates the chosen estimator. With `probe` (an
    attached SensitivityProbe), the same backward also gives it the gradients at its leaves."""
    device = input_device(model)
    gdtype = _gate_dtype(model)
    masks = _mask_tensors(alive, gdtype, device)
    acc = [torch.zeros(g.num_heads, dtype=torch.float64) for g in geometry]
    total = weight = 0.0
    gen = torch.Generator().manual_seed(int(seed))
    t0, seen = time.perf_counter(), 0
    with head_gates(model, adapter, geometry=geometry, dtype=gdtype) as gates, torch.enable_grad():
        for bi, batch in enumerate(batches):
            b = to_device(batch, device)
            n = b["input_ids"].shape[0]
            leaves = [m.expand(n, -1).clone().requires_grad_(True) for m in masks]
            gates.values[:] = leaves
            if probe is not None:
                probe.start_batch()
            out, is_logits = forward_output(model, b)
            if objective == "kl":
                losses, w = fisher_sample_losses(out, b, is_logits, gen)
                base = 0.0
            else:
                losses, w = objective_losses(objective, out, b)
                base = None
            s = (losses * w).sum()
            s_value = float(s.detach())
            _check_finite(s_value, label, bi)
            extra = probe.leaves() if probe is not None else []
            grads = torch.autograd.grad(s, leaves + extra, allow_unused=True)
            if probe is not None:  # its objective is the mean over the batch's weighted tokens
                probe.add_gradients(grads[len(leaves):], 1.0 / max(float(w.sum()), 1.0), _tokens(b))
                grads = grads[:len(leaves)]
            total += s_value if base is None else base
            weight += float(w.sum())
            for i, g in enumerate(grads):
                if g is None:
                    continue
                g = g.detach().double()
                if estimator == "gradient":
                    acc[i] += g.abs().sum(0).cpu()
                elif estimator == "taylor":
                    acc[i] += g.sum(0).abs().cpu()
                else:
                    acc[i] += g.pow(2).sum(0).cpu()
            seen += _tokens(b)
            bar.update(task, advance=1, rate=f"{seen / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
    scale = 1.0 / max(weight, 1.0) * (0.5 if estimator == "fisher" else 1.0)
    raw = [(a * scale).tolist() for a in acc]
    return raw, total / max(weight, 1.0), int(weight), len(batches)


# --------------------------------------------------------------------------- ablation


def _chunk_size(model, geometry, batch: dict, out_dim: int, requested: int | None) -> int:
    if requested:
        return max(1, int(requested))
    n, t = batch["input_ids"].shape[:2]
    hidden = getattr(model.config, "hidden_size", None) or out_dim
    heads = max(g.num_heads for g in geometry)
    per_copy = 4 * n * t * (3 * out_dim + 12 * hidden + 2 * heads * t)
    return max(1, ABLATION_MEMORY_BYTES // max(per_copy, 1))


def _chunks(items: list[int], k: int) -> list[list[int]]:
    """Split into ceil(len/k) nearly equal chunks (9 heads, k=4 -> 3,3,3 rather than 4,4,1)."""
    if not items:
        return []
    n = -(-len(items) // k)
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _ablation_passes(alive, k: int) -> int:
    return sum(len(_chunks([j for j, a in enumerate(r) if a], k)) for r in alive)


def _ablation_round(model, adapter, geometry, batches, objective, alive, chunk, bar, task, label):
    """Exact loss increases; per batch one full forward, then replays from each layer on."""
    device = input_device(model)
    gdtype = _gate_dtype(model)
    masks = _mask_tensors(alive, gdtype, device)
    layers = [adapter.layer_module(model, i) for i in range(len(geometry))]
    cache = _LayerCache(layers)
    diff = [torch.zeros(g.num_heads, dtype=torch.float64) for g in geometry]
    total = weight = 0.0
    passes = 0
    t0, seen = time.perf_counter(), 0
    with head_gates(model, adapter, geometry=geometry, dtype=gdtype) as gates, torch.inference_mode():
        gates.values[:] = masks
        for bi, batch in enumerate(batches):
            b = to_device(batch, device)
            n = b["input_ids"].shape[0]
            with cache.recording():
                out0, is_logits = forward_output(model, b)
            passes += 1
            ref = out0 if objective == "kl" else None
            l0, w = objective_losses(objective, out0, b, ref, is_logits)
            s0 = float((l0 * w).sum())
            _check_finite(s0, label, bi)
            total += s0
            weight += float(w.sum())
            seen += _tokens(b)
            k = _chunk_size(model, geometry, b, out0.shape[-1], chunk)
            for li, geo in enumerate(geometry):
                for heads in _chunks([j for j in range(geo.num_heads) if alive[li][j]], k):
                    c = len(heads)
                    g = masks[li].expand(c * n, -1).clone()
                    for ci, h in enumerate(heads):
                        g[ci * n:(ci + 1) * n, h] = 0.0
                    hidden = _repeat(cache.inputs[li], c, n)
                    placeholder = _repeat(cache.outputs[li - 1], c, n) if li else None
                    if isinstance(placeholder, torch.Tensor):
                        placeholder = hidden  # the usual case: layer l-1's output is layer l's input
                    gates.values[li] = g
                    try:
                        with _start_at_layer(layers, li, hidden, placeholder):
                            out, _ = forward_output(model, _repeat_batch(b, c, n))
                    finally:
                        gates.values[li] = masks[li]
                    passes += 1
                    d = _copy_loss_increase(objective, out, b, c, n, l0, w, ref, is_logits)
                    for ci, h in enumerate(heads):
                        _check_finite(float(d[ci]), label, bi, f" with head {li}.{h} gated off")
                        diff[li][h] += float(d[ci])
                    seen += c * _tokens(b)
                    bar.update(task, advance=1, rate=f"{seen / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
            bar.update(task, advance=1)
            cache.inputs = [None] * len(layers)
            cache.outputs = [None] * len(layers)
    raw = [(d / max(weight, 1.0)).tolist() for d in diff]
    return raw, total / max(weight, 1.0), int(weight), passes


def _repeat_batch(b: dict, c: int, n: int) -> dict:
    return {k: _repeat(v, c, n) for k, v in b.items()}


def _copy_loss_increase(objective, out, b, c, n, l0, w, ref, is_logits) -> torch.Tensor:
    """Summed loss increase of each of the c copies in a repeated-batch output (float64 [c])."""
    if objective == "kl":  # the reference broadcasts over a leading copies dimension
        o = out.view(c, n, *out.shape[1:])
        if o.dim() == 3:  # pooled [c, n, C]
            d, ww = divergence(o[:, :, None], ref[:, None], None, is_logits)
        else:
            d, ww = divergence(o, ref, b.get("attention_mask"), is_logits)
        return (d * ww).reshape(c, -1).sum(1).double()
    lr, wr = objective_losses(objective, out, _repeat_batch(b, c, n))
    return ((lr - l0.repeat(c, *([1] * (l0.dim() - 1)))) * wr).reshape(c, -1).sum(1).double()


# --------------------------------------------------------------------------- entry point


def check_method(method: str, objective: str | None) -> str:
    """The estimator a method computes for an objective (UsageError for impossible pairs)."""
    if method not in METHODS:
        raise UsageError(f"unknown --method {method!r}; use one of {', '.join(METHODS)}")
    if method == "taylor" and objective == "kl":
        raise UsageError("taylor is a first-order estimate and the kl objective's gradient at the "
                         "unpruned model is exactly zero; use --method gradient (Fisher form) or ablation")
    if method == "gradient" and objective == "kl":
        return "fisher"
    return method


def carries_probe(method: str, objective: str | None, iterative: int = 0) -> bool:
    """Whether scoring with `method` on `objective` runs the passes a SensitivityProbe can ride on: one
    round of a gradient-type estimator of the lm or mlm loss itself, in one process (its statistics are
    then those of `layer_sensitivity` on the same blocks)."""
    return (not iterative and objective in ("lm", "mlm") and method in DATA_METHODS
            and check_method(method, objective) in ("gradient", "taylor", "fisher") and rank_and_world()[1] == 1)


def score_heads(
    model: nn.Module,
    adapter: Adapter,
    batches: Sequence[dict] | None,
    *,
    method: str = "gradient",
    objective: str | None = "lm",
    normalize: str = "auto",
    iterative: int = 0,
    fraction: float | None = None,
    iterative_fraction: float | None = None,
    seed: int = 0,
    geometry: Sequence[LayerHeads] | None = None,
    ablation_chunk: int | None = None,
    label: str = "score",
    probe: Any = None,
) -> ScoreResult:
    """Importance of every head of `model` on `batches` (None for magnitude / random).

    `objective` is a resolved objective ('lm', 'mlm', 'classification', 'kl'). With
    `iterative` = K > 0, K rounds of scoring each followed by gating off the weakest heads;
    `removal_order` then lists the heads in the order they fell. `probe` (a SensitivityProbe, not
    attached) collects prune --normalize obs's layer sensitivity on the same forward and backward
    passes: one round of a gradient-type method on the model's own loss, in one process.
    """
    t_start = time.perf_counter()
    geometry = list(geometry or adapter.geometry(model.config))
    estimator = check_method(method, objective)
    if probe is not None and not carries_probe(method, objective, iterative):
        raise ValueError("a sensitivity probe rides on one round of gradient scoring of the lm or mlm loss, "
                         "in one process")
    norm = resolve_normalize(normalize, method)
    if method in ("magnitude", "random"):
        if iterative:
            raise UsageError(f"--iterative needs a data-driven method ({', '.join(DATA_METHODS)}); "
                             f"{method} scores do not change when heads are gated off")
        raw = magnitude_scores(model, adapter, geometry) if method == "magnitude" else random_scores(geometry, seed)
        return ScoreResult(method, estimator, None, norm, normalize_scores(raw, norm), raw, None,
                           elapsed_s=time.perf_counter() - t_start)
    if not batches:
        raise UsageError(f"--method {method} needs data (--data)")
    rank, world = rank_and_world()
    if world > 1:
        if len(batches) < world:
            raise UsageError(f"{len(batches)} batches for {world} processes: give more --max-samples")
        batches = shard(batches)
    n_rounds = iterative or 1
    counts = removal_counts(sum(g.num_heads for g in geometry), n_rounds, fraction, iterative_fraction) \
        if iterative else [0]
    gateable = sum(max(g.num_heads - 1, 0) for g in geometry)  # weakest_heads keeps one head per layer
    if sum(counts) > gateable:  # (the last rounds gated off fewer heads than asked, or none, and said nothing)
        asked = f"--iterative-fraction {iterative_fraction}" if iterative_fraction is not None else \
            f"--fraction {0.5 if fraction is None else fraction}"
        raise UsageError(f"--iterative {iterative} with {asked} gates off {sum(counts)} of the "
                         f"{sum(g.num_heads for g in geometry)} heads, but one head per layer stays: at most "
                         f"{gateable} can go; lower {asked.split()[0]}")
    if iterative and 0 in counts:  # (those rounds re-scored the model and gated off nothing: 94 of --iterative 100)
        target = sum(counts)
        raise UsageError(f"--iterative {iterative} with --fraction {0.5 if fraction is None else fraction} gates off "
                         f"{target} of the {sum(g.num_heads for g in geometry)} heads, fewer than one a round: "
                         f"give --iterative {target} or fewer" + (", or a higher --fraction" if target < gateable else
                                                                  " (one head per layer always stays)"))
    alive = [[True] * g.num_heads for g in geometry]
    last_raw: Matrix = [[0.0] * g.num_heads for g in geometry]
    order: list[list[int]] = []
    rounds: list[dict[str, Any]] = []
    baseline = None
    positions = passes = 0
    if estimator == "ablation":
        k0 = ablation_chunk or _chunk_size(model, geometry, batches[0], _out_dim(model), None)
        total_steps = sum(len(batches) * (1 + _ablation_passes(alive, k0)) for _ in range(n_rounds))
    else:
        total_steps = n_rounds * len(batches)
    with scoring_mode(model), progress() as bar, (probe.attached() if probe is not None else nullcontext()):
        task = bar.add_task(f"{label} ({estimator})", total=total_steps, rate="")
        for r in range(n_rounds):
            if estimator == "ablation":
                raw, loss, positions, p = _ablation_round(model, adapter, geometry, batches, objective, alive,
                                                          ablation_chunk, bar, task, label)
            else:
                raw, loss, positions, p = _gradient_round(model, adapter, geometry, batches, objective, estimator,
                                                          alive, seed, bar, task, label, probe)
            raw, loss, positions = combine_means(raw, loss, positions)  # data parallel: all ranks agree
            positions = int(positions)
            passes += p
            baseline = loss if baseline is None else baseline
            normed = normalize_scores(raw, norm, alive)
            for i, row in enumerate(raw):
                for j, v in enumerate(row):
                    if alive[i][j]:
                        last_raw[i][j] = v
            gone = weakest_heads(normed, alive, counts[r]) if iterative else []
            rounds.append({"round": r + 1, "loss": loss, "heads_alive": sum(map(sum, alive)),
                           "raw_scores": [[v if alive[i][j] else None for j, v in enumerate(row)]
                                          for i, row in enumerate(raw)],
                           "removed": gone})
            if r == n_rounds - 1:
                alive_last = [list(a) for a in alive]
                final = order_consistent_scores(normed, alive_last, order) if iterative else normed
            for i, j in gone:
                alive[i][j] = False
            order += gone
    return ScoreResult(method, estimator, objective, norm, final, last_raw, baseline, positions, passes,
                       removal_order=order if iterative else None, rounds=rounds if iterative else [],
                       elapsed_s=time.perf_counter() - t_start)


def _out_dim(model: nn.Module) -> int:
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    return int(getattr(model.config, "hidden_size", 0) or getattr(model.config, "n_embd", 1))
