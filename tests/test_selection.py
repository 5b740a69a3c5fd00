"""Selection: scores + target -> heads to keep (pure functions)."""
from __future__ import annotations

import pytest

from headtool.arch import LayerHeads
from headtool.errors import UsageError
from headtool.surgery.selection import (Target, candidate_sets, choose_removal, choose_removals, resolve_unit, head_pairs, parse_heads, parse_protect,
    removal_steps, select_heads, selection_from_removed)

MHA = [LayerHeads(4, 4, 8)] * 3
GQA = [LayerHeads(6, 2, 8)] * 2  # groups {0,1,2} {3,4,5}
SC_MHA = [[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.05], [1.0, 0.95, 0.9, 0.85]]


def test_global_fraction_takes_weakest_heads():
    sel = select_heads(SC_MHA, MHA, Target(fraction=0.25))  # 3 of 12
    assert sel.removed(MHA) == [[1], [0, 3], []]


def test_num_heads_and_threshold():
    assert select_heads(SC_MHA, MHA, Target(num_heads=2)).removed(MHA) == [[1], [3], []]
    assert select_heads(SC_MHA, MHA, Target(threshold=0.35)).removed(MHA) == [[1, 3], [0, 3], []]


def test_min_heads_per_layer_caps_a_layer():
    sel = select_heads(SC_MHA, MHA, Target(num_heads=3, min_heads_per_layer=3))
    assert sel.removed(MHA) == [[1], [3], [3]]  # layer 1 would otherwise lose 0 and 3


def test_layer_scope_removes_the_same_number_everywhere():
    sel = select_heads(SC_MHA, MHA, Target(fraction=0.5, scope="layer"))
    assert sel.removed(MHA) == [[1, 3], [0, 3], [2, 3]]
    with pytest.raises(UsageError, match="multiple of the 3 layers"):
        select_heads(SC_MHA, MHA, Target(num_heads=4, scope="layer"))


def test_unit_query_keeps_groups_equal():
    scores = [[0.1, 0.5, 0.9, 0.2, 0.6, 0.3], [1, 1, 1, 1, 1, 1]]
    steps = removal_steps(scores[0], GQA[0], "query")
    assert steps == [[0, 3], [1, 5]]
    sel = select_heads(scores, GQA, Target(num_heads=2))
    assert sel.removed(GQA) == [[0, 3], []]
    assert sel.keeps[0].kv == (0, 1)


def test_unit_group_removes_whole_groups_with_their_kv_head():
    scores = [[0.1, 0.2, 0.3, 0.9, 0.8, 0.7], [1, 1, 1, 1, 1, 1]]
    sel = select_heads(scores, GQA, Target(num_heads=3, unit="group"))
    assert sel.removed(GQA) == [[0, 1, 2], []]
    assert sel.keeps[0].kv == (1,)
    assert sel.geometry(GQA)[0] == LayerHeads(3, 1, 8)


def test_unit_head_removes_single_heads_and_keeps_every_kv_head_with_a_reader():
    scores = [[0.1, 0.5, 0.9, 0.2, 0.6, 0.3], [1, 1, 1, 1, 1, 1]]
    assert removal_steps(scores[0], GQA[0], "head") == [[0], [3], [5], [1], [4]]
    sel = select_heads(scores, GQA, Target(num_heads=3, unit="head"))
    assert sel.removed(GQA) == [[0, 3, 5], []]
    assert sel.keeps[0].kv == (0, 1) and sel.keeps[0].group_sizes == (2, 1)
    assert sel.geometry(GQA)[0] == LayerHeads(3, 2, 8, (2, 1))
    # the last reader of a KV head takes it along: groups of 3 and 0 are one group of 3
    sel = selection_from_removed({0: [3, 4, 5]}, GQA, unit="head")
    assert sel.geometry(GQA)[0] == LayerHeads(3, 1, 8) and sel.keeps[0].group_sizes is None
    with pytest.raises(UsageError, match="unequal sizes"):
        selection_from_removed({0: [0]}, GQA)  # without --unit head the groups must stay equal


def test_uneven_geometry_maps_query_heads_to_their_kv_heads():
    g = LayerHeads(5, 2, 8, (3, 2))
    assert g.uneven and g.sizes() == (3, 2) and g.kv_index() == [0, 0, 0, 1, 1]
    assert [g.kv_head_of(h) for h in range(5)] == [0, 0, 0, 1, 1] and g.query_heads_of(1) == [3, 4]
    assert LayerHeads(4, 2, 8, (2, 2)) == LayerHeads(4, 2, 8)  # equal groups: the ordinary layout
    with pytest.raises(ValueError, match="differ in size"):
        g.group_size
    with pytest.raises(ValueError, match="do not split"):
        LayerHeads(5, 2, 8, (3, 3))
    # a second prune of such a layer removes single heads only
    with pytest.raises(UsageError, match="--unit head"):
        select_heads([[1.0] * 5], [g], Target(num_heads=1))
    sel = select_heads([[0.5, 0.1, 0.9, 0.8, 0.7]], [g], Target(num_heads=1, unit="head"))
    assert sel.geometry([g])[0] == LayerHeads(4, 2, 8)  # (2, 2): equal again


