"""K/V grouping and merging: MHA to GQA, GQA to fewer groups, to MQA.

A new KV head n serves a set of query heads Q_n (H/N of them). Each query head h in Q_n used
to read its old KV head j(h); merging replaces those by one K and one V projection and may
change the query heads and output-projection columns of Q_n so that the function changes as
little as possible. All statistics come from the Gram matrix of the attention input
x~ = [x, 1] (`calibration.attention_input_grams`): q, k and v are affine maps of x, so
every second moment below is W Sigma W^T, and the bias is the last column of W.

Methods:
- `mean`: average the K and V projections of the heads a group reads (Ainslie et al. 2023).
- `aligned`: first map each old K/V head onto a common reference with maps that leave the
  model's function unchanged, then average. For K under RoPE the map is a unit complex
  number per frequency plane (rotate_half pairs (p, p + r/2)), which commutes with the
  rotary embedding; the query heads that read the K head get the same rotation. Dims that
  do not rotate (no or partial RoPE) and V get orthogonal maps (generalized Procrustes);
  V's inverse is folded into the output-projection columns of the heads that read it.
- `fit`: data-aware. K: per frequency plane the logit error sum_h E|q_h|^2 E|k_j(h) - k'/d_h|^2
  (query energy per plane, the rotation-averaged query second moment) is minimized jointly
  over the merged plane k' and a complex scale d_h per query head (folded into that query
  head): a weighted rank-1 approximation, closed form from the top eigenvector of a small
  Hermitian matrix. V: the merged value is the leading principal subspace of what the group
  writes through the output projection (W_o^h v_j(h) stacked over the group's query heads),
  and the output-projection columns are the matching principal directions; a sequential,
  damped, held-out-checked refit of the output projection follows (compensation).

With a per-head k_norm before RoPE (Qwen3, Gemma3) no K map commutes with the norm (its
weight differs inside a frequency plane, the RMS mixes planes) and a query-side fold would
meet q_norm: K is then averaged plainly for every method, V still gets the chosen method;
the norm weights, shared by all heads, stay as they are. Merging identical heads stays exact.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from ..arch import Adapter, LayerHeads, kv_head_families
from ..arch.heads import assemble, extract_heads, layer_tensor_names
from ..errors import UsageError
from ..model.info import conversion_figures, model_info
from ..model.placement import require_resident_weights
from ..model.resize import resize_attention
from .compensation import DEFAULT_ANCHOR, sequential_refit

METHODS = ("mean", "aligned", "fit")
GROUPINGS = ("contiguous", "similarity")
DATA_METHODS = ("aligned", "fit")
_EPS = 1e-12
_F = TypeVar("_F", bound=Callable[..., Any])


def _one_thread(fn: _F) -> _F:
    """Run `fn` on one intra-op thread (and put the count back after).

    The merges do linear algebra on small matrices (a head's 64 x 64 maps, a few hundred rows
    at most), where threads only add synchronization; on a machine whose cores are shared, a
    64 x 64 SVD was measured at 11 ms on one thread and 1.5 s on two.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        if n == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)
    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- targets

def merges(geo: LayerHeads, n: int) -> bool:
    """Whether `--kv-heads n` merges this layer: one with n KV heads or fewer (a prune removed whole
    groups) stays as it is."""
    return geo.num_kv_heads > n


def merged_geometry(geometry: Sequence[LayerHeads], n: int) -> list[LayerHeads]:
    """Every layer's heads after `--kv-heads n`: n equal groups where it merges, as it was elsewhere."""
    return [LayerHeads(g.num_heads, n, g.head_dim) if merges(g, n) else g for g in geometry]


def valid_kv_targets(geometry: Sequence[LayerHeads]) -> list[int]:
    """KV-head counts the model can be merged to: below the most KV heads a layer has, and dividing
    the query heads of every layer that it merges."""
    hi = max(g.num_kv_heads for g in geometry)
    return [n for n in range(1, hi) if all(g.num_heads % n == 0 for g in geometry if merges(g, n))]


