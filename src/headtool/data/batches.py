"""Token batches from a DataSpec: packed blocks for language models (masked for MLM), padded
examples for classification; the same spec and tokenizer always give byte-identical tensors.

Selection is prefix-stable: blocks (or examples) are ordered by a seeded shuffle
that does not depend on ``max_samples`` or ``skip_samples``, so
``skip_samples=N`` with the same seed always gives data disjoint from the first N.

``self`` sources (text sampled from the model, ``selfgen``) need the model: pass it as
``make_batches(spec, tokenizer, task, model=lm)``. Their blocks are taken in generation order
(block i is the same sample whatever is asked for), so ``skip_samples=N`` gives the blocks after
the first N. Mixtures (``a.txt*3+self``; grammar in ``sources``) interleave their sources' blocks
by weighted round-robin; max/num-tokens/skip count blocks of the whole mixture.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch

from ..console import info as tell
from ..console import warn
from ..errors import UsageError
from .selfgen import DEFAULT_SELF_SAMPLES, can_sample, self_blocks
from .sources import (AUTO_OTHER, AUTO_SAMPLING, SOURCE_PATH, DataSpec, SourcePart, builtin_version, file_identity,
                      is_auto, load_source, parse_sources, self_source)


TASKS = ("lm", "mlm", "classification", "plain")

#: Blocks are shuffled within consecutive chunks of about this many tokens. The
#: chunking keeps selection independent of max/skip (so held-out data stays
#: disjoint) while only tokenizing the first chunk(s) of a large corpus.
CHUNK_TOKENS = 1 << 20

MLM_PROBABILITY = 0.15
_TOKENIZE_BATCH_CHARS = 200_000


@dataclass
class Batches:
    """Token batches plus a JSON-ready description of where they came from."""

    batches: list[dict[str, torch.Tensor]]
    info: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batches[index]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens over all batches."""
        return real_token_count(self.batches)


# --------------------------------------------------------------------------- helpers


def _position_limit(model: Any) -> int | None:
    """The most tokens a sequence of `model` (a LoadedModel or a module) may hold, where its positions
    are learned (arch.Adapter.max_positions); None where there is no such limit or no model."""
    from ..arch.registry import adapter_for
    from ..errors import HeadtoolError

    config = getattr(getattr(model, "model", model), "config", None)
    if config is None:
        return None
    try:
        return adapter_for(config).max_positions(config)
    except HeadtoolError:
        return None


def _validate(spec: DataSpec, task: str, tokenizer: Any, model: Any = None) -> None:
    if task not in TASKS:
        raise UsageError(f"unknown data task '{task}'; use one of: {', '.join(TASKS)}")
    if tokenizer is None or not callable(tokenizer):
        raise UsageError("a tokenizer is needed to make token batches")
    if not isinstance(spec.seq_len, int) or spec.seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2 (got {spec.seq_len})")
    if not isinstance(spec.batch_size, int) or spec.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {spec.batch_size})")
    if spec.max_samples is not None and spec.max_samples < 1:
        raise UsageError(f"--max-samples must be at least 1 (got {spec.max_samples})")
    if spec.num_tokens is not None and spec.num_tokens < 1:
        raise UsageError(f"--num-tokens must be at least 1 (got {spec.num_tokens})")
    if spec.num_tokens is not None and spec.num_tokens < spec.seq_len:
        raise UsageError(
            f"--num-tokens {spec.num_tokens} is less than one block of --seq-len {spec.seq_len}; "
            "raise --num-tokens or lower --seq-len"
        )
    if spec.skip_samples < 0:
        raise UsageError(f"--skip-samples must be 0 or more (got {spec.skip_samples})")
    mml = getattr(tokenizer, "model_max_length", None)
    if isinstance(mml, int) and 0 < mml < 1_000_000 and spec.seq_len > mml:
        raise UsageError(
            f"--seq-len {spec.seq_len} is longer than the tokenizer's maximum length {mml}; use --seq-len {mml} or less"
        )
    most = _position_limit(model)
    if most is not None and spec.seq_len > most:  # failed inside the model: 'internal error: IndexError'
        raise UsageError(f"--seq-len {spec.seq_len} is longer than the model's {most} positions "
                         f"(max_position_embeddings); use --seq-len {most} or less")


