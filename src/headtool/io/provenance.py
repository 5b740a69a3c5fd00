"""Which text a written model was fitted on, so that `headtool eval` does not flatter it.

Every command that writes a model (prune, convert-gqa, convert-mla, heal, recipes) records in
headtool.json, under `data_read`, how many leading blocks of each source it read: to fit (scores,
refits, merges, factorizations, training) or only to evaluate, together with what the model it
started from had recorded. `headtool eval` reads these records (`data_plan.evaluation_cut`): its
blocks start after every block any of the models was fitted on of the evaluated source (the same
cut prune's --eval-data and recipes make), and it marks the models fitted on the evaluated text's
domain, where a figure flatters them. The model card lists the same texts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

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
    """JSON entries of (source, seq_len, seed, role, part) -> blocks, in a stable order."""
    out = []
    for (source, seq_len, seed, role, part), blocks in sorted(seen.items(), key=lambda kv: tuple(map(str, kv[0]))):
        entry = {"source": source, "seq_len": seq_len, "seed": seed, "role": role, "blocks": blocks}
        out.append({**entry, "part": True} if part else entry)
    return out


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


def fitted_on_any(record: list[dict], sources: set[str]) -> bool:
    """Was the record's model fitted on one of `sources` (a text's source and its mixture's parts)?
    Then a figure measured on that text is in-domain and flatters."""
    return any(e["source"] in sources for e in record if e.get("role", FIT) == FIT)


def fitted_on(record: list[dict], info: dict | None) -> bool:
    """`fitted_on_any` for the source of `info` (a Batches info) and its mixture's parts."""
    if not info:
        return False
    return fitted_on_any(record, {info.get("source"), *(p.get("source") for p in info.get("mixture") or [])})


IN_DOMAIN_NOTE = "in-domain: the model was fitted on this text's source, so the figure flatters"


def fitted_sources(record: list[dict]) -> list[str]:
    """The sources (as given: a mixture whole) a record's model was fitted on."""
    return sorted({e["source"] for e in record if e.get("role", FIT) == FIT and not e.get("part")})
