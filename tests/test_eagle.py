"""EAGLE-3 with EAGLE-2 dynamic trees (jaxspec/drafters/eagle.py) on the tiny Llama-3: greedy output equals
autoregressive, the head's cache after rounds equals the head run over the committed text, dynamic trees are
ancestor-closed with parents first and match an independent path-by-path recomputation, the draft vocabulary map,
training-time test equals a manual unroll through the inference path, and training lowers the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec.cache import KVCache, commit_positions, init_cache
from jaxspec.drafters import RoundInputs
from jaxspec.drafters.eagle import (
    Eagle3Config,
    FeatureMajorHead,
    absorb_pairs,
    build_vocab_map,
    draft_to_target,
    draft_tree,
    expand_pool,
    feature_major_head,
    fuse_features,
    head_dtype,
    head_forward,
    head_logits,
    static_tree,
    target_to_draft_mask,
    to_target_logits,
    ttt_logits,
)
from jaxspec.generate import generate, prefill
from jaxspec.model import forward
from jaxspec.sampling import GREEDY, SamplingConfig, target_probs
from jaxspec.speculative import speculative_generate, speculative_generate_tokens
from jaxspec.tree import DraftTree, chain_parents, select_nodes
from jaxspec.verification import accept, verify_forward

TINY = fixture_path("tiny-llama3")


def _prompts(ref):
    ids = ref["input_ids"]
    return [ids[0, :5].tolist(), ids[1, :17].tolist(), ids[0, 3:40].tolist()]


def _head(model, scale=0.3, vocab=128, **tree):
    """A random (non-zero) head over a reduced vocabulary of `vocab` of the 256 tokens, and its config."""
    cfg = Eagle3Config(draft_vocab_size=vocab, init_scale=scale, **{"depth": 3, "top_k": 3, "num_nodes": 8, **tree})
    cfg = cfg.for_target(model.config)
    counts = np.random.default_rng(0).integers(0, 50, model.config.vocab_size)
    return cfg, cfg.init_params(model.config, model.weights, jax.random.key(7), counts)


def test_greedy_equals_autoregressive(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    cfg, params = _head(model)
    drafter = cfg.make_drafter()
    assert drafter.target_layers == (0, 1, 2) and drafter.num_nodes == 8
    for batch in (prompts[:1], prompts):  # batch 1, and 3 rows of different lengths
        expected = generate(model.weights, model.config, batch, max_new_tokens=24, eos_ids=()).token_ids
        result = speculative_generate(model.weights, model.config, drafter, params, batch, max_new_tokens=24,
                                      eos_ids=())
        assert result.token_ids == expected
        assert all(1 <= r <= 24 for r in result.rounds)
        if len(batch) == 1:  # another prompt length in the same shape bucket: no new compilation
            before = speculative_generate_tokens._cache_size()
            other = [prompts[2][:30]]
            expected = generate(model.weights, model.config, other, max_new_tokens=24, eos_ids=()).token_ids
            assert speculative_generate(model.weights, model.config, drafter, params, other, max_new_tokens=24,
                                        eos_ids=()).token_ids == expected
            assert speculative_generate_tokens._cache_size() == before


def test_greedy_equals_autoregressive_with_a_prompt_lookup_chain_merged_in(tiny_llama3):
    """The head's dynamic tree plus a prompt-lookup chain (merge_chain), batch 1 and 3 rows of different lengths; a
    chain that would leave the head no node is refused."""
    from jaxspec.errors import UserError

    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    prompts = [p + p[:6] for p in prompts]  # each ends by repeating its start: the lookup finds something to copy
    cfg, params = _head(model)
    drafter = dataclasses.replace(cfg.make_drafter(), num_nodes=8 + 3, lookup_depth=3)
    for batch in (prompts[:1], prompts):
        expected = generate(model.weights, model.config, batch, max_new_tokens=24, eos_ids=()).token_ids
        result = speculative_generate(model.weights, model.config, drafter, params, batch, max_new_tokens=24,
                                      eos_ids=())
        assert result.token_ids == expected
    with pytest.raises(UserError, match="at least one"):
        dataclasses.replace(drafter, num_nodes=3, lookup_depth=3)


def test_greedy_equals_autoregressive_over_per_layer_buffers(tiny_llama3):
    """The CPU layout (per-layer weights and a per-layer cache, written in place by each layer; JAXSPEC_LAYERS=
    unstacked) verifies trees and commits accepted paths to the same tokens as plain decoding, batch 1 and 3."""
    from jaxspec.model import layers_layout

    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    cfg, params = _head(model)
    for batch in (prompts[:1], prompts):
        expected = generate(model.weights, model.config, batch, max_new_tokens=16, eos_ids=()).token_ids
        with layers_layout("unstacked"):
            result = speculative_generate(model.weights, model.config, cfg.make_drafter(), params, batch,
                                          max_new_tokens=16, eos_ids=())
        assert result.token_ids == expected
        assert max(result.rounds) < 16  # some rounds accepted drafted tokens: commits of more than one entry ran


@pytest.mark.parametrize("name", ["eagle", "eagle2", "eagle3"])
def test_the_eagle_methods_build_their_heads_and_trees(tiny_llama3, name):
    """Which head and tree each EAGLE method builds (greedy identity for every registry method: test_registry.py)."""
    from jaxspec.methods import LEARNED_METHODS, METHODS, MethodOptions, build_method

    _, model, ref = tiny_llama3
    assert name in METHODS and name in LEARNED_METHODS
    # eagle3 with the registry's defaults (--budget auto: the tree shape from a measured cost model and the head's
    # measured ranks); eagle2 with a tree by hand (the auto path is the same code)
    hand = dict(num_draft_tokens=3, tree_width=2, tree_nodes=5) if name == "eagle2" else {}
    method = build_method(name, model, MethodOptions(drafter="untrained", **hand))
    drafter = method.drafter
    if name == "eagle3":  # fused low/mid/high layers, reduced vocabulary (all 256 here), dynamic tree
        assert drafter.target_layers == (0, 1, 2) and drafter.choices is None
    else:  # the EAGLE-1 head on the top layer; eagle: its static tree, eagle2: the dynamic tree
        assert drafter.target_layers == (2,) and method.params.fc.shape == (64, 64)
        assert (drafter.choices is not None) == (name == "eagle")
    if name != "eagle3":
        return
    batch = _prompts(ref)[1:]
    # sampling: deterministic top-k children (draft_probs None) under the same loop; reproducible per seed
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    runs = [method.generate(batch, max_new_tokens=12, eos_ids=(), sampling=sampling, seed=s).token_ids for s in (1, 1)]
    assert runs[0] == runs[1] and all(len(r) == 12 and all(0 <= x < 256 for x in r) for r in runs[0])


def _scratch_pairs(params, model, drafter, committed, width=None):
    """The head run over a committed text (prompt, then accepted tokens, then the root) in one causal forward:
    (h [1, L, d], k [1, L, Hkv, h]) for the pairs (f_t, x_{t+1}), t < L. With `width`, the text is right-padded to
    width + 1 tokens (one compilation for every length; causal attention keeps padding out of the first L pairs)."""
    n = len(committed) - 1
    ids = jnp.asarray([committed + [0] * ((width or n) - n)], jnp.int32)  # [1, W + 1]
    h, k = _scratch_jit(params, model.weights, model.config, drafter.target_layers, ids)
    return h[:, :n], k[:, :n]


@jax.jit(static_argnums=(2, 3))
def _scratch_jit(params, weights, cfg, layers, ids):
    n = ids.shape[1] - 1
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    out = forward(weights, cfg, ids[:, :n], positions, hidden_layers=layers)
    feats = fuse_features(params, out.hidden)  # [1, W, d]
    h, k, _ = head_forward(params, cfg, weights.embed, ids[:, 1:], feats, positions)
    return h, k


def test_head_cache_after_rounds_equals_the_head_over_the_committed_text(tiny_llama3):
    """Rounds by hand with trees that force different accepted lengths per row (chains whose first a tokens are
    the target's greedy continuation): after each round the head's cache [0, L) and its next tree are those of
    running the head over the whole committed text from scratch."""
    _, model, ref = tiny_llama3
    cfg_t, w = model.config, model.weights
    cfg, params = _head(model)
    drafter = cfg.make_drafter()
    t = drafter.num_nodes
    prompts = [ref["input_ids"][0, :9].tolist(), ref["input_ids"][1, :6].tolist()]
    greedy = generate(w, cfg_t, prompts, max_new_tokens=40, eos_ids=()).token_ids  # [2][40], the first is the root
    lengths = jnp.array([9, 6], jnp.int32)
    tokens = jnp.asarray([prompts[0], prompts[1] + [0, 0, 0]], jnp.int32)
    size = 64
    cache = init_cache(cfg_t, 2, size)
    logits, out, cache = prefill(w, cfg_t, tokens, lengths, cache, hidden_layers=drafter.target_layers)
    root = jnp.argmax(logits, -1).astype(jnp.int32)
    history = jnp.zeros((2, size), jnp.int32).at[:, :9].set(tokens).at[jnp.arange(2), lengths].set(root)
    state = drafter.init(params, cfg_t, tokens, lengths, out, size, GREEDY)
    done = [0, 0]  # generated tokens before the root, per row
    propose = jax.jit(lambda p, s, i: drafter.propose(p, s, i, cfg_t, GREEDY, jax.random.key(0)))
    update = jax.jit(drafter.update)
    verify = jax.jit(lambda w, c, r, tr: verify_forward(w, cfg_t, c, r, tr, drafter.target_layers))
    tree_jit = jax.jit(lambda p, e, c, h: draft_tree(p, cfg_t, e, c, h, depth=3, top_k=3, num_nodes=t))
    for forced in ([3, 0], [0, 8], [8, 5], [1, 2]):
        inputs = RoundInputs(target_weights=w, target_cache=cache, history=history, lengths=cache.lengths, root=root)
        tree, state, cache = propose(params, state, inputs)
        for row in range(2):  # the head's cache and tree equal the head run over the committed text
            n = int(cache.lengths[row])
            committed = prompts[row] + greedy[row][: done[row] + 1]
            assert len(committed) == n + 1 and int(state.cache.lengths[row]) == n
            h, k = _scratch_pairs(params, model, drafter, committed, width=48)
            np.testing.assert_allclose(np.asarray(state.cache.k[0, row, :, :n]), np.asarray(k[0].transpose(1, 0, 2)),
                                       rtol=2e-4, atol=2e-5)
            one = KVCache(k=state.cache.k[:, row:row + 1], v=state.cache.v[:, row:row + 1], lengths=jnp.array([n]))
            scratch, _ = tree_jit(params, w.embed, one, h[:, -1])
            np.testing.assert_array_equal(np.asarray(scratch.tokens[0]), np.asarray(tree.tokens[row]))
            np.testing.assert_array_equal(np.asarray(scratch.parents[0]), np.asarray(tree.parents[row]))
        # a chain whose first `forced[row]` tokens are right, the rest wrong
        chain = np.zeros((2, t), np.int32)
        for row in range(2):
            right = np.asarray(greedy[row][done[row] + 1: done[row] + 1 + t])
            chain[row] = np.where(np.arange(t) < forced[row], right, (right + 1) % cfg_t.vocab_size)
        forced_tree = DraftTree(tokens=jnp.asarray(chain), parents=jnp.broadcast_to(jnp.asarray(chain_parents(t)),
                                (2, t)), valid=jnp.ones((2, t), bool))
        verification = verify(w, cache, root, forced_tree)
        acc = accept(forced_tree, target_probs(verification.logits, GREEDY), jnp.zeros((2, t)), jnp.zeros(2))
        assert acc.num_accepted.tolist() == forced
        start = cache.lengths
        cache = commit_positions(verification.cache, acc.path, acc.num_accepted + 1)
        for row in range(2):
            new = acc.tokens[row, : forced[row] + 1]
            history = history.at[row, int(start[row]) + 1: int(start[row]) + 2 + forced[row]].set(new)
            done[row] += forced[row] + 1
        state = update(params, state, inputs, dataclasses.replace(verification, cache=None), acc)
        root = acc.bonus


def test_select_nodes_is_ancestor_closed_with_parents_first():
    """Random pools shaped like EAGLE-2's (children score at most their parent, many exact ties, zero log-probs):
    the kept nodes are the best N by score, every kept node's parent is kept and comes before it."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        k, depth = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        m = k + (depth - 1) * k * k
        parents, scores = np.full(m, -1), np.zeros(m)
        scores[:k] = -rng.integers(0, 3, k)  # integer log-probs: ties everywhere, some exactly 0
        frontier = np.arange(k)
        for j in range(depth - 1):
            offset = k + j * k * k
            for f, node in enumerate(frontier):
                for c in range(k):
                    parents[offset + f * k + c] = node
                    scores[offset + f * k + c] = scores[node] - rng.integers(0, 2)
            frontier = offset + np.argsort(-scores[offset: offset + k * k], kind="stable")[:k]
        n = int(rng.integers(1, m + 1))
        keep, tree_parents = select_nodes(jnp.asarray(scores[None], jnp.float32), jnp.asarray(parents[None]), n)
        keep, tree_parents = np.asarray(keep[0]), np.asarray(tree_parents[0])
        assert np.all(np.diff(keep) > 0)
        assert np.all(tree_parents < np.arange(n)), (trial, tree_parents)
        for j in range(n):  # the tree's parent is the pool parent
            expect = parents[keep[j]]
            assert (tree_parents[j] == -1 and expect == -1) or keep[tree_parents[j]] == expect
        assert sorted(scores[keep]) == sorted(np.sort(scores)[::-1][:n])


def _committed(params, model, drafter, prompt, root):
    """The head's cache (32 slots) after absorbing a prompt followed by the root, and the root's draft state h_root
    [1, d], checked against the head run over the text in one forward."""
    cfg_t, w = model.config, model.weights
    committed = prompt + [root]
    h, _ = _scratch_pairs(params, model, drafter, committed)
    n = len(prompt)
    out = forward(w, cfg_t, jnp.asarray([prompt]), jnp.arange(n)[None], hidden_layers=drafter.target_layers)
    feats = fuse_features(params, out.hidden)  # [1, n, d]
    cache = init_cache(cfg_t, 1, 32, num_layers=1)
    cache, h_root = absorb_pairs(params, cfg_t, w.embed, cache, jnp.pad(feats, ((0, 0), (0, 32 - n), (0, 0))),
                                 jnp.pad(jnp.asarray([committed]), ((0, 0), (0, 32 - n - 1))), jnp.array([n]))
    np.testing.assert_allclose(np.asarray(h_root), np.asarray(h[:, -1]), rtol=1e-4, atol=1e-5)
    return cache, h_root


def test_a_long_prompt_is_absorbed_in_chunks_with_the_same_result(tiny_llama3):
    """`absorb_pairs` over 13 pairs, 4 at a time (ragged rows of 13, 9 and 3 valid pairs, a cache already holding
    two pairs), caches the same keys and values at the valid slots and returns the same draft state as in one go."""
    _, model, _ = tiny_llama3
    cfg_t, w = model.config, model.weights
    cfg, params = _head(model)
    rng = np.random.default_rng(5)
    b, width = 3, 13
    history = jnp.asarray(rng.integers(1, 256, (b, 40)), jnp.int32)  # [B, S]
    feats = jnp.asarray(rng.standard_normal((b, width, cfg_t.hidden_size)), jnp.float32)  # [B, W, d]
    start = init_cache(cfg_t, b, 40, num_layers=1)
    start = absorb_pairs(params, cfg_t, w.embed, start, feats[:, :2], history, jnp.full((b,), 2, jnp.int32))[0]
    lengths = jnp.array([15, 11, 5], jnp.int32)  # [B]: 2 cached + 13, 9 and 3 valid pairs
    whole, h_whole = absorb_pairs(params, cfg_t, w.embed, start, feats, history, lengths)
    chunked, h_chunked = absorb_pairs(params, cfg_t, w.embed, start, feats, history, lengths, chunk=4)
    np.testing.assert_array_equal(np.asarray(chunked.lengths), np.asarray(lengths))
    # float32 round-off in units of the state's scale (entries up to about 20): 13 pairs and 4 pairs at a time sum in
    # different orders (XLA picks its product per width), and an entry near 0 left by cancellation keeps the error
    # of its large terms (on the 2-core EPYC, 2.1e-5 at an entry of 0.037)
    scale = float(np.abs(np.asarray(h_whole)).max())
    np.testing.assert_allclose(np.asarray(h_chunked), np.asarray(h_whole), rtol=1e-5, atol=1e-5 * scale)
    for row in range(b):
        n = int(lengths[row])
        for a, c in ((whole.k, chunked.k), (whole.v, chunked.v)):
            np.testing.assert_allclose(np.asarray(c[:, row, :, :n]), np.asarray(a[:, row, :, :n]), rtol=1e-5,
                                       atol=1e-5)


def _path_log_probs(params, model, cache, h_root, path):
    """The head run on one path alone (feed (h_root, y1), (h1, y2), ... causally over the cache): the draft
    log-probs [Vd] each token of the path was chosen from."""
    cfg_t, w = model.config, model.weights
    n = int(cache.lengths[0])
    feats, out = [h_root[:, None]], [jax.nn.log_softmax(head_logits(params, cfg_t, h_root), -1)[0]]
    for i in range(1, len(path)):
        chain = jnp.asarray([path[:i]], jnp.int32)
        hs, _, _ = head_forward(params, cfg_t, w.embed, chain, jnp.concatenate(feats, 1), n + jnp.arange(i)[None],
                                cache)
        feats.append(hs[:, -1:])
        out.append(jax.nn.log_softmax(head_logits(params, cfg_t, hs[:, -1]), -1)[0])
    return [np.asarray(x) for x in out]


def _paths(tokens, parents):
    """The root-to-node token path of every node."""
    paths = []
    for j in range(len(tokens)):
        path, node = [], j
        while node >= 0:
            path.append(int(tokens[node]))
            node = parents[node]
        paths.append(path[::-1])
    return paths


def test_dynamic_tree_matches_an_independent_path_recomputation(tiny_llama3):
    """For every node of a real drafted tree: its parent comes first, its token is among its parent's top-K draft
    tokens, and its score equals the sum of log-probs along its path when the head is run on that path alone (a
    causal chain over the committed cache); the kept nodes are the best N of the whole pool."""
    _, model, ref = tiny_llama3
    cfg, params = _head(model, scale=0.5, depth=4, top_k=3, num_nodes=12)
    cache, h_root = _committed(params, model, cfg.make_drafter(), ref["input_ids"][0, :11].tolist(), 7)
    tree, scores = draft_tree(params, model.config, model.weights.embed, cache, h_root, depth=4, top_k=3,
                              num_nodes=12)
    _, _, pool_scores = expand_pool(params, model.config, model.weights.embed, cache, h_root, 4, 3)
    np.testing.assert_allclose(np.sort(np.asarray(scores[0])), np.sort(np.asarray(pool_scores[0]))[-12:], rtol=1e-6)
    tokens, parents, scores = (np.asarray(x[0]) for x in (tree.tokens, tree.parents, scores))
    d2t = np.asarray(draft_to_target(params))
    paths = _paths(tokens, parents)
    for j, path in enumerate(paths):
        assert parents[j] < j
        total = 0.0
        for y, logp in zip(path, _path_log_probs(params, model, cache, h_root, path)):
            assert y in d2t[np.argsort(-logp, kind="stable")[:3]]  # one of the parent's top-K
            total += float(logp[np.flatnonzero(d2t == y)[0]])
        np.testing.assert_allclose(scores[j], total, rtol=1e-4, atol=1e-4)
    assert max(len(p) for p in paths) >= 2  # the tree goes deeper than the root's children
    for j in range(12):  # siblings are distinct tokens
        siblings = [tokens[i] for i in range(12) if parents[i] == parents[j]]
        assert len(set(siblings)) == len(siblings)


def test_the_feature_major_head_computes_the_trained_layout(tiny_llama3):
    """`feature_major_head` (the per-layer CPU layout: transposed, fused matrices through `feature_major_product`,
    the few-column kernel at 2-16 rows) against the head as trained: fused features, the head's layer over 1, 2 and
    20 pairs (kernel and XLA products), its logits, and the tree it drafts from a committed cache."""
    _, model, ref = tiny_llama3
    cfg, params = _head(model, scale=0.5, depth=3, top_k=2, num_nodes=5)
    fm = feature_major_head(params)
    assert isinstance(fm, FeatureMajorHead) and fm.wqkv.shape[1] == params.wq.shape[0]
    rows, rng = 2, np.random.default_rng(0)
    d, n = model.config.hidden_size, len(cfg.feature_layers)
    hidden = jnp.asarray(rng.standard_normal((n, rows, 4, d)), jnp.float32)  # [n, B, 4, d]

    def close(got, want):  # float32 sums in another order: errors scale with the array's largest entries
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=4e-6 * float(np.max(np.abs(want))))

    close(fuse_features(fm, hidden), fuse_features(params, hidden))
    embed = model.weights.embed
    forward_jit = jax.jit(head_forward, static_argnums=1)
    for t in (1, 2, 20):
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (rows, t)), jnp.int32)  # [B, T]
        feats = jnp.asarray(rng.standard_normal((rows, t, d)), jnp.float32)  # [B, T, d]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))  # [B, T]
        for got, want in zip(forward_jit(fm, model.config, embed, tokens, feats, positions),
                             forward_jit(params, model.config, embed, tokens, feats, positions)):
            close(got, want)
        close(head_logits(fm, model.config, feats), head_logits(params, model.config, feats))
    ids = ref["input_ids"][0].tolist()
    cache, h_root = _committed(params, model, cfg.make_drafter(), ids[:9], ids[9])
    h_root = jnp.broadcast_to(h_root, (rows, d))  # [B, d]
    cache = dataclasses.replace(cache, k=jnp.broadcast_to(cache.k, (1, rows, *cache.k.shape[2:])),
                                v=jnp.broadcast_to(cache.v, (1, rows, *cache.v.shape[2:])),
                                lengths=jnp.broadcast_to(cache.lengths, (rows,)))
    tree_jit = jax.jit(lambda p: draft_tree(p, model.config, embed, cache, h_root, depth=3, top_k=2, num_nodes=5))
    (want, want_scores), (got, got_scores) = tree_jit(params), tree_jit(fm)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-4, atol=1e-5)
    # the generation loop runs it where the target runs per layer, and only there
    from jaxspec.model import layers_layout

    drafter = cfg.make_drafter()
    assert drafter.execution_params(params) is params
    with layers_layout("unstacked"):
        assert isinstance(drafter.execution_params(params), FeatureMajorHead)
        assert drafter.execution_params(params) is drafter.execution_params(params)  # converted once


