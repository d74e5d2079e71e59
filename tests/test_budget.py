"""The tree budget that follows load: cost-model interpolation, the choice rule on hand-made costs, measuring and
caching on the tiny Llama-3, and clear refusals."""

import importlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import budget
from jaxspec.budget import (
    CostModel,
    choose_budget,
    cost_model_path,
    format_budget_table,
    load_or_measure_cost_model,
    measure_cost_model,
    tau_model,
)
from jaxspec.errors import UserError

TOKENS = [1, 9, 17, 33, 65, 129]


def _hand_made_costs() -> CostModel:
    """Batch 1: 1 ms flat up to 33 tokens, then linear (memory-bound); batch 16: 1 ms + 0.1 ms per token."""
    batch_1 = [1e-3, 1e-3, 1e-3, 1e-3, 2e-3, 4e-3]
    batch_16 = [1e-3 + 1e-4 * t for t in TOKENS]
    return CostModel(device="test", model="abc", batch_sizes=[1, 16], token_counts=TOKENS, seconds=[batch_1, batch_16])


def test_verify_seconds_is_exact_on_the_grid_log_linear_between_and_monotone():
    cost = CostModel(device="test", model="abc", batch_sizes=[1, 4, 16], token_counts=[1, 9, 33],
                     seconds=[[1.0, 2.0, 4.0], [2.0, 3.0, 8.0], [4.0, 9.0, 16.0]])
    for i, b in enumerate(cost.batch_sizes):
        for j, t in enumerate(cost.token_counts):
            assert cost.verify_seconds(b, t) == pytest.approx(cost.seconds[i][j], rel=1e-12)
    # halfway in log space is the geometric mean of the neighbours, along either axis and both at once
    assert cost.verify_seconds(1, 3) == pytest.approx(math.sqrt(1.0 * 2.0))
    assert cost.verify_seconds(2, 9) == pytest.approx(math.sqrt(2.0 * 3.0))
    assert cost.verify_seconds(8, 3 * math.sqrt(33)) == pytest.approx((3.0 * 8.0 * 9.0 * 16.0) ** 0.25)
    # outside the grid: the last power law continued above (batch 64 from 4 -> 16 doubling per 4x), held below
    assert cost.verify_seconds(64, 33) == pytest.approx(32.0)
    assert cost.verify_seconds(1, 66) == pytest.approx(4.0 * 2 ** (math.log(2) / math.log(33 / 9)))
    for b in (1, 2, 3, 4, 7, 16, 40):
        times = [cost.verify_seconds(b, t) for t in range(1, 80)]
        assert all(x <= y for x, y in zip(times, times[1:]))
    for t in (1, 5, 9, 20, 33, 50):
        times = [cost.verify_seconds(b, t) for b in range(1, 40)]
        assert all(x <= y for x, y in zip(times, times[1:]))
    upper = CostModel(device="test", model="abc", batch_sizes=[4, 16], token_counts=[9, 33],
                      seconds=[[3.0, 8.0], [9.0, 16.0]])
    assert upper.verify_seconds(1, 1) == pytest.approx(3.0) and upper.verify_seconds(2, 5) == pytest.approx(3.0)
    # a cost that falls past the grid's edge (noise) is held, never extrapolated downwards
    noisy = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=[1, 9], seconds=[[2.0, 1.0]])
    assert noisy.verify_seconds(1, 100) == pytest.approx(1.0)
    # a sparse grid: each batch size is interpolated over its own measured cells only
    sparse = CostModel(device="test", model="abc", batch_sizes=[1, 4], token_counts=[1, 3, 9],
                       seconds=[[1.0, None, 4.0], [2.0, 3.0, None]])
    assert sparse.verify_seconds(1, 3) == pytest.approx(2.0) and sparse.verify_seconds(4, 9) == pytest.approx(4.5)
    assert sparse.covers([1], [1, 9]) and not sparse.covers([1], [3])
    merged = sparse.merged(CostModel(device="test", model="abc", batch_sizes=[1], token_counts=[3], seconds=[[5.0]]))
    assert merged.seconds == [[1.0, 5.0, 4.0], [2.0, 3.0, None]]
    with pytest.raises(UserError, match="at least one measured"):
        CostModel(device="test", model="abc", batch_sizes=[1, 4], token_counts=[1], seconds=[[1.0], [None]])


def test_json_round_trip():
    cost = _hand_made_costs()
    assert CostModel.from_json(cost.to_json()) == cost


