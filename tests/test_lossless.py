"""Exactness of speculative sampling, computed, not sampled.

A tiny target and a tiny draft model over a 4-token vocabulary. For every possible draft tree (its tokens
enumerated, weighted by their draft probabilities q) the real `accept` is evaluated on a grid of uniforms whose
cells follow the rule's breakpoints (acceptance thresholds and the bonus CDF), each cell weighted by its volume.
That gives the exact distribution of the round's emitted block. Extending every block with the target's own
continuation up to a fixed horizon must give exactly the target's distribution over sequences, p(y_1..y_H).
A deliberately broken rule (resampling the bonus from p instead of the residual) must fail the same check.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import verification
from jaxspec.cache import init_cache
from jaxspec.config import ModelConfig
from jaxspec.generate import prefill
from jaxspec.model import forward, init_weights
from jaxspec.sampling import SamplingConfig, target_probs
from jaxspec.tree import DraftTree, ancestor_mask, chain_parents, choices_parents, node_depths

V = 4
CFG = ModelConfig(architecture="llama", vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
TARGET = init_weights(CFG, jax.random.key(1), scale=0.8)
DRAFT = init_weights(CFG, jax.random.key(2), scale=0.8)
CONTEXT = [1, 3, 0, 2]  # the last token is the round's root

# (name, parents, how each node is drafted): "sampled" = drawn from q at its parent (siblings independently);
# an int r = the rank-r token of q at its parent (deterministic children, q = point mass).
TREES = [
    ("chain of 2, sampled", [-1, 0], ["sampled", "sampled"]),
    ("tree, sampled siblings", [-1, -1, 0], ["sampled", "sampled", "sampled"]),
    ("tree, top-k children", [-1, -1, 0], [0, 1, 0]),
]
SAMPLINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=3),
    SamplingConfig(temperature=1.3, top_p=0.75),
    SamplingConfig(),  # greedy: a point mass on the greedy continuation
]


# The model parts run jitted (one compilation per shape, shared by every case); run eagerly, each call compiled its
# operations one by one. The acceptance rule is jitted afresh per call (`_block_distribution`), so that a rule
# broken by monkeypatch in a test below is traced again, never served from a cache.
@jax.jit
def _probs_jit(weights, ids, sampling):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)  # [N, len]
    return target_probs(forward(weights, CFG, ids, positions).logits, sampling)  # [N, len, V]


def _probs(weights, sequences, sampling):
    """Processed next-token distributions after every prefix: float64[N, len, V]."""
    return np.asarray(_probs_jit(weights, jnp.asarray(sequences, jnp.int32), sampling), np.float64)


@jax.jit
def _node_probs_jit(tokens, parents, sampling):
    """The target's p at the root and every node of each row's tree after CONTEXT: [N, T + 1, V]."""
    n, t = tokens.shape
    cache = init_cache(CFG, n, 16)
    ctx = jnp.asarray([CONTEXT[:-1]] * n, jnp.int32)  # [N, 3]
    _, _, cache = prefill(TARGET, CFG, ctx, jnp.full((n,), len(CONTEXT) - 1, jnp.int32), cache)
    tree = DraftTree(tokens=tokens, parents=parents, valid=jnp.ones((n, t), bool))
    logits = verification.verify_forward(TARGET, CFG, cache, jnp.full((n,), CONTEXT[-1], jnp.int32), tree).logits
    return target_probs(logits, sampling)


def _target_sequence_table(horizon, sampling):
    """p(y_1..y_m | CONTEXT) for every y in V^horizon and every m: dict m -> {prefix tuple: prob}."""
    seqs = list(itertools.product(range(V), repeat=horizon))
    probs = _probs(TARGET, [CONTEXT + list(y) for y in seqs], sampling)
    table = {0: {(): 1.0}}
    for m in range(1, horizon + 1):
        table[m] = {}
        for y, row in zip(seqs, probs):
            prefix_prob = table[m - 1][y[: m - 1]] * row[len(CONTEXT) - 2 + m, y[m - 1]]
            table[m][y[:m]] = prefix_prob
    return table


def _draft_outcomes(parents, kinds, sampling):
    """Every possible draft tree with its probability: list of (tokens, q rows or None, probability)."""
    t = len(parents)
    outcomes = [((), (), 1.0)]
    for j in range(t):
        grown = []
        for tokens, qs, prob in outcomes:
            path, node = [], parents[j]
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            q = _probs(DRAFT, [CONTEXT + path[::-1]], sampling)[0, -1]
            if kinds[j] == "sampled":
                grown += [(tokens + (x,), qs + (q,), prob * q[x]) for x in range(V) if q[x] > 0]
            else:
                x = int(np.argsort(-q, kind="stable")[kinds[j]])
                grown.append((tokens + (x,), qs + (q,), prob))
        outcomes = grown
    deterministic = all(k != "sampled" for k in kinds)
    return [(np.array(tok), None if deterministic else np.stack(qs), prob) for tok, qs, prob in outcomes]


def _breakpoints(tokens, parents, q, p):
    """Where the rule's outcome can change: acceptance thresholds per node, and the bonus CDF values."""
    t = len(tokens)
    thresholds = [set() for _ in range(t)]
    bonus = set()

    def walk(j, current, residual):
        if j == t:
            bonus.update(np.cumsum(residual) / residual.sum())
            return
        if parents[j] + 1 != current:
            return walk(j + 1, current, residual)
        qj = q[j] if q is not None else np.eye(V)[tokens[j]]
        x = tokens[j]
        a = min(1.0, residual[x] / qj[x]) if qj[x] > 0 else 0.0
        thresholds[j].add(a)
        if a > 0:
            walk(j + 1, j + 1, p[j + 1])
        if a < 1:
            left = np.maximum(residual - qj, 0)
            walk(j + 1, current, left / left.sum() if left.sum() > 0 else residual)

    walk(0, 0, p[0])
    return thresholds, bonus


