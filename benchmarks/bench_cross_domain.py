"""Cross-domain quality on SmolLM2-135M without training: calibrate on one source, evaluate on text it never saw.

Every other quality figure (bench_quality.py) calibrates and evaluates on `builtin:pydoc`, which
flatters the refits (issue 18). Here each compressed model is evaluated on three out-of-domain
sets and, last and labelled as such, on held-out `builtin:pydoc` blocks.

Rows: the unpruned model; then for each calibration source (--calibrations, default
`builtin:pydoc`, `self` and `builtin:pydoc+self`): --fractions of the query heads removed with
`--compensate` (gradient scores computed on the same calibration blocks), and 3 -> 1 KV heads
with each of --merges. `mean` needs no data, so it is one row whatever the calibration.
The rows run the workflow functions the CLI runs: `score_loaded` then `prune_loaded` (what
`headtool score --data D | headtool prune --scores - --fraction F --compensate --data D`
does; the recipe's score -> prune steps pass the scores in memory the same way) and
`convert_loaded` with one `--merge` method at a time (with a comma list it keeps only the best).
A row's seconds are its surgery and its evaluation on every domain; making the calibration text
(for `self`: generating it the first time) and the gradient scores happen once per calibration
and are reported apart.
Calibration: DataSpec(source=CAL_SOURCE, max_samples=--cal, seed=--seed (0)) (an evaluation set's name in
CAL_SOURCE, alone or mixed, is that set's own text after its evaluated blocks: `calibration_spec`,
a domain-matched calibration whose cell the table marks), held-out refit checks
of `fit` / the merge choice: the next --held blocks of the same source (`--heldout-samples`);
prune uses the CLI's default (no held-out check). `self` text is sampled from the unpruned
model and cached under $HEADTOOL_CACHE/selfcal (the first run generates it).

Evaluation (the same blocks for every row, --eval blocks of --seq-len tokens each):

* news: the Lee Background Corpus (Lee, Pincombe & Welsh 2005, "An empirical evaluation of
  models of text document similarity"): 300 Australian news articles (ABC news mail service),
  one per line, about 360 KB. It ships in the gensim wheel on PyPI as
  `gensim/test/test_data/lee_background.cor`; gensim is LGPL-2.1, and the articles carry no
  licence of their own (they were collected for research), so the text is never committed:
  the first run fetches the wheel with `pip download --no-deps --only-binary :all: gensim==4.4.0`,
  extracts that one member and caches it as $HEADTOOL_CACHE/bench-data/lee_background.txt;
  later runs are offline.
* legal: the licence texts that ship with the installed Python packages: every `LICENSE*`,
  `COPYING*` and `licenses/*` file under the `*.dist-info` folders of this interpreter's
  site-packages, deduplicated by content (whitespace-normalised), sorted by path and joined into
  $HEADTOOL_CACHE/bench-data/python-licences.txt (English legal prose: MIT, BSD, Apache,
  GPL/LGPL, PSF, ...; each file under its own package's licence, which permits redistribution
  of the licence text). Rebuilt every run from the installed packages; its sha256 and file
  count are recorded, since another set of packages gives another text.
* wiki: English Wikipedia articles, the body prose of the ~100 articles in the shortened 2017 dump
  that ships in the same gensim wheel as
  `gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`
  (Anarchism, Autism, Albedo, ...: encyclopedic prose on many subjects, 100 distinct documents,
  unlike the licence texts' near-copies). benchmarks/wikitext.py keeps the body paragraphs of 20
  words or more, without templates, references, tables, lists, headings or the sections from
  "See also" on. Wikipedia text is CC BY-SA and is never committed: it is fetched with the news
  set's wheel and cached as $HEADTOOL_CACHE/bench-data/enwiki-articles.txt. Results written
  before this set existed have no wiki column.
* in-domain: `builtin:pydoc` blocks after the --cal + --held blocks of every calibration (so
  disjoint from all of them; for `self` calibration this is simply a third domain, for the
  mixture half in-domain). Reported last: it flatters the pydoc-calibrated rows.

Each evaluation set is DataSpec(source=FILE, seq_len, max_samples=--eval, seed=0): a seeded
choice of blocks from the whole text. The script checks that every set has at least
--min-blocks blocks and that no evaluation block is also a calibration or held-out block.

    HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cross_domain.py

Writes benchmarks/results/cross_domain.json after every row (a partial run keeps its rows) and
prints the table (perplexity and its ratio to the unpruned model; out-of-domain columns first).
"""
from __future__ import annotations

