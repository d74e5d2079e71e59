"""DFlash, DDTree and JetSpec (jaxspec/drafters/block_head.py, dflash.py, ddtree.py, jetspec.py) on the tiny Llama-3:
the best-first tree equals a plain Python heap, literal block masks, the tree-causal head's node outputs equal the
head run on the node's path alone (so a sibling branch cannot change them), the training block equals the inference
block, the refresh keeps the best path-conditioned candidates, greedy output equals autoregressive at batch 1 and 3
with trained heads, and bad settings are refused."""

import dataclasses
import heapq
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec.cache import KVCache
from jaxspec.drafters.block_head import (
    ParallelHeadConfig,
    block_forward,
    chain_block_mask,
    parallel_logits,
    spread_feature_layers,
    tree_block_mask,
)
from jaxspec.drafters.eagle import _project, draft_to_target, fuse_features
from jaxspec.drafters.jetspec import refresh_tree
from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.model import forward
from jaxspec.speculative import speculative_generate
from jaxspec.tree import best_first_tree

TINY = fixture_path("tiny-llama3")


def test_spread_feature_layers():
    assert spread_feature_layers(30) == (1, 8, 15, 22, 29)
    assert spread_feature_layers(36) == (1, 9, 18, 26, 35)
    assert spread_feature_layers(3) == (0, 1, 2)


# ---------------------------------------------------------------------------------------------- best-first tree


def _python_heap_tree(log_probs, budget, width):
    """The best-first tree built with heapq: pop the best candidate (ties: the earlier pushed), it becomes the next
    node, push its top-W children at the next depth. log_probs: [D, V]. Returns (ids, parents, scores) lists."""
    depth_count = log_probs.shape[0]
    order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :width]  # [D, W]
    heap, pushed = [], 0
    for w in range(width):
        heapq.heappush(heap, (-float(log_probs[0, order[0, w]]), pushed, -1, 1, int(order[0, w])))
        pushed += 1
    ids, parents, scores = [], [], []
    while heap and len(ids) < budget:
        neg, _, parent, depth, token = heapq.heappop(heap)
        node = len(ids)
        ids.append(token)
        parents.append(parent)
        scores.append(-neg)
        if depth < depth_count:
            for w in range(width):
                tok = int(order[depth, w])
                heapq.heappush(heap, (neg - float(log_probs[depth, tok]), pushed, node, depth + 1, tok))
                pushed += 1
    return ids, parents, scores


@pytest.mark.parametrize("depth,vocab,budget,width", [(3, 9, 7, 3), (4, 6, 12, 2), (1, 5, 4, 2), (5, 20, 30, 4)])
def test_best_first_tree_equals_a_python_heap(depth, vocab, budget, width):
    rng = np.random.default_rng(depth * 100 + budget)
    log_probs = np.log(rng.dirichlet(np.ones(vocab), size=(2, depth))).astype(np.float32)  # [2, D, V]
    ids, parents, valid, scores = (np.asarray(x) for x in best_first_tree(jnp.asarray(log_probs), budget, width))
    for row in range(2):
        ref_ids, ref_parents, ref_scores = _python_heap_tree(log_probs[row], budget, width)
        n = len(ref_ids)
        assert valid[row].tolist() == [True] * n + [False] * (budget - n)  # (1, 5, 4, 2): only 2 candidates exist
        assert ids[row, :n].tolist() == ref_ids
        assert parents[row, :n].tolist() == ref_parents
        np.testing.assert_allclose(scores[row, :n], ref_scores, rtol=1e-6)
        assert all(p < j for j, p in enumerate(parents[row]))  # parents first