def _cells(points):
    """Midpoints and widths of the intervals of [0, 1) cut at `points`."""
    edges = np.array(sorted({0.0, 1.0} | {float(x) for x in points if 0 < x < 1}))
    return (edges[:-1] + edges[1:]) / 2, np.diff(edges)


def _bucket(n: int) -> int:
    """n rounded up to a power of two (at least 8): the eager ops below compile once per shape, so padded row counts
    let the cases share their compilations."""
    return max(8, 1 << (n - 1).bit_length())


def _block_distribution(parents, kinds, sampling, outcomes=None):
    """Exact distribution of the emitted block (accepted drafts + bonus) of one round: {tuple: prob}.
    outcomes: the possible drafts as (tokens, q rows or None, probability); default: enumerated from the draft model."""
    outcomes = _draft_outcomes(parents, kinds, sampling) if outcomes is None else outcomes
    t = len(parents)
    n = _bucket(len(outcomes))  # rows padded with copies of the first outcome (their results unused)
    # the target's distributions at the root and every node, by one verification forward per outcome
    drafted = [o[0] for o in outcomes]
    tokens = jnp.asarray(np.stack(drafted + drafted[:1] * (n - len(drafted))), jnp.int32)  # [n, T]
    parents_n = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (n, t))  # [n, T]
    p_all = np.asarray(_node_probs_jit(tokens, parents_n, sampling), np.float64)[: len(outcomes)]

    rows, weights, row_outcome = [], [], []
    for k, ((tokens, q, prob), p) in enumerate(zip(outcomes, p_all)):
        thresholds, bonus = _breakpoints(tokens, parents, q, p)
        grids = [_cells(s) for s in thresholds] + [_cells(bonus)]
        for cell in itertools.product(*[range(len(g[0])) for g in grids]):
            point = [grids[d][0][i] for d, i in enumerate(cell)]
            volume = np.prod([grids[d][1][i] for d, i in enumerate(cell)])
            rows.append((tokens, q, point))
            weights.append(prob * volume)
            row_outcome.append(k)
    real = len(rows)
    rows += rows[:1] * (_bucket(real) - real)  # padding rows of weight 0: few distinct shapes for the eager ops
    weights += [0.0] * (len(rows) - real)
    row_outcome += row_outcome[:1] * (len(rows) - real)
    m = len(rows)
    batch = DraftTree(
        tokens=jnp.asarray(np.stack([r[0] for r in rows]), jnp.int32),
        parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (m, t)),
        valid=jnp.ones((m, t), bool),
        draft_probs=None if rows[0][1] is None else jnp.asarray(np.stack([r[1] for r in rows]), jnp.float32),
    )
    points = np.array([r[2] for r in rows], np.float32)
    rule = jax.jit(lambda *args: verification.accept(*args))  # a new function: traced with the rule as it is now
    acc = rule(batch, jnp.asarray(p_all[row_outcome], jnp.float32), jnp.asarray(points[:, :t]),
               jnp.asarray(points[:, t]))
    blocks = {}
    for tokens, count, w in zip(np.asarray(acc.tokens), np.asarray(acc.num_accepted), weights):
        key = tuple(int(x) for x in tokens[: count + 1])
        blocks[key] = blocks.get(key, 0.0) + w
    return blocks