def test_batch_1_picks_a_large_budget_and_batch_16_a_small_one():
    cost = _hand_made_costs()
    taus = {8: 2.0, 16: 2.4, 32: 2.7, 64: 2.9, 128: 3.0}
    # batch 1: verify 1, 1, 1, 2, 4 ms -> 2000, 2400, 2700, 1450, 750 tokens/s: 32 wins
    chosen, rows = choose_budget(cost, 1, tau=taus)
    assert chosen == 32
    assert [r["budget"] for r in rows] == [8, 16, 32, 64, 128]
    assert [r["tokens_per_second"] for r in rows] == pytest.approx([2000, 2400, 2700, 1450, 750])
    assert [r["chosen"] for r in rows] == [False, False, True, False, False]
    # batch 16: verify 1.9, 2.7, 4.3, 7.5, 13.9 ms -> 16 * tau / s = 16842, 14222, 10047, 6187, 3453: 8 wins
    chosen, rows = choose_budget(cost, 16, tau=taus)
    assert chosen == 8
    assert [r["verify_seconds"] for r in rows] == pytest.approx([1.9e-3, 2.7e-3, 4.3e-3, 7.5e-3, 13.9e-3])
    assert rows[0]["tokens_per_second"] == pytest.approx(16 * 2.0 / 1.9e-3)
    table = format_budget_table(rows)
    assert len(table.splitlines()) == 6 and table.splitlines()[1].endswith("*")


def test_tau_forms_draft_time_and_ties():
    cost = _hand_made_costs()
    # a dict is interpolated in log2(budget) and held at its ends
    _, rows = choose_budget(cost, 1, budgets=(4, 16, 64), tau={8: 2.0, 32: 3.0})
    assert [r["tau"] for r in rows] == pytest.approx([2.0, 2.5, 3.0])
    # a gain or nothing: the placeholder model
    _, rows = choose_budget(cost, 1, budgets=(15,), tau=0.5)
    assert rows[0]["tau"] == pytest.approx(1 + 0.5 * 4) == pytest.approx(tau_model(15, 0.5))
    _, rows = choose_budget(cost, 1, budgets=(15,))
    assert rows[0]["tau"] == pytest.approx(tau_model(15)) == pytest.approx(1 + budget.DEFAULT_TAU_GAIN * 4)
    # equal throughput everywhere (flat cost, constant tau): the smallest budget
    assert choose_budget(cost, 1, budgets=(32, 8, 16), tau=lambda b: 2.0)[0] == 8
    # drafting at 0.1 ms per node pushes batch 1 from 32 down to 8: 2.0 / 1.8 ms > 2.4 / 2.6 ms > 2.7 / 4.2 ms
    chosen, rows = choose_budget(cost, 1, tau={8: 2.0, 16: 2.4, 32: 2.7, 64: 2.9, 128: 3.0},
                                 draft_seconds=lambda b, n: 1e-4 * n)
    assert chosen == 8
    assert [r["tokens_per_second"] for r in rows[:3]] == pytest.approx([2.0 / 1.8e-3, 2.4 / 2.6e-3, 2.7 / 4.2e-3])


def test_budget_0_is_plain_decoding():
    """Budget 0 is plain decoding (tau 1, no drafting, one token verified): chosen when no budget beats it."""
    cost = _hand_made_costs()
    chosen, rows = choose_budget(cost, 16, budgets=(0, 8, 16), tau={8: 1.2, 16: 1.3}, draft_seconds=lambda b, n: 1e-3)
    assert rows[0]["budget"] == 0 and rows[0]["tau"] == 1.0
    assert rows[0]["tokens_per_second"] == pytest.approx(16 / cost.verify_seconds(16, 1))
    assert chosen == 0 and rows[0]["chosen"]
    assert choose_budget(cost, 1, budgets=(0, 8, 16), tau={8: 2.0, 16: 2.4})[0] == 16


def test_user_errors():
    cost = _hand_made_costs()
    with pytest.raises(UserError, match="batch size"):
        choose_budget(cost, 0)
    with pytest.raises(UserError, match="budgets"):
        choose_budget(cost, 1, budgets=())
    with pytest.raises(UserError, match="budgets"):
        choose_budget(cost, 1, budgets=(8, -1))
    with pytest.raises(UserError, match="taus are empty"):
        choose_budget(cost, 1, tau={})
    with pytest.raises(UserError, match="tau must be"):
        choose_budget(cost, 1, tau="fast")
    with pytest.raises(UserError, match="batch >= 1"):
        cost.verify_seconds(0, 9)
    with pytest.raises(UserError, match="ascending"):
        CostModel(device="test", model="abc", batch_sizes=[4, 1], token_counts=[1], seconds=[[1.0], [1.0]])
    with pytest.raises(UserError, match="grid"):
        CostModel(device="test", model="abc", batch_sizes=[1], token_counts=[1, 9], seconds=[[1.0]])
    with pytest.raises(UserError, match="positive"):
        CostModel(device="test", model="abc", batch_sizes=[1], token_counts=[1], seconds=[[0.0]])