def test_a_head_of_bfloat16_values_runs_feature_major_in_bfloat16_with_the_same_numbers(tiny_llama3):
    """A float32 head whose entries are all bfloat16 values (stored in bfloat16, as the shipped heads are) keeps its
    matrices in bfloat16 in the per-layer layout (half the bytes a round reads) and computes exactly what its float32
    layout does: fused features, the layer over 1, 5 and 20 pairs (the kernel at up to 16 columns, XLA past them),
    its logits; the caches it makes stay float32. A head with any other float32 entry stays float32."""
    from jaxspec import kernels

    if kernels.load_kernel() is not None or not kernels.small_product_columns():
        pytest.skip("jaxspec's CPU kernels are off or unavailable here")
    _, model, _ = tiny_llama3
    cfg, params = _head(model, scale=0.5, depth=3, top_k=2, num_nodes=5)
    assert isinstance(feature_major_head(params).fc, jax.Array) and feature_major_head(params).fc.dtype == jnp.float32
    rounded = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)  # bfloat16 values
    half = feature_major_head(rounded)
    assert half.fc.dtype == half.wqkv.dtype == half.lm_head.dtype == jnp.bfloat16
    assert half.input_norm.dtype == jnp.float32 and head_dtype(half) == jnp.float32
    full = dataclasses.replace(half, **{name: getattr(half, name).astype(jnp.float32)
                                        for name in ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")})
    rows, rng = 2, np.random.default_rng(1)
    d, n = model.config.hidden_size, len(cfg.feature_layers)
    hidden = jnp.asarray(rng.standard_normal((n, rows, 4, d)), jnp.float32)  # [n, B, 4, d]
    np.testing.assert_array_equal(fuse_features(half, hidden), fuse_features(full, hidden))
    forward_jit = jax.jit(head_forward, static_argnums=1)
    for t in (1, 5, 20):
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (rows, t)), jnp.int32)  # [B, T]
        feats = jnp.asarray(rng.standard_normal((rows, t, d)), jnp.float32)  # [B, T, d]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))  # [B, T]
        got = forward_jit(half, model.config, model.weights.embed, tokens, feats, positions)
        want = forward_jit(full, model.config, model.weights.embed, tokens, feats, positions)
        for g, w in zip(got, want):
            assert g.dtype == jnp.float32
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(head_logits(half, model.config, feats), head_logits(full, model.config, feats))


