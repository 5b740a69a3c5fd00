"""Data sources -> texts (and labels).

Every command that needs data (score, eval, inspect, heal, prune with compensation)
reads it through :func:`load_source` and cuts it with ``batches.make_batches``, so that
one ``--data`` reference means the same tokens everywhere and the same options always
give byte-identical batches (scores are reproducible only if their data is).

Sources (``DataSpec.source``): a local ``.txt``, ``.jsonl``, ``.json``, ``.csv``,
``.tsv`` or ``.parquet`` file, a folder written by ``datasets.save_to_disk``, ``-``
(text on stdin), ``builtin:pydoc`` (the help texts that ship inside every Python:
the default calibration corpus, nothing to download), ``builtin:licenses`` (the licence texts
of the installed Python packages: English legal prose, another domain than pydoc that is on
every machine headtool runs on, for out-of-domain evaluation), a hub dataset
``name[:config]``, or ``self`` / ``self:N``: text sampled from the model being compressed
(self-calibration, ``selfgen``; N blocks, default as many as --max-samples / --num-tokens
ask for, else 128, in a mixture too), which ``make_batches`` makes only when it is given
the model.

Mixtures: one ``--data`` string may combine sources, each with an optional weight::

    DATA   := PART ( "+" PART )*
    PART   := SOURCE [ "*" WEIGHT ]         WEIGHT: a positive number, default 1

for example ``builtin:pydoc+self``, ``'a.txt*3+self*1'`` (quote ``*`` in a shell) or
``notes.jsonl*0.5+builtin:pydoc``. Spaces around ``+`` and ``*`` are ignored. A string that
names an existing file or folder is always that one source, and so is a part of a mixture (a path
may contain ``+`` and ``*``: ``c++notes.txt*2+self``); hub names cannot contain ``+`` or ``*``. A source may appear only once (give it a weight instead).
The mixture's blocks are interleaved by weighted round-robin (see ``batches.mixture_schedule``):
position k goes to the source whose next block is due first, due times being
(blocks it has given + 1) / weight, ties to the source written first; so weights 3 and 1
give ``a a a b a a a b ...`` and equal weights alternate. Each source gives the blocks it
would give alone with --skip-samples and --max-samples set to its share of the skipped and
taken positions, in its own order; --max-samples, --num-tokens and --skip-samples count
blocks of the mixture as a whole, so ``skip_samples=k`` gives blocks disjoint from the first
k. The mixture ends where a source runs out of blocks (the proportions stay as written).
Mixtures make token blocks (tasks lm, mlm, plain), not classification examples; the split
and the text column apply to the sources that have columns.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import UsageError
from ..io.provenance import SOURCE_PATH, SOURCE_SHA256
from ..optionspec import option

__all__ = [
    "DataSpec",
    "load_source",
    "load_texts",
    "SourcePart",
    "parse_sources",
    "self_source",
    "SUPPORTED_SUFFIXES",
    "BUILTIN_SOURCES",
    "builtin_version",
    "licence_texts",
]

log = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet")
BUILTIN_SOURCES = ("builtin:pydoc", "builtin:licenses")

#: Column names taken as the text column without asking (first match wins).
TEXT_COLUMN_NAMES = (
    "text",
    "content",
    "sentence",
    "document",
    "review",
    "passage",
    "body",
    "article",
    "sentence1",
)

SOURCE_HELP = ("text source: .txt/.jsonl/.json/.csv/.parquet file, save_to_disk folder, hub name[:config], "
               "'-' for stdin, builtin:pydoc, builtin:licenses, self or self:N (text sampled from the model "
               "itself), a weighted mixture SOURCE*W+SOURCE*W, or auto: builtin:pydoc+self on a causal LM "
               "(the calibration that held up best on text it never saw: README, Results), builtin:pydoc on "
               "other models; to calibrate for known use, mix its text in: notes.txt+builtin:pydoc+self")
AUTO_SOURCE = "auto"
#: what `auto` reads: on a model that can sample its own text, and on any other
AUTO_SAMPLING, AUTO_OTHER = "builtin:pydoc+self", "builtin:pydoc"
_PANEL = "Data"

_TRUE = {"1", "true", "yes", "on"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_FILE_LIKE_SUFFIX = re.compile(r"^\.[A-Za-z][A-Za-z0-9]{0,5}$")


@dataclass(frozen=True)
class DataSpec:
    """What data to use and how to cut it; recorded in every JSON output via ``Batches.info``.

    The fields' metadata is the --data option group of every command and a recipe's data block.
    """

    source: str = option("builtin:pydoc", SOURCE_HELP, flags=("--data",), panel=_PANEL)
    split: str | None = option(None, "dataset split (hub / save_to_disk)", panel=_PANEL)
    text_column: str | None = option(None, "text column (auto-detected when obvious)", panel=_PANEL)
    label_column: str | None = option(None, "label column: switches to classification", panel=_PANEL)
    seq_len: int = option(128, "tokens per block", min=2, panel=_PANEL)
    batch_size: int = option(4, "blocks per batch", min=1, panel=_PANEL)
    max_samples: int | None = option(None, "number of blocks (or examples) to use", min=1, panel=_PANEL)
    num_tokens: int | None = option(None, "cap the data at about this many tokens", min=1, panel=_PANEL)
    seed: int = option(0, "seed for sampling and masking", min=0, panel=_PANEL)
    skip_samples: int = option(0, "skip this many blocks first (held-out data disjoint from calibration)",
                               min=0, panel=_PANEL)
    self_temperature: float = option(1.0, "--data self: sampling temperature of the generated text", above=0,
                                     panel=_PANEL)
    self_top_p: float = option(0.95, "--data self: nucleus (top-p) of the generated text, in (0, 1]", above=0,
                               max=1, panel=_PANEL)


# --------------------------------------------------------------------------- grammar

_WEIGHTED = re.compile(r"^(?P<source>.*?)\s*\*\s*(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")
_SELF = re.compile(r"^self(?::(?P<n>.*))?$")


@dataclass(frozen=True)
class SourcePart:
    """One source of a ``--data`` string and its weight (1 unless written)."""

    source: str
    weight: Fraction = Fraction(1)


def self_source(source: str) -> tuple[bool, int | None]:
    """(is it ``self`` / ``self:N``, N or None); a usage error for ``self:`` without a count."""
    m = _SELF.match(source.strip())
    if m is None:
        return False, None
    if m.group("n") is None:
        return True, None
    n = m.group("n").strip()
    if not n.isdigit() or int(n) < 1:
        raise UsageError(f"--data {source}: write self or self:N with N a number of blocks of at least 1")
    return True, int(n)


def is_auto(source: Any) -> bool:
    """Is this the ``auto`` source (resolved per model by ``batches.resolve_auto``)?"""
    return isinstance(source, str) and source.strip().lower() == AUTO_SOURCE


def reads_stdin(source) -> bool:
    """Whether a --data value (a source string, a DataSpec or None) reads stdin, alone or in a mixture."""
    text = getattr(source, "source", source)
    return isinstance(text, str) and any(part.source == "-" for part in parse_sources(text))


def _names_path(text: str) -> bool:
    """Does `text` name an existing file or folder?"""
    try:
        return bool(text) and Path(text).expanduser().exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte: no file
        return False


def _mixture_pieces(source: str) -> list[str]:
    """`source` cut at '+', except where consecutive pieces (with an optional *WEIGHT) name an existing
    file or folder: those are one piece, so a path holding '+' (c++notes.txt) can be mixed too."""
    pieces = source.split("+")
    out: list[str] = []
    i = 0
    while i < len(pieces):
        j = i + 1
        for k in range(len(pieces), i + 1, -1):  # the longest run that names a path
            text = "+".join(pieces[i:k]).strip()
            m = _WEIGHTED.match(text)
            if _names_path(text) or (m is not None and _names_path(m.group("source").strip())):
                j = k
                break
        out.append("+".join(pieces[i:j]))
        i = j
    return out


def parse_sources(source: str) -> list[SourcePart]:
    """The parts of a ``--data`` string (one part unless it is a mixture; grammar above)."""
    if not isinstance(source, str) or not source.strip():
        return [SourcePart(source)]
    if source == "-" or ("+" not in source and "*" not in source):
        return [SourcePart(source)]
    if _names_path(source):
        return [SourcePart(source)]
    parts: list[SourcePart] = []
    raws = _mixture_pieces(source)
    if any(is_auto(raw.split("*")[0]) for raw in raws):
        raise UsageError(f"--data {source!r}: auto stands alone (it chooses the whole source); "
                         f"write the mixture out, e.g. {AUTO_SAMPLING}+notes.txt")
    for raw in raws:
        text = raw.strip()
        weight = Fraction(1)
        m = None if _names_path(text) else _WEIGHTED.match(text)
        if m is not None and ("*" not in m.group("source") or _names_path(m.group("source").strip())):
            text, weight = m.group("source").strip(), Fraction(m.group("weight"))
            if weight <= 0:
                raise UsageError(f"--data {source!r}: the weight of {text or 'a source'} must be above 0")
        if not text:
            raise UsageError(f"--data {source!r}: a source of the mixture is empty "
                             "(write SOURCE[*WEIGHT]+SOURCE[*WEIGHT]...)")
        if "*" in text and not _names_path(text):
            raise UsageError(f"--data {source!r}: {text!r} is not SOURCE*WEIGHT with WEIGHT a positive number")
        parts.append(SourcePart(text, weight))
    seen: dict[str, str] = {}
    for p in parts:
        is_self, _ = self_source(p.source)
        key = "self" if is_self else source_key(p.source)  # a.txt and ./a.txt are one file
        if key in seen:
            raise UsageError(f"--data {source!r}: {seen[key]} and {p.source} are the same source; "
                             "give it once, with a weight")
        seen[key] = p.source
    return parts


# --------------------------------------------------------------------------- tables


@dataclass
class _Table:
    """Column access over any source, so column detection is written once."""

    columns: list[str]
    get: Callable[[str], list]
    string_columns: list[str]
    class_names: dict[str, list[str]] = field(default_factory=dict)
    split: str | None = None


@dataclass
class _Loaded:
    texts: list[str]
    labels: list | None
    label_names: list[str] | None
    split: str | None
    text_column: str | None
    label_column: str | None


def _texts_table(texts: list[str]) -> _Table:
    return _Table(columns=["text"], get=lambda c: texts, string_columns=["text"])


def _records_table(rows: list, where: str, split: str | None = None) -> _Table:
    """Rows from JSON/JSONL: dicts (columns = keys) or bare strings (one 'text' column)."""
    if not rows:
        raise UsageError(f"no records in {where}")
    if all(isinstance(r, str) for r in rows):
        return _Table(["text"], lambda c: rows, ["text"], split=split)
    if not all(isinstance(r, dict) for r in rows):
        bad = next(r for r in rows if not isinstance(r, (dict, str)))
        raise UsageError(
            f"{where} must hold objects (one per example) or strings, found {type(bad).__name__}"
        )
    columns: list[str] = []
    seen: set[str] = set()
    for r in rows:
        if isinstance(r, dict):
            for k in r:
                if k not in seen:
                    seen.add(k)
                    columns.append(k)

    def get(col: str) -> list:
        return [r.get(col) if isinstance(r, dict) else None for r in rows]

    strings = []
    for c in columns:
        values = [v for v in (r.get(c) for r in rows[:200] if isinstance(r, dict)) if v is not None]
        if values and all(isinstance(v, str) for v in values):
            strings.append(c)
    return _Table(columns, get, strings, split=split)


def _arrow_table(table: Any, split: str | None = None) -> _Table:
    import pyarrow as pa

    def is_str(t: Any) -> bool:
        if pa.types.is_dictionary(t):  # a pandas category / polars Categorical column of strings
            t = t.value_type
        return pa.types.is_string(t) or pa.types.is_large_string(t) or (
            hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)
        )

    cols = list(table.column_names)
    strings = [c for c in cols if is_str(table.schema.field(c).type)]
    return _Table(cols, lambda c: table.column(c).to_pylist(), strings, split=split)


def _dataset_table(ds: Any, split: str | None) -> _Table:
    from datasets import ClassLabel, Value

    cols = list(ds.column_names)
    strings, names = [], {}
    for c in cols:
        f = ds.features[c]
        if isinstance(f, Value) and f.dtype in ("string", "large_string", "string_view"):
            strings.append(c)
        elif isinstance(f, ClassLabel):
            names[c] = list(f.names)
    return _Table(cols, lambda c: list(ds[c]), strings, names, split=split)


# --------------------------------------------------------------------------- readers


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path} as UTF-8 text; convert it to UTF-8") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


#: (the stdin object, all it held): a command reads `--data -` more than once (calibration, held-out
#: and evaluation blocks are cut from it separately) but a pipe gives its text only once. Keyed by
#: the object, so a new stdin (each CliRunner invocation) is read afresh.
_STDIN_READ: tuple[object, str] | None = None


def _read_stdin() -> str:
    global _STDIN_READ
    stdin = sys.stdin
    if stdin is None:
        raise UsageError("--data - reads text from stdin, but there is no stdin")
    if _STDIN_READ is not None and _STDIN_READ[0] is stdin:
        return _STDIN_READ[1]
    try:
        if stdin.isatty():
            raise UsageError("--data - reads text from stdin, but stdin is a terminal; pipe text in")
    except (AttributeError, ValueError):
        pass
    # The bytes, decoded as a file's are (`_read_text_file`): UTF-8 whatever the locale, a BOM
    # dropped, CRLF and CR made LF. A text-mode stdin translates no newlines on POSIX and keeps a
    # BOM, so `--data - < a.txt` gave other tokens (other blocks) than `--data a.txt`.
    buffer = getattr(stdin, "buffer", None)
    try:
        text = buffer.read().decode("utf-8-sig") if buffer is not None else stdin.read().removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise UsageError("cannot read stdin as UTF-8 text; convert it to UTF-8") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    _STDIN_READ = (stdin, text)
    return text


def _read_jsonl(text: str, where: str) -> list:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} line {n} is not valid JSON: {e.msg}") from None
    return rows


def _read_json(path: Path, split: str | None) -> _Table:
    text = _read_text_file(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # A .json file is often JSON lines in disguise (what datasets' json loader accepts too).
        if text.lstrip().startswith("{") and "\n" in text.strip():
            try:
                return _records_table(_read_jsonl(text, str(path)), str(path))
            except UsageError:
                pass
        raise UsageError(f"{path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if isinstance(obj, list):
        return _records_table(obj, str(path))
    if isinstance(obj, str):
        return _texts_table([obj])
    if not isinstance(obj, dict):
        raise UsageError(f"{path} must hold a list of objects or an object with a list")
    lists = {k: v for k, v in obj.items() if isinstance(v, list)}
    # Lists of objects are row lists (e.g. one per split); a single list of strings is too.
    # Several lists of scalars are columns ({"text": [...], "label": [...]}), handled below.
    row_lists = {k: v for k, v in lists.items() if v and all(isinstance(r, dict) for r in v)}
    if not row_lists and len(lists) == 1:
        row_lists = {k: v for k, v in lists.items() if v and all(isinstance(r, str) for r in v)}
    if split is not None and not row_lists and split in lists:
        row_lists = {split: lists[split]}
    if split is not None:
        if split not in row_lists:
            avail = ", ".join(row_lists) or "none"
            raise UsageError(f"split '{split}' not found in {path}; lists there: {avail}")
        return _records_table(row_lists[split], f"{path} [{split}]", split=split)
    if len(row_lists) == 1:
        key = next(iter(row_lists))
        return _records_table(row_lists[key], f"{path} [{key}]")
    if len(row_lists) > 1:
        for key in ("train", "data", "rows", "examples", "records"):
            if key in row_lists:
                return _records_table(row_lists[key], f"{path} [{key}]", split=key)
        raise UsageError(
            f"{path} holds several lists ({', '.join(row_lists)}); pass --split to choose one"
        )
    # Column-oriented: {"text": [...], "label": [...]} with lists of equal length.
    if lists and len({len(v) for v in lists.values()}) == 1 and next(iter(lists.values())):
        n = len(next(iter(lists.values())))
        rows = [{k: v[i] for k, v in lists.items()} for i in range(n)]
        return _records_table(rows, str(path))
    if lists:
        raise UsageError(f"{path}: the lists in this object have different lengths")
    return _records_table([obj], str(path))


def _read_csv(path: Path, delimiter: str) -> _Table:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {path} as UTF-8 text; convert it to UTF-8") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip():
        raise UsageError(f"no records in {path}")
    try:
        table = pacsv.read_csv(
            io.BytesIO(raw),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UsageError(f"cannot parse {path} as CSV: {_one_line(e)}") from None
    return _arrow_table(table)


def _read_parquet(path: Path) -> _Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"cannot read {path} as parquet: {_one_line(e)}") from None
    return _arrow_table(table)


def _choose_split(splits: Sequence[str], split: str | None, where: str) -> str:
    """The requested split, else 'train', else the only one: the same rule for hub and disk."""
    splits = list(splits)
    if split is not None:
        if split not in splits:
            raise UsageError(f"split '{split}' not found in {where}; available splits: {', '.join(splits)}")
        return split
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise UsageError(f"{where} has several splits ({', '.join(splits)}); pass --split to choose one")


def _read_saved_dataset(path: Path, split: str | None) -> _Table:
    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise UsageError(
            f"folder {path} is not a datasets.save_to_disk folder (no dataset_dict.json or state.json)"
        )
    try:
        import datasets

        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # corrupt folders raise anything from FileNotFoundError to ArrowInvalid
        raise UsageError(f"cannot load dataset folder {path}: {_one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        chosen = _choose_split(list(ds.keys()), split, str(path))
        return _dataset_table(ds[chosen], chosen)
    return _dataset_table(ds, None)


def _env_offline() -> bool:
    return any(
        os.environ.get(k, "").strip().lower() in _TRUE
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


class _ForcedOffline:
    """Make datasets/huggingface_hub honour offline env vars set after they were imported.

    Both libraries read the variables at import time; a variable set later (a test's
    monkeypatch, a long-lived process) would otherwise be ignored and a lookup could
    go to the network. Cached datasets still load.
    """

    def __init__(self, active: bool) -> None:
        self.active = active
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "_ForcedOffline":
        if not self.active:
            return self
        import datasets.config as dconf
        import huggingface_hub.constants as hconst

        for mod, name in ((dconf, "HF_HUB_OFFLINE"), (dconf, "HF_DATASETS_OFFLINE"), (hconst, "HF_HUB_OFFLINE")):
            if hasattr(mod, name):
                self.saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, True)
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, name, value in reversed(self.saved):
            setattr(mod, name, value)


def _is_connection_error(e: BaseException) -> bool:
    names = " ".join(type(x).__name__ for x in type(e).__mro__)
    text = str(e).lower()
    return (
        isinstance(e, (ConnectionError, TimeoutError))
        or "Connection" in names
        or "Timeout" in names
        or "Offline" in names
        or "offline" in text
        or "couldn't reach" in text
    )


def _read_hub(source: str, split: str | None) -> _Table:
    name, _, config = source.partition(":")
    chosen = split or "train"
    offline = _env_offline()
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise UsageError(f"loading hub datasets needs the 'datasets' package: {e}") from None
    try:
        with _ForcedOffline(offline):
            ds = datasets.load_dataset(name, config or None, split=chosen)
    except Exception as e:  # load_dataset raises many unrelated types for one cause
        if offline or _is_connection_error(e):
            raise UsageError(
                f"could not load dataset '{source}' from the hub (offline?): {_one_line(e)}; "
                "use a local file or a datasets.save_to_disk folder"
            ) from None
        raise UsageError(f"could not load dataset '{source}' from the hub: {_one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):  # pragma: no cover - split is always given
        chosen = _choose_split(list(ds.keys()), split, source)
        ds = ds[chosen]
    return _dataset_table(ds, chosen)


def _pydoc_texts() -> list[str]:
    """The pydoc topic help texts, in sorted key order (stable for a given Python)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        raise UsageError("builtin:pydoc needs pydoc_data, which this Python lacks; use another --data") from None
    return [topics[k] for k in sorted(topics)]


