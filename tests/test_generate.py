"""Autoregressive generation: batches of ragged prompts, EOS, streaming, sampling, no recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path

from jaxspec.errors import UserError
from jaxspec.generate import (
    PAD,
    _take_similar_prompts,
    continuous_generate,
    generate,
    generate_tokens,
    pad_prompts,
    stream_generate,
)
from jaxspec.loading import load_model
from jaxspec.sampling import SamplingConfig, process_logits, sample_token


def _prompts(ref):
    ids = ref["input_ids"]
    return [ids[0, :5].tolist(), ids[1, :17].tolist(), ids[0, 3:40].tolist()]


def test_batch_rows_equal_single_rows(tiny_llama3):
    """Each row of a ragged batch decodes exactly as it would alone."""
    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    batched = generate(model.weights, model.config, prompts, max_new_tokens=12, eos_ids=())
    for row, prompt in enumerate(prompts):
        alone = generate(model.weights, model.config, [prompt], max_new_tokens=12, eos_ids=())
        assert batched.token_ids[row] == alone.token_ids[0]


def test_eos_stops_each_row_on_its_own(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    free = generate(model.weights, model.config, prompts, max_new_tokens=12, eos_ids=())
    eos = free.token_ids[1][4]  # row 1 reaches this token at step 4
    stopped = generate(model.weights, model.config, prompts, max_new_tokens=12, eos_ids=(eos,))
    for row in range(len(prompts)):
        full = free.token_ids[row]
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert stopped.token_ids[row] == expected
    assert len(stopped.token_ids[1]) <= 5


def test_stream_yields_the_same_tokens_as_generate(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)):
        whole = generate(model.weights, model.config, prompts, max_new_tokens=10, sampling=sampling, seed=3,
                         eos_ids=())
        steps = np.stack(list(stream_generate(model.weights, model.config, prompts, max_new_tokens=10,
                                              sampling=sampling, seed=3, eos_ids=())), axis=1)
        assert [row.tolist() for row in steps] == whole.token_ids


def test_sampling_is_reproducible_and_seed_dependent(tiny_llama3):
    _, model, ref = tiny_llama3
    prompts = _prompts(ref)
    sampling = SamplingConfig(temperature=1.0)
    a = generate(model.weights, model.config, prompts, max_new_tokens=16, sampling=sampling, seed=1, eos_ids=())
    b = generate(model.weights, model.config, prompts, max_new_tokens=16, sampling=sampling, seed=1, eos_ids=())
    c = generate(model.weights, model.config, prompts, max_new_tokens=16, sampling=sampling, seed=2, eos_ids=())
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_no_recompilation_across_prompts_and_steps(tiny_llama3):
    """One compilation serves prompts of different lengths (same bucket) and every decoding step."""
    _, model, ref = tiny_llama3
    ids = ref["input_ids"]
    generate(model.weights, model.config, [ids[0, :7].tolist()], max_new_tokens=9, eos_ids=())
    before = generate_tokens._cache_size()
    generate(model.weights, model.config, [ids[1, :30].tolist()], max_new_tokens=9, eos_ids=())
    generate(model.weights, model.config, [ids[0, :2].tolist()], max_new_tokens=9, eos_ids=())
    assert generate_tokens._cache_size() == before


def test_one_compilation_per_kind_of_sampling(tiny_llama3):
    """Temperature, top-k and top-p values are traced: a sweep over them reuses one compiled loop (greedy, top-k
    on/off and top-p on/off are the structure), and each value still means what it says (a different
    distribution)."""
    _, model, ref = tiny_llama3
    prompt = [ref["input_ids"][0, :7].tolist()]

    def run(**kw):
        return generate(model.weights, model.config, prompt, max_new_tokens=9, eos_ids=(), seed=3,
                        sampling=SamplingConfig(**kw)).token_ids

    run(temperature=0.7, top_p=0.9)
    before = generate_tokens._cache_size()
    hot, cold = run(temperature=5.0, top_p=0.95), run(temperature=1e-3, top_p=0.9)
    assert generate_tokens._cache_size() == before
    greedy = generate(model.weights, model.config, prompt, max_new_tokens=9, eos_ids=()).token_ids
    assert cold == greedy and hot != greedy  # near-zero temperature is the argmax; a hot one is not
    run(temperature=5.0, top_k=50)
    before = generate_tokens._cache_size()
    top1, wide = run(temperature=5.0, top_k=1), run(temperature=5.0, top_k=200)
    assert generate_tokens._cache_size() == before
    assert top1 == greedy and wide != greedy  # top-1 is the argmax at any temperature


def test_generation_pads_after_eos_and_counts(tiny_llama3):
    _, model, ref = tiny_llama3
    batch = pad_prompts(_prompts(ref), 8, model.config)
    free, _ = generate_tokens(model.weights, model.config, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                              jax.random.key(0), max_new_tokens=8, cache_size=batch.cache_size)
    eos = int(free[0, 2])
    out, counts = generate_tokens(model.weights, model.config, jnp.asarray(batch.tokens),
                                  jnp.asarray(batch.lengths), jax.random.key(0), max_new_tokens=8,
                                  cache_size=batch.cache_size, eos_ids=(eos,))
    first = list(np.asarray(out[0])).index(eos)
    assert counts[0] == first + 1 and np.all(np.asarray(out[0, first + 1:]) == PAD)


def test_prompt_widths_step_by_32_from_64(tiny_llama3):
    """The prefill computes every padded position: short prompts share the 64-token width, longer ones are padded to
    the next multiple of 32 (an 88-token prompt costs 96 positions, not 128), and every row keeps its length."""
    _, model, _ = tiny_llama3
    for longest, width in ((1, 64), (64, 64), (65, 96), (88, 96), (96, 96), (97, 128), (129, 160)):
        batch = pad_prompts([[7] * longest, [5] * 3], 4, model.config)
        assert batch.tokens.shape == (2, width) and batch.lengths.tolist() == [longest, 3]
        assert batch.cache_size % 128 == 0 and batch.cache_size >= width + 4


def test_prompt_too_long_for_the_cache_is_a_clear_error(tiny_llama3):
    _, model, ref = tiny_llama3
    with pytest.raises(UserError, match="cache slots"):
        pad_prompts([list(range(40))], 30, model.config, max_cache_length=64)
    with pytest.raises(UserError, match="empty"):
        pad_prompts([[]], 4, model.config)


# ---------------------------------------------------------------------------------------------- sampling rules


def _reference_probs(logits, temperature, top_k, top_p):
    """numpy: the HF-style warpers (temperature, then top-k, then top-p keeping the smallest set >= top_p)."""
    z = logits / temperature
    if top_k:
        z = np.where(z < np.sort(z)[::-1][top_k - 1], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        keep = np.zeros_like(p, bool)
        mass = 0.0
        for i in order:
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.9, 4, 0.6)])
def test_process_logits_matches_reference_rules(temperature, top_k, top_p):
    logits = np.array([2.0, 1.5, 0.3, -1.0, 0.9, 1.1, -0.2, 0.0], np.float32)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.exp(np.asarray(process_logits(jnp.asarray(logits), sampling)))
    np.testing.assert_allclose(got, _reference_probs(logits.astype(np.float64), temperature, top_k, top_p), atol=1e-6)


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = jnp.array([[0.1, 3.0, -2.0, 2.9]])
    p = np.exp(np.asarray(process_logits(logits, SamplingConfig())))
    np.testing.assert_array_equal(p, [[0, 1, 0, 0]])
    assert int(sample_token(jax.random.key(0), logits, SamplingConfig())[0]) == 1


def test_samples_follow_the_distribution():
    """20k draws: every token's frequency within 5 standard errors of p (a check that can fail)."""
    logits = jnp.array([1.0, 0.2, -0.5, 2.0, 0.0])
    sampling = SamplingConfig(temperature=0.9, top_k=4)
    p = _reference_probs(np.asarray(logits, np.float64), 0.9, 4, 1.0)
    n = 20000
    draws = jax.vmap(lambda k: sample_token(k, logits[None], sampling)[0])(jax.random.split(jax.random.key(0), n))
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    sigma = np.sqrt(p * (1 - p) / n) + 1e-12
    assert np.all(np.abs(freq - p) <= 5 * sigma), (freq, p)
    assert freq[np.argmin(p)] == 0.0  # the token top-k removed never appears