import argparse
import bz2
import copy
import hashlib
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: shared cores
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_clock, run as a script
from run_clock import RunClock  # noqa: E402
import wikitext  # noqa: E402

from headtool.data.batches import make_batches, mixture_schedule
from headtool.data.sources import DataSpec, licence_texts, parse_sources
from headtool.measure.evaluation import evaluate
from headtool.model.loading import load_model, model_from_object
from headtool.model.refs import cache_dir
from headtool.surgery.merging import summary_figures
from headtool.surgery.prune_defaults import default_anchor_power
from headtool.workflows.convert_gqa import convert_loaded
from headtool.workflows.prune import prune_loaded
from headtool.workflows.requests import (DEFAULT_PRUNE_DAMPING, ConvertRequest, PruneRequest,
                                         ScoreRequest)
from headtool.workflows.score import score_loaded

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m"
CALIBRATIONS = ("builtin:pydoc", "self", "builtin:pydoc+self")
MERGES = ("mean", "aligned", "fit")
DATA_FREE_MERGES = ("mean",)

GENSIM = "gensim==4.4.0"
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
NEWS_FILE = "lee_background.txt"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_FILE = "enwiki-articles.txt"
LEGAL_FILE = "python-licences.txt"
IN_DOMAIN = "in-domain"
IN_DOMAIN_LABEL = "in-domain (flatters)"