def licence_files(site: Path) -> list[Path]:
    """The licence files of the packages installed in `site` (a site-packages folder).

    Every ``LICENSE*``, ``LICENCE*`` and ``COPYING*`` file and everything under a ``licenses/``
    (or ``licences/``) folder of a ``*.dist-info`` folder, in path order.
    """
    out = []
    for dist in sorted(site.glob("*.dist-info")):
        for p in sorted(dist.rglob("*")):
            rel = p.relative_to(dist)
            if p.is_file() and (p.name.upper().startswith(("LICENSE", "LICENCE", "COPYING"))
                                or "licenses" in rel.parts[:-1] or "licences" in rel.parts[:-1]):
                out.append(p)
    return out


def licence_texts(site: Path | None = None) -> list[tuple[str, str]]:
    """(path under site-packages, text) of every distinct installed licence text, sorted by path.

    Texts are deduplicated by whitespace-normalised content (most MIT or Apache texts differ only
    in their copyright line or not at all). The set depends on the installed packages, so
    ``make_batches`` records how many texts it read; torch, transformers and their dependencies
    alone give well over a hundred.
    """
    import hashlib
    import sysconfig

    site = site or Path(sysconfig.get_paths()["purelib"])
    seen: set[str] = set()
    kept: list[tuple[str, str]] = []
    for p in sorted(licence_files(site), key=lambda q: str(q.relative_to(site))):
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        text = text.replace("\r\n", "\n").strip()
        key = hashlib.sha256(re.sub(r"\s+", " ", text).encode()).hexdigest()
        if text and key not in seen:
            seen.add(key)
            kept.append((str(p.relative_to(site)), text))
    return kept


