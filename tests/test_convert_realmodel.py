"""SmolLM2-135M, 3 -> 1 KV heads on CI-sized data: the data-aware fit beats plain averaging by far."""
from __future__ import annotations

import pytest

from conftest import needs_smollm2


@pytest.mark.realmodel
@needs_smollm2
def test_smollm2_fit_beats_mean_by_far(smollm2):
    from headtool.surgery import merging as C
    from headtool.measure.calibration import attention_input_grams
    from headtool.data.sources import DataSpec
    from headtool.data.batches import make_batches
    from headtool.measure.evaluation import evaluate

    cal = make_batches(DataSpec(seq_len=64, batch_size=8, max_samples=8), smollm2.tokenizer, "lm")
    ev = make_batches(DataSpec(seq_len=64, batch_size=4, max_samples=4, skip_samples=8), smollm2.tokenizer, "lm")
    grams = attention_input_grams(smollm2.model, smollm2.adapter, cal.batches)
    ppl = {}
    for method in ("mean", "fit"):
        conv = C.convert_model(smollm2.model, smollm2.adapter, 1, method=method, grams=grams)
        assert conv.model.config.num_key_value_heads == 1
        ppl[method] = evaluate(conv.model, ev.batches, "lm")["perplexity"]
        del conv
    assert ppl["fit"] * 10 < ppl["mean"], ppl
