"""Self-calibration (--data self: text sampled from the model being compressed) and mixed
--data sources (a.txt*3+self): determinism, the cache, the grammar, interleaving and held-out
blocks."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from _data_fixtures import bert_tokenizer, tiny_causal_tokenizer
from conftest import needs_smollm2
from tiny_models import FAMILIES, tiny_model

from headtool.data import batches, selfgen
from headtool.data.batches import make_batches, mixture_schedule
from headtool.data.selfgen import self_blocks, self_cache_key
from headtool.data.sources import DataSpec, SourcePart, load_texts, parse_sources
from headtool.errors import UsageError

CAUSAL = [f for f, (_, mlm) in FAMILIES.items() if not mlm]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    return tiny_causal_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


class Counting:
    """Wraps selfgen._sample to count the sequences generated."""

    def __init__(self, monkeypatch):
        self.rows = 0
        self.calls = 0
        real = selfgen._sample

        def wrapped(module, start, uniforms, *a, **k):
            self.calls += 1
            self.rows += uniforms.shape[0]
            return real(module, start, uniforms, *a, **k)

        monkeypatch.setattr(selfgen, "_sample", wrapped)


def rows(b) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for batch in b for r in batch["input_ids"]]


# ----------------------------------------------------------------------------- self


def test_self_blocks_deterministic_for_a_seed(llama, tok):
    a = self_blocks(llama, tok, 3, 12, seed=0, cache=False)
    b = self_blocks(llama, tok, 3, 12, seed=0, cache=False)
    c = self_blocks(llama, tok, 3, 12, seed=1, cache=False)
    assert a.ids.shape == (3, 12) and a.ids.dtype == torch.long
    assert torch.equal(a.ids, b.ids) and a.texts == b.texts
    assert not torch.equal(a.ids, c.ids)
    assert len({tuple(r) for r in a.ids.tolist()}) == 3  # each block its own sample
    assert a.texts[0] == tok.decode(a.ids[0].tolist())


def batch_sensitive_draws(monkeypatch):
    """Make every draw depend on how many rows its batch has, as a real model's last bits do (kernels
    block by the batch's shape; on SmolLM2 batches of 1 and 40 sampled one of 8 blocks differently)."""
    real = selfgen._draw

    def draw(logits, u, temperature, top_p, vocab):
        ramp = torch.linspace(0, 1, logits.shape[-1], dtype=logits.dtype)
        return real(logits + 3.0 * logits.shape[0] * ramp, u, temperature, top_p, vocab)

    monkeypatch.setattr(selfgen, "_draw", draw)


def test_self_blocks_do_not_depend_on_count_or_order_even_where_batches_would(llama, tok, monkeypatch, tmp_path):
    batch_sensitive_draws(monkeypatch)
    count = Counting(monkeypatch)
    five = self_blocks(llama, tok, 5, 10, seed=3, cache=False, group=4)
    first3 = self_blocks(llama, tok, 3, 10, seed=3, cache=False, group=4)
    assert torch.equal(five.ids[:3], first3.ids)
    # through the cache: 2 blocks, then 5 (the first call's group covers blocks 0-3, the second adds 4-7)
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "c"))
    rows_before = count.rows
    two = self_blocks(llama, tok, 2, 10, seed=3, group=4)
    then5 = self_blocks(llama, tok, 5, 10, seed=3, group=4)
    assert count.rows - rows_before == 8 and two.generated == 4 and then5.generated == 4
    assert torch.equal(then5.ids, five.ids) and torch.equal(two.ids, five.ids[:2])
    assert then5.info["group"] == 4
    # another group size is other text under batch-sensitive numerics, so it is another cache entry
    other = self_blocks(llama, tok, 5, 10, seed=3, group=2)
    assert other.generated == 6 and not torch.equal(other.ids, five.ids)


def test_without_fixed_groups_the_batch_would_change_the_text(llama, tok, monkeypatch):
    """What the grouping guards against: the same block sampled in a batch of another size."""
    batch_sensitive_draws(monkeypatch)
    assert not torch.equal(self_blocks(llama, tok, 4, 10, seed=3, cache=False, group=4).ids,
                           self_blocks(llama, tok, 4, 10, seed=3, cache=False, group=1).ids)