def _licence_table_texts() -> list[str]:
    texts = [t for _, t in licence_texts()]
    if not texts:  # pragma: no cover - a Python with no packages cannot run headtool
        raise UsageError("builtin:licenses: no licence texts found among the installed packages; use another --data")
    return texts


def builtin_version(source: str) -> str:
    """What a builtin source's text depends on, for the batches' provenance."""
    python = "python " + ".".join(map(str, sys.version_info[:3]))
    if source != "builtin:licenses":
        return python
    import hashlib

    texts = licence_texts()
    digest = hashlib.sha256("\n\n".join(t for _, t in texts).encode()).hexdigest()[:16]
    return f"{len(texts)} licence texts of the installed packages (sha256 {digest}), {python}"


def _local_path(source: Any) -> Path | None:
    """The file or folder a --data source reads, when it reads one (as `_open_table` decides)."""
    if not isinstance(source, str) or not source.strip() or source == "-" or source.startswith("builtin:"):
        return None
    if is_auto(source) or self_source(source)[0]:
        return None
    try:
        path = Path(source).expanduser()
        return path.resolve() if path.exists() else None
    except (OSError, RuntimeError):  # a name too long for the file system, a symlink loop: no file
        return None


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes (cached per size and mtime: one command reads a file many times)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def file_identity(source: Any) -> dict[str, str]:
    """{source_path, source_sha256} of a local file source ({source_path} of a folder), {} for any
    other (builtin:, self, stdin, a hub name): what `data_read` compares instead of the typed path."""
    path = _local_path(source)
    if path is None:
        return {}
    if not path.is_file():
        return {SOURCE_PATH: str(path)}
    try:
        st = path.stat()
        return {SOURCE_PATH: str(path), SOURCE_SHA256: _file_digest(str(path), st.st_size, st.st_mtime_ns)}
    except OSError:
        return {SOURCE_PATH: str(path)}