def test_measure_cache_reuse_and_corrupt_cache(tiny_llama3, tmp_path, monkeypatch, capsys):
    _, model, _ = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    grid = dict(batch_sizes=(1, 2), token_counts=(1, 3), context=8, repeats=1)
    path = cost_model_path(model)
    assert path.startswith(str(tmp_path / "cache")) and model.fingerprint() in os.path.basename(path)

    cost = load_or_measure_cost_model(model, progress=False, **grid)
    assert os.path.isfile(path) and path in capsys.readouterr().err
    assert cost.batch_sizes == [1, 2] and cost.token_counts == [1, 3] and cost.context == 8
    assert cost.model == model.fingerprint() and all(s > 0 for row in cost.seconds for s in row)
    assert CostModel.load(path) == cost

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the cache holds the model")

    with monkeypatch.context() as m:
        m.setattr(budget, "measure_cost_model", no_measuring)
        assert load_or_measure_cost_model(model, progress=False, **grid) == cost
        assert load_or_measure_cost_model(model, progress=False, batch_sizes=(2,), token_counts=(3,), context=8) == cost

    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return measure_cost_model(*args, **kwargs)

    monkeypatch.setattr(budget, "measure_cost_model", counting)
    with open(path, "w") as f:
        f.write("{not json")
    again = load_or_measure_cost_model(model, progress=False, **grid)
    assert len(calls) == 1 and "unreadable" in capsys.readouterr().err
    assert again.token_counts == [1, 3] and json.load(open(path))["model"] == model.fingerprint()
    # cells the cache lacks are measured, and only they (each compiles a program); the file keeps both
    bigger = load_or_measure_cost_model(model, progress=False, **{**grid, "batch_sizes": (2,), "token_counts": (1, 5)})
    assert len(calls) == 2 and calls[1]["skip"] == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert bigger.token_counts == [1, 3, 5] and bigger.covers([1, 2], [1, 3]) and bigger.covers([2], [5])
    assert not bigger.covers([1], [5]) and bigger.seconds[0][2] is None
    assert bigger.seconds[1][:2] == again.seconds[1] and CostModel.load(path) == bigger
    assert bigger.verify_seconds(1, 5) > 0  # batch 1 interpolated over its own measured cells
    # a cost model timed on another version of the forward (a faster layout since) is not used: timed afresh
    budget.forward_code_digest.cache_clear()
    monkeypatch.setattr(budget, "FORWARD_MODULES", (*budget.FORWARD_MODULES, "speculative"))
    assert cost_model_path(model) != path
    load_or_measure_cost_model(model, progress=False, **grid)
    assert len(calls) == 3 and calls[2]["skip"] == frozenset()
    budget.forward_code_digest.cache_clear()


# ---------------------------------------------------------------------------------------------- EAGLE tree shapes


def test_expected_tokens_per_round_on_hand_made_ranks():
    from jaxspec.budget import TreeShape, expected_tokens_per_round

    big = 1 << 30
    ranks = np.array([[0, 0, 1], [0, 2, 0], [3, 0, 0], [0, 0, 0], [1, big, 0]])  # [P, 3]
    # chain of d: drafts kept = leading zeros, at most d
    assert expected_tokens_per_round(ranks, TreeShape(1, 1, 1)) == pytest.approx(1 + 3 / 5)
    assert expected_tokens_per_round(ranks, TreeShape(2, 1, 2)) == pytest.approx(1 + (2 + 1 + 0 + 2 + 0) / 5)
    assert expected_tokens_per_round(ranks, TreeShape(3, 1, 3)) == pytest.approx(1 + (2 + 1 + 0 + 3 + 0) / 5)
    # full depth-2 trees: ranks below top_k at both depths
    assert expected_tokens_per_round(ranks, TreeShape(2, 2, 6)) == pytest.approx(1 + (2 + 1 + 0 + 2 + 1) / 5)
    assert expected_tokens_per_round(ranks, TreeShape(2, 4, 20)) == pytest.approx(1 + (2 + 2 + 2 + 2 + 1) / 5)
    assert expected_tokens_per_round(ranks, TreeShape(1, 2, 2)) == pytest.approx(1 + 4 / 5)
    with pytest.raises(UserError, match="not modelled"):
        expected_tokens_per_round(ranks, TreeShape(3, 2, 8))  # EAGLE-2 prunes depth 3: not exact, refused
    with pytest.raises(UserError, match="do not cover depth"):
        expected_tokens_per_round(ranks, TreeShape(4, 1, 4))
    with pytest.raises(UserError, match="do not cover"):
        expected_tokens_per_round(np.zeros((0, 3), int), TreeShape(1, 1, 1))
    # a prompt-lookup chain merged in: each position keeps the longer of the head's run and the lookup's (capped)
    runs = np.array([0, 4, 1, 0, 2])  # [P]
    assert expected_tokens_per_round(ranks, TreeShape(2, 1, 2, 3), runs) == pytest.approx(1 + (2 + 3 + 1 + 2 + 2) / 5)
    assert expected_tokens_per_round(ranks, TreeShape(1, 1, 1, 1), runs) == pytest.approx(1 + (1 + 1 + 1 + 1 + 1) / 5)
    with pytest.raises(UserError, match="lookup runs"):
        expected_tokens_per_round(ranks, TreeShape(2, 1, 2, 3))


