"""The paired difference of two models' losses over the same blocks, and its standard error: what the
allocation judge of `prune --normalize` weighs a candidate's gain against."""
from __future__ import annotations

import math

import pytest
import torch

from headtool.measure.evaluation import evaluate, paired_difference
from tiny_models import sample_ids, tiny_model


def test_the_difference_is_the_difference_of_the_mean_losses():
    a, b, w = [10.0, 20.0, 33.0, 5.0], [9.0, 21.0, 30.0, 5.5], [10.0, 10.0, 12.0, 4.0]
    diff, se = paired_difference(a, b, w)
    assert diff == pytest.approx(sum(a) / sum(w) - sum(b) / sum(w))
    # the ratio estimator's standard error, written out
    resid = [(x - y) - wi * diff for x, y, wi in zip(a, b, w)]
    assert se == pytest.approx(math.sqrt(4 / 3 * sum(r * r for r in resid)) / sum(w))


def test_a_gain_every_block_shares_in_proportion_has_no_error_and_noise_has_some():
    w = [8.0, 16.0, 12.0]
    b = [4.0 * x for x in w]
    assert paired_difference([s - 0.1 * x for s, x in zip(b, w)], b, w) == pytest.approx((-0.1, 0.0), abs=1e-12)
    diff, se = paired_difference([b[0] - 2.0, b[1] + 1.0, b[2]], b, w)
    assert diff == pytest.approx(-1.0 / 36.0) and se > abs(diff)


def test_one_block_has_no_error_estimate_and_mismatched_blocks_are_refused():
    assert paired_difference([2.0], [1.0], [1.0]) == (1.0, math.inf)
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        paired_difference([], [], [])


def test_evaluate_per_block_sums_add_up_to_its_mean_loss():
    model = tiny_model("llama")
    batches = [{"input_ids": sample_ids("llama", 3, 12, seed=s), "attention_mask": torch.ones(3, 12, dtype=torch.long)}
               for s in range(2)]
    batches[1]["attention_mask"][0, 8:] = 0  # padding counts for nothing
    out = evaluate(model, batches, "lm", per_block=True)
    assert len(out["block_sums"]) == len(out["block_weights"]) == 6
    assert out["block_weights"] == [11.0, 11.0, 11.0, 7.0, 11.0, 11.0]
    assert sum(out["block_sums"]) / sum(out["block_weights"]) == pytest.approx(out["loss"], rel=1e-6)
    assert "block_sums" not in evaluate(model, batches, "lm")
