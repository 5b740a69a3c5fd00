"""Recipes: a declared pipeline (model, data, steps) in YAML, validated whole before anything runs.

Every problem is reported at once with its YAML location (file:line:col); values can be
overridden from the command line (`--set steps.1.fraction=0.4`). A step's keys are its
command's options, derived from the same request dataclass (`workflows.requests`): the same
names (underscores for dashes), types, allowed values and defaults; the options that concern a
whole run (model loading, output, overwrite, shard_size, sequential) are top-level keys. The
executors live in `headtool.workflows.recipe_runner`.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from ..data.sources import DataSpec, parse_sources
from ..errors import UsageError
from ..model.placement import LoadOptions
from ..optionspec import CLI_ONLY, RECIPE, STEP, Opt, options_of, problem
from ..train.options import HealOptions
from .requests import ConvertRequest, EvalRequest, HealRequest, LatentRequest, PruneRequest, ScoreRequest

# --------------------------------------------------------------------------- schema
Check = Callable[[Any], str | None]  # returns a problem or None


def _type(*types: type, what: str) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) and bool not in types:
            return f"must be {what}, got {v!r}"
        return None if isinstance(v, types) else f"must be {what}, got {v!r}"
    return check


def _int_min(lo: int) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else \
            f"must be an integer >= {lo}, got {v!r}"
    return check


_STR = _type(str, what="a string")
_BOOL = _type(bool, what="true or false")


def _folder(v: Any) -> str | None:
    """A folder to write to: text, not blank (an empty `output: ""` would write nowhere)."""
    return _STR(v) or (None if v.strip() else "must name a folder, got an empty string")


_DATA = "data"  # marker: a nested data block
_DATA_OR_SOURCE = "data or source"  # marker: a data block, or a source string

#: recipe step -> its request class and the nested option dataclasses whose keys it also takes
STEP_REQUESTS: dict[str, tuple[type, dict[str, type]]] = {
    "score": (ScoreRequest, {}),
    "prune": (PruneRequest, {}),
    "convert_gqa": (ConvertRequest, {}),
    "convert_mla": (LatentRequest, {}),
    "eval": (EvalRequest, {}),
    "heal": (HealRequest, {"opts": HealOptions}),
}


def _opt_check(opt: Opt) -> Check:
    return lambda v: problem(opt, v)


def step_options(name: str) -> dict[str, Opt]:
    """The options a recipe step takes as its own keys: its command's, less the whole-recipe ones."""
    cls, nested = STEP_REQUESTS[name]
    opts = [o for o in options_of(cls)] + [o for c in nested.values() for o in options_of(c)]
    return {o.name: o for o in opts if o.where == STEP}


def _step_schema(name: str) -> dict[str, Check | str]:
    schema: dict[str, Check | str] = {}
    for key, opt in step_options(name).items():
        schema[key] = _DATA_OR_SOURCE if isinstance(opt.type, tuple) and DataSpec in opt.type else _opt_check(opt)
    cls, _ = STEP_REQUESTS[name]
    if any(f.name == "data" for f in dataclasses.fields(cls)):
        schema["data"] = _DATA
    return schema


DATA_KEYS: dict[str, Check] = {o.name: _opt_check(o) for o in options_of(DataSpec)}
STEP_KEYS: dict[str, dict[str, Check | str]] = {name: _step_schema(name) for name in STEP_REQUESTS}
STEP_TARGETS = {"prune": ("fraction", "num_heads", "threshold", "heads"), "convert_mla": ("kv_rank", "kv_cache")}

#: the keys whose value is text (the schema wants a string): a plain scalar YAML 1.1 reads as a number or
#: a boolean there (`heads: 1:0` is the base-60 integer 60) is taken as written
TOP_STRINGS = {"name", "description", "model", "output", "shard_size"} | {
    o.name for o in options_of(LoadOptions) if o.type is str}
DATA_STRINGS = {o.name for o in options_of(DataSpec) if o.type is str}
STEP_STRINGS = {name: {k for k, o in step_options(name).items() if o.type is str} for name in STEP_REQUESTS}

