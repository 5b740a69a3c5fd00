"""The refit settings prune uses with --compensate, measured out of domain. Constants and the one rule
that picks between two of them, torch-free, so that the CLI's option tables can name them without
importing torch."""

# prune --anchor-power with --compensate: a layer that keeps k of h heads is refit at anchor x (k/h)^P,
# P by how much calibration text the refit reads (default_anchor_power). Measured out of domain on
# SmolLM2 (news, legal, wiki): on 64 blocks of 128 tokens with query steps (bench_obs_allocation, five
# calibration samples) power 2 and 3 were better than 0 in every sample at 25% and 50% of the heads, 3 a
# little more than 2. With single heads (bench_anchor_power) 8 beat 3 on 256 blocks in all 9 cells of three
# samples at 25% (6 worse than 8 in every cell, 12 within 0.002 of it) and in 7 of 9 at 50%, on 128 blocks
# in 8 of 9 cells of three samples, while on 64 blocks 3 was better in 6 of 9 and on the demo's 16 on all 3:
# the more text, the freer a refit it supports.
FEW_TOKENS_ANCHOR_POWER = 3.0
MANY_TOKENS_ANCHOR_POWER = 8.0
MANY_CALIBRATION_TOKENS = 128 * 128  # from here on MANY_TOKENS_ANCHOR_POWER (prune's default reads 256 x 128)


def default_anchor_power(calibration_tokens: int) -> float:
    """The --anchor-power a refit on this many calibration tokens gets when none is given."""
    return MANY_TOKENS_ANCHOR_POWER if calibration_tokens >= MANY_CALIBRATION_TOKENS else FEW_TOKENS_ANCHOR_POWER


# prune --damping: the ridge toward zero under the anchor's ridge toward the weights. At the freer anchors
# of --anchor-power 3 (0.037 for a layer keeping 3 of 9 heads) 0.01 pulled the refit toward zero as hard as
# the anchor pulls it toward the weights; 0.001 was better on news, legal and wiki in 27 of 30 cells of
# five calibration samples at 25% and 50% of SmolLM2's heads (bench_obs_allocation --damping), 0.0001
# no better than 0.001 on two samples.
DEFAULT_PRUNE_DAMPING = 1e-3
# Layers with more query heads than this search one removal set a round (greedy), and prune's --unit auto
# takes query steps on them: on a synthetic layer of 32 x 64-dim heads (8 KV, every count) a beam of 8
# over single heads took 20 s against greedy's 2.6 s, over query steps 5.5 s against 0.7 s (both growing
# each set's factor; costing every set anew the beam took 196 s / 28.5 s, greedy 21 s / 2.6 s), and
# whether the beam, or single heads, choose better there is not measured.
BEAM_MAX_HEADS = 16