def check_target(adapter: Adapter, geometry: Sequence[LayerHeads], n: int) -> None:
    """UsageError (exit 2) when `n` KV heads cannot be expressed; lists the valid values."""
    if not adapter.support.kv_heads:
        instead = ("convert-mla shrinks its KV cache instead, prune removes whole heads" if adapter.latent
                   else "prune removes whole heads instead")
        raise UsageError(f"convert-gqa: the {adapter.family} family has no KV-head setting in its config "
                         f"(every query head has its own K/V and the stock model cannot share them), so it cannot "
                         f"become GQA or MQA; convert-gqa converts {', '.join(kv_head_families())} ({instead})")
    valid = valid_kv_targets(geometry)
    if n not in valid:
        hs = sorted({g.num_heads for g in geometry if merges(g, n)} or {g.num_heads for g in geometry})
        ks = sorted({g.num_kv_heads for g in geometry})
        raise UsageError(f"--kv-heads {n}: must be below the most KV heads a layer has ({'/'.join(map(str, ks))}) "
                         f"and divide the query heads of every layer it merges ({'/'.join(map(str, hs))}); "
                         f"valid values: {', '.join(map(str, valid)) if valid else 'none (already one KV head)'}")


# --------------------------------------------------------------------------- blocks
@dataclass
class Blocks:
    """One layer's heads in float64: q/k/v [n, d, D+1] (bias in the last column), o [H, d, D_out]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor


def read_blocks(tensors: Mapping[str, torch.Tensor], adapter: Adapter, prefix: str, geo: LayerHeads) -> Blocks:
    """A layer's head blocks from its (possibly fused) tensors, through surgery.extract_heads."""
    weights: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}
    for key, ht in layer_tensor_names(adapter, prefix, tensors.keys()):
        t = tensors[key]
        for kind in ht.kinds:
            b = extract_heads(t.detach(), ht, geo, kind).to("cpu", torch.float64)
            (biases if t.dim() == 1 else weights)[kind] = b
    aug = {}
    for kind in "qkv":
        w = weights[kind]
        b = biases.get(kind, w.new_zeros(w.shape[:2]))
        aug[kind] = torch.cat([w, b[..., None]], dim=-1)
    return Blocks(aug["q"], aug["k"], aug["v"], weights["o"])


def write_tensors(blocks: Blocks, adapter: Adapter, prefix: str, tensors: Mapping[str, torch.Tensor],
                  geo: LayerHeads, new_geo: LayerHeads) -> dict[str, torch.Tensor]:
    """New values of the layer's head-carrying tensors (full keys), through surgery.assemble."""
    out = {}
    for key, ht in layer_tensor_names(adapter, prefix, tensors.keys()):
        t = tensors[key]
        parts = {}
        for kind in ht.kinds:
            if kind == "o":
                parts[kind] = blocks.o
            else:
                a = getattr(blocks, kind)
                parts[kind] = a[..., -1] if t.dim() == 1 else a[..., :-1]
        out[key] = assemble(ht, new_geo, {k: p.to(t.dtype) for k, p in parts.items()}).to(t.device)
    return out


# --------------------------------------------------------------------------- moments
def _planes(w: torch.Tensor, r: int) -> torch.Tensor:
    """Rotary planes of heads [n, d, D+1] as complex rows [n, r/2, D+1]: z = x_p + i x_{p+r/2}."""
    p = r // 2
    return torch.complex(w[:, :p], w[:, p:r])


def _set_planes(w: torch.Tensor, z: torch.Tensor, r: int) -> torch.Tensor:
    p = r // 2
    w = w.clone()
    w[:, :p], w[:, p:r] = z.real, z.imag
    return w