#: steps that rebuild or remove heads: latent attention (convert_mla) has none left to work on (the
#: commands refuse a latent model the same way: model.latent.HEAD_SURGERY, kept apart to stay torch-free)
HEAD_SURGERY = ("prune", "convert_gqa", "convert_mla")
#: steps whose result is new weights, which only an output keeps
REWRITING_STEPS = ("prune", "convert_gqa", "convert_mla", "heal")
#: the step orders a run refuses, the one list the validator knows them from (the runner checks
#: only what needs the loaded model): (step, when its keys have these values, after this earlier
#: step, why, what to do)
REFUSED_ORDERS: tuple[tuple[str, dict[str, Any], str, str, str], ...] = (
    *((name, {}, "convert_mla", "the attention is latent now", "put it before convert_mla") for name in HEAD_SURGERY),
    ("score", {"method": "magnitude"}, "convert_mla", "magnitude reads the K/V projections, which latent "
     "attention replaced", "put it before convert_mla or use another method"),
)

TOP_KEYS: dict[str, Check | str] = {
    "name": _STR, "description": _STR, "model": _STR, **{o.name: _opt_check(o) for o in options_of(LoadOptions)},
    "seed": _int_min(0), "data": _DATA, "output": _folder, "overwrite": _BOOL, "sequential": _BOOL,
    # the commands' --shard-size and its check (a bad size was found when the output was written, after every step)
    "shard_size": _opt_check(next(o for o in options_of(PruneRequest) if o.name == "shard_size")),
    "steps": "steps",
}


def _not_step_keys(name: str) -> dict[str, str]:
    """The options of a step's command that a recipe step does not take, and why (its declared `why`):
    a whole-recipe key (output, overwrite, ...) or one only a command run has (streaming, resume, ...)."""
    cls, nested = STEP_REQUESTS[name]
    out = {}
    for o in [*options_of(cls), *(o for c in nested.values() for o in options_of(c))]:
        if o.where == RECIPE and o.name in TOP_KEYS:
            out[o.name] = o.meta["why"] or f"a whole-recipe key: give {o.name} at the top of the recipe"
        elif o.where == CLI_ONLY and o.meta["why"]:
            out[o.name] = o.meta["why"]
    return out


#: step -> {command option it does not take: why} (said instead of "unknown key")
NOT_STEP_KEYS = {name: _not_step_keys(name) for name in STEP_REQUESTS}


# --------------------------------------------------------------------------- loading with marks
@dataclass
class Recipe:
    """A parsed recipe: the plain values plus where each came from in the file."""

    path: str
    values: dict[str, Any]
    marks: dict[str, str] = field(default_factory=dict)  # dotted path -> "file:line:col"
    #: dotted path -> the text of a plain scalar that YAML read as something other than a string
    written: dict[str, str] = field(default_factory=dict)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.values.get("steps") or []

    def where(self, dotted: str) -> str:
        while dotted and dotted not in self.marks:
            dotted = dotted.rsplit(".", 1)[0] if "." in dotted else ""
        return self.marks.get(dotted, self.path)


def _scalar(node: yaml.Node) -> Any:
    """A scalar node's value, constructed in place: re-serialising an empty one (`- score:`) is not YAML."""
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def _to_python(node: yaml.Node, path: str, recipe: Recipe) -> Any:
    recipe.marks[path] = f"{recipe.path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k, v in node.value:
            key = str(_scalar(k))
            out[key] = _to_python(v, f"{path}.{key}" if path else key, recipe)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, f"{path}.{i}" if path else str(i), recipe) for i, v in enumerate(node.value)]
    value = _scalar(node)
    if isinstance(node, yaml.ScalarNode) and node.style is None and value is not None and not isinstance(value, str):
        recipe.written[path] = node.value
    return value