def source_key(source: str) -> str:
    """One name per source however it is written: a local file's resolved path, else the source."""
    path = _local_path(source)
    return source if path is None else str(path)


def _looks_like_path(source: str) -> bool:
    """Heuristic: a reference that can only be meant as a local file (vs. a hub id)."""
    if source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1:
        return True
    name = source.split(":", 1)[0]  # 'wikimedia/wikipedia:20231101.en' is a hub id
    suffix = Path(name).suffix
    return suffix.lower() in SUPPORTED_SUFFIXES or bool(_FILE_LIKE_SUFFIX.match(suffix))


def _open_table(spec: DataSpec) -> _Table:
    """Dispatch on the kind of source."""
    source = spec.source
    if not isinstance(source, str) or not source.strip():
        raise UsageError("no data given; pass --data (a file, a folder, '-', builtin:pydoc or a hub name)")
    if source == "-":
        return _texts_table([_read_stdin()])
    if self_source(source)[0]:
        raise UsageError("--data self needs the model being compressed (text is sampled from it); "
                         "this step was not given the model")
    if source.startswith("builtin:"):
        if source == "builtin:pydoc":
            return _texts_table(_pydoc_texts())
        if source == "builtin:licenses":
            return _texts_table(_licence_table_texts())
        raise UsageError(f"unknown builtin data '{source}'; available: {', '.join(BUILTIN_SOURCES)}")
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            return _read_saved_dataset(path, spec.split)
        suffix = path.suffix.lower()
        if suffix == ".txt":
            return _texts_table([_read_text_file(path)])
        if suffix == ".jsonl":
            return _records_table(_read_jsonl(_read_text_file(path), str(path)), str(path))
        if suffix == ".json":
            return _read_json(path, spec.split)
        if suffix == ".csv":
            return _read_csv(path, ",")
        if suffix == ".tsv":
            return _read_csv(path, "\t")
        if suffix == ".parquet":
            return _read_parquet(path)
        raise UsageError(
            f"unsupported data file type '{path.suffix or '(none)'}' for {path}; supported: "
            f"{', '.join(SUPPORTED_SUFFIXES)}, a datasets.save_to_disk folder, '-' (stdin), "
            "builtin:pydoc, builtin:licenses, self[:N], or a hub dataset name[:config] (a plain text file "
            "without a suffix: give it one, e.g. notes.txt, or pipe it in with --data -)"
        )
    if _looks_like_path(source):
        raise UsageError(f"data file not found: {source}")
    if _HUB_ID.match(source.split(":", 1)[0]) and source.count(":") <= 1:
        return _read_hub(source, spec.split)
    raise UsageError(f"data file not found: {source} (and it is not a hub dataset name[:config])")