def test_choose_tree_picks_the_argmax_of_its_own_throughput_model():
    """On hand-made costs and ranks: the chosen shape is the one whose batch * tau / (verify + draft) is highest,
    computed here independently; a device where extra tokens are free picks a wide tree, one where every token
    costs picks a short chain."""
    from jaxspec.budget import TREE_SHAPES, choose_tree, format_tree_table

    rng = np.random.default_rng(0)
    ranks = np.minimum(rng.geometric(0.55, size=(400, 6)) - 1, 9)  # rank 0 with p 0.55, then rarer
    counts = [1, 2, 3, 4, 5, 6, 7, 13, 21]

    def draft(rows, shape):
        return 1e-4 * shape.depth

    head_only = [s for s in TREE_SHAPES if not s.lookup]
    for per_token, expect_wide in ((0.0, True), (1.0, False)):  # ms per extra token on top of 10 ms
        cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                         seconds=[[1e-2 + 1e-3 * per_token * (t - 1) for t in counts]])
        shape, rows = choose_tree(cost, 1, ranks, draft)  # no lookup runs: the head's shapes only
        by_hand = []
        for s in head_only:
            inside = ranks[:, : s.depth] < s.top_k
            tau = 1 + np.cumprod(inside, axis=1).sum(axis=1).mean()
            by_hand.append(tau / (1e-2 + 1e-3 * per_token * s.num_nodes + 1e-4 * s.depth))
        assert shape == head_only[int(np.argmax(by_hand))]
        assert [r["tokens_per_second"] for r in rows] == pytest.approx(by_hand)
        assert sum(r["chosen"] for r in rows) == 1 and rows[int(np.argmax(by_hand))]["chosen"]
        assert (shape.top_k > 1) == expect_wide and (expect_wide or shape.depth <= 3)
        assert "*" in format_tree_table(rows)
    # with lookup runs: every shape, a merged chain keeping the longer run; text that repeats itself (long runs)
    # makes a lookup shape the best on a device where every token costs
    runs = np.where(rng.random(400) < 0.5, 5, 0)  # [P]
    cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                     seconds=[[1e-2 + 1e-3 * (t - 1) for t in counts]])
    shape, rows = choose_tree(cost, 1, ranks, draft, lookup_runs=runs)
    by_hand = []
    for s in TREE_SHAPES:
        kept = np.cumprod(ranks[:, : s.depth] < s.top_k, axis=1).sum(axis=1)
        tau = 1 + np.maximum(kept, np.minimum(runs, s.lookup)).mean()
        # verified tokens between measured counts: the cost model's own (log-log) interpolation
        by_hand.append(tau / (cost.verify_seconds(1, s.num_nodes + s.lookup + 1) + 1e-4 * s.depth))
    assert [r["tokens_per_second"] for r in rows] == pytest.approx(by_hand)
    assert shape == TREE_SHAPES[int(np.argmax(by_hand))] and shape.lookup > 0
    assert " lookup " in format_tree_table(rows).splitlines()[0]
    # with the chain's valid lengths: where it is short of a shape's chain, the slots past its end hold the head's
    # next-ranked first tokens, so a first draft ranked below top_k plus those slots is kept as well
    valid = np.where(runs > 0, 12, rng.integers(0, 4, 400))  # [P]: no match (0) or a short one where nothing kept
    shape, rows = choose_tree(cost, 1, ranks, draft, lookup_runs=runs, lookup_valid=valid)
    by_hand = []
    for s in TREE_SHAPES:
        kept = np.cumprod(ranks[:, : s.depth] < s.top_k, axis=1).sum(axis=1)
        if s.lookup:
            spare_slots = s.lookup - np.minimum(valid, s.lookup)
            kept = np.maximum(np.maximum(kept, ranks[:, 0] < s.top_k + spare_slots), np.minimum(runs, s.lookup))
        by_hand.append((1 + kept.mean()) / (cost.verify_seconds(1, s.num_nodes + s.lookup + 1) + 1e-4 * s.depth))
    assert [r["tokens_per_second"] for r in rows] == pytest.approx(by_hand)
    assert shape == TREE_SHAPES[int(np.argmax(by_hand))]
    credited = [r["tau"] for r in rows if r["shape"].lookup]
    uncredited = [r["tau"] for r in choose_tree(cost, 1, ranks, draft, lookup_runs=runs)[1] if r["shape"].lookup]
    assert all(a >= b for a, b in zip(credited, uncredited)) and sum(credited) > sum(uncredited) + 0.5
    with pytest.raises(UserError, match="batch size"):
        choose_tree(cost, 0, ranks, draft)