# --------------------------------------------------------------------------- evaluation texts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _gensim_members(members: list[str]) -> tuple[dict[str, bytes], dict]:
    """Files of the gensim wheel on PyPI, read in one download (to a temporary folder, then dropped)."""
    with tempfile.TemporaryDirectory(prefix="headtool-gensim-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", GENSIM,
               "-d", tmp, "--quiet"]
        print(f"fetching {', '.join(members)}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
        wheels = sorted(Path(tmp).glob("gensim-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download {GENSIM} gave no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            raw = {m: z.read(m) for m in members}
        return raw, {"wheel": wheels[0].name, "wheel_sha256": _sha256(wheels[0])}


def _cached_gensim_text(folder: Path, name: str) -> tuple[Path, dict]:
    """GENSIM_TEXTS[name] cached as folder/name, with a sidecar .json naming the wheel it came from.
    A missing text is fetched together with every other missing one: one download of the wheel."""
    path = folder / name
    if not path.exists():
        missing = [n for n in GENSIM_TEXTS if not (folder / n).exists()]
        raw, fetched = _gensim_members([GENSIM_TEXTS[n][0] for n in missing])
        for n in missing:
            member, to_text = GENSIM_TEXTS[n]
            # the sidecar says which wheel it came from (the text alone does not)
            _write_atomic((folder / n).with_suffix(".json"), json.dumps({**fetched, "member": member}, indent=2)
                          + "\n")
            _write_atomic(folder / n, to_text(raw[member]))
    sidecar = path.with_suffix(".json")
    return path, json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.exists() else {}


def news_text(folder: Path) -> tuple[Path, dict]:
    """The Lee corpus as a .txt (fetched from the gensim wheel once, then read from the cache)."""
    path, fetched = _cached_gensim_text(folder, NEWS_FILE)
    meta = {"name": "news", "label": "news (Lee corpus)",
            "what": "Lee Background Corpus: 300 ABC news articles, one per line",
            "origin": f"{LEE_MEMBER} in the {GENSIM} wheel on PyPI (gensim: LGPL-2.1; the text is not committed)",
            **fetched}
    text = path.read_text(encoding="utf-8")
    meta["lines"] = sum(1 for line in text.splitlines() if line.strip())
    return path, meta


def _wiki_prose(raw: bytes) -> str:
    """The wheel's bz2 MediaWiki export as one .txt: articles' body prose, a blank line between articles."""
    return wikitext.joined(wikitext.plain_articles(_decode(bz2.decompress(raw))))


# the texts taken from the gensim wheel: cached name -> (wheel member, bytes -> text)
GENSIM_TEXTS = {NEWS_FILE: (LEE_MEMBER, _decode), WIKI_FILE: (WIKI_MEMBER, _wiki_prose)}


def wiki_text(folder: Path) -> tuple[Path, dict]:
    """Wikipedia articles as plain prose (`wikitext.plain_articles` of the gensim wheel's test dump)."""
    path, fetched = _cached_gensim_text(folder, WIKI_FILE)
    text = path.read_text(encoding="utf-8")
    meta = {"name": "wiki", "label": "encyclopedia (Wikipedia)",
            "what": "English Wikipedia articles (the first pages of a 2017 dump: Anarchism, Autism, Albedo, ...) "
                    "as plain prose: body paragraphs of 20 words or more, without templates, references, tables, "
                    "lists, headings or the sections from See also on (benchmarks/wikitext.py)",
            "origin": f"{WIKI_MEMBER} in the {GENSIM} wheel on PyPI (Wikipedia text: CC BY-SA; the text is not "
                      "committed)", **fetched,
            "articles": text.count("\n\n") + 1}
    return path, meta


def legal_text(folder: Path) -> tuple[Path, dict]:
    """The licence texts of the installed packages (`builtin:licenses`), written out for its sha256."""
    texts = licence_texts()
    joined = "\n\n".join(t for _, t in texts) + "\n"
    path = folder / LEGAL_FILE
    if not path.exists() or path.read_text(encoding="utf-8") != joined:
        _write_atomic(path, joined)
    meta = {"name": "legal", "label": "legal (package licences)",
            "what": "builtin:licenses: the licence texts of the installed Python packages (*.dist-info LICENSE*, "
                    "COPYING*, licenses/*), deduplicated by whitespace-normalised content, sorted by path",
            "origin": f"{sysconfig.get_paths()['purelib']} (each text under its own package's licence; "
                      "the text is not committed)",
            "data_source": "builtin:licenses", "files_kept": len(texts), "packages": sorted({rel.split("/")[0] for rel, _ in texts})}
    return path, meta


def count_blocks(source: str, tokenizer, seq_len: int) -> int:
    """Blocks of seq_len tokens the whole source gives (as make_batches cuts it)."""
    return make_batches(DataSpec(source=source, seq_len=seq_len, batch_size=64), tokenizer, "lm").info["samples"]


def evaluation_sets(tok, *, seq_len: int, batch_size: int, n_eval: int, used: int, min_blocks: int,
                    log=lambda msg: None, in_domain: bool = True) -> tuple[dict[str, dict], dict[str, list]]:
    """(domains, their evaluation batches): news, legal, wiki, then (unless not `in_domain`) in-domain pydoc
    blocks after `used`."""
    folder = cache_dir() / "bench-data"
    domains: dict[str, dict] = {}
    for path, meta in (news_text(folder), legal_text(folder), wiki_text(folder)):
        source = meta.pop("data_source", str(path))
        n = count_blocks(source, tok, seq_len)
        if n < max(min_blocks, n_eval):
            raise SystemExit(f"{meta['name']}: {path} gives {n} blocks of {seq_len} tokens, fewer than "
                             f"{max(min_blocks, n_eval)}")
        spec = DataSpec(source=source, seq_len=seq_len, batch_size=batch_size, max_samples=n_eval, seed=0)
        domains[meta["name"]] = {**meta, "source": source, "sha256": _sha256(path),
                                 "bytes": path.stat().st_size, "blocks_available": n, "spec": spec}
    if in_domain:
        n_pydoc = count_blocks("builtin:pydoc", tok, seq_len)
        if n_pydoc - used < n_eval:
            raise SystemExit(f"builtin:pydoc gives {n_pydoc} blocks: too few for {used} calibration + held-out "
                             f"and {n_eval} evaluation blocks")
        domains[IN_DOMAIN] = {"name": IN_DOMAIN, "label": f"pydoc, {IN_DOMAIN_LABEL}",
                              "what": "builtin:pydoc (Python help texts), the blocks after every calibration's "
                                      "calibration and held-out blocks", "origin": "this Python's pydoc topics",
                              "source": "builtin:pydoc", "blocks_available": n_pydoc,
                              "spec": DataSpec(source="builtin:pydoc", seq_len=seq_len, batch_size=batch_size,
                                               max_samples=n_eval, seed=0, skip_samples=used)}
    evals = {}
    for name, d in domains.items():
        b = make_batches(d.pop("spec"), tok, "lm")
        evals[name] = b.batches
        d["eval"] = b.info
        log(f"{name}: {d['blocks_available']} blocks of {seq_len} tokens available, evaluating on "
            f"{b.info['samples']}")
    return domains, evals


def served_source(name: str, domains: dict[str, dict]) -> tuple[str, list[str]]:
    """A --data string with every evaluation set's name (news, legal, wiki; alone or in a mixture) replaced
    by that set's source, and the names replaced: the sets this data is in-domain for."""
    parts = parse_sources(name)
    own = [p.source for p in parts if p.source in domains and p.source != IN_DOMAIN]
    return "+".join((domains[p.source]["source"] if p.source in own else p.source)
                    + ("" if p.weight == 1 else f"*{float(p.weight):g}") for p in parts), own


def calibration_spec(name: str, domains: dict[str, dict], *, blocks: int, evaluated: int, seq_len: int,
                     batch_size: int, seed: int = 0) -> tuple[DataSpec, list[str]]:
    """The calibration `name` (a --data source) and the evaluation sets it calibrates on. An
    evaluation set's name, alone or in a mixture (`news+builtin:pydoc+self`), stands for that set's
    own text after the `evaluated` blocks it is evaluated on: the cut skips as many of its first
    blocks as that takes (in a mixture every part skips its share), so calibration and evaluation
    stay disjoint while the calibration is domain-matched."""
    parts = parse_sources(name)
    source, own = served_source(name, domains)
    skip = 0
    if own:
        weights = [p.weight for p in parts]

        def short(n: int) -> bool:  # a matched part has fewer than `evaluated` blocks in the first n
            order = mixture_schedule(weights, n)
            return any(order.count(i) < evaluated for i, p in enumerate(parts) if p.source in own)
        while short(skip):
            skip += 1
    return DataSpec(source=source, seq_len=seq_len, batch_size=batch_size, max_samples=blocks, seed=seed,
                    skip_samples=skip), own


def calibration_mark(name: str, row: dict) -> str:
    """', calibrated on it' where evaluation set `name` is one the row was calibrated on (domain-matched:
    in-domain for it). Rows written before `calibrated_on` was recorded name the set as their calibration."""
    return ", calibrated on it" if name in row.get("calibrated_on", [row.get("calibration")]) else ""


def perplexities(model, evals: dict[str, list], per_block: bool = False) -> tuple[dict, float]:
    """Loss and perplexity of `model` on every evaluation set, and the seconds it took; with `per_block`
    also every block's summed loss and weight (`block_sums`, `block_weights`: for paired differences)."""
    t0 = time.perf_counter()
    out = {}
    for name, batches in evals.items():
        e = evaluate(model, batches, "lm", label=f"eval {name}", per_block=per_block)
        out[name] = {k: e[k] for k in ("loss", "perplexity", "block_sums", "block_weights") if k in e}
    return out, time.perf_counter() - t0


# --------------------------------------------------------------------------- helpers


def _block_set(batches) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for b in batches for row in b["input_ids"]}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrations", default=",".join(CALIBRATIONS),
                    help="comma list of calibration --data sources (mixtures allowed); an evaluation set's name "
                         "(news, legal, wiki), alone or in a mixture, is that set's own text after its evaluated blocks "
                         "(domain-matched: the table marks the cell)")
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="fractions of query heads removed")
    ap.add_argument("--scores", default="gradient", help="comma list of score methods for the prune rows")
    ap.add_argument("--ablation-for", default="",
                    help="comma list of calibrations that also get ablation-scored prune rows (ablation scores "
                         "cost a pass per head: about 15 minutes on 2 cores at 32 blocks)")
    ap.add_argument("--ablation-blocks", type=int, default=0,
                    help="calibration blocks the ablation scores read (0: --cal)")
    ap.add_argument("--compensate", default="on,off", help="prune rows with --compensate (on), without (off), both")
    ap.add_argument("--protect", default="0",
                    help="semicolon list of --protect-layers settings for the prune rows (one row each), e.g. "
                         "'none;0'")
    ap.add_argument("--normalize", default="auto",
                    help="semicolon list of prune --normalize settings for the prune rows (one row each), e.g. "
                         "'layer;none;auto'")
    ap.add_argument("--anchors", default="1",
                    help="comma list of --anchor values for the refits (--compensate and fit); one row each")
    ap.add_argument("--auto-heldout", default="",
                    help="CAL=HELD pairs (comma list): for calibration CAL also a row with --anchor auto chosen on "
                         "--heldout-data HELD (25%% prune and fit), e.g. builtin:pydoc=self")
    ap.add_argument("--unit", default="query", choices=("query", "head", "auto"),
                    help="prune's --unit for the prune rows: query (the default here, so that the commands of the "
                         "README tables measured before 2026-12-07 reproduce) or auto, prune's default since then "
                         "(head for the rows with --compensate; the lead table's command passes it)")
    ap.add_argument("--merges", default=",".join(MERGES), help="3 -> 1 KV merge methods, one row each")
    ap.add_argument("--cal", type=int, default=32, help="calibration / scoring blocks")
    ap.add_argument("--held", type=int, default=8, help="held-out blocks after them (fit's refit checks)")
    ap.add_argument("--eval", type=int, default=16, help="evaluation blocks of every domain")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0,
                    help="calibration seed: which pydoc blocks and which self text (0: every other table's); another "
                         "seed leaves out the in-domain column, whose seed-0 blocks could be calibration blocks")
    ap.add_argument("--min-blocks", type=int, default=64, help="fail when an evaluation text gives fewer blocks")
    ap.add_argument("--out", default=str(HERE / "results" / "cross_domain.json"))
    a = ap.parse_args()
    calibrations = [c.strip() for c in a.calibrations.split(",") if c.strip()]
    fractions = [float(f) for f in a.fractions.split(",") if f]
    merges = [m.strip() for m in a.merges.split(",") if m.strip()]
    scores = [m.strip() for m in a.scores.split(",") if m.strip()]
    ablation_for = [c.strip() for c in a.ablation_for.split(",") if c.strip()]
    compensations = [{"on": True, "off": False}[c.strip()] for c in a.compensate.split(",") if c.strip()]
    anchors = [x.strip() for x in a.anchors.split(",") if x.strip()]
    protects = [x.strip() for x in a.protect.split(";") if x.strip()]
    normalizes = [x.strip() for x in a.normalize.split(";") if x.strip()]
    auto_heldout = dict(pair.split("=", 1) for pair in a.auto_heldout.split(",") if pair.strip())
    bad = [m for m in merges if m not in MERGES]
    if bad:
        ap.error(f"--merges: unknown {', '.join(bad)}; use {', '.join(MERGES)}")
    command = shlex.join(["python", "benchmarks/bench_cross_domain.py", *sys.argv[1:]])
    clock = RunClock()
    log = clock.log


    lm = load_model(MODEL, dtype="float32", device="cpu")
    tok = lm.tokenizer
    log("model loaded")

    # ---- evaluation sets: out of domain first, in-domain last
    domains, evals = evaluation_sets(tok, seq_len=a.seq_len, batch_size=a.batch_size, n_eval=a.eval,
                                     used=a.cal + a.held, min_blocks=a.min_blocks, log=log, in_domain=a.seed == 0)

    def ppl_all(model) -> tuple[dict, float]:
        return perplexities(model, evals)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    doc = {"model": MODEL, "dtype": "float32", "command": command,
           "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                        "transformers": transformers.__version__},  # pydoc's text follows the Python
           "settings": {"calibrations": calibrations, "fractions": fractions, "merges": merges, "cal": a.cal,
                        "seed": a.seed,
                        "held": a.held, "eval": a.eval, "seq_len": a.seq_len, "batch_size": a.batch_size,
                        "scores": scores, "ablation_for": ablation_for, "ablation_blocks": a.ablation_blocks,
                        "compensate": compensations, "anchors": anchors, "protect": protects, "normalize": normalizes, "auto_heldout": auto_heldout,
                        "unit": a.unit,
                        "prune": "prune_loaded (scores from score_loaded on the calibration blocks): with and "
                                 "without --compensate (--choose-in-layer auto, no held-out check unless "
                                 "--heldout-data)",
                        "convert": "convert_loaded: --kv-heads 1, one --merge at a time, "
                                   "--heldout-samples HELD, refit for fit only (--anchor per row)",
                        "threads": torch.get_num_threads()},
           "domains": domains, "order": list(domains),
           "in_domain": IN_DOMAIN if IN_DOMAIN in domains else None, "calibration": {}, "rows": []}

    def save() -> None:
        doc["total_seconds"] = clock.seconds()
        out.write_text(json.dumps(doc, indent=2) + "\n")

    def add(row: dict) -> None:
        for name, r in row["eval"].items():
            r["ratio"] = r["perplexity"] / base[name]["perplexity"]
        doc["rows"].append(row)
        save()
        cells = "  ".join(f"{n} {_fmt(r['perplexity'])} ({r['ratio']:.2f}x)" for n, r in row["eval"].items())
        log(f"{row['change']:<28} cal={row['calibration'] or '-':<20} {cells}  [{row['seconds']} s]")

    t0 = time.perf_counter()
    base, eval_s = ppl_all(lm.model)
    add({"change": "none (unpruned)", "kind": "unpruned", "calibration": None, "eval": base,
         "heads": sum(g.num_heads for g in lm.geometry), "kv_heads": sum(g.num_kv_heads for g in lm.geometry),
         "eval_seconds": round(eval_s, 1), "seconds": round(time.perf_counter() - t0, 1)})

    for cal_source in calibrations:
        spec, calibrated_on = calibration_spec(cal_source, domains, blocks=a.cal, evaluated=a.eval,
                                               seq_len=a.seq_len, batch_size=a.batch_size, seed=a.seed)
        # the calibration and held-out blocks, made (and for self: generated and cached) up front so
        # that generation time is not charged to the first row; the rows read the same blocks again
        t0 = time.perf_counter()
        cal_b = make_batches(spec, tok, "plain", model=lm)
        held_b = make_batches(replace(spec, skip_samples=spec.skip_samples + a.cal, max_samples=a.held), tok, "plain",
                              model=lm)
        data_s = time.perf_counter() - t0
        cal_blocks = _block_set(cal_b.batches) | _block_set(held_b.batches)
        overlap = {name: len(cal_blocks & _block_set(b)) for name, b in evals.items()}
        if any(overlap.values()):
            raise SystemExit(f"calibration {cal_source}: evaluation blocks also in calibration: {overlap}")
        record = {"calibration": cal_b.info, "heldout": held_b.info, "data_seconds": round(data_s, 1),
                  "score_seconds": {}, "eval_overlap_blocks": overlap}
        doc["calibration"][cal_source] = record
        methods = scores + (["ablation"] if cal_source in ablation_for and "ablation" not in scores else [])
        scored = {}
        for method in methods:
            t0 = time.perf_counter()
            sspec = replace(spec, max_samples=a.ablation_blocks) if method == "ablation" and a.ablation_blocks else spec
            scored[method] = score_loaded(lm, ScoreRequest(model=MODEL, method=method, data=sspec), text_model=lm)
            record["score_seconds"][method] = round(time.perf_counter() - t0, 1)
            save()
            log(f"calibration {cal_source}: data {data_s:.1f} s, {method} scores {record['score_seconds'][method]} s")

        def prune_row(fraction: float, method: str, compensate: bool, anchor: str,
                      heldout: str | None = None, protect: str = protects[0], normalize: str = normalizes[0]) -> None:
            t0 = time.perf_counter()
            model = copy.deepcopy(lm.model)
            plm = model_from_object(model, tok, ref=MODEL)
            extra = {"heldout_data": DataSpec(source=heldout, seq_len=a.seq_len, batch_size=a.batch_size,
                                              max_samples=a.held, seed=a.seed)} if heldout else {}
            req = PruneRequest(model=MODEL, fraction=fraction, compensate=compensate, data=spec, anchor=anchor,
                               protect_layers=protect, normalize=normalize, unit=a.unit, **extra)
            done = prune_loaded(plm, req, scores=scored[method].result, text_model=lm)
            prune_s = time.perf_counter() - t0
            del model  # plm.model is the pruned model (the winning candidate when normalizations were compared)
            ev, eval_s = ppl_all(plm.model)
            s = done.result.summary()
            add({"change": f"{fraction:.0%} of query heads removed", "kind": "prune", "fraction": fraction,
                 "calibration": cal_source, "calibrated_on": calibrated_on, "scores": method,
                 "heads_removed": s["heads_removed"],
                 "compensate": compensate, "anchor": anchor if compensate else None,
                 "anchor_power": done.result.anchor_power, "damping": req.damping if compensate else None,
                 "heldout_data": heldout,
                 "protect_layers": protect, "normalize": normalize, "unit": done.target.unit,
                 "allocation": done.result.allocation,
                 "removed_per_layer": [len(r) for r in done.result.selection.removed(
                     done.result.geometry_before)],
                 "choose_in_layer": done.result.choice if compensate else None, "eval": ev,
                 "surgery_seconds": round(prune_s, 1), "eval_seconds": round(eval_s, 1),
                 "seconds": round(time.perf_counter() - t0, 1)})

        def convert_row(method: str, anchor: str, heldout: str | None = None) -> None:
            t0 = time.perf_counter()
            extra = {"heldout_data": DataSpec(source=heldout, seq_len=a.seq_len, batch_size=a.batch_size,
                                              max_samples=a.held, seed=a.seed)} if heldout else {}
            if method not in DATA_FREE_MERGES:  # a data-free merge reads no data and refits nothing
                extra.update(heldout_samples=a.held, **({"anchor": anchor} if method == "fit" else {}))
            req = ConvertRequest(model=MODEL, kv_heads=1, merge=method, data=spec, **extra)
            conv = convert_loaded(lm, req, text_model=lm)
            conv_s = time.perf_counter() - t0
            ev, eval_s = ppl_all(conv.best.model)
            after = summary_figures(conv.best.model, lm.adapter)
            add({"change": f"3 -> 1 KV heads, merge {method}", "kind": "convert", "method": method,
                 "calibration": None if method in DATA_FREE_MERGES else cal_source,
                 "calibrated_on": [] if method in DATA_FREE_MERGES else calibrated_on,
                 "anchor": anchor if method == "fit" else None, "heldout_data": heldout, "refit": conv.best.refit,
                 "heldout_loss": conv.results[0].get("heldout_loss"), "kv_heads_after": 1,
                 "params_after": after["params"], "eval": ev, "surgery_seconds": round(conv_s, 1),
                 "eval_seconds": round(eval_s, 1), "seconds": round(time.perf_counter() - t0, 1)})

        for fraction in fractions:
            for method in methods:
                for compensate in compensations:
                    for anchor in (anchors if compensate else anchors[:1]):
                        for protect in protects:
                            for normalize in normalizes:
                                prune_row(fraction, method, compensate, anchor, protect=protect,
                                          normalize=normalize)
        for method in merges:
            if method in DATA_FREE_MERGES and any(r.get("method") == method for r in doc["rows"]):
                continue  # needs no data: the same model whatever the calibration
            for anchor in (anchors if method == "fit" else anchors[:1]):
                convert_row(method, anchor)
        if cal_source in auto_heldout:
            held_source = auto_heldout[cal_source]
            prune_row(0.25, scores[0], True, "auto", held_source)
            convert_row("fit", "auto", held_source)
    save()
    print(render(doc))