def test_protected_layers_lose_no_heads_and_the_others_make_up_the_number():
    # unprotected, the weakest 3 heads are layer 0's head 1 and layer 1's heads 0 and 3
    sel = select_heads(SC_MHA, MHA, Target(fraction=0.25, protect=(0,)))
    assert sel.removed(MHA) == [[], [0, 2, 3], []]  # still 3 heads: the next weakest is layer 1 head 2
    assert select_heads(SC_MHA, MHA, Target(num_heads=3, protect=(0, -2))).removed(MHA) == [[], [], [1, 2, 3]]
    assert select_heads(SC_MHA, MHA, Target(threshold=0.35, protect=(1,))).removed(MHA) == [[1, 3], [], []]
    # --scope layer: every other layer loses its share, the protected one none
    assert select_heads(SC_MHA, MHA, Target(fraction=0.5, scope="layer", protect=(2,))).removed(MHA) == \
        [[1, 3], [0, 3], []]
    assert select_heads(SC_MHA, MHA, Target(num_heads=3, scope="layer", protect=(0,))).removed(MHA) == \
        [[], [3], [3]]
    assert Target(fraction=0.25, protect=(0, -1)).describe()["protect_layers"] == [0, -1]


def test_protect_layers_text_and_its_errors():
    assert parse_protect("0") == (0,) and parse_protect(" 0, -1 ") == (0, -1)
    assert parse_protect("none") == () and parse_protect("") == () and parse_protect(None) == ()
    assert parse_protect("auto") == (0,) and parse_protect("auto", "layer") == ()
    assert parse_protect("auto", "global", 1) == () and parse_protect("0", "global", 1) == (0,)
    for text, msg in (("a", "cannot read 'a'"), ("0,0", "listed twice"), ("1;2", "cannot read")):
        with pytest.raises(UsageError, match=msg):
            parse_protect(text)
    with pytest.raises(UsageError, match="layer 3 does not exist"):
        select_heads(SC_MHA, MHA, Target(fraction=0.25, protect=(3,)))
    with pytest.raises(UsageError, match="layer -4 does not exist"):
        select_heads(SC_MHA, MHA, Target(fraction=0.25, protect=(-4,)))
    with pytest.raises(UsageError, match="at most 3 of 12 .*--protect-layers 0,1"):
        select_heads(SC_MHA, MHA, Target(num_heads=4, protect=(0, 1)))


@pytest.mark.parametrize("target, msg", [
    (Target(fraction=1.0), "strictly between 0 and 1"),
    (Target(fraction=0.0), "strictly between 0 and 1"),
    (Target(num_heads=12), "only 12 query heads"),
    (Target(fraction=0.5, min_heads_per_layer=5), "impossible"),
    (Target(fraction=0.9, min_heads_per_layer=3), "at most 3 of 12"),
    (Target(), "exactly one target"),
    (Target(fraction=0.2, num_heads=2), "exactly one target"),
    (Target(threshold=0.5, scope="layer"), "does not combine"),
    (Target(fraction=0.2, unit="kv"), "--unit"),
])
def test_bad_targets_are_usage_errors(target, msg):
    with pytest.raises(UsageError, match=msg):
        select_heads(SC_MHA, MHA, target)


def test_scores_of_the_wrong_shape():
    with pytest.raises(UsageError, match="2 layers"):
        select_heads(SC_MHA[:2], MHA, Target(fraction=0.2))
    with pytest.raises(UsageError, match="3 heads in layer 0"):
        select_heads([[1, 2, 3]] + SC_MHA[1:], MHA, Target(fraction=0.2))


def test_parse_heads_and_its_errors():
    assert parse_heads("2:3,1; 0:0 ;", MHA) == {0: [0], 2: [1, 3]}
    assert parse_heads("", MHA) == parse_heads("  ", MHA) == {}  # prune: remove none
    for text, msg in [("1-2", "cannot read"), ("5:0", "layer 5 does not exist"), ("0:4", "not 4"),
                      ("0:a", "cannot read"), ("0:-1", "cannot read"), ("3", "no layer before it"),
                      ("1,0:2", "no layer before it"), ("0:1,1", "head 1 is listed twice"),
                      ("0:1;0:1", "head 1 is listed twice"), ("1:2,1:2", "listed twice"), (";;", "lists no heads"),
                      (",", "lists no heads"), ("0:", "cannot read"), (":1", "cannot read"), ("0:1:2", "cannot read")]:
        with pytest.raises(UsageError, match=msg) as e:
            parse_heads(text, MHA)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", [
    "0:1,3;2:0",        # prune's form: layers separated by ';', heads by ','
    "0:1,0:3,2:0",      # inspect's older form: LAYER:HEAD pairs separated by ','
    "0:1,3,2:0",        # mixed: an item with ':' starts a new layer
    "2:0; 0:3,1",       # any order, spaces, one layer given twice with different heads
    "0:3;0:1;2:0;",
])
def test_one_grammar_reads_both_forms(text):
    assert parse_heads(text, MHA) == {0: [1, 3], 2: [0]}
    assert head_pairs(parse_heads(text, MHA)) == [(0, 1), (0, 3), (2, 0)]