def test_a_head_with_one_child_per_node_drafts_chains(tiny_llama3):
    """`Eagle3Drafter.chain` (the commit then skips moving cache entries) holds for the trees the head drafts with
    top_k 1: node j's parent is j - 1, whatever the head's scores; with top_k 2 it is not claimed."""
    _, model, ref = tiny_llama3
    cfg, params = _head(model, scale=0.5, depth=4, top_k=1, num_nodes=4)
    assert cfg.make_drafter().chain
    assert not dataclasses.replace(cfg.make_drafter(), top_k=2).chain
    assert dataclasses.replace(cfg.make_drafter(), num_nodes=1, top_k=3).chain
    for length in (5, 9, 14):
        ids = ref["input_ids"][0].tolist()
        cache, h_root = _committed(params, model, cfg.make_drafter(), ids[:length], ids[length])
        tree, _ = draft_tree(params, model.config, model.weights.embed, cache, h_root, depth=4, top_k=1, num_nodes=4)
        np.testing.assert_array_equal(np.asarray(tree.parents[0]), chain_parents(4))


def test_static_tree_eagle1_variant(tiny_llama3):
    """`tree_choices` with a head on the top layer over the whole vocabulary (EAGLE-1): node j is the rank-r token
    of its parent's draft distribution on its own path, and greedy decoding equals autoregressive."""
    _, model, ref = tiny_llama3
    choices = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))
    cfg = Eagle3Config(feature_layers=(2,), draft_vocab_size=0, init_scale=0.5, tree_choices=choices)
    cfg = cfg.for_target(model.config)
    params = cfg.init_params(model.config, model.weights, jax.random.key(2))
    drafter = cfg.make_drafter()
    assert params.fc.shape == (64, 64) and params.lm_head.shape == (64, 256) and drafter.num_nodes == 8
    cache, h_root = _committed(params, model, drafter, ref["input_ids"][1, :9].tolist(), 3)
    tree = static_tree(params, model.config, model.weights.embed, cache, h_root, drafter.choices)
    tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
    assert parents.tolist() == [-1, -1, -1, 0, 0, 1, 3, 4]
    for choice, path in zip(drafter.choices, _paths(tokens, parents)):
        for rank, y, logp in zip(choice, path, _path_log_probs(params, model, cache, h_root, path)):
            assert y == int(np.argsort(-logp, kind="stable")[rank])
    prompts = _prompts(ref)
    expected = generate(model.weights, model.config, prompts, max_new_tokens=20, eos_ids=()).token_ids
    result = speculative_generate(model.weights, model.config, drafter, params, prompts, max_new_tokens=20,
                                  eos_ids=())
    assert result.token_ids == expected