#: marks a row whose `--normalize auto` compared layer,none with --compensate (before auto became obs)
BEFORE_OBS = "‡"
BEFORE_OBS_NOTE = (f"{BEFORE_OBS} `--normalize auto` with `--compensate` pruned with `layer` and `none` and kept the "
                   "lower held-out loss, its rule before it became `obs` (the split by what the refit cannot "
                   "repair); measured before the change, not rerun.")


def auto_before_obs(row: dict) -> bool:
    """Did `--normalize auto` compare layer,none in this refit prune row, where it now takes obs?"""
    modes = {c.get("normalize") for c in (row.get("allocation") or {}).get("candidates", [])}
    return (row.get("normalize") == "auto" and bool(row.get("compensate")) and modes == {"layer", "none"}
            and str(row.get("anchor")) != "inf")


# prune's refit settings before they were recorded (and before 2026-12-06's defaults): one anchor for
# every layer, damping 0.01. bench_allocation and bench_obs_allocation pin them: their records hold them.
EARLIER_REFIT = {"anchor_power": 0.0, "damping": 1e-2}


def refit_defaults(calibration_tokens: int) -> dict:
    """prune's refit settings today for a calibration of this many tokens (the power depends on it)."""
    return {"anchor_power": default_anchor_power(calibration_tokens), "damping": DEFAULT_PRUNE_DAMPING}


