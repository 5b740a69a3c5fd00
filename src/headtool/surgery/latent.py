"""K/V heads into one shared latent per token: multi-head latent attention (convert-mla).

A layer with H query heads reading K KV heads of head_dim d (r rotary dims, rotate_half planes
(p, p + r/2), P = r/2 of them) becomes, per token, one latent z (kv_rank dims) and one rotary
key shared by all query heads (rope_dim dims = n complex slots). All statistics come from the
Gram matrix of the attention input x~ = [x, 1] (`calibration.attention_input_grams`), as for
K/V merging (`merging`), whose plane helpers this module shares.

1. RoRoPE (as TransMLA): on every frequency plane p, the K heads' planes are complex numbers
   k_j; a unitary K x K mix U_p across heads, k'_m = sum_j U_p[m, j] k_j, commutes with the
   rotary embedding (which multiplies every plane by the same e^{i theta_p t}). Query head h
   (reading KV head j(h)) then scores sum_m Re(U_p[m, j(h)] q_h conj(k'_m)) on that plane:
   exactly its old score. U_p diagonalizes the key moments E[k_a conj(k_b)] (PCA of the key
   energy per frequency), so the leading rotated heads carry most of it. TransMLA uses a real
   orthogonal mix applied to both coordinates of a plane; a unitary one is the same kind of map
   (complex scalars are rotation-scalings of a plane, which commute with RoPE) and concentrates
   at least as much energy.
2. The rotary key: the n slots (p, m) with the most key energy times query energy keep RoPE and
   form the shared rotary key; each query head gets the matching rotary query U_p[m, j(h)] q_h^p,
   a map of its own query (q_rope_proj, rope_dim x d per head), so q_proj stays as it was.
3. The rest of K (the other slots, whose RoPE is dropped, and dims that never rotated) and all
   of V are compressed into the latent: Y = [k_nope; v] = C x~ is approximated by B A x~ with
   A = U_R^T W^1/2 C and B = W^-1/2 U_R, U_R the leading eigenvectors of W^1/2 C G~ C^T W^1/2
   (activation-whitened SVD; G~ the Gram ridge-regularized by `damping`). W weighs key errors by
   what the queries read (sum_h L_j(h)^T E[q_h q_h^T] L_j(h)) and value errors by the output
   projection (sum_h W_o^h^T W_o^h), K and V each normalized to its total (TransMLA's balance),
   then keys weighted by `key_weight` (DEFAULT_KEY_WEIGHT; `balance="output"` instead weighs a
   key error by how far it moves the head's output to first order).
4. Per query head, the key up-projection W_uk^h = L_j(h) B_k maps the latent to the no-RoPE key
   in the head's own d coordinates (so the head's no-RoPE query is its original query, without
   RoPE), and W_uv^h = B_v rows of head j(h); at decode both are absorbed (see the modeling file).
At full rank (kv_rank = every dim of Y, rope_dim = K x r) every step is exact.

Families without RoPE (GPT-2, OPT) have no planes: no rotary key, all of K and V in the latent.
Families that RMS-norm every q and k head before RoPE (Qwen 3, Gemma 3) have no affine q and k:
there the same steps run over features instead of x~ (`normed_blocks`): the queries over each
head's normed query, K and V over f~ = [normed keys, values, 1], with their Grams from
`calibration.normed_head_grams`; the layer keeps its q/k projections and norms to compute them
(the value rows of the latent projection fold through v_proj onto x~).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..arch import Adapter, LayerHeads, latent_families
from ..arch.heads import layer_tensor_names
from ..errors import UsageError
from ..measure.calibration import NormedGrams, attention_input_grams, normed_head_grams
from ..model.info import conversion_figures, model_info
from ..model.latent import install_latent
from ..model.placement import require_resident_weights
from .compensation import DEFAULT_ANCHOR, sequential_refit
from .merging import Blocks, _one_thread, _planes, _plane_moments, read_blocks

DEFAULT_DAMPING = 1e-2  # ridge on the Gram, relative to its mean diagonal
# weight of key errors against value errors in the latent, each relative to its own total.
# Measured on SmolLM2-135M (pydoc calibration, no refit, perplexity ratio on unseen prose):
# kv_rank 64 + rope_dim 64 (33% of the cache) 4.76x at 1, 3.93x at 0.25, 3.81x at 0.1, 3.86x
# at 0; kv_rank 32 + rope_dim 16 (12.5%) 18.3x at 1, 16.9x at 0.25. Values lose more than keys.
DEFAULT_KEY_WEIGHT = 0.25
BALANCES = ("normalized", "output")
_WEIGHT_FLOOR = 1e-3  # floor of the error weights W, relative to their mean eigenvalue
_EPS = 1e-12


# --------------------------------------------------------------------------- limits
def latent_dims(geo: LayerHeads, rot_dim: int, rope_dim: int) -> int:
    """Dims of Y = [k_nope; v] of a layer: the largest useful kv_rank (full rank, exact)."""
    return 2 * geo.num_kv_heads * geo.head_dim - rope_dim


def check_latent_target(adapter: Adapter, config, geometry: Sequence[LayerHeads], kv_rank: int | Sequence[int],
                        rope_dim: int) -> list[int]:
    """kv_rank per layer, or a UsageError (exit 2) naming what cannot be expressed."""
    if not adapter.latent:
        raise UsageError(f"convert-mla: the {adapter.family} family is not supported yet (supported: "
                         f"{', '.join(latent_families())})")
    rot = [adapter.rotary_dim(config, g.head_dim) for g in geometry]
    max_rope = min(g.num_kv_heads * r for g, r in zip(geometry, rot))
    if not max_rope:  # learned positions (GPT-2, OPT): no rotary key, all of K and V in the latent
        if rope_dim:
            raise UsageError(f"--rope-dim {rope_dim}: the {adapter.family} family has no rotary embedding; use "
                             "--rope-dim 0 (the default)")
    elif rope_dim < 2 or rope_dim % 2 or rope_dim > max_rope:
        raise UsageError(f"--rope-dim {rope_dim}: must be even, at least 2 and at most the rotary dims of all KV "
                         f"heads of a layer ({max_rope})")
    tops = [latent_dims(g, r, rope_dim) for g, r in zip(geometry, rot)]
    if isinstance(kv_rank, int):  # one rank for every layer: a layer whose full rank is less keeps its full rank
        if not 1 <= kv_rank <= max(tops):
            big = max(range(len(geometry)), key=tops.__getitem__)
            g = geometry[big]
            where = "" if len(set(tops)) == 1 else f" (layer {big}'s; a layer whose full rank is less keeps it)"
            raise UsageError(f"--kv-rank {kv_rank}: must be between 1 and {tops[big]} (full rank with --rope-dim "
                             f"{rope_dim}: K and V of {g.num_kv_heads} KV heads x {g.head_dim} dims, less the "
                             f"rotary key, which is exact){where}")
        return [min(int(kv_rank), top) for top in tops]
    ranks = [int(r) for r in kv_rank]
    if len(ranks) != len(geometry):
        raise UsageError(f"--kv-rank: {len(ranks)} values for {len(geometry)} layers")
    for i, (r, g) in enumerate(zip(ranks, geometry)):
        if r < 1 or r > tops[i]:
            where = "" if len(set(tops)) == 1 else f" in layer {i}"
            raise UsageError(f"--kv-rank {r}: must be between 1 and {tops[i]}{where} (full rank with --rope-dim "
                             f"{rope_dim}: K and V of {g.num_kv_heads} KV heads x {g.head_dim} dims, less the "
                             "rotary key, which is exact)")
    return ranks


# --------------------------------------------------------------------------- RoRoPE
@_one_thread
def rorope(k: torch.Tensor, gram: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-plane unitary mixes of the KV heads [P, K, K] (row m: rotated head m) and the key
    energy of every rotated head [P, K], leading heads first."""
    m = _plane_moments(_planes(k, rot_dim), gram)  # [P, K, K] Hermitian: E[k_a conj(k_b)]
    lam, vec = torch.linalg.eigh(m)
    lam, vec = lam.flip(-1), vec.flip(-1)
    return vec.conj().transpose(-1, -2), lam.clamp_min(0)


