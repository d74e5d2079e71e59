"""The forward pass against Hugging Face transformers (torch) on the same weights.

Reference values come from scripts/make_reference.py (transformers 5.24 + torch 2.13, float32), committed under
tests/fixtures/ because torch is not a jaxspec dependency.
"""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KVCache, init_cache
from jaxspec.config import LLAMA3_8B, QWEN3_8B, ModelConfig, RopeScaling
from jaxspec.generate import decode_step, generate, prefill
from jaxspec.model import Weights, causal_mask, forward


def _positions(ids):
    return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)


def test_tiny_logits_and_hidden_states_match_transformers(tiny):
    name, model, ref = tiny
    ids = jnp.asarray(ref["input_ids"])  # [2, 40]
    cfg = model.config
    out = forward(model.weights, cfg, ids, _positions(ids), hidden_layers=tuple(range(cfg.num_layers)))
    np.testing.assert_allclose(np.asarray(out.logits), ref["logits"], atol=1e-4, rtol=1e-4, err_msg=name)
    # HF hidden_states[i + 1] is the output of layer i, except the last, which HF gives after the final norm.
    for i in range(cfg.num_layers - 1):
        np.testing.assert_allclose(np.asarray(out.hidden[i]), ref["hidden_states"][i + 1], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out.hidden[-1]), np.asarray(out.last_hidden))


def test_tiny_greedy_matches_transformers(tiny):
    name, model, ref = tiny
    prompt = ref["prompt"][0].tolist()
    result = generate(model.weights, model.config, [prompt], max_new_tokens=20, eos_ids=())
    assert result.token_ids[0] == ref["greedy"][0].tolist(), name


def test_smollm2_logits_match_transformers(smollm2, smollm2_reference):
    ref = smollm2_reference
    ids = jnp.asarray(ref["logits_ids"])  # [1, 37]
    logits = np.asarray(forward(smollm2.weights, smollm2.config, ids, _positions(ids)).logits[0])
    # Same dequantized float32 weights; differences are float32 summation order (observed 6e-5 on logits ~37).
    np.testing.assert_allclose(logits[-8:], ref["logits"], atol=1e-3)
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits_all_argmax"])
    np.testing.assert_allclose(logits.max(-1), ref["logits_all_max"], atol=1e-3)


def test_smollm2_greedy_chat_matches_transformers_batched(smollm2, smollm2_reference):
    """Four chat prompts of different lengths in one batch; each row equals transformers' greedy output."""
    ref = smollm2_reference
    import json

    from jaxspec.tokenizer import encode_prompt

    prompts = json.loads(str(ref["prompts"]))
    ids = [encode_prompt(smollm2.tokenizer, p) for p in prompts]
    for i, row in enumerate(ids):
        assert row == ref[f"prompt_ids_{i}"].reshape(-1).tolist()
    assert len({len(r) for r in ids}) > 1, "the prompts should have different lengths"
    result = generate(smollm2.weights, smollm2.config, ids, max_new_tokens=48)
    for i in range(len(prompts)):
        assert result.token_ids[i] == ref[f"greedy_{i}"].reshape(-1).tolist(), prompts[i]


def test_gemma3_270m_logits_and_greedy_match_transformers(gemma3_270m):
    """The real Gemma-3-270M (18 layers, 15 of them sliding-window, a 262144-token tied embedding) against
    transformers on the same dequantized weights: the top-64 logits of every prompt position, and 32 greedy tokens
    per prompt (batched, prompts of different lengths)."""
    ref = np.load("tests/fixtures/gemma3_270m_reference.npz")
    cfg, w = gemma3_270m.config, gemma3_270m.weights
    assert (cfg.architecture, cfg.num_layers, cfg.sliding_layers.count(True), cfg.sliding_window) == ("gemma3", 18,
                                                                                                      15, 512)
    prompts = [ref[f"prompt_ids_{i}"][0].tolist() for i in range(3)]
    for i, prompt in enumerate(prompts):
        ids = jnp.asarray([prompt])
        logits = np.asarray(forward(w, cfg, ids, _positions(ids)).logits[0])  # [P, V]
        top = ref[f"top_ids_{i}"]  # [P, 64]
        np.testing.assert_allclose(np.take_along_axis(logits, top, axis=-1), ref[f"top_logits_{i}"], atol=2e-4)
        np.testing.assert_array_equal(logits.argmax(-1), top[:, 0])
    assert len({len(p) for p in prompts}) > 1
    result = generate(w, cfg, prompts, max_new_tokens=32, eos_ids=())
    for i in range(3):
        assert result.token_ids[i] == ref[f"greedy_{i}"][0].tolist(), i


