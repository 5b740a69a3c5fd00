"""Tests for headtool.data: every --data source, every task, determinism, and every bad input."""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _data_fixtures import bert_tokenizer, tiny_causal_tokenizer  # noqa: E402

from headtool.data import batches as hd
from headtool.data.batches import Batches, make_batches
from headtool.data.sources import DataSpec, load_texts
from headtool.errors import UsageError  # noqa: E402

SENTENCES = [
    "Heads that matter little can be removed without hurting the model much.",
    "A key and value head may serve a whole group of query heads.",
    "Calibration data should look like the data the model will see.",
    "The output projection can be refit by least squares after pruning.",
    "Scores must be reproducible when the seed is the same.",
    "Every error is one clear line that says what to do next.",
] * 4


@pytest.fixture(scope="module")
def causal():
    return tiny_causal_tokenizer()


@pytest.fixture(scope="module")
def bert():
    return bert_tokenizer()


def rows(b: Batches, key: str = "input_ids") -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for batch in b for r in batch[key]]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- sources


def test_txt_file_lm_blocks(tmp_path, causal):
    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(SENTENCES), encoding="utf-8")
    b = make_batches(DataSpec(source=str(p), seq_len=16, batch_size=3), causal, "lm")
    assert len(b) >= 2
    n_stream = len(causal("\n\n".join(SENTENCES), add_special_tokens=False)["input_ids"])
    assert b.info["samples"] == n_stream // 16  # full blocks only, last partial dropped
    for batch in b:
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape[1] == 16
        assert batch["attention_mask"].dtype == torch.long and bool((batch["attention_mask"] == 1).all())
        assert torch.equal(batch["labels"], batch["input_ids"])
    assert [x["input_ids"].shape[0] for x in b][:-1] == [3] * (len(b) - 1)  # last batch may be short
    assert b.num_tokens == b.info["tokens"] == b.info["samples"] * 16
    assert b.info["selection"] == "sequential" and b.info["task"] == "lm"
    json.dumps(b.info)  # goes into JSON outputs as is
    # corpus order is kept without max_samples: the first block is the first 16 tokens
    first = causal("\n\n".join(SENTENCES), add_special_tokens=False)["input_ids"][:16]
    assert b[0]["input_ids"][0].tolist() == first


def test_texts_joined_with_eos(tmp_path, causal):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES[:6]])
    b = make_batches(DataSpec(source=str(p), seq_len=8, batch_size=64), causal, "lm")
    flat = torch.cat([x["input_ids"].flatten() for x in b]).tolist()
    assert flat.count(causal.eos_token_id) >= 4  # a separator between consecutive texts
    assert b.info["separator_token_id"] == causal.eos_token_id


def test_jsonl_autodetect_and_explicit_column(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": i, "title": f"t{i}", "content": s} for i, s in enumerate(SENTENCES[:3])],
    )
    texts, labels = load_texts(DataSpec(source=str(p)))
    assert texts == SENTENCES[:3] and labels is None
    texts, _ = load_texts(DataSpec(source=str(p), text_column="title"))
    assert texts == ["t0", "t1", "t2"]


def test_jsonl_only_string_column(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"n": 1, "words": "alpha"}, {"n": 2, "words": "beta"}])
    assert load_texts(DataSpec(source=str(p)))[0] == ["alpha", "beta"]