def _plane_moments(z: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """M[p, a, b] = E[k_a conj(k_b)] on plane p, for complex rows z [n, P, D+1]."""
    zs = torch.einsum("npd,de->npe", z, gram.to(z.dtype))
    return torch.einsum("apd,bpd->pab", zs, z.conj())


def _real_moments(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """C[a, b] = E[y_a y_b^T] for real heads w [n, f, D+1]: [n, n, f, f]."""
    ws = torch.einsum("nfd,de->nfe", w, gram)
    return torch.einsum("afd,bgd->abfg", ws, w)


def _energy(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """E||y||^2 per head for real heads [n, f, D+1]: [n]."""
    return torch.einsum("nfd,de,nfe->n", w, gram, w)


# --------------------------------------------------------------------------- alignment
def _polar(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of m (argmax_R tr(R^T m)), batched."""
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


def _align_planes(m: torch.Tensor, c: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """Unit complex u [P, J] with u_j k_j close to the weighted mean reference (per plane)."""
    P, J, _ = m.shape
    u = torch.ones(P, J, dtype=m.dtype)
    for _ in range(iters):
        # s_j = E[conj(k_j) r], r = sum_l c_l u_l k_l; E[conj(k_j) k_l] = M[l, j]
        s = torch.einsum("plj,pl->pj", m, c.to(m.dtype) * u)
        mag = s.abs()
        new = torch.where(mag > _EPS, s / mag.clamp_min(_EPS), torch.ones_like(s))
        if torch.allclose(new, u, atol=1e-12):
            break
        u = new
    return u


def _align_real(cm: torch.Tensor, c: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """Orthogonal R [J, f, f] with R_j y_j close to the weighted mean reference (generalized Procrustes)."""
    J, _, f, _ = cm.shape
    R = torch.eye(f, dtype=cm.dtype).expand(J, f, f).clone()
    for _ in range(iters):
        # E[r y_j^T] = sum_l c_l R_l E[y_l y_j^T]
        cross = torch.einsum("l,lfg,ljgh->jfh", c.to(cm.dtype), R, cm)
        new = _polar(cross)
        if torch.allclose(new, R, atol=1e-12):
            break
        R = new
    return R


@dataclass
class GroupMaps:
    """The function-preserving maps of the old KV heads `sources` of one new group."""

    sources: list[int]
    u: torch.Tensor | None  # [P, J] unit complex, K rotary planes (None: identity)
    rk: torch.Tensor | None  # [J, f, f] orthogonal, K dims that do not rotate
    rv: torch.Tensor  # [J, d, d] orthogonal, V


def group_maps(b: Blocks, sources: list[int], weights: torch.Tensor, gram: torch.Tensor,
               rot_dim: int, k_maps: bool) -> GroupMaps:
    """Alignment maps of the old KV heads `sources` (weighted by the query heads reading them)."""
    d = b.k.shape[1]
    k, v = b.k[sources], b.v[sources]
    u = rk = None
    if k_maps:
        if rot_dim:
            u = _align_planes(_plane_moments(_planes(k, rot_dim), gram), weights)
        if rot_dim < d:
            rk = _align_real(_real_moments(k[:, rot_dim:], gram), weights)
    rv = _align_real(_real_moments(v, gram), weights)
    return GroupMaps(sources, u, rk, rv)


def _map_k(k: torch.Tensor, u: torch.Tensor | None, rk: torch.Tensor | None, rot_dim: int) -> torch.Tensor:
    """Apply per-head K maps to heads [J, d, D+1] (also right for the query heads that read them)."""
    if u is not None:
        k = _set_planes(k, _planes(k, rot_dim) * u.T[:, :, None], rot_dim)
    if rk is not None:
        k = k.clone()
        k[:, rot_dim:] = torch.einsum("jfg,jgd->jfd", rk, k[:, rot_dim:])
    return k


@_one_thread
def apply_alignment(b: Blocks, geo: LayerHeads, groups: Sequence[Sequence[int]], gram: torch.Tensor,
                    rot_dim: int, k_maps: bool = True) -> Blocks:
    """The layer with every old KV head mapped onto its group's reference, nothing averaged.

    Each KV head must belong to one group. The function of the model is unchanged (the
    inverse maps sit in the query heads and output-projection columns); this is what
    `aligned` averages.
    """
    q, k, v, o = b.q.clone(), b.k.clone(), b.v.clone(), b.o.clone()
    seen: set[int] = set()
    for g in groups:
        src = [geo.kv_head_of(h) for h in g]
        sources = sorted(set(src))
        if seen & set(sources):
            raise ValueError("apply_alignment: a KV head serves two groups")
        seen |= set(sources)
        w = torch.tensor([src.count(j) for j in sources], dtype=torch.float64)
        m = group_maps(b, sources, w, gram, rot_dim, k_maps)
        k[sources] = _map_k(b.k[sources], m.u, m.rk, rot_dim)
        v[sources] = torch.einsum("jfg,jgd->jfd", m.rv, b.v[sources])
        for h in g:
            j = sources.index(geo.kv_head_of(h))
            uq = None if m.u is None else m.u[:, j:j + 1]
            rq = None if m.rk is None else m.rk[j:j + 1]
            q[h:h + 1] = _map_k(b.q[h:h + 1], uq, rq, rot_dim)
            o[h] = m.rv[j] @ b.o[h]
    return Blocks(q, k, v, o)


# --------------------------------------------------------------------------- fit
def _pca_merge(t: torch.Tensor, cov: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-`dim` y ~ B z with z = G s, for y = T s and E[s s^T] = cov: (G [dim, S], B [Y, dim]).

    B spans the leading principal directions of y (orthonormal columns), G = B^T T. They are
    the leading left singular vectors of A = T cov^(1/2), found from the small Gram A^T A
    (S x S, S a few hundred) rather than an SVD of the tall A: U = A V / sigma.
    """
    lam, vec = torch.linalg.eigh(cov)
    root = vec * lam.clamp_min(0).sqrt()
    a = t @ root
    s2, v = torch.linalg.eigh(a.T @ a)
    s2, v = s2.flip(0)[:dim], v.flip(1)[:, :dim]
    if dim and float(s2[-1]) > 1e-6 * max(float(s2[0]), _EPS):  # well conditioned: U to ~1e-10
        B = (a @ v) / s2.sqrt()
    else:  # (nearly) rank below dim: the SVD, accurate and completing the basis
        B = torch.linalg.svd(a, full_matrices=False)[0][:, :dim]
    return B.T @ t, B


def _fit_k_planes(b: Blocks, q_rows: torch.Tensor, src: list[int], gram: torch.Tensor,
                  rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged K planes [P, D+1] and the complex factor [n, P] each query head's planes get."""
    zk = _planes(b.k[src], rot_dim)  # one row per query head (its old KV head)
    zq = _planes(q_rows, rot_dim)
    eq = _plane_moments(zq, gram).diagonal(dim1=1, dim2=2).real.T  # [n, P] query energy per plane
    s = (eq + 1e-9 * eq.mean(0, keepdim=True) + _EPS).sqrt()
    m = _plane_moments(zk, gram)  # [P, n, n]
    g = s.T[:, :, None] * m * s.T[:, None, :]
    _, vec = torch.linalg.eigh(g)
    a = vec[:, :, -1]  # [P, n]
    merged = torch.einsum("pn,np,npd->pd", a.conj(), s.to(a.dtype), zk)
    dfac = a.T / s  # [n, P]: k_h ~ d_h k'
    ek = m.diagonal(dim1=1, dim2=2).real.mean(1)  # mean energy of the old heads, per plane
    em = torch.einsum("pd,de,pe->p", merged, gram.to(merged.dtype), merged.conj()).real
    lam = (ek / em.clamp_min(_EPS)).sqrt()
    return merged * lam[:, None], (dfac / lam).conj()


def _fit_real(y_scale: list[torch.Tensor], src: list[int], sources: list[int], heads: torch.Tensor,
              gram: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Shared f-dim projection and per-query-head read-out for y_h = A_h s_j(h) (A_h [Y, f]).

    `heads` [J, f, D+1] are the old projections; returns merged [f, D+1] and B_h [Y, f].
    """
    J, f, _ = heads.shape
    flat = heads.reshape(J * f, -1)
    cov = flat @ gram @ flat.T
    ysz = y_scale[0].shape[0]
    t = heads.new_zeros(len(src) * ysz, J * f)
    for r, (a, j) in enumerate(zip(y_scale, src)):
        c = sources.index(j)
        t[r * ysz:(r + 1) * ysz, c * f:(c + 1) * f] = a
    g, B = _pca_merge(t, cov, f)
    return g @ flat, [B[r * ysz:(r + 1) * ysz] for r in range(len(src))]


# --------------------------------------------------------------------------- merge
@_one_thread
def merge_layer(b: Blocks, geo: LayerHeads, groups: Sequence[Sequence[int]], method: str,
                gram: torch.Tensor | None, rot_dim: int, qk_norm: bool) -> Blocks:
    """The layer with one KV head per group; query heads (and o columns) in group order."""
    if method not in METHODS:
        raise UsageError(f"unknown merge method {method!r}; use {', '.join(METHODS)}")
    if method in DATA_METHODS and gram is None:
        raise UsageError(f"--merge {method} needs calibration data (--data)")
    if method not in DATA_METHODS:
        raise ValueError("merge_layer is for the data-aware merges; --merge mean is mean_layer_tensors")
    d = geo.head_dim
    order = [h for g in groups for h in g]
    q, o = b.q[order].clone(), b.o[order].clone()
    new_k, new_v = [], []
    pos = 0
    for g in groups:
        src = [geo.kv_head_of(h) for h in g]
        rows = slice(pos, pos + len(g))
        pos += len(g)
        sources = sorted(set(src))
        w = torch.tensor([src.count(j) for j in sources], dtype=torch.float64)
        if method == "aligned":
            m = group_maps(b, sources, w, gram, rot_dim, k_maps=not qk_norm)
            idx = [sources.index(j) for j in src]
            kq = _map_k(b.k[sources], m.u, m.rk, rot_dim)
            new_k.append((kq * w[:, None, None]).sum(0) / w.sum())
            vq = torch.einsum("jfg,jgd->jfd", m.rv, b.v[sources])
            new_v.append((vq * w[:, None, None]).sum(0) / w.sum())
            uq = None if m.u is None else m.u[:, idx]
            rq = None if m.rk is None else m.rk[idx]
            q[rows] = _map_k(q[rows], uq, rq, rot_dim)
            o[rows] = torch.einsum("nfg,ngd->nfd", m.rv[idx], o[rows])
            continue
        # fit
        if qk_norm:
            k_new = b.k[src].mean(0)
        else:
            k_new = b.k[src[0]].clone()
            qr = q[rows].clone()
            if rot_dim:
                merged, fac = _fit_k_planes(b, qr, src, gram, rot_dim)
                k_new = _set_planes(k_new[None], merged[None], rot_dim)[0]
                qr = _set_planes(qr, _planes(qr, rot_dim) * fac[:, :, None], rot_dim)
            if rot_dim < d:
                f = d - rot_dim
                eq = _energy(qr[:, rot_dim:], gram) / f
                sc = (eq + 1e-9 * eq.mean() + _EPS).sqrt()
                eye = torch.eye(f, dtype=torch.float64)
                merged, bs = _fit_real([s * eye for s in sc], src, sources, b.k[sources, rot_dim:], gram)
                k_new[rot_dim:] = merged
                # q_h^T k_j ~ q_h^T B_h k' / s_h: the query head reads through B_h^T / s_h
                qr[:, rot_dim:] = torch.stack([bh.T @ qh / s for bh, qh, s in zip(bs, qr[:, rot_dim:], sc)])
            q[rows] = qr
        new_k.append(k_new)
        merged, bs = _fit_real([ob.T for ob in o[rows]], src, sources, b.v[sources], gram)
        new_v.append(merged)
        o[rows] = torch.stack([bh.T for bh in bs])
    return Blocks(q, torch.stack(new_k), torch.stack(new_v), o)


# --------------------------------------------------------------------------- grouping
def contiguous_groups(geo: LayerHeads, n: int) -> list[tuple[int, ...]]:
    size = geo.num_heads // n
    return [tuple(range(i * size, (i + 1) * size)) for i in range(n)]


@_one_thread
def kv_distances(b: Blocks, gram: torch.Tensor, rot_dim: int, k_aligned: bool, v_aligned: bool) -> torch.Tensor:
    """Relative merge error of every pair of old KV heads [K, K] (K and V parts summed).

    Aligned parts are measured after the best function-preserving maps (per-plane rotation
    for K's rotary dims, orthogonal elsewhere), the others as raw differences.
    """
    def part(w: torch.Tensor, planes: int, aligned: bool) -> torch.Tensor:
        e = _energy(w, gram)
        norm = e[:, None] + e[None, :] + _EPS
        if not aligned:
            cm = _real_moments(w, gram)
            cross = cm.diagonal(dim1=2, dim2=3).sum(-1)
            return (norm - 2 * cross) / norm
        if planes:
            m = _plane_moments(_planes(w, planes), gram).abs().sum(0)
            rest = w[:, planes:]
            if rest.shape[1]:
                m = m + torch.linalg.matrix_norm(_real_moments(rest, gram), ord="nuc")
        else:
            m = torch.linalg.matrix_norm(_real_moments(w, gram), ord="nuc")
        return (norm - 2 * m) / norm

    return part(b.k, rot_dim, k_aligned) + part(b.v, 0, v_aligned)


def balanced_partition(dist: torch.Tensor, n: int) -> list[list[int]]:
    """n equal groups of units with small within-group distance: contiguous start, best swaps."""
    units = dist.shape[0]
    size = units // n
    groups = [list(range(i * size, (i + 1) * size)) for i in range(n)]
    dd = dist.tolist()
    for _ in range(10 * units):
        best, move = -1e-12, None
        for ga in range(n):
            for gb in range(ga + 1, n):
                for a in groups[ga]:
                    for bu in groups[gb]:
                        delta = sum(dd[bu][x] - dd[a][x] for x in groups[ga] if x != a) + \
                            sum(dd[a][y] - dd[bu][y] for y in groups[gb] if y != bu)
                        if delta < best:
                            best, move = delta, (ga, a, gb, bu)
        if move is None:
            break
        ga, a, gb, bu = move
        groups[ga][groups[ga].index(a)] = bu
        groups[gb][groups[gb].index(bu)] = a
    return [sorted(g) for g in groups]


def similarity_groups(b: Blocks, geo: LayerHeads, n: int, gram: torch.Tensor, rot_dim: int,
                      k_aligned: bool, v_aligned: bool) -> list[tuple[int, ...]]:
    """Groups of query heads whose KV heads behave most alike; each group's heads ascending."""
    dist = kv_distances(b, gram, rot_dim, k_aligned, v_aligned)
    if geo.num_kv_heads % n == 0 and not geo.uneven:  # whole old KV groups move together
        parts = balanced_partition(dist, n)
        groups = [tuple(h for j in p for h in geo.query_heads_of(j)) for p in parts]
    else:  # an old KV head has to be split, or the old groups differ in size: query heads are the units
        kv = torch.tensor([geo.kv_head_of(h) for h in range(geo.num_heads)])
        parts = balanced_partition(dist[kv][:, kv], n)
        groups = [tuple(p) for p in parts]
    return sorted((tuple(sorted(g)) for g in groups), key=lambda g: g[0])


# --------------------------------------------------------------------------- model level
@dataclass
class LayerPlan:
    """How one layer is converted."""

    groups: list[tuple[int, ...]]
    new_geo: LayerHeads
    order: list[int] = field(default_factory=list)  # original query head of each new position
    merged: bool = True  # False: the layer had the target's KV heads or fewer and stays as it is


def plan_layers(model, adapter: Adapter, n: int, grouping: str, method: str,
                grams: Mapping[int, torch.Tensor] | None) -> list[LayerPlan]:
    """Groups per layer (similarity grouping needs `grams`)."""
    if grouping not in GROUPINGS:
        raise UsageError(f"unknown --grouping {grouping!r}; use {', '.join(GROUPINGS)}")
    if grouping == "similarity" and grams is None:
        raise UsageError("--grouping similarity needs calibration data (--data)")
    geometry = adapter.geometry(model.config)
    if grouping == "contiguous":
        return contiguous_plans(geometry, n)
    state = model.state_dict()
    plans = []
    for i, geo in enumerate(geometry):
        if not merges(geo, n):
            plans.append(unmerged_plan(geo))
            continue
        b = read_blocks(state, adapter, adapter.layer_prefix(model, i), geo)
        rot = adapter.rotary_dim(model.config, geo.head_dim)
        aligned = method != "mean"
        groups = similarity_groups(b, geo, n, grams[i], rot, k_aligned=aligned and not adapter.qk_norm,
                                   v_aligned=aligned)
        plans.append(merged_plan(geo, n, groups))
    return plans


def unmerged_plan(geo: LayerHeads) -> LayerPlan:
    """A layer with the target's KV heads or fewer: it stays as it is."""
    return LayerPlan([tuple(geo.query_heads_of(k)) for k in range(geo.num_kv_heads)], geo,
                     list(range(geo.num_heads)), merged=False)


def merged_plan(geo: LayerHeads, n: int, groups: list[tuple[int, ...]]) -> LayerPlan:
    """A layer merged into `groups` (n of them), its query heads in group order."""
    return LayerPlan(groups, LayerHeads(geo.num_heads, n, geo.head_dim), [h for g in groups for h in g])


def contiguous_plans(geometry: Sequence[LayerHeads], n: int) -> list[LayerPlan]:
    """Every layer's plan for contiguous grouping: from the geometry alone, so that the streamed
    conversion (no model) records the same groups and head order as the in-memory one."""
    return [merged_plan(geo, n, contiguous_groups(geo, n)) if merges(geo, n) else unmerged_plan(geo)
            for geo in geometry]


def mean_layer_tensors(tensors: Mapping[str, torch.Tensor], adapter: Adapter, prefix: str, geo: LayerHeads,
                       groups: Sequence[Sequence[int]], new_geo: LayerHeads) -> dict[str, torch.Tensor]:
    """`--merge mean` on a layer's tensors in their own dtype: only what changes is returned.

    Each group's K/V heads (weights and biases) are averaged in float64 and cast back; query
    heads and output-projection columns are only reordered into group order, so a tensor that
    holds nothing but q or o is left out entirely when the grouping is contiguous (streaming
    copies it file to file). Why not merge_layer: it lifts every q/o block to float64 for the
    data-aware methods, which for a plain mean is all cost and no effect on the result.
    """
    order = [h for g in groups for h in g]
    identity = order == list(range(geo.num_heads))
    out = {}
    for key, ht in layer_tensor_names(adapter, prefix, tensors.keys()):
        if identity and set(ht.kinds) <= {"q", "o"}:
            continue
        t = tensors[key].detach()
        parts = {}
        for kind in ht.kinds:
            blocks = extract_heads(t, ht, geo, kind)
            if kind in ("q", "o"):
                parts[kind] = blocks if identity else blocks[order]
            else:
                src = [[geo.kv_head_of(h) for h in g] for g in groups]
                parts[kind] = torch.stack([blocks[s].to(torch.float64).mean(0) for s in src]).to(t.dtype)
        out[key] = assemble(ht, new_geo, parts)
    return out


def converted_layer_tensors(model, adapter: Adapter, layer: int, plan: LayerPlan, method: str,
                            gram: torch.Tensor | None, state: Mapping[str, torch.Tensor] | None = None,
                            ) -> dict[str, torch.Tensor]:
    """New head-carrying tensors (full keys, model dtype) of `layer` after merging per `plan`."""
    state = state if state is not None else model.state_dict()
    geo = adapter.geometry(model.config)[layer]
    prefix = adapter.layer_prefix(model, layer)
    if method == "mean":
        changed = mean_layer_tensors(state, adapter, prefix, geo, plan.groups, plan.new_geo)
        return {key: changed.get(key, state[key]) for key, _ in layer_tensor_names(adapter, prefix, state.keys())}
    b = read_blocks(state, adapter, prefix, geo)
    rot = adapter.rotary_dim(model.config, geo.head_dim)
    merged = merge_layer(b, geo, plan.groups, method, gram, rot, bool(adapter.qk_norm))
    return write_tensors(merged, adapter, prefix, state, geo, plan.new_geo)


def aligned_layer_tensors(model, adapter: Adapter, layer: int, groups: Sequence[Sequence[int]],
                          gram: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer's tensors with the alignment maps applied and nothing merged (same geometry)."""
    state = model.state_dict()
    geo = adapter.geometry(model.config)[layer]
    prefix = adapter.layer_prefix(model, layer)
    b = read_blocks(state, adapter, prefix, geo)
    rot = adapter.rotary_dim(model.config, geo.head_dim)
    return write_tensors(apply_alignment(b, geo, groups, gram, rot, k_maps=not adapter.qk_norm),
                         adapter, prefix, state, geo, geo)


def convert_in_place(model, adapter: Adapter, plans: Sequence[LayerPlan], method: str,
                     grams: Mapping[int, torch.Tensor] | None) -> None:
    """Merge every layer of `model` per `plans`, in place (through headtool.model.resize)."""
    state = {k: v for k, v in model.state_dict().items()}
    for i, plan in enumerate(plans):
        if not plan.merged:
            continue
        tensors = converted_layer_tensors(model, adapter, i, plan, method,
                                          None if grams is None else grams[i], state)
        resize_attention(model, adapter, i, plan.new_geo, tensors)  # also updates model.config


def summary_figures(model, adapter: Adapter) -> dict[str, Any]:
    """Parameters and KV cache of a model (before/after columns of the summary)."""
    info = model_info(model, adapter)
    return conversion_figures(info, ("params", "attention_params", "kv_cache_bytes_per_token", "num_kv_heads",
                                      "total_kv_heads", "num_heads"))


@dataclass
class Converted:
    """One conversion of a model: the new model, its per-layer plans and the refit report."""

    method: str
    model: Any
    plans: list[LayerPlan]
    refit: list[dict] | None
    seconds: float


CONVERT_INSTEAD = ("use --sequential (one layer at a time on --device) for the data-aware merges, "
                   "or --streaming with --merge mean")


def convert_model(original, adapter: Adapter, n: int, *, method: str, grouping: str = "contiguous",
                  grams: Mapping[int, torch.Tensor] | None = None, refit: bool = False,
                  batches: Sequence[dict] | None = None, heldout_batches: Sequence[dict] | None = None,
                  damping: float = 1e-2, anchor: float | Sequence[float] = DEFAULT_ANCHOR,
                  calib_device=None) -> Converted:
    """A converted copy of `original` (left untouched) with `n` KV heads per layer.

    With `refit`, the output projections are refit sequentially through the layers on
    `batches` (each layer fed by the already converted and refit earlier ones), damped, and a
    layer's refit is kept only when it lowers the error on `heldout_batches`. `anchor` pulls
    the refit toward the merged output projection (the weights without a refit), relative to
    the mean diagonal of the Gram matrix: 0 is the plain damped refit, inf none; several
    values are candidates chosen per layer on `heldout_batches` (see
    compensation.sequential_refit). The default, compensation.DEFAULT_ANCHOR (1), held up
    best on text the calibration never saw. With `calib_device`, the refit moves one layer at
    a time to that device (the model stays put).
    """
    import copy
    import time

    t0 = time.perf_counter()
    require_resident_weights(original, "convert-gqa", CONVERT_INSTEAD)
    check_target(adapter, adapter.geometry(original.config), n)
    model = copy.deepcopy(original)
    plans = plan_layers(original, adapter, n, grouping, method, grams)
    convert_in_place(model, adapter, plans, method, grams)
    report = None
    if refit:
        if not batches:
            raise UsageError("the output-projection refit needs calibration data (--data)")
        report = sequential_refit(original, model, adapter, batches, damping=damping, anchor=anchor,
                                  heldout_batches=heldout_batches, device=calib_device)
    return Converted(method, model, plans, report, time.perf_counter() - t0)