@pytest.mark.parametrize("name, multimodal", [("gemma3", "gemma3"), ("qwen3_5", "qwen3_5"),
                                              ("qwen3_5_moe", "qwen3_5_moe")])
def test_a_multimodal_folder_runs_its_language_model(tmp_path, name, multimodal):
    """A published gemma3, qwen3_5 or qwen3_5_moe folder (a vision tower beside the language model: config.json with
    text_config, tensors under model.language_model.) loads as its text model: the same config and logits as the
    text-only folder."""
    import json

    from safetensors.numpy import load_file, save_file

    from jaxspec import load_model

    text = f"tests/fixtures/tiny-{name}"
    with open(f"{text}/config.json") as f:
        text_config = json.load(f)
    config = {"model_type": multimodal, "text_config": text_config, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model."): value
               for name, value in load_file(f"{text}/model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)  # not read
    save_file(tensors, str(tmp_path / "model.safetensors"))
    alone, inside = load_model(text, with_tokenizer=False), load_model(str(tmp_path), with_tokenizer=False)
    assert inside.config == alone.config
    ids = jnp.asarray(np.load(f"tests/fixtures/tiny_{name}_reference.npz")["input_ids"])
    np.testing.assert_array_equal(np.asarray(forward(inside.weights, inside.config, ids, _positions(ids)).logits),
                                  np.asarray(forward(alone.weights, alone.config, ids, _positions(ids)).logits))


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' in config.json is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must name"),
])
def test_gemma3_config_fields_jaxspec_does_not_run_are_refused_by_name(change, message):
    import json

    from jaxspec.errors import UserError

    with open("tests/fixtures/tiny-gemma3/config.json") as f:
        raw = {**json.load(f), **change}
    with pytest.raises(UserError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_cached_decoding_equals_full_forward(tiny):
    """Prefill 30 tokens, decode 10 one at a time: logits equal one forward over all 40."""
    _, model, ref = tiny
    cfg, w = model.config, model.weights
    ids = jnp.asarray(ref["input_ids"])  # [2, 40]
    full = np.asarray(forward(w, cfg, ids, _positions(ids)).logits)
    cache = init_cache(cfg, 2, 64)
    lengths = jnp.array([30, 30], jnp.int32)
    last, _, cache = prefill(w, cfg, ids[:, :30], lengths, cache)
    np.testing.assert_allclose(np.asarray(last), full[:, 29], atol=1e-4)
    for t in range(30, 40):
        logits, cache = decode_step(w, cfg, ids[:, t], cache, jnp.ones(2, bool))
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-4)
    assert cache.lengths.tolist() == [40, 40]


def test_tree_mask_verification_equals_separate_branches(tiny):
    """Two branches verified together under an ancestor mask give the logits of each branch run alone."""
    _, model, ref = tiny
    cfg, w = model.config, model.weights
    ids = jnp.asarray(ref["input_ids"][:1])  # [1, 40]
    context, a, b = ids[:, :20], ids[:, 20:23], ids[:, 30:32]
    cache = init_cache(cfg, 1, 64)
    _, _, cache = prefill(w, cfg, context, jnp.array([20]), cache)
    # nodes: a0 a1 a2 (chain) and b0 b1 (chain), both hanging off the context
    tokens = jnp.concatenate([a, b], axis=1)  # [1, 5]
    positions = jnp.array([[20, 21, 22, 20, 21]], jnp.int32)
    mask = jnp.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], bool)
    tree = forward(w, cfg, tokens, positions, cache, mask[None]).logits[0]
    for branch, rows in ((a, slice(0, 3)), (b, slice(3, 5))):
        seq = jnp.concatenate([context, branch], axis=1)
        alone = forward(w, cfg, seq, _positions(seq)).logits[0, 20:]
        np.testing.assert_allclose(np.asarray(tree[rows]), np.asarray(alone), atol=1e-4)


