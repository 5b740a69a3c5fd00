"""How the commands cut their data: calibration blocks (a default count when --data gives none),
held-out blocks after them, and evaluation blocks disjoint from both. Shared by the commands and
the recipe steps, so one --data means the same blocks in either."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..console import info, warnings_held
from ..data.batches import Batches, evaluation_reads, leading_blocks, make_batches, mixture_schedule
from ..data.sources import DataSpec, file_identity, parse_sources, self_source, source_key
from ..errors import UsageError
from ..io.provenance import FIT, fitted_on_any, same_source


def same_source_name(a: Any, b: Any) -> bool:
    """Do two --data sources name the same text? A local file however its path is written (./a.txt and
    a.txt from its folder: `source_key`); any other source as written."""
    return isinstance(a, str) and isinstance(b, str) and source_key(a.strip()) == source_key(b.strip())


def with_default_blocks(spec: DataSpec | None, blocks: int | None) -> DataSpec | None:
    """`spec`, capped at `blocks` blocks when it says neither max_samples nor num_tokens
    (`self:N` alone says N)."""
    if spec is None or blocks is None or spec.max_samples is not None or spec.num_tokens is not None:
        return spec
    parts = parse_sources(spec.source)
    if len(parts) == 1:
        is_self, n = self_source(parts[0].source)
        if is_self and n is not None:
            blocks = n
    return replace(spec, max_samples=blocks)


def part_blocks(spec: DataSpec | None, source: str, positions: int) -> int | None:
    """How many blocks of `source` the first `positions` blocks of `spec` read when `source` is one
    part of its mixture (None when it is not): a single-source cut of `source` that skips these
    stays disjoint from the mixture's (the block order of a source is the same alone or mixed)."""
    if spec is None:
        return None
    parts = parse_sources(spec.source)
    if len(parts) < 2:
        return None
    index = next((i for i, p in enumerate(parts) if same_source_name(p.source, source)), None)
    if index is None:
        return None
    count = mixture_schedule([p.weight for p in parts], positions).count(index)
    cap = self_source(source)[1]  # self:N gives at most N blocks however many the schedule asks of it
    return count if cap is None else min(count, cap)


def self_blocks_read(spec: DataSpec | None, positions: int) -> int:
    """How many blocks of self text the first `positions` blocks of `spec` read (0 when it reads none;
    self text is one sequence per seed, alone or in a mixture, so later blocks are disjoint)."""
    if spec is None:
        return 0
    parts = parse_sources(spec.source)
    own = next((p.source for p in parts if self_source(p.source)[0]), None)
    if own is None:
        return 0
    if len(parts) == 1:
        cap = self_source(own)[1]
        return positions if cap is None else min(positions, cap)
    return part_blocks(spec, own, positions) or 0


#: Blocks of self text on which `prune --normalize auto` compares its candidate allocations: over 64
#: blocks of 128 tokens the paired per-block loss difference of two allocations of SmolLM2-135M has a
#: standard error of about 0.01 nats (0.02-0.04 over the 16 held-out blocks of the calibration used
#: before). Longer blocks take fewer of them, ALLOCATION_TOKENS in all (at least ALLOCATION_MIN_BLOCKS):
#: the text is sampled, and 64 blocks of 2,048 tokens would be 131k tokens to generate, about a quarter
#: of an hour for SmolLM2-135M on 2 cores and far longer for a 7B model on a CPU.
ALLOCATION_BLOCKS = 64
ALLOCATION_TOKENS = 8192
ALLOCATION_MIN_BLOCKS = 4