def test_vocab_map():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
    d2t, t2d = build_vocab_map(counts, 5)
    assert d2t.tolist() == [2, 5, 0, 3, 7]  # by count, ties by id
    assert t2d.tolist() == [True, False, True, True, False, True, False, True]
    assert np.all(t2d[d2t]) and t2d.sum() == 5 and len(set(d2t.tolist())) == 5
    whole, all_in = build_vocab_map(counts, 8)
    assert sorted(whole.tolist()) == list(range(8)) and all_in.all()
    with pytest.raises(ValueError):
        build_vocab_map(counts, 9)
    # in the parameters: float-stored ids round-trip; draft logits scatter to their target ids, -inf elsewhere
    from jaxspec import load_model

    model = load_model(TINY)
    params = Eagle3Config(draft_vocab_size=5).init_params(model.config, model.weights, jax.random.key(0),
                                                          np.pad(counts, (0, 248)))
    assert np.asarray(draft_to_target(params)).tolist() == [2, 5, 0, 3, 7]
    assert np.asarray(target_to_draft_mask(params, 256))[:8].tolist() == t2d.tolist()
    full = np.asarray(to_target_logits(params, jnp.arange(5.0)[None], 256))[0]
    assert full[[2, 5, 0, 3, 7]].tolist() == [0, 1, 2, 3, 4] and np.isneginf(np.delete(full, [2, 5, 0, 3, 7])).all()
    # the LM head starts as the target's columns of those tokens
    np.testing.assert_array_equal(np.asarray(params.lm_head), np.asarray(model.weights.lm_head)[:, [2, 5, 0, 3, 7]])


def test_training_time_test_equals_a_manual_unroll(tiny_llama3):
    """TTT step i at column t equals the inference path: the head on pairs 0..t (causal), then a chain of i drafted
    nodes fed with the head's own outputs over that cache. Step 1 is not teacher-forced (it differs from feeding
    the target's own feature of the next position)."""
    _, model, ref = tiny_llama3
    cfg_t, w = model.config, model.weights
    cfg, params = _head(model, scale=0.5)
    drafter = cfg.make_drafter()
    s, steps = 14, 4
    tokens = jnp.asarray(ref["input_ids"][:1, :s], jnp.int32)
    out = forward(w, cfg_t, tokens, jnp.arange(s)[None], hidden_layers=drafter.target_layers)
    feats = fuse_features(params, out.hidden)  # [1, S, d]
    logits = ttt_logits(params, cfg_t, w.embed, tokens, feats, steps)
    for t in (0, 3, 8):
        h0, k0, v0 = head_forward(params, cfg_t, w.embed, tokens[:, 1: t + 2], feats[:, : t + 1],
                                  jnp.arange(t + 1)[None])
        np.testing.assert_allclose(np.asarray(logits[0][0, t]), np.asarray(head_logits(params, cfg_t, h0[0, t])),
                                   rtol=1e-4, atol=1e-4)
        cache = KVCache(k=k0.transpose(0, 2, 1, 3)[None], v=v0.transpose(0, 2, 1, 3)[None], lengths=jnp.array([t + 1]))
        chain_feats = [h0[:, t:t + 1]]
        for i in range(1, steps):
            if t + i + 1 >= s:
                break
            chain = tokens[:, t + 2: t + 2 + i]  # x_{t+2} .. x_{t+i+1}
            hs, _, _ = head_forward(params, cfg_t, w.embed, chain, jnp.concatenate(chain_feats, 1),
                                    t + 1 + jnp.arange(i)[None], cache)
            chain_feats.append(hs[:, -1:])
            np.testing.assert_allclose(np.asarray(logits[i][0, t]),
                                       np.asarray(head_logits(params, cfg_t, hs[0, -1])), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(logits[1][0, :-2]), np.asarray(logits[0][0, 1:-1]), atol=1e-3)