def test_a_cache_with_a_partial_group_regenerates_that_group(llama, tok, monkeypatch, tmp_path):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "c"))
    full = self_blocks(llama, tok, 4, 10, seed=5, group=4)
    (path,) = (tmp_path / "c" / "selfcal").glob("*.json")
    doc = json.loads(path.read_text())
    doc["ids"], doc["texts"], doc["num_blocks"] = doc["ids"][:3], doc["texts"][:3], 3
    doc["ids"][0] = [0] * 10  # a block that would be read back if partial groups were trusted
    path.write_text(json.dumps(doc))
    again = self_blocks(llama, tok, 4, 10, seed=5, group=4)
    assert again.generated == 4 and torch.equal(again.ids, full.ids)


def test_second_call_reads_the_cache_and_a_longer_one_extends_it(llama, tok, monkeypatch, tmp_path):
    monkeypatch.setattr(selfgen, "MAX_GENERATION_BATCH", 2)  # groups of 2 blocks
    count = Counting(monkeypatch)
    spec = DataSpec(source="self:4", seq_len=12, batch_size=3)
    first = make_batches(spec, tok, "lm", model=llama)
    assert count.rows == 4 and first.info["samples"] == 4 and len(first) == 2
    files = list((tmp_path / "cache" / "selfcal").glob("*.json"))
    assert len(files) == 1 and not list(files[0].parent.glob("*.tmp"))  # no temp file left behind
    doc = json.loads(files[0].read_text())
    assert doc["num_blocks"] == 4 and len(doc["texts"]) == 4 and doc["settings"]["seq_len"] == 12

    again = make_batches(spec, tok, "lm", model=llama)
    assert count.rows == 4  # nothing generated
    assert rows(again) == rows(first) and again.info == first.info

    fewer = make_batches(DataSpec(source="self:2", seq_len=12), tok, "lm", model=llama)
    assert count.rows == 4 and rows(fewer) == rows(first)[:2]
    more = make_batches(DataSpec(source="self:6", seq_len=12), tok, "lm", model=llama)
    assert count.rows == 6  # only the two missing blocks
    odd = make_batches(DataSpec(source="self:7", seq_len=12), tok, "lm", model=llama)
    assert count.rows == 8 and odd.info["samples"] == 7  # a whole group for the seventh block
    assert rows(odd)[:6] == rows(more)
    assert rows(more)[:4] == rows(first)
    assert json.loads(files[0].read_text())["num_blocks"] == 8


def test_cache_key_changes_with_every_setting(llama, tok, monkeypatch, tmp_path):
    base = {"fingerprint": "sha256:abc", "precision": "float32/cpu", "seq_len": 16, "seed": 0, "temperature": 1.0,
            "top_p": 0.95, "start": 0}
    changed = {"fingerprint": "sha256:abd", "precision": "bfloat16/cpu", "seq_len": 17, "seed": 1,
               "temperature": 0.8, "top_p": 0.9, "start": 1, "group": 3}
    keys = {self_cache_key(**base)}
    for k, v in changed.items():
        keys.add(self_cache_key(**{**base, k: v}))
    assert len(keys) == 9
    assert self_cache_key(**base, group=selfgen.group_size(16)) == self_cache_key(**base)  # the default group
    monkeypatch.setattr(selfgen, "GENERATOR_VERSION", selfgen.GENERATOR_VERSION + 1)
    assert self_cache_key(**base) not in keys
    monkeypatch.undo()

    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(selfgen, "MAX_GENERATION_BATCH", 2)  # groups of 2 blocks
    count = Counting(monkeypatch)
    make_batches(DataSpec(source="self:2", seq_len=8), tok, "lm", model=llama)
    make_batches(DataSpec(source="self:2", seq_len=8, seed=1), tok, "lm", model=llama)
    make_batches(DataSpec(source="self:2", seq_len=8, self_top_p=0.5), tok, "lm", model=llama)
    make_batches(DataSpec(source="self:2", seq_len=8, self_temperature=0.7), tok, "lm", model=llama)
    make_batches(DataSpec(source="self:2", seq_len=8), tok, "lm", model=tiny_model("llama", seed=1))
    assert count.rows == 10 and len(list((tmp_path / "cache" / "selfcal").glob("*.json"))) == 5

    def loaded(module):  # one checkpoint loaded twice: the fingerprint is the files', whatever the dtype
        return type("Loaded", (), {"model": module, "fingerprint": "sha256:one-checkpoint", "task": "causal-lm",
                                   "ref": "tiny-llama"})()

    first = make_batches(DataSpec(source="self:2", seq_len=8), tok, "lm", model=loaded(llama))
    wide = make_batches(DataSpec(source="self:2", seq_len=8), tok, "lm", model=loaded(copy.deepcopy(llama).double()))
    assert count.rows == 14  # the float64 load sampled its own text, not the float32 load's
    assert first.info["generation"]["precision"] == "float32/cpu"
    assert wide.info["generation"]["precision"] == "float64/cpu"