@pytest.mark.parametrize("size", [5, 256, 700])  # one block; exactly one full block; two full blocks and a part
def test_sample_from_is_the_inverse_cdf_of_its_input(size):
    """The two-level search (block masses, then the block's own running sum) picks, for every uniform, the token
    numpy's float64 inverse CDF picks (away from the breakpoints themselves, where float32 rounding may go either
    way); zero-mass tokens are never picked, even at a uniform just below 1 after trailing zeros."""
    from jaxspec.sampling import sample_from

    rng = np.random.default_rng(size)
    probs = rng.random(size) ** 3 * (rng.random(size) < 0.7)  # [V], about 30% zeros, unnormalised
    probs[-min(size // 3, 200):] = 0.0  # trailing zeros (at 700: the last, partial block holds no mass)
    probs[0], probs[1] = 0.0, 0.5
    cdf = np.cumsum(probs) / probs.sum()  # float64
    uniforms = np.concatenate([rng.random(4000), [0.0, 1 - 2 ** -24]])
    expected = np.minimum(np.searchsorted(cdf, uniforms, side="right"), np.flatnonzero(probs)[-1])
    got = np.asarray(jax.jit(jax.vmap(sample_from, in_axes=(None, 0)))(jnp.asarray(probs, jnp.float32),
                                                                       jnp.asarray(uniforms, jnp.float32)))
    near = np.min(np.abs(uniforms[:, None] - cdf[None, :]), axis=1) < 1e-5  # [N] too close to a breakpoint
    np.testing.assert_array_equal(got[~near], expected[~near])
    assert np.all(probs[got] > 0)
    assert got[-1] == np.flatnonzero(probs)[-1] and got[-2] == np.flatnonzero(probs)[0]


def test_sample_categorical_draws_the_inverse_cdf_of_one_uniform_per_row():
    """sample_categorical is sample_from on exp(log p) with the row's uniform from the key: the same draws, row by
    row, for a [2, 3] batch of rows (frequencies are checked by test_samples_follow_the_distribution)."""
    from jaxspec.sampling import sample_categorical, sample_from

    log_p = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (2, 3, 300)) * 2)  # [2, 3, V]
    key = jax.random.key(5)
    got = sample_categorical(key, log_p)  # [2, 3]
    uniforms = jax.random.uniform(key, (2, 3))
    by_row = [[int(sample_from(jnp.exp(log_p[i, j]), uniforms[i, j])) for j in range(3)] for i in range(2)]
    assert got.shape == (2, 3) and np.asarray(got).tolist() == by_row