def test_training_lowers_the_loss_and_ships_a_lossless_drafter(tiny_data, tmp_path):
    from jaxspec.config_files import from_dict
    from jaxspec.data import RegeneratedDataset
    from jaxspec.drafters.eagle import eagle3_loss, response_token_counts
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.training.config import TrainConfig
    from jaxspec.training.distill import target_features, train

    target, data = tiny_data
    drafter_cfg = {"draft_vocab_size": 64, "depth": 3, "top_k": 2, "num_nodes": 5, "ttt_steps": 3}
    config = from_dict(TrainConfig, {
        "method": "eagle3", "target": TINY, "dtype": "float32",
        "data": {"path": data, "seq_len": 32, "eval_holdout": 4, "cache_features": True},  # the cached path
        "optim": {"learning_rate": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
        "loss": {"kind": "forward_kl", "position_decay": 0.8},
        "run": {"steps": 12, "batch_size": 4, "seed": 0, "out_dir": str(tmp_path / "run"), "save_every": 6,
                "eval_every": 12, "eval_prompts": 2, "log_every": 1},
        "drafter": drafter_cfg,
    })
    summary = train(config, progress=False)
    params = summary["params"]
    dataset = RegeneratedDataset(data)
    counts = response_token_counts(dataset, 256)
    d2t, _ = build_vocab_map(counts, 64)
    assert np.asarray(draft_to_target(params)).tolist() == d2t.tolist()  # the draft vocabulary comes from the data
    layers = (0, 1, 2)
    batch = next(dataset.batches(16, 32, seed=1))
    tokens = jnp.asarray(batch["tokens"])
    feats = target_features(target.weights, target.config, tokens, layers)
    fresh = Eagle3Config(**drafter_cfg).init_params(target.config, target.weights, jax.random.key(0), counts)

    def fixed_loss(p):
        return float(eagle3_loss(p, target.weights, target.config, tokens, feats.hidden, feats.last_hidden,
                                 jnp.asarray(batch["loss_mask"]), steps=3)[0])

    assert fixed_loss(params) < fixed_loss(fresh)
    # the tree by hand (the auto path is checked in test_untrained_methods_from_the_registry_equal_autoregressive)
    method = build_method("eagle3", target, MethodOptions(drafter=summary["drafter"], num_draft_tokens=3,
                                                          tree_width=2, tree_nodes=5))
    assert method.drafter.target_layers == layers and method.drafter.num_nodes == 5
    prompts = [[5, 9, 33, 2], list(range(40, 58))]
    expected = generate(target.weights, target.config, prompts, max_new_tokens=16, eos_ids=()).token_ids
    assert method.generate(prompts, max_new_tokens=16, eos_ids=()).token_ids == expected


def _tiny_eagle3_config(data: str, out_dir: str, vocab: int, lr: float, eval_holdout: int, **run):
    """A short EAGLE-3 training run on the tiny Llama-3's regenerated data (the vocabulary-moving tests)."""
    from jaxspec.config_files import from_dict
    from jaxspec.training.config import TrainConfig

    return from_dict(TrainConfig, {
        "method": "eagle3", "target": TINY, "dtype": "float32",
        "data": {"path": data, "seq_len": 32, "eval_holdout": eval_holdout},
        "optim": {"learning_rate": lr, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "loss": {"kind": "forward_kl", "position_decay": 0.8},
        "run": {"steps": 1, "batch_size": 4, "seed": 0, "out_dir": out_dir, "save_every": 1, "eval_every": 0,
                "log_every": 1, **run},
        "drafter": {"draft_vocab_size": vocab, "depth": 2, "top_k": 2, "num_nodes": 3, "ttt_steps": 2},
    })


def test_a_head_is_fine_tuned_into_another_draft_vocabulary(tiny_data, tmp_path):
    """run.init_from with another draft_vocab_size: the new head keeps every trained weight and the trained LM-head
    column of each token both vocabularies hold; a token new to it starts at the mean of those trained columns; the
    vocabulary is the data's most frequent tokens as for a fresh head. Other settings still refuse."""
    from jaxspec.config_files import from_dict, to_dict
    from jaxspec.data import RegeneratedDataset
    from jaxspec.drafters.eagle import response_token_counts
    from jaxspec.errors import UserError
    from jaxspec.training.config import TrainConfig
    from jaxspec.training.distill import train

    target, data = tiny_data

    def config(vocab, out, lr=3e-3, **run):
        return _tiny_eagle3_config(data, str(tmp_path / out), vocab, lr, eval_holdout=4, **run)

    small = train(config(16, "small", steps=3), progress=False)["params"]
    # one step at a learning rate of 1e-12 shows the starting point
    grown = train(config(48, "grown", lr=1e-12, init_from=str(tmp_path / "small" / "drafter")), progress=False)
    grown = grown["params"]
    counts = response_token_counts(RegeneratedDataset(data), 256)
    fresh = Eagle3Config(draft_vocab_size=48, depth=2, top_k=2, num_nodes=3, ttt_steps=2).init_params(
        target.config, target.weights, jax.random.key(0), counts)
    np.testing.assert_array_equal(np.asarray(draft_to_target(grown)), np.asarray(draft_to_target(fresh)))
    old_ids = np.asarray(draft_to_target(small)).tolist()
    new_ids = np.asarray(draft_to_target(grown)).tolist()
    assert set(old_ids) < set(new_ids)  # the 16 most frequent tokens are among the 48
    mean = np.asarray(small.lm_head).mean(axis=1)  # [d]: all 16 old tokens are kept
    for j, token in enumerate(new_ids):
        expected = small.lm_head[:, old_ids.index(token)] if token in old_ids else mean
        np.testing.assert_allclose(np.asarray(grown.lm_head[:, j]), np.asarray(expected), atol=1e-6)
    for name in ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "input_norm", "final_norm"):
        np.testing.assert_allclose(np.asarray(getattr(grown, name)), np.asarray(getattr(small, name)), atol=1e-6)
    plain = to_dict(config(48, "refused", init_from=str(tmp_path / "small" / "drafter")))
    plain["drafter"]["ttt_steps"] = 3
    with pytest.raises(UserError, match="other drafter settings.*ttt_steps"):
        train(from_dict(TrainConfig, plain), progress=False)


def test_a_fine_tuned_head_moves_to_its_new_datas_vocabulary_at_the_same_size(tiny_data, tmp_path):
    """run.rebuild_draft_vocab: fine-tuned on other data at the same draft_vocab_size, the head takes that data's
    most frequent tokens (a trained column kept for every token both vocabularies hold, a new one at their mean);
    without it the saved vocabulary stays."""
    from jaxspec.data import RegeneratedDataset, regenerate_ids
    from jaxspec.drafters.eagle import response_token_counts
    from jaxspec.training.distill import train

    target, data = tiny_data
    other = str(tmp_path / "other")  # answers to prompts of high token ids only: other frequent tokens
    rng = np.random.default_rng(1)
    regenerate_ids(target, [rng.integers(200, 256, size=8).tolist() for _ in range(12)], other, max_prompt_tokens=16,
                   max_new_tokens=20, batch_size=4, shard_size=6, progress=False)

    def config(path, out, lr=3e-3, **run):
        return _tiny_eagle3_config(path, str(tmp_path / out), 16, lr, eval_holdout=2, **run)

    first = train(config(data, "first", steps=2), progress=False)["params"]
    saved = str(tmp_path / "first" / "drafter")
    kept = train(config(other, "kept", lr=1e-12, init_from=saved), progress=False)["params"]
    moved = train(config(other, "moved", lr=1e-12, init_from=saved, rebuild_draft_vocab=True), progress=False)
    moved = moved["params"]
    counts = response_token_counts(RegeneratedDataset(other), 256)
    fresh = Eagle3Config(draft_vocab_size=16, depth=2, top_k=2, num_nodes=3, ttt_steps=2).init_params(
        target.config, target.weights, jax.random.key(0), counts)
    old_ids = np.asarray(draft_to_target(first)).tolist()
    new_ids = np.asarray(draft_to_target(moved)).tolist()
    assert np.asarray(draft_to_target(kept)).tolist() == old_ids
    assert new_ids == np.asarray(draft_to_target(fresh)).tolist() and set(new_ids) != set(old_ids)
    shared = [old_ids.index(token) for token in new_ids if token in old_ids]
    mean = np.asarray(first.lm_head)[:, shared].mean(axis=1)  # [d]: the kept trained columns' mean
    for j, token in enumerate(new_ids):
        expected = first.lm_head[:, old_ids.index(token)] if token in old_ids else mean
        np.testing.assert_allclose(np.asarray(moved.lm_head[:, j]), np.asarray(expected), atol=1e-6)
    np.testing.assert_allclose(np.asarray(moved.fc), np.asarray(first.fc), atol=1e-6)


def test_config_file_and_refusals(tiny_llama3):
    import os

    from jaxspec.config_files import from_dict, load_config
    from jaxspec.errors import UserError
    from jaxspec.training.config import TrainConfig

    _, model, _ = tiny_llama3
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "eagle3-smollm2-135m.yaml")
    config = load_config(path, TrainConfig, [])
    drafter = from_dict(Eagle3Config, dict(config.drafter), path="drafter")
    assert config.method == "eagle3" and drafter.feature_layers == (2, 15, 27) and drafter.draft_vocab_size == 4096
    assert Eagle3Config().for_target(dataclasses.replace(model.config, num_layers=30)).feature_layers == (2, 15, 27)
    with pytest.raises(UserError, match="num_nodes"):
        Eagle3Config(depth=2, top_k=2, num_nodes=7)  # at most 2 + 4 candidates
    with pytest.raises(UserError, match="feature_layers"):
        Eagle3Config(feature_layers=(0, 5)).for_target(model.config)  # the tiny target has 3 layers
    assert Eagle3Config(draft_vocab_size=0).for_target(model.config).draft_vocab_size == 256