def test_best_first_tree_on_a_hand_made_example():
    """Marginals: depth 1 {a: .6, b: .3, c: .1}, depth 2 {x: .45, y: .4, z: .15}, width 2, budget 5.
    Pops: a (.6), b (.3), a-x (.27), a-y (.24), b-x (.135); c (.1) never makes it (width 2 keeps a and b only)."""
    a, b, c, x, y, z = range(6)
    lp = np.full((1, 2, 6), -np.inf, np.float32)
    lp[0, 0, [a, b, c]] = np.log([0.6, 0.3, 0.1])
    lp[0, 1, [x, y, z]] = np.log([0.45, 0.4, 0.15])
    ids, parents, valid, scores = (np.asarray(v)[0] for v in best_first_tree(jnp.asarray(lp), 5, 2))
    assert ids.tolist() == [a, b, x, y, x] and parents.tolist() == [-1, -1, 0, 0, 1] and valid.all()
    np.testing.assert_allclose(np.exp(scores), [0.6, 0.3, 0.27, 0.24, 0.135], rtol=1e-6)


def test_best_first_tree_takes_the_top_k_without_sorting_the_vocabulary():
    """Its compiled program takes each depth's top W with a top-k, not a sort of the whole vocabulary (XLA:CPU sorted
    it when the pops' dynamic indexing read the top-k directly: 12 ms for [1, 8, 8192], 100x the top-k)."""
    log_probs = jnp.zeros((1, 8, 512), jnp.float32)  # [B, D, Vd]
    hlo = jax.jit(best_first_tree, static_argnums=(1, 2)).lower(log_probs, 4, 4).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line and ",512]" in line.split(" sort(")[0]]
    assert not sorts, sorts


# ---------------------------------------------------------------------------------------------- masks