def allocation_blocks(seq_len: int) -> int:
    """Blocks of self text that judge the allocation at this block length (64 at 128 tokens or fewer)."""
    return max(ALLOCATION_MIN_BLOCKS, min(ALLOCATION_BLOCKS, ALLOCATION_TOKENS // max(seq_len, 1)))


def allocation_spec(spec: DataSpec, used: int, sampling: bool, after: DataSpec | None = None,
                    heldout_data: str | DataSpec | None = None) -> tuple[DataSpec, int]:
    """The held-out blocks on which candidate layer allocations are compared, and how many blocks of
    `spec` they take. Where the model can sample its own text (`sampling`), allocation_blocks blocks
    of it (64 of 128 tokens) that neither the calibration (its first `used` blocks) nor the evaluation
    `after` read: the model's own distribution judges how general the pruned model stays, where a narrow calibration
    source judges only itself (SmolLM2-135M, six calibrations at 25% and 50%: self text sided with
    news, legal and wiki text in 11 of the 12, the 12th by 0.003 nats; 64 pydoc blocks sided against
    them at t = -3.3 in one).
    Otherwise (or given `heldout_data`: a source to judge on) a quarter of the calibration's count,
    of `heldout_data` or of the calibration after it."""
    if not sampling or heldout_data is not None:
        n = max(4, (spec.max_samples or 16) // 4)
        cspec = heldout_spec(spec, heldout_data, n, used)
        return cspec, n if same_source_name(cspec.source, spec.source) else 0
    skip = self_blocks_read(spec, used)
    if after is not None and after.max_samples is not None:
        skip = max(skip, self_blocks_read(after, after.skip_samples + after.max_samples))
    cspec = replace(spec, source="self", split=None, text_column=None, label_column=None, skip_samples=skip,
                    max_samples=allocation_blocks(spec.seq_len), num_tokens=None)
    return cspec, 0


def _as_given(block: DataSpec, spec: DataSpec | None, blocks: int, used: int) -> DataSpec:
    """A recipe's own held-out or evaluation block: `blocks` blocks unless it says how many, and
    after the `used` calibration blocks when it reads the calibration source and says not where."""
    if block.max_samples is None and block.num_tokens is None:
        block = replace(block, max_samples=blocks)
    if spec is not None and block.skip_samples == 0:
        if same_source_name(block.source, spec.source):
            block = replace(block, skip_samples=used)
        elif (part := part_blocks(spec, block.source, used)) is not None:
            block = replace(block, skip_samples=part)
    return block


def eval_spec(spec: DataSpec | None, eval_data: str | DataSpec, eval_samples: int, used: int,
              held: Batches | None = None) -> tuple[DataSpec, int]:
    """The evaluation data of prune and convert-gqa, and the blocks it skips: a DataSpec as given
    (a recipe's eval_data block; `eval_samples` blocks unless it says), or a source cut like the
    calibration data, after the `used` calibration and held-out blocks when it is the same source.
    `held`: the held-out blocks, when they came from another source; an evaluation on that source
    that would start inside them starts after them."""
    espec, skip = _eval_spec(spec, eval_data, eval_samples, used)
    if held is not None and spec is not None and not same_source_name(held.info.get("source"), spec.source):
        after = leading_blocks(held.info).get((source_key(espec.source), espec.seq_len, espec.seed), 0)
        if skip < after and not (isinstance(eval_data, DataSpec) and eval_data.skip_samples):
            espec, skip = replace(espec, skip_samples=after), after
    return espec, skip


def _eval_spec(spec: DataSpec | None, eval_data: str | DataSpec, eval_samples: int, used: int
               ) -> tuple[DataSpec, int]:
    if isinstance(eval_data, DataSpec):
        given = _as_given(eval_data, spec, eval_samples, used)
        return given, given.skip_samples
    same = spec is not None and same_source_name(eval_data, spec.source)
    part = part_blocks(spec, eval_data, used)
    if (same or part is not None) and spec.max_samples is None:
        raise UsageError(f"--eval-data is {'the same source as' if same else 'a source of'} --data: give "
                         "--max-samples so the evaluation blocks can be held out from it")
    skip = used if same else part or 0
    base = spec if spec is not None else DataSpec(source=eval_data)
    espec = replace(base, source=eval_data, max_samples=eval_samples, num_tokens=None, skip_samples=skip,
                    label_column=None)
    if not same:  # another source: its own columns and split
        espec = replace(espec, split=None, text_column=None)
    return espec, skip


def heldout_spec(spec: DataSpec, heldout_data: str | DataSpec | None, blocks: int, used: int) -> DataSpec:
    """The held-out blocks on which refits and merges are chosen: `blocks` of --heldout-data (a
    DataSpec as given, or a source cut like the calibration), else of --data after the `used`
    calibration blocks."""
    if isinstance(heldout_data, DataSpec):
        return _as_given(heldout_data, spec, blocks, used)
    if heldout_data is None or same_source_name(heldout_data, spec.source):
        return replace(spec, skip_samples=used, max_samples=blocks, num_tokens=None)
    return replace(spec, source=heldout_data, split=None, text_column=None, label_column=None,
                   skip_samples=part_blocks(spec, heldout_data, used) or 0, max_samples=blocks, num_tokens=None)


@dataclass
class CalibrationBlocks:
    """The blocks a data-aware conversion reads: calibration, held-out (refit and merge choices),
    evaluation (reported only), and how many blocks of --data the first two used."""

    cal: Batches | None = None
    held: Batches | None = None
    ev: Batches | None = None
    used: int = 0


def blocks_all_read(read_info: dict, used: int) -> int | None:
    """How many blocks the source gives, where a read (its `Batches.info`) went through the whole source
    and the first `used` of its blocks take all of them, so nothing is left to read after them; else None.
    The calibration, held-out and heal cuts refuse with their own line on it (make_batches would blame a
    --skip-samples nobody gave)."""
    available = read_info.get("available_samples")
    if read_info.get("corpus_fully_read") and isinstance(available, int) and available <= used:
        return available
    return None


def _refuse_read_whole(cal: dict, spec: DataSpec, used: int) -> None:
    """A usage error where the calibration read every block of --data that the held-out blocks were to
    come after."""
    available = blocks_all_read(cal, used)
    if available is not None:
        skipped = f" after --skip-samples {spec.skip_samples}" if spec.skip_samples else ""
        raise UsageError(f"--data {spec.source} gives {available} blocks of {spec.seq_len} tokens and the "
                         f"calibration reads every one{skipped}, so none are left for the held-out blocks: give "
                         f"more text, --max-samples below {cal['samples']} or a lower "
                         "--seq-len, held-out text with --heldout-data, or --heldout-samples 0")


def calibration_blocks(spec: DataSpec, tokenizer: Any, task: str, model: Any, *, calibrate: bool,
                       hold_out: bool, heldout_samples: int | None, heldout_data: str | DataSpec | None,
                       eval_data: str | DataSpec | None, eval_samples: int) -> CalibrationBlocks:
    """Calibration blocks of `spec` (when `calibrate`), `heldout_samples` held-out blocks after them
    (None: a quarter of the calibration, at least 4; when `hold_out`), and `eval_samples` blocks of
    `eval_data` after both when it is the same source. `model` is what `self` text is sampled
    from. convert-gqa and convert-mla (and their recipe steps) cut their data here."""
    with warnings_held():  # 'only 6 of 64 blocks' is dropped where a line below refuses the same text
        return _calibration_blocks(spec, tokenizer, task, model, calibrate=calibrate, hold_out=hold_out,
                                   heldout_samples=heldout_samples, heldout_data=heldout_data,
                                   eval_data=eval_data, eval_samples=eval_samples)


def _calibration_blocks(spec: DataSpec, tokenizer: Any, task: str, model: Any, *, calibrate: bool,
                        hold_out: bool, heldout_samples: int | None, heldout_data: str | DataSpec | None,
                        eval_data: str | DataSpec | None, eval_samples: int) -> CalibrationBlocks:
    out = CalibrationBlocks()
    if calibrate:
        out.cal = make_batches(spec, tokenizer, task, model=model)
        out.used = spec.skip_samples + out.cal.info["samples"]
        n_held = heldout_samples if heldout_samples is not None else max(4, out.cal.info["samples"] // 4)
        if hold_out and n_held > 0 and (heldout_data is None or isinstance(heldout_data, str)
                                        and same_source_name(heldout_data, spec.source)):
            _refuse_read_whole(out.cal.info, spec, out.used)
        if hold_out and n_held > 0:
            hspec = heldout_spec(spec, heldout_data, n_held, out.used)
            out.held = make_batches(hspec, tokenizer, task, model=model)
            if same_source_name(hspec.source, spec.source):
                out.used += out.held.info["samples"]
        info(f"calibrating on {out.cal.info['samples']} blocks of {spec.seq_len} tokens from {spec.source}"
             + (f" ({out.held.info['samples']} held out from {out.held.info.get('source')})" if out.held else ""))
    if eval_data:
        if out.cal is not None and isinstance(eval_data, str) and same_source_name(eval_data, spec.source):
            available = blocks_all_read(out.cal.info, out.used)
            if available is not None:
                read = "calibration and held-out blocks read" if out.held else "calibration reads"
                raise UsageError(f"--eval-data {eval_data}: --data gives {available} blocks of {spec.seq_len} tokens "
                                 f"and the {read} every one, so none are left to evaluate on: give more text, "
                                 "a lower --max-samples or --seq-len, or another --eval-data source")
        espec = eval_spec(spec, eval_data, eval_samples, out.used, out.held)[0]
        with evaluation_reads():
            out.ev = make_batches(espec, tokenizer, task, model=model)
    return out


@dataclass(frozen=True)
class EvalCut:
    """The evaluation data after the cut and what the models read of it."""

    spec: DataSpec
    needed: int  # blocks of spec.source (same block length and seed) that some model read
    read_by: tuple[str, ...]  # the models that read them
    in_domain: dict[str, bool | None]  # fitted on one of the evaluated sources (None: no record)
    other_cut: tuple[str, ...]  # read the source in blocks of another length or seed: may overlap

    @property
    def overlaps(self) -> bool:
        """The evaluation reads blocks a model read (a --skip-samples below what they read)."""
        return self.spec.skip_samples < self.needed


def evaluation_cut(spec: DataSpec, records: dict[str, list[dict] | None], *, skip_given: bool = False) -> EvalCut:
    """`spec` started after every block any model was fitted on of its source with the same block
    length and seed, unless --skip-samples says where to start; which models were fitted on one of its
    sources; and which read its source with another block length or seed (those blocks cannot be
    skipped exactly: the text may overlap). skip_given: --skip-samples was typed (0 included: it was
    read as the default and moved past the fitted blocks, the user asking for the start)."""
    names = {spec.source, *(p.source for p in parse_sources(spec.source))}
    identity = file_identity(spec.source)  # a local file: its records match however its path was typed
    needed, read_by, other = 0, [], []
    in_domain: dict[str, bool | None] = {}
    for ref, record in records.items():
        in_domain[ref] = None if record is None else fitted_on_any(record, [(n, file_identity(n)) for n in names])
        for e in record or ():
            if not same_source(e, spec.source, identity) or e.get("role", FIT) != FIT:
                continue  # (blocks a command only evaluated on need no skipping: eval may report on them too)
            same_cut = (e.get("seq_len"), e.get("seed")) == (spec.seq_len, spec.seed)
            needed = max(needed, int(e["blocks"])) if same_cut else needed
            group = read_by if same_cut else other
            if ref not in group:
                group.append(ref)
    if spec.skip_samples == 0 and needed and not skip_given:
        spec = replace(spec, skip_samples=needed)
    return EvalCut(spec, needed, tuple(read_by), in_domain, tuple(other))