def test_bad_sampling_settings_are_clear_errors():
    for kwargs in ({"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(UserError):
            SamplingConfig(**kwargs)


# ---------------------------------------------------------------------------------------------- continuous batching


def _ragged_prompts(vocab: int, count: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, n).tolist() for n in rng.integers(1, 70, count)]  # both prompt widths (64, 96)


@pytest.mark.parametrize("name,layers", [("llama3", "stacked"), ("llama3", "unstacked"), ("qwen3_5", "stacked")])
def test_continuous_batching_answers_like_generate_row_by_row(name, layers, monkeypatch):
    """More prompts than rows, answers of different lengths (an EOS some rows reach early): every prompt is answered
    once, with the tokens and the saved features of a batch-1 `generate` of it alone."""
    monkeypatch.setenv("JAXSPEC_LAYERS", layers)
    model = load_model(fixture_path(f"tiny-{name}"))
    cfg, last = model.config, model.config.num_layers - 1
    prompts = _ragged_prompts(cfg.vocab_size)
    alone = [generate(model.weights, cfg, [p], max_new_tokens=9, eos_ids=(), hidden_layers=(0, last))
             for p in prompts]
    eos = alone[2].token_ids[0][3]  # prompt 2 ends at its 4th token; others run to 9 tokens or stop where they meet it
    answers = list(continuous_generate(model.weights, cfg, prompts, max_new_tokens=9, batch_size=3, eos_ids=(eos,),
                                       hidden_layers=(0, last), steps_per_sync=2, start_group=2))
    assert sorted(i for i, _, _ in answers) == list(range(len(prompts)))
    lengths = set()
    for index, tokens, features in answers:
        full = alone[index].token_ids[0]
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert tokens == expected, index
        lengths.add(len(tokens))
        fed = len(prompts[index]) + len(tokens) - 1
        reference = alone[index].features[0][:, :fed].astype(np.float32)  # [2, fed, d]
        assert features.shape == reference.shape
        # bfloat16 keeps 8 significant bits (rtol 2^-7); the batch-3 and batch-1 programs sum in different orders in
        # float32, which moves a value by a few float32 ulps of the largest terms summed (about 1e-6 at these
        # magnitudes), so an element near zero can differ by more than 2^-7 of itself: atol covers that, 1e-5
        # (before the LM head's 3-row product changed XLA's fusions of the batch-3 hybrid program, one element of
        # 8,960 at 3.4e-5 differed by 1.4e-6; the features themselves are of order 0.1-1)
        np.testing.assert_allclose(features.astype(np.float32), reference, rtol=2 ** -7, atol=1e-5)
    assert len(lengths) > 1  # rows did finish at different steps, so rows were refilled mid-run


def test_a_prefill_group_takes_the_oldest_prompt_and_its_nearest_lengths():
    lengths = [100, 30, 200, 95, 250, 104, 100, 40]
    waiting = list(range(len(lengths)))
    assert _take_similar_prompts(waiting, lengths, 3, window=6) == [0, 5, 3]  # 104 and 95 of 30, 200, 95, 250, 104
    assert waiting == [1, 2, 4, 6, 7]
    assert _take_similar_prompts(waiting, lengths, 3, window=3) == [1, 2, 4]  # only the next two in the window
    assert _take_similar_prompts(waiting, lengths, 5, window=8) == [6, 7]  # fewer left than asked
    assert waiting == []


def test_continuous_batching_samples_do_not_depend_on_the_batch(tiny_llama3):
    _, model, _ = tiny_llama3
    prompts = _ragged_prompts(model.config.vocab_size, 5)
    sampling = SamplingConfig(temperature=1.0)

    def run(batch_size, seed):
        return dict((i, t) for i, t, _ in continuous_generate(model.weights, model.config, prompts, max_new_tokens=8,
                                                              batch_size=batch_size, sampling=sampling, seed=seed,
                                                              eos_ids=(), steps_per_sync=3))

    two, five = run(2, 1), run(5, 1)
    assert two == five and len(two) == len(prompts)
    assert run(2, 2) != two


def test_continuous_batching_refuses_a_prompt_that_does_not_fit(tiny_llama3):
    _, model, _ = tiny_llama3
    with pytest.raises(UserError, match="cache slots"):
        next(continuous_generate(model.weights, model.config, [[1, 2], [1] * 5000], max_new_tokens=8))
