"""Which text a written model was fitted on, so that `headtool eval` does not flatter it.

Every command that writes a model (prune, convert-gqa, convert-mla, heal, recipes) records in
headtool.json, under `data_read`, how many leading blocks of each source it read: to fit (scores,
refits, merges, factorizations, training) or only to evaluate, together with what the model it
started from had recorded. `headtool eval` reads these records: its blocks start after every block
any of the models read of the evaluated source (the same cut prune's --eval-data and recipes
make), and it says which models were fitted on the evaluated text's domain, where a figure
flatters them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

from ..data.sources import DataSpec, parse_sources

RECORD = "data_read"
FIT, EVAL = "fit", "eval"


def read_entries(infos: Iterable[dict]) -> list[dict]:
    """One entry per (source, seq_len, seed, role): how many of the source's first blocks (in its
    seeded order, skipped ones included) were read; a mixture gives an entry for itself (its
    blocks are positions in its schedule) and one per part (`part`: true)."""
    seen: dict[tuple, int] = {}
    for info in infos:
        role = info.get("role", FIT)
        for p in [info, *(info.get("mixture") or [])]:
            if isinstance(p.get("source"), str):
                key = (p["source"], info.get("seq_len"), info.get("seed"), role, p is not info)
                blocks = int(p.get("skip_samples") or 0) + int(p.get("samples") or 0)
                seen[key] = max(seen.get(key, 0), blocks)
    return _entries(seen)


def merged(*records: Iterable[dict] | None) -> list[dict]:
    """The records together, the largest count kept for each (source, seq_len, seed, role)."""
    seen: dict[tuple, int] = {}
    for record in records:
        for e in record or ():
            key = (e["source"], e.get("seq_len"), e.get("seed"), e.get("role", FIT), bool(e.get("part")))
            seen[key] = max(seen.get(key, 0), int(e.get("blocks") or 0))
    return _entries(seen)


def _entries(seen: dict[tuple, int]) -> list[dict]:
    return [{"source": s, "seq_len": n, "seed": seed, "role": role, "blocks": blocks, **({"part": True} if part
                                                                                        else {})}
            for (s, n, seed, role, part), blocks in sorted(seen.items(), key=lambda kv: tuple(map(str, kv[0])))]


def folder_record(path: str | Path | None) -> list[dict] | None:
    """The record in a folder's headtool.json; None when there is none (not a headtool output, or
    one written before headtool recorded what it read)."""
    if path is None:
        return None
    meta = Path(path) / "headtool.json"
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    record = doc.get(RECORD) if isinstance(doc, dict) else None
    return record if isinstance(record, list) else None


def written_record(infos: Iterable[dict], source_path: str | Path | None, *also: list[dict]) -> list[dict]:
    """What a command that writes a model records: the blocks it read (`blocks_read`), with what
    the model it started from had recorded (and `also`: reads of earlier runs it used)."""
    return merged(read_entries(infos), folder_record(source_path), *also)


def card_lines(record: list[dict] | None) -> list[str]:
    """The model card's account of the text the model was fitted on (and evaluated on only)."""
    if not record:
        return []
    lines = ["## Text it was fitted on", ""]
    for role, what in ((FIT, "fitted on"), (EVAL, "only evaluated on")):
        for e in record:
            if e.get("role", FIT) == role and not e.get("part"):
                lines.append(f"- {what} `{e['source']}`: its first {e['blocks']} blocks of {e.get('seq_len')} "
                             f"tokens (seed {e.get('seed')})")
    lines += ["", "Perplexity on the domains it was fitted on flatters it; evaluate on the text it will serve. "
              "`headtool eval` starts after these blocks (headtool.json, `data_read`).", ""]
    return lines


def fitted_sources(record: list[dict]) -> list[str]:
    """The sources (as given: a mixture whole) a record's model was fitted on."""
    return sorted({e["source"] for e in record if e.get("role", FIT) == FIT and not e.get("part")})


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


def evaluation_cut(spec: DataSpec, records: dict[str, list[dict] | None]) -> EvalCut:
    """`spec` started after every block any model was fitted on of its source with the same block
    length and seed, unless --skip-samples says where to start; which models were fitted on one of its
    sources; and which read its source with another block length or seed (those blocks cannot be
    skipped exactly: the text may overlap)."""
    names = {spec.source, *(p.source for p in parse_sources(spec.source))}
    needed, read_by, other = 0, [], []
    in_domain: dict[str, bool | None] = {}
    for ref, record in records.items():
        in_domain[ref] = None if record is None else any(
            e["source"] in names for e in record if e.get("role", FIT) == FIT)
        for e in record or ():
            if e["source"] != spec.source or e.get("role", FIT) != FIT:
                continue  # (blocks a command only evaluated on need no skipping: eval may report on them too)
            same_cut = (e.get("seq_len"), e.get("seed")) == (spec.seq_len, spec.seed)
            needed = max(needed, int(e["blocks"])) if same_cut else needed
            group = read_by if same_cut else other
            if ref not in group:
                group.append(ref)
    if spec.skip_samples == 0 and needed:
        spec = replace(spec, skip_samples=needed)
    return EvalCut(spec, needed, tuple(read_by), in_domain, tuple(other))