def test_layer_range_composes_to_full_forward(tiny):
    _, model, ref = tiny
    cfg, w = model.config, model.weights
    ids = jnp.asarray(ref["input_ids"])
    pos = _positions(ids)
    if cfg.is_hybrid:  # its layers run at once (early exit and pipeline stages are refused for it by name)
        with pytest.raises(ValueError, match="hybrid model runs all its layers at once"):
            forward(w, cfg, ids, pos, layer_range=(0, 1), compute_logits=False)
        return
    full = forward(w, cfg, ids, pos)
    low = forward(w, cfg, ids, pos, layer_range=(0, 1), compute_logits=False)
    assert low.logits is None
    high = forward(w, cfg, None, pos, layer_range=(1, cfg.num_layers), hidden_in=low.last_hidden)
    np.testing.assert_allclose(np.asarray(high.logits), np.asarray(full.logits), atol=1e-5)


def test_lm_head_on_a_reduced_vocabulary_is_the_full_logits_columns(tiny):
    """`lm_head(..., vocab)` (what drafter training uses instead of the [B, S, V] logits) takes the same columns,
    with tied embeddings and with a separate output matrix."""
    import dataclasses

    from jaxspec.model import lm_head

    _, model, ref = tiny
    cfg, w = model.config, model.weights
    x = forward(w, cfg, jnp.asarray(ref["input_ids"]), _positions(jnp.asarray(ref["input_ids"])),
                compute_logits=False).last_hidden  # [B, T, d]
    vocab = jnp.asarray([7, 0, cfg.vocab_size - 1, 31, 7], jnp.int32)
    untied = dataclasses.replace(w, lm_head=jnp.asarray(np.random.default_rng(0).normal(
        size=(cfg.hidden_size, cfg.vocab_size)), w.embed.dtype))
    for weights in (dataclasses.replace(w, lm_head=None), untied):
        full = np.asarray(lm_head(weights, cfg, x))  # [B, T, V]
        np.testing.assert_allclose(np.asarray(lm_head(weights, cfg, x, vocab)), full[..., np.asarray(vocab)],
                                   rtol=1e-5, atol=1e-5)


