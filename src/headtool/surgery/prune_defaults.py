"""The refit settings prune uses with --compensate, measured out of domain. A module of constants
only, so that the CLI's option tables can name them without importing torch."""

# prune --anchor-power with --compensate: a layer that keeps k of h heads is refit at anchor x (k/h)^3.
# Measured out of domain on SmolLM2 (bench_obs_allocation, five calibration samples): power 2 and 3 were
# better than 0 on news, legal and wiki in every sample at 25% and 50% of the heads, 3 a little more than 2.
DEFAULT_ANCHOR_POWER = 3.0
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