def load_recipe(path: str | os.PathLike) -> Recipe:
    p = Path(path)
    if p.is_dir():  # it was 'recipe not found' for a folder that is there
        raise UsageError(f"{p} is a folder, not a recipe; give a recipe YAML file (e.g. recipes/demo.yaml)")
    if not p.is_file():
        raise UsageError(f"recipe not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from e
    recipe = Recipe(str(p), {})
    recipe.values = _to_python(node, "", recipe) if node is not None else {}
    if not isinstance(recipe.values, dict):
        raise UsageError(f"{p}: a recipe is a mapping with 'model' and 'steps'")
    normalise_steps(recipe)
    return recipe


def normalise_steps(recipe: Recipe) -> None:
    """Accept `- prune: {fraction: 0.3}` as well as `- step: prune\\n  fraction: 0.3`."""
    steps = recipe.values.get("steps")
    if not isinstance(steps, list):
        return
    for i, s in enumerate(steps):
        if isinstance(s, dict) and "step" not in s and len(s) == 1:
            (name, opts), = s.items()
            if isinstance(opts, dict) or opts is None:  # `- score:` is a step with no options
                steps[i] = {"step": name, **(opts or {})}
                _move_keys(recipe, f"steps.{i}.{name}", f"steps.{i}")
    _strings_as_written(recipe)


def _move_keys(recipe: Recipe, old: str, new: str) -> None:
    """The locations (kept for messages about the shorthand's own line) and the written texts of
    the keys under `old` now live under `new`."""
    for key in [k for k in recipe.marks if k == old or k.startswith(old + ".")]:
        recipe.marks[new + key[len(old):]] = recipe.marks[key]
    for key in [k for k in recipe.written if k == old or k.startswith(old + ".")]:
        recipe.written[new + key[len(old):]] = recipe.written.pop(key)


def _wants_string(values: dict[str, Any], parts: list[str]) -> bool:
    """Is the key at `parts` (a dotted path split) one whose schema wants a string?"""
    if len(parts) == 1:
        return parts[0] in TOP_STRINGS
    if parts[0] == "data":
        return len(parts) == 2 and parts[1] in DATA_STRINGS
    steps = values.get("steps")
    if parts[0] != "steps" or not parts[1].isdigit() or not isinstance(steps, list) or int(parts[1]) >= len(steps):
        return False
    step = steps[int(parts[1])]
    name = step.get("step") if isinstance(step, dict) else None
    if name not in STEP_KEYS:
        return False
    if len(parts) == 3:
        return parts[2] in STEP_STRINGS[name]
    return len(parts) == 4 and STEP_KEYS[name].get(parts[2]) in (_DATA, _DATA_OR_SOURCE) and parts[3] in DATA_STRINGS


def _at(values: Any, parts: list[str]) -> Any:
    """The value at a dotted path (split), or None where there is none."""
    for part in parts:
        if isinstance(values, list) and part.isdigit() and int(part) < len(values):
            values = values[int(part)]
        elif isinstance(values, dict):
            values = values.get(part)
        else:
            return None
    return values


def _strings_as_written(recipe: Recipe) -> None:
    """Where the schema wants a string, a plain scalar is the text the user typed: YAML 1.1 reads
    `heads: 1:0` as the base-60 integer 60 and `merge: no` as false."""
    for dotted, text in recipe.written.items():
        parts = dotted.split(".")
        if not _wants_string(recipe.values, parts):
            continue
        parent = _at(recipe.values, parts[:-1])
        if isinstance(parent, dict) and parts[-1] in parent and not isinstance(parent[parts[-1]], str):
            parent[parts[-1]] = text


# --------------------------------------------------------------------------- overrides
def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(recipe: Recipe, assignments: list[str]) -> None:
    """`key.sub.0.k=value` assignments (values parsed as YAML scalars)."""
    for a in assignments:
        if "=" not in a:
            raise UsageError(f"--set {a!r}: use KEY=VALUE, e.g. --set steps.1.fraction=0.4")
        key, raw = a.split("=", 1)
        parts = key.strip().split(".")
        cur: Any = recipe.values
        for j, part in enumerate(parts):
            last = j == len(parts) - 1
            if isinstance(cur, list):
                if not part.isdigit() or int(part) >= len(cur):
                    raise UsageError(f"--set {key}: no item {part!r} (there are {len(cur)})")
                if last:
                    cur[int(part)] = _parse_scalar(raw)
                else:
                    cur = cur[int(part)]
            elif isinstance(cur, dict):
                if last:
                    cur[part] = _parse_scalar(raw)
                else:
                    if cur.get(part) is None:  # a key left empty in the file (`data:`) is filled in
                        cur[part] = {}
                    cur = cur[part]
            else:
                raise UsageError(f"--set {key}: {'.'.join(parts[:j])} is not a mapping or list")
        dotted = ".".join(parts)
        _remember_written(recipe, dotted, raw)
        for old in [k for k in recipe.marks if k.startswith(dotted + ".")]:
            del recipe.marks[old]  # what the file had under it is gone: its problems are the override's
        recipe.marks[dotted] = f"--set {dotted}"
    _strings_as_written(recipe)


def _remember_written(recipe: Recipe, dotted: str, raw: str) -> None:
    """An override's text replaces what the file had there (`--set steps.1.heads=9:9` is text, not 549)."""
    for key in [k for k in recipe.written if k == dotted or k.startswith(dotted + ".")]:
        del recipe.written[key]
    value = _parse_scalar(raw)
    if value is not None and not isinstance(value, (str, list, dict)):  # a scalar (a list is no text typed)
        recipe.written[dotted] = raw.strip()


# --------------------------------------------------------------------------- validation
def _looks_local(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or ref.endswith(
        (".gguf", ".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet"))


def _check_block(block: Any, schema: dict[str, Check | str], where: str, recipe: Recipe,
                 problems: list[str], elsewhere: dict[str, str] | None = None) -> None:
    if not isinstance(block, dict):
        problems.append(f"{recipe.where(where)}: {where}: must be a mapping")
        return
    for key, value in block.items():
        dotted = f"{where}.{key}" if where else key
        check = schema.get(key)
        if check is None and key in (elsewhere or {}):
            problems.append(f"{recipe.where(dotted)}: {dotted}: not a key of a step: {elsewhere[key]}")
        elif check is None and key != "step":
            problems.append(f"{recipe.where(dotted)}: {dotted}: unknown key (known: {', '.join(sorted(schema))})")
        elif value is None and check != "steps":  # (an empty steps: is "required" below)
            if not (callable(check) and check(None) is None):  # null is a value only where None is allowed
                problems.append(f"{recipe.where(dotted)}: {dotted}: no value: give one, or leave the key out")
        elif check == _DATA_OR_SOURCE and isinstance(value, str):
            _check_source(value, dotted, recipe, problems)
        elif check in (_DATA, _DATA_OR_SOURCE):
            _check_block(value, DATA_KEYS, dotted, recipe, problems)
            if isinstance(value, dict) and isinstance(value.get("source"), str):
                _check_source(value["source"], dotted + ".source", recipe, problems)
        elif callable(check):
            msg = check(value)
            if msg:
                problems.append(f"{recipe.where(dotted)}: {dotted}: {msg}")


def _check_source(src: str, dotted: str, recipe: Recipe, problems: list[str]) -> None:
    """Every part of a (possibly mixed) source that names a local file must exist."""
    try:
        parts = [p.source for p in parse_sources(src)]
    except UsageError as e:
        problems.append(f"{recipe.where(dotted)}: {dotted}: {str(e).split(': ', 1)[-1]}")
        return
    for part in parts:
        if part not in ("-",) and not part.startswith("builtin:") and _looks_local(part) \
                and not Path(os.path.expanduser(part)).exists():
            problems.append(f"{recipe.where(dotted)}: {dotted}: file not found: {part}")


def validate(recipe: Recipe, *, geometry_check: Callable[[Recipe, list[str]], None] | None = None,
             more: list[str] | None = None) -> None:
    """Raise one UsageError listing every problem of the recipe (one per line), with `more` (problems
    found elsewhere, e.g. output_problems) so that all are listed at once."""
    normalise_steps(recipe)
    problems: list[str] = []
    v = recipe.values
    _check_block(v, {k: c for k, c in TOP_KEYS.items() if k != "steps"} | {"steps": "steps"}, "", recipe, problems)
    if "model" not in v:
        problems.append(f"{recipe.path}: model: required (a folder, .gguf file, packaged name or hub id)")
    elif isinstance(v["model"], str) and not v["model"].strip():
        problems.append(f"{recipe.where('model')}: model: empty (a folder, .gguf file, packaged name or hub id)")
    elif isinstance(v["model"], str) and _looks_local(v["model"]) and not Path(os.path.expanduser(v["model"])).exists():
        problems.append(f"{recipe.where('model')}: model: not found: {v['model']}")
    _check_placement(recipe, problems)
    steps = v.get("steps")
    if not isinstance(steps, list) or not steps:
        problems.append(f"{recipe.where('steps')}: steps: required, a non-empty list of steps")
        steps = []
    for i, step in enumerate(steps):
        where = f"steps.{i}"
        if not isinstance(step, dict) or "step" not in step:
            problems.append(f"{recipe.where(where)}: {where}: each step is a mapping with a step name "
                            f"({', '.join(STEP_KEYS)})")
            continue
        name = step["step"]
        if name not in STEP_KEYS:
            problems.append(f"{recipe.where(where)}: {where}: unknown step {name!r} (known: {', '.join(STEP_KEYS)})")
            continue
        _check_block(step, STEP_KEYS[name], where, recipe, problems, NOT_STEP_KEYS[name])
        problems += _target_problems(recipe, i, step)
        for key, opt in step_options(name).items():
            if opt.required and key not in step:
                problems.append(f"{recipe.where(where)}: {where}.{key}: required")
    problems += order_problems(recipe) + unused_score_problems(recipe) + (more or [])
    if geometry_check is not None and not problems:
        geometry_check(recipe, problems)
    raise_problems(recipe, problems)


def _known_steps(recipe: Recipe) -> list[tuple[int, dict[str, Any]]]:
    """(index, step) of the steps that name a known step (the others are reported on their own)."""
    steps = recipe.values.get("steps")
    return [(i, s) for i, s in enumerate(steps if isinstance(steps, list) else [])
            if isinstance(s, dict) and s.get("step") in STEP_KEYS]


def order_problems(recipe: Recipe) -> list[str]:
    """Each step that comes after one it cannot follow (REFUSED_ORDERS), at its location: found
    before the model loads, not when the run reaches it."""
    problems, earlier = [], set()
    for i, step in _known_steps(recipe):
        name = step["step"]
        for later, keys, before, why, fix in REFUSED_ORDERS:
            if name == later and before in earlier and all(step.get(k) == v for k, v in keys.items()):
                what = name + "".join(f" with {k} {v}" for k, v in keys.items())
                problems.append(f"{recipe.where(f'steps.{i}')}: steps.{i}: {what} after {before} "
                                f"is not supported ({why}): {fix}")
        if name == "heal" and not earlier & set(REWRITING_STEPS) - {"heal"} and not step.get("lm_weight"):
            # its teacher is the recipe's model: as `heal M --teacher M`, a zero loss and a copy written
            problems.append(f"{recipe.where(f'steps.{i}')}: steps.{i}: heal before any prune, convert_gqa or "
                            "convert_mla step distils the recipe's model into itself (its teacher), a loss of 0 "
                            "with nothing to heal: put it after the step that changes the model, or give lm_weight")
        earlier.add(name)
    return problems


#: how a prune step that does not take an earlier score step's scores chooses its heads instead
_OWN_HEADS = (("heads", "removes the heads its heads: lists"), ("scores", "reads its scores: document"),
              ("method", "scores the heads itself (its method:)"))


def unused_score_problems(recipe: Recipe, *, at_end: bool = False) -> list[str]:
    """A score step whose scores nothing reads: no document (its output:) and no prune that takes them
    (one with a target and no heads, scores or method: the runner passes them only there) before another
    score step replaces them or a conversion rebuilds the heads they name. It ran for minutes and its
    result was dropped without a word. `at_end`: instead, the one left unread when the recipe ends (a
    warning: its summary row still gives the objective and baseline loss, which a recipe may run it for)."""
    problems: list[str] = []
    live: int | None = None  # the score step whose scores are in memory and not yet read, without a document

    def unused(why: str) -> None:
        problems.append(f"{recipe.where(f'steps.{live}')}: steps.{live}: the score step's scores are read by "
                        f"nothing: {why}; give it output: FILE to keep its document, or leave the step out")

    for i, step in _known_steps(recipe):
        name = step["step"]
        if name == "score":
            if live is not None:
                unused(f"steps.{i} (score) replaces them before any step reads them")
            live = None if step.get("output") else i
        elif name == "prune":
            own = next((what for key, what in _OWN_HEADS if step.get(key) is not None), None)
            if live is not None and own:
                unused(f"steps.{i} (prune) {own}; a prune with fraction, num_heads or threshold and none of "
                       "heads, scores, method takes them")
            live = None
        elif name in ("convert_gqa", "convert_mla") and live is not None:
            unused(f"steps.{i} ({name}) rebuilds the heads they name before any prune reads them")
            live = None
    if at_end:
        problems = []
        if live is not None:
            unused("no prune after it takes them")
    return problems


def rewriting_steps(recipe: Recipe) -> list[str]:
    """The names of the recipe's steps that rewrite the weights, each once, sorted."""
    return sorted({s["step"] for _, s in _known_steps(recipe) if s["step"] in REWRITING_STEPS})


def output_problems(recipe: Recipe, output: str | None = None) -> list[str]:
    """Steps that rewrite the weights with no output would compute everything and keep nothing:
    refused before anything runs, unless the run is a dry run on purpose."""
    if output or "output" in recipe.values or not rewriting_steps(recipe):  # (a bad output: is its own problem)
        return []
    which = ", ".join(f"steps.{i} ({s['step']})" for i, s in _known_steps(recipe) if s["step"] in REWRITING_STEPS)
    return [f"{recipe.path}: {which} rewrite the weights but the recipe has no output: add output: (or -o DIR), "
            "or run with --dry-run to compute them and write nothing"]


def _target_problems(recipe: Recipe, i: int, step: dict[str, Any]) -> list[str]:
    """prune and convert_mla take exactly one target; one left empty (`{fraction}`) is named as such."""
    names = STEP_TARGETS.get(step["step"], ())
    targets = [t for t in names if step.get(t) is not None]
    if not names or len(targets) == 1:
        return []
    where = f"steps.{i}"
    empty = [f"{where}.{t}" for t in names if t in step and step[t] is None]
    if empty and not targets:
        return [f"{recipe.where(e)}: {e}: no value: give one, or leave the key out" for e in empty]
    return [f"{recipe.where(where)}: {where}: give exactly one target of {', '.join(names)} (got {targets or 'none'})"]


def raise_problems(recipe: Recipe, problems: list[str]) -> None:
    """One UsageError listing every problem of the recipe, one per line (nothing when there are none)."""
    if problems:
        raise UsageError(f"recipe {recipe.path} has {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def _check_placement(recipe: Recipe, problems: list[str]) -> None:
    """sequential / device_map / max_memory: the same rules as the CLI's --sequential, --device-map
    and --max-memory, reported at their place in the file."""
    from ..model.placement import parse_max_memory

    v = recipe.values
    if v.get("sequential") and v.get("device_map"):
        problems.append(f"{recipe.where('device_map')}: device_map: sequential places layers itself: "
                        "leave out device_map")
    if v.get("max_memory") is not None:
        if not v.get("device_map"):
            problems.append(f"{recipe.where('max_memory')}: max_memory: caps devices for device_map: "
                            "add device_map: auto")
        elif isinstance(v["max_memory"], str):
            try:
                parse_max_memory(v["max_memory"])
            except UsageError as e:
                problems.append(f"{recipe.where('max_memory')}: max_memory: {str(e).removeprefix('--max-memory: ')}")


def resolved(recipe: Recipe, output: str | None = None, overwrite: bool | None = None) -> dict[str, Any]:
    """The recipe as it will run (after overrides, with the command line's -o and --overwrite over its own
    output and overwrite), for the output folder, the model card and `run --json`."""
    values = copy.deepcopy(recipe.values)
    for key, value in (("output", output), ("overwrite", overwrite)):
        if value is not None:
            values[key] = value
    return values


def step_data(recipe: Recipe, step: dict[str, Any], key: str = "data") -> dict[str, Any] | None:
    """A step's data block merged over the recipe's top-level data block."""
    top = recipe.values.get("data") or {}
    own = step.get(key)
    if own is None and key != "data":
        return None
    merged = {**top, **(own or {})}
    if "seed" not in merged and "seed" in recipe.values:
        merged["seed"] = recipe.values["seed"]
    return merged