@pytest.mark.parametrize("family", CAUSAL)
def test_kv_cache_sampling_matches_full_forwards(family, tok):
    """The sampling loop (KV cache) works for every causal family and gives what re-running the
    whole prefix gives."""
    model = tiny_model(family)
    u = torch.stack([selfgen._block_uniforms(0, i, 6) for i in range(2)])
    with torch.inference_mode():
        cached = selfgen._sample(model, 0, u, 1.0, 0.95, len(tok))
        full = selfgen._sample(model, 0, u, 1.0, 0.95, len(tok), use_cache=False)
    assert cached.shape == (2, 6) and torch.equal(cached, full)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(selfgen._draw(logits, torch.tensor([u]), 1.0, 0.7, 4)) for u in torch.linspace(0, 0.999, 50)}
    assert draws == {0, 1}  # 0.5 + 0.3 reach 0.7; the tail is never drawn
    draws = {int(selfgen._draw(logits, torch.tensor([u]), 1.0, 1.0, 4)) for u in torch.linspace(0, 0.999, 50)}
    assert draws == {0, 1, 2, 3}
    assert int(selfgen._draw(logits, torch.tensor([0.99]), 1.0, 0.01, 4)) == 0  # at least one token
    wide = torch.zeros((1, 6))  # a model's padded vocabulary: ids past the tokenizer's are never drawn
    assert {int(selfgen._draw(wide, torch.tensor([u]), 1.0, 1.0, 4)) for u in torch.linspace(0, 0.999, 40)} \
        == {0, 1, 2, 3}


def test_candidate_search_draws_what_a_full_sort_draws(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(6, 50, generator=g) * s for s in (0.3, 1.0, 4.0)])
    logits[0, :10] = 2.0  # ties, across the candidate boundary too
    logits[1] = 0.0  # flat: the nucleus is nearly everything
    u = torch.rand(18, generator=g, dtype=torch.float64)
    for top_p in (0.3, 0.9, 0.95, 1.0):
        monkeypatch.setattr(selfgen, "CANDIDATES", ())
        full = selfgen._draw(logits, u, 1.0, top_p, 50)
        for k in ((1,), (4,), (12,), (4, 12), (2, 60)):
            monkeypatch.setattr(selfgen, "CANDIDATES", k)
            assert torch.equal(selfgen._draw(logits, u, 1.0, top_p, 50), full), (top_p, k)


def test_self_info_and_exact_block_length(llama, tok, monkeypatch):
    b = make_batches(DataSpec(source="self", seq_len=9, max_samples=5, batch_size=2), tok, "plain", model=llama)
    assert b.info["samples"] == 5 and all(x["input_ids"].shape[1] == 9 for x in b) and "labels" not in b[0]
    assert b.info["source"] == "self" and b.info["selection"] == "sequential"
    gen = b.info["generation"]
    assert gen["temperature"] == 1.0 and gen["top_p"] == 0.95 and gen["start_token_id"] == tok.bos_token_id
    assert gen["model_fingerprint"].startswith("sha256:")
    json.dumps(b.info)
    monkeypatch.setattr(batches, "DEFAULT_SELF_SAMPLES", 7)  # 128 unless a count is given
    default = make_batches(DataSpec(source="self", seq_len=4), tok, "lm", model=llama)
    assert default.info["samples"] == 7


def test_self_skip_samples_gives_the_next_blocks(llama, tok):
    calib = make_batches(DataSpec(source="self", seq_len=8, max_samples=3), tok, "lm", model=llama)
    held = make_batches(DataSpec(source="self", seq_len=8, max_samples=2, skip_samples=3), tok, "lm", model=llama)
    all5 = make_batches(DataSpec(source="self:5", seq_len=8), tok, "lm", model=llama)
    assert rows(calib) + rows(held) == rows(all5)
    with pytest.raises(UsageError, match="--skip-samples 5 leaves no data"):
        make_batches(DataSpec(source="self:5", seq_len=8, skip_samples=5), tok, "lm", model=llama)