def test_eagle1_training_regresses_features_with_the_target_lm_head_frozen(tiny_data, tmp_path):
    """`method: eagle` trains the EAGLE-1 head (feature regression + token loss, noise, teacher forcing): fc and the
    LM head stay the target's, the regression error falls, and one checkpoint serves `eagle` (static tree) and
    `eagle2` (dynamic tree) losslessly; `eagle3` refuses it."""
    from jaxspec.config_files import from_dict
    from jaxspec.errors import UserError
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.training.config import TrainConfig
    from jaxspec.training.distill import train

    target, data = tiny_data
    config = from_dict(TrainConfig, {
        "method": "eagle", "target": TINY, "dtype": "float32",
        "data": {"path": data, "seq_len": 32, "eval_holdout": 4},
        "optim": {"learning_rate": 1e-2, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
        "loss": {"kind": "forward_kl"},
        "run": {"steps": 16, "batch_size": 4, "seed": 0, "out_dir": str(tmp_path / "run"), "save_every": 16,
                "eval_every": 0, "log_every": 1},
        "drafter": {"init_scale": 0.02},
    })
    summary = train(config, progress=False)
    params = summary["params"]
    np.testing.assert_array_equal(np.asarray(params.fc), np.eye(64, dtype=np.float32))
    shared = np.asarray(target.weights.lm_head)[:, np.asarray(draft_to_target(params))]
    np.testing.assert_array_equal(np.asarray(params.lm_head), shared)  # the target's LM head (permuted), frozen
    from jaxspec.data import RegeneratedDataset
    from jaxspec.drafters.eagle import eagle1_config, eagle3_loss
    from jaxspec.training.distill import target_features

    batch = next(RegeneratedDataset(data).batches(16, 32, seed=1))
    tokens = jnp.asarray(batch["tokens"])
    feats = target_features(target.weights, target.config, tokens, (2,))
    fresh = eagle1_config(target.config).init_params(target.config, target.weights, jax.random.key(0))

    def regression_error(p):
        return float(eagle3_loss(p, target.weights, target.config, tokens, feats.hidden, feats.last_hidden,
                                 jnp.asarray(batch["loss_mask"]), steps=1, feature_weight=1.0)[1]["feature_step0"])

    assert regression_error(params) < 0.9 * regression_error(fresh)
    prompts = [[5, 9, 33, 2], list(range(40, 58))]
    expected = generate(target.weights, target.config, prompts, max_new_tokens=16, eos_ids=()).token_ids
    for name, hand in (("eagle", {}), ("eagle2", dict(num_draft_tokens=3, tree_width=2, tree_nodes=5))):
        method = build_method(name, target, MethodOptions(drafter=summary["drafter"], **hand))
        assert method.drafter.target_layers == (2,)
        assert method.generate(prompts, max_new_tokens=16, eos_ids=()).token_ids == expected
    with pytest.raises(UserError, match="'eagle' drafter, not 'eagle3'"):
        build_method("eagle3", target, MethodOptions(drafter=summary["drafter"]))


def test_tree_options_for_the_eagle_methods(tiny_llama3):
    from jaxspec.errors import UserError
    from jaxspec.methods import MethodOptions, build_method

    _, model, _ = tiny_llama3
    method = build_method("eagle2", model, MethodOptions(drafter="untrained", num_draft_tokens=4, tree_width=3,
                                                         tree_nodes=12))
    assert (method.drafter.depth, method.drafter.top_k, method.drafter.num_nodes) == (4, 3, 12)
    with pytest.raises(UserError, match="num_nodes must be between 1 and 6"):
        build_method("eagle3", model, MethodOptions(drafter="untrained", num_draft_tokens=2, tree_width=2,
                                                    tree_nodes=7))
    with pytest.raises(UserError, match="static tree"):
        build_method("eagle", model, MethodOptions(drafter="untrained", tree_nodes=8))
    with pytest.raises(UserError, match="--tree-nodes"):
        build_method("prompt-lookup", model, MethodOptions(tree_nodes=8))


def test_calibration_ranks_follow_greedy_answers_and_masses_sampled_ones(tiny_llama3, monkeypatch):
    """The head's ranks and the lookup runs are measured along the target's greedy answers to the calibration
    prompts (what T=0 rounds see); the target's masses of the head's candidates along answers it sampled at
    CALIBRATION_TEMPERATURE (what sampled rounds see: along greedy text they overrated deeper drafts at T=1), and
    along those sampled answers the head's ranks and the lookup runs too (what a lookup chain adds at T > 0)."""
    from jaxspec import methods
    from jaxspec.drafters import eagle
    from jaxspec.drafters.prompt_lookup import lookup_statistics

    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    monkeypatch.setattr(methods, "CALIBRATION_TOKENS", 12)
    texts, measured = {}, []
    real_generate, real_statistics = methods.generate, eagle.draft_statistics

    def recording_generate(*args, sampling=methods.GREEDY, **kwargs):
        result = real_generate(*args, sampling=sampling, **kwargs)
        texts[sampling.temperature] = result.token_ids
        return result

    def recording_statistics(params, weights, cfg, layers, tokens, lengths, starts, depth, top_k, head_cfg=None):
        answers = [list(row[s:n]) for row, s, n in zip(tokens, starts, lengths)]
        measured.append((answers, top_k))
        return real_statistics(params, weights, cfg, layers, tokens, lengths, starts, depth, top_k, head_cfg)

    monkeypatch.setattr(methods, "generate", recording_generate)
    monkeypatch.setattr(eagle, "draft_statistics", recording_statistics)
    ranks, runs, valid, mass, sampled = methods._measure_draft_ranks(model, cfg.make_drafter(), params)
    assert sorted(texts) == [0.0, methods.CALIBRATION_TEMPERATURE] and texts[0.0] != texts[1.0]  # the draws differ
    assert measured == [(texts[0.0], 0), (texts[1.0], methods.CALIBRATION_TOP_K)]
    assert ranks.shape[1] == methods.CALIBRATION_DEPTH and runs.shape == valid.shape == (len(ranks),)
    assert mass.shape[1:] == (methods.CALIBRATION_DEPTH, methods.CALIBRATION_TOP_K) and mass[:, 0, -1].mean() > 0
    assert np.all((mass >= 0) & (mass <= 1 + 1e-6))
    # at T > 0 the head's ranks and the lookup chain's runs along the sampled answers, at the masses' positions
    prompts = methods._calibration_prompts(model)
    rows = [p + a for p, a in zip(prompts, texts[1.0])]
    lengths = np.array([len(r) for r in rows])  # [R]
    tokens = np.array([r + [0] * (lengths.max() - len(r)) for r in rows])  # [R, S]
    starts = np.array([len(p) for p in prompts])  # [R]
    want_runs, want_valid = lookup_statistics(tokens, lengths, starts, methods.CALIBRATION_LOOKUP,
                                              methods.CALIBRATION_NGRAM)
    want_ranks, _ = real_statistics(params, model.weights, model.config, cfg.make_drafter().target_layers, tokens,
                                    lengths, starts, methods.CALIBRATION_DEPTH, 0, cfg.make_drafter().head_config(
                                        model.config))
    assert sampled.ranks.shape == (len(mass), methods.CALIBRATION_DEPTH)
    np.testing.assert_array_equal(sampled.ranks, want_ranks)
    np.testing.assert_array_equal(sampled.lookup_runs, want_runs)
    np.testing.assert_array_equal(sampled.lookup_valid, want_valid)


def test_draft_ranks_stored_in_the_drafter_folder(tiny_llama3, tmp_path, monkeypatch):
    """A drafter folder's draft-ranks.npz (scripts/calibrate_drafter.py) is read instead of measuring when it was
    made for this head and target with these calibration settings; of another target, or of another head (one
    retrained into the same folder), or of an older calibration that lacks some arrays, it is ignored and the
    ranks measured."""
    from jaxspec import methods
    from jaxspec.budget import SampledText

    _, model, _ = tiny_llama3
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    measured = np.full((3, methods.CALIBRATION_DEPTH), 7)  # [P, D]
    runs = np.array([0, 2, 5])  # [P]: the prompt-lookup runs at the same positions
    valid = np.array([4, 6, 12])  # [P]: its valid tokens there
    mass = np.full((3, methods.CALIBRATION_DEPTH, methods.CALIBRATION_TOP_K), 0.25)  # [P, D, K]
    sampled = SampledText(np.full((3, methods.CALIBRATION_DEPTH), 1), np.array([1, 0, 2]), np.array([3, 0, 12]))

    def profile(shift=0):
        return (measured + shift, runs + shift, valid - shift, mass / (1 + shift),
                SampledText(sampled.ranks + shift, sampled.lookup_runs + shift, sampled.lookup_valid - shift))

    monkeypatch.setattr(methods, "_measure_draft_ranks", lambda *a: profile())
    stored = np.arange(2 * methods.CALIBRATION_DEPTH).reshape(2, -1)  # [P, D]
    stored_runs, stored_valid = np.array([1, 3]), np.array([2, 12])
    stored_mass = np.full((2, methods.CALIBRATION_DEPTH, methods.CALIBRATION_TOP_K), 0.5)
    stored_sampled = dict(sampled_ranks=np.zeros((2, methods.CALIBRATION_DEPTH), int),
                          sampled_lookup_runs=np.array([2, 0]), sampled_lookup_valid=np.array([5, 1]))
    path = tmp_path / methods.DRAFT_RANKS_FILE
    params = {"w": np.zeros(3)}
    head = methods._head_digest(model, params)

    def plain(result):  # lists all the way down, to compare
        *arrays, text = result
        return (*(np.asarray(x).tolist() for x in arrays),
                *(np.asarray(x).tolist() for x in (text.ranks, text.lookup_runs, text.lookup_valid)))

    def read(p=params):
        return plain(methods.measured_draft_ranks(model, None, p, str(tmp_path)))

    def stored_file(**fields):
        np.savez(path, ranks=stored, calibration=methods._calibration_digest(), head=head, **fields)

    every = dict(lookup_runs=stored_runs, lookup_valid=stored_valid, draft_mass=stored_mass, **stored_sampled)
    stored_file(**every, target=model.fingerprint())
    assert read() == (stored.tolist(), stored_runs.tolist(), stored_valid.tolist(), stored_mass.tolist(),
                      *(x.tolist() for x in stored_sampled.values()))
    expected = plain(profile())
    stored_file(**every, target="another target")
    assert read() == expected
    for older in ("draft_mass", "lookup_valid", "sampled_ranks", "sampled_lookup_runs"):  # a file of before them
        stored_file(**{k: v for k, v in every.items() if k != older}, target=model.fingerprint())
        assert read() == expected
    assert methods.save_draft_ranks(str(tmp_path), model, None, params) == str(path)  # writes `measured`
    monkeypatch.setattr(methods, "_measure_draft_ranks", lambda *a: profile(1))
    assert read() == expected
    retrained = {"w": np.ones(3)}  # another head in the same folder: its own ranks, not the stored ones
    assert read(retrained) == plain(profile(1))


def test_measured_ranks_predict_each_round_of_a_real_chain(smollm2):
    """`draft_ranks` (the head fed the true tokens) predicts exactly how many drafts each round of a real greedy
    chain run accepts: the run's rounds start at roots t_0 = prompt end, t_{k+1} = t_k + accepted_k + 1, and at
    each the accepted count is the number of leading rank-0 steps (capped at the depth). Shipped EAGLE-3 head."""
    from jaxspec.drafters.eagle import draft_ranks, draft_statistics
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.tokenizer import encode_prompt

    depth = 3
    method = build_method("eagle3", smollm2, MethodOptions(num_draft_tokens=depth, tree_width=1, tree_nodes=depth))
    prompt = encode_prompt(smollm2.tokenizer, "Write a Python function that returns the squares of a list.")
    run = speculative_generate(smollm2.weights, smollm2.config, method.drafter, method.params, [prompt],
                               max_new_tokens=48, eos_ids=())
    text = prompt + run.token_ids[0]
    ranks = draft_ranks(method.params, smollm2.weights, smollm2.config, method.drafter.target_layers,
                        np.array([text]), np.array([len(text)]), np.array([len(prompt)]), depth)  # [P, depth]
    assert len(ranks) == len(text) - len(prompt) - 1
    root, checked = len(prompt) - 1, 0  # column t of the round whose root is token t + 1
    for accepted in run.accepted[0]:
        if root + 1 + depth >= len(text):
            break  # the run's end cut this round short
        leading = int(np.cumprod(ranks[root - (len(prompt) - 1)] == 0).sum())
        assert accepted == leading, f"round at root {root + 1}"
        root += accepted + 1
        checked += 1
    assert checked >= 10 and sum(run.accepted[0]) > 0  # the head does accept: the check has teeth
    # what a sampled round keeps (`draft_statistics`): the target's probability of the head's top-k candidates,
    # a probability growing with k; where the head's first candidate is the target's greedy token (rank 0) that
    # token has the largest probability, so it holds at least as much as the second candidate (a check that the
    # masses are read at the column that predicts the drafted token)
    same_ranks, mass = draft_statistics(method.params, smollm2.weights, smollm2.config, method.drafter.target_layers,
                                        np.array([text]), np.array([len(text)]), np.array([len(prompt)]), depth, 2)
    assert np.array_equal(same_ranks, ranks) and mass.shape == (len(ranks), depth, 2)
    assert np.all((mass >= 0) & (mass <= 1 + 1e-6)) and np.all(mass[..., 1] >= mass[..., 0])
    greedy_first = ranks == 0  # [P, depth]
    assert greedy_first.sum() >= 10
    assert np.all(mass[..., 0][greedy_first] >= (mass[..., 1] - mass[..., 0])[greedy_first] - 1e-6)
    assert np.mean(mass[..., 0][greedy_first]) > np.mean(mass[..., 0][ranks[:, :] > 0]) + 0.1


def test_lookup_runs_and_ranks_predict_each_round_of_a_real_merged_tree(smollm2):
    """With a prompt-lookup chain merged into the head's chain (Eagle3Drafter.lookup_depth), each round of a real
    greedy run accepts exactly the longer of the head's leading rank-0 steps (`draft_ranks`) and the lookup chain's
    run (`lookup_statistics`, capped at its length), where the chain's slots past its end hold the head's next-ranked
    first tokens (a first draft of rank below 1 + those slots is kept): the model `--budget auto` chooses by. Greedy
    output equals autoregressive decoding. Shipped EAGLE-3 head; a prompt whose answer repeats its own text."""
    from jaxspec.drafters.eagle import draft_ranks
    from jaxspec.drafters.prompt_lookup import lookup_statistics
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.tokenizer import encode_prompt

    depth, lookup = 2, 3
    method = build_method("eagle3", smollm2, MethodOptions(num_draft_tokens=depth, tree_width=1, tree_nodes=depth,
                                                           lookup_tokens=lookup))
    assert (method.drafter.num_nodes, method.drafter.lookup_depth) == (depth + lookup, lookup)
    prompt = encode_prompt(smollm2.tokenizer, "Repeat this list three times: red apple, green pear, blue plum.")
    run = speculative_generate(smollm2.weights, smollm2.config, method.drafter, method.params, [prompt],
                               max_new_tokens=64, eos_ids=())
    assert run.token_ids == generate(smollm2.weights, smollm2.config, [prompt], max_new_tokens=64,
                                     eos_ids=()).token_ids
    text = prompt + run.token_ids[0]
    args = (np.array([text]), np.array([len(text)]), np.array([len(prompt)]))
    ranks = draft_ranks(method.params, smollm2.weights, smollm2.config, method.drafter.target_layers, *args,
                        depth)  # [P, depth]
    runs, valid = lookup_statistics(*args, lookup)  # [P] each
    assert len(runs) == len(valid) == len(ranks) == len(text) - len(prompt) - 1
    root, checked, by_lookup, by_spare = len(prompt) - 1, 0, 0, 0
    for accepted in run.accepted[0]:
        if root + 1 + depth + lookup >= len(text):
            break  # the run's end cut this round short
        p = root - (len(prompt) - 1)
        head = int(np.cumprod(ranks[p] == 0).sum())
        spare = int(0 < ranks[p, 0] < 1 + lookup - valid[p])  # the head's first draft kept in a spare slot
        assert accepted == max(head, spare, int(runs[p])), f"round at root {root + 1}"
        by_lookup += int(runs[p]) > head
        by_spare += spare > max(head, int(runs[p]))
        root += accepted + 1
        checked += 1
    assert checked >= 8 and by_lookup >= 2 and by_spare >= 1  # the chain and the spares carry rounds: teeth


def test_auto_tree_merges_a_lookup_chain_at_t0_only(tiny_llama3):
    """--budget auto on hand-made ranks and lookup runs: text that repeats itself makes a lookup shape the choice at
    T=0 (drafter_for_batch sets the chain); for sampled decoding the lookup shapes are left out."""
    from jaxspec.budget import EAGLE_TOKEN_COUNTS, CostModel
    from jaxspec.methods import Method

    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    counts = list(EAGLE_TOKEN_COUNTS)
    cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                     seconds=[[1e-2 + 1e-4 * (t - 1) for t in counts]])
    ranks = np.full((100, 6), 5)  # [P, D]: the head never right
    runs = np.full(100, 6)  # [P]: the lookup chain always right for 6 tokens
    method = Method(name="eagle3", drafter=cfg.make_drafter(), params=params, target=model, cost_model=cost,
                    sampled_cost_model=cost, tree_ranks=ranks, lookup_runs=runs)
    greedy, sampled = method.drafter_for_batch(1), method.drafter_for_batch(1, greedy=False)
    # the shortest lookup chain of TREE_SHAPES (3, 5, 8, 12) that keeps all 6, under the cheapest head chain
    assert greedy.lookup_depth == 8 and greedy.num_nodes == method.auto_tree(1)[0].verified_nodes == 9
    # sampled: no lookup shapes, and a head that is never right pays for no tree: plain decoding
    assert sampled is None and all(not r["shape"].lookup for r in method.auto_tree(1, greedy=False)[1])
    assert "prompt-lookup chain of 8" in method.auto_table(1)[0]