def _speculative_sequence_distribution(blocks, table, horizon):
    """Each block extended by the target's continuation: {y: prob} over V^horizon."""
    dist = {}
    for y, p_y in table[horizon].items():
        total = 0.0
        for block, w in blocks.items():
            m = len(block)
            if y[:m] == block:
                prefix = table[m][block]
                if prefix == 0:
                    if w > 1e-9:
                        return None  # the round emitted a block the target never would
                    continue
                total += w * p_y / prefix
        dist[y] = total
    return dist


def _check(parents, kinds, sampling, outcomes=None):
    depth = int(np.asarray(node_depths(jnp.asarray([parents], jnp.int32))).max())
    horizon = depth + 1
    table = _target_sequence_table(horizon, sampling)
    blocks = _block_distribution(parents, kinds, sampling, outcomes)
    assert abs(sum(blocks.values()) - 1) < 1e-6
    spec = _speculative_sequence_distribution(blocks, table, horizon)
    if spec is None:
        return np.inf
    return max(abs(spec[y] - table[horizon][y]) for y in table[horizon])


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("name,parents,kinds", TREES, ids=[t[0] for t in TREES])
def test_speculative_round_reproduces_the_target_distribution_exactly(name, parents, kinds, sampling):
    assert _check(parents, kinds, sampling) < 2e-6


@functools.partial(jax.jit, static_argnums=0)
def _first_round_tree(drafter, params, sampling):
    """The tree a drafter proposes in its first round after CONTEXT (the target prefilled on CONTEXT[:-1], the root
    CONTEXT[-1])."""
    from jaxspec.drafters import RoundInputs

    context = jnp.asarray([CONTEXT[:-1]], jnp.int32)  # [1, 3]
    lengths = jnp.array([len(CONTEXT) - 1], jnp.int32)
    _, out, cache = prefill(TARGET, CFG, context, lengths, init_cache(CFG, 1, 32), hidden_layers=drafter.target_layers)
    state = drafter.init(params, CFG, context, lengths, out, 32, sampling)
    history = jnp.zeros((1, 32), jnp.int32).at[0, : len(CONTEXT)].set(jnp.asarray(CONTEXT))
    inputs = RoundInputs(target_weights=TARGET, target_cache=cache, history=history, lengths=cache.lengths,
                         root=jnp.asarray([CONTEXT[-1]], jnp.int32))
    tree, _, _ = drafter.propose(params, state, inputs, CFG, sampling, jax.random.key(0))
    return tree


def _eagle3_tree(sampling):
    """The dynamic tree the real EAGLE-3 drafter (reduced draft vocabulary of 3 of the 4 tokens, fused target
    features, EAGLE-2 expansion and reranking) proposes after CONTEXT: (tokens [T], parents [T])."""
    from jaxspec.drafters.eagle import Eagle3Config

    mcfg = Eagle3Config(feature_layers=(0,), draft_vocab_size=3, depth=3, top_k=2, num_nodes=5, init_scale=0.8)
    mcfg = mcfg.for_target(CFG)
    params = mcfg.init_params(CFG, TARGET, jax.random.key(3), np.array([3, 9, 1, 5]))  # token 2 is never drafted
    drafter = mcfg.make_drafter()
    tree = _first_round_tree(drafter, params, sampling)
    assert tree.draft_probs is None  # deterministic top-k children: q is a point mass
    return np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]).tolist()


@pytest.mark.parametrize("sampling", SAMPLINGS[:3], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_eagle3_dynamic_tree_round_reproduces_the_target_distribution_exactly(sampling):
    """One round with the tree the EAGLE-3 drafter builds. The tree is a deterministic function of the committed
    text, so an exact round after every context makes the whole generation exact (induction over rounds)."""
    tokens, parents = _eagle3_tree(sampling)
    assert len(set(parents)) < len(parents) and max(node_depths(jnp.asarray([parents])).tolist()[0]) >= 2  # branches
    assert 2 not in tokens.tolist()  # only draft-vocabulary tokens
    assert _check(parents, None, sampling, outcomes=[(tokens, None, 1.0)]) < 2e-6


def _parallel_tree(mode, sampling):
    """The tree the real DDTree (bidirectional block head, best-first on marginals) or JetSpec (tree-causal head,
    best-first + one path-conditioned refresh) drafter proposes after CONTEXT: (tokens [T], parents [T])."""
    from jaxspec.drafters.block_head import ParallelHeadConfig

    attention = "tree_causal" if mode == "jetspec" else "bidirectional"
    mcfg = ParallelHeadConfig(attention=attention, feature_layers=(0,), draft_vocab_size=3, block_size=3, budget=5,
                              tree_width=2, refresh_steps=1, init_scale=0.8).for_target(CFG)
    params = mcfg.init_params(CFG, TARGET, jax.random.key(3), np.array([3, 9, 1, 5]))  # token 2 is never drafted
    drafter = mcfg.make_drafter(mode)
    tree = _first_round_tree(drafter, params, sampling)
    assert tree.draft_probs is None and bool(tree.valid.all())  # deterministic top-W children, no padding
    return np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]).tolist()