def test_eagle_draft_seconds_costs_each_head_matrix_at_the_targets_seconds_per_weight():
    """A round's drafting, by hand: the layer and fusion over the last round's pairs, the LM head on the root, and
    per further depth the layer and LM head over the frontier, each at verify_seconds(tokens) / target weights."""
    from jaxspec.budget import TreeShape, eagle_draft_seconds

    counts = [1, 2, 3, 4, 5, 7, 13, 21]
    cost = CostModel(device="test", model="abc", batch_sizes=[1, 4], token_counts=counts,
                     seconds=[[0.03 + 0.005 * (t - 1) for t in counts], [0.05 + 0.02 * (t - 1) for t in counts]])
    work = dict(target_work=1000, layer_work=40, fuse_work=10, vocab_work=50)
    per_weight = {1: {t: (0.03 + 0.005 * (t - 1)) / 1000 for t in counts},
                  4: {t: (0.05 + 0.02 * (t - 1)) / 1000 for t in counts}}
    for batch in (1, 4):
        w = per_weight[batch]
        chain1 = eagle_draft_seconds(cost, batch, TreeShape(1, 1, 1), **work)
        assert chain1 == pytest.approx(50 * w[2] + 50 * w[1])  # absorb 2 pairs, LM head on the root
        chain3 = eagle_draft_seconds(cost, batch, TreeShape(3, 1, 3), **work)
        assert chain3 == pytest.approx(50 * w[4] + 50 * w[1] + 2 * 90 * w[1])
        tree = eagle_draft_seconds(cost, batch, TreeShape(2, 3, 12), **work)
        assert tree == pytest.approx(50 * w[13] + 50 * w[1] + 90 * w[3])
        lookup = eagle_draft_seconds(cost, batch, TreeShape(1, 1, 1, 3), **work)  # 4 verified nodes: 5 pairs
        assert lookup == pytest.approx(50 * w[5] + 50 * w[1])
    # the same round costs more where each token costs more (batch 4 here)
    assert eagle_draft_seconds(cost, 4, TreeShape(2, 1, 2), **work) > eagle_draft_seconds(cost, 1, TreeShape(2, 1, 2),
                                                                                             **work)


def test_sampled_rounds_follow_the_target_mass_of_the_candidates():
    """At T > 0 (`draft_mass` given) a shape's tau is 1 + the mean over positions of the sum over depths of the
    product of its levels' top_k masses (a chain: top-1 masses; a full depth-2 tree: m1 + m1 m2), the lookup shapes
    are left out without sampled text, and the chooser takes the argmax of throughput under that model: on a device
    where extra tokens are free, a wide tree (the target spreads its probability over the head's top candidates);
    where each costs as much as a step, the cheapest useful round."""
    from jaxspec.budget import TREE_SHAPES, TreeShape, choose_tree, expected_tokens_sampled

    rng = np.random.default_rng(1)
    top1 = rng.uniform(0.1, 0.5, (300, 6))  # [P, D]
    mass = np.cumsum(np.stack([top1] + [top1 * 0.6 ** k for k in range(1, 4)], axis=2), axis=2)  # [P, D, 4]
    ranks = np.zeros((300, 6), np.int64)  # at T=0 every draft would be kept: the sampled model must not use them
    assert expected_tokens_sampled(mass, TreeShape(3, 1, 3)) == pytest.approx(
        1 + np.mean(top1[:, 0] + top1[:, 0] * top1[:, 1] + top1[:, 0] * top1[:, 1] * top1[:, 2]))
    assert expected_tokens_sampled(mass, TreeShape(2, 3, 12)) == pytest.approx(
        1 + np.mean(mass[:, 0, 2] + mass[:, 0, 2] * mass[:, 1, 2]))
    assert expected_tokens_sampled(mass, TreeShape(1, 2, 2)) == pytest.approx(1 + np.mean(mass[:, 0, 1]))
    with pytest.raises(UserError, match="sampled text"):
        expected_tokens_sampled(mass, TreeShape(2, 1, 2, 3))
    with pytest.raises(UserError, match="neither a chain nor a full"):
        expected_tokens_sampled(mass, TreeShape(2, 2, 4))
    counts = [1, 2, 3, 4, 5, 7, 13, 21]

    def draft(rows, shape):
        return 1e-4 * shape.depth

    runs = np.full(300, 5)  # [P]: greedy lookup runs, which a sampled round's model must not use
    for per_token, expect_wide in ((0.0, True), (10.0, False)):  # ms per extra token on top of 10 ms
        cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                         seconds=[[1e-2 + 1e-3 * per_token * (t - 1) for t in counts]])
        shape, rows = choose_tree(cost, 1, ranks, draft, lookup_runs=runs, draft_mass=mass)
        head_only = [s for s in TREE_SHAPES if not s.lookup]
        assert [r["shape"] for r in rows] == head_only
        by_hand = [expected_tokens_sampled(mass, s) / (cost.verify_seconds(1, s.num_nodes + 1) + 1e-4 * s.depth)
                   for s in head_only]
        assert [r["tokens_per_second"] for r in rows] == pytest.approx(by_hand)
        assert shape == head_only[int(np.argmax(by_hand))]
        assert (shape.top_k > 1) == expect_wide and (expect_wide or shape.num_nodes <= 2)