def test_json_list_object_with_list_and_splits(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    assert load_texts(DataSpec(source=str(a)))[0] == ["one", "two"]
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"version": 1, "data": [{"sentence": "x"}, {"sentence": "y"}]}))
    assert load_texts(DataSpec(source=str(b)))[0] == ["x", "y"]
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"train": [{"text": "tr"}], "test": [{"text": "te"}]}))
    assert load_texts(DataSpec(source=str(c)))[0] == ["tr"]  # default train
    assert load_texts(DataSpec(source=str(c), split="test"))[0] == ["te"]
    with pytest.raises(UsageError, match="split 'dev' not found.*train, test"):
        load_texts(DataSpec(source=str(c), split="dev"))
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"text": ["p", "q"], "label": [0, 1]}))  # column-oriented
    assert load_texts(DataSpec(source=str(d), label_column="label")) == (["p", "q"], [0, 1])
    e = tmp_path / "e.json"  # JSON lines saved as .json
    e.write_text('{"text": "l1"}\n{"text": "l2"}\n')
    assert load_texts(DataSpec(source=str(e)))[0] == ["l1", "l2"]


def test_csv_classification_string_labels(tmp_path, bert):
    p = tmp_path / "d.csv"
    lines = ["text,label"] + [f'"{s}",{"pos" if i % 3 else "neg"}' for i, s in enumerate(SENTENCES[:9])]
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    b = make_batches(DataSpec(source=str(p), label_column="label", seq_len=12, batch_size=4), bert, "classification")
    assert b.info["label_names"] == ["neg", "pos"] and b.info["num_labels"] == 2
    labels = torch.cat([x["labels"] for x in b]).tolist()
    assert labels == [0 if i % 3 == 0 else 1 for i in range(9)]
    for x in b:
        assert x["input_ids"].shape[1] == 12 and x["labels"].shape == (x["input_ids"].shape[0],)
        assert x["labels"].dtype == torch.long
        assert bool((x["input_ids"][:, 0] == bert.cls_token_id).all())
    assert b.info["samples"] == 9 and b.num_tokens == b.info["tokens"]


def test_classification_int_labels_padding(tmp_path, bert):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "short", "y": 1}, {"text": " ".join(["word"] * 50), "y": 0}])
    b = make_batches(DataSpec(source=str(p), label_column="y", seq_len=10, batch_size=8), bert, "classification")
    x = b[0]
    assert x["labels"].tolist() == [1, 0] and "label_names" not in b.info and b.info["num_labels"] == 2
    assert x["attention_mask"][0].tolist() == [1, 1, 1] + [0] * 7  # [CLS] short [SEP] + padding
    assert bool((x["input_ids"][0, 3:] == bert.pad_token_id).all())
    assert int(x["attention_mask"][1].sum()) == 10 and int(x["input_ids"][1, -1]) == bert.sep_token_id