def test_greedy_tokens_through_the_bfloat16_screen_are_the_float32_argmax(tiny_llama3):
    """`greedy_tokens` with a `HeadScreen` (the CPU layout) gives the argmax of the float32 logits: tied and untied
    output matrices, the lowest id where two tokens tie exactly, and the float32 logits deciding where the screen
    cannot be sure (an error bound too wide to certify anything)."""
    import dataclasses

    from jaxspec.model import HeadScreen, greedy_tokens, head_screen, lm_head

    _, model, ref = tiny_llama3
    cfg, w = model.config, model.weights
    rng = np.random.default_rng(0)
    embed = np.asarray(w.embed).copy()
    embed[40] = embed[9]  # tokens 9 and 40 score alike for every h
    tied = dataclasses.replace(w, embed=jnp.asarray(embed), lm_head=None)
    untied = dataclasses.replace(w, lm_head=jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)) * 0.05,
                                                        jnp.float32))
    x = jnp.asarray(rng.normal(size=(2, 6, cfg.hidden_size)), jnp.float32)  # [B, T, d]
    x = x.at[1, 2].set(jnp.asarray(embed[9]) / w.final_norm * 30.0)  # a position whose argmax is the tie 9 / 40
    for weights in (tied, untied):
        screen = head_screen(weights)
        assert screen is not None and screen.matrix.dtype == jnp.bfloat16 and 0 < float(screen.error) < 1e-2
        expected = np.argmax(np.asarray(lm_head(weights, cfg, x)), axis=-1)  # [B, T]
        for certain in (True, False):
            use = screen if certain else dataclasses.replace(screen, error=jnp.float32(1e6))
            got = jax.jit(greedy_tokens, static_argnums=1)(dataclasses.replace(weights, head_screen=use), cfg, x)
            assert got.dtype == jnp.int32 and got.shape == (2, 6)
            np.testing.assert_array_equal(np.asarray(got), expected)
    assert np.argmax(np.asarray(lm_head(tied, cfg, x))[1, 2]) == 9  # the tie was reached, and went to the lower id
    # a screen that misranks the winners (their rows zeroed), with its honest error bound: the float32 logits decide
    expected = np.argmax(np.asarray(lm_head(untied, cfg, x)), axis=-1)  # [B, T]
    rows = np.asarray(untied.lm_head).T.astype(np.float64)  # [V, d]
    wrong = rows.copy()
    wrong[np.unique(expected)] = 0.0
    d, unit = rows.shape[1], 2.0 ** -24
    bound = (np.sqrt(np.max(np.sum((wrong - rows) ** 2, axis=1)))
             + 2 * d * unit / (1 - d * unit) * np.sqrt(np.max(np.sum(rows ** 2, axis=1))))
    misranking = HeadScreen(matrix=jnp.asarray(wrong, jnp.bfloat16), error=jnp.float32(bound))
    got = jax.jit(greedy_tokens, static_argnums=1)(dataclasses.replace(untied, head_screen=misranking), cfg, x)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_the_cpu_layout_keeps_an_untied_output_matrix_as_rows(tiny_llama3):
    """An untied LM head (lm_head [d, V]) is transposed once into the CPU layout's `HeadScreen` (its float32 rows),
    not inside every jitted step (for Qwen2.5-Coder-1.5B that copy was 0.93 GB, half a decoding step). Greedy tokens
    and logits from the layout equal those of the stacked weights."""
    import dataclasses

    from jaxspec.kernels import kernels_on
    from jaxspec.model import feature_major_layers, greedy_tokens, lm_head, output_matrix

    if not kernels_on():
        pytest.skip("jaxspec's CPU kernels do not run here: no screen, so no rows to keep")
    _, model, _ = tiny_llama3
    cfg, w = model.config, model.weights
    rng = np.random.default_rng(1)
    untied = dataclasses.replace(w, lm_head=jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)) * 0.05,
                                                        jnp.float32))  # [d, V]
    layout = feature_major_layers(untied)
    np.testing.assert_array_equal(np.asarray(layout.head_screen.rows), np.asarray(untied.lm_head).T)
    assert output_matrix(layout) is layout.head_screen.rows
    assert feature_major_layers(dataclasses.replace(w, lm_head=None)).head_screen.rows is None  # tied: the embedding
    x = jnp.asarray(rng.normal(size=(2, 3, cfg.hidden_size)), jnp.float32)  # [B, T, d]
    np.testing.assert_allclose(np.asarray(lm_head(layout, cfg, x)), np.asarray(lm_head(untied, cfg, x)),
                               rtol=1e-5, atol=1e-5)
    step = jax.jit(greedy_tokens, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(step(layout, cfg, x)),
                                  np.argmax(np.asarray(lm_head(untied, cfg, x)), axis=-1))
    d, v = cfg.hidden_size, cfg.vocab_size
    text = step.lower(layout, cfg, x).as_text()
    assert not [line for line in text.splitlines() if "transpose" in line and f"{v}x{d}" in line]


def test_greedy_tokens_with_noise_are_the_argmax_of_the_noisy_float32_logits(tiny_llama3):
    """With noise (temperature x Gumbel noise: a draw at that temperature) the screened path gives the argmax of the
    float32 logits + noise, certified or not (an error bound too wide to certify anything), as the path without a
    screen does; noise that flips the winner is followed."""
    from jaxspec.model import greedy_tokens, head_screen, lm_head
    from jaxspec.sampling import SamplingConfig, gumbel_noise

    _, model, _ = tiny_llama3
    cfg, w = model.config, model.weights
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, cfg.hidden_size)), jnp.float32)  # [B, T, d]
    logits = np.asarray(lm_head(w, cfg, x))  # [B, T, V]
    screen = head_screen(w)
    step = jax.jit(greedy_tokens, static_argnums=1)
    for i, temperature in enumerate((0.3, 1.0, 4.0)):
        noise = gumbel_noise(jax.random.key(i), logits.shape, SamplingConfig(temperature=temperature))  # [B, T, V]
        expected = np.argmax(logits + np.asarray(noise), axis=-1)  # [B, T]
        for use in (None, screen, dataclasses.replace(screen, error=jnp.float32(1e6))):
            got = step(dataclasses.replace(w, head_screen=use), cfg, x, noise)
            np.testing.assert_array_equal(np.asarray(got), expected)
    flip = np.zeros(logits.shape, np.float32)
    flip[0, 0, 7] = logits[0, 0].max() - logits[0, 0, 7] + 1.0  # token 7 now leads position (0, 0) by one logit
    got = step(dataclasses.replace(w, head_screen=screen), cfg, x, jnp.asarray(flip))
    assert int(got[0, 0]) == 7 and np.array_equal(np.asarray(got)[1], np.argmax(logits, axis=-1)[1])