def test_auto_tree_chooses_plain_decoding_when_no_tree_pays(tiny_llama3):
    """--budget auto weighs plain decoding (jaxspec.budget.PLAIN) beside the trees: where every tree is expected to
    be slower (a head rarely right, each verified token dear) it drafts nothing, and generate decodes plainly: the
    same tokens as autoregressive decoding, reported as rounds of one token (tau 1). Where the head is right, a tree."""
    from jaxspec.bench import _label, method_k
    from jaxspec.budget import EAGLE_TOKEN_COUNTS, PLAIN, CostModel
    from jaxspec.methods import Method

    cfg_t, model, _ = tiny_llama3
    cfg, params = _head(model)
    counts = list(EAGLE_TOKEN_COUNTS)
    cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                     seconds=[[1e-2 + 5e-3 * (t - 1) for t in counts]])  # each verified token: half a step more
    rarely = np.where(np.arange(100)[:, None] < 20, 0, 5) * np.ones((1, 6), int)  # [P, D]: right at 20% of positions
    method = Method(name="eagle3", drafter=cfg.make_drafter(), params=params, target=model, cost_model=cost,
                    tree_ranks=rarely)
    shape, rows = method.auto_tree(1)
    assert shape == PLAIN and rows[0]["shape"] == PLAIN and rows[0]["chosen"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and all(r["speedup"] < 1 for r in rows[1:])
    assert method.drafter_for_batch(1) is None and "no draft" in method.auto_table(1)[0]
    assert method_k(method) == 0 and _label(method) == "eagle3 K=0 (no draft)"
    prompts = [[1, 5, 9, 2], [3, 3, 7]]
    result = method.generate(prompts, max_new_tokens=8, eos_ids=())
    assert result.token_ids == generate(model.weights, model.config, prompts, max_new_tokens=8, eos_ids=()).token_ids
    assert result.tau == 1.0 and result.rounds == [7, 7] and result.accepted == [[0] * 7, [0] * 7]
    often = np.where(np.arange(100)[:, None] < 90, 0, 5) * np.ones((1, 6), int)  # right at 90%: a chain pays
    method = dataclasses.replace(method, tree_ranks=often)
    assert not method.auto_tree(1)[0].plain and method.drafter_for_batch(1) is not None


def test_sampled_rounds_are_sized_on_the_cost_of_sampled_verification(tiny_llama3):
    """At T > 0 each verified row also draws its token (Gumbel noise over the vocabulary and the noisy screen), which
    the greedy cost model leaves out: --budget auto costs the verification of a sampled round, and plain decoding's
    sampled step, on the sampled cost model (`Method.sampled_cost_model`), and the head's drafting on the greedy one.
    A chain that pays on greedy costs loses to plain decoding once each row's draw is paid."""
    from jaxspec.budget import EAGLE_TOKEN_COUNTS, PLAIN, CostModel, TreeShape
    from jaxspec.methods import Method

    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    counts = list(EAGLE_TOKEN_COUNTS)
    greedy_cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                            seconds=[[1e-2 + 1e-3 * (t - 1) for t in counts]])  # each verified token: a tenth of a step
    sampled_cost = CostModel(device="test-sampled", model="abc", batch_sizes=[1], token_counts=counts,
                             seconds=[[1.03e-2 + 8e-3 * (t - 1) for t in counts]])  # each row's draw dear
    mass = np.full((100, 6, 4), 0.8)  # [P, D, K]: the target's probability of the head's top-k candidates
    ranks = np.zeros((100, 6), int)  # [P, D]: at T=0 every draft kept
    method = Method(name="eagle3", drafter=cfg.make_drafter(), params=params, target=model, cost_model=greedy_cost,
                    sampled_cost_model=greedy_cost, tree_ranks=ranks, draft_mass=mass)
    cheap_shape, cheap_rows = method.auto_tree(1, greedy=False)
    assert not cheap_shape.plain and method.drafter_for_batch(1, greedy=False) is not None
    method = dataclasses.replace(method, sampled_cost_model=sampled_cost)
    shape, rows = method.auto_tree(1, greedy=False)
    assert shape == PLAIN and method.drafter_for_batch(1, greedy=False) is None
    for row, cheap in zip(rows, cheap_rows):  # the same shapes, tau and drafting; only the verification differs
        nodes = row["shape"].verified_nodes
        assert row["shape"] == cheap["shape"] and row["tau"] == cheap["tau"]
        assert row["draft_seconds"] == cheap["draft_seconds"]
        assert row["verify_seconds"] == pytest.approx(sampled_cost.verify_seconds(1, nodes + 1))
    chain = next(r for r in rows if r["shape"] == TreeShape(1, 1, 1))
    assert chain["speedup"] < 1 < next(r for r in cheap_rows if r["shape"] == TreeShape(1, 1, 1))["speedup"]
    assert not method.auto_tree(1)[0].plain  # T=0 stays on the greedy model