def test_loaded_model_is_accepted_and_its_fingerprint_used(llama, tok):
    class Loaded:  # what commands pass: a LoadedModel
        model = llama
        fingerprint = "sha256:given"
        task = "causal-lm"
        ref = "tiny-llama"

    b = make_batches(DataSpec(source="self:2", seq_len=6), tok, "lm", model=Loaded())
    assert b.info["generation"]["model_fingerprint"] == "sha256:given"


def test_self_needs_a_causal_model(tok):
    with pytest.raises(UsageError, match="--data self needs the model being compressed"):
        make_batches(DataSpec(source="self:2", seq_len=8), tok, "lm")
    with pytest.raises(UsageError, match="--data self needs the model being compressed"):
        load_texts(DataSpec(source="self"))
    with pytest.raises(UsageError, match="--data self needs the model being compressed"):
        make_batches(DataSpec(source="builtin:pydoc+self", seq_len=8, max_samples=2), tok, "lm")
    bert = tiny_model("bert")
    with pytest.raises(UsageError, match="not one") as e:
        make_batches(DataSpec(source="self:2", seq_len=8), bert_tokenizer(), "plain", model=bert)
    assert "\n" not in str(e.value) and "causal language model" in str(e.value)

    class LoadedEncoder:
        model = bert
        fingerprint = "sha256:x"
        task = "masked-lm"
        ref = "tiny-bert"

    with pytest.raises(UsageError, match="tiny-bert is not one \\(masked-lm\\)"):
        self_blocks(LoadedEncoder(), bert_tokenizer(), 2, 8)
    with pytest.raises(UsageError, match="not labelled examples"):
        make_batches(DataSpec(source="self:2", seq_len=8, label_column="y"), tok, "classification",
                     model=tiny_model("llama"))


def test_start_token_bos_else_eos_else_error(llama):
    class Tok:
        def __init__(self, bos, eos):
            self.bos_token_id, self.eos_token_id = bos, eos

    class Bare(torch.nn.Module):
        config = type("C", (), {"bos_token_id": None, "eos_token_id": None})()

    assert selfgen.start_token_id(Tok(5, 7), Bare()) == 5
    assert selfgen.start_token_id(Tok(None, 7), Bare()) == 7
    with pytest.raises(UsageError, match="neither"):
        selfgen.start_token_id(Tok(None, None), Bare())


def test_bad_self_settings(llama, tok):
    with pytest.raises(UsageError, match="temperature must be above 0"):
        make_batches(DataSpec(source="self:2", seq_len=8, self_temperature=0.0), tok, "lm", model=llama)
    with pytest.raises(UsageError, match="top_p must be in"):
        make_batches(DataSpec(source="self:2", seq_len=8, self_top_p=1.5), tok, "lm", model=llama)
    with pytest.raises(UsageError, match="self:N with N a number"):
        make_batches(DataSpec(source="self:x", seq_len=8), tok, "lm", model=llama)


# ----------------------------------------------------------------------------- grammar


def test_grammar(tmp_path):
    assert parse_sources("builtin:pydoc") == [SourcePart("builtin:pydoc")]
    assert parse_sources("wikitext:wikitext-2-raw-v1") == [SourcePart("wikitext:wikitext-2-raw-v1")]
    assert parse_sources("a.txt*3+self*1") == [SourcePart("a.txt", 3), SourcePart("self", 1)]
    assert parse_sources(" a.jsonl * 0.5 + builtin:pydoc ") == [SourcePart("a.jsonl", 0.5), SourcePart("builtin:pydoc")]
    assert parse_sources("self:64*2+org/name:cfg") == [SourcePart("self:64", 2), SourcePart("org/name:cfg")]
    plus = tmp_path / "c++notes.txt"
    plus.write_text("x")
    assert parse_sources(str(plus)) == [SourcePart(str(plus))]  # an existing path is one source
    for bad, msg in [("a.txt++self", "empty"), ("a.txt*0+self", "above 0"), ("a.txt*x+self", "not SOURCE\\*WEIGHT"),
                     ("a.txt+a.txt", "same source"), ("self+self:3", "same source"), ("*2+self", "empty")]:
        with pytest.raises(UsageError, match=msg):
            parse_sources(bad)