def test_greedy_tokens_on_smollm2_certify_the_argmax_along_a_real_answer(smollm2, smollm2_reference):
    """On SmolLM2's real output matrix (49,152 tokens, tied): the screen's error bound is tight enough that most
    positions of a real answer are certified from the bfloat16 copy, and every position's token is the float32
    argmax."""
    from jaxspec.model import SCREEN_CANDIDATES, greedy_tokens, head_screen, lm_head, rms_norm

    cfg, w = smollm2.config, smollm2.weights
    ids = np.concatenate([smollm2_reference["prompt_ids_0"].reshape(-1), smollm2_reference["greedy_0"].reshape(-1)])
    x = forward(w, cfg, jnp.asarray(ids[None]), jnp.arange(len(ids), dtype=jnp.int32)[None],
                compute_logits=False).last_hidden  # [1, L, d]
    screened = dataclasses.replace(w, head_screen=head_screen(w))
    step = jax.jit(greedy_tokens, static_argnums=1)
    got = np.concatenate([np.asarray(step(screened, cfg, x[:, i: i + 8]))[0] for i in range(0, len(ids) - 7, 8)])
    logits = np.asarray(lm_head(w, cfg, x))[0]  # [L, V]
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1)[: len(got)])
    h = np.asarray(rms_norm(x, w.final_norm, cfg.rms_norm_eps))[0]  # [L, d]
    margin = float(screened.head_screen.error) * np.linalg.norm(h, axis=1)  # [L]
    ranked = np.sort(logits, axis=1)
    gap = ranked[:, -1] - ranked[:, -1 - SCREEN_CANDIDATES]  # best against the first token left out
    assert np.mean(gap > 2 * margin) > 0.9, (np.median(margin), np.median(gap))


def test_rows_of_a_batch_are_independent(tiny):
    """A row's logits do not depend on the other rows (their lengths, their padding)."""
    _, model, ref = tiny
    cfg, w = model.config, model.weights
    ids = jnp.asarray(ref["input_ids"])
    cache = init_cache(cfg, 2, 64)
    lengths = jnp.array([12, 33], jnp.int32)
    last, _, _ = prefill(w, cfg, ids[:, :33], lengths, cache)
    for row, n in enumerate((12, 33)):
        alone = forward(w, cfg, ids[row:row + 1, :n], _positions(ids[row:row + 1, :n])).logits[0, -1]
        np.testing.assert_allclose(np.asarray(last[row]), np.asarray(alone), atol=1e-4)


def _abstract_weights(cfg: ModelConfig, dtype=jnp.bfloat16) -> Weights:
    from jaxspec.model import LayerWeights

    L, d, f, h, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    hq, hk = cfg.num_heads, cfg.num_kv_heads

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layers = LayerWeights(
        attn_norm=s(L, d), wq=s(L, d, hq, h), wk=s(L, d, hk, h), wv=s(L, d, hk, h), wo=s(L, hq, h, d),
        mlp_norm=s(L, d), w_gate=s(L, d, f), w_up=s(L, d, f), w_down=s(L, f, d),
        q_norm=s(L, h) if cfg.qk_norm else None, k_norm=s(L, h) if cfg.qk_norm else None,
    )
    return Weights(embed=s(v, d), layers=layers, final_norm=s(d), lm_head=None if cfg.tie_word_embeddings else s(d, v))