def test_a_nan_label_is_an_empty_label(tmp_path, causal):
    """A missing label read as NaN (a parquet float column, JSON's NaN) was refused as 'holds
    non-integer numbers; classification needs class labels', which the integer labels were; it is
    an empty value, as a null is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", "c d", "e f"], "y": [0.0, float("nan"), 1.0]}), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text('{"text": "a b", "y": 1}\n{"text": "c d", "y": NaN}\n{"text": "e", "y": 0}\n')
    for name in ("d.parquet", "d.jsonl"):
        with pytest.raises(UsageError, match=f"^label column 'y' of .*{name} has 1 empty value\\(s\\); fill or drop them$"):
            make_batches(DataSpec(source=str(tmp_path / name), label_column="y", seq_len=8), causal, "classification")
    with pytest.raises(UsageError, match="non-integer numbers"):  # a real fraction is still that
        pq.write_table(pa.table({"text": ["a", "b"], "y": [0.5, 1.0]}), tmp_path / "f.parquet")
        make_batches(DataSpec(source=str(tmp_path / "f.parquet"), label_column="y", seq_len=8), causal, "classification")


def test_classification_causal_tokenizer_without_pad(tmp_path, causal):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab", "y": "a"}, {"text": "abcdef", "y": "b"}])
    b = make_batches(DataSpec(source=str(p), label_column="y", seq_len=8), causal, "classification")
    assert b[0]["input_ids"].shape == (2, 8) and b.info["label_names"] == ["a", "b"]


def test_parquet(tmp_path, causal):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"document": SENTENCES[:5], "score": list(range(5))}), p)
    assert load_texts(DataSpec(source=str(p)))[0] == SENTENCES[:5]
    b = make_batches(DataSpec(source=str(p), seq_len=8), causal, "lm")
    assert b.info["samples"] > 0 and b.info["text_column"] == "document"


def test_save_to_disk_dataset_and_dict(tmp_path, bert):
    import datasets

    ds = datasets.Dataset.from_dict({"sentence": SENTENCES[:6], "label": [0, 1, 2, 0, 1, 2]})
    ds = ds.cast_column("label", datasets.ClassLabel(names=["a", "b", "c"]))
    ds.save_to_disk(str(tmp_path / "one"))
    texts, labels = load_texts(DataSpec(source=str(tmp_path / "one"), label_column="label"))
    assert texts == SENTENCES[:6] and labels == [0, 1, 2, 0, 1, 2]
    b = make_batches(DataSpec(source=str(tmp_path / "one"), label_column="label", seq_len=16), bert, "classification")
    assert b.info["label_names"] == ["a", "b", "c"]  # ClassLabel names are kept

    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": ["train text"]}),
        validation=datasets.Dataset.from_dict({"text": ["validation text"]}),
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_texts(DataSpec(source=str(tmp_path / "dict")))[0] == ["train text"]
    assert load_texts(DataSpec(source=str(tmp_path / "dict"), split="validation"))[0] == ["validation text"]
    with pytest.raises(UsageError, match="split 'test' not found.*train, validation"):
        load_texts(DataSpec(source=str(tmp_path / "dict"), split="test"))
    b = make_batches(DataSpec(source=str(tmp_path / "dict"), split="validation", seq_len=3), bert, "plain")
    assert b.info["split"] == "validation"


def test_stdin(monkeypatch, causal):
    text = " ".join(SENTENCES)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    b = make_batches(DataSpec(source="-", seq_len=32), causal, "lm")
    assert b.info["source"] == "-" and b.info["samples"] == len(causal(text, add_special_tokens=False)["input_ids"]) // 32


def test_stdin_is_read_once_and_cut_as_often_as_asked(monkeypatch, causal):
    """A command cuts calibration, held-out and evaluation blocks from `--data -` separately; a pipe
    gives its text once, so every cut reads the same text (a new stdin is read afresh)."""
    text = " ".join(SENTENCES)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    first = make_batches(DataSpec(source="-", seq_len=32, max_samples=2), causal, "lm")
    held = make_batches(DataSpec(source="-", seq_len=32, max_samples=2, skip_samples=2), causal, "lm")
    assert first.info["samples"] == held.info["samples"] == 2
    again = make_batches(DataSpec(source="-", seq_len=32, max_samples=2), causal, "lm")
    assert torch.equal(first.batches[0]["input_ids"], again.batches[0]["input_ids"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("other words " * 200))
    other = make_batches(DataSpec(source="-", seq_len=32, max_samples=2), causal, "lm")
    assert not torch.equal(first.batches[0]["input_ids"], other.batches[0]["input_ids"])


def test_stdin_terminal_is_refused(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Tty(""))
    with pytest.raises(UsageError, match="stdin is a terminal"):
        load_texts(DataSpec(source="-"))


def test_stdin_gives_the_blocks_of_the_same_bytes_in_a_file(monkeypatch, tmp_path, causal):
    """`--data - < a.txt` and `--data a.txt` are one text: stdin's bytes are decoded as a file's (UTF-8
    whatever the locale, a BOM dropped, CRLF and CR made LF). Before, a POSIX stdin (text mode,
    newline='\\n') kept the BOM and the CRs: other tokens, other blocks, another fingerprint."""
    raw = "\ufeff" + "\r\n".join(SENTENCES) + "\rlast line\r\n"
    path = tmp_path / "windows.txt"
    path.write_bytes(raw.encode("utf-8"))
    spec = DataSpec(seq_len=8, max_samples=6)
    from_file = make_batches(DataSpec(**{**spec.__dict__, "source": str(path)}), causal, "lm")
    for stdin in (io.TextIOWrapper(io.BytesIO(raw.encode("utf-8")), encoding="latin-1", newline="\n"),
                  io.StringIO(raw, newline="")):  # the bytes under any locale; a text-only stream
        monkeypatch.setattr(sys, "stdin", stdin)
        piped = make_batches(DataSpec(**{**spec.__dict__, "source": "-"}), causal, "lm")
        assert piped.info["fingerprint"] == from_file.info["fingerprint"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café".encode("latin-1")), encoding="latin-1"))
    with pytest.raises(UsageError, match="cannot read stdin as UTF-8"):
        load_texts(DataSpec(source="-"))


def test_licence_texts_found_deduplicated_and_in_path_order(tmp_path):
    """builtin:licenses reads every licence file of the *.dist-info folders (LICENSE*, LICENCE*,
    COPYING*, anything under licenses/), drops texts equal up to whitespace, decodes latin-1."""
    from headtool.data.sources import licence_texts

    files = {"b-1.0.dist-info/LICENSE": b"MIT License\r\n\r\nPermission is hereby granted",
             "a-2.0.dist-info/licenses/NOTICE": b"Apache  License\n Version 2.0",
             "c-1.0.dist-info/LICENSE.txt": b"MIT License\n\nPermission   is hereby granted\n",  # a duplicate
             "d-1.0.dist-info/COPYING": "Copyright \u00e9cole".encode("latin-1"),
             "d-1.0.dist-info/METADATA": b"Name: d", "e/LICENSE": b"not a dist-info"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    got = licence_texts(tmp_path)
    assert [rel for rel, _ in got] == ["a-2.0.dist-info/licenses/NOTICE", "b-1.0.dist-info/LICENSE",
                                      "d-1.0.dist-info/COPYING"]
    assert got[1][1] == "MIT License\n\nPermission is hereby granted" and got[2][1] == "Copyright \u00e9cole"


def test_builtin_licenses_is_another_domain_on_every_install(bert):
    """The installed packages' licence texts: enough blocks for an evaluation, the same blocks on
    every call, and provenance that names how many texts were read."""
    b = make_batches(DataSpec(source="builtin:licenses", max_samples=32, seq_len=64, batch_size=8), bert, "lm")
    b2 = make_batches(DataSpec(source="builtin:licenses", max_samples=32, seq_len=64, batch_size=8), bert, "lm")
    assert b.info["samples"] == 32 and b.info["available_samples"] > 200
    assert "licence texts of the installed packages" in b.info["source_version"]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(b, b2) for k in x)


def test_builtin_pydoc_fast_and_deterministic(bert):
    from pydoc_data.topics import topics

    texts, _ = load_texts(DataSpec())
    assert texts == [topics[k] for k in sorted(topics)]
    t0 = time.perf_counter()
    b = make_batches(DataSpec(max_samples=64, seq_len=128, batch_size=8), bert, "lm")
    assert time.perf_counter() - t0 < 2.0
    b2 = make_batches(DataSpec(max_samples=64, seq_len=128, batch_size=8), bert, "lm")
    assert len(b) == 8 and b.info["samples"] == 64 and b.info["tokens"] == 64 * 128
    assert b.info["source"] == "builtin:pydoc" and b.info["selection"] == "shuffled"
    assert all(torch.equal(x[k], y[k]) for x, y in zip(b, b2) for k in x)
    assert b.info == b2.info
    b3 = make_batches(DataSpec(max_samples=64, seq_len=128, batch_size=8, seed=1), bert, "lm")
    assert b3.info["fingerprint"] != b.info["fingerprint"]


def test_num_tokens_caps_blocks(causal):
    b = make_batches(DataSpec(num_tokens=1000, seq_len=64), causal, "lm")
    assert b.info["samples"] == 1000 // 64
    b = make_batches(DataSpec(num_tokens=1000, max_samples=3, seq_len=64), causal, "lm")
    assert b.info["samples"] == 3  # both caps apply


# ----------------------------------------------------------------------------- selection


def test_skip_samples_gives_disjoint_heldout(causal):
    calib = make_batches(DataSpec(max_samples=32, seq_len=32), causal, "lm")
    held = make_batches(DataSpec(max_samples=50, skip_samples=32, seq_len=32), causal, "lm")
    both = make_batches(DataSpec(max_samples=82, seq_len=32), causal, "lm")
    assert len(set(rows(calib))) == 32 and len(set(rows(held))) == 50
    assert not set(rows(calib)) & set(rows(held))
    assert set(rows(calib)) | set(rows(held)) == set(rows(both))  # selection is prefix-stable


def test_lazy_read_is_prefix_stable(monkeypatch, causal):
    """With small chunks only the first chunks are tokenized; the choice still matches a full read."""
    monkeypatch.setattr(hd, "CHUNK_TOKENS", 32 * 16)  # 16 blocks of 32 per chunk
    small = make_batches(DataSpec(max_samples=10, seq_len=32), causal, "lm")
    assert small.info["corpus_fully_read"] is False and small.info["available_samples"] == 16
    held = make_batches(DataSpec(max_samples=10, skip_samples=10, seq_len=32), causal, "lm")
    assert held.info["available_samples"] == 32
    full = make_batches(DataSpec(skip_samples=0, max_samples=10**6, seq_len=32), causal, "lm")
    assert full.info["corpus_fully_read"] is True
    assert not set(rows(small)) & set(rows(held))
    everything = set(rows(full))
    assert set(rows(small)) <= everything and set(rows(held)) <= everything
    twenty = make_batches(DataSpec(max_samples=20, seq_len=32), causal, "lm")
    assert set(rows(small)) | set(rows(held)) == set(rows(twenty))


def test_skip_for_classification_disjoint(tmp_path, bert):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": f"example number {i}", "label": i % 2} for i in range(40)])
    a = make_batches(DataSpec(source=str(p), label_column="label", max_samples=15, seq_len=8), bert, "classification")
    b = make_batches(
        DataSpec(source=str(p), label_column="label", skip_samples=15, seq_len=8), bert, "classification"
    )
    assert a.info["samples"] == 15 and b.info["samples"] == 25
    assert not set(rows(a)) & set(rows(b))


# ----------------------------------------------------------------------------- encoders / mlm


def test_plain_encoder_blocks_wrapped(bert):
    b = make_batches(DataSpec(max_samples=12, seq_len=16), bert, "plain")
    for x in b:
        assert "labels" not in x
        assert bool((x["input_ids"][:, 0] == bert.cls_token_id).all())
        assert bool((x["input_ids"][:, -1] == bert.sep_token_id).all())
        assert x["input_ids"].shape[1] == 16
    assert b.info["encoder_wrapped"] is True


def test_plain_causal_not_wrapped(causal):
    b = make_batches(DataSpec(max_samples=4, seq_len=16), causal, "plain")
    assert set(b[0]) == {"input_ids", "attention_mask"} and b.info["encoder_wrapped"] is False


def test_mlm_masking(bert):
    spec = DataSpec(max_samples=64, seq_len=64, batch_size=16, seed=3)
    b = make_batches(spec, bert, "mlm")
    plain = make_batches(spec, bert, "plain")  # same selection, unmasked
    ids = torch.cat([x["input_ids"] for x in b])
    labels = torch.cat([x["labels"] for x in b])
    orig = torch.cat([x["input_ids"] for x in plain])
    masked = labels != -100
    special = torch.isin(orig, torch.tensor(bert.all_special_ids))
    assert bool(special[:, 0].all()) and bool(special[:, -1].all())
    assert not bool((masked & special).any())  # special tokens never masked
    assert torch.equal(labels[masked], orig[masked])
    assert torch.equal(ids[~masked], orig[~masked])  # unmasked positions unchanged
    rate = masked.sum().item() / (~special).sum().item()
    assert 0.12 < rate < 0.18
    n = masked.sum().item()
    as_mask = (ids[masked] == bert.mask_token_id).sum().item() / n
    kept = (ids[masked] == orig[masked]).sum().item() / n
    assert 0.72 < as_mask < 0.88 and 0.04 < kept < 0.17
    assert not bool(torch.isin(ids[masked & (ids != bert.mask_token_id)], torch.tensor(bert.all_special_ids)).any())
    assert b.info["masked_tokens"] == n and bool(masked.any(dim=1).all())
    again = make_batches(spec, bert, "mlm")
    assert all(torch.equal(x[k], y[k]) for x, y in zip(b, again) for k in x)
    other = make_batches(DataSpec(max_samples=64, seq_len=64, batch_size=16, seed=4), bert, "mlm")
    assert b.info["fingerprint"] != other.info["fingerprint"]


def test_mlm_needs_mask_token(causal):
    with pytest.raises(UsageError, match="mask token"):
        make_batches(DataSpec(max_samples=2, seq_len=16), causal, "mlm")


# ----------------------------------------------------------------------------- errors


def test_errors_bad_options(causal):
    with pytest.raises(UsageError, match="seq-len must be at least 2"):
        make_batches(DataSpec(seq_len=1), causal)
    with pytest.raises(UsageError, match="batch-size must be at least 1"):
        make_batches(DataSpec(batch_size=0), causal)
    with pytest.raises(UsageError, match="max-samples"):
        make_batches(DataSpec(max_samples=0), causal)
    with pytest.raises(UsageError, match="skip-samples must be"):
        make_batches(DataSpec(skip_samples=-1), causal)
    with pytest.raises(UsageError, match="less than one block"):
        make_batches(DataSpec(num_tokens=10, seq_len=64), causal)
    with pytest.raises(UsageError, match="unknown data task"):
        make_batches(DataSpec(), causal, "regression")
    with pytest.raises(UsageError, match="maximum length 2048"):
        make_batches(DataSpec(seq_len=4096), causal)
    with pytest.raises(UsageError, match="leaves no data"):
        make_batches(DataSpec(skip_samples=10**6), causal)


def test_error_empty_data(tmp_path, causal):
    p = tmp_path / "empty.txt"
    p.write_text("  \n\n ")
    with pytest.raises(UsageError, match="no text found"):
        make_batches(DataSpec(source=str(p)), causal)
    q = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(UsageError, match="no text found"):
        make_batches(DataSpec(source=str(q)), causal)
    r = tmp_path / "none.jsonl"
    r.write_text("\n")
    with pytest.raises(UsageError, match="no records"):
        make_batches(DataSpec(source=str(r)), causal)


def test_error_missing_columns(tmp_path, causal):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "q?", "answer": "a."}])
    with pytest.raises(UsageError, match=r"cannot tell which column.*question, answer.*--text-column"):
        load_texts(DataSpec(source=str(p)))
    with pytest.raises(UsageError, match=r"column 'body' not found.*available columns: question, answer"):
        load_texts(DataSpec(source=str(p), text_column="body"))
    with pytest.raises(UsageError, match=r"label column 'y' not found.*question, answer"):
        make_batches(DataSpec(source=str(p), text_column="question", label_column="y"), causal, "classification")
    with pytest.raises(UsageError, match="needs a label column"):
        make_batches(DataSpec(source=str(p), text_column="question"), causal, "classification")
    n = write_jsonl(tmp_path / "n.jsonl", [{"text": "x", "num": 3}])
    with pytest.raises(UsageError, match="does not hold text"):
        load_texts(DataSpec(source=str(n), text_column="num"))


def test_a_categorical_text_column_is_a_text_column(tmp_path):
    """A parquet column of strings stored dictionary-encoded (a pandas category, a polars Categorical)
    was no string column: 'cannot tell which column of d.parquet holds the text (columns: comment,
    stars)' with one text column there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    comments = pa.array(["good film", "bad film", "good film"]).dictionary_encode()
    pq.write_table(pa.table({"comment": comments, "stars": [5, 1, 5]}), tmp_path / "d.parquet")
    assert load_texts(DataSpec(source=str(tmp_path / "d.parquet"))) == (["good film", "bad film", "good film"], None)


