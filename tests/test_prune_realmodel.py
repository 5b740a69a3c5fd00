"""SmolLM2-135M, CI-sized: compensation lowers held-out perplexity at 25% of query heads removed."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from conftest import needs_smollm2
from headtool.data.sources import DataSpec
from headtool.data.batches import make_batches
from headtool.measure.evaluation import evaluate
from headtool.model.loading import model_from_object
from headtool.surgery.pruning import prune
from headtool.measure.scoring import score_heads
from headtool.surgery.selection import Target, select_heads


@pytest.mark.realmodel
@needs_smollm2
def test_compensation_beats_plain_removal_on_held_out_blocks(smollm2):
    spec = DataSpec(source="builtin:pydoc", seq_len=64, batch_size=4, max_samples=4)  # CI-sized
    calib = make_batches(spec, smollm2.tokenizer, "lm").batches
    held_out = make_batches(replace(spec, skip_samples=4, max_samples=4), smollm2.tokenizer, "lm").batches
    scores = score_heads(smollm2.model, smollm2.adapter, calib[:1], method="gradient", objective="lm").scores
    sel = select_heads(scores, smollm2.geometry, Target(fraction=0.25))
    losses = {}
    for name, kw in {"plain": {}, "refit": {"compensate": True, "calib_batches": calib}}.items():
        lm = model_from_object(copy.deepcopy(smollm2.model), smollm2.tokenizer)
        result = prune(lm, sel, **kw)
        assert result.info_after["total_heads"] == 270 - sel.num_removed(smollm2.geometry)
        losses[name] = evaluate(lm.model, held_out, "lm")["loss"]
        if kw:
            assert all(r["rel_error_after"] < r["rel_error_before"] for r in result.compensation)
        del lm
    assert losses["refit"] < losses["plain"] - 0.05, losses