@pytest.mark.parametrize("cfg", [LLAMA3_8B, QWEN3_8B], ids=["llama3-8b", "qwen3-8b"])
def test_full_size_configs_trace_without_memory(cfg):
    """jax.eval_shape of prefill + decode for Llama-3-8B and Qwen3-8B (no weights are allocated)."""
    weights = _abstract_weights(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 1024, jnp.bfloat16))
    tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    last, _, cache = jax.eval_shape(lambda w, t, n, c: prefill(w, cfg, t, n, c), weights, tokens, lengths, cache)
    assert last.shape == (2, cfg.vocab_size) and cache.k.shape == (cfg.num_layers, 2, 8, 1024, 128)
    logits, _ = jax.eval_shape(
        lambda w, t, c: decode_step(w, cfg, t, c, jnp.ones(2, bool)), weights,
        jax.ShapeDtypeStruct((2,), jnp.int32), cache)
    assert logits.shape == (2, cfg.vocab_size)


def test_config_round_trips_through_hf_dict(tiny):
    name, model, _ = tiny
    for cfg in (model.config, LLAMA3_8B, QWEN3_8B):
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert ModelConfig.from_hf_config(f"tests/fixtures/tiny-{name}") == model.config


def test_configs_read_from_files(tiny, smollm2):
    name, model, _ = tiny
    cfg = model.config
    if name == "qwen2":
        assert cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    if name == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    if name == "llama3":
        assert cfg.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position=64)
    s = smollm2.config
    assert (s.architecture, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert s.tie_word_embeddings and s.rope_theta == 1e5 and s.vocab_size == 49152 and s.eos_token_ids == (2,)


def test_prefill_mask_is_causal():
    mask = causal_mask(1, 3)[0]
    np.testing.assert_array_equal(np.asarray(mask), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_bfloat16_weights_run(tiny):
    _, model, ref = tiny
    w16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.weights)
    ids = jnp.asarray(ref["input_ids"])
    logits = forward(w16, model.config, ids, _positions(ids)).logits
    assert logits.dtype == jnp.float32
    agree = np.mean(np.asarray(logits).argmax(-1) == ref["logits"].argmax(-1))
    assert agree > 0.8, agree




def test_unstacked_layers_compute_the_stacked_forward(tiny_llama3, monkeypatch):
    """The CPU layout (per-layer buffers, 2-4 rows as separate matrix-vector products) gives the scan's logits,
    hidden states and cache entries for 1 to 15 rows x tokens (both sides of ROWWISE_MAX_ROWS), over a stacked or a
    per-layer cache (causal and tree masks), a layer range, and the same greedy generation."""
    import dataclasses

    from jaxspec.model import LAYERS_ENV, FeatureMajorLayer, execution_weights, feature_major_layers, unstack_layers

    _, model, ref = tiny_llama3
    w, cfg = model.weights, model.config
    unstacked = unstack_layers(w)
    assert isinstance(unstacked.layers, tuple) and len(unstacked.layers) == cfg.num_layers
    feature_major = feature_major_layers(w)  # the CPU layout: matrices [out, in], activations [d, N]
    assert all(isinstance(lw, FeatureMajorLayer) for lw in feature_major.layers)
    run = jax.jit(forward, static_argnames=("cfg", "hidden_layers", "layer_range", "compute_logits"))
    for b, t in ((1, 1), (1, 3), (2, 2), (3, 5)):
        cache = dataclasses.replace(init_cache(cfg, b, 32), lengths=jnp.arange(3, 3 + b, dtype=jnp.int32))
        tokens = (jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) * 7 + 1) % cfg.vocab_size  # [B, T]
        positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
        layers = (0, cfg.num_layers - 1)
        a = run(w, cfg, tokens, positions, cache, causal_mask(b, t), hidden_layers=layers)
        for layout in (unstacked, feature_major):
            u = run(layout, cfg, tokens, positions, cache, causal_mask(b, t), hidden_layers=layers)
            for x, y in ((a.logits, u.logits), (a.hidden, u.hidden), (a.cache.k, u.cache.k), (a.cache.v, u.cache.v)):
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5, err_msg=f"B={b} T={t}")
        # a per-layer cache (random committed entries): each layer attends over its own buffer, then writes its
        # entries into it (in place); 32 and 192 slots, rows at 3-5 and 60-62 tokens
        tree = causal_mask(b, t).at[:, t - 1, 0].set(t < 3)  # [B, T, T]: the last node's parent skips the first
        for mask, slots, start in ((causal_mask(b, t), 32, 3), (tree, 32, 3), (causal_mask(b, t), 192, 60),
                                   (tree, 192, 60)):
            lengths = jnp.arange(start, start + b, dtype=jnp.int32)  # [B]
            shape = init_cache(cfg, b, slots).k.shape  # [L, B, Hkv, S, h]: random committed entries
            keys, values = (jnp.asarray(np.random.default_rng(i).normal(size=shape), jnp.float32) for i in (1, 2))
            stacked = KVCache(k=keys, v=values, lengths=lengths)
            per_layer = KVCache(k=tuple(keys), v=tuple(values), lengths=lengths)
            at = lengths[:, None] + jnp.arange(t)  # [B, T]
            s = run(w, cfg, tokens, at, stacked, mask, hidden_layers=layers)
            p = run(feature_major, cfg, tokens, at, per_layer, mask, hidden_layers=layers)
            assert isinstance(p.cache.k, tuple) and len(p.cache.k) == cfg.num_layers
            for x, y in ((s.logits, p.logits), (s.hidden, p.hidden), (s.cache.k, jnp.stack(p.cache.k)),
                         (s.cache.v, jnp.stack(p.cache.v))):
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5, err_msg=f"B={b} T={t}")
        part = run(unstacked, cfg, tokens, positions, cache, causal_mask(b, t), layer_range=(0, 1),
                   compute_logits=False)
        np.testing.assert_allclose(np.asarray(part.last_hidden), np.asarray(a.hidden[0]), rtol=1e-5, atol=1e-5)
    prompts = [ref["input_ids"][0, :5].tolist(), ref["input_ids"][0, :9].tolist()]
    plain = generate(w, cfg, prompts, max_new_tokens=6, eos_ids=())
    assert execution_weights(w) is w  # stacked unless asked
    monkeypatch.setenv(LAYERS_ENV, "unstacked")
    assert isinstance(execution_weights(w).layers, tuple) == (jax.default_backend() == "cpu")
    assert generate(w, cfg, prompts, max_new_tokens=6, eos_ids=()).token_ids == plain.token_ids