@pytest.mark.parametrize("mode", ["ddtree", "jetspec"])
@pytest.mark.parametrize("sampling", SAMPLINGS[:3], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_parallel_tree_round_reproduces_the_target_distribution_exactly(mode, sampling):
    """One round with the best-first tree a DDTree / JetSpec drafter builds, enumerated exactly (the tree is a
    deterministic function of the committed text, so exact rounds give an exact sequence by induction)."""
    tokens, parents = _parallel_tree(mode, sampling)
    assert len(set(parents)) < len(parents) and max(node_depths(jnp.asarray([parents])).tolist()[0]) >= 2  # branches
    assert 2 not in tokens.tolist()  # only draft-vocabulary tokens
    assert _check(parents, None, sampling, outcomes=[(tokens, None, 1.0)]) < 2e-6


def test_a_broken_rule_is_caught(monkeypatch):
    """Resampling from p after a rejection (instead of from norm(max(0, p - q))) biases the output."""
    name, parents, kinds = TREES[0]
    monkeypatch.setattr(verification, "residual_after_rejection", lambda residual, q, vocab_axis=None: residual)
    assert _check(parents, kinds, SamplingConfig(temperature=1.0)) > 1e-4  # the correct rule is within 2e-6


def test_ignoring_deterministic_rejections_is_caught(monkeypatch):
    """For top-k children, keeping a rejected token in the residual biases the output too."""
    name, parents, kinds = TREES[2]
    monkeypatch.setattr(verification, "residual_after_rejection", lambda residual, q, vocab_axis=None: residual)
    assert _check(parents, kinds, SamplingConfig(temperature=1.0)) > 1e-4  # the correct rule is within 2e-6


# ---------------------------------------------------------------------------------------------- masks


def test_ancestor_mask_of_a_small_tree_is_literal():
    """root -> a, b; a -> c; c -> d (verification indices: root 0, a 1, b 2, c 3, d 4)."""
    mask = np.asarray(ancestor_mask(jnp.asarray([[-1, -1, 0, 2]], jnp.int32)))[0].astype(int)
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(np.asarray(node_depths(jnp.asarray([[-1, -1, 0, 2]])))[0], [0, 1, 1, 2, 3])


@pytest.mark.parametrize("num_nodes", [1, 2, 3, 7, 8, 16, 64, 100])
def test_ancestor_mask_equals_walking_up_the_parents(num_nodes):
    """Random trees and the deepest one (a chain), against a plain walk from every node up to the root."""
    rng = np.random.default_rng(num_nodes)
    parents = np.array([[rng.integers(-1, j) for j in range(num_nodes)] for _ in range(4)]
                       + [chain_parents(num_nodes)], np.int32)  # [5, T]
    mask = np.asarray(ancestor_mask(jnp.asarray(parents)))  # [5, T+1, T+1]
    expected = np.zeros_like(mask)
    for row, tree in enumerate(parents):
        for i in range(num_nodes + 1):
            node = i
            expected[row, i, node] = True
            while node > 0:
                node = tree[node - 1] + 1
                expected[row, i, node] = True
    np.testing.assert_array_equal(mask, expected)


def test_chain_and_choices_topologies():
    np.testing.assert_array_equal(chain_parents(4), [-1, 0, 1, 2])
    mask = np.asarray(ancestor_mask(jnp.asarray([chain_parents(3)])))[0].astype(int)
    np.testing.assert_array_equal(mask, np.tril(np.ones((4, 4), int)))
    parents, ranks = choices_parents([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    np.testing.assert_array_equal(parents, [-1, -1, 0, 0, 1])
    np.testing.assert_array_equal(ranks, [0, 1, 0, 1, 0])


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_acceptance_equals_the_rule_on_point_masses(with_q):
    """`accept_greedy` (argmaxes only) against the general rule run on the greedy point masses, over random trees
    with siblings, invalid nodes and tokens from a vocabulary of 4 (so that many nodes match), with and without
    a draft distribution q, under random uniforms: path, count, tokens and bonus all equal."""
    rng = np.random.default_rng(0)
    b, t, v = 64, 7, 4
    parents = np.stack([[rng.integers(-1, j) for j in range(t)] for _ in range(b)]).astype(np.int32)  # [B, T]
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)  # [B, T]
    valid = rng.random((b, t)) < 0.85  # [B, T]
    logits = jnp.asarray(rng.standard_normal((b, t + 1, v)), jnp.float32)  # [B, T+1, V]
    q = None
    if with_q:
        q = rng.random((b, t, v)).astype(np.float32)
        q = jnp.asarray(q / q.sum(-1, keepdims=True))  # [B, T, V]
    tree = DraftTree(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), valid=jnp.asarray(valid),
                     draft_probs=q)
    greedy = SamplingConfig(temperature=0.0)
    rule = verification.accept(tree, target_probs(logits, greedy), jnp.asarray(rng.random((b, t)), jnp.float32),
                               jnp.asarray(rng.random(b), jnp.float32))
    fast = verification.accept_greedy(tree, jnp.argmax(logits, axis=-1))
    assert int(jnp.sum(rule.num_accepted)) > b // 2  # the trees accept something: the comparison has content
    for name in ("path", "num_accepted", "tokens", "bonus"):
        np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(rule, name)), err_msg=name)
    # and verify_and_accept takes the greedy path at temperature 0 with the same outcome
    both = verification.verify_and_accept(tree, logits, greedy, jnp.zeros((b, t)), jnp.zeros((b,)))
    np.testing.assert_array_equal(np.asarray(both.tokens), np.asarray(rule.tokens))


