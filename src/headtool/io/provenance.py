"""Which text a written model was fitted on, so that `headtool eval` does not flatter it.

Every command that writes a model (prune, convert-gqa, convert-mla, heal, recipes) records in
headtool.json, under `data_read`, how many leading blocks of each source it read: to fit (scores,
refits, merges, factorizations, training) or only to evaluate, together with what the model it
started from had recorded. `headtool eval` reads these records (`data_plan.evaluation_cut`): its
blocks start after every block any of the models was fitted on of the evaluated source (the same
cut prune's --eval-data and recipes make), and it marks the models fitted on the evaluated text's
domain, where a figure flatters them. The model card lists the same texts. A local file is matched by
its resolved path or content (`source_path`, `source_sha256`) where both sides have them, so the
spelling of its path does not matter; records without them match by the source as typed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

RECORD = "data_read"
#: The keys under which a Batches info (and a `data_read` entry) names a local file source: its resolved
#: path and a digest of its bytes (data.sources.file_identity), so that ./a.txt, /abs/a.txt and a.txt from
#: its folder are one source and an unrelated a.txt elsewhere is another (the source as typed says neither).
SOURCE_PATH, SOURCE_SHA256 = "source_path", "source_sha256"
FIT, EVAL = "fit", "eval"


def read_entries(infos: Iterable[dict]) -> list[dict]:
    """One entry per (source, seq_len, seed, role): how many of the source's first blocks (in its
    seeded order, skipped ones included) were read; a mixture gives an entry for itself (its
    blocks are positions in its schedule) and one per part (`part`: true). A local file's entry
    carries the identity its Batches info recorded (`file_identity`) beside the path as typed."""
    seen: dict[tuple, dict] = {}
    for info in infos:
        role = info.get("role", FIT)
        for p in [info, *(info.get("mixture") or [])]:
            if isinstance(p.get("source"), str):
                entry = _entry(p["source"], _identity(p), info.get("seq_len"), info.get("seed"), role, p is not info)
                _keep(seen, entry, int(p.get("skip_samples") or 0) + int(p.get("samples") or 0))
    return _entries(seen)


def merged(*records: Iterable[dict] | None) -> list[dict]:
    """The records together, the largest count kept for each (source, seq_len, seed, role)."""
    seen: dict[tuple, dict] = {}
    for record in records:
        for e in record or ():
            entry = _entry(e["source"], _identity(e), e.get("seq_len"), e.get("seed"), e.get("role", FIT),
                           bool(e.get("part")))
            _keep(seen, entry, int(e.get("blocks") or 0))
    return _entries(seen)


def _identity(p: dict) -> dict[str, str]:
    """The identity of a local file an info or entry recorded ({} for other sources, old records)."""
    return {k: p[k] for k in (SOURCE_PATH, SOURCE_SHA256) if isinstance(p.get(k), str)}


def _entry(source: str, identity: dict, seq_len, seed, role: str, part: bool) -> dict:
    """A record entry without its count, in the order headtool.json shows it."""
    entry = {"source": source, **identity, "seq_len": seq_len, "seed": seed, "role": role}
    return {**entry, "part": True} if part else entry


def _keep(seen: dict[tuple, dict], entry: dict, blocks: int) -> None:
    """The largest count per (source, seq_len, seed, role, part); a local file is one source by its
    resolved path however it was typed (the first spelling is kept)."""
    key = (entry.get(SOURCE_PATH) or entry["source"], entry["seq_len"], entry["seed"], entry["role"],
           bool(entry.get("part")))
    held = seen.setdefault(key, entry)
    held["blocks"] = max(int(held.get("blocks") or 0), blocks)


def _entries(seen: dict[tuple, dict]) -> list[dict]:
    """The JSON entries in a stable order."""
    def order(e: dict) -> tuple:
        return tuple(map(str, (e["source"], e["seq_len"], e["seed"], e["role"], bool(e.get("part")),
                               e.get(SOURCE_PATH, ""))))

    out = []
    for e in sorted(seen.values(), key=order):  # blocks before part, as before
        part = e.pop("part", False)
        out.append({**e, "part": True} if part else e)
    return out


def folder_meta(path: str | Path | None) -> dict | None:
    """A folder's headtool.json, or None where there is none or it is not a JSON object (not a headtool
    output; the file is the user's to edit)."""
    if path is None:
        return None
    try:
        doc = json.loads((Path(path) / "headtool.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def folder_record(path: str | Path | None) -> list[dict] | None:
    """The record in a folder's headtool.json; None when there is none (not a headtool output, or
    one written before headtool recorded what it read)."""
    doc = folder_meta(path)
    record = doc.get(RECORD) if doc is not None else None
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


def same_source(entry: dict, source: str, identity: dict) -> bool:
    """Does a record's entry name `source` (whose `file_identity` is `identity`)? Where both name a
    local file, by its resolved path or its content, however either path was typed (./a.txt,
    /abs/a.txt); otherwise (builtin:, self, hub names, records written before headtool recorded
    paths) by the source as typed."""
    if entry.get(SOURCE_PATH) and identity.get(SOURCE_PATH):
        digest = entry.get(SOURCE_SHA256)
        return entry[SOURCE_PATH] == identity[SOURCE_PATH] or (digest is not None
                                                               and digest == identity.get(SOURCE_SHA256))
    return entry["source"] == source


def _fitted(record: list[dict], named: list[tuple[str, dict]]) -> bool:
    """Was the record's model fitted on one of `named` ((source, identity) pairs)?"""
    return any(same_source(e, source, identity) for e in record if e.get("role", FIT) == FIT
               for source, identity in named)


def fitted_on_any(record: list[dict], named: Iterable[tuple[str, dict]]) -> bool:
    """Was the record's model fitted on one of `named` ((source, its file_identity) pairs: a text's
    source and its mixture's parts)? Then a figure measured on that text is in-domain and flatters."""
    return _fitted(record, [(s, identity) for s, identity in named if isinstance(s, str)])


def fitted_on(record: list[dict], info: dict | None) -> bool:
    """`fitted_on_any` for the source of `info` (a Batches info, with the file identities it recorded)
    and its mixture's parts."""
    if not info:
        return False
    return _fitted(record, [(p["source"], _identity(p))
                            for p in [info, *(info.get("mixture") or [])] if isinstance(p.get("source"), str)])


IN_DOMAIN_NOTE = "in-domain: the model was fitted on this text's source, so the figure flatters"


def fitted_sources(record: list[dict]) -> list[str]:
    """The sources (as given: a mixture whole) a record's model was fitted on."""
    return sorted({e["source"] for e in record if e.get("role", FIT) == FIT and not e.get("part")})


#: headtool.json keys of a model pruned from a headtool output: its kept query heads as indices of the model
#: that chain started from (`kept_heads` names those of the input folder) and that model's source record
ORIGINAL_KEPT, ORIGINAL_SOURCE = "original_kept_heads", "original_source"


def original_heads(source_path: str | Path | None, kept: Sequence[Sequence[int]] | None,
                   heads_before: Sequence[int]) -> dict:
    """Where the input is itself a headtool output that chose heads (a prune, convert-gqa or recipe with
    `kept_heads`): `kept` (positions in the input, whose layers hold `heads_before` query heads) as heads
    of the model that output's chain started from, under ORIGINAL_KEPT, with that model's source record
    under ORIGINAL_SOURCE. {} for any other input, or where the input's record does not fit its heads
    (an edited file)."""
    doc = folder_meta(source_path)
    if doc is None or kept is None:
        return {}
    earlier = doc.get(ORIGINAL_KEPT) if ORIGINAL_KEPT in doc else doc.get("kept_heads")
    source = doc.get(ORIGINAL_SOURCE) if ORIGINAL_KEPT in doc else doc.get("source")
    fits = (isinstance(earlier, list) and len(earlier) == len(heads_before) == len(kept)
            and all(isinstance(layer, list) and len(layer) == n and all(type(h) is int for h in layer)
                    for layer, n in zip(earlier, heads_before))
            and all(0 <= p < n for layer, n in zip(kept, heads_before) for p in layer))
    if not fits:
        return {}
    return {ORIGINAL_KEPT: [[layer[p] for p in positions] for layer, positions in zip(earlier, kept)],
            ORIGINAL_SOURCE: source if isinstance(source, dict) else None}


def original_heads_kept_as_is(source_path: str | Path | None, heads: Sequence[int]) -> dict:
    """original_heads of an operation that keeps every query head where it is (heal, convert-mla): the
    input's own lineage carried on, so that a prune after it still names the first model's heads."""
    return original_heads(source_path, [list(range(n)) for n in heads], heads)
