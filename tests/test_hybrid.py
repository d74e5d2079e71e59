"""A hybrid target (the tiny Qwen3.5: two Gated DeltaNet layers, one attention layer) through a verification round
by hand: a tree whose accepted path runs through a second sibling and stops mid-tree. After the commit, the
recurrent and conv states (and the next logits) equal a fresh prefill of the committed text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec import load_model
from jaxspec.cache import commit_positions, commit_recurrent, init_cache
from jaxspec.generate import decode_step, prefill
from jaxspec.sampling import GREEDY, SamplingConfig
from jaxspec.tree import DraftTree
from jaxspec.verification import verify_and_accept, verify_forward


def test_a_round_that_rejects_mid_tree_leaves_the_state_of_a_fresh_prefill():
    model = load_model(fixture_path("tiny-qwen3_5"), with_tokenizer=False)
    cfg, w = model.config, model.weights
    ref = np.load(fixture_path("tiny_qwen3_5_reference.npz"))
    context = jnp.asarray(ref["input_ids"][:1, :12])  # [1, 12]
    cache = init_cache(cfg, 1, 64)
    logits, _, cache = prefill(w, cfg, context, jnp.array([12]), cache)
    root = jnp.argmax(logits, -1).astype(jnp.int32)  # [1]: the token after the context, not yet in the cache
    # the target's own greedy continuation after the root: g1, g2, g3
    greedy, probe = [], cache
    token = root
    for _ in range(3):
        step, probe = decode_step(w, cfg, token, probe, jnp.ones(1, bool))
        token = jnp.argmax(step, -1).astype(jnp.int32)
        greedy.append(int(token[0]))
    g1, g2, g3 = greedy
    wrong = [(g + 7) % cfg.vocab_size for g in greedy]
    # nodes: 0 wrong (child of root), 1 g1 (its sibling), 2 g2 (under 1), 3 wrong (under 2), 4 wrong (under 1)
    tree = DraftTree(tokens=jnp.asarray([[wrong[0], g1, g2, wrong[2], wrong[1]]], jnp.int32),
                     parents=jnp.asarray([[-1, -1, 1, 2, 1]], jnp.int32), valid=jnp.ones((1, 5), bool))
    verification = verify_forward(w, cfg, cache, root, tree)
    acc = verify_and_accept(tree, verification.logits, GREEDY, jnp.zeros((1, 5)), jnp.zeros((1,)))
    assert int(acc.num_accepted[0]) == 2  # g1, g2 accepted through the second sibling; g3 is the bonus
    assert acc.path[0, :3].tolist() == [0, 2, 3] and int(acc.bonus[0]) == g3
    committed = acc.num_accepted + 1
    after = commit_positions(verification.cache, acc.path, committed)
    after = commit_recurrent(after, verification.pending, acc.path, committed)

    text = jnp.concatenate([context, jnp.asarray([[int(root[0]), g1, g2]], jnp.int32)], axis=1)  # [1, 15]
    _, _, fresh = prefill(w, cfg, text, jnp.array([15]), init_cache(cfg, 1, 64))
    assert after.lengths.tolist() == fresh.lengths.tolist() == [15]
    np.testing.assert_allclose(np.asarray(after.state), np.asarray(fresh.state), atol=1e-5)
    # the conv buffers hold projections of each layer's input, like k: layer 1's input comes out of layer 0 by the
    # tree-masked path here and the chunked path there, so the two agree to float32 rounding (1.4e-6 seen), as k does
    np.testing.assert_allclose(np.asarray(after.conv), np.asarray(fresh.conv), atol=1e-5)
    np.testing.assert_allclose(np.asarray(after.k[:, :, :, :15]), np.asarray(fresh.k[:, :, :, :15]), atol=1e-5)
    next_after, _ = decode_step(w, cfg, jnp.asarray([g3]), after, jnp.ones(1, bool))
    next_fresh, _ = decode_step(w, cfg, jnp.asarray([g3]), fresh, jnp.ones(1, bool))
    np.testing.assert_allclose(np.asarray(next_after), np.asarray(next_fresh), atol=1e-4)
    # the state moved: a commit that ignored the round would not pass the checks above
    assert not np.allclose(np.asarray(after.state), np.asarray(cache.state), atol=1e-3)


def test_sampling_through_a_hybrid_target_keeps_its_distribution():
    """At T > 0 with temperature, top-k and top-p, trees whose siblings take different recurrent states (a
    draft-model tree of top-2 siblings and EAGLE-3's dynamic tree, drafting for a tiny random hybrid target over a
    vocabulary of 8) emit the target's own distribution of the first 3 tokens, enumerated exactly (chi-square, as
    tests/test_sampled_loop.py does for attention targets)."""
    from unittest import mock

    import test_sampled_loop as sampled

    from jaxspec.config import FULL, LINEAR, ModelConfig
    from jaxspec.drafters import DraftModelDrafter
    from jaxspec.drafters.eagle import Eagle3Config
    from jaxspec.model import init_weights
    from jaxspec.speculative import speculative_generate

    hybrid = ModelConfig(architecture="qwen3_5", vocab_size=sampled.V, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, partial_rotary_factor=0.5,
                         attention_output_gate=True, layer_types=(LINEAR, FULL), linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                         max_position_embeddings=64)
    target = init_weights(hybrid, jax.random.key(21), scale=0.5)
    counts = np.arange(sampled.V)[::-1].copy()
    eagle = Eagle3Config(feature_layers=(0, 1), draft_vocab_size=6, depth=3, top_k=2, num_nodes=5, init_scale=0.5)
    cases = [(DraftModelDrafter(depth=2, tree_width=2, draft_cfg=sampled.CFG), sampled.DRAFT),  # an attention draft
             (eagle.for_target(hybrid).make_drafter(), eagle.init_params(hybrid, target, jax.random.key(3), counts))]
    with mock.patch.multiple(sampled, CFG=hybrid, TARGET=target):  # the enumeration, on the hybrid target
        expected = sampled._target_distribution.__wrapped__(sampled.SAMPLING)
    assert max(expected.values()) < 0.5 and sum(p > 0.01 for p in expected.values()) >= 10  # it hesitates
    for drafter, params in cases:
        rows = speculative_generate(target, hybrid, drafter, params, [list(sampled.PROMPT)] * sampled.ROWS,
                                    max_new_tokens=sampled.NEW, sampling=sampled.SAMPLING, seed=2,
                                    eos_ids=()).token_ids
        assert sampled._p_value(rows, expected) > 1e-3, type(drafter).__name__


def test_a_long_prefill_runs_in_chunks_and_equals_decoding_token_by_token():
    """A 100-token prompt (two chunks of 64 in the linear-attention layers) gives the logits of the single-chunk
    tree form, and leaves the states that feeding the same tokens one at a time leaves."""
    from jaxspec.model import causal_mask, forward

    model = load_model(fixture_path("tiny-qwen3_5"), with_tokenizer=False)
    cfg, w = model.config, model.weights
    ids = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 100)), jnp.int32)
    positions = jnp.arange(100)[None]
    chunked = forward(w, cfg, ids, positions).logits
    whole = forward(w, cfg, ids, positions, mask=causal_mask(1, 100)).logits  # an explicit mask: the tree form
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-4)
    _, _, prefilled = prefill(w, cfg, ids, jnp.array([100]), init_cache(cfg, 1, 128))
    stepped = init_cache(cfg, 1, 128)
    for i in range(100):
        _, stepped = decode_step(w, cfg, ids[:, i], stepped, jnp.ones(1, bool))
    np.testing.assert_allclose(np.asarray(prefilled.state), np.asarray(stepped.state), atol=1e-4)
    np.testing.assert_allclose(np.asarray(prefilled.conv), np.asarray(stepped.conv), atol=1e-5)  # layer 1 reads layer 0


# ---------------------------------------------------------------------------------------------- pipelines


def _hybrid_pipeline_model(vocab: int, scale: float, seed: int = 0):
    """A random Qwen3.5-shaped model of 4 layers (three Gated DeltaNet layers, then attention), so that 4 stages of
    one layer each put linear-attention layers in stages that a flush cuts at different depths."""
    from jaxspec.config import FULL, LINEAR, ModelConfig
    from jaxspec.model import init_weights

    cfg = ModelConfig(architecture="qwen3_5", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, partial_rotary_factor=0.5,
                      attention_output_gate=True, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel=4, max_position_embeddings=256)
    return cfg, init_weights(cfg, jax.random.key(seed), scale=scale)


def _relative_error(actual, desired) -> float:
    """max |actual - desired| over max |desired|."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    return float(np.max(np.abs(actual - desired)) / np.max(np.abs(desired)))


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_a_pipeline_over_a_hybrid_target_restarts_from_the_kept_state(sampling):
    """PPSD through 4 stages of a hybrid target, with an untrained early exit that is rejected often: greedy output
    equals autoregressive decoding, and at the end every linear-attention layer's ring holds, at the slot of the last
    committed position, the conv and recurrent states of plain decoding of the committed text (and every committed
    attention slot its keys): a flush that left the flushed tokens' updates in the state would fail both."""
    from jaxspec.drafters.ppsd import EarlyExitPipelineDrafter
    from jaxspec.generate import generate, pad_prompts
    from jaxspec.pipeline import pipeline_generate_tokens

    cfg, weights = _hybrid_pipeline_model(vocab=64, scale=0.5)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    n, new = 4, 16
    batch = pad_prompts(prompts, new, cfg, draft_slots=n + 1)
    out, counts, stats, (cache, committed) = pipeline_generate_tokens(
        weights, cfg, EarlyExitPipelineDrafter(num_stages=n), None, jnp.asarray(batch.tokens),
        jnp.asarray(batch.lengths), jax.random.key(0), max_new_tokens=new, cache_size=batch.cache_size,
        sampling=sampling)
    assert int(stats["rejections"].sum()) > 5 and int(stats["exits"].sum()) > int(stats["rejections"].sum())
    if sampling.greedy:
        assert np.asarray(out).tolist() == generate(weights, cfg, prompts, max_new_tokens=new, eos_ids=()).token_ids
    for row, prompt in enumerate(prompts):
        c = int(committed[row])
        text = prompt + np.asarray(out[row]).tolist()
        assert len(prompt) < c <= len(text)
        # the reference computes as the pipeline does: the prompt prefilled, then the committed tokens one by one
        _, _, fresh = prefill(weights, cfg, jnp.asarray([prompt]), jnp.array([len(prompt)]), init_cache(cfg, 1, 64))
        for token in text[len(prompt):c]:
            _, fresh = decode_step(weights, cfg, jnp.asarray([token]), fresh, jnp.ones(1, bool))
        slot = (c - 1) % n
        # float32 rounding apart (two programs, through three recurrent layers): within 1e-4 of each array's
        # largest value (conv inputs reach 6-11 at this weight scale); the neighbouring slot, a state one token
        # older, is 1e-2 of it off or more, as a state with a flushed token's update in it would be
        pairs = [(cache.state[:, row, slot], fresh.state[:, 0]), (cache.conv[:, row, slot], fresh.conv[:, 0]),
                 (cache.k[:, row, :, :c], fresh.k[:, 0, :, :c])]
        for actual, desired in pairs:
            assert _relative_error(actual, desired) < 1e-4
        assert _relative_error(cache.state[:, row, (c - 2) % n], fresh.state[:, 0]) > 1e-2
        assert _relative_error(cache.conv[:, row, (c - 2) % n], fresh.conv[:, 0]) > 1e-2