def _draw_block_distribution(parents, kinds, sampling, shared_draw=False):
    """Exact distribution of one round's emitted block when deterministic children are checked against the target's
    own draws (the speculative loop at a temperature alone): `accept_greedy` on y_0..y_T, y_j ~ p at the root and at
    node j independently, every combination enumerated with its probability. shared_draw: one y for every node (a
    broken rule, for the check below)."""
    ((tokens, q, prob),) = _draft_outcomes(parents, kinds, sampling)
    assert q is None and prob == 1.0
    t = len(parents)
    p = np.asarray(_node_probs_jit(jnp.asarray(tokens[None], jnp.int32), jnp.asarray([parents], jnp.int32),
                                   sampling), np.float64)[0]  # [T+1, V]
    draws = [(y,) * (t + 1) for y in range(V)] if shared_draw else list(itertools.product(range(V), repeat=t + 1))
    weights = [p[0, y[0]] if shared_draw else np.prod([p[j, y[j]] for j in range(t + 1)]) for y in draws]
    n = len(draws)
    tree = DraftTree(tokens=jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (n, t)),
                     parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (n, t)), valid=jnp.ones((n, t), bool))
    acc = verification.accept_greedy(tree, jnp.asarray(draws, jnp.int32))
    blocks = {}
    for block, count, w in zip(np.asarray(acc.tokens), np.asarray(acc.num_accepted), weights):
        key = tuple(int(x) for x in block[: count + 1])
        blocks[key] = blocks.get(key, 0.0) + w
    return blocks


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=2.5)],
                         ids=lambda s: f"T{s.temperature}")
def test_deterministic_children_checked_against_the_targets_draws_give_the_rules_distribution(sampling):
    """Deterministic (top-k) children accepted when the target's own draw at their parent is their token, the draw
    the bonus otherwise (`accept_greedy` on draws, as the speculative loop runs a temperature alone): the emitted
    block has exactly the distribution of the acceptance rule (`accept`, integrated over its uniforms), and the
    round's output that of the target. Drawing once for all nodes instead is caught."""
    parents, kinds = [-1, -1, 0], [0, 1, 0]
    rule = _block_distribution(parents, kinds, sampling)
    drawn = _draw_block_distribution(parents, kinds, sampling)
    assert abs(sum(drawn.values()) - 1) < 1e-6 and len(drawn) > 4
    assert max(abs(drawn.get(k, 0.0) - rule.get(k, 0.0)) for k in set(drawn) | set(rule)) < 1e-6
    table = _target_sequence_table(3, sampling)
    spec = _speculative_sequence_distribution(drawn, table, 3)
    assert max(abs(spec[y] - table[3][y]) for y in table[3]) < 2e-6
    shared = _draw_block_distribution(parents, kinds, sampling, shared_draw=True)
    assert max(abs(shared.get(k, 0.0) - rule.get(k, 0.0)) for k in set(shared) | set(rule)) > 1e-4  # 100x the check