def test_sampled_rounds_merge_a_lookup_chain_by_what_it_adds_along_sampled_text():
    """At T > 0 a shape with a prompt-lookup chain has the head's tau from the masses plus what merging the chain
    adds along the sampled text (`SampledText`: each position keeps the longer of the head's run and the chain's;
    the chain's empty slots hold the head's next-ranked first tokens), and the chooser weighs those shapes too."""
    from jaxspec.budget import SampledText, TreeShape, choose_tree, expected_tokens_sampled

    mass = np.zeros((4, 6, 4))  # [P, D, K]
    mass[:, :, 0] = 0.5  # the head's top-1 at every level: half the target's mass
    mass[:, :, 1:] = 0.6
    # along the sampled text: the head's ranks, the chain's runs and its valid tokens at the same 4 positions
    ranks = np.array([[0, 0, 5, 5, 5, 5], [1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0], [9, 9, 9, 9, 9, 9]])  # [P, D]
    text = SampledText(ranks=ranks, lookup_runs=np.array([1, 3, 0, 0]), lookup_valid=np.array([3, 3, 0, 1]))
    chain2 = TreeShape(2, 1, 2)
    head_tau = 1 + 0.5 + 0.25
    assert expected_tokens_sampled(mass, chain2, text) == pytest.approx(head_tau)  # no chain: the masses alone
    # the head's chain of 2 along the text keeps 2, 0, 0, 0 (mean 0.5); merged with a lookup chain of 3: 2 (the
    # head's run is the longer), 3 (the chain's), 1 (no chain: its 3 slots hold the head's ranks 1-3, rank 2 kept),
    # 0 (2 empty slots: ranks 1-2, not 9)
    merged = np.mean([2, 3, 1, 0])
    assert expected_tokens_sampled(mass, TreeShape(2, 1, 2, 3), text) == pytest.approx(head_tau + merged - 0.5)
    with pytest.raises(UserError, match="positions"):
        expected_tokens_sampled(mass[:2], TreeShape(2, 1, 2, 3), text)
    counts = [1, 2, 3, 4, 5, 7, 13, 21]
    cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                     seconds=[[1e-2 + 1e-4 * (t - 1) for t in counts]])  # extra tokens nearly free

    def draft(rows, shape):
        return 1e-4 * shape.depth

    greedy_ranks = np.zeros((4, 6), np.int64)
    shape, rows = choose_tree(cost, 1, greedy_ranks, draft, lookup_runs=np.zeros(4, int), draft_mass=mass,
                              sampled_text=text)
    taus = {r["shape"]: r["tau"] for r in rows}
    assert any(s.lookup for s in taus) and shape == max(rows, key=lambda r: r["tokens_per_second"])["shape"]
    assert taus[TreeShape(2, 1, 2, 3)] == pytest.approx(head_tau + merged - 0.5)
    without = choose_tree(cost, 1, greedy_ranks, draft, lookup_runs=np.zeros(4, int), draft_mass=mass)[1]
    assert not any(r["shape"].lookup for r in without)  # no sampled text: the lookup shapes are left out