def refit_settings(row: dict) -> dict | None:
    """The --anchor-power and --damping a refit prune row ran at (EARLIER_REFIT where the row predates
    their record); None for a row without a refit."""
    if not row.get("compensate"):
        return None
    return {k: row.get(k, v) for k, v in EARLIER_REFIT.items()}


def as_flags(settings: dict) -> str:
    """Refit settings ({anchor_power: 0, damping: 0.01}) as prune's flags (`--anchor-power 0 --damping 0.01`)."""
    return " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in settings.items())


def earlier_refit_flags() -> str:
    """EARLIER_REFIT as the flags the README's prose names."""
    return as_flags(EARLIER_REFIT)


def refit_flags(row: dict, calibration_tokens: int) -> str:
    """The refit settings a row ran at where they differ from today's defaults for its calibration's size,
    as flags."""
    today = refit_defaults(calibration_tokens)
    changed = {k: v for k, v in (refit_settings(row) or {}).items() if v != today[k]}
    return f" {as_flags(changed)}" if changed else ""


def chosen_allocation(row: dict) -> str | None:
    """What `--normalize` chose in a prune row (None: nothing compared), marked when it was `auto`
    comparing layer,none (before obs)."""
    chosen = (row.get("allocation") or {}).get("normalize")
    if chosen is None:
        return None
    return chosen + (BEFORE_OBS if auto_before_obs(row) else "")