def test_a_text_column_with_a_non_text_value_is_named_with_its_row(tmp_path, causal):
    """A 'text' column with one number among its strings (or a CSV of a header alone) was answered
    'cannot tell which column of d.jsonl holds the text (columns: text); pass --text-column': the one
    column, named text, and the user asked to name it. It is that column, and the refusal says what
    is in it and where; a header alone has no text."""
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"text": None}, {"text": 5}, {"text": "more"}])
    with pytest.raises(UsageError, match=r"^column 'text' of .*d.jsonl does not hold text \(found int in row 3\)"):
        load_texts(DataSpec(source=str(p)))
    header = tmp_path / "h.csv"
    header.write_text("text,label\n")
    with pytest.raises(UsageError, match=r"^no text found in .*h.csv \(column 'text'\)$"):
        make_batches(DataSpec(source=str(header), seq_len=8), causal, "lm")
    two = write_jsonl(tmp_path / "two.jsonl", [{"text": 1, "title": "t", "summary": "s"}])
    with pytest.raises(UsageError, match="cannot tell which column"):  # string columns to choose from: ask
        load_texts(DataSpec(source=str(two)))


def test_a_one_token_text_is_not_told_to_use_seq_len_2(tmp_path, causal):
    """A text of one token was told 'use --seq-len 2 or less', which fails the same way (a block of
    2 needs 2 tokens) and --seq-len 1 is refused: it is told to give more text."""
    p = tmp_path / "one.txt"
    p.write_text("a")
    assert len(causal("a", add_special_tokens=False)["input_ids"]) == 1
    with pytest.raises(UsageError, match=r"has only 1 token, fewer than one block of --seq-len 8; give more text"):
        make_batches(DataSpec(source=str(p), seq_len=8), causal, "lm")