def test_paths_with_plus_or_star_mix_like_any_other(tmp_path, tok):
    """An existing path is one source inside a mixture too, '+' and '*' in it and all (the README: a path
    may contain '+'). Before, d+x/c++.txt+b.txt split at every '+' ('a source of the mixture is empty')
    and a*b.txt+b.txt was refused as a bad weight."""
    folder = tmp_path / "d+x"
    folder.mkdir()
    plus, star, b = folder / "c++.txt", tmp_path / "a*b.txt", tmp_path / "b.txt"
    for path, word in ((plus, "p"), (star, "s"), (b, "b")):
        path.write_text(" ".join(f"{word}{i}" for i in range(200)))
    assert parse_sources(f"{plus}+{b}") == [SourcePart(str(plus)), SourcePart(str(b))]
    assert parse_sources(f"{b} + {plus} * 3") == [SourcePart(str(b)), SourcePart(str(plus), 3)]
    assert parse_sources(f"{star}+{b}*2") == [SourcePart(str(star)), SourcePart(str(b), 2)]
    assert parse_sources(f"{star}*2+{plus}") == [SourcePart(str(star), 2), SourcePart(str(plus))]
    assert parse_sources(f"self+{star}*0.5") == [SourcePart("self"), SourcePart(str(star), 0.5)]
    mix = make_batches(DataSpec(source=f"{plus}*2+{star}", seq_len=8, max_samples=6), tok, "lm")
    alone = rows(make_batches(DataSpec(source=str(plus), seq_len=8, max_samples=4), tok, "lm"))
    assert [p["source"] for p in mix.info["mixture"]] == [str(plus), str(star)]
    assert rows(mix)[:2] == alone[:2]
    for bad, msg in [(f"{star}*x+{b}", "not SOURCE\\*WEIGHT"), (f"{tmp_path}/no*pe.txt+{b}", "not SOURCE\\*WEIGHT"),
                     (f"{plus}++{b}", "empty")]:
        with pytest.raises(UsageError, match=msg):
            parse_sources(bad)