@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_over_a_per_layer_cache_copies_no_cache_buffer(tiny_llama3, batch):
    """The decoding loop over per-layer weights writes each layer's cache buffers in place: its compiled program holds
    no copy of a buffer. (At batch 1 XLA copied every buffer two or three times a step when the write was unordered
    with the attention's read, or fused into both of its users: 5.6 of 33 ms a SmolLM2 step; cpu-performance.md.)"""
    import re

    from jaxspec.generate import generate_tokens
    from jaxspec.model import feature_major_layers

    _, model, _ = tiny_llama3
    cfg, slots = model.config, 96
    weights = feature_major_layers(model.weights)
    tokens = jnp.ones((batch, 8), jnp.int32)  # [B, 8]
    lengths = jnp.full((batch,), 5, jnp.int32)  # [B]
    hlo = generate_tokens.lower(weights, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=4,
                                cache_size=slots).compile().as_text()
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))  # the while loops' body computations
    loop = "\n".join(block for block in hlo.split("\n\n") if re.match(r"%([\w.\-]+) ", block)
                     and re.match(r"%([\w.\-]+) ", block).group(1) in bodies)
    buffer = rf"f32\[{batch},{cfg.num_kv_heads},{slots},{cfg.head_dim}\]"  # one layer's keys or values
    assert re.search(buffer, loop), "no loop body carries a per-layer cache buffer: the check would pass vacuously"
    copies = re.findall(rf"= {buffer}\S* copy\(", loop)
    assert not copies, f"{len(copies)} copies of a cache buffer in the compiled decoding loop's body"


