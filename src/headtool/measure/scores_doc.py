"""The score document ("headtool.scores/1"): build, write, read back and validate.

`headtool score` writes it and `headtool prune --scores` reads it (also through a pipe), so
its keys are stable (add keys freely, never rename). Floats are written with Python's
shortest round-trip repr, so the same scores always give byte-identical numbers; the only
time-dependent value is `elapsed_s`.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import UsageError
from ..version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from ..model.loading import LoadedModel
    from .scoring import ScoreResult

FORMAT = "headtool.scores/1"
FORMAT_PREFIX = "headtool.scores/"
FORMAT_VERSION = 1


def build_document(loaded: "LoadedModel", result: "ScoreResult", data_info: dict | None,
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The score document of `result` for `loaded` (see DESIGN.md for the keys)."""
    from ..model.info import model_info
    from .scoring import ESTIMATORS, kv_group_scores

    geometry = loaded.geometry
    doc: dict[str, Any] = {
        "format": FORMAT,
        "model": {**model_info(loaded.model, loaded.adapter), "path": loaded.path, "ref": loaded.ref,
                  "fingerprint": loaded.fingerprint},
        "method": result.method,
        "estimator": result.estimator,
        "estimator_definition": ESTIMATORS[result.estimator],
        "objective": result.objective,
        "normalize": result.normalize,
        "data": data_info,
        "baseline_loss": _num(result.baseline_loss),
        "loss_positions": result.loss_positions,
        "forward_passes": result.passes,
        "scores": _matrix(result.scores),
        "raw_scores": _matrix(result.raw_scores),
        "kv_group_scores": _matrix(kv_group_scores(result.scores, geometry)),
        "options": options or {},
    }
    if result.removal_order is not None:
        doc["removal_order"] = result.removal_order
        doc["rounds"] = [{**r, "loss": _num(r["loss"]), "raw_scores": [[_num(v) for v in row] for row in r["raw_scores"]]}
                         for r in result.rounds]
    doc["elapsed_s"] = round(result.elapsed_s, 3)
    doc["headtool_version"] = __version__
    return doc


def _num(v: float | None) -> float | None:
    if v is None:
        return None
    v = float(v)
    if not math.isfinite(v):
        raise UsageError(f"a score is not finite ({v}); the run is not usable")
    return v + 0.0  # -0.0 -> 0.0, so equal runs print equal text


def _matrix(m: Sequence[Sequence[float]]) -> list[list[float]]:
    return [[_num(v) for v in row] for row in m]  # type: ignore[misc]


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def write_document(doc: dict[str, Any], path: str | None) -> None:
    """To `path` (atomically where it is a file: io.files.write_file), or to stdout for None / '-'."""
    text = dumps(doc)
    if path is None or path == "-":
        from ..console import result_stream

        out = result_stream()
        out.write(text)
        out.flush()
        return
    from ..io.files import check_output_path, write_text

    check_output_path(path, "-o")
    write_text(path, text)


# --------------------------------------------------------------------------- reading


def read_scores(path_or_dash: str, loaded: "LoadedModel | None" = None) -> dict[str, Any]:
    """Read and validate a score document from a file or stdin ('-').

    Checks: JSON, format version, `scores` / `raw_scores` / `kv_group_scores` shapes against
    the model geometry, finite numbers, and that the fingerprint matches `loaded`'s. Every
    problem is a one-line UsageError that says what to do.
    """
    where = "stdin" if path_or_dash == "-" else path_or_dash
    if path_or_dash == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("--scores -: nothing piped in; use `headtool score MODEL | headtool prune MODEL --scores -`")
        text = sys.stdin.read()
    else:
        p = Path(path_or_dash)
        if not p.exists():
            raise UsageError(f"scores file not found: {path_or_dash}")
        if p.is_dir():
            raise UsageError(f"{path_or_dash} is a folder, not a score document")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read scores from {path_or_dash}: {e}") from e
    if not text.strip():
        raise UsageError(f"no scores in {where} (empty); did `headtool score` fail earlier in the pipe?")
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where} is not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None
    validate(doc, loaded, where)
    return doc


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name} in the score document")


def validate(doc: Any, loaded: "LoadedModel | None", where: str = "scores") -> None:
    """The checks of `read_scores` on an already parsed document."""
    if not isinstance(doc, dict):
        raise UsageError(f"{where} is not a headtool score document (a JSON object is expected)")
    fmt = doc.get("format")
    if not isinstance(fmt, str) or not fmt.startswith(FORMAT_PREFIX):
        raise UsageError(f"{where} is not a headtool score document (format {fmt!r}, expected {FORMAT!r}); "
                         "make one with `headtool score`")
    try:
        version = int(fmt[len(FORMAT_PREFIX):])
    except ValueError:
        raise UsageError(f"{where}: unknown score format {fmt!r}; expected {FORMAT!r}") from None
    if version != FORMAT_VERSION:
        raise UsageError(f"{where} has format {fmt!r}, this headtool {__version__} reads {FORMAT!r}; "
                         "re-run `headtool score` with this version")
    if "scores" not in doc:
        raise UsageError(f"{where}: no 'scores' in the score document")
    geometry = loaded.geometry if loaded is not None else None
    heads = [g.num_heads for g in geometry] if geometry is not None else None
    _check_matrix(doc["scores"], "scores", heads, where)
    if "raw_scores" in doc:
        _check_matrix(doc["raw_scores"], "raw_scores", heads or [len(r) for r in doc["scores"]], where)
    if "kv_group_scores" in doc and geometry is not None:
        _check_matrix(doc["kv_group_scores"], "kv_group_scores", [g.num_kv_heads for g in geometry], where)
    order = doc.get("removal_order")
    if order is not None:
        shape = [len(r) for r in doc["scores"]]
        if not isinstance(order, list) or not all(
                isinstance(x, list) and len(x) == 2 and all(_is_int(v) for v in x)
                and 0 <= x[0] < len(shape) and 0 <= x[1] < shape[x[0]] for x in order):
            raise UsageError(f"{where}: 'removal_order' must list [layer, head] pairs within the model")
    if loaded is not None:
        model = doc.get("model")
        fp = model.get("fingerprint") if isinstance(model, dict) else None
        if not isinstance(fp, str):
            raise UsageError(f"{where}: the score document has no model fingerprint; re-run `headtool score`")
        if fp != loaded.fingerprint:
            made_for = model.get("path") or model.get("ref") or "?"
            raise UsageError(f"scores were made for another model ({made_for}, fingerprint {fp}); this model "
                             f"{loaded.ref} has fingerprint {loaded.fingerprint}: re-run `headtool score {loaded.ref}`")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_matrix(m: Any, key: str, heads: list[int] | None, where: str) -> None:
    if not isinstance(m, list) or not all(isinstance(r, list) for r in m):
        raise UsageError(f"{where}: '{key}' must be a list of per-layer lists of numbers")
    if heads is not None:
        if len(m) != len(heads):
            raise UsageError(f"{where}: '{key}' has {len(m)} layers, the model has {len(heads)}; "
                             "were the scores made for another model?")
        for i, (row, n) in enumerate(zip(m, heads)):
            if len(row) != n:
                raise UsageError(f"{where}: '{key}' layer {i} has {len(row)} values, the model's layer {i} "
                                 f"has {n} heads; were the scores made for another model?")
    for i, row in enumerate(m):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UsageError(f"{where}: '{key}' layer {i} head {j} is {v!r}, not a finite number")