def test_block_masks_are_literal():
    np.testing.assert_array_equal(np.asarray(chain_block_mask(1, 3, "bidirectional"))[0], np.ones((3, 3), bool))
    np.testing.assert_array_equal(np.asarray(chain_block_mask(1, 3, "tree_causal"))[0].astype(int),
                                  [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    # root -> n0, n1; n0 -> n2, n3; n3 -> n4 (slots: root 0, node j at j + 1): each sees itself and its ancestors
    mask = np.asarray(tree_block_mask(jnp.asarray([[-1, -1, 0, 0, 3]], jnp.int32)))[0].astype(int)
    np.testing.assert_array_equal(mask, [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ])


# ---------------------------------------------------------------------------------------------- the head


def _head(model, attention="tree_causal", scale=0.3, **settings):
    cfg = ParallelHeadConfig(attention=attention, draft_vocab_size=128, init_scale=scale,
                             **{"block_size": 4, "budget": 8, "tree_width": 2, **settings}).for_target(model.config)
    counts = np.random.default_rng(0).integers(0, 50, model.config.vocab_size)
    return cfg, cfg.init_params(model.config, model.weights, jax.random.key(5), counts)


def _context(model, params, tokens, n):
    """The head's cache of the first n - 1 pairs of `tokens` [1, S] and f_{n-1} (the root pair's feature)."""
    out = forward(model.weights, model.config, tokens, jnp.arange(tokens.shape[1])[None], hidden_layers=(0, 1, 2))
    feats = fuse_features(params.head, out.hidden)  # [1, S, d]
    positions = jnp.arange(n - 1)[None]
    _, k, v = _project(params.head, model.config, jnp.take(model.weights.embed, tokens[:, 1:n], axis=0),
                       feats[:, : n - 1], positions)
    pad = ((0, 0), (0, 0), (0, 16), (0, 0))
    cache = KVCache(k=jnp.pad(k.transpose(0, 2, 1, 3), pad)[None], v=jnp.pad(v.transpose(0, 2, 1, 3), pad)[None],
                    lengths=jnp.array([n - 1], jnp.int32))
    return cache, feats[:, n - 1], feats


def _tree_logits(model, params, cache, root_feature, root, tokens, parents):
    """The tree-causal block over the root and a tree: [T+1, Vd]."""
    from jaxspec.tree import node_depths

    parents = jnp.asarray([parents], jnp.int32)
    all_tokens = jnp.concatenate([jnp.asarray([[root]], jnp.int32), jnp.asarray([tokens], jnp.int32)], axis=1)
    positions = cache.lengths[:, None] + node_depths(parents)
    return block_forward(params, model.config, model.weights.embed, cache, root_feature, all_tokens,
                         jnp.ones(all_tokens.shape, bool), positions, tree_block_mask(parents))[0]


def test_tree_causal_node_outputs_equal_the_path_alone_and_ignore_siblings(tiny_llama3):
    """Each node of a tree-causal block outputs what the head outputs on its own path as a chain; changing a
    sibling branch leaves a node unchanged. The same block with a full (bidirectional) mask does change: the check
    can fail."""
    _, model, ref = tiny_llama3
    tokens = jnp.asarray(ref["input_ids"][:1, :20], jnp.int32)
    _, params = _head(model)
    cache, root_feature, _ = _context(model, params, tokens, 12)
    root = int(tokens[0, 11])
    tree_tokens, parents = [5, 9, 17, 33, 40], [-1, -1, 0, 0, 3]  # root -> 5, 9; 5 -> 17, 33; 33 -> 40
    logits = np.asarray(_tree_logits(model, params, cache, root_feature, root, tree_tokens, parents))
    for node, path in ((0, [5]), (1, [9]), (2, [5, 17]), (3, [5, 33]), (4, [5, 33, 40])):
        chain = np.asarray(_tree_logits(model, params, cache, root_feature, root, path, list(range(-1, len(path) - 1))))
        np.testing.assert_allclose(logits[node + 1], chain[-1], rtol=1e-5, atol=1e-5)
    changed = np.asarray(_tree_logits(model, params, cache, root_feature, root, [5, 77, 17, 33, 40], parents))
    np.testing.assert_allclose(changed[[1, 3, 4, 5]], logits[[1, 3, 4, 5]], rtol=1e-5, atol=1e-5)  # sibling 9 -> 77
    assert not np.allclose(changed[2], logits[2])  # the changed node itself does change

    full = jnp.ones((1, 6, 6), bool)  # the control: everyone sees everyone
    b_tokens = jnp.asarray([[root, 5, 9, 17, 33, 40]], jnp.int32)
    positions = cache.lengths[:, None] + jnp.asarray([[0, 1, 1, 2, 2, 3]])
    a = block_forward(params, model.config, model.weights.embed, cache, root_feature, b_tokens, jnp.ones((1, 6), bool),
                      positions, full)
    b = block_forward(params, model.config, model.weights.embed, cache, root_feature, b_tokens.at[0, 2].set(77),
                      jnp.ones((1, 6), bool), positions, full)
    assert not np.allclose(np.asarray(a[0, 3]), np.asarray(b[0, 3]), atol=1e-5)


@pytest.mark.parametrize("attention", ["bidirectional", "tree_causal"])
def test_training_block_equals_the_inference_block(tiny_llama3, attention):
    """parallel_logits at anchor a (context = pairs < a, slot 0 = (f_a, x_{a+1}), masks or true tokens after it)
    equals block_forward over the head's cache of the pairs < a."""
    _, model, ref = tiny_llama3
    s, d = 24, 4
    tokens = jnp.asarray(ref["input_ids"][:1, :s], jnp.int32)
    _, params = _head(model, attention, block_size=d)
    for real in ([False], [True]) if attention == "tree_causal" else ([False],):
        anchors = jnp.asarray([3, 10, 16], jnp.int32)
        out = forward(model.weights, model.config, tokens, jnp.arange(s)[None], hidden_layers=(0, 1, 2))
        feats = fuse_features(params.head, out.hidden)
        logits = parallel_logits(params, model.config, model.weights.embed, tokens, feats, anchors, d, attention,
                                 jnp.full((1, 3), real[0]))  # [1, A, D, Vd]
        for i, a in enumerate(anchors.tolist()):
            cache, root_feature, _ = _context(model, params, tokens, a + 1)
            blk = tokens[:, a + 1: a + 1 + d]  # root x_{a+1}, then x_{a+2} ..
            expected = block_forward(params, model.config, model.weights.embed, cache, root_feature, blk,
                                     jnp.ones((1, d), bool) if real[0] else jnp.arange(d)[None] == 0,
                                     a + jnp.arange(d)[None], chain_block_mask(1, d, attention))
            np.testing.assert_allclose(np.asarray(logits[0, i]), np.asarray(expected[0]), rtol=1e-4, atol=1e-4)


def test_refresh_keeps_the_best_path_conditioned_candidates(tiny_llama3):
    """The refreshed tree equals a brute-force recomputation: every candidate = a top-W child (by the head's
    path-conditioned output) of the root or of a node whose own token is among its parent's top W; score = the sum
    of path-conditioned log-probs; keep the best B."""
    _, model, ref = tiny_llama3
    tokens = jnp.asarray(ref["input_ids"][:1, :20], jnp.int32)
    cfg, params = _head(model, scale=0.5)
    cache, root_feature, _ = _context(model, params, tokens, 12)
    root = tokens[:, 11]
    log_probs = jax.nn.log_softmax(block_forward(
        params, model.config, model.weights.embed, cache, root_feature,
        jnp.zeros((1, 4), jnp.int32).at[0, 0].set(root[0]), jnp.arange(4)[None] == 0, 11 + jnp.arange(4)[None],
        chain_block_mask(1, 4, "tree_causal")), axis=-1)
    budget, width = 6, 2
    ids, parents, valid, _ = best_first_tree(log_probs, budget, width)
    new_ids, new_parents, new_valid, new_scores = refresh_tree(params, model.config, model.weights.embed, cache,
                                                               root_feature, root, ids, parents, valid, width)
    d2t = np.asarray(draft_to_target(params.head))
    ids_l, parents_l = np.asarray(ids)[0].tolist(), np.asarray(parents)[0].tolist()

    def path_of(j):
        path = []
        while j >= 0:
            path.insert(0, ids_l[j])
            j = parents_l[j]
        return path

    def dist(path):  # log-probs of the next draft id after `path` (draft ids), by the head on the path alone
        chain = [int(d2t[t]) for t in path]
        out = _tree_logits(model, params, cache, root_feature, int(root[0]), chain, list(range(-1, len(chain) - 1)))
        return np.asarray(jax.nn.log_softmax(out[-1]))

    candidates = {}  # path tuple -> score
    for path in [()] + [tuple(path_of(j)) for j in range(budget)]:
        score, ok = 0.0, True
        for i in range(len(path)):  # the path's own tokens must be top-W children of their prefixes
            lp = dist(list(path[:i]))
            ok &= path[i] in np.argsort(-lp, kind="stable")[:width]
            score += lp[path[i]]
        if not ok:
            continue
        lp = dist(list(path))
        for tok in np.argsort(-lp, kind="stable")[:width]:
            candidates[path + (int(tok),)] = score + lp[tok]
    best = sorted(candidates.values(), reverse=True)[:budget]
    np.testing.assert_allclose(np.sort(np.asarray(new_scores)[0])[::-1], best, rtol=1e-4, atol=1e-4)
    assert bool(np.asarray(new_valid).all())
    got_ids, got_parents = np.asarray(new_ids)[0].tolist(), np.asarray(new_parents)[0].tolist()
    for j in range(budget):  # every kept node's path is a candidate and parents come first
        assert got_parents[j] < j
        path, k = [], j
        while k >= 0:
            path.insert(0, got_ids[k])
            k = got_parents[k]
        assert tuple(path) in candidates


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def trained_heads(tiny_data, tmp_path_factory):
    """A DFlash and a JetSpec head trained briefly on the tiny model's regenerated data: method -> (summary, losses)."""
    import json
    import os

    from jaxspec.config_files import from_dict
    from jaxspec.training.config import TrainConfig
    from jaxspec.training.distill import train

    target, data = tiny_data
    heads = {}
    for method in ("dflash", "jetspec"):
        out = str(tmp_path_factory.mktemp(method))
        config = from_dict(TrainConfig, {
            "method": method, "target": TINY, "dtype": "float32",
            "data": {"path": data, "seq_len": 32, "eval_holdout": 4, "cache_features": True},
            "optim": {"learning_rate": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
            "loss": {"kind": "forward_kl", "gamma": 0.2},
            "run": {"steps": 30, "batch_size": 4, "seed": 0, "out_dir": out, "save_every": 30, "eval_every": 30,
                    "eval_prompts": 2, "log_every": 1},
            "drafter": {"draft_vocab_size": 64, "block_size": 4, "budget": 8, "tree_width": 2, "anchor_stride": 1},
        })
        summary = train(config, progress=False)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
        heads[method] = (summary, losses)
    return target, heads


def test_training_lowers_the_loss(trained_heads):
    _, heads = trained_heads
    for method, (_, losses) in heads.items():
        assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), method


@pytest.mark.parametrize("method", ["dflash", "ddtree", "jetspec"])
def test_greedy_equals_autoregressive_batch_1_and_3(trained_heads, tiny_llama3, method):
    from jaxspec.methods import MethodOptions, build_method

    target, heads = trained_heads
    _, _, ref = tiny_llama3
    ids = ref["input_ids"]
    prompts = [ids[0, :5].tolist(), ids[1, :17].tolist(), ids[0, 3:40].tolist()]
    path = heads["dflash" if method != "jetspec" else "jetspec"][0]["drafter"]
    m = build_method(method, target, MethodOptions(drafter=path, budget=4 if method == "dflash" else 8))  # as trained
    expected = generate(target.weights, target.config, prompts, max_new_tokens=30).token_ids
    one = speculative_generate(target.weights, target.config, m.drafter, m.params, prompts[:1], max_new_tokens=30)
    assert one.token_ids == expected[:1]
    three = speculative_generate(target.weights, target.config, m.drafter, m.params, prompts, max_new_tokens=30)
    assert three.token_ids == expected
    assert three.tau > 1.2, three.tau  # drafts are accepted: multi-token rounds are exercised
    assert len(set(map(len, three.accepted))) > 1 or len({tuple(a) for a in three.accepted}) > 1  # rows differ


def test_refusals(tiny_llama3):
    _, model, _ = tiny_llama3
    cfg, _ = _head(model, "bidirectional")
    with pytest.raises(UserError, match="tree_causal"):
        cfg.make_drafter("jetspec")
    with pytest.raises(UserError, match="attention"):
        ParallelHeadConfig(attention="causal")
    with pytest.raises(UserError, match="layer 40"):
        ParallelHeadConfig(feature_layers=(1, 40)).for_target(model.config)
    from jaxspec.methods import MethodOptions, build_method

    with pytest.raises(UserError, match="block size"):
        build_method("dflash", model, MethodOptions(drafter="untrained", budget=64))
    with pytest.raises(UserError, match="--budget"):
        build_method("eagle3", model, MethodOptions(drafter="untrained", budget=16))
    with pytest.raises(UserError, match="refresh"):
        build_method("ddtree", model, MethodOptions(drafter="untrained", refresh_steps=2))
    assert dataclasses.replace(cfg, budget=3).make_drafter("dflash").num_nodes == 3


def test_budget_auto_follows_the_batch_size(tiny_llama3, tmp_path, monkeypatch):
    """--budget auto reads the device's cached cost model and picks per batch size: on costs where verification
    is flat in tokens at batch 1 and linear at batch 16, and a head whose tau grows with the budget, batch 1 gets the
    largest budget and batch 16 none (plain decoding, budget 0); generation with the chosen drafter stays lossless."""
    from jaxspec import methods as methods_module
    from jaxspec.budget import CostModel, cost_model_path, device_name
    from jaxspec.methods import AUTO_BUDGETS, MethodOptions, build_method

    _, model, ref = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(methods_module, "measured_budget_taus",
                        lambda target, drafter, params, budgets, folder=None: {b: 1 + 0.3 * b ** 0.5 for b in budgets})
    tokens = [1, *(b + 1 for b in AUTO_BUDGETS)]
    cost = CostModel(device=device_name(model.weights.embed.dtype), model=model.fingerprint(), batch_sizes=[1, 4, 16],
                     token_counts=tokens, seconds=[[1e-3] * len(tokens), [1e-3 + 1e-5 * t for t in tokens],
                                                   [1e-3 + 1e-3 * t for t in tokens]], context=256)
    cost.save(cost_model_path(model))
    method = build_method("jetspec", model, MethodOptions(drafter="untrained", budget="auto"))
    assert method.drafter_for_batch(1).num_nodes == max(AUTO_BUDGETS)
    # batch 16, where each verified token costs a step's worth: no budget beats plain decoding (budget 0)
    budget, table = method.auto_budget(16)
    assert [r["budget"] for r in table] == [0, *AUTO_BUDGETS] and sum(r["chosen"] for r in table) == 1
    assert budget == 0 and method.drafter_for_batch(16) is None and "no draft" in method.auto_table(16)[0]
    prompts = [ref["input_ids"][0, :9].tolist(), ref["input_ids"][1, :5].tolist()]
    result = method.generate(prompts, max_new_tokens=12)
    assert result.token_ids == generate(model.weights, model.config, prompts, max_new_tokens=12).token_ids


def test_budget_taus_are_measured_by_decoding_and_cached(tiny_llama3, tmp_path, monkeypatch):
    """--budget auto for the block heads sizes rounds from the head's own tokens per round at each budget: measured
    by the decoding loop on the calibration prompts (equal to a run of the method at that budget), cached per head
    and settings, read from the drafter's folder once stored there; the chooser then picks by them (a head that
    gains nothing past budget 2 gets 2 on a device where every node is nearly free)."""
    from jaxspec import methods as methods_module
    from jaxspec.budget import CostModel, cost_model_path, device_name
    from jaxspec.methods import (
        BUDGET_CALIBRATION_PROMPTS,
        BUDGET_CALIBRATION_TOKENS,
        MethodOptions,
        _calibration_prompts,
        budget_taus_file,
        build_method,
        measured_budget_taus,
        save_budget_taus,
    )
    from jaxspec.metrics import tau

    _, model, _ = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    method = build_method("ddtree", model, MethodOptions(drafter="untrained", budget=4))
    taus = measured_budget_taus(model, method.drafter, method.params, [2, 4])
    prompts = _calibration_prompts(model)[:BUDGET_CALIBRATION_PROMPTS]
    run = method.generate(prompts, max_new_tokens=BUDGET_CALIBRATION_TOKENS)  # the method at budget 4
    assert set(taus) == {2, 4} and taus[4] == pytest.approx(tau(run.accepted)) and all(t >= 1 for t in taus.values())

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the cache holds the taus")

    with monkeypatch.context() as m:
        m.setattr(methods_module, "_measure_budget_taus", no_measuring)
        assert measured_budget_taus(model, method.drafter, method.params, [2, 4]) == taus
    folder = tmp_path / "drafter"
    path = save_budget_taus(str(folder), model, method.drafter, method.params, [2, 4])
    assert os.path.basename(path) == budget_taus_file(method.drafter) == "budget-taus-ddtreedrafter.json"
    with open(path) as f:
        stored = json.load(f)
    stored["taus"] = {"2": 2.5, "4": 2.6}  # what the folder says wins over a fresh measurement
    with open(path, "w") as f:
        json.dump(stored, f)
    with monkeypatch.context() as m:
        m.setattr(methods_module, "_measure_budget_taus", no_measuring)
        assert measured_budget_taus(model, method.drafter, method.params, [2, 4], str(folder)) == {2: 2.5, 4: 2.6}
        other = dataclasses.replace(method.drafter, tree_width=method.drafter.tree_width + 1)
        with pytest.raises(AssertionError, match="measured although"):  # other settings: not these taus
            measured_budget_taus(model, other, method.params, [2, 4], str(folder))

    budgets = methods_module.AUTO_BUDGETS
    tokens = [1, *(b + 1 for b in budgets)]
    CostModel(device=device_name(model.weights.embed.dtype), model=model.fingerprint(), batch_sizes=[1],
              token_counts=tokens, seconds=[[1e-3 * (1 + 1e-3 * t) for t in tokens]], context=256).save(
        cost_model_path(model))
    monkeypatch.setattr(methods_module, "measured_budget_taus",
                        lambda target, drafter, params, bs, folder=None: {b: 2.0 if b >= 2 else 1.0 for b in bs})
    auto = build_method("ddtree", model, MethodOptions(drafter="untrained", budget="auto"))
    assert auto.budget_taus == {b: 2.0 for b in budgets} and auto.drafter_for_batch(1).num_nodes == 2