def test_the_two_expert_paths_agree_and_only_chosen_experts_count():
    """Qwen3-MoE's gathered path (few token-expert pairs) and grouped path (many) give the same output; an expert
    no token chose can change without changing it."""
    import dataclasses

    from jaxspec import load_model
    from jaxspec.model import mixture_of_experts

    model = load_model("tests/fixtures/tiny-qwen3moe", with_tokenizer=False)
    cfg = model.config
    lw = jax.tree.map(lambda w: w[0], model.weights.layers)  # layer 0
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, cfg.hidden_size)), jnp.float32)  # [B, T, d]
    gathered = mixture_of_experts(cfg, x, lw, grouped=False)
    grouped = mixture_of_experts(cfg, x, lw, grouped=True)
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(grouped), atol=1e-5)
    scores = np.einsum("btd,de->bte", np.asarray(x), np.asarray(lw.router))  # [B, T, E]
    chosen = set(np.argsort(-scores, axis=-1)[..., :cfg.num_experts_per_tok].reshape(-1).tolist())
    unused = sorted(set(range(cfg.num_experts)) - chosen)
    assert unused, "every expert was chosen: pick fewer tokens"
    changed = dataclasses.replace(lw, expert_down=lw.expert_down.at[unused[0]].set(1.0))
    for path in (False, True):
        np.testing.assert_array_equal(np.asarray(mixture_of_experts(cfg, x, changed, grouped=path)),
                                      np.asarray(gathered if not path else grouped))


def test_qwen3_moe_gguf_equals_its_folder():
    """The tiny Qwen3-MoE written as llama.cpp lays out a qwen3moe GGUF (read back by transformers to the folder's
    logits when the fixture was made) loads to the same config and logits as the folder."""
    from jaxspec import load_model

    folder, gguf = (load_model(f"tests/fixtures/tiny-qwen3moe{ext}", with_tokenizer=False) for ext in ("", ".gguf"))
    assert gguf.config.num_experts == folder.config.num_experts == 8 and gguf.config.norm_topk_prob
    ref = np.load("tests/fixtures/tiny_qwen3moe_reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    np.testing.assert_allclose(np.asarray(forward(gguf.weights, gguf.config, ids, _positions(ids)).logits),
                               ref["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_gguf_written_by_llama_cpp_equals_its_folder(name):
    """The tiny Qwen3.5 and Qwen3.5-MoE converted by llama.cpp's own convert_hf_to_gguf.py (value heads tiled, A_log
    stored as -exp(A_log), norms + 1, experts stacked, llama.cpp's tensor names; no vocabulary) load to their
    folder's config, weights and transformers' logits. Their full_attention_interval says 4 (the converter's
    default) where the layers are linear, linear, attention: the layer kinds come from the tensors."""
    import dataclasses

    from jaxspec import load_model

    folder = load_model(f"tests/fixtures/tiny-{name}", with_tokenizer=False)
    gguf = load_model(f"tests/fixtures/tiny-{name}.gguf")  # a file without a vocabulary: no tokenizer, no error
    assert gguf.tokenizer is None
    assert gguf.config.rms_norm_eps == pytest.approx(folder.config.rms_norm_eps)  # stored as float32 in the file
    assert dataclasses.replace(gguf.config, rms_norm_eps=folder.config.rms_norm_eps) == folder.config
    for a, b in zip(jax.tree.leaves(gguf.weights), jax.tree.leaves(folder.weights), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)  # A_log through -exp and back: 6e-8
    ref = np.load(f"tests/fixtures/tiny_{name}_reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    np.testing.assert_allclose(np.asarray(forward(gguf.weights, gguf.config, ids, _positions(ids)).logits),
                               ref["logits"], atol=1e-4, rtol=1e-4)


def test_qwen3_moe_with_dense_layers_is_refused_by_name():
    import json

    from jaxspec.errors import UserError

    with open("tests/fixtures/tiny-qwen3moe/config.json") as f:
        raw = json.load(f)
    with pytest.raises(UserError, match="mlp_only_layers=\\[1\\]"):
        ModelConfig.from_hf_dict({**raw, "mlp_only_layers": [1]})


def test_the_parameter_count_is_the_checkpoint_s(tiny):
    """ModelConfig.num_parameters (what `jaxspec plan` and bench_ar's bandwidth bound use) counts exactly the
    tensors transformers saved for each tiny architecture: attention with biases, norms and output gates, experts
    and the shared one, Gated DeltaNet layers, a tied or untied output."""
    from conftest import fixture_path
    from safetensors import safe_open

    name, model, _ = tiny
    with safe_open(fixture_path(f"tiny-{name}") + "/model.safetensors", "numpy") as f:
        saved = sum(int(np.prod(f.get_slice(key).get_shape())) for key in f.keys())
    assert model.config.num_parameters() == saved