def test_explicit_removal_checks_gqa_and_min_heads():
    sel = selection_from_removed({0: [0, 3]}, GQA)
    assert sel.kept[0] == (1, 2, 4, 5)
    with pytest.raises(UsageError, match="unequal"):
        selection_from_removed({0: [0]}, GQA)
    with pytest.raises(UsageError, match="fewer than --min-heads-per-layer"):
        selection_from_removed({0: [0, 1, 2, 3]}, MHA, min_heads=1)
    assert selection_from_removed({}, MHA).num_removed(MHA) == 0


def test_choose_removal_minimizes_cost_under_the_unit_rules():
    cost = lambda s: sum({0: 5, 1: 1, 2: 3, 3: 4, 4: 0, 5: 2}[h] for h in s)  # noqa: E731
    assert choose_removal(GQA[0], 2, "query", cost) == [1, 4]
    assert choose_removal(GQA[0], 3, "group", cost) == [3, 4, 5]
    assert len(candidate_sets(GQA[0], 2, "query")) == 9
    # greedy path (too many candidates) still obeys the unit rule
    big = LayerHeads(64, 4, 8)
    out = choose_removal(big, 32, "query", lambda s: float(sum(s)))
    assert [sum(1 for h in out if big.kv_head_of(h) == k) for k in range(4)] == [8, 8, 8, 8]
    assert choose_removal(GQA[0], 2, "head", cost) == [1, 4]
    assert choose_removal(GQA[0], 3, "head", cost) == [1, 4, 5]  # two from one group: --unit head allows it
    assert len(candidate_sets(GQA[0], 3, "head")) == 20


def test_choose_removals_beam_keeps_more_than_the_cheapest_set_and_serves_every_count():
    geo = LayerHeads(9, 3, 8)
    single = {0: 1.0, 1: 2.0, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0, 6: 4.5, 7: 5.0, 8: 5.5}

    def cost(s):  # heads 1 and 2 are redundant with each other: together they cost less than any pair with 0
        calls.append(tuple(s))
        return sum(single[h] for h in s) - (3.9 if {1, 2} <= set(s) else 0.0)
    calls: list = []
    chosen = choose_removals(geo, range(9), "head", cost)
    assert sorted(chosen) == list(range(9)) and chosen[0] == []
    assert chosen[1] == [0] and chosen[2] == [1, 2]  # one set a round (greedy) would keep 0 and miss the pair
    assert chosen[3] == [0, 1, 2]
    assert len(set(calls)) == len(calls) < sum(len(candidate_sets(geo, n, "head")) for n in range(1, 9))
    # a single small count: exhaustive (exact), no dearer than the beam there; the beam over every count misses
    triple = lambda s: (-1.0 if set(s) == {6, 7, 8} else 1.0) + 0.1 * sum(s)  # noqa: E731
    assert choose_removal(geo, 3, "head", triple) == [6, 7, 8]
    assert choose_removals(geo, range(1, 9), "head", triple)[3] != [6, 7, 8]
    # more than BEAM_MAX_HEADS query heads: one set a round (greedy) misses the redundant pair
    wide = LayerHeads(20, 4, 8)
    single.update({h: 6.0 + h for h in range(9, 20)})
    assert choose_removals(wide, [2], "head", cost)[2] == [0, 1]
    # the beam obeys the unit rules (one head from every group a step)
    big = LayerHeads(16, 4, 8)
    out = choose_removals(big, [4, 8, 12], "query", lambda s: float(sum(s)))
    assert [[big.kv_head_of(h) for h in out[n]].count(k) for n in (4, 8, 12) for k in range(4)] == [1] * 4 + [2] * 4 + [3] * 4


def test_unit_auto_is_head_for_a_compensated_global_prune_of_grouped_layers_else_query():
    gqa, mha, mqa = [LayerHeads(6, 3, 8)] * 2, [LayerHeads(4, 4, 8)] * 2, [LayerHeads(4, 1, 8)] * 2
    uneven = [LayerHeads(5, 3, 8, group_sizes=(1, 2, 2)), LayerHeads(6, 3, 8)]
    assert resolve_unit("auto", gqa, compensate=True) == "head"
    assert resolve_unit("auto", gqa, compensate=True, scope="layer") == "query"
    assert resolve_unit("auto", gqa) == "query"
    assert resolve_unit("auto", mha, compensate=True) == resolve_unit("auto", mqa, compensate=True) == "query"
    assert resolve_unit("auto", uneven) == "head"  # nothing else can prune it
    for unit in ("query", "group", "head"):
        assert resolve_unit(unit, gqa, compensate=True) == unit
    wide = [LayerHeads(32, 8, 8)] * 2  # single-head search there costs several times query's
    assert resolve_unit("auto", wide, compensate=True) == "query" and resolve_unit("head", wide) == "head"