def test_compilation_cache_folder_follows_the_settings(tmp_path):
    """`enable_compilation_cache` in fresh processes (it changes a process-wide JAX option): the jaxspec cache folder
    by default, a folder the user gave JAX kept, off with JAXSPEC_COMPILATION_CACHE=0; and a program compiled once
    is written there."""
    import subprocess
    import sys

    script = ("import jax, jax.numpy as jnp; from jaxspec.budget import enable_compilation_cache; "
              "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
              "folder = enable_compilation_cache(); jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready();"
              "print(folder)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXSPEC_COMPILATION_CACHE")}

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    ours = str(tmp_path / "jaxspec")
    assert run(JAXSPEC_CACHE_DIR=ours) == os.path.join(ours, "xla")
    assert os.listdir(os.path.join(ours, "xla")), "nothing was written to the compilation cache"
    theirs = str(tmp_path / "theirs")
    assert run(JAXSPEC_CACHE_DIR=ours, JAX_COMPILATION_CACHE_DIR=theirs) == theirs
    assert run(JAXSPEC_CACHE_DIR=str(tmp_path / "off"), JAXSPEC_COMPILATION_CACHE="0") == "None"
    assert not os.path.exists(tmp_path / "off" / "xla")


def test_measure_times_the_layout_the_decoding_loops_run(tiny_llama3, monkeypatch):
    """Per-layer weights are timed over a per-layer cache (the in-place path the loops take; a stacked cache sent
    them down another path that cost a third more)."""
    from jaxspec.model import layers_layout

    _, model, _ = tiny_llama3
    seen = []
    real = budget._verification_jit

    def recording(weights, cfg, cache, root, tree, sampled=False):
        seen.append((isinstance(weights.layers, tuple), cache.per_layer, tree.tokens.shape[1]))
        return real(weights, cfg, cache, root, tree, sampled)

    monkeypatch.setattr(budget, "_verification_jit", recording)
    for layout in ("stacked", "unstacked"):
        seen.clear()
        with layers_layout(layout):
            cost = measure_cost_model(model, batch_sizes=(1,), token_counts=(1, 3), context=8, repeats=1,
                                      progress=False)
        per_layer = layout == "unstacked"
        assert set(seen) == {(per_layer, per_layer, 0), (per_layer, per_layer, 2)}
        assert cost.device.endswith(("-unstacked-float32" if per_layer else "cpu-float32"))


def test_the_sampled_cost_model_times_rounds_that_draw_their_tokens(tiny_llama3, tmp_path, monkeypatch):
    """`sampled=True` times every shape as a round at a temperature runs it (Gumbel noise over the vocabulary at
    every verified row, plain decoding's step included), under its own device name and cache file: a greedy cost
    model is never served for a sampled one, nor the other way round."""
    _, model, _ = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    seen = []
    real = budget._verification_jit

    def recording(weights, cfg, cache, root, tree, sampled=False):
        seen.append((tree.tokens.shape[1], sampled))
        return real(weights, cfg, cache, root, tree, sampled)

    monkeypatch.setattr(budget, "_verification_jit", recording)
    grid = dict(batch_sizes=(1,), token_counts=(1, 3), context=8, repeats=1)
    sampled = load_or_measure_cost_model(model, progress=False, sampled=True, **grid)
    assert set(seen) == {(0, True), (2, True)} and sampled.device.endswith("-sampled")
    assert cost_model_path(model, sampled=True) != cost_model_path(model)
    assert os.path.isfile(cost_model_path(model, sampled=True)) and not os.path.exists(cost_model_path(model))
    seen.clear()
    greedy = load_or_measure_cost_model(model, progress=False, **grid)  # measured afresh, not the sampled file
    assert set(seen) == {(0, False), (2, False)} and not greedy.device.endswith("-sampled")
    seen.clear()
    assert load_or_measure_cost_model(model, progress=False, sampled=True, **grid) == sampled and not seen
    # the sampled forward draws: its tokens are the argmax of the logits plus temperature-1 Gumbel noise
    from jaxspec.cache import init_cache
    from jaxspec.model import forward
    from jaxspec.sampling import SamplingConfig, gumbel_noise
    from jaxspec.tree import DraftTree

    weights, cfg = model.weights, model.config
    tree = DraftTree(tokens=jnp.array([[4, 7]], jnp.int32), parents=jnp.array([[-1, 0]], jnp.int32),
                     valid=jnp.ones((1, 2), jnp.bool_))
    drawn, _ = real(weights, cfg, init_cache(cfg, 1, 16), jnp.array([3], jnp.int32), tree, True)  # [1, 3]
    logits = forward(weights, cfg, jnp.array([[3, 4, 7]]), jnp.arange(3)[None], init_cache(cfg, 1, 16)).logits
    noise = gumbel_noise(jax.random.key(0), (1, 3, cfg.vocab_size), SamplingConfig(temperature=1.0))
    assert np.array_equal(np.asarray(drawn), np.asarray(jnp.argmax(logits + noise, -1)))
    assert not np.array_equal(np.asarray(drawn), np.asarray(jnp.argmax(logits, -1)))  # the noise decided somewhere