def identity_mix(k: torch.Tensor, gram: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """No mixing (the heads as they are) with their energies: the baseline RoRoPE improves on."""
    m = _plane_moments(_planes(k, rot_dim), gram)
    P, K, _ = m.shape
    return torch.eye(K, dtype=m.dtype).expand(P, K, K).clone(), m.diagonal(dim1=1, dim2=2).real.clamp_min(0)


def position_weight(inv_freq: torch.Tensor, context: int, points: int = 64) -> torch.Tensor:
    """How much dropping RoPE changes a plane's scores: E|e^(i theta Delta) - 1|^2 over distances
    Delta log-uniform in [1, context] (near tokens count as much as far ones, per octave) [P]."""
    delta = torch.logspace(0, torch.log10(torch.tensor(float(max(context, 2)))).item(), points,
                           dtype=torch.float64)
    return (2 * (1 - torch.cos(inv_freq.to(torch.float64)[:, None] * delta[None, :]))).mean(1)


def _query_plane_energy(q: torch.Tensor, gram: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """E|q_h^p|^2 per plane and query head [P, H]; `gram` shared by all heads [D+1, D+1] (q over
    the attention input) or one per head [H, d, d] (q over the head's own normed query)."""
    z = _planes(q, rot_dim)
    if gram.dim() == 3:
        return torch.einsum("hpd,hde,hpe->ph", z, gram.to(z.dtype), z.conj()).real
    return _plane_moments(z, gram).diagonal(dim1=1, dim2=2).real


def _query_moments(q: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """E[q_h q_h^T] per query head [H, d, d] (`gram` as in _query_plane_energy)."""
    if gram.dim() == 3:
        return torch.einsum("hfd,hde,hge->hfg", q, gram, q)
    return torch.einsum("hfd,de,hge->hfg", q, gram, q)


def choose_slots(u: torch.Tensor, lam: torch.Tensor, q: torch.Tensor, gram: torch.Tensor, geo: LayerHeads,
                 rot_dim: int, n: int, plane_weight: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """The n (plane, rotated head) slots that keep RoPE: most key energy times the energy of the
    queries that read them (times `plane_weight`, how much position matters on the plane);
    ordered by rotated head, then plane. `gram` is the queries' (see _query_plane_energy)."""
    eq = _query_plane_energy(q, gram, rot_dim)  # [P, H]
    j = torch.tensor([geo.kv_head_of(h) for h in range(geo.num_heads)])
    read = (u[:, :, j].abs() ** 2 * eq[:, None, :]).sum(-1)  # [P, K]: query energy per slot
    if plane_weight is not None:
        read = read * plane_weight.to(read.dtype)[:, None]
    score = (lam * read).reshape(-1)
    order = torch.argsort(-score, stable=True)[:n].tolist()
    K = lam.shape[1]
    return sorted(((i // K, i % K) for i in order), key=lambda s: (s[1], s[0]))


# --------------------------------------------------------------------------- one layer
@dataclass
class LatentLayer:
    """One converted layer, float64, bias in the last column of q_heads / kv_a."""

    kv_a: torch.Tensor  # [kv_rank + rope_dim, D+1]
    kv_b: torch.Tensor  # [H * (nope + d), kv_rank]
    o: torch.Tensor  # [H, d, D_out] unchanged
    slots: list[tuple[int, int]]  # (plane, rotated head) of every rotary slot
    qk_nope_dim: int
    q_heads: torch.Tensor  # [H * d, D+1]: the original query rows (the no-RoPE query is all of them)
    q_rope_map: torch.Tensor  # [H * rope_dim, d]: each head's rotary query from its own query
    report: dict[str, Any] = field(default_factory=dict)


def _real_rows(z: torch.Tensor) -> torch.Tensor:
    """Complex rows [n, D+1] as real rows [2n, D+1]: real parts, then imaginary parts."""
    return torch.cat([z.real, z.imag], dim=0)


@dataclass
class LayerProblem:
    """One layer up to the choice of its rank: the rotary key and queries, the no-RoPE key map, Y
    and its weighted spectrum (`spectrum[r]`: the weighted error that latent dim r + 1 removes,
    relative to the layer's own K and V totals, see `prepare_layer`)."""

    slots: list[tuple[int, int]]
    k_rope: torch.Tensor
    q_rope_map: torch.Tensor  # [H, rope_dim, d]: head h's rotary query is q_rope_map[h] @ (its query)
    lmap: torch.Tensor
    n_k: int
    y: torch.Tensor
    s: torch.Tensor  # W^1/2 Y
    w_inv: torch.Tensor  # W^-1/2
    ev: torch.Tensor  # eigenvalues of S G~ S^T, descending
    vec: torch.Tensor
    report: dict[str, Any]

    @property
    def spectrum(self) -> torch.Tensor:
        return self.ev


@_one_thread
def prepare_layer(b: Blocks, geo: LayerHeads, gram: torch.Tensor, rot_dim: int, rope_dim: int,
                  damping: float = DEFAULT_DAMPING, rotate: bool = True,
                  plane_weight: torch.Tensor | None = None, balance: str = "normalized",
                  key_weight: float = DEFAULT_KEY_WEIGHT, scaling: float = 1.0,
                  q_gram: torch.Tensor | None = None) -> LayerProblem:
    """Steps 1-3 of the module doc for one layer, everything but the rank. `q_gram` (per head
    [H, d, d]) when the queries are over their own normed heads, not over `gram`'s input.

    Its spectrum is what `allocate_ranks` compares across layers: the share of the layer's own
    weighted V energy (and, at `key_weight`, K energy) that each latent dim keeps. Relative, not
    absolute: attention output energy grows with depth, and absolute units gave the first layer of
    SmolLM2-135M a rank of 1 at a third of the cache (a smoke run of benchmarks/bench_mla.py)."""
    H, K, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    P, n = rot_dim // 2, rope_dim // 2
    if n > P * K:
        raise UsageError(f"--rope-dim {rope_dim}: at most {2 * P * K} rotary dims in a layer")
    q_gram = gram if q_gram is None else q_gram  # what the queries are over
    if P:
        u, lam = (rorope if rotate else identity_mix)(b.k, gram, rot_dim)
        slots = choose_slots(u, lam, b.q, q_gram, geo, rot_dim, n, plane_weight)
    else:  # no RoPE: no planes to mix, no rotary key
        u, lam = b.k.new_zeros(0, K, K, dtype=torch.complex128), b.k.new_zeros(0, K)
        slots = []
    dropped = sorted(set((p, m) for p in range(P) for m in range(K)) - set(slots), key=lambda s: (s[1], s[0]))
    zk = torch.einsum("pmj,jpd->mpd", u, _planes(b.k, rot_dim))  # rotated key planes [K, P, D+1]
    jh = [geo.kv_head_of(h) for h in range(H)]

    # shared rotary key and each head's rotary query: a map of the head's own query (its planes at
    # the slots' frequencies turned by the mixing's coefficients), so the layer keeps q_proj as it is
    if slots:
        k_rope = _real_rows(torch.stack([zk[m, p] for p, m in slots]))
        eye = _planes(torch.eye(d, dtype=b.q.dtype)[None], rot_dim)[0]  # [P, d]: plane p of a query
        q_map = torch.stack([_real_rows(torch.stack([u[p, m, jh[h]] * eye[p] for p, m in slots]))
                             for h in range(H)])
    else:
        k_rope = b.k.new_zeros(0, b.k.shape[-1])
        q_map = b.q.new_zeros(H, 0, d)

    # the key without RoPE: dropped slots (real parts, imaginary parts), then dims that never rotate
    nd, f = len(dropped), d - rot_dim
    rows = [_real_rows(torch.stack([zk[m, p] for p, m in dropped]))] if nd else []
    rows += [b.k[j, rot_dim:] for j in range(K)] if f else []
    n_k = 2 * nd + K * f
    c_k = torch.cat(rows) if rows else b.k.new_zeros(0, b.k.shape[-1])
    # L_j [d, n_k]: the no-RoPE key in KV head j's own coordinates (a query head dots its query into it)
    lmap = b.k.new_zeros(K, d, n_k)
    for a, (p, m) in enumerate(dropped):
        c = u[p, m]  # [K] complex
        lmap[:, p, a], lmap[:, p, nd + a] = c.real, c.imag
        lmap[:, P + p, a], lmap[:, P + p, nd + a] = -c.imag, c.real
    for j in range(K):
        lmap[j, rot_dim:, 2 * nd + j * f: 2 * nd + (j + 1) * f] = torch.eye(f, dtype=lmap.dtype)
    c_v = b.v.reshape(K * d, -1)
    y = torch.cat([c_k, c_v])
    # the share of the rotary key energy that keeps RoPE (all of it where nothing rotates)
    rope_energy = float(lam[tuple(zip(*slots))].sum() / lam.sum().clamp_min(_EPS)) if slots else float(not P)
    report: dict[str, Any] = {"rope_energy": rope_energy}

    gq = _query_moments(b.q, q_gram)  # E[q_h q_h^T] [H, d, d]
    sens = torch.ones(H, dtype=y.dtype)
    if balance == "output":
        # first-order: a score error e moves head h's output by about e (v - mean v) through W_o^h
        mean = gram[:, -1]
        vm = torch.einsum("jfd,d->jf", b.v, mean)
        cov = torch.einsum("jfd,de,jge->jfg", b.v, gram, b.v) - vm[:, :, None] * vm[:, None, :]
        sens = torch.stack([scaling ** 2 * torch.trace(b.o[h].T @ cov[jh[h]] @ b.o[h]) for h in range(H)])
    m_k = sum(sens[h] * lmap[jh[h]].T @ gq[h] @ lmap[jh[h]] for h in range(H)) if n_k else y.new_zeros(0, 0)
    m_v = torch.zeros(K * d, K * d, dtype=y.dtype)
    for h in range(H):
        sl = slice(jh[h] * d, (jh[h] + 1) * d)
        m_v[sl, sl] += b.o[h] @ b.o[h].T
    g_reg = gram + damping * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)

    def total_of(m: torch.Tensor, c: torch.Tensor) -> torch.Tensor | float:
        # balance "normalized": K and V each relative to its own total (TransMLA's balancing)
        return torch.trace(m @ c @ g_reg @ c.T).clamp_min(_EPS) if balance == "normalized" else 1.0

    def root(m: torch.Tensor, c: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not m.numel():
            return m, m
        lam_m, vec = torch.linalg.eigh(scale * m / total_of(m, c))
        lam_m = lam_m.clamp_min(0) + _WEIGHT_FLOOR * lam_m.clamp_min(0).mean() + _EPS
        return (vec * lam_m.sqrt()) @ vec.T, (vec / lam_m.sqrt()) @ vec.T

    rk, rk_inv = root(m_k, c_k, key_weight)
    rv, rv_inv = root(m_v, c_v, 1.0)
    w_half = torch.block_diag(rk, rv)
    w_inv = torch.block_diag(rk_inv, rv_inv)
    sy = w_half @ y
    ev, vec = torch.linalg.eigh(sy @ g_reg @ sy.T)
    ev, vec = ev.flip(0).clamp_min(0), vec.flip(1)
    return LayerProblem(slots, k_rope, q_map, lmap, n_k, y, sy, w_inv, ev, vec, report)


@_one_thread
def finish_layer(pb: LayerProblem, b: Blocks, geo: LayerHeads, kv_rank: int) -> LatentLayer:
    """Step 3's factorization at `kv_rank` and step 4 (the per-head up-projections)."""
    H, d = geo.num_heads, geo.head_dim
    jh = [geo.kv_head_of(h) for h in range(H)]
    y, n_k = pb.y, pb.n_k
    report = dict(pb.report)
    if kv_rank >= y.shape[0]:  # full rank: the latent is Y itself
        a_mat, b_mat = y.clone(), torch.eye(y.shape[0], dtype=y.dtype)
        report["latent_energy"] = 1.0
    else:
        u_r = pb.vec[:, :kv_rank]
        a_mat, b_mat = u_r.T @ pb.s, pb.w_inv @ u_r
        report["latent_energy"] = float(pb.ev[:kv_rank].sum() / pb.ev.sum().clamp_min(_EPS))

    b_k, b_v = b_mat[:n_k], b_mat[n_k:]
    nope = d if n_k else 0
    kv_b_rows = []
    for h in range(H):
        j = jh[h]
        kv_b_rows += ([pb.lmap[j] @ b_k] if nope else []) + [b_v[j * d:(j + 1) * d]]
    return LatentLayer(kv_a=torch.cat([a_mat, pb.k_rope]), kv_b=torch.cat(kv_b_rows), o=b.o,
                       slots=pb.slots, qk_nope_dim=nope, q_heads=b.q.reshape(H * d, -1),
                       q_rope_map=pb.q_rope_map.reshape(-1, d), report=report)


def latent_layer(b: Blocks, geo: LayerHeads, gram: torch.Tensor, rot_dim: int, rope_dim: int, kv_rank: int,
                 damping: float = DEFAULT_DAMPING, rotate: bool = True,
                 plane_weight: torch.Tensor | None = None, balance: str = "normalized",
                 key_weight: float = DEFAULT_KEY_WEIGHT,
                 scaling: float = 1.0) -> LatentLayer:
    """Convert one layer's heads (see the module doc); `rotate=False` keeps the heads unmixed."""
    pb = prepare_layer(b, geo, gram, rot_dim, rope_dim, damping, rotate, plane_weight, balance, key_weight, scaling)
    return finish_layer(pb, b, geo, kv_rank)


# --------------------------------------------------------------------------- qk-normed families
def latent_grams(model, adapter: Adapter, batches: Sequence[dict], device=None) -> dict:
    """The calibration statistics convert_model_latent needs for this family: attention-input
    Grams, or per-head normed features where q and k are normed per head."""
    if adapter.qk_norm:
        return normed_head_grams(model, adapter, batches, device=device)
    return attention_input_grams(model, adapter, batches, device=device)


def normed_blocks(geo: LayerHeads, o: torch.Tensor) -> Blocks:
    """Blocks of a layer whose q and k are RMS-normed per head (Qwen 3, Gemma 3), over features
    instead of the attention input: each query head is the identity on its own normed query
    [H, d, d]; K and V select their rows of f~ = [normed k_1..k_K, v_1..v_K, 1] [K, d, 2Kd+1]
    (`calibration.NormedGrams`). Every step of the module doc then runs unchanged: the latent
    and the rotary key are linear maps of the normed keys and the values, the queries of the
    normed queries, and at full rank the layer is exact again."""
    H, K, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    feats = 2 * K * d + 1
    eye = torch.eye(d, dtype=torch.float64)
    k = torch.zeros(K, d, feats, dtype=torch.float64)
    v = torch.zeros(K, d, feats, dtype=torch.float64)
    for j in range(K):
        k[j, :, j * d:(j + 1) * d] = eye
        v[j, :, (K + j) * d:(K + j + 1) * d] = eye
    return Blocks(eye.expand(H, d, d).clone(), k, v, o)


# --------------------------------------------------------------------------- ranks per layer
RANK_ALLOCATIONS = ("uniform", "auto")


def budget_dims(geometry: Sequence[LayerHeads], fraction: float) -> int:
    """Cache dims per token (latent + rotary key, summed over layers) within `fraction` of today's
    K/V dims: the budget in bytes is this times the element size."""
    today = sum(2 * g.num_kv_heads * g.head_dim for g in geometry)
    return int(math.floor(fraction * today + 1e-9))


def ranks_for_budget(geometry: Sequence[LayerHeads], fraction: float, rope_dim: int,
                     allocation: str = "uniform") -> list[int]:
    """kv_rank per layer that `--kv-cache fraction` allows with `rope_dim`. uniform: total // layers
    in every layer, or a layer's full rank where that is less (a prune can leave layers with fewer KV
    heads); auto: the whole total, split as evenly as the layers' full ranks allow, which is only the
    start auto allocation re-spreads by measured error (the budget met exactly)."""
    n = len(geometry)
    total = budget_dims(geometry, fraction) - n * rope_dim
    if total < n:
        today = sum(2 * g.num_kv_heads * g.head_dim for g in geometry)
        need = n * (rope_dim + 1)  # (a rotary key of 2 dims is the least RoPE allows, 0 without RoPE)
        raise UsageError(f"--kv-cache {fraction:g}: {budget_dims(geometry, fraction)} cache dims per token for "
                         f"{n} layers cannot hold --rope-dim {rope_dim} plus a latent of at least 1 in every layer "
                         f"(today {today}); raise --kv-cache to at least {need}/{today}"
                         + (" or lower --rope-dim" if rope_dim > 2 else ""))
    tops = [latent_dims(g, 0, rope_dim) for g in geometry]
    if allocation == "uniform":
        return [min(total // n, top) for top in tops]
    ranks = [0] * n
    left = min(total, sum(tops))
    for k, i in enumerate(sorted(range(n), key=tops.__getitem__)):  # the smallest layers first
        ranks[i] = min(tops[i], -(-left // (n - k)))
        left -= ranks[i]
    return ranks


def allocate_ranks(spectra: Sequence[torch.Tensor], total: int, minimum: int = 1) -> list[int]:
    """kv_rank per layer summing to `total`: every layer starts at `minimum`, then each further
    latent dim goes to the layer whose (relative) weighted error it lowers most (as CARE), which
    for descending spectra is the `total - layers x minimum` largest of the remaining eigenvalues."""
    tops = [len(s) for s in spectra]
    if total > sum(tops) or total < minimum * len(spectra):
        raise UsageError(f"a total latent of {total} dims does not fit {len(spectra)} layers of "
                         f"{minimum}..{min(tops)} dims")
    cands = [(-float(v), i, r) for i, s in enumerate(spectra) for r, v in enumerate(s.tolist()) if r >= minimum]
    ranks = [minimum] * len(spectra)
    for _, i, _ in sorted(cands)[: total - minimum * len(spectra)]:
        ranks[i] += 1
    return ranks


# --------------------------------------------------------------------------- model level
def _has_bias(adapter: Adapter, prefix: str, state: Mapping[str, torch.Tensor], kinds: set[str]) -> bool:
    return any(t.dim() == 1 and set(ht.kinds) & kinds
               for key, ht in layer_tensor_names(adapter, prefix, state.keys()) for t in [state[key]])


def _module_tensors(layer: LatentLayer, q_bias: bool, kv_bias: bool, o_bias: torch.Tensor | None,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The latent layer's parameters: the original q_proj, each head's rotary query map over it
    (`q_rope_proj`, rope_dim x head_dim per head, where the DeepSeek layout's extra q_proj rows
    would cost rope_dim x hidden per head), the latent and its up-projection, the output."""
    out = {"q_proj.weight": layer.q_heads[:, :-1], "q_rope_proj": layer.q_rope_map,
           "kv_a_proj_with_mqa.weight": layer.kv_a[:, :-1],
           "kv_b_proj.weight": layer.kv_b, "o_proj.weight": layer.o.reshape(-1, layer.o.shape[-1]).T}
    if q_bias:
        out["q_proj.bias"] = layer.q_heads[:, -1]
    if kv_bias:
        out["kv_a_proj_with_mqa.bias"] = layer.kv_a[:, -1]
    if o_bias is not None:
        out["o_proj.bias"] = o_bias
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


NORMED_KEPT = ("q_proj", "k_proj", "q_norm", "k_norm")  # what a qk-normed layer keeps of the original


def _normed_module_tensors(layer: LatentLayer, attention, geo: LayerHeads, o_bias: torch.Tensor | None,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The latent layer of a qk-normed family: the original q/k projections and norms (the normed
    features), the per-head rotary query maps, the latent over [normed K, x, 1] (its V part folded
    through v_proj, which the layer then no longer needs) and the up-projection."""
    K, d = geo.num_kv_heads, geo.head_dim
    if layer.kv_a[:, -1].abs().max() > 1e-9:  # K and V rows select features: no constant term
        raise AssertionError("the latent of normed features has a constant term")
    a_k, a_v = layer.kv_a[:, :K * d], layer.kv_a[:, K * d:2 * K * d]
    v_proj = attention.v_proj
    a_x = a_v @ v_proj.weight.detach().to(a_v.dtype)  # latent from the values = (A_v W_v) x + A_v b_v
    out = {"q_rope_proj": layer.q_rope_map,
           "kv_a_proj_with_mqa.weight": torch.cat([a_k, a_x], dim=1),
           "kv_b_proj.weight": layer.kv_b, "o_proj.weight": layer.o.reshape(-1, layer.o.shape[-1]).T}
    if v_proj.bias is not None:
        out["kv_a_proj_with_mqa.bias"] = a_v @ v_proj.bias.detach().to(a_v.dtype)
    if o_bias is not None:
        out["o_proj.bias"] = o_bias
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    for name, value in attention.named_parameters():
        if name.split(".")[0] in NORMED_KEPT:
            out[name] = value.detach().clone()
    return out


@dataclass
class LatentConverted:
    """A model converted to latent attention, its table and what each layer kept."""

    model: Any
    spec: dict[str, Any]
    layers: list[dict[str, Any]]
    seconds: float
    refit: list[dict] | None = None


CONVERT_INSTEAD = "convert-mla keeps the model in memory: load it without --device-map"


def convert_model_latent(original, adapter: Adapter, kv_rank: int | Sequence[int], *, rope_dim: int | None = None,
                         grams: Mapping[int, torch.Tensor], damping: float = DEFAULT_DAMPING,
                         rotate: bool = True, absorb: str | bool = "auto", rope_context: int | None = None,
                         refit: bool = False, batches: Sequence[dict] | None = None,
                         heldout_batches: Sequence[dict] | None = None,
                         anchor: float | Sequence[float] = DEFAULT_ANCHOR, balance: str = "normalized",
                         key_weight: float = DEFAULT_KEY_WEIGHT, allocation: str = "uniform") -> LatentConverted:
    """A copy of `original` (left untouched) whose attention layers are latent attention.

    `rope_dim` defaults to one head's rotary dims (as DeepSeek and TransMLA); `grams` are the
    attention-input Grams per layer (calibration.attention_input_grams); `rotate=False` skips
    RoRoPE (a baseline). At kv_rank = latent_dims and rope_dim = KV heads x rotary dims the copy
    computes what the original computes.

    `key_weight` and `balance` weigh key against value errors in the latent (module doc);
    `rope_context` (experimental, off) weighs each plane's claim to a rotary slot by how much
    RoPE turns it over distances up to that many tokens (better where the latent is full rank,
    worse where it is not: the low-frequency planes it leaves out carry much of the key energy).
    With `refit`, the output projections are refit sequentially on `batches` and kept per layer
    where they lower the error on `heldout_batches` (compensation.sequential_refit, `anchor`).
    `allocation="auto"` keeps the total of `kv_rank` over layers and spreads it by the layers'
    weighted spectra (`allocate_ranks`); "uniform" keeps `kv_rank` as given.
    """
    if allocation not in RANK_ALLOCATIONS:
        raise UsageError(f"--rank-allocation {allocation!r}: use {' or '.join(RANK_ALLOCATIONS)}")
    if balance not in BALANCES:
        raise UsageError(f"balance {balance!r}: use {' or '.join(BALANCES)}")
    if key_weight < 0:
        raise UsageError(f"--key-weight must be >= 0 (got {key_weight})")
    t0 = time.perf_counter()
    require_resident_weights(original, "convert-mla", CONVERT_INSTEAD)
    config = original.config
    geometry = adapter.geometry(config)
    rot = adapter.rotary_dim(config, geometry[0].head_dim)
    rope_dim = rot if rope_dim is None else int(rope_dim)
    ranks = check_latent_target(adapter, config, geometry, kv_rank, rope_dim)
    # a pruned or merged input may have different head counts per layer (its head table): each
    # latent layer then has its own query heads; the head dim is one for all (the table's)
    empty = [i for i, g in enumerate(geometry) if not g.num_heads]
    if empty:
        raise UsageError(f"convert-mla: layer {empty[0]} has no attention heads left; nothing to convert there")
    if damping < 0:
        raise UsageError(f"--damping must be >= 0 (got {damping})")
    state = original.state_dict()
    dtype = next(original.parameters()).dtype
    tensors, slots, reports = [], [], []
    q_bias = kv_bias = v_bias = False
    biases = []
    for i, geo in enumerate(geometry):
        prefix = adapter.layer_prefix(original, i)
        q_bias |= _has_bias(adapter, prefix, state, {"q"})
        kv_bias |= _has_bias(adapter, prefix, state, {"k", "v"})
        v_bias |= _has_bias(adapter, prefix, state, {"v"})  # normed layers: folded into the latent projection
        biases.append(adapter.projection_module(original, i, "o").bias)
    o_bias = biases[0] is not None
    plane_weight = None
    if rope_context:
        plane_weight = position_weight(adapter.rotary_inv_freq(original), rope_context)
    normed = bool(adapter.qk_norm)  # Qwen 3, Gemma 3: the latent is taken over normed features
    if normed and not all(isinstance(grams[i], NormedGrams) for i in range(len(geometry))):
        raise ValueError(f"{adapter.family}: q and k are normed per head; calibrate with "
                         "calibration.normed_head_grams (latent_grams picks it)")

    def blocks(i: int) -> Blocks:
        b = read_blocks(state, adapter, adapter.layer_prefix(original, i), geometry[i])
        return normed_blocks(geometry[i], b.o) if normed else b

    def problem(i: int) -> LayerProblem:
        g = grams[i]
        return prepare_layer(blocks(i), geometry[i], g.kv if normed else g, rot, rope_dim, damping, rotate,
                             plane_weight, balance, key_weight, adapter.attention_scaling(original, i),
                             q_gram=g.q if normed else None)

    problems: list[LayerProblem | None] = [None] * len(geometry)
    if allocation == "auto":  # every layer's spectrum first, then the ranks, then the factorizations
        problems = [problem(i) for i in range(len(geometry))]
        ranks = allocate_ranks([p.spectrum for p in problems], sum(ranks))
    for i, geo in enumerate(geometry):
        pb = problems[i] or problem(i)
        problems[i] = None
        layer = finish_layer(pb, blocks(i), geo, ranks[i])
        ob = biases[i].detach() if o_bias else None
        tensors.append(_normed_module_tensors(layer, adapter.attention_module(original, i), geo, ob, dtype)
                       if normed else _module_tensors(layer, q_bias, kv_bias, ob, dtype))
        slots.append(layer.slots)
        reports.append({"layer": i, "kv_rank": ranks[i], **{k: round(v, 6) for k, v in layer.report.items()}})
    g = geometry[0]

    def per_layer(values: list):  # one value for every layer, or a list
        return values[0] if len(set(values)) == 1 else values
    scaling = [adapter.attention_scaling(original, i) for i in range(len(geometry))]
    extras = [adapter.attention_extras(original, i) for i in range(len(geometry))]
    softcap = {e["softcap"] for e in extras}
    if len(softcap) != 1:
        raise UsageError("convert-mla: layers with different score soft-capping are not supported yet")
    spec = {
        "layers_path": adapter.layers_path, "attention": adapter.attention, "hidden_size": adapter.hidden_size(config),
        "num_heads": per_layer([x.num_heads for x in geometry]),
        "qk_nope_dim": per_layer([x.head_dim if latent_dims(x, rot, rope_dim) > x.num_kv_heads * x.head_dim else 0
                                  for x in geometry]),
        "v_head_dim": g.head_dim, "rope_dim": rope_dim, "rotary_dim": rot, "kv_rank": ranks,
        "rope_planes": [[p for p, _ in s] for s in slots], "rope_heads": [[m for _, m in s] for s in slots],
        "scaling": per_layer(scaling), "q_bias": q_bias and not normed,
        "kv_bias": v_bias if normed else kv_bias, "o_bias": o_bias, "absorb": absorb,
        "qk_norm": normed, "factored_query": True,
        "softcap": softcap.pop(), "sliding_window": [e["sliding_window"] for e in extras],
        "attention_dropout": per_layer([e["dropout"] for e in extras]),
        "output_dropout": per_layer([e["output_dropout"] for e in extras]),
        "source_num_kv_heads": per_layer([x.num_kv_heads for x in geometry]),
    }
    model = copy.deepcopy(original)
    install_latent(model, adapter, spec, tensors)
    refit_report = None
    if refit:
        if not batches:
            raise UsageError("the output-projection refit needs calibration data (--data)")
        refit_report = sequential_refit(original, model, adapter, batches, damping=damping, anchor=anchor,
                                        heldout_batches=heldout_batches)
    return LatentConverted(model, spec, reports, time.perf_counter() - t0, refit_report)


def summary_figures(model, adapter: Adapter) -> dict[str, Any]:
    """Parameters and KV cache of a model (before/after columns of the summary)."""
    info = model_info(model, adapter)
    return conversion_figures(info, ("params", "attention_params", "kv_cache_bytes_per_token",
                                     "kv_cache_bytes_per_token_per_layer", "num_kv_heads", "num_heads"))