def test_one_file_written_two_ways_is_the_same_source(tmp_path, monkeypatch):
    """a.txt+./a.txt is a.txt twice (each part gave the same blocks: the mixture read every one of
    them twice); it is refused as a.txt+a.txt is."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("some words " * 50)
    monkeypatch.chdir(tmp_path)
    for mix in ("a.txt+./a.txt", f"a.txt*2+{tmp_path}/a.txt", "self+sub/../a.txt+a.txt"):
        with pytest.raises(UsageError, match="are the same source; give it once, with a weight"):
            parse_sources(mix)


def test_one_weighted_source_is_that_source(tmp_path, tok):
    p = tmp_path / "a.txt"
    p.write_text(" ".join(f"w{i}" for i in range(300)))
    plain = make_batches(DataSpec(source=str(p), seq_len=8), tok, "lm")
    weighted = make_batches(DataSpec(source=f"{p}*3", seq_len=8), tok, "lm")
    assert rows(plain) == rows(weighted)


# ----------------------------------------------------------------------------- mixtures


def _files(tmp_path: Path) -> tuple[str, str]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(f"a{i}" for i in range(400)))  # a block of either holds its letter
    b.write_text(" ".join(f"b{i}" for i in range(400)))
    return str(a), str(b)


def test_mixture_schedule():
    assert mixture_schedule([3, 1], 8) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert mixture_schedule([1, 1], 4) == [0, 1, 0, 1]
    assert mixture_schedule([2, 1], 6) == [0, 0, 1, 0, 0, 1]
    assert mixture_schedule([1, 2], 6) == [1, 0, 1, 1, 0, 1]
    s = mixture_schedule([0.5, 1, 1.5], 60)
    assert [s.count(i) for i in range(3)] == [10, 20, 30]


def test_mixture_interleaves_as_documented(tmp_path, tok):
    a, b = _files(tmp_path)
    mix = make_batches(DataSpec(source=f"{a}*2+{b}", seq_len=8, max_samples=6, batch_size=4), tok, "lm")
    alone_a = rows(make_batches(DataSpec(source=a, seq_len=8, max_samples=4), tok, "lm"))
    alone_b = rows(make_batches(DataSpec(source=b, seq_len=8, max_samples=2), tok, "lm"))
    assert rows(mix) == [alone_a[0], alone_a[1], alone_b[0], alone_a[2], alone_a[3], alone_b[1]]
    assert [len(x["input_ids"]) for x in mix] == [4, 2]
    assert torch.equal(mix[0]["labels"], mix[0]["input_ids"])
    texts = [tok.decode(list(r)) for r in rows(mix)]
    assert ["a" in t for t in texts] == [True, True, False, True, True, False]


def test_mixture_info(tmp_path, tok):
    a, b = _files(tmp_path)
    mix = make_batches(DataSpec(source=f"{a}*3+{b}*1", seq_len=8, max_samples=8, skip_samples=4), tok, "lm")
    info = mix.info
    assert info["source"] == f"{a}*3+{b}*1" and info["selection"] == "mixture" and info["samples"] == 8
    assert info["order"] == "weighted round-robin" and info["skip_samples"] == 4
    parts = info["mixture"]
    assert [(p["source"], p["weight"], p["samples"], p["skip_samples"]) for p in parts] == \
        [(a, 3, 6, 3), (b, 1, 2, 1)]
    assert parts[0]["available_samples"] > 8 and parts[0]["selection"] == "shuffled"
    json.dumps(info)


def test_mixture_skip_samples_gives_disjoint_blocks(tmp_path, tok, llama):
    a, b = _files(tmp_path)
    for source in (f"{a}*3+{b}", f"{a}+self*2"):
        spec = DataSpec(source=source, seq_len=8, max_samples=8)
        calib = rows(make_batches(spec, tok, "lm", model=llama))
        held = rows(make_batches(DataSpec(source=source, seq_len=8, max_samples=8, skip_samples=8), tok, "lm",
                                 model=llama))
        assert len(calib) == len(held) == 8 and not set(calib) & set(held)


def test_mixture_weights_respected(tmp_path, tok, llama):
    a, b = _files(tmp_path)
    mix = make_batches(DataSpec(source=f"{a}*3+{b}*1", seq_len=8, max_samples=40), tok, "lm")
    texts = [tok.decode(list(r)) for r in rows(mix)]
    assert sum("a" in t for t in texts) == 30 and sum("b" in t for t in texts) == 10
    with_self = make_batches(DataSpec(source=f"{a}+self*0.5", seq_len=8, num_tokens=8 * 9), tok, "lm", model=llama)
    parts = with_self.info["mixture"]
    assert with_self.info["samples"] == 9 and [p["samples"] for p in parts] == [6, 3]
    assert parts[1]["generation"]["model_fingerprint"].startswith("sha256:") and parts[1]["weight"] == 0.5
    own = [tuple(r) for r in self_blocks(llama, tok, 3, 8).ids.tolist()]
    assert [r for r in rows(with_self) if r in own] == own and rows(with_self)[2::3] == own


def test_mixture_ends_where_a_source_runs_out(tmp_path, tok):
    a, _ = _files(tmp_path)
    small = tmp_path / "small.txt"
    small.write_text(" ".join(f"c{i}" for i in range(12)))
    n_small = make_batches(DataSpec(source=str(small), seq_len=8), tok, "lm").info["samples"]
    assert n_small >= 2
    mix = make_batches(DataSpec(source=f"{a}+{small}", seq_len=8), tok, "lm")
    assert mix.info["samples"] == 2 * n_small + 1  # a b a b ... a, then b has no block left
    assert [p["samples"] for p in mix.info["mixture"]] == [n_small + 1, n_small]
    capped = make_batches(DataSpec(source=f"{a}+{small}", seq_len=8, max_samples=4 * n_small), tok, "lm")
    assert capped.info["samples"] == 2 * n_small + 1


def test_a_part_that_runs_out_is_told_once_in_the_mixtures_numbers(tmp_path, tok, monkeypatch):
    """With --max-samples, a part that ran out warned in its own share's numbers ('asked for 100
    blocks but only 32') before the mixture's own warning, and a part whose share of --skip-samples
    passed its end was refused as '--skip-samples 3000 leaves no data' when 6000 was given. One
    warning now, in the mixture's numbers, and the refusal names the --skip-samples given; the
    blocks are those given before."""
    a, b = _files(tmp_path)
    n = make_batches(DataSpec(source=a, seq_len=8), tok, "lm").info["samples"]
    told: list[str] = []
    monkeypatch.setattr(batches, "warn", told.append)
    mix = make_batches(DataSpec(source=f"{a}+{b}", seq_len=8, max_samples=4 * n), tok, "lm")
    assert mix.info["samples"] == 2 * n and [p["samples"] for p in mix.info["mixture"]] == [n, n]
    assert told == [f"asked for {4 * n} blocks of 8 tokens but {a} ran out after {n}; using {2 * n}"]
    alone = rows(make_batches(DataSpec(source=a, seq_len=8, max_samples=n), tok, "lm"))
    assert rows(mix)[0::2] == alone
    told.clear()
    skipped = make_batches(DataSpec(source=f"{a}+{b}", seq_len=8, skip_samples=2 * n - 4, max_samples=40), tok, "lm")
    assert skipped.info["samples"] == 4 and len(told) == 1
    with pytest.raises(UsageError, match=f"^--skip-samples {4 * n} leaves no data: {a} has no blocks after the "
                                         f"skipped ones \\(it gives {n} blocks of 8 tokens, its share of the "
                                         f"skipped {2 * n}\\)"):
        make_batches(DataSpec(source=f"{a}+{b}", seq_len=8, skip_samples=4 * n, max_samples=4), tok, "lm")


def test_self_without_n_or_cap_is_128_blocks_in_a_mixture_too(tmp_path, tok, llama, monkeypatch):
    monkeypatch.setattr(batches, "DEFAULT_SELF_SAMPLES", 3)
    a, _ = _files(tmp_path)
    mix = make_batches(DataSpec(source=f"{a}+self", seq_len=8), tok, "lm", model=llama)
    assert [p["samples"] for p in mix.info["mixture"]] == [4, 3]  # a s a s a s a: then self has given 3
    skipped = make_batches(DataSpec(source=f"{a}+self", seq_len=8, skip_samples=2), tok, "lm", model=llama)
    assert [p["samples"] for p in skipped.info["mixture"]] == [4, 3]


def test_mixture_mlm_and_errors(tmp_path, tok):
    a, b = _files(tmp_path)
    bert = bert_tokenizer()
    m = make_batches(DataSpec(source=f"{a}+{b}", seq_len=10, max_samples=4), bert, "mlm")
    assert m[0]["input_ids"].shape == (4, 10) and bool((m[0]["input_ids"][:, 0] == bert.cls_token_id).all())
    assert m.info["masked_tokens"] > 0
    with pytest.raises(UsageError, match="not labelled examples"):
        make_batches(DataSpec(source=f"{a}+{b}", seq_len=8, label_column="y"), tok, "classification")
    with pytest.raises(UsageError, match=f"data file not found: {tmp_path}/nope.txt .*of the mixture"):
        make_batches(DataSpec(source=f"{a}+{tmp_path}/nope.txt", seq_len=8, max_samples=4), tok, "lm")
    with pytest.raises(UsageError, match="--skip-samples 900 leaves no data"):
        make_batches(DataSpec(source=f"{a}+{b}", seq_len=8, skip_samples=900), tok, "lm")


def test_mixture_is_deterministic(tmp_path, tok, llama):
    a, b = _files(tmp_path)
    spec = DataSpec(source=f"{a}*2+{b}+self", seq_len=8, max_samples=7, seed=5)
    x = make_batches(spec, tok, "lm", model=llama)
    y = make_batches(spec, tok, "lm", model=llama)
    assert rows(x) == rows(y) and x.info == y.info


# ----------------------------------------------------------------------------- a real model


@needs_smollm2
@pytest.mark.realmodel
def test_smollm2_generates_its_own_calibration_text(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADTOOL_CACHE", str(tmp_path / "real"))
    # 32 steps of 2 rows are latency-bound: one thread is as fast, and immune to a busy machine
    # (the _threads fixture restores the thread count)
    torch.set_num_threads(1)
    monkeypatch.setattr(selfgen, "MAX_GENERATION_BATCH", 2)  # a group of 2 blocks, not 64
    b = make_batches(DataSpec(source="self:2", seq_len=32, batch_size=2), smollm2.tokenizer, "lm", model=smollm2)
    assert b.info["samples"] == 2 and b[0]["input_ids"].shape == (2, 32)
    assert b.info["generation"]["model_fingerprint"] == smollm2.fingerprint
    assert b.info["generation"]["start_token_id"] == smollm2.tokenizer.bos_token_id
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "real" / "selfcal").glob("*.json")]
    text = doc["texts"][0]
    assert sum(c.isalpha() for c in text) > len(text) // 3  # words, not noise