@pytest.mark.optimized  # 3 x 4000 rows through 4 stages
def test_a_pipeline_over_a_hybrid_target_keeps_its_distribution():
    """12,000 sampled 3-token continuations of PPSD over the 4-stage hybrid target against its exact distribution
    (all 6^3 sequences enumerated), as tests/test_pipeline.py checks attention targets; the same samples fail
    against the distribution at 1.5x the temperature, so the check can fail."""
    from test_pipeline import _chi_square, _chi_square_threshold, exact_distribution

    from jaxspec.drafters.ppsd import EarlyExitPipelineDrafter
    from jaxspec.generate import pad_prompts
    from jaxspec.pipeline import pipeline_generate_tokens

    cfg, weights = _hybrid_pipeline_model(vocab=6, scale=0.3)
    sampling = SamplingConfig(temperature=0.9, top_k=4)
    prompt, length, rows, n = [1, 2, 3], 3, 4000, 4
    batch = pad_prompts([prompt] * rows, length, cfg, draft_slots=n + 1)
    exact = exact_distribution(cfg, weights, prompt, length, sampling)
    counts, rejections, exits = np.zeros(cfg.vocab_size ** length), 0, 0
    for seed in range(3):
        out, _, stats, _ = pipeline_generate_tokens(
            weights, cfg, EarlyExitPipelineDrafter(num_stages=n), None, jnp.asarray(batch.tokens),
            jnp.asarray(batch.lengths), jax.random.key(seed), max_new_tokens=length, cache_size=batch.cache_size,
            sampling=sampling)
        counts += np.bincount(np.asarray(out) @ (cfg.vocab_size ** np.arange(length - 1, -1, -1)),
                              minlength=counts.size)
        rejections, exits = rejections + int(stats["rejections"].sum()), exits + int(stats["exits"].sum())
    assert 0.05 * exits < rejections < 0.95 * exits, (rejections, exits)
    stat, df = _chi_square(counts, exact)
    assert stat < _chi_square_threshold(df), (stat, df)
    other = exact_distribution(cfg, weights, prompt, length, SamplingConfig(temperature=1.35, top_k=4))
    stat_other, df_other = _chi_square(counts, other)
    assert stat_other > _chi_square_threshold(df_other), stat_other


def test_pipelines_over_a_hybrid_target_refuse_what_they_cannot_do():
    from jaxspec.errors import UserError
    from jaxspec.pipeline import check_pipeline

    cfg, _ = _hybrid_pipeline_model(vocab=64, scale=0.5)
    check_pipeline(cfg, 4)
    check_pipeline(cfg, 2)
    with pytest.raises(UserError, match="siblings .*--tree-width 2"):
        check_pipeline(cfg, 4, tree_width=2)
    with pytest.raises(UserError, match="one device.*--stage-devices"):
        check_pipeline(cfg, 4, stage_devices=2)
    with pytest.raises(UserError, match="--num-stages must divide"):
        check_pipeline(cfg, 3)