def test_chosen_layout_is_measured_once_per_batch_size_and_cached(tiny_llama3, tmp_path, monkeypatch, capsys):
    """The commands' default CPU layout: the one whose decoding step is faster here, timed once per device, target,
    batch size and forward version, then read from the cache; an explicit choice or $JAXSPEC_LAYERS wins."""
    from jaxspec.budget import chosen_layout

    generate_module = importlib.import_module("jaxspec.generate")  # the module (jaxspec.generate is also a function)
    from jaxspec.model import LAYERS_ENV

    _, model, _ = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    calls = []

    def fake_fastest(weights, cfg, batch_size, cache_size, *args, **kwargs):
        calls.append(batch_size)
        return "unstacked", {"stacked": 0.041, "unstacked": 0.028}

    monkeypatch.setattr(generate_module, "fastest_layout", fake_fastest)
    assert chosen_layout(model, 1, "stacked") == ("stacked", "") and not calls
    layout, why = chosen_layout(model, 1)
    assert layout == "unstacked" and calls == [1] and "stacked 41.0 ms, unstacked 28.0 ms" in why
    assert chosen_layout(model, 1, "auto")[0] == "unstacked" and calls == [1]  # read back from the cache
    assert chosen_layout(model, 4)[0] == "unstacked" and calls == [1, 4]  # another batch size: timed
    path = why.split("cached in ")[1].split(";")[0]
    assert os.path.isfile(path) and set(json.load(open(path))) == {"1", "4"}
    monkeypatch.setenv(LAYERS_ENV, "stacked")
    assert chosen_layout(model, 1) == ("stacked", "")
    assert chosen_layout(model, 1, "auto")[0] == "unstacked"  # asked for: the measured choice
    with open(path, "w") as f:
        f.write("[not an object")
    assert chosen_layout(model, 1, "auto")[0] == "unstacked" and calls == [1, 4, 1]
    assert "unreadable" in capsys.readouterr().err
    with pytest.raises(UserError, match="auto, stacked or unstacked"):
        chosen_layout(model, 1, "scanned")


def test_a_draft_models_chain_is_sized_by_the_argmax_of_its_throughput_model():
    """A draft model's chain of K costs one draft forward over 2 tokens and K - 1 over one (each at the target's
    seconds per weight times the draft model's weights), plus the verification of K + 1 tokens; its tau is 1 + the
    mean of min(run, K) over the measured positions. By hand, on a cost model where a token of verification is
    cheap (long chains pay) and on one where it is dear (plain decoding wins)."""
    from jaxspec.budget import CHAIN_SHAPES, PLAIN, TreeShape, choose_tree, draft_model_seconds

    counts = [1, 2, 3, 4, 5, 7, 9, 11]
    runs = np.array([0, 1, 2, 3, 5, 8, 10, 10, 10, 4])  # [P]: how many leading drafts the target keeps at each root
    ranks = np.where(np.arange(10)[None, :] < runs[:, None], 0, 3)  # [P, 10]: rank 0 while kept, then a miss
    for per_token, expected_depth in ((0.02, None), (1.5, PLAIN)):
        cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                         seconds=[[0.1 * (1 + per_token * (t - 1)) for t in counts]])
        work = dict(target_work=1000, draft_work=100)  # a draft model of a tenth of the target's weights

        def draft_seconds(rows, shape, work=work, cost=cost):
            return draft_model_seconds(cost, rows, shape, **work)

        shape, rows = choose_tree(cost, 1, ranks, draft_seconds, shapes=CHAIN_SHAPES)
        by_hand = {}
        for k in range(0, 11):
            tau = 1 + np.minimum(runs, k).mean()
            draft = 0.0 if k == 0 else 100 / 1000 * (cost.verify_seconds(1, 2) + (k - 1) * cost.verify_seconds(1, 1))
            by_hand[k] = tau / (cost.verify_seconds(1, k + 1) + draft)
        assert [r["tokens_per_second"] for r in rows] == pytest.approx([by_hand[k] for k in range(11)])
        best = max(by_hand, key=by_hand.get)
        assert shape == (TreeShape(best, 1, best) if best else PLAIN)
        if expected_depth is PLAIN:
            assert shape == PLAIN
        else:
            assert shape.depth >= 5  # cheap verification and a tenth-size draft model: a long chain
    assert draft_model_seconds(cost, 1, PLAIN, target_work=1000, draft_work=100) == 0.0