def test_sampled_rounds_may_draft_the_heads_first_tokens_side_by_side(tiny_llama3):
    """At T > 0 one of a node's deterministic children is kept with their target probability mass together, so where
    the head's second choice holds much of that mass, its top 2 first tokens side by side (a depth-1 tree) yield more
    a round than a chain, whose next level adds only the product of two top-1 masses: --budget auto picks that tree,
    and the drafter drafts it. At T=0 (every top choice right) a chain."""
    from jaxspec.budget import EAGLE_TOKEN_COUNTS, CostModel, TreeShape
    from jaxspec.methods import Method

    _, model, _ = tiny_llama3
    cfg, params = _head(model)
    counts = list(EAGLE_TOKEN_COUNTS)
    cost = CostModel(device="test", model="abc", batch_sizes=[1], token_counts=counts,
                     seconds=[[1e-2 + 1e-4 * (t - 1) for t in counts]])
    mass = np.zeros((100, 6, 4))  # [P, D, K]: the target's probability of the head's top-k candidates together
    mass[:, 0] = [0.3, 0.9, 0.905, 0.91]  # first tokens: the second choice holds most of the mass
    mass[:, 1:] = [0.05, 0.1, 0.12, 0.13]  # deeper levels rarely kept
    method = Method(name="eagle3", drafter=cfg.make_drafter(), params=params, target=model, cost_model=cost,
                    sampled_cost_model=cost, tree_ranks=np.zeros((100, 6), int), draft_mass=mass)
    shape, rows = method.auto_tree(1, greedy=False)
    tau = {r["shape"]: r["tau"] for r in rows}
    assert tau[TreeShape(1, 2, 2)] == pytest.approx(1.9) and tau[TreeShape(2, 1, 2)] == pytest.approx(1.315)
    assert shape == TreeShape(1, 2, 2)
    drafter = method.drafter_for_batch(1, greedy=False)
    assert (drafter.depth, drafter.top_k, drafter.num_nodes, drafter.lookup_depth) == (1, 2, 2, 0)
    assert method.auto_tree(1)[0].top_k == 1  # greedy: the top choice is always right, a chain


def test_merge_chain_builds_a_trie_without_duplicate_siblings():
    """A chain merged into a tree hangs under the tree's nodes while its tokens match them (those chain nodes are
    marked invalid), then goes on as new nodes; invalid chain nodes stay invalid."""
    from jaxspec.tree import merge_chain

    # tree: root -> 5 (node 0) -> 6 (node 1); root -> 7 (node 2)
    tree = DraftTree(tokens=jnp.array([[5, 6, 7]] * 3), parents=jnp.array([[-1, 0, -1]] * 3),
                     valid=jnp.array([[True, True, True]] * 3))
    chain = jnp.array([[5, 9, 6], [5, 6, 8], [7, 7, 7]])  # [B, K]
    valid = jnp.array([[True, True, True], [True, True, True], [True, True, False]])
    merged = merge_chain(tree, chain, valid)
    assert merged.tokens.tolist() == [[5, 6, 7, 5, 9, 6], [5, 6, 7, 5, 6, 8], [5, 6, 7, 7, 7, 7]]
    # row 0: 5 is node 0, 9 is new under it, 6 under 9 (not node 1: another parent)
    # row 1: 5 and 6 are nodes 0 and 1, 8 new under node 1; row 2: 7 is node 2, 7 new under it, the last invalid
    assert merged.parents.tolist() == [[-1, 0, -1, -1, 0, 4], [-1, 0, -1, -1, 0, 1], [-1, 0, -1, -1, 2, 4]]
    assert merged.valid.tolist() == [[True, True, True, False, True, True], [True, True, True, False, False, True],
                                     [True, True, True, False, True, False]]
    # the slots past the chain's end take spare root children in order; one equal to the chain's kept first token
    # is left invalid (row 2's chain token 7 is node 2: not refilled; row 0 has no match at all)
    valid = jnp.array([[False, False, False], [True, False, False], [True, True, False]])
    spares = jnp.array([[11, 12, 13], [10, 9, 14], [15, 16, 17]])  # ranked below the tree's
    chain = jnp.array([[0, 0, 0], [9, 0, 0], [7, 8, 0]])
    merged = merge_chain(tree, chain, valid, spares)
    assert merged.tokens.tolist() == [[5, 6, 7, 11, 12, 13], [5, 6, 7, 9, 10, 9], [5, 6, 7, 7, 8, 15]]
    assert merged.parents.tolist() == [[-1, 0, -1, -1, -1, -1], [-1, 0, -1, -1, -1, -1], [-1, 0, -1, -1, 2, -1]]
    assert merged.valid.tolist() == [[True, True, True, True, True, True], [True, True, True, True, True, False],
                                     [True, True, True, False, True, True]]


def test_eagle_tree_options_are_checked_before_any_model_loads():
    """--budget auto and a tree by hand exclude each other; a numeric budget is refused for the dynamic trees."""
    from jaxspec.errors import UserError
    from jaxspec.methods import MethodOptions, check_method_options

    assert not MethodOptions().tree_by_hand
    for by_hand in (dict(num_draft_tokens=3), dict(tree_width=2), dict(tree_nodes=6)):
        options = MethodOptions(budget="auto", **by_hand)
        assert options.tree_by_hand
        with pytest.raises(UserError, match="not both"):
            check_method_options("eagle3", options)
        check_method_options("eagle3", MethodOptions(**by_hand))  # the tree by hand alone is fine
    with pytest.raises(UserError, match="not a number"):
        check_method_options("eagle2", MethodOptions(budget=16))
    check_method_options("eagle2", MethodOptions(budget="auto"))