def self_judged_blocks(rows: list[dict]) -> int | None:
    """How many blocks of self text `--normalize auto` compared its allocations on in these rows (None:
    no row compared on self text)."""
    return next((r["allocation"]["heldout_blocks"] for r in rows
                 if ((r.get("allocation") or {}).get("compared_on") or {}).get("source") == "self"), None)


def render(doc: dict) -> str:
    """The markdown table: perplexity (ratio to the unpruned model) per domain, in-domain last."""
    names = doc["order"]
    head = [doc["domains"][n].get("label", n) for n in names]
    lines = ["| change | calibration | " + " | ".join(head) + " | seconds |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " | ---: |"]
    tokens = doc["settings"]["cal"] * doc["settings"].get("seq_len", 128)  # the refit's calibration
    for r in doc["rows"]:
        cells = []
        for n in names:
            e = r["eval"][n]
            cells.append(_fmt(e["perplexity"]) if r["kind"] == "unpruned" else
                         f"{_fmt(e['perplexity'])} ({e['ratio']:.2f}x){calibration_mark(n, r)}")
        change = r["change"].replace("->", "→")
        if r["kind"] == "prune":
            change += f" ({r['heads_removed']}), {r.get('scores', 'gradient')}"
            change += (f", `--compensate --anchor {r.get('anchor') or 0}{refit_flags(r, tokens)}`"
                       if r.get("compensate") else ", no refit")
            change += f", `--protect-layers {r.get('protect_layers', 'none')}`"
            if r.get("unit") == "head":  # single query heads (KV groups may differ); rows without it: query steps
                change += ", `--unit head`"
            if "normalize" in r:  # rows written before prune had --normalize used the scores as scored (layer)
                chosen = chosen_allocation(r)
                change += f", `--normalize {r['normalize']}`" + (
                    f" (chose {chosen})" if chosen and chosen != r["normalize"] else
                    " (as scored)" if not chosen and r["normalize"] == "auto" else "")
        elif r["kind"] == "convert" and r.get("refit"):
            change += f" + refit `--anchor {r.get('anchor') or 0}`"
        if r.get("heldout_data"):
            change += f" `--heldout-data {r['heldout_data']}`"
        cal = f"`{r['calibration']}`" if r["calibration"] else "-"
        lines.append(f"| {change} | {cal} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    d = doc["domains"]
    lines += ["", "Evaluation: " + "; ".join(
        f"{d[n].get('label', n)}: {d[n]['eval']['samples']} of "
        f"{d[n]['blocks_available']} blocks of {d[n]['eval']['seq_len']} tokens" for n in names) + "."]
    if doc["calibration"]:
        def once(v: dict) -> str:
            sc = v["score_seconds"]
            sc = sc if isinstance(sc, dict) else {"gradient": sc}
            return f"{v['data_seconds']:.0f} s + " + " + ".join(f"{m} {t:.0f} s" for m, t in sc.items())
        lines.append("Once per calibration, not in the rows' seconds (calibration text made or read, scores): "
                     + "; ".join(f"`{c}` {once(v)}" for c, v in doc["calibration"].items()) + ".")
    if any(auto_before_obs(r) for r in doc["rows"]):
        lines.append(BEFORE_OBS_NOTE)
    lines.append(f"`{doc['command']}`")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