# --------------------------------------------------------------------------- columns


def _choose_text_column(table: _Table, wanted: str | None, label: str | None, where: str) -> str:
    if wanted is not None:
        if wanted not in table.columns:
            raise UsageError(
                f"column '{wanted}' not found in {where}; available columns: {', '.join(table.columns)}"
            )
        return wanted
    candidates = [c for c in table.string_columns if c != label]
    lower = {c.lower(): c for c in candidates}
    for name in TEXT_COLUMN_NAMES:
        if name in lower:
            return lower[name]
    if len(candidates) == 1:
        return candidates[0]
    # A column named as text that is not all text (a number among the strings, no rows at all): that
    # column, so that the user is told what is in it rather than asked which column holds the text.
    named = {c.lower(): c for c in table.columns if c != label}
    for name in TEXT_COLUMN_NAMES:
        if name in named and not candidates:
            return named[name]
    raise UsageError(
        f"cannot tell which column of {where} holds the text (columns: {', '.join(table.columns) or 'none'}); "
        "pass --text-column"
    )


def load_source(spec: DataSpec, want_labels: bool) -> _Loaded:
    table = _open_table(spec)
    where = spec.source if spec.source != "-" else "stdin"
    label_col = spec.label_column if want_labels else None
    if label_col is not None and label_col not in table.columns:
        raise UsageError(
            f"label column '{label_col}' not found in {where}; available columns: {', '.join(table.columns)}"
        )
    text_col = _choose_text_column(table, spec.text_column, label_col, where)
    raw = table.get(text_col)
    texts: list[str] = []
    for row, v in enumerate(raw, 1):
        if v is None:
            texts.append("")
        elif isinstance(v, str):
            texts.append(v)
        else:
            raise UsageError(
                f"column '{text_col}' of {where} does not hold text (found {type(v).__name__} in row {row}); "
                f"pass --text-column (string columns: {', '.join(table.string_columns) or 'none'})"
            )
    labels = table.get(label_col) if label_col is not None else None
    return _Loaded(
        texts=texts,
        labels=labels,
        label_names=table.class_names.get(label_col) if label_col else None,
        split=table.split,
        text_column=None if _is_plain(spec) else text_col,
        label_column=label_col,
    )


def _is_plain(spec: DataSpec) -> bool:
    """Sources without columns (txt, stdin, builtin): no text column to record."""
    s = spec.source
    return s == "-" or s.startswith("builtin:") or s.lower().endswith(".txt")


def load_texts(spec: DataSpec) -> tuple[list[str], list | None]:
    """Texts (and labels if ``spec.label_column``) from any source.

    A ``.txt`` file and stdin give one text each; ``builtin:pydoc`` one per help topic;
    tables one per row (missing text -> ""). Labels are returned raw (not mapped to ids).
    """
    loaded = load_source(spec, want_labels=spec.label_column is not None)
    return loaded.texts, loaded.labels


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