def _sample_cap(spec: DataSpec) -> int | None:
    """max_samples, num_tokens // seq_len, or the smaller of the two when both are given."""
    caps = []
    if spec.max_samples is not None:
        caps.append(spec.max_samples)
    if spec.num_tokens is not None:
        caps.append(spec.num_tokens // spec.seq_len)
    return min(caps) if caps else None


def _order(n: int, chunk: int, seed: int) -> torch.Tensor:
    """Seeded order of n items, shuffled within consecutive chunks of `chunk`.

    Chunk k's permutation depends only on (seed, chunk sizes before k), which are all
    full: the order of the first m chunks is the same however far the corpus was read.
    """
    g = torch.Generator().manual_seed(int(seed))
    parts = [torch.randperm(min(chunk, n - s), generator=g) + s for s in range(0, n, chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _select(n: int, chunk: int, spec: DataSpec, cap: int | None, what: str) -> tuple[torch.Tensor, str]:
    """Indices (in corpus order) of the chosen items and how they were chosen."""
    if cap is None and spec.skip_samples == 0:
        return torch.arange(n), "sequential"
    order = _order(n, chunk, spec.seed)
    stop = None if cap is None else spec.skip_samples + cap
    chosen = order[spec.skip_samples : stop]
    if chosen.numel() == 0:
        raise UsageError(
            f"--skip-samples {spec.skip_samples} leaves no data: there are only {n} {what}; "
            "lower --skip-samples (or --seq-len)"
        )
    if cap is not None and chosen.numel() < cap:
        warn(f"asked for {cap} {what} but only {chosen.numel()} are available; using {chosen.numel()}")
    return torch.sort(chosen).values, "shuffled"


def _separator_id(tokenizer: Any) -> int | None:
    for attr in ("eos_token_id", "sep_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return None


def _encoder_wrap(tokenizer: Any, task: str) -> tuple[int, int] | None:
    if task not in ("mlm", "plain"):
        return None
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    if isinstance(cls, int) and isinstance(sep, int):
        return cls, sep
    return None


def _tokenize(tokenizer: Any, texts: list[str], **kw: Any) -> list[list[int]]:
    enc = tokenizer(texts, verbose=False, **kw)
    return [list(x) for x in enc["input_ids"]]


def _token_stream(
    tokenizer: Any, texts: list[str], block: int, target_blocks: int | None
) -> tuple[list[int], bool]:
    """Tokens of the texts joined by the separator; stops once target_blocks are there.

    Returns (stream, exhausted): exhausted is False when reading stopped early.
    """
    sep = _separator_id(tokenizer)
    stream: list[int] = []
    i, n = 0, len(texts)
    while i < n:
        j, chars = i, 0
        while j < n and (j == i or chars + len(texts[j]) <= _TOKENIZE_BATCH_CHARS):
            chars += len(texts[j])
            j += 1
        batch = [t for t in texts[i:j] if t.strip()]
        i = j
        if not batch:
            continue
        for ids in _tokenize(tokenizer, batch, add_special_tokens=False):
            if not ids:
                continue
            if stream and sep is not None:
                stream.append(sep)
            stream.extend(ids)
        if target_blocks is not None and len(stream) // block >= target_blocks and i < n:
            return stream, False
    return stream, True


def _fingerprint(batches: list[dict[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(k.encode())
            h.update(b[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _split_batches(tensors: dict[str, torch.Tensor], batch_size: int) -> list[dict[str, torch.Tensor]]:
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[s : s + batch_size].clone() for k, v in tensors.items()} for s in range(0, n, batch_size)]


def _mask_tokens(ids: torch.Tensor, tokenizer: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking: 15% of non-special positions; of those 80% [MASK], 10% random, 10% kept.

    Every row with a maskable position gets at least one masked position, so no batch
    has an undefined (all -100) loss.
    """
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if not isinstance(mask_id, int):
        raise UsageError("masked-LM data needs a tokenizer with a mask token; this tokenizer has none")
    special_ids = sorted({int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None})
    special = torch.isin(ids, torch.tensor(special_ids, dtype=ids.dtype)) if special_ids else torch.zeros_like(ids, dtype=torch.bool)
    g = torch.Generator().manual_seed(int(seed))
    maskable = ~special
    masked = (torch.rand(ids.shape, generator=g) < MLM_PROBABILITY) & maskable
    pick = torch.rand(ids.shape, generator=g).masked_fill(~maskable, -1.0).argmax(dim=1)
    need = ~masked.any(dim=1) & maskable.any(dim=1)
    masked[need, pick[need]] = True
    how = torch.rand(ids.shape, generator=g)
    vocab = len(tokenizer)
    allowed = torch.ones(vocab, dtype=torch.bool)
    in_vocab = [i for i in special_ids if 0 <= i < vocab]
    if in_vocab:
        allowed[torch.tensor(in_vocab)] = False
    allowed_ids = allowed.nonzero().squeeze(1)
    random_ids = allowed_ids[torch.randint(len(allowed_ids), ids.shape, generator=g)]
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    out = ids.clone()
    out[masked & (how < 0.8)] = mask_id
    rnd = masked & (how >= 0.8) & (how < 0.9)
    out[rnd] = random_ids[rnd]
    return out, labels


# --------------------------------------------------------------------------- batches


def _base_info(spec: DataSpec, task: str, split: str | None) -> dict:
    info: dict = {"source": spec.source, **file_identity(spec.source), "split": split, "seq_len": spec.seq_len,
                  "seed": spec.seed, "task": task}
    if spec.source.startswith("builtin:"):
        info["source_version"] = builtin_version(spec.source)
    return info


@dataclass
class _Read:
    """One text source read far enough into blocks: its stream, block count and provenance."""

    loaded: Any
    where: str
    stream: list[int]
    n_blocks: int
    exhausted: bool


def _block_len(spec: DataSpec, tokenizer: Any, task: str) -> tuple[int, tuple[int, int] | None]:
    wrap = _encoder_wrap(tokenizer, task)
    block = spec.seq_len - 2 if wrap else spec.seq_len
    if block < 1:
        raise UsageError(f"--seq-len must be at least 3 for encoder inputs ([CLS] text [SEP]); got {spec.seq_len}")
    return block, wrap


def _read_blocks(spec: DataSpec, tokenizer: Any, block: int, cap: int | None, wrap: Any) -> _Read:
    """Tokenize a source far enough for skip_samples + cap blocks (whole chunks), or fully."""
    loaded = load_source(spec, want_labels=False)
    where = spec.source if spec.source != "-" else "stdin"
    if not any(t.strip() for t in loaded.texts):
        raise UsageError(f"no text found in {where}" + (f" (column '{loaded.text_column}')" if loaded.text_column else ""))
    chunk = max(1, CHUNK_TOKENS // spec.seq_len)
    target = None if cap is None else math.ceil((spec.skip_samples + cap) / chunk) * chunk
    stream, exhausted = _token_stream(tokenizer, loaded.texts, block, target)
    n_blocks = len(stream) // block
    if not exhausted:  # keep whole chunks only, so the order matches a full read
        n_blocks = min(n_blocks, target or n_blocks)
    if n_blocks == 0:
        most = len(stream) + (2 if wrap else 0)  # the longest --seq-len that makes a block of this text
        fix = f"use --seq-len {most} or less, or more text" if most >= 2 else \
            "give more text (--seq-len is at least 2)"
        raise UsageError(f"{where} has only {len(stream)} token{'s' if len(stream) != 1 else ''}, fewer than one "
                         f"block of --seq-len {spec.seq_len}; {fix}")
    return _Read(loaded, where, stream, n_blocks, exhausted)


def _choose_blocks(read: _Read, spec: DataSpec, block: int, cap: int | None) -> tuple[torch.Tensor, str]:
    """The chosen blocks [n, block] in corpus order and how they were chosen."""
    chunk = max(1, CHUNK_TOKENS // spec.seq_len)
    chosen, selection = _select(read.n_blocks, chunk, spec, cap, f"blocks of {spec.seq_len} tokens")
    ids = torch.tensor(read.stream[: read.n_blocks * block], dtype=torch.long).view(read.n_blocks, block)[chosen]
    return ids, selection


def _block_tensors(ids: torch.Tensor, spec: DataSpec, tokenizer: Any, task: str, wrap: Any,
                   info: dict) -> dict[str, torch.Tensor]:
    """Blocks [n, block] -> model inputs (encoder-wrapped, labels or masking for the task)."""
    if wrap:
        cls, sep = wrap
        ids = torch.cat(
            [torch.full((ids.shape[0], 1), cls, dtype=torch.long), ids, torch.full((ids.shape[0], 1), sep, dtype=torch.long)],
            dim=1,
        )
    tensors: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "lm":
        tensors["labels"] = ids.clone()
    elif task == "mlm":
        tensors["input_ids"], tensors["labels"] = _mask_tokens(ids, tokenizer, spec.seed)
        info["mlm_probability"] = MLM_PROBABILITY
        info["masked_tokens"] = int((tensors["labels"] != -100).sum())
    return tensors


def _lm_batches(spec: DataSpec, tokenizer: Any, task: str) -> Batches:
    block, wrap = _block_len(spec, tokenizer, task)
    cap = _sample_cap(spec)
    read = _read_blocks(spec, tokenizer, block, cap, wrap)
    ids, selection = _choose_blocks(read, spec, block, cap)
    info = _base_info(spec, task, read.loaded.split)
    tensors = _block_tensors(ids, spec, tokenizer, task, wrap, info)
    batches = _split_batches(tensors, spec.batch_size)
    info.update(
        samples=int(ids.shape[0]),
        tokens=int(tensors["input_ids"].numel()),
        batch_size=spec.batch_size,
        num_batches=len(batches),
        skip_samples=spec.skip_samples,
        selection=selection,
        available_samples=read.n_blocks,
        corpus_fully_read=read.exhausted,
        text_column=read.loaded.text_column,
    )
    return _finished(batches, info, tokenizer, wrap, cap)


def _finished(batches: list[dict[str, torch.Tensor]], info: dict, tokenizer: Any, wrap, cap: int | None) -> Batches:
    """The Batches of token blocks, their info closed with what every kind of block records."""
    info.update(separator_token_id=_separator_id(tokenizer), encoder_wrapped=bool(wrap),
                fingerprint=_fingerprint(batches))
    if cap is not None:
        info["requested_samples"] = cap
    return Batches(batches, info)


# --------------------------------------------------------------------------- self and mixtures


def mixture_schedule(weights: Sequence[Fraction | float | int], length: int) -> list[int]:
    """Which source gives each of the first `length` blocks of a mixture (weighted round-robin).

    Position k goes to the source whose next block is due first, the due time of source i being
    (blocks it has given + 1) / weight_i; ties go to the source written first. Any prefix holds
    within one block of each source's share, and the schedule depends only on the weights.
    """
    w = [Fraction(x) for x in weights]
    counts = [0] * len(w)
    out: list[int] = []
    for _ in range(length):
        i = min(range(len(w)), key=lambda j: ((counts[j] + 1) / w[j], j))
        counts[i] += 1
        out.append(i)
    return out


@dataclass
class _Part:
    """One source of a mixture: what it is, its share and what it gave."""

    source: str
    weight: Fraction
    self_n: int | None = None  # self:N (None: self without N, or not self)
    is_self: bool = False
    spec: DataSpec | None = None  # a text source's own spec (its columns, split)
    read: _Read | None = None
    available: int | None = None  # blocks it can give (None: as many as asked, self without N)
    skip: int = 0
    take: int = 0
    ids: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


def _mixture_length(parts: list[_Part], skip: int) -> int:
    """Positions (skipped included) until the first source runs out, without a cap.

    A ``self`` without N counts as DEFAULT_SELF_SAMPLES blocks after its share of the
    skipped ones (as it does alone), so ``builtin:pydoc+self`` does not generate a block of
    text for every block of pydoc.
    """
    w = [p.weight for p in parts]
    skipped = mixture_schedule(w, skip)
    finite = [p.available if p.available is not None or not p.is_self
              else skipped.count(i) + DEFAULT_SELF_SAMPLES for i, p in enumerate(parts)]
    counts = [0] * len(parts)
    length = 0
    while True:
        i = min(range(len(w)), key=lambda j: ((counts[j] + 1) / w[j], j))
        if counts[i] >= finite[i]:
            return length
        counts[i] += 1
        length += 1


def _part_spec(spec: DataSpec, source: str) -> DataSpec:
    """A mixture source's own spec: the text column only where there are columns."""
    plain = source == "-" or source.startswith("builtin:") or source.lower().endswith(".txt")
    return replace(spec, source=source, text_column=None if plain else spec.text_column, max_samples=None,
                   num_tokens=None, skip_samples=0)


def _mixed_batches(spec: DataSpec, parts_in: list[SourcePart], tokenizer: Any, task: str, model: Any) -> Batches:
    """Blocks of one ``self`` source or of a mixture (see the grammar in ``sources``)."""
    block, wrap = _block_len(spec, tokenizer, task)
    cap = _sample_cap(spec)
    skip = spec.skip_samples
    mixed = len(parts_in) > 1
    parts = []
    for sp in parts_in:
        is_self, n = self_source(sp.source)
        p = _Part(sp.source, sp.weight, n, is_self)
        if is_self:
            if model is None:
                raise UsageError("--data self needs the model being compressed (text is sampled from it); "
                                 "this step was not given the model")
            p.available = n
        else:
            p.spec = _part_spec(spec, sp.source)
        parts.append(p)

    def context(p: _Part, e: UsageError) -> UsageError:
        return UsageError(f"{e} (source {p.source!r} of the mixture {spec.source!r})") if mixed else e

    if cap is None:  # as many blocks as the finite sources allow: read them whole
        for p in parts:
            if not p.is_self:
                try:
                    p.read = _read_blocks(p.spec, tokenizer, block, None, wrap)
                except UsageError as e:
                    raise context(p, e) from None
                p.available = p.read.n_blocks
        length = _mixture_length(parts, skip)
    else:
        length = skip + cap
    schedule = mixture_schedule([p.weight for p in parts], length)
    for k, i in enumerate(schedule):
        if k < skip:
            parts[i].skip += 1
        else:
            parts[i].take += 1
    if length <= skip:
        raise UsageError(f"--skip-samples {skip} leaves no data: {spec.source} gives only {length} blocks "
                         f"of {spec.seq_len} tokens; lower --skip-samples (or --seq-len)")

    for p in parts:
        if p.is_self:
            need = p.skip + p.take
            if p.self_n is not None:
                need = min(need, p.self_n)
            if need <= p.skip:
                p.ids = torch.zeros((0, block), dtype=torch.long)
                p.info = {"source": p.source, "available_samples": p.self_n}
                continue
            sb = self_blocks(model, tokenizer, need, block, seed=spec.seed, temperature=spec.self_temperature,
                             top_p=spec.self_top_p)
            p.ids = sb.ids[p.skip:]
            p.info = {"source": p.source, "available_samples": p.self_n, "selection": "sequential",
                      "generation": sb.info}
            continue
        if p.take == 0:
            p.ids = torch.zeros((0, block), dtype=torch.long)
            p.info = {"source": p.source}
            continue
        pspec = replace(p.spec, skip_samples=p.skip, max_samples=p.take)
        try:
            if p.read is None:
                p.read = _read_blocks(pspec, tokenizer, block, p.take, wrap)
            # A part that runs out gives what it has (the same blocks: its seeded order cut at its
            # end); the mixture stops there and says so once, in the mixture's own numbers.
            take = min(p.take, p.read.n_blocks - p.skip) if p.read.exhausted else p.take
            if take > 0:
                p.ids, selection = _choose_blocks(p.read, replace(pspec, max_samples=take), block, take)
            else:
                p.ids, selection = torch.zeros((0, block), dtype=torch.long), "shuffled"
        except UsageError as e:
            raise context(p, e) from None
        p.info = {"source": p.source, "split": p.read.loaded.split, "text_column": p.read.loaded.text_column,
                  "available_samples": p.read.n_blocks, "corpus_fully_read": p.read.exhausted,
                  "selection": selection}
        if p.source.startswith("builtin:"):
            p.info["source_version"] = builtin_version(p.source)

    rows: list[torch.Tensor] = []
    used = [0] * len(parts)
    short = None
    for i in schedule[skip:]:
        p = parts[i]
        assert p.ids is not None
        if used[i] >= p.ids.shape[0]:
            short = p
            break
        rows.append(p.ids[used[i]])
        used[i] += 1
    if not rows:  # the first source due after the skipped positions has none left
        assert short is not None
        gives = short.read.n_blocks if short.read is not None else short.available
        raise UsageError(f"--skip-samples {skip} leaves no data: {short.source} has no blocks after the skipped "
                         f"ones (it gives {gives} blocks of {spec.seq_len} tokens, its share of the skipped "
                         f"{short.skip}); lower --skip-samples (or --seq-len)")
    if short is not None and cap is not None:
        warn(f"asked for {cap} blocks of {spec.seq_len} tokens but {short.source} ran out after "
             f"{used[parts.index(short)]}; using {len(rows)}")
    ids = torch.stack(rows)

    split = None if mixed else (parts[0].info.get("split"))
    info = _base_info(spec, task, split)
    tensors = _block_tensors(ids, spec, tokenizer, task, wrap, info)
    batches = _split_batches(tensors, spec.batch_size)
    info.update(
        samples=int(ids.shape[0]),
        tokens=int(tensors["attention_mask"].numel()),
        batch_size=spec.batch_size,
        num_batches=len(batches),
        skip_samples=skip,
    )
    if mixed:
        info["selection"] = "mixture"
        info["mixture"] = [
            {"source": p.source, **file_identity(p.source), "weight": _weight_json(p.weight), "samples": used[i],
             "skip_samples": p.skip, **{k: v for k, v in p.info.items() if k != "source"}}
            for i, p in enumerate(parts)
        ]
        info["order"] = "weighted round-robin"
    else:
        p = parts[0]
        info["selection"] = "sequential"
        info["available_samples"] = p.self_n
        info["generation"] = p.info.get("generation")
    return _finished(batches, info, tokenizer, wrap, cap)


def _weight_json(w: Fraction) -> int | float:
    return int(w) if w.denominator == 1 else float(w)


def _label_ids(labels: list, names: list[str] | None, col: str, where: str) -> tuple[list[int], list[str] | None]:
    """Class ids for raw labels; strings map to ids in sorted order (names recorded)."""
    def empty(v: Any) -> bool:  # a missing number is NaN in parquet (pyarrow, polars) and JSON (NaN)
        return v is None or (isinstance(v, float) and math.isnan(v))

    if any(empty(v) for v in labels):
        n = sum(empty(v) for v in labels)
        raise UsageError(f"label column '{col}' of {where} has {n} empty value(s); fill or drop them")
    if all(isinstance(v, (bool, int)) for v in labels) or all(
        isinstance(v, (bool, int, float)) and float(v).is_integer() for v in labels
    ):
        ids = [int(v) for v in labels]
        if min(ids) < 0:
            raise UsageError(
                f"label column '{col}' of {where} has negative labels (an unlabelled split?); use a labelled split"
            )
        return ids, names
    if any(isinstance(v, float) for v in labels) and all(isinstance(v, (int, float)) for v in labels):
        raise UsageError(
            f"label column '{col}' of {where} holds non-integer numbers; classification needs class labels"
        )
    as_str = [v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in labels]
    names = sorted(set(as_str))
    index = {n: i for i, n in enumerate(names)}
    return [index[v] for v in as_str], names


def _classification_batches(spec: DataSpec, tokenizer: Any) -> Batches:
    if spec.label_column is None:
        raise UsageError("classification needs a label column; pass --label-column")
    loaded = load_source(spec, want_labels=True)
    where = spec.source if spec.source != "-" else "stdin"
    assert loaded.labels is not None and loaded.label_column is not None
    if not loaded.texts:
        raise UsageError(f"no examples found in {where}")
    label_ids, names = _label_ids(loaded.labels, loaded.label_names, loaded.label_column, where)
    cap = _sample_cap(spec)
    n = len(loaded.texts)
    chosen, selection = _select(n, max(n, 1), spec, cap, "examples")
    idx = chosen.tolist()
    enc = _tokenize(
        tokenizer, [loaded.texts[i] for i in idx], add_special_tokens=True, truncation=True, max_length=spec.seq_len
    )
    pad = getattr(tokenizer, "pad_token_id", None)
    if not isinstance(pad, int):
        pad = _separator_id(tokenizer) or 0
    left = getattr(tokenizer, "padding_side", "right") == "left"
    ids = torch.full((len(idx), spec.seq_len), pad, dtype=torch.long)
    att = torch.zeros((len(idx), spec.seq_len), dtype=torch.long)
    for r, seq in enumerate(enc):
        seq = seq[: spec.seq_len] or [pad]  # an empty text still needs one position to attend to
        sl = slice(spec.seq_len - len(seq), spec.seq_len) if left else slice(0, len(seq))
        ids[r, sl] = torch.tensor(seq, dtype=torch.long)
        att[r, sl] = 1
    labels = torch.tensor([label_ids[i] for i in idx], dtype=torch.long)
    batches = _split_batches({"input_ids": ids, "attention_mask": att, "labels": labels}, spec.batch_size)
    info = _base_info(spec, "classification", loaded.split)
    num_labels = len(names) if names else max(label_ids) + 1
    info.update(
        samples=len(idx),
        tokens=int(att.sum()),
        batch_size=spec.batch_size,
        num_batches=len(batches),
        skip_samples=spec.skip_samples,
        selection=selection,
        available_samples=n,
        text_column=loaded.text_column,
        label_column=loaded.label_column,
        num_labels=num_labels,
        fingerprint=_fingerprint(batches),
    )
    if names is not None:
        info["label_names"] = names
    if cap is not None:
        info["requested_samples"] = cap
    return Batches(batches, info)


def resolve_auto(spec: DataSpec | None, tokenizer: Any, model: Any, task: str = "lm") -> DataSpec | None:
    """`spec` with ``--data auto`` made concrete for this model: builtin:pydoc+self where text can be
    sampled from it (a causal LM with a start token, and token blocks wanted), builtin:pydoc
    otherwise. Any other source is returned as it is. Resolved once, where the commands first see
    the model, so held-out and evaluation blocks are cut from the same concrete source."""
    if spec is None or not is_auto(spec.source):
        return spec
    _validate(spec, task, tokenizer, model)  # bad input is reported before anything else is said or done
    sampling = task in ("lm", "plain") and model is not None and can_sample(model, tokenizer)
    source = AUTO_SAMPLING if sampling else AUTO_OTHER
    tell(f"--data auto: {source} ("
         + ("pydoc mixed with text sampled from the model itself" if sampling else "not a causal LM: no self text")
         + ")")
    return replace(spec, source=source)


_READ_LOGS: list[list[dict]] = []


@contextmanager
def blocks_read() -> Iterator[list[dict]]:
    """The info of every Batches made inside the block: a recipe learns which blocks of which
    source its calibrating steps read, so that its evaluations can start after them."""
    seen: list[dict] = []
    _READ_LOGS.append(seen)
    try:
        yield seen
    finally:  # by identity: two logs that saw the same infos are equal lists
        del _READ_LOGS[next(i for i, x in enumerate(_READ_LOGS) if x is seen)]


_EVALUATING: list[bool] = []


@contextmanager
def evaluation_reads() -> Iterator[None]:
    """Batches made inside are only evaluated on (a command's --eval-data, a recipe's eval step),
    not fitted to: the logs of `blocks_read` see them with "role": "eval"."""
    _EVALUATING.append(True)
    try:
        yield
    finally:
        _EVALUATING.pop()


def read_to_fit(info: dict) -> None:
    """Blocks made to evaluate on that then chose the model (convert-gqa's merge among several, with no
    held-out blocks): the logs of `blocks_read` see them again as fitted on, so that the written model's
    record says so and `headtool eval` starts after them and marks a figure on their source in-domain."""
    entry = {k: v for k, v in info.items() if k != "role"}
    for log_ in _READ_LOGS:
        log_.append(entry)


def leading_blocks(info: dict) -> dict[tuple[str, int, int], int]:
    """(source, seq_len, seed) -> how many of the source's first blocks (in its seeded order) a
    Batches read, skipped ones included; every part of a mixture but `self`. A single-source cut
    that skips these is disjoint from what was read. A local file is keyed by its resolved path
    (`source_key`), so that ./a.txt finds the blocks a.txt read."""
    key = (info.get("seq_len"), info.get("seed"))
    parts = info.get("mixture") or [info]
    return {(p.get(SOURCE_PATH) or p["source"], *key): int(p.get("skip_samples") or 0) + int(p.get("samples") or 0)
            for p in parts if isinstance(p.get("source"), str) and not self_source(p["source"])[0]}


def make_batches(spec: DataSpec, tokenizer: Any, task: str = "lm", model: Any = None) -> Batches:
    """Token batches for one task; the same spec and tokenizer always give identical tensors.

    task: 'lm' (packed blocks, labels = input_ids), 'mlm' (packed, encoder-wrapped,
    seeded 15% masking, labels -100 except masked positions), 'classification'
    (one padded example per row, labels = class ids [B]) or 'plain' (packed, no labels).

    model: the model being compressed (a LoadedModel, or a causal-LM module), which ``self``
    sources sample their text from (cached; see ``selfgen``); other sources ignore it.
    ``spec.source`` may be a mixture (``a.txt*3+self``; grammar in ``sources``) or ``auto``
    (``resolve_auto``).
    """
    out = _make_batches(spec, tokenizer, task, model)
    entry = {**out.info, "role": "eval"} if _EVALUATING else out.info
    for log_ in _READ_LOGS:
        log_.append(entry)
    return out


def _make_batches(spec: DataSpec, tokenizer: Any, task: str, model: Any) -> Batches:
    spec = resolve_auto(spec, tokenizer, model, task)
    _validate(spec, task, tokenizer, model)
    parts = parse_sources(spec.source)
    if len(parts) == 1 and not self_source(parts[0].source)[0]:
        if parts[0].source != spec.source:  # one source with a weight: the weight means nothing
            spec = replace(spec, source=parts[0].source)
        if task == "classification":
            return _classification_batches(spec, tokenizer)
        if task == "mlm" and not isinstance(getattr(tokenizer, "mask_token_id", None), int):
            raise UsageError("masked-LM data needs a tokenizer with a mask token; this tokenizer has none")
        return _lm_batches(spec, tokenizer, task)
    what = "--data self" if len(parts) == 1 else f"the mixture --data {spec.source}"
    if task == "classification":
        raise UsageError(f"{what} makes token blocks, not labelled examples; classification takes one "
                         "labelled source")
    if task == "mlm" and not isinstance(getattr(tokenizer, "mask_token_id", None), int):
        raise UsageError("masked-LM data needs a tokenizer with a mask token; this tokenizer has none")
    return _mixed_batches(spec, parts, tokenizer, task, model)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def real_tokens_in(batch: dict) -> int:
    """The tokens of a batch that its attention mask keeps (padding left out); all of them without a mask."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


def real_token_count(batches: Iterable[dict]) -> int:
    """Real (non-padding) tokens over all batches."""
    return sum(real_tokens_in(b) for b in batches)