def test_error_text_too_short(tmp_path, causal):
    p = tmp_path / "short.txt"
    p.write_text("tiny")
    n = len(causal("tiny", add_special_tokens=False)["input_ids"])
    with pytest.raises(UsageError, match=rf"only {n} tokens.*--seq-len {n} or less"):
        make_batches(DataSpec(source=str(p), seq_len=128), causal)


def test_error_encoding(tmp_path, causal):
    for name in ("latin.txt", "latin.jsonl", "latin.csv"):
        p = tmp_path / name
        p.write_bytes("text\ncaf\xe9 cr\xe8me\n".encode("latin-1"))
        with pytest.raises(UsageError, match=f"cannot read .*{name} as UTF-8 text"):
            make_batches(DataSpec(source=str(p)), causal)


def test_error_paths(tmp_path):
    with pytest.raises(UsageError, match="data file not found: .*nope.txt"):
        load_texts(DataSpec(source=str(tmp_path / "nope.txt")))
    with pytest.raises(UsageError, match="data file not found: missing.jsonl"):
        load_texts(DataSpec(source="missing.jsonl"))
    with pytest.raises(UsageError, match="data file not found: ./some/dir"):
        load_texts(DataSpec(source="./some/dir"))
    x = tmp_path / "data.xml"
    x.write_text("<a/>")
    with pytest.raises(UsageError, match=r"unsupported data file type '.xml'.*\.txt, \.jsonl, \.json, \.csv"):
        load_texts(DataSpec(source=str(x)))
    bare = tmp_path / "notes"  # every source the other messages offer, and what to do with a bare text file
    bare.write_text("plain prose")
    with pytest.raises(UsageError, match=r"'\(none\)'.*builtin:licenses, self\[:N\].*e\.g\. notes\.txt"):
        load_texts(DataSpec(source=str(bare)))
    (tmp_path / "folder").mkdir()
    with pytest.raises(UsageError, match="not a datasets.save_to_disk folder"):
        load_texts(DataSpec(source=str(tmp_path / "folder")))
    with pytest.raises(UsageError, match="unknown builtin data 'builtin:wiki'.*builtin:pydoc"):
        load_texts(DataSpec(source="builtin:wiki"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(UsageError, match="line 2 is not valid JSON"):
        load_texts(DataSpec(source=str(bad)))
    amb = tmp_path / "amb.json"
    amb.write_text(json.dumps({"a": [{"text": "x"}], "b": [{"text": "y"}]}))
    with pytest.raises(UsageError, match="several lists.*--split"):
        load_texts(DataSpec(source=str(amb)))
    neg = write_jsonl(tmp_path / "neg.jsonl", [{"text": "x", "label": -1}])
    with pytest.raises(UsageError, match="negative labels"):
        make_batches(DataSpec(source=str(neg), label_column="label", seq_len=8), bert_tokenizer(), "classification")


def test_hub_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in ("someone/not-a-dataset-xyz", "wikitext:wikitext-2-raw-v1", "wikimedia/wikipedia:20231101.en"):
        t0 = time.perf_counter()
        with pytest.raises(UsageError, match=rf"could not load dataset '{name}' from the hub \(offline\?\)"):
            load_texts(DataSpec(source=name))
        assert time.perf_counter() - t0 < 10


def test_hub_errors_and_success_are_mapped(monkeypatch, causal):
    """The hub branch without a network: load_dataset is replaced, so nothing is downloaded."""
    import datasets

    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    calls = []

    def no_network(name, config=None, split=None, **kw):
        calls.append((name, config, split))
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(UsageError, match=r"from the hub \(offline\?\): Couldn't reach"):
        load_texts(DataSpec(source="org/name:cfg"))
    assert calls == [("org/name", "cfg", "train")]

    def ok(name, config=None, split=None, **kw):
        return datasets.Dataset.from_dict({"text": SENTENCES})

    monkeypatch.setattr(datasets, "load_dataset", ok)
    b = make_batches(DataSpec(source="org/name", split="test", seq_len=16), causal)
    assert b.info["split"] == "test" and b.info["samples"] > 0 and b.info["text_column"] == "text"


def test_fewer_blocks_than_asked_is_a_headtool_warning_and_can_be_held(tmp_path, causal, monkeypatch):
    """'asked for N blocks but only M' went through `logging` with no handler: Python's last-resort
    printer wrote it bare on stderr (no 'warning:'), outside the console the rest of stderr goes
    through. It is console.warn now, and warnings_held() shows it after a step that returns and
    drops it from one that raises (heal's refusal of too short a text stays one line)."""
    from headtool import console

    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(SENTENCES), encoding="utf-8")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    console.reset_consoles()
    try:
        spec = DataSpec(source=str(p), seq_len=16, max_samples=1000)
        make_batches(spec, causal, "lm")
        assert err.getvalue().startswith("warning: asked for 1000 blocks"), err.getvalue()
        err.truncate(0), err.seek(0)
        with console.warnings_held():
            make_batches(spec, causal, "lm")
            assert err.getvalue() == ""
        assert err.getvalue().startswith("warning: asked for 1000 blocks"), err.getvalue()
        err.truncate(0), err.seek(0)
        with pytest.raises(UsageError), console.warnings_held():
            make_batches(spec, causal, "lm")
            raise UsageError("refused")
        assert err.getvalue() == ""
    finally:
        console.reset_consoles()
